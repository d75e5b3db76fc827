/*
 * malloc_stress: a multi-threaded malloc/calloc/realloc/free workout that checks every
 * byte it wrote. Built and run by crates/uswap-cli/tests/run_programs.rs, under
 * `uswap run` and on its own.
 *
 *   cc -O2 -pthread -o malloc_stress malloc_stress.c
 *   malloc_stress THREADS SIZE [SEED]
 *
 * SIZE (suffix K, M or G, powers of 1024) is the live set kept by all threads together;
 * each thread keeps SIZE/THREADS of blocks of 16 B to 4 MiB. A thread first allocates up
 * to its share, then churns (frees, reallocs that grow or shrink, new blocks) until it has
 * turned its share over twice, then the main thread verifies and frees every thread's
 * blocks (frees from another thread than the one that allocated).
 *
 * Every block is filled with a pattern derived from (block id, generation); a block is
 * verified before each realloc and free, the part a realloc keeps is verified after it,
 * a calloc'd block must read as zeros, and the live blocks are verified at the end.
 * System calls touch the blocks too: a live block is written to a pipe and read back into
 * a fresh block, written to an unlinked temporary file and read back with pread(2), and
 * /dev/zero is read over a live block, which must then read as zeros.
 *
 * Everything is deterministic for a given (THREADS, SIZE, SEED). On success it prints
 * `ok <bytes verified>` and exits 0; on the first mismatch it prints
 * `mismatch thread T block B gen G size S offset O expected 0xEE got 0xGG` and exits 1.
 * Usage or system errors exit 2.
 *
 * MALLOC_STRESS_CORRUPT=1 flips one byte of one live block before the final check, to
 * show that a mismatch is caught (the tests use it).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MIN_BLOCK 16u
#define MAX_BLOCK (4u << 20)
/* System-call checks every this many churn operations. */
#define SYSCALL_EVERY 64
/* Largest chunk one write(2) to the pipe carries (below the default pipe capacity, so one
 * thread can write then read without a reader on the other side). */
#define PIPE_CHUNK (32u << 10)

struct block {
    unsigned char *p;
    size_t size;
    uint64_t id;
    uint64_t gen;
};

struct worker {
    pthread_t tid;
    int index;
    uint64_t rng;
    size_t budget;
    size_t live;
    struct block *blocks;
    size_t nblocks, cap;
    uint64_t next_id;
    uint64_t verified;
    int pipefd[2];
    int tmpfd;
};

static uint64_t seed_arg = 1;

/* ---- deterministic numbers ---------------------------------------------------------- */

static uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t next_rand(uint64_t *state)
{
    *state += 0x9e3779b97f4a7c15ull;
    return mix64(*state);
}

/* Uniform in [0, n). */
static uint64_t below(uint64_t *state, uint64_t n)
{
    return next_rand(state) % n;
}

/* A block size: mostly small, some medium, a few large, spread evenly in log scale within
 * each class. */
static size_t pick_size(uint64_t *state)
{
    unsigned lo, hi; /* log2 bounds */
    uint64_t r = below(state, 100);
    if (r < 55) {
        lo = 4, hi = 12; /* 16 B .. 4 KiB */
    } else if (r < 90) {
        lo = 12, hi = 18; /* 4 KiB .. 256 KiB */
    } else {
        lo = 18, hi = 22; /* 256 KiB .. 4 MiB */
    }
    unsigned bits = lo + (unsigned)below(state, hi - lo);
    size_t base = (size_t)1 << bits;
    size_t s = base + (size_t)below(state, base);
    if (s < MIN_BLOCK)
        s = MIN_BLOCK;
    if (s > MAX_BLOCK)
        s = MAX_BLOCK;
    return s;
}

/* ---- the pattern -------------------------------------------------------------------- */

static uint64_t block_key(uint64_t id, uint64_t gen)
{
    return mix64(id * 0x100000001b3ull ^ mix64(gen ^ seed_arg));
}

static inline uint64_t pattern_word(uint64_t key, size_t word)
{
    return mix64(key ^ ((uint64_t)word * 0xd6e8feb86659fd93ull));
}

static inline unsigned char pattern_byte(uint64_t key, size_t off)
{
    return (unsigned char)(pattern_word(key, off / 8) >> (8 * (off % 8)));
}

