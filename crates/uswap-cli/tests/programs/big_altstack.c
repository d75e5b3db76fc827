/* A program whose signal handler needs a large alternate stack: it sets up a 512 KiB
 * alternate stack (sigaltstack) and a SIGUSR1 handler (SA_ONSTACK) that uses 256 KiB of
 * stack, raises SIGUSR1 once, then replaces the stack with a 1 MiB one and raises SIGUSR1
 * ROUNDS times, with memory in use beside it, checked after each. Without uswap this
 * works; a handler run on a 64 KiB stack overflows it (SIGSEGV).
 *
 * usage: big_altstack ROUNDS; prints "ok ROUNDS handlers"; exit 1 on a failed check,
 * 2 on a usage or system error. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ALT_SIZE (1 << 20)
#define HANDLER_USE (256 << 10)

static volatile sig_atomic_t ran;
static volatile uint64_t sink;

static void handler(int sig) {
    (void)sig;
    volatile unsigned char big[HANDLER_USE];
    for (size_t i = 0; i < sizeof big; i += 512)
        big[i] = (unsigned char)i;
    uint64_t sum = 0;
    for (size_t i = 0; i < sizeof big; i += 512)
        sum += big[i];
    sink = sum;
    ran++;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: big_altstack ROUNDS\n");
        return 2;
    }
    long rounds = atol(argv[1]);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = handler;
    sa.sa_flags = SA_ONSTACK;
    if (sigaction(SIGUSR1, &sa, NULL) != 0) {
        perror("sigaction");
        return 2;
    }
    /* A first stack, half the size (room for the handler too), used once, then replaced. */
    stack_t first = {.ss_sp = malloc(ALT_SIZE / 2), .ss_size = ALT_SIZE / 2, .ss_flags = 0};
    if (!first.ss_sp || sigaltstack(&first, NULL) != 0) {
        perror("sigaltstack");
        return 2;
    }
    raise(SIGUSR1);
    stack_t ss = {.ss_sp = malloc(ALT_SIZE), .ss_size = ALT_SIZE, .ss_flags = 0};
    if (!ss.ss_sp || sigaltstack(&ss, NULL) != 0) {
        perror("sigaltstack");
        return 2;
    }
    stack_t seen;
    if (sigaltstack(NULL, &seen) != 0 || seen.ss_sp != ss.ss_sp || seen.ss_size != ALT_SIZE) {
        fprintf(stderr, "sigaltstack reads back %p %zu\n", seen.ss_sp, seen.ss_size);
        return 1;
    }
    /* Memory in use beside it, written and read back between the signals. */
    size_t words = 8 << 20;
    uint64_t *mem = malloc(words * 8);
    if (!mem)
        return 2;
    for (long r = 0; r < rounds; r++) {
        for (size_t i = 0; i < words; i += 512)
            mem[i] = i ^ (uint64_t)r;
        raise(SIGUSR1);
        for (size_t i = 0; i < words; i += 512)
            if (mem[i] != (i ^ (uint64_t)r)) {
                printf("round %ld word %zu is wrong\n", r, i);
                return 1;
            }
    }
    if (ran != rounds + 1) {
        printf("%d handlers ran of %ld\n", (int)ran, rounds + 1);
        return 1;
    }
    printf("ok %ld handlers\n", rounds);
    return 0;
}
