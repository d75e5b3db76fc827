/* sequential_rewrite: usemem-like sequential passes over a malloc'ed buffer, each word
 * checked before it is rewritten. The program of the issue-21 real-program runs.
 *
 *   cc -O2 -o sequential_rewrite sequential_rewrite.c
 *   sequential_rewrite SIZE_MIB PASSES
 *
 * Writes every 8-byte word with a value of (word, pass 0), then PASSES times walks the
 * buffer in order, checking each word holds the previous pass's value before writing this
 * pass's. Prints `ok PASSES passes` or the first wrong word (exit 1).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static uint64_t value(uint64_t word, uint64_t pass)
{
    uint64_t v = word * 0x9e3779b97f4a7c15ull ^ pass;
    return v ^ (v >> 29);
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s SIZE_MIB PASSES\n", argv[0]);
        return 2;
    }
    size_t words = (size_t)atol(argv[1]) << 17;
    long passes = atol(argv[2]);
    uint64_t *mem = malloc(words * 8);
    if (!mem || words == 0) {
        fprintf(stderr, "sequential_rewrite: cannot allocate\n");
        return 2;
    }
    for (size_t w = 0; w < words; w++)
        mem[w] = value(w, 0);
    for (long pass = 1; pass <= passes; pass++)
        for (size_t w = 0; w < words; w++) {
            if (mem[w] != value(w, pass - 1)) {
                printf("pass %ld word %zu is wrong\n", pass, w);
                return 1;
            }
            mem[w] = value(w, pass);
        }
    printf("ok %ld passes\n", passes);
    return 0;
}
