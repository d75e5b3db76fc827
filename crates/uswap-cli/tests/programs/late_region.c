/*
 * late_region: memory written before uswap builds a program's region comes through the
 * build, fork and swapping intact. Under `uswap run`, a program's region is built when it
 * first commits more than its start-up allowance (or starts a thread); before that its
 * memory is plain memory. Built and run by crates/uswap-cli/tests/run_programs.rs.
 *
 *   cc -O2 -pthread -o late_region late_region.c
 *   late_region BIG_MIB [thread]
 *
 * 1. Writes a pattern into 600 small blocks and one 1 MiB block, reads a page it never
 *    wrote (the kernel maps its zero page) and lazily frees another (MADV_FREE), and
 *    reports how many userfaultfds the process has (none before the build). With
 *    `thread`, it then starts a thread, which builds the region.
 * 2. Forks. The child checks the pattern, writes its own over it, then fills and checks
 *    BIG_MIB (past the allowance: it builds its region and swaps), then checks its pattern
 *    again; exit 0 only if all matched.
 * 3. The parent checks that its pattern is unchanged, then fills and checks BIG_MIB, checks
 *    the pattern again (swapped out and in by then), writes and checks the page it only
 *    read, checks that the lazily freed page reads as zeros or as it was, and prints
 *    `ok before <n> userfaultfds after <m>`.
 * A mismatch prints where and exits 1; usage and system errors exit 2.
 */
#include <dirent.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define SMALL 600
#define SMALL_BYTES 1000
#define EARLY (1 << 20)

static unsigned char *small[SMALL];
static unsigned char *early;
/* A page only read before the build, and one lazily freed before it. */
static volatile unsigned char *read_only;
static unsigned char *lazy;

static void *nothing(void *arg) { return arg; }

static unsigned char byte_of(uint64_t i, unsigned seed) { return (unsigned char)(i * 131 + seed * 7 + (i >> 12)); }

static void fill(unsigned char *p, size_t n, uint64_t base, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = byte_of(base + i, seed);
}

static int check(const unsigned char *p, size_t n, uint64_t base, unsigned seed, const char *what) {
    for (size_t i = 0; i < n; i++) {
        if (p[i] != byte_of(base + i, seed)) {
            printf("mismatch in %s at byte %zu (seed %u): %u, expected %u\n", what, i, seed, p[i],
                   byte_of(base + i, seed));
            return 1;
        }
    }
    return 0;
}

static void fill_early(unsigned seed) {
    for (int b = 0; b < SMALL; b++) fill(small[b], SMALL_BYTES, (uint64_t)b << 20, seed);
    fill(early, EARLY, 1ull << 40, seed);
}

static int check_early(unsigned seed, const char *when) {
    for (int b = 0; b < SMALL; b++)
        if (check(small[b], SMALL_BYTES, (uint64_t)b << 20, seed, when)) return 1;
    return check(early, EARLY, 1ull << 40, seed, when);
}

/* How many of this process's descriptors are userfaultfds. */
static int userfaultfds(void) {
    DIR *d = opendir("/proc/self/fd");
    if (!d) exit(2);
    int n = 0;
    struct dirent *e;
    char path[300], link[128];
    while ((e = readdir(d))) {
        snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        ssize_t len = readlink(path, link, sizeof link - 1);
        if (len > 0) {
            link[len] = 0;
            n += strstr(link, "userfaultfd") != NULL;
        }
    }
    closedir(d);
    return n;
}

/* Fills and checks `mib` MiB, a page's worth at a time, twice over. */
static int big(size_t mib, unsigned seed) {
    size_t n = mib << 20;
    unsigned char *p = malloc(n);
    if (!p) {
        printf("malloc of %zu MiB failed\n", mib);
        exit(2);
    }
    fill(p, n, 1ull << 44, seed);
    int bad = check(p, n, 1ull << 44, seed, "the big block");
    free(p);
    return bad;
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: late_region BIG_MIB [thread]\n");
        return 2;
    }
    size_t mib = strtoul(argv[1], NULL, 10);
    for (int b = 0; b < SMALL; b++)
        if (!(small[b] = malloc(SMALL_BYTES))) return 2;
    if (!(early = malloc(EARLY))) return 2;
    fill_early(1);
    if (!(read_only = aligned_alloc(4096, 4096)) || !(lazy = aligned_alloc(4096, 4096))) return 2;
    unsigned sum = 0;
    for (int i = 0; i < 4096; i += 64) sum += read_only[i];
    if (sum != 0) {
        printf("a fresh page reads %u\n", sum);
        return 1;
    }
    memset(lazy, 0x5a, 4096);
    if (madvise(lazy, 4096, MADV_FREE) != 0) return 2;
    int before = userfaultfds();
    if (argc == 3) {
        pthread_t t;
        if (pthread_create(&t, NULL, nothing, NULL) != 0 || pthread_join(t, NULL) != 0) return 2;
    }

    pid_t child = fork();
    if (child < 0) return 2;
    if (child == 0) {
        if (check_early(1, "the child's inherited memory")) _exit(1);
        fill_early(2);
        if (big(mib, 3) || check_early(2, "the child's memory after its build")) _exit(1);
        _exit(0);
    }
    int status;
    if (waitpid(child, &status, 0) != child) return 2;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        printf("the child failed (status %#x)\n", status);
        return 1;
    }
    if (check_early(1, "the parent's memory after the child")) return 1;
    if (big(mib, 4) || check_early(1, "the parent's memory after its build")) return 1;
    for (int i = 0; i < 4096; i++) read_only[i] = (unsigned char)i;
    for (int i = 0; i < 4096; i++)
        if (read_only[i] != (unsigned char)i) {
            printf("the page read before the build lost a write at byte %d\n", i);
            return 1;
        }
    for (int i = 0; i < 4096; i++)
        if (lazy[i] != lazy[0] || (lazy[0] != 0 && lazy[0] != 0x5a)) {
            printf("the lazily freed page reads %u at byte %d\n", lazy[i], i);
            return 1;
        }
    printf("ok before %d userfaultfds after %d\n", before, userfaultfds());
    return 0;
}
