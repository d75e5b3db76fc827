/* heap_limit: grows memory the ways programs and language runtimes do, writes every word,
 * checks every word, and reports the most anonymous memory the process held resident
 * (RssAnon in /proc/self/status, sampled after every step).
 *
 * Usage: heap_limit WAY MiB
 *   realloc      one block grown by realloc in 16 MiB steps to MiB (grows in place)
 *   realloc2     two blocks grown in turn, so each step moves one of them
 *   mremap       a private anonymous mapping grown by mremap(MREMAP_MAYMOVE) in 16 MiB steps
 *   reserve      a PROT_NONE reservation of MiB committed about 16 MiB at a time (a
 *                prime number of pages, so that the committed part ends inside fault-around
 *                windows) by mmap(MAP_FIXED, read-write), as HotSpot and Go commit their
 *                heaps; then
 *                the first half is uncommitted by mmap(MAP_FIXED, PROT_NONE) and
 *                committed again, and must read as zeros
 *   mprotect     the same committed by mprotect(read-write), as V8 does;
 *                then the first half is decommitted (madvise(MADV_DONTNEED), mprotect
 *                PROT_NONE) and committed again, and must read as zeros
 * Prints "ok WAY MiB peak-rss-anon-mib N" and exits 0, or names the first wrong word and
 * exits 1. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define STEP ((size_t)16 << 20)

static long peak_kib;

static void sample(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    if (!f) { perror("/proc/self/status"); exit(2); }
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "RssAnon:", 8)) {
            long kib = atol(line + 8);
            if (kib > peak_kib) peak_kib = kib;
        }
    fclose(f);
}

static uint64_t word(size_t i, int k) { return (i + 1) * 0x9e3779b97f4a7c15ull ^ (uint64_t)k << 56; }

static void fill(uint64_t *p, size_t from, size_t to, int k) {
    for (size_t i = from / 8; i < to / 8; i++) p[i] = word(i, k);
}

static void check(const uint64_t *p, size_t from, size_t to, int k, const char *what) {
    for (size_t i = from / 8; i < to / 8; i++)
        if (p[i] != word(i, k)) {
            printf("%s: word %zu of block %d is 0x%016llx, not 0x%016llx\n", what, i, k,
                   (unsigned long long)p[i], (unsigned long long)word(i, k));
            exit(1);
        }
}

static void check_zero(const uint64_t *p, size_t len, const char *what) {
    for (size_t i = 0; i < len / 8; i++)
        if (p[i]) {
            printf("%s: word %zu is 0x%016llx after it was uncommitted, not zero\n", what, i,
                   (unsigned long long)p[i]);
            exit(1);
        }
}

static void *must(void *p, const char *what) {
    if (p == MAP_FAILED || p == NULL) { perror(what); exit(2); }
    return p;
}

static void grow_realloc(size_t total, int blocks) {
    uint64_t *p[2] = {0, 0};
    for (size_t n = 0; n < total; n += STEP) {
        for (int k = 0; k < blocks; k++) {
            p[k] = must(realloc(p[k], n + STEP), "realloc");
            fill(p[k], n, n + STEP, k);
        }
        sample();
    }
    for (int k = 0; k < blocks; k++) check(p[k], 0, total, k, "realloc");
    for (int k = 0; k < blocks; k++) free(p[k]);
}

static void grow_mremap(size_t total) {
    uint64_t *p = must(mmap(NULL, STEP, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                            -1, 0), "mmap");
    /* A mapping right after it keeps it from growing in place. */
    void *blocker = must(mmap((char *)p + STEP, 4096, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS, -1, 0), "mmap");
    fill(p, 0, STEP, 0);
    for (size_t n = STEP; n < total; n += STEP) {
        p = must(mremap(p, n, n + STEP, MREMAP_MAYMOVE), "mremap");
        fill(p, n, n + STEP, 0);
        sample();
    }
    check(p, 0, total, 0, "mremap");
    munmap(p, total);
    munmap(blocker, 4096);
}

static void commit(char *base, size_t from, size_t to, int by_mprotect) {
    if (by_mprotect) {
        if (mprotect(base + from, to - from, PROT_READ | PROT_WRITE)) { perror("mprotect"); exit(2); }
    } else {
        must(mmap(base + from, to - from, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0), "mmap(MAP_FIXED)");
    }
}

static void uncommit(char *base, size_t len, int by_mprotect) {
    if (by_mprotect) {
        if (madvise(base, len, MADV_DONTNEED) || mprotect(base, len, PROT_NONE)) {
            perror("madvise/mprotect"); exit(2);
        }
    } else {
        must(mmap(base, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                  -1, 0), "mmap(PROT_NONE, MAP_FIXED)");
    }
}

static void grow_reserved(size_t total, int by_mprotect) {
    const char *what = by_mprotect ? "mprotect" : "reserve";
    char *base = must(mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                           -1, 0), "mmap(PROT_NONE)");
    /* Pieces of a prime number of pages: their ends fall inside fault-around windows. */
    const size_t piece = 4093 * 4096;
    for (size_t n = 0; n < total; n += piece) {
        size_t end = n + piece < total ? n + piece : total;
        commit(base, n, end, by_mprotect);
        fill((uint64_t *)base, n, end, 0);
        sample();
    }
    check((uint64_t *)base, 0, total, 0, what);
    size_t half = total / 2 / STEP * STEP;
    uncommit(base, half, by_mprotect);
    sample();
    commit(base, 0, half, by_mprotect);
    check_zero((uint64_t *)base, half, what);
    check((uint64_t *)base, half, total, 0, what);
    munmap(base, total);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: heap_limit realloc|realloc2|mremap|reserve|mprotect MiB\n");
        return 2;
    }
    const char *way = argv[1];
    size_t total = (size_t)atol(argv[2]) << 20;
    if (total < 2 * STEP) { fprintf(stderr, "heap_limit: MiB must be at least 32\n"); return 2; }
    total = total / STEP * STEP;
    if (!strcmp(way, "realloc")) grow_realloc(total, 1);
    else if (!strcmp(way, "realloc2")) grow_realloc(total, 2);
    else if (!strcmp(way, "mremap")) grow_mremap(total);
    else if (!strcmp(way, "reserve")) grow_reserved(total, 0);
    else if (!strcmp(way, "mprotect")) grow_reserved(total, 1);
    else { fprintf(stderr, "heap_limit: no way named %s\n", way); return 2; }
    sample();
    printf("ok %s %zu peak-rss-anon-mib %ld\n", way, total >> 20, peak_kib >> 10);
    return 0;
}
