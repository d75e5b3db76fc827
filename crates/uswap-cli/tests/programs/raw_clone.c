/* A fork made with the raw clone system call (clone(SIGCHLD), as some sandboxes and
 * runtimes make it), not the C library's fork: the child checks the parent's memory as it
 * was at the clone, writes its own, checks that, and exits; the parent checks that its
 * memory is unchanged by the child's writes. Repeated ROUNDS times. The clone is made
 * through the C library's syscall(), or with `asm` as a third argument by a syscall
 * instruction of the program's own.
 *
 * usage: raw_clone SIZE_MIB ROUNDS [asm]; prints "ok ROUNDS children"; exit 1 on a wrong
 * word or a child that did not exit 0, 2 on a usage or system error. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static uint64_t value(size_t i, uint64_t round) {
    uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ULL ^ round;
    return x ^ (x >> 31);
}

/* clone(SIGCHLD) by a syscall instruction: the child returns here on the same stack, as
 * after fork. */
static long clone_by_instruction(void) {
    long ret;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "0"((long)SYS_clone), "D"((long)SIGCHLD), "S"(0L), "d"(0L)
                     : "rcx", "r11", "memory");
    return ret;
}

static int check(const uint64_t *mem, size_t words, uint64_t round, const char *who) {
    for (size_t i = 0; i < words; i += 64)
        if (mem[i] != value(i, round)) {
            printf("%s: word %zu is wrong in round %llu\n", who, i, (unsigned long long)round);
            return 1;
        }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3 && !(argc == 4 && strcmp(argv[3], "asm") == 0)) {
        fprintf(stderr, "usage: raw_clone SIZE_MIB ROUNDS [asm]\n");
        return 2;
    }
    int by_instruction = argc == 4;
    size_t words = (size_t)atol(argv[1]) << 17;
    long rounds = atol(argv[2]);
    uint64_t *mem = malloc(words * 8);
    if (!mem)
        return 2;
    for (long r = 0; r < rounds; r++) {
        for (size_t i = 0; i < words; i += 64)
            mem[i] = value(i, (uint64_t)r);
        long pid = by_instruction ? clone_by_instruction() : syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0);
        if (pid < 0) {
            fprintf(stderr, "clone: %ld\n", pid);
            return 2;
        }
        if (pid == 0) {
            if (check(mem, words, (uint64_t)r, "child"))
                _exit(1);
            for (size_t i = 0; i < words; i += 64)
                mem[i] = value(i, 1000 + (uint64_t)r);
            _exit(check(mem, words, 1000 + (uint64_t)r, "child again"));
        }
        int status;
        if (waitpid((pid_t)pid, &status, 0) != pid) {
            perror("waitpid");
            return 2;
        }
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            printf("child %ld ended with status %#x\n", pid, status);
            return 1;
        }
        if (check(mem, words, (uint64_t)r, "parent"))
            return 1;
    }
    printf("ok %ld children\n", rounds);
    return 0;
}
