/* Fork/exec storm: runs PROG ARGS COUNT times, at most CONC at once, one start every
 * INTERVAL_US microseconds (0: as fast as possible).  Reaps everything; exits 1 if any child
 * failed.
 * usage: storm COUNT CONCURRENCY INTERVAL_US PROG [ARGS...] */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int reap(int *bad)
{
    int st;
    pid_t p = wait(&st);
    if (p < 0) return 0;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) *bad = 1;
    return 1;
}

int main(int argc, char **argv)
{
    if (argc < 5) { fprintf(stderr, "usage: storm COUNT CONC INTERVAL_US PROG [ARGS...]\n"); return 2; }
    long count = atol(argv[1]), conc = atol(argv[2]), interval = atol(argv[3]);
    long running = 0;
    int bad = 0;
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    for (long i = 0; i < count; i++) {
        while (running >= conc && reap(&bad)) running--;
        if (interval > 0) {
            next.tv_nsec += interval * 1000;
            while (next.tv_nsec >= 1000000000L) { next.tv_nsec -= 1000000000L; next.tv_sec++; }
            clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
        }
        pid_t p = fork();
        if (p < 0) { perror("fork"); bad = 1; break; }
        if (p == 0) {
            execv(argv[4], &argv[4]);
            perror("execv");
            _exit(127);
        }
        running++;
    }
    while (running > 0 && reap(&bad)) running--;
    return bad;
}
