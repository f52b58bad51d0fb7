/* main -> ticks -> clock_gettime(CLOCK_MONOTONIC), the vDSO's fast path (no syscall), for
 * about 0.3 s of CPU: most samples' leaf is [vdso] code, at the same few addresses of the
 * vdso image in every process, which the kernel maps at another address in each. For the
 * replay tests of [vdso] frames (tests/differential/test_filereplay.py); built with frame
 * pointers so that perf record -g walks it too. */
#include <stdint.h>
#include <time.h>

volatile uint64_t sink;

__attribute__((noinline)) void ticks(int n)
{
    struct timespec t;
    for (int i = 0; i < n; i++) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        sink += (uint64_t)t.tv_nsec;
    }
}

int main(void)
{
    struct timespec cpu;
    do {
        ticks(1000);
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu);
    } while (cpu.tv_sec == 0 && cpu.tv_nsec < 300000000);
    return 0;
}
