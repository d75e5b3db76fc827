/* alloc_api: every allocation entry point uswap run interposes, under memory pressure.
 *
 * Usage: alloc_api SIZE_MIB
 * Fills SIZE_MIB of memory through each path (aligned allocations, malloc_usable_size,
 * reallocarray, mid-size blocks laid out by size class, private anonymous mmap with munmap
 * of a middle part, mremap growing in place and moving, MAP_FIXED over its own mapping),
 * with a pattern per page, and verifies it all after the rest has pushed it out to swap.
 * Prints "ok ..." and exits 0, or names the first failure and exits 1. */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define PAGE 4096UL

static int failures;

static void fail(const char *what, size_t at) {
    if (failures++ == 0) {
        printf("FAILED: %s (offset %zu)\n", what, at);
    }
}

static void fill(unsigned char *p, size_t len, unsigned seed) {
    for (size_t i = 0; i < len; i += 64) {
        p[i] = (unsigned char)(seed * 131 + i / 64);
    }
}

static void check(const char *what, const unsigned char *p, size_t len, unsigned seed) {
    for (size_t i = 0; i < len; i += 64) {
        if (p[i] != (unsigned char)(seed * 131 + i / 64)) {
            fail(what, i);
            return;
        }
    }
}

int main(int argc, char **argv) {
    size_t total = (argc > 1 ? strtoul(argv[1], NULL, 10) : 256) << 20;
    size_t piece = total / 8;

    /* Mid-size blocks made first, before the region is built (they come from an arena),
     * resized and freed once it is (when blocks of their sizes come from slabs). */
    enum { EARLY = 64 };
    unsigned char *early[EARLY];
    for (int i = 0; i < EARLY; i++) {
        early[i] = malloc(1500 + 40 * i);
        if (!early[i]) { fail("early mid-size malloc", i); return 1; }
        fill(early[i], 1500 + 40 * i, 200 + i);
    }

    /* Aligned allocations keep their alignment and their data. */
    void *a = NULL;
    if (posix_memalign(&a, 1 << 16, piece) != 0 || (uintptr_t)a % (1 << 16)) fail("posix_memalign", 0);
    void *b = aligned_alloc(4096, piece);
    if (!b || (uintptr_t)b % 4096) fail("aligned_alloc", 0);
    void *c = memalign(1 << 12, piece);
    if (!c || (uintptr_t)c % 4096) fail("memalign", 0);
    void *v = valloc(3 * PAGE + 1);
    if (!v || (uintptr_t)v % PAGE) fail("valloc", 0);
    if (posix_memalign(&a, 3, 16) != EINVAL) fail("posix_memalign(3) must be EINVAL", 0);
    posix_memalign(&a, 1 << 16, piece);
    fill(a, piece, 1);
    fill(b, piece, 2);
    fill(c, piece, 3);

    /* malloc_usable_size covers the request, and every usable byte is the caller's. */
    for (size_t n = 1; n < 300000; n = n * 3 + 7) {
        unsigned char *p = malloc(n);
        size_t u = malloc_usable_size(p);
        if (!p || u < n) fail("malloc_usable_size", n);
        memset(p, 0xA5, u);
        free(p);
    }
    /* reallocarray refuses an overflowing count and keeps the block. */
    unsigned char *r = malloc(64);
    volatile size_t huge = SIZE_MAX / 2;
    errno = 0;
    if (reallocarray(r, huge, 4) != NULL || errno != ENOMEM) fail("reallocarray overflow", 0);
    r = reallocarray(r, piece / 16, 16);
    if (!r) fail("reallocarray", 0);
    fill(r, piece, 4);

    /* Large blocks: calloc reads zero (also a range freed and handed out again), realloc
     * grows and shrinks them with their data. */
    for (int round = 0; round < 2; round++) {
        unsigned char *z = calloc(piece / 64, 64);
        if (!z) { fail("calloc large", 0); break; }
        for (size_t i = 0; i < piece; i += PAGE / 2) {
            if (z[i]) { fail("calloc large not zero", i); break; }
        }
        memset(z, 0xEE, piece);
        free(z);
    }
    unsigned char *big = malloc(piece / 2);
    fill(big, piece / 2, 7);
    big = realloc(big, piece);
    check("realloc large grown", big, piece / 2, 7);
    fill(big, piece, 7);
    big = realloc(big, piece / 3);
    check("realloc large shrunk", big, piece / 3, 7);
    big = realloc(big, 1000);
    check("realloc large to small", big, 1000, 7);
    free(big);

    /* Mid-size blocks (above 1 KiB, up to 16 KiB) lie as jemalloc's size classes do: a
     * 2000-byte block never crosses a page, a 4000-byte one starts on one, and a quarter of
     * 1500-byte blocks cross one (dlmalloc's back-to-back chunks cross 37% and
     * nearly 100% of the time). A freed block calloc'd again reads zero, realloc carries
     * data between classes, and every block keeps its data through the push below. */
    enum { MIDS = 3000 };
    static unsigned char *mid[MIDS];
    static const size_t mid_sizes[3] = {1500, 2000, 4000};
    size_t crossing = 0;
    for (int i = 0; i < MIDS; i++) {
        size_t n = mid_sizes[i % 3];
        uintptr_t at = (uintptr_t)(mid[i] = malloc(n));
        if (!mid[i] || malloc_usable_size(mid[i]) < n) { fail("mid-size malloc", n); break; }
        if (n == 2000 && at / PAGE != (at + n - 1) / PAGE) fail("a 2000-byte block crosses a page", i);
        if (n == 4000 && at % PAGE) fail("a 4000-byte block does not start a page", i);
        crossing += n == 1500 && at / PAGE != (at + n - 1) / PAGE;
        fill(mid[i], n, 11 + i);
    }
    /* A quarter, exactly, in whole spans: 30% leaves room for a block of the class taken
     * before, and is still far from 37%. */
    if (crossing * 10 > (MIDS / 3) * 3) fail("1500-byte blocks crossing a page, over 30%", crossing);
    for (int i = 0; i < MIDS; i += 2) {
        size_t n = mid_sizes[i % 3];
        check("mid-size block before free", mid[i], n, 11 + i);
        free(mid[i]);
        mid[i] = calloc(1, n);
        if (!mid[i]) { fail("mid-size calloc", n); break; }
        for (size_t j = 0; j < n; j++) {
            if (mid[i][j]) { fail("mid-size calloc not zero", j); break; }
        }
        fill(mid[i], n, 11 + i);
    }
    for (int i = 0; i < EARLY; i++) {
        size_t n = 1500 + 40 * i;
        check("early mid-size block", early[i], n, 200 + i);
        early[i] = realloc(early[i], n + 1000 * (i % 3));
        if (!early[i]) { fail("early mid-size realloc", i); break; }
        check("early mid-size block after realloc", early[i], n, 200 + i);
        free(early[i]);
    }
    unsigned char *grown = malloc(1100);
    fill(grown, 1100, 9);
    size_t steps[] = {1200, 3000, 9000, 20000, 5000, 1025, 800, 1300};
    size_t kept = 1100;
    for (size_t k = 0; k < sizeof steps / sizeof *steps; k++) {
        grown = realloc(grown, steps[k]);
        if (!grown) { fail("mid-size realloc", steps[k]); break; }
        kept = kept < steps[k] ? kept : steps[k];
        check("mid-size realloc kept data", grown, kept, 9);
    }
    free(grown);

    /* Private anonymous mappings: zero at first, unmapped in the middle, grown, moved. */
    int prot = PROT_READ | PROT_WRITE, flags = MAP_PRIVATE | MAP_ANONYMOUS;
    unsigned char *m = mmap(NULL, piece, prot, flags, -1, 0);
    if (m == MAP_FAILED) fail("mmap", 0);
    for (size_t i = 0; i < piece; i += PAGE) {
        if (m[i]) { fail("fresh mapping not zero", i); break; }
    }
    fill(m, piece, 5);
    if (munmap(m + PAGE, PAGE) != 0) fail("munmap of a middle page", 0);
    unsigned char *again = mmap(NULL, PAGE, prot, flags, -1, 0);
    if (again == MAP_FAILED || again[0] || again[PAGE - 1]) fail("reused range not zero", 0);
    unsigned char *g = mremap(m + 2 * PAGE, piece - 2 * PAGE, 2 * piece, MREMAP_MAYMOVE);
    if (g == MAP_FAILED) fail("mremap grow", 0);
    for (size_t i = 0; i < piece - 2 * PAGE; i += 64) {
        if (g[i] != (unsigned char)(5 * 131 + (i + 2 * PAGE) / 64)) { fail("mremap kept data", i); break; }
    }
    fill(g, 2 * piece, 6);
    unsigned char *fx = mmap(g, PAGE, prot, flags | MAP_FIXED, -1, 0);
    if (fx != g || g[0] != 0) fail("MAP_FIXED over own mapping reads zeros", 0);
    fill(g, PAGE, 6);

    /* Push everything out, then verify. */
    unsigned char *push = malloc(total);
    if (!push) fail("malloc(total)", 0);
    else { memset(push, 0x5A, total); }
    check("posix_memalign data", a, piece, 1);
    check("aligned_alloc data", b, piece, 2);
    check("memalign data", c, piece, 3);
    check("reallocarray data", r, piece, 4);
    check("mapping head", m, PAGE, 5);
    check("mremap data", g, 2 * piece, 6);
    for (int i = 0; i < MIDS; i++) {
        check("mid-size data", mid[i], mid_sizes[i % 3], 11 + i);
        free(mid[i]);
    }
    for (size_t i = 0; push && i < total; i += PAGE) {
        if (push[i] != 0x5A) { fail("push data", i); break; }
    }
    if (munmap(g, 2 * piece) != 0) fail("munmap", 0);
    free(push); free(a); free(b); free(c); free(v); free(r);
    if (failures) return 1;
    printf("ok every entry point\n");
    return 0;
}
