/*
 * marker_fill: allocates SIZE bytes with malloc, fills every page with a known 16-byte
 * marker (repeated), then checks every page. With SIZE above the memory limit, the marked
 * pages go to swap; crates/uswap-cli/tests/run_programs.rs then looks for the marker in
 * the raw image of the file system that held the swap file, after the program exited.
 *
 *   cc -O2 -o marker_fill marker_fill.c
 *   marker_fill MIB
 *
 * Prints `ok <pages> pages` and exits 0, or prints the first bad page and exits 1; usage
 * and allocation errors exit 2.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PAGE 4096
static const char MARKER[16] = "uSwApMaRkEr-7f3A";

int main(int argc, char **argv)
{
    if (argc != 2 || atoi(argv[1]) <= 0) {
        fprintf(stderr, "usage: marker_fill MIB\n");
        return 2;
    }
    size_t pages = (size_t)atoi(argv[1]) * 256;
    char *buf = malloc(pages * PAGE);
    if (!buf) {
        perror("malloc");
        return 2;
    }
    for (size_t p = 0; p < pages; p++)
        for (size_t off = 0; off < PAGE; off += sizeof MARKER)
            memcpy(buf + p * PAGE + off, MARKER, sizeof MARKER);
    for (size_t p = 0; p < pages; p++)
        for (size_t off = 0; off < PAGE; off += sizeof MARKER)
            if (memcmp(buf + p * PAGE + off, MARKER, sizeof MARKER) != 0) {
                printf("page %zu offset %zu is not the marker\n", p, off);
                return 1;
            }
    printf("ok %zu pages\n", pages);
    return 0;
}
