/* System calls on swapped-out heap memory, and threads cancelled while they wait in one:
 * what `uswap run` in SIGBUS or auto mode serves with direct calls (the C library's
 * wrappers run without the trap of syscall dispatch when their buffers are in memory) and
 * dispatched ones (when they are not).
 *
 *   cc -O2 -pthread -o direct_calls direct_calls.c
 *   direct_calls SIZE_MIB ROUNDS
 *
 * 1. Fills SIZE_MIB MiB of heap, 64 KiB blocks, each word naming its block and offset.
 * 2. ROUNDS times: copies a random block into another through a pipe (write + read), a
 *    Unix socket (send + recv, sendmsg + recvmsg with two-part vectors) and writev + readv,
 *    checking the copy each time, then puts the destination's own contents back.
 * 3. Cancels a thread blocked in read(2) on an empty pipe into a fresh heap block (never
 *    touched: under uswap its call is dispatched), one blocked in epoll_wait(2) and one in
 *    recv(2) with buffers in memory (direct calls under uswap), each with a cleanup
 *    handler: each must be cancelled (joined as PTHREAD_CANCELED, its
 *    cleanup run) and the process go on.
 * 4. Checks every block again.
 * Prints `ok N blocks` and exits 0, or says what was wrong and exits 1.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define BLOCK 65536
#define WORDS (BLOCK / 8)

static uint64_t **blocks;
static size_t nblocks;

static void fail(const char *what)
{
    perror(what);
    exit(1);
}

static uint64_t word(size_t block, size_t i)
{
    return (uint64_t)block << 32 | i | 0x8000000000000000ull;
}

static void fill(size_t b, uint64_t *to)
{
    for (size_t i = 0; i < WORDS; i++)
        to[i] = word(b, i);
}

static void check(size_t b, const uint64_t *got, const char *how)
{
    for (size_t i = 0; i < WORDS; i++)
        if (got[i] != word(b, i)) {
            fprintf(stderr, "%s: block %zu word %zu is %016llx, not %016llx\n", how, b, i,
                    (unsigned long long)got[i], (unsigned long long)word(b, i));
            exit(1);
        }
}

static uint64_t rng = 88172645463325252ull;
static size_t pick(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng % nblocks;
}

/* Moves n bytes from `from` to `to` through the connected pair (rd, wr), in pieces. */
static void through(int wr, int rd, const void *from, void *to, size_t n, int sock)
{
    for (size_t sent = 0, got = 0; got < n;) {
        if (sent < n) {
            ssize_t w = sock ? send(wr, (const char *)from + sent, n - sent, MSG_DONTWAIT)
                             : write(wr, (const char *)from + sent, n - sent);
            if (w > 0)
                sent += w;
        }
        ssize_t r = sock ? recv(rd, (char *)to + got, n - got, 0)
                         : read(rd, (char *)to + got, n - got);
        if (r <= 0)
            fail(sock ? "recv" : "read");
        got += r;
    }
}

static void copy_rounds(int rounds)
{
    int p[2], s[2];
    if (pipe(p) != 0 || socketpair(AF_UNIX, SOCK_STREAM, 0, s) != 0)
        fail("pipe/socketpair");
    for (int r = 0; r < rounds; r++) {
        size_t src = pick(), dst = pick();
        if (src == dst)
            continue;
        int how = r % 4;
        if (how == 0)
            through(p[1], p[0], blocks[src], blocks[dst], BLOCK, 0);
        else if (how == 1)
            through(s[0], s[1], blocks[src], blocks[dst], BLOCK, 1);
        else {
            /* Two-part vectors, the second part first in memory. */
            size_t half = BLOCK / 2;
            struct iovec out[2] = {{blocks[src], half}, {(char *)blocks[src] + half, half}};
            struct iovec in[2] = {{blocks[dst], half}, {(char *)blocks[dst] + half, half}};
            int fd_w = how == 2 ? p[1] : s[0], fd_r = how == 2 ? p[0] : s[1];
            struct msghdr mo = {.msg_iov = out, .msg_iovlen = 2};
            struct msghdr mi = {.msg_iov = in, .msg_iovlen = 2};
            /* A pipe holds 64 KiB: the whole vector fits. */
            ssize_t w = how == 2 ? writev(fd_w, out, 2) : sendmsg(fd_w, &mo, 0);
            if (w != BLOCK)
                fail(how == 2 ? "writev" : "sendmsg");
            for (ssize_t got = 0; got < BLOCK;) {
                ssize_t n = how == 2 ? readv(fd_r, in, 2) : recvmsg(fd_r, &mi, MSG_WAITALL);
                if (n <= 0)
                    fail(how == 2 ? "readv" : "recvmsg");
                got += n;
                if (got < BLOCK) {
                    fprintf(stderr, "short vector read %zd\n", n);
                    exit(1);
                }
            }
        }
        check(src, blocks[dst], "a copy");
        fill(dst, blocks[dst]);
    }
    close(p[0]);
    close(p[1]);
    close(s[0]);
    close(s[1]);
}