static void fill(unsigned char *p, size_t size, uint64_t id, uint64_t gen)
{
    uint64_t key = block_key(id, gen);
    size_t words = size / 8, w;
    for (w = 0; w < words; w++) {
        uint64_t v = pattern_word(key, w);
        memcpy(p + w * 8, &v, 8);
    }
    for (size_t off = words * 8; off < size; off++)
        p[off] = pattern_byte(key, off);
}

static pthread_mutex_t report_lock = PTHREAD_MUTEX_INITIALIZER;

static _Noreturn void mismatch(int thread, const struct block *b, size_t off, unsigned expected,
                     unsigned got)
{
    pthread_mutex_lock(&report_lock);
    printf("mismatch thread %d block %llu gen %llu size %zu offset %zu expected 0x%02x "
           "got 0x%02x\n",
           thread, (unsigned long long)b->id, (unsigned long long)b->gen, b->size, off,
           expected, got);
    fflush(stdout);
    _exit(1);
}

/* Checks the first `len` bytes of `p` against block b's pattern; on a mismatch reports it
 * (as b, at the first bad offset) and exits. */
static void check_as(int thread, const struct block *b, const unsigned char *p, size_t len)
{
    uint64_t key = block_key(b->id, b->gen);
    size_t words = len / 8, w;
    for (w = 0; w < words; w++) {
        uint64_t v, want = pattern_word(key, w);
        memcpy(&v, p + w * 8, 8);
        if (v != want)
            break;
    }
    for (size_t off = w * 8; off < len; off++) {
        unsigned char want = pattern_byte(key, off);
        if (p[off] != want)
            mismatch(thread, b, off, want, p[off]);
    }
}

static void check_zero(int thread, const struct block *b, const unsigned char *p, size_t len)
{
    for (size_t off = 0; off < len; off++)
        if (p[off] != 0)
            mismatch(thread, b, off, 0, p[off]);
}

static _Noreturn void die(const char *what)
{
    pthread_mutex_lock(&report_lock);
    fprintf(stderr, "malloc_stress: %s: %s\n", what, strerror(errno));
    fflush(stderr);
    _exit(2);
}

static _Noreturn void xmalloc_fail(const char *what, size_t size)
{
    pthread_mutex_lock(&report_lock);
    fprintf(stderr, "malloc_stress: %s of %zu bytes failed\n", what, size);
    fflush(stderr);
    _exit(2);
}

/* ---- one thread's blocks ------------------------------------------------------------ */

static void push(struct worker *w, struct block b)
{
    if (w->nblocks == w->cap) {
        size_t cap = w->cap ? w->cap * 2 : 256;
        struct block *nb = realloc(w->blocks, cap * sizeof *nb);
        if (!nb)
            xmalloc_fail("realloc of the block table", cap * sizeof *nb);
        w->blocks = nb;
        w->cap = cap;
    }
    w->blocks[w->nblocks++] = b;
    w->live += b.size;
}

static void add_block(struct worker *w)
{
    struct block b = {.size = pick_size(&w->rng), .id = w->next_id++, .gen = 0};
    if (below(&w->rng, 4) == 0) {
        b.p = calloc(1, b.size);
        if (!b.p)
            xmalloc_fail("calloc", b.size);
        check_zero(w->index, &b, b.p, b.size);
        w->verified += b.size;
    } else {
        b.p = malloc(b.size);
        if (!b.p)
            xmalloc_fail("malloc", b.size);
    }
    fill(b.p, b.size, b.id, b.gen);
    push(w, b);
}

static void free_block(struct worker *w, size_t i)
{
    struct block *b = &w->blocks[i];
    check_as(w->index, b, b->p, b->size);
    w->verified += b->size;
    free(b->p);
    w->live -= b->size;
    w->blocks[i] = w->blocks[--w->nblocks];
}

