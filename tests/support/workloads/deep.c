/* dive recursing to a depth that changes every round (a fixed pseudo-random sequence, 16 to
 * 175 levels), spin at the bottom: samples land at many depths, each a stack of its own, up
 * to ~180 frames deep, so a query's JSON answer of a second of it runs to megabytes (the
 * daemon's answers written in chunks). The store after the call keeps dive from being a tail
 * call or a loop.  argv[1]: rounds (default 400). */
#include <stdint.h>
#include <stdlib.h>

#define NOIN __attribute__((noipa))

volatile uint64_t sink;

NOIN uint64_t spin(uint64_t n)
{
    uint64_t acc = sink;
    for (uint64_t i = 0; i < n; i++) {
        acc = acc * 6364136223846793005ULL + i;
        acc ^= acc >> 29;
    }
    return acc;
}

NOIN uint64_t dive(int depth, uint64_t n)
{
    if (depth == 0)
        return spin(n);
    uint64_t r = dive(depth - 1, n);
    sink = r;
    return r + (uint64_t)depth;
}

int main(int argc, char **argv)
{
    long rounds = argc > 1 ? atol(argv[1]) : 400;
    uint64_t x = 12345;
    for (long r = 0; r < rounds; r++) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        sink += dive(16 + (int)((x >> 33) % 160), 1000000);
    }
    return 0;
}
