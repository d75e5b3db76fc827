/* Processes that end inside a signal handler, as PostgreSQL's postmaster does: its
 * handlers fork its helper processes, which live and exit inside the handler, and its
 * shutdown handler calls exit(). Each handler here interrupts a read(2) blocked on a pipe
 * (so under uswap run --fault-mode sigbus it runs while the read is dispatched):
 *   1. a SIGUSR1 handler forks a child that checks the parent's memory and calls exit();
 *      the parent's read goes on (SA_RESTART) until a helper thread writes the pipe;
 *   2. a SIGTERM handler checks the memory, prints "ok <bytes> bytes" and calls exit(0).
 *
 * usage: handler_exit SIZE[K|M|G]; exit 1 on a mismatch or a child that did not exit 0,
 * 2 on a usage or system error. */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static uint64_t *memory;
static size_t words;
static volatile sig_atomic_t child_status = -1;
static pthread_t main_thread;
static int pipe_fds[2];

static uint64_t word(size_t i) {
    uint64_t x = i * 0x9e3779b97f4a7c15ULL;
    return x ^ (x >> 29);
}

static int memory_intact(void) {
    for (size_t i = 0; i < words; i++)
        if (memory[i] != word(i)) return 0;
    return 1;
}

static void fork_a_checker(int sig) {
    (void)sig;
    pid_t pid = fork();
    if (pid == 0) exit(memory_intact() ? 0 : 1);
    int status;
    if (pid < 0 || waitpid(pid, &status, 0) != pid) _exit(2);
    child_status = status;
}

static void exit_checked(int sig) {
    (void)sig;
    if (!memory_intact()) {
        printf("mismatch in the SIGTERM handler\n");
        exit(1);
    }
    printf("ok %zu bytes\n", words * 8);
    exit(0);
}

static void pause_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&t, NULL);
}

/* Signals the main thread while its read is blocked, then lets the read return. */
static void *signaller(void *arg) {
    (void)arg;
    pause_ms(200);
    pthread_kill(main_thread, SIGUSR1);
    while (child_status == -1) pause_ms(10);
    if (write(pipe_fds[1], "x", 1) != 1) _exit(2);
    pause_ms(200);
    pthread_kill(main_thread, SIGTERM);
    return NULL;
}

static void handle(int sig, void (*handler)(int)) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = handler;
    sa.sa_flags = SA_RESTART;
    if (sigaction(sig, &sa, NULL) != 0) _exit(2);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SIZE[K|M|G]\n", argv[0]);
        return 2;
    }
    char *unit;
    size_t size = strtoull(argv[1], &unit, 10);
    size <<= *unit == 'G' ? 30 : *unit == 'M' ? 20 : *unit == 'K' ? 10 : 0;
    words = size / 8;
    memory = malloc(words * 8);
    if (!memory || pipe(pipe_fds) != 0) return 2;
    for (size_t i = 0; i < words; i++) memory[i] = word(i);
    setvbuf(stdout, NULL, _IOLBF, 0);

    handle(SIGUSR1, fork_a_checker);
    handle(SIGTERM, exit_checked);
    main_thread = pthread_self();
    pthread_t t;
    if (pthread_create(&t, NULL, signaller, NULL) != 0) return 2;

    char c;
    if (read(pipe_fds[0], &c, 1) != 1) return 2;
    if (!WIFEXITED(child_status) || WEXITSTATUS(child_status) != 0) {
        printf("the child forked in the handler ended with status %#x\n", child_status);
        return 1;
    }
    /* The SIGTERM handler ends the process while this read is blocked. */
    if (read(pipe_fds[0], &c, 1) != 1) return 2;
    return 2;
}
