/* What a system call costs a program, and what one that reads into its heap costs.
 *
 *   cc -O2 -o syscall_cost syscall_cost.c
 *   syscall_cost SIZE_MIB SECONDS
 *
 * Allocates SIZE_MIB MiB with malloc and writes every page, then for SECONDS each:
 *   - getppid() in a loop (a call that takes no buffer);
 *   - read(2) of 4 KiB from /dev/zero into a random page of the heap block (a call whose
 *     buffer may be swapped out under uswap run, which then brings it in first).
 * Prints `getppid NS_PER_CALL read4k NS_PER_CALL` and checks that every page read into
 * holds zeros afterwards (exit 1 if not).
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s SIZE_MIB SECONDS\n", argv[0]);
        return 2;
    }
    size_t pages = (size_t)atol(argv[1]) * 256;
    double seconds = atof(argv[2]);
    unsigned char *heap = malloc(pages * 4096);
    if (!heap) {
        perror("malloc");
        return 2;
    }
    for (size_t p = 0; p < pages; p++)
        memset(heap + p * 4096, 0xa5, 4096);

    long calls = 0;
    double start = now(), end = start + seconds;
    while (now() < end) {
        for (int i = 0; i < 1000; i++)
            getppid();
        calls += 1000;
    }
    double getppid_ns = (now() - start) * 1e9 / calls;

    int zero = open("/dev/zero", O_RDONLY);
    if (zero < 0) {
        perror("/dev/zero");
        return 2;
    }
    uint64_t x = 88172645463325252ull;
    long reads = 0;
    start = now();
    end = start + seconds;
    while (now() < end) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        unsigned char *page = heap + (x % pages) * 4096;
        if (read(zero, page, 4096) != 4096) {
            perror("read");
            return 1;
        }
        if (page[0] != 0 || page[4095] != 0) {
            fprintf(stderr, "a page read from /dev/zero is not zeros\n");
            return 1;
        }
        reads++;
    }
    double read_ns = (now() - start) * 1e9 / reads;
    printf("getppid %.0f read4k %.0f\n", getppid_ns, read_ns);
    return 0;
}
