/* Works in el_a -> el_b -> el_spin, then execs itself with one round fewer, argv[1] times; the
 * last image execs argv[2..] (if given).  Every exec replaces the whole address space (and,
 * with ASLR, moves it), so samples after each exec need the new image's mappings only.
 * argv[0] must be a path to this program; argv[1]: execs left; argv[2]: work per image. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define NOIN __attribute__((noipa))

volatile uint64_t sink;

NOIN uint64_t el_spin(uint64_t n)
{
    uint64_t acc = sink;
    for (uint64_t i = 0; i < n; i++) {
        acc = acc * 6364136223846793005ULL + i;
        acc ^= acc >> 31;
    }
    return acc;
}

NOIN uint64_t el_b(uint64_t n) { return el_spin(n) + 1; }
NOIN uint64_t el_a(uint64_t n) { return el_b(n) + 1; }

int main(int argc, char **argv)
{
    if (argc < 3) { fprintf(stderr, "usage: execloop LEFT WORK [PROG ARGS...]\n"); return 2; }
    long left = atol(argv[1]);
    sink += el_a((uint64_t)atoll(argv[2]));
    if (left > 0) {
        char buf[32];
        snprintf(buf, sizeof buf, "%ld", left - 1);
        argv[1] = buf;
        execv(argv[0], argv); /* argv[0] is a path: keep the comm */
        perror("execv self");
        return 1;
    }
    if (argc > 3) {
        execv(argv[3], &argv[3]);
        perror("execv");
        return 1;
    }
    return 0;
}
