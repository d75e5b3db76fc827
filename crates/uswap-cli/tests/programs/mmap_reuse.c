/* mmap_reuse: threads that map, check, fill and unmap private anonymous memory over and
 * over, so ranges one thread gave back are handed to another while reclaim is busy.
 *
 * Usage: mmap_reuse THREADS
 * A fresh mapping must read as zeros, whatever the range held before. Prints "ok ..." and
 * exits 0, or names the first stale byte (and whose data it was) and exits 1. Found a bug:
 * a page reclaim moved out between uswap's handling of a discard and the kernel's zap came
 * back with its old data in the next mapping of the range. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#define PAGE 4096
static size_t live_mb;
static void *work(void *arg) {
    long id = (long)arg;
    unsigned seed = id * 7 + 1;
    enum { SLOTS = 64 };
    unsigned char *blk[SLOTS] = {0}; size_t len[SLOTS] = {0};
    for (int it = 0; it < 4000; it++) {
        int s = rand_r(&seed) % SLOTS;
        if (blk[s]) { munmap(blk[s], len[s]); blk[s] = 0; }
        len[s] = (size_t)(1 + rand_r(&seed) % 64) * PAGE * 4;
        blk[s] = mmap(NULL, len[s], PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
        if (blk[s] == MAP_FAILED) { perror("mmap"); exit(2); }
        for (size_t o = 0; o < len[s]; o += PAGE) {
            for (size_t k = 0; k < PAGE; k += 512) if (blk[s][o + k]) {
                printf("stale thread %ld iter %d offset %zu byte %zu value 0x%02x\n", id, it, o, k, blk[s][o+k]); exit(1); }
            memset(blk[s] + o, 0x40 + id, PAGE);
        }
    }
    return 0;
}
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 4;
    pthread_t t[16];
    for (long i = 0; i < n; i++) pthread_create(&t[i], 0, work, (void *)i);
    for (int i = 0; i < n; i++) pthread_join(t[i], 0);
    printf("ok %d threads\n", n);
    return 0;
}
