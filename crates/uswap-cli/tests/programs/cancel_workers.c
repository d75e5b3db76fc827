/* Threads cancelled while they work on memory larger than uswap run's limit, as
 * will-it-scale's page_fault1_threads ends: WORKERS threads keep writing SIZE bytes each
 * (so that under uswap run faults keep coming), the main thread pthread_cancel()s and joins
 * them, first with asynchronous cancellation, then with deferred cancellation while each
 * is blocked in read(2) on a pipe into its buffer. The main thread's own memory is checked
 * after each round.
 *
 * usage: cancel_workers WORKERS SIZE[K|M|G]; prints "ok <workers> workers"; exit 1 on a
 * mismatch or a thread that did not end cancelled, 2 on a usage or system error. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static size_t size;
static uint64_t *own;
static size_t own_words;
static int pipe_fds[2];

static void pause_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&t, NULL);
}

static void *write_forever(void *arg) {
    (void)arg;
    pthread_setcanceltype(PTHREAD_CANCEL_ASYNCHRONOUS, NULL);
    volatile unsigned char *p = malloc(size);
    if (!p) _exit(2);
    for (unsigned char v = 1;; v++)
        for (size_t i = 0; i < size; i += 4096) p[i] = v;
}

static void *read_blocked(void *arg) {
    (void)arg;
    char *buf = malloc(size);
    if (!buf) _exit(2);
    memset(buf, 1, size);
    /* Deferred cancellation: read is a cancellation point. */
    for (;;)
        if (read(pipe_fds[0], buf + size / 2, 4096) < 0) _exit(2);
}

static int round_of(int workers, void *(*work)(void *), const char *what) {
    pthread_t t[64];
    for (int i = 0; i < workers; i++)
        if (pthread_create(&t[i], NULL, work, NULL) != 0) return 2;
    pause_ms(500);
    for (int i = 0; i < workers; i++) pthread_cancel(t[i]);
    for (int i = 0; i < workers; i++) {
        void *result;
        pthread_join(t[i], &result);
        if (result != PTHREAD_CANCELED) {
            printf("%s: thread %d was not cancelled\n", what, i);
            return 1;
        }
    }
    for (size_t i = 0; i < own_words; i++)
        if (own[i] != i * 0x9e3779b97f4a7c15ULL) {
            printf("%s: mismatch at word %zu\n", what, i);
            return 1;
        }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s WORKERS SIZE[K|M|G]\n", argv[0]);
        return 2;
    }
    int workers = atoi(argv[1]);
    char *unit;
    size = strtoull(argv[2], &unit, 10);
    size <<= *unit == 'G' ? 30 : *unit == 'M' ? 20 : *unit == 'K' ? 10 : 0;
    own_words = size / 8;
    own = malloc(size);
    if (workers < 1 || workers > 64 || !own || pipe(pipe_fds) != 0) return 2;
    for (size_t i = 0; i < own_words; i++) own[i] = i * 0x9e3779b97f4a7c15ULL;
    int rc = round_of(workers, write_forever, "asynchronous");
    if (rc == 0) rc = round_of(workers, read_blocked, "deferred, in read");
    if (rc == 0) printf("ok %d workers\n", workers);
    return rc;
}
