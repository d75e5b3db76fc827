/* random_access: pmbench-like uniform random reads and writes over a malloc'ed set, every
 * read checked. The program of the issue-21 real-program runs (`uswap bench run`).
 *
 *   cc -O2 -o random_access random_access.c
 *   random_access SIZE_MIB ACCESSES [WRITE_PERCENT]
 *
 * Fills SIZE_MIB MiB, one 8-byte stamp per page (page number and a version), then makes
 * ACCESSES accesses to uniformly random pages: WRITE_PERCENT (default 30) of them write a
 * new version of the page's stamp, the rest read it and check it against the version this
 * program last wrote. Prints `ok ACCESSES accesses` or the first wrong stamp (exit 1).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
    if (argc < 3 || argc > 4) {
        fprintf(stderr, "usage: %s SIZE_MIB ACCESSES [WRITE_PERCENT]\n", argv[0]);
        return 2;
    }
    size_t pages = (size_t)atol(argv[1]) * 256;
    long accesses = atol(argv[2]);
    unsigned write_pct = argc == 4 ? (unsigned)atoi(argv[3]) : 30;
    uint64_t *mem = malloc(pages * 4096);
    uint32_t *version = calloc(pages, sizeof *version);
    if (!mem || !version || pages == 0) {
        fprintf(stderr, "random_access: cannot allocate\n");
        return 2;
    }
    for (size_t p = 0; p < pages; p++)
        mem[p * 512 + p % 512] = (uint64_t)p << 32;
    uint64_t x = 88172645463325252ull;
    for (long i = 0; i < accesses; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        size_t p = (x >> 8) % pages;
        uint64_t *stamp = &mem[p * 512 + p % 512];
        if ((x & 0xff) % 100 < write_pct) {
            *stamp = (uint64_t)p << 32 | ++version[p];
        } else if (*stamp != ((uint64_t)p << 32 | version[p])) {
            printf("page %zu holds %016llx, not version %u\n", p, (unsigned long long)*stamp,
                   version[p]);
            return 1;
        }
    }
    printf("ok %ld accesses\n", accesses);
    return 0;
}
