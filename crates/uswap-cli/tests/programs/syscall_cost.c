/* What a system call costs a program, and what one that reads into its heap costs.
 *
 *   cc -O2 -o syscall_cost syscall_cost.c
 *   syscall_cost SIZE_MIB SECONDS
 *
 * Allocates SIZE_MIB MiB with malloc and writes every page, then for SECONDS each:
 *   - getppid() in a loop (a call that takes no buffer);
 *   - read(2) of 4 KiB from /dev/zero into a random page of the heap block (a call whose
 *     buffer may be swapped out under uswap run, which then brings it in first);
 *   - read(2) of 4 KiB from a pipe into one heap page (the pipe filled from the stack);
 *   - epoll_wait(2) on one ready eventfd, its events array on the heap;
 *   - write(2) of 64 KiB from the heap to a Unix socket (drained untimed).
 * Prints `getppid NS read4k NS pipe4k NS epoll NS sock64k NS` (nanoseconds per call) and
 * checks every buffer it reads into (exit 1 if wrong).
 */
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
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

static void fail(const char *what)
{
    perror(what);
    exit(1);
}

/* read(2) of 4 KiB from a pipe into the heap's first page, the pipe refilled each time. */
static double pipe_read_ns(unsigned char *heap, double seconds)
{
    int fds[2];
    unsigned char block[4096];
    if (pipe(fds) != 0)
        fail("pipe");
    long calls = 0;
    double spent = 0, end = now() + seconds;
    while (now() < end) {
        memset(block, (int)(calls & 0xff), sizeof block);
        if (write(fds[1], block, sizeof block) != sizeof block)
            fail("write to pipe");
        double t = now();
        if (read(fds[0], heap, 4096) != 4096)
            fail("read from pipe");
        spent += now() - t;
        if (heap[0] != (calls & 0xff) || heap[4095] != (calls & 0xff)) {
            fprintf(stderr, "a page read from the pipe is wrong\n");
            exit(1);
        }
        calls++;
    }
    close(fds[0]);
    close(fds[1]);
    return spent * 1e9 / calls;
}

/* epoll_wait(2) on one ready eventfd, its events array in the heap's second page. */
static double epoll_ns(unsigned char *heap, double seconds)
{
    int ep = epoll_create1(0), ev = eventfd(1, 0);
    struct epoll_event want = {.events = EPOLLIN, .data.u64 = 42};
    if (ep < 0 || ev < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, ev, &want) != 0)
        fail("epoll setup");
    struct epoll_event *events = (struct epoll_event *)(heap + 4096);
    long calls = 0;
    double start = now(), end = start + seconds;
    while (now() < end) {
        for (int i = 0; i < 1000; i++) {
            events[0].data.u64 = 0;
            if (epoll_wait(ep, events, 8, 0) != 1 || events[0].data.u64 != 42)
                fail("epoll_wait");
        }
        calls += 1000;
    }
    close(ep);
    close(ev);
    return (now() - start) * 1e9 / calls;
}

/* write(2) of 64 KiB from the heap to a Unix stream socket, drained into the stack. */
static double socket_write_ns(unsigned char *heap, size_t pages, double seconds)
{
    int sv[2], size = 1 << 20;
    static unsigned char sink[65536];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
        fail("socketpair");
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
    setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    size_t blocks = pages / 16, b = 0;
    long calls = 0;
    double spent = 0, end = now() + seconds;
    while (now() < end) {
        unsigned char *from = heap + (b++ % blocks) * 65536;
        double t = now();
        if (write(sv[0], from, 65536) != 65536)
            fail("write to socket");
        spent += now() - t;
        for (size_t got = 0; got < 65536;) {
            ssize_t n = read(sv[1], sink + got, 65536 - got);
            if (n <= 0)
                fail("read from socket");
            got += n;
        }
        if (memcmp(sink, from, 65536) != 0) {
            fprintf(stderr, "the socket carried wrong data\n");
            exit(1);
        }
        calls++;
    }
    close(sv[0]);
    close(sv[1]);
    return spent * 1e9 / calls;
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
    printf("getppid %.0f read4k %.0f pipe4k %.0f epoll %.0f sock64k %.0f\n", getppid_ns,
           read_ns, pipe_read_ns(heap, seconds), epoll_ns(heap, seconds),
           socket_write_ns(heap, pages, seconds));
    return 0;
}
