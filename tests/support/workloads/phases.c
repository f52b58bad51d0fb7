/*
 * Two phases with their own functions: first_phase runs from main's start for a quarter of the
 * work, second_phase for the rest; argv[1] scales the work (default 20M iterations), argv[2] is
 * the exit status.
 */
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
NOIN uint64_t first_phase(uint64_t n) { return spin(n) + 1; }
NOIN uint64_t second_phase(uint64_t n) { return spin(n) + 2; }
int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 20000000;
    sink += first_phase(n);
    sink += second_phase(3 * n);
    return argc > 2 ? atoi(argv[2]) : 0;
}
