/* fork without exec, checked: a parent fills SIZE bytes of malloc'd memory (several times
 * the limit uswap run gives it) and an mmap'd block, then forks CHILDREN children while a
 * thread keeps writing memory of its own. Each child checks every byte it inherited,
 * writes a pattern of its own over all of it, checks that, forks a grandchild that checks
 * the child's pattern, and exits 0 only if everything matched. A stream is open across
 * the forks, and written on both sides. The parent checks that its
 * memory is untouched by the children and prints "ok <children> children <bytes> bytes".
 *
 * usage: fork_verify CHILDREN SIZE[K|M|G]; exit 1 on a mismatch (with a line saying where),
 * 2 on a usage or system error. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define CHUNK (256 * 1024)

static uint64_t word(uint64_t chunk, uint64_t i, uint64_t version) {
    uint64_t x = (chunk << 32) ^ (i << 8) ^ version;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static void fill(uint64_t *p, uint64_t chunk, uint64_t version) {
    for (uint64_t i = 0; i < CHUNK / 8; i++) p[i] = word(chunk, i, version);
}

static int check(const char *who, uint64_t *p, uint64_t chunk, uint64_t version) {
    for (uint64_t i = 0; i < CHUNK / 8; i++) {
        if (p[i] != word(chunk, i, version)) {
            printf("%s: mismatch chunk %llu word %llu version %llu\n", who,
                   (unsigned long long)chunk, (unsigned long long)i,
                   (unsigned long long)version);
            fflush(stdout);
            return 0;
        }
    }
    return 1;
}

static uint64_t **chunks;
static size_t nchunks;
static uint64_t *mapped; /* one chunk from mmap */

static int check_all(const char *who, uint64_t version) {
    for (size_t c = 0; c < nchunks; c++)
        if (!check(who, chunks[c], c, version)) return 0;
    return check(who, mapped, nchunks, version);
}

static void fill_all(uint64_t version) {
    for (size_t c = 0; c < nchunks; c++) fill(chunks[c], c, version);
    fill(mapped, nchunks, version);
}

static volatile int stop;

/* Writes memory of its own while the main thread forks: the children must not care. */
static void *churn(void *arg) {
    (void)arg;
    uint64_t *mine = malloc(4 * CHUNK);
    for (uint64_t v = 100; !stop; v++) {
        for (int c = 0; c < 4; c++) fill(mine + c * CHUNK / 8, 1000 + c, v);
        void *junk = malloc(4096 + v % 8192);
        free(junk);
    }
    free(mine);
    return NULL;
}

static int wait_ok(pid_t pid, const char *who) {
    int status;
    if (waitpid(pid, &status, 0) != pid) { perror("waitpid"); exit(2); }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        printf("%s %d failed: status %#x\n", who, (int)pid, status);
        return 0;
    }
    return 1;
}

/* An open stream: the C library resets its lock in a fork child before any handler. */
static FILE *journal;

static int child(int n) {
    if (fprintf(journal, "child %d\n", n) < 0 || fflush(journal) != 0) return 2;
    if (!check_all("child", 1)) return 1;
    uint64_t version = 10 + n;
    fill_all(version);
    if (!check_all("child", version)) return 1;
    pid_t pid = fork();
    if (pid < 0) { perror("fork"); return 2; }
    if (pid == 0) _exit(check_all("grandchild", version) ? 0 : 1);
    if (!wait_ok(pid, "grandchild")) return 1;
    return check_all("child", version) ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: fork_verify CHILDREN SIZE\n"); return 2; }
    int children = atoi(argv[1]);
    char *end;
    unsigned long long size = strtoull(argv[2], &end, 10);
    if (*end == 'K') size <<= 10; else if (*end == 'M') size <<= 20; else if (*end == 'G') size <<= 30;
    nchunks = size / CHUNK;
    chunks = calloc(nchunks, sizeof *chunks);
    for (size_t c = 0; c < nchunks; c++) {
        chunks[c] = malloc(CHUNK);
        if (!chunks[c]) { perror("malloc"); return 2; }
    }
    mapped = mmap(NULL, CHUNK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) { perror("mmap"); return 2; }
    fill_all(1);
    journal = tmpfile();
    if (!journal || fprintf(journal, "parent\n") < 0) { perror("tmpfile"); return 2; }
    pthread_t t;
    pthread_create(&t, NULL, churn, NULL);
    int ok = 1;
    for (int n = 0; n < children && ok; n++) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid < 0) { perror("fork"); return 2; }
        if (pid == 0) _exit(child(n));
        ok = wait_ok(pid, "child") && check_all("parent", 1);
    }
    stop = 1;
    pthread_join(t, NULL);
    if (!ok) return 1;
    printf("ok %d children %llu bytes\n", children, (unsigned long long)nchunks * CHUNK);
    return 0;
}