/* ---- cancellation ------------------------------------------------------------------- */

static volatile int cleaned[3];

static void cleanup(void *which)
{
    cleaned[(intptr_t)which] = 1;
}

static int fds[2], sock[2], ep;

/* Its buffer is fresh, never touched: the call is dispatched (it brings the buffer in). */
static void *blocked_read(void *arg)
{
    pthread_cleanup_push(cleanup, (void *)0);
    char *buf = malloc(4 << 20);
    read(fds[0], buf, 4 << 20);
    pthread_cleanup_pop(0);
    return arg;
}

/* Its buffer is in memory: a direct call, under uswap. */
static void *blocked_epoll(void *arg)
{
    pthread_cleanup_push(cleanup, (void *)1);
    struct epoll_event *events = calloc(64, sizeof *events);
    memset(events, 1, 64 * sizeof *events);
    epoll_wait(ep, events, 64, -1);
    pthread_cleanup_pop(0);
    return arg;
}

static void *blocked_recv(void *arg)
{
    pthread_cleanup_push(cleanup, (void *)2);
    char *buf = malloc(BLOCK);
    memset(buf, 1, BLOCK);
    recv(sock[1], buf, BLOCK, 0);
    pthread_cleanup_pop(0);
    return arg;
}

static void cancel_blocked(void *(*body)(void *), int which, const char *what)
{
    pthread_t t;
    void *result;
    if (pthread_create(&t, NULL, body, NULL) != 0)
        fail("pthread_create");
    usleep(100 * 1000);
    if (pthread_cancel(t) != 0 || pthread_join(t, &result) != 0)
        fail("pthread_cancel/join");
    if (result != PTHREAD_CANCELED || !cleaned[which]) {
        fprintf(stderr, "the thread blocked in %s was not cancelled\n", what);
        exit(1);
    }
}

static void cancellations(void)
{
    if (pipe(fds) != 0 || socketpair(AF_UNIX, SOCK_STREAM, 0, sock) != 0)
        fail("pipe/socketpair");
    ep = epoll_create1(0);
    struct epoll_event want = {.events = EPOLLIN};
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, fds[0], &want) != 0)
        fail("epoll");
    cancel_blocked(blocked_read, 0, "read");
    cancel_blocked(blocked_epoll, 1, "epoll_wait");
    cancel_blocked(blocked_recv, 2, "recv");
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s SIZE_MIB ROUNDS\n", argv[0]);
        return 2;
    }
    nblocks = (size_t)atol(argv[1]) * 16;
    int rounds = atoi(argv[2]);
    blocks = malloc(nblocks * sizeof *blocks);
    if (!blocks)
        fail("malloc");
    for (size_t b = 0; b < nblocks; b++) {
        if (!(blocks[b] = malloc(BLOCK)))
            fail("malloc");
        fill(b, blocks[b]);
    }
    copy_rounds(rounds);
    cancellations();
    for (size_t b = 0; b < nblocks; b++)
        check(b, blocks[b], "at the end");
    printf("ok %zu blocks\n", nblocks);
    return 0;
}
