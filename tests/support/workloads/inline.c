/* inline.c: hot code inlined two levels deep into two callers, plus libc work (qsort: its
 * inlined helpers come from libc's own DWARF), for the inline-frame oracle
 * (tests/differential/test_inline_oracle.py). Built -O2 -g. */
#include <stdio.h>
#include <stdlib.h>

static inline __attribute__((always_inline)) double mix(double x, int i)
{
    for (int k = 0; k < 40; k++)
        x = x * 0.999 + i;
    return x;
}

static inline __attribute__((always_inline)) double step(double x, int i)
{
    x = mix(x, i);
    return x * 0.5 + mix(x, i + 1);
}

__attribute__((noinline)) double walk(int n)
{
    double s = 0;
    for (int i = 0; i < n; i++)
        s += step(s, i);
    return s;
}

__attribute__((noinline)) double stroll(int n)
{
    double s = 1;
    for (int i = 0; i < n; i++)
        s -= mix(s, i);
    return s;
}

static int cmp(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

__attribute__((noinline)) long sort_some(int n)
{
    int *v = malloc(sizeof(int) * (size_t)n);
    long t = 0;
    for (int r = 0; r < 4; r++) {
        for (int i = 0; i < n; i++)
            v[i] = (i * 7919 + r) % 10007;
        qsort(v, (size_t)n, sizeof(int), cmp);
        t += v[n / 2];
    }
    free(v);
    return t;
}

int main(void)
{
    double t = 0;
    long u = 0;
    for (int r = 0; r < 60; r++) {
        t += walk(100000);
        t += stroll(100000);
        u += sort_some(20000);
    }
    printf("%f %ld\n", t, u);
    return 0;
}
