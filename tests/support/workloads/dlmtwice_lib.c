/* dlmtwice_lib.c: the library dlmtwice.c maps twice (see there). */
static __attribute__((noinline)) long inner(long n)
{
    volatile long x = 0;
    for (long i = 0; i < n; i++)
        x += i;
    return x;
}

long run(long n) { return inner(n) + 1; }
