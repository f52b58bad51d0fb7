/* A short-lived process that still does a little work in a known call chain:
 * main -> a -> b -> c -> spin, no frame pointers (only DWARF CFI unwinds it), the same
 * names as chain.c so the live tests' CHAINS grade it. No libc calls in the hot path, so
 * every sample inside the work has exactly that chain.
 *
 * argv[1]: iterations of spin's loop (default 300000: ~0.3-0.6 ms of CPU). Fixed work, not
 * wall time. Run by churn.c hundreds of times a second (issue 4: "500 short-lived processes
 * per second"), where fork+exec of chain.c (~5 ms each) would need more CPUs than a 2-vCPU
 * machine has. */
#include <stdint.h>
#include <stdlib.h>

#define NOIN __attribute__((noinline, noclone))

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

NOIN uint64_t c(uint64_t n) { return spin(n) + 1; }
NOIN uint64_t b(uint64_t n) { return c(n) + 1; }
NOIN uint64_t a(uint64_t n) { return b(n) + 1; }

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 300000;
    sink += a((uint64_t)n);
    return 0;
}
