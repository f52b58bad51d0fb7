/* Sampling target for tests/integration/test_unwinder.py: a fixed call chain main -> a -> b -> c -> spin,
 * built -O2 -fomit-frame-pointer so only DWARF CFI can unwind it.
 *
 *   unw_chain chain ITER     read one byte from stdin (the "session is open" signal), then spin
 *   unw_chain signal ITER    same, but the spinning happens inside a SIGALRM handler that
 *                            interrupts interrupted(): hspin <- handler <- __restore_rt <-
 *                            interrupted <- main
 *
 * Every function does work after its call, so gcc cannot turn the call into a tail jump and
 * drop a frame; noinline/noclone keep each function a real symbol.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

#define NOINL __attribute__((noinline, noclone))

static volatile unsigned long sink;
static volatile int done;
static unsigned long iters;

NOINL unsigned long spin(unsigned long n)
{
    for (unsigned long i = 0; i < n; i++)
        sink += i ^ (sink >> 3);
    return sink;
}

NOINL unsigned long c(unsigned long n) { unsigned long r = spin(n); sink += r; return r + 1; }
NOINL unsigned long b(unsigned long n) { unsigned long r = c(n); sink ^= r; return r + 2; }
NOINL unsigned long a(unsigned long n) { unsigned long r = b(n); sink -= r; return r + 3; }

NOINL unsigned long hspin(unsigned long n) { unsigned long r = spin(n); sink += r; return r; }

NOINL void handler(int sig)
{
    (void)sig;
    sink += hspin(iters);
    done = 1;
}

NOINL void interrupted(void)
{
    while (!done)
        sink++;
}

static void wait_go(void)
{
    char ch;
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    if (read(0, &ch, 1) != 1)
        exit(2);
}

int main(int argc, char **argv)
{
    if (argc < 3)
        return 2;
    iters = strtoul(argv[2], 0, 10);
    if (!strcmp(argv[1], "chain")) {
        wait_go();
        sink += a(iters);
    } else if (!strcmp(argv[1], "signal")) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = handler;
        sigaction(SIGALRM, &sa, 0);
        wait_go();
        struct itimerval it = {{0, 0}, {0, 2000}}; /* one shot, 2 ms */
        setitimer(ITIMER_REAL, &it, 0);
        interrupted();
    } else {
        return 2;
    }
    printf("%lu\n", sink & 1);
    return 0;
}
