/* Process churn at a fixed rate: posix_spawn (vfork+exec in glibc: no page-table copy, so the
 * spawner stays cheap at hundreds of starts a second) of PROG ARGS, one start every
 * 1/RATE s on an absolute schedule, at most CONC alive at once, for SECONDS.
 *
 * Children are reaped as soon as they exit (SIGCHLD blocked and waited for with
 * sigtimedwait between starts), so "lifetime" = spawn call to reap is the child's real life
 * plus a scheduling delay, an upper bound. On stdout, one JSON object:
 *   started, failed, wall_s, rate (achieved starts/s), behind_ms (how late the last start was
 *   against the schedule), life_ms {p50, p99, max}, over_50ms (children that lived longer),
 *   conc_waits (starts delayed because CONC were alive), children_cpu_s (utime+stime).
 * Exit status 1 if any child failed or could not be spawned. With -w, waits for a line (or
 * EOF) on stdin first, so a profiler can attach to this pid before the first child. With
 * -n K, PROG is a printf pattern with one %ld, run as (i % K): K distinct binaries (copies
 * without a build-id are K ELF cache entries), to exercise the cache's byte cap.
 * usage: churn [-w] [-n K] RATE SECONDS CONC PROG [ARGS...] */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define MAXCONC 256

static pid_t slot_pid[MAXCONC];
static int64_t slot_t0[MAXCONC];
static long running, failed;
static uint32_t *life_us;
static long nlife;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void reaped(pid_t p, int st)
{
    int64_t t = now_ns();
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) failed++;
    for (int i = 0; i < MAXCONC; i++) {
        if (slot_pid[i] == p) {
            slot_pid[i] = 0;
            life_us[nlife++] = (uint32_t)((t - slot_t0[i]) / 1000);
            running--;
            return;
        }
    }
}

static void reap_ready(void)
{
    int st;
    pid_t p;
    while (running > 0 && (p = waitpid(-1, &st, WNOHANG)) > 0) reaped(p, st);
}

/* wait for SIGCHLD until deadline_ns (or forever if < 0), reaping whatever exited */
static void wait_until(int64_t deadline_ns, const sigset_t *chld)
{
    for (;;) {
        reap_ready();
        int64_t left = deadline_ns < 0 ? 1000000000 : deadline_ns - now_ns();
        if (deadline_ns >= 0 && left <= 0) return;
        if (deadline_ns < 0 && running == 0) return;
        struct timespec ts = {left / 1000000000, left % 1000000000};
        if (sigtimedwait(chld, NULL, &ts) < 0 && errno != EAGAIN && errno != EINTR) return;
        if (deadline_ns < 0) { reap_ready(); return; }
    }
}

static int cmp_u32(const void *x, const void *y)
{
    uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
    return (a > b) - (a < b);
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "-w") == 0) {
        char line[16];
        if (!fgets(line, sizeof line, stdin)) { /* EOF also means go */ }
        argv++;
        argc--;
    }
    long variants = 0;
    if (argc > 2 && strcmp(argv[1], "-n") == 0) {
        variants = atol(argv[2]);
        argv += 2;
        argc -= 2;
    }
    if (argc < 5) { fprintf(stderr, "usage: churn [-w] [-n K] RATE SECONDS CONC PROG [ARGS...]\n"); return 2; }
    double rate = atof(argv[1]), seconds = atof(argv[2]);
    long conc = atol(argv[3]);
    if (rate <= 0 || seconds <= 0 || conc < 1 || conc > MAXCONC) { fprintf(stderr, "bad args\n"); return 2; }
    long count = (long)(rate * seconds + 0.5);
    life_us = calloc((size_t)count + 1, sizeof *life_us);
    if (!life_us) return 2;

    sigset_t chld, empty;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigemptyset(&empty);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setsigmask(&attr, &empty);  /* the child must not inherit our blocked SIGCHLD */
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);

    int64_t period = (int64_t)(1e9 / rate), t_start = now_ns(), behind = 0;
    long conc_waits = 0, started = 0;
    for (long i = 0; i < count; i++) {
        int64_t due = t_start + i * period;
        wait_until(due, &chld);
        while (running >= conc) { conc_waits++; wait_until(-1, &chld); }
        int slot = 0;
        while (slot_pid[slot] != 0) slot++;
        int64_t t0 = now_ns();
        behind = t0 - due;
        pid_t p;
        char prog[4096];
        if (variants > 0) snprintf(prog, sizeof prog, argv[4], i % variants);
        else snprintf(prog, sizeof prog, "%s", argv[4]);
        int err = posix_spawn(&p, prog, NULL, &attr, &argv[4], environ);
        if (err != 0) { fprintf(stderr, "posix_spawn: %s\n", strerror(err)); failed++; break; }
        slot_pid[slot] = p;
        slot_t0[slot] = t0;
        running++;
        started++;
    }
    while (running > 0) wait_until(-1, &chld);
    int64_t wall = now_ns() - t_start;

    qsort(life_us, (size_t)nlife, sizeof *life_us, cmp_u32);
    long over = 0;
    for (long i = 0; i < nlife; i++) over += life_us[i] > 50000;
    struct rusage ru;
    getrusage(RUSAGE_CHILDREN, &ru);
    double cpu = ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
    double p50 = nlife ? life_us[nlife / 2] / 1e3 : 0, p99 = nlife ? life_us[(nlife * 99) / 100] / 1e3 : 0;
    double mx = nlife ? life_us[nlife - 1] / 1e3 : 0;
    printf("{\"started\": %ld, \"failed\": %ld, \"wall_s\": %.3f, \"rate\": %.1f, \"behind_ms\": %.1f, "
           "\"life_ms\": {\"p50\": %.2f, \"p99\": %.2f, \"max\": %.2f}, \"over_50ms\": %ld, "
           "\"conc_waits\": %ld, \"children_cpu_s\": %.3f}\n",
           started, failed, wall / 1e9, started / (wall / 1e9), behind / 1e6, p50, p99, mx, over,
           conc_waits, cpu);
    return failed != 0;
}
