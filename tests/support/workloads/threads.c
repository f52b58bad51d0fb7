/* Three pthreads, each in its own call chain with its own thread name (one with a space, so
 * perf's "comm pid/tid" header has a comm containing a space):
 *   alpha_top -> alpha_mid -> alpha_leaf     comm "wk alpha"
 *   beta_top  -> beta_leaf                   comm "wk-beta"
 *   gamma_top -> gamma_mid -> gamma_leaf     comm "wk gamma 3"
 * The main thread only joins.  argv[1]: work units per thread (default 8).  argv[2], if given:
 * a file the main thread writes once all threads are joined, one "tid comm" line per thread,
 * main first (its tid is the pid), so a test knows every thread id the samples may carry. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define NOIN __attribute__((noipa))

static long units = 8;
static pid_t tids[3]; /* each worker's gettid(), written by the worker before it works */
volatile uint64_t sink;

static inline uint64_t mix(uint64_t n, uint64_t k)
{
    uint64_t acc = k;
    for (uint64_t i = 0; i < n; i++) {
        acc = acc * 6364136223846793005ULL + i;
        acc ^= acc >> 31;
    }
    return acc;
}

NOIN uint64_t alpha_leaf(uint64_t n) { return mix(n, 1); }
NOIN uint64_t alpha_mid(uint64_t n) { return alpha_leaf(n) + 1; }
NOIN void *alpha_top(void *arg)
{
    (void)arg;
    pthread_setname_np(pthread_self(), "wk alpha");
    tids[0] = gettid();
    for (long u = 0; u < units; u++) sink += alpha_mid(3000000);
    return NULL;
}

NOIN uint64_t beta_leaf(uint64_t n) { return mix(n, 2); }
NOIN void *beta_top(void *arg)
{
    (void)arg;
    pthread_setname_np(pthread_self(), "wk-beta");
    tids[1] = gettid();
    for (long u = 0; u < units; u++) sink += beta_leaf(3000000);
    return NULL;
}

NOIN uint64_t gamma_leaf(uint64_t n) { return mix(n, 3); }
NOIN uint64_t gamma_mid(uint64_t n) { return gamma_leaf(n) + 1; }
NOIN void *gamma_top(void *arg)
{
    (void)arg;
    pthread_setname_np(pthread_self(), "wk gamma 3");
    tids[2] = gettid();
    for (long u = 0; u < units; u++) sink += gamma_mid(3000000);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1) units = atol(argv[1]);
    pthread_t t[3];
    pthread_create(&t[0], NULL, alpha_top, NULL);
    pthread_create(&t[1], NULL, beta_top, NULL);
    pthread_create(&t[2], NULL, gamma_top, NULL);
    for (int i = 0; i < 3; i++) pthread_join(t[i], NULL);
    if (argc > 2) {
        static const char *const names[3] = {"wk alpha", "wk-beta", "wk gamma 3"};
        FILE *f = fopen(argv[2], "w");
        if (!f) return 1;
        fprintf(f, "%d threads\n", (int)gettid());
        for (int i = 0; i < 3; i++) fprintf(f, "%d %s\n", (int)tids[i], names[i]);
        if (fclose(f)) return 1;
    }
    return 0;
}
