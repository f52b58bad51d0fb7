/* The shared library dlmain loads and unloads: dl_entry -> dl_inner -> dl_hot. */
#include <stdint.h>

#define NOIN __attribute__((noipa))

NOIN static uint64_t dl_hot(uint64_t n, uint64_t k)
{
    uint64_t acc = k;
    for (uint64_t i = 0; i < n; i++) {
        acc = acc * 2862933555777941757ULL + i;
        acc ^= acc >> 27;
    }
    return acc;
}

NOIN static uint64_t dl_inner(uint64_t n, uint64_t k) { return dl_hot(n, k) + 1; }

NOIN uint64_t dl_entry(uint64_t n, uint64_t k) { return dl_inner(n, k) + 1; }