static void realloc_block(struct worker *w, size_t i)
{
    struct block *b = &w->blocks[i];
    size_t old = b->size, size;
    /* Grow up to 4x or shrink down to a quarter, leaning towards whatever brings the live
     * set back to the budget. */
    int grow = w->live < w->budget ? below(&w->rng, 4) != 0 : below(&w->rng, 4) == 0;
    uint64_t factor = 1 + below(&w->rng, 3); /* 1..3: 2x..4x */
    if (grow)
        size = old * (factor + 1) + below(&w->rng, 64);
    else
        size = old / (factor + 1) + below(&w->rng, 64);
    if (size < MIN_BLOCK)
        size = MIN_BLOCK;
    if (size > MAX_BLOCK)
        size = MAX_BLOCK;

    check_as(w->index, b, b->p, old);
    unsigned char *p = realloc(b->p, size);
    if (!p)
        xmalloc_fail("realloc", size);
    b->p = p;
    /* realloc keeps the first min(old, size) bytes */
    size_t kept = old < size ? old : size;
    check_as(w->index, b, p, kept);
    w->verified += old + kept;

    w->live = w->live - old + size;
    b->size = size;
    b->gen++;
    fill(p, size, b->id, b->gen);
}

/* ---- system calls on the blocks ----------------------------------------------------- */

static void write_all(int fd, const unsigned char *p, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            die("write");
        p += n;
        len -= (size_t)n;
    }
}

static void read_all(int fd, unsigned char *p, size_t len)
{
    while (len > 0) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            die(n == 0 ? "read (early end of file)" : "read");
        p += n;
        len -= (size_t)n;
    }
}

/* A live block goes through a pipe into a new heap buffer, which must hold its pattern. */
static void pipe_copy(struct worker *w, const struct block *b)
{
    unsigned char *dst = malloc(b->size);
    if (!dst)
        xmalloc_fail("malloc (pipe copy)", b->size);
    for (size_t off = 0; off < b->size; off += PIPE_CHUNK) {
        size_t n = b->size - off < PIPE_CHUNK ? b->size - off : PIPE_CHUNK;
        write_all(w->pipefd[1], b->p + off, n);
        read_all(w->pipefd[0], dst + off, n);
    }
    check_as(w->index, b, dst, b->size);
    check_as(w->index, b, b->p, b->size);
    w->verified += 2 * b->size;
    free(dst);
}

/* A live block goes to the temporary file with write(2) and comes back into a new heap
 * buffer with pread(2). */
