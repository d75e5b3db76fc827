/*
 * page_verify: allocates SIZE bytes with malloc, then PASSES times writes every page and
 * reads every page back to check it. Built and run by crates/uswap-cli/tests/kernel_run.rs
 * (under `uswap run --backend kernel` and `uswap bench run`), and the program of the
 * `uswap bench run` measurements.
 *
 *   cc -O2 -o page_verify page_verify.c
 *   page_verify SIZE [PASSES]
 *
 * SIZE has a suffix K, M or G (powers of 1024); PASSES defaults to 2. Pass p writes into
 * every 8-byte word of every page a value made from (page, word, p), in page order, then
 * checks every word in page order: with SIZE above the memory limit, each pass swaps the
 * whole buffer out and in again. It prints `ok <pages> pages <passes> passes` and exits 0,
 * or prints the first mismatch and exits 1; usage and allocation errors exit 2.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint64_t word_value(uint64_t page, uint64_t word, uint64_t pass)
{
    uint64_t x = (page << 20) ^ (word << 4) ^ pass ^ 0x9e3779b97f4a7c15ull;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    return x ^ (x >> 29);
}

static int parse_size(const char *text, size_t *bytes)
{
    char *end;
    unsigned long long n = strtoull(text, &end, 10);
    int shift = 0;
    if (end == text || n == 0)
        return -1;
    switch (*end) {
    case 'K': case 'k': shift = 10; end++; break;
    case 'M': case 'm': shift = 20; end++; break;
    case 'G': case 'g': shift = 30; end++; break;
    }
    if (*end != '\0')
        return -1;
    *bytes = (size_t)(n << shift);
    return 0;
}

int main(int argc, char **argv)
{
    size_t bytes;
    long passes = argc == 3 ? strtol(argv[2], NULL, 10) : 2;
    if (argc < 2 || argc > 3 || parse_size(argv[1], &bytes) != 0 || passes < 1) {
        fprintf(stderr, "usage: %s SIZE [PASSES]   (SIZE like 512M)\n", argv[0]);
        return 2;
    }
    size_t page_size = (size_t)sysconf(_SC_PAGESIZE);
    size_t pages = bytes / page_size;
    size_t words = page_size / sizeof(uint64_t);
    uint64_t *mem = malloc(pages * page_size);
    if (mem == NULL) {
        fprintf(stderr, "page_verify: cannot allocate %zu bytes\n", pages * page_size);
        return 2;
    }
    for (long pass = 1; pass <= passes; pass++) {
        for (size_t p = 0; p < pages; p++)
            for (size_t w = 0; w < words; w++)
                mem[p * words + w] = word_value(p, w, (uint64_t)pass);
        for (size_t p = 0; p < pages; p++)
            for (size_t w = 0; w < words; w++)
                if (mem[p * words + w] != word_value(p, w, (uint64_t)pass)) {
                    printf("mismatch pass %ld page %zu word %zu\n", pass, p, w);
                    return 1;
                }
    }
    free(mem);
    printf("ok %zu pages %ld passes\n", pages, passes);
    return 0;
}
