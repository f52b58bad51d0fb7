/* A sampling target for tests/integration/test_perfcore.py. It announces, on stdout, its pid and the address
 * of a stack slot holding MAGIC while it spins, so a test can check a sample's user sp and stack
 * copy against ground truth: for a sample taken inside spin(), sp <= &magic < sp + dyn_size and
 * the copied stack holds MAGIC at &magic - sp.
 *
 *   busy spin MS         spin MS milliseconds of CPU time, exit 0
 *   busy wait-spin MS    read one byte from stdin first (the test's "session is open" signal)
 *   busy wait-fork MS    read one byte, fork; the grandchild spins MS ms; wait for it
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAGIC 0xfeedfacecafebeefULL

static volatile uint64_t sink;

/* The spinning thread's CPU time, not the wall clock: a per-task cpu-clock event samples the
 * time the task runs, so MS ms of it give the same number of samples however loaded the
 * machine is (a wall-clock spin on a busy shared machine got a fraction of them). */
static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

__attribute__((noinline)) static void spin(double ms)
{
    volatile uint64_t magic = MAGIC;
    printf("pid=%d local=%p\n", (int)getpid(), (void *)&magic);
    fflush(stdout);
    double end = now_ms() + ms;
    while (now_ms() < end) {
        for (uint64_t i = 0; i < 20000; i++)
            sink += magic ^ i;
    }
}

static void wait_go(void)
{
    char c;
    if (read(0, &c, 1) != 1)
        exit(3);
}

int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    double ms = atof(argv[2]);
    if (!strcmp(argv[1], "spin")) {
        spin(ms);
    } else if (!strcmp(argv[1], "wait-spin")) {
        wait_go();
        spin(ms);
    } else if (!strcmp(argv[1], "wait-fork")) {
        wait_go();
        fflush(stdout);
        pid_t pid = fork();
        if (pid < 0)
            return 4;
        if (pid == 0) {
            spin(ms);
            _exit(0);
        }
        int st;
        if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st))
            return 5;
    } else {
        return 2;
    }
    return 0;
}