static void file_copy(struct worker *w, const struct block *b)
{
    if (ftruncate(w->tmpfd, 0) != 0 || lseek(w->tmpfd, 0, SEEK_SET) != 0)
        die("truncating the temporary file");
    write_all(w->tmpfd, b->p, b->size);
    unsigned char *dst = malloc(b->size);
    if (!dst)
        xmalloc_fail("malloc (file copy)", b->size);
    size_t done = 0;
    while (done < b->size) {
        ssize_t n = pread(w->tmpfd, dst + done, b->size - done, (off_t)done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            die("pread");
        done += (size_t)n;
    }
    check_as(w->index, b, dst, b->size);
    w->verified += b->size;
    free(dst);
}

/* /dev/zero is read over a live block, which must then read as zeros; the block is then
 * refilled with its next generation. */
static void zero_over(struct worker *w, struct block *b)
{
    int fd = open("/dev/zero", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        die("open /dev/zero");
    read_all(fd, b->p, b->size);
    close(fd);
    check_zero(w->index, b, b->p, b->size);
    w->verified += b->size;
    b->gen++;
    fill(b->p, b->size, b->id, b->gen);
}

static void syscall_checks(struct worker *w)
{
    if (w->nblocks == 0)
        return;
    /* The oldest blocks are the likeliest to be swapped out. */
    size_t i = below(&w->rng, w->nblocks < 8 ? w->nblocks : 8);
    pipe_copy(w, &w->blocks[i]);
    file_copy(w, &w->blocks[below(&w->rng, w->nblocks)]);
    zero_over(w, &w->blocks[below(&w->rng, w->nblocks)]);
}

static int open_tmpfile(void)
{
    const char *dir = getenv("TMPDIR");
    if (!dir || !*dir)
        dir = "/tmp";
    int fd = open(dir, O_RDWR | O_TMPFILE | O_CLOEXEC, 0600);
    if (fd >= 0)
        return fd;
    /* No O_TMPFILE on this file system: a named file, unlinked at once. */
    char path[4096];
    snprintf(path, sizeof path, "%s/malloc_stress.XXXXXX", dir);
    fd = mkostemp(path, O_CLOEXEC);
    if (fd < 0)
        die("creating a temporary file");
    unlink(path);
    return fd;
}

static void *run_worker(void *arg)
{
    struct worker *w = arg;

    /* Fill up to the budget. */
    while (w->live < w->budget)
        add_block(w);

    /* Churn until the share has been turned over twice. */
    size_t turned = 0;
    unsigned long ops = 0;
    while (turned < 2 * w->budget) {
        uint64_t r = below(&w->rng, 100);
        size_t before = w->live;
        if (w->nblocks == 0 || (w->live < w->budget && r < 40)) {
            add_block(w);
            turned += w->live - before;
        } else if (r < 70) {
            size_t i = below(&w->rng, w->nblocks);
            turned += w->blocks[i].size;
            realloc_block(w, i);
        } else if (w->live >= w->budget || r < 85) {
            size_t i = below(&w->rng, w->nblocks);
            turned += w->blocks[i].size;
            free_block(w, i);
        } else {
            add_block(w);
            turned += w->live - before;
        }
        if (++ops % SYSCALL_EVERY == 0)
            syscall_checks(w);
    }
    syscall_checks(w);
    return NULL;
}

/* ---- main --------------------------------------------------------------------------- */

static int parse_size(const char *s, size_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return -1;
    unsigned shift = 0;
    if (*end == 'k' || *end == 'K')
        shift = 10, end++;
    else if (*end == 'm' || *end == 'M')
        shift = 20, end++;
    else if (*end == 'g' || *end == 'G')
        shift = 30, end++;
    if (*end == 'i' && shift)
        end++;
    if (*end == 'B' || *end == 'b')
        end++;
    if (*end || v == 0 || v > (SIZE_MAX >> shift))
        return -1;
    *out = (size_t)v << shift;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3 || argc > 4) {
        fprintf(stderr, "usage: %s THREADS SIZE [SEED]   (SIZE like 512M)\n", argv[0]);
        return 2;
    }
    char *end;
    long threads = strtol(argv[1], &end, 10);
    size_t size;
    if (*end || threads < 1 || threads > 1024) {
        fprintf(stderr, "malloc_stress: bad thread count %s\n", argv[1]);
        return 2;
    }
    if (parse_size(argv[2], &size) != 0 || size < (size_t)threads * MAX_BLOCK) {
        fprintf(stderr, "malloc_stress: bad size %s (at least 4M per thread)\n", argv[2]);
        return 2;
    }
    if (argc == 4) {
        seed_arg = strtoull(argv[3], &end, 10);
        if (*end) {
            fprintf(stderr, "malloc_stress: bad seed %s\n", argv[3]);
            return 2;
        }
    }

    struct worker *ws = calloc((size_t)threads, sizeof *ws);
    if (!ws)
        xmalloc_fail("calloc of the workers", (size_t)threads * sizeof *ws);
    for (long t = 0; t < threads; t++) {
        struct worker *w = &ws[t];
        w->index = (int)t;
        w->rng = mix64(seed_arg * 0x2545f4914f6cdd1dull + (uint64_t)t);
        w->budget = size / (size_t)threads;
        w->next_id = (uint64_t)t << 40;
        if (pipe2(w->pipefd, O_CLOEXEC) != 0)
            die("pipe2");
        w->tmpfd = open_tmpfile();
    }
    for (long t = 0; t < threads; t++) {
        errno = pthread_create(&ws[t].tid, NULL, run_worker, &ws[t]);
        if (errno)
            die("pthread_create");
    }
    for (long t = 0; t < threads; t++) {
        errno = pthread_join(ws[t].tid, NULL);
        if (errno)
            die("pthread_join");
    }

    const char *corrupt = getenv("MALLOC_STRESS_CORRUPT");
    if (corrupt && *corrupt == '1') {
        struct worker *w = &ws[threads - 1];
        struct block *b = &w->blocks[w->nblocks / 2];
        b->p[b->size / 3] ^= 0x5a;
    }

    /* Verify every live block and free it, from this thread rather than its owner. */
    uint64_t verified = 0;
    for (long t = 0; t < threads; t++) {
        struct worker *w = &ws[t];
        verified += w->verified;
        for (size_t i = 0; i < w->nblocks; i++) {
            check_as(w->index, &w->blocks[i], w->blocks[i].p, w->blocks[i].size);
            verified += w->blocks[i].size;
            free(w->blocks[i].p);
        }
        free(w->blocks);
        close(w->pipefd[0]);
        close(w->pipefd[1]);
        close(w->tmpfd);
    }
    free(ws);
    printf("ok %llu\n", (unsigned long long)verified);
    return 0;
}
