/* SIGALRM every 10 ms (setitimer ITIMER_PROF: it counts this process's CPU time, so a busy
 * machine does not change the ratio); the handler spins for about half of each period, so
 * many samples land in handler_spin <- on_alarm <- __restore_rt <- main_spin <- main.
 * argv[1]: rounds of main_spin (default 60). */
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

#define NOIN __attribute__((noipa))

volatile uint64_t sink;
volatile sig_atomic_t alarms;

NOIN uint64_t handler_spin(uint64_t n)
{
    uint64_t acc = n;
    for (uint64_t i = 0; i < n; i++) {
        acc = acc * 6364136223846793005ULL + i;
        acc ^= acc >> 33;
    }
    return acc;
}

NOIN void on_alarm(int sig)
{
    (void)sig;
    alarms++;
    sink += handler_spin(2500000);
}

NOIN uint64_t main_spin(uint64_t n)
{
    uint64_t acc = n;
    for (uint64_t i = 0; i < n; i++) {
        acc = acc * 2862933555777941757ULL + i;
        acc ^= acc >> 29;
    }
    return acc;
}

int main(int argc, char **argv)
{
    long rounds = argc > 1 ? atol(argv[1]) : 60;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGPROF, &sa, NULL);
    struct itimerval it = {{0, 10000}, {0, 10000}};
    setitimer(ITIMER_PROF, &it, NULL);
    for (long r = 0; r < rounds; r++) sink += main_spin(2500000);
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_PROF, &off, NULL);
    return alarms > 0 ? 0 : 1;
}
