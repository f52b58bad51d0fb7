/* dlmtwice.c: one process maps the same shared library twice (dlopen, and dlmopen into a new
 * link-map namespace) and alternates calls into the two copies: the same code frames at two
 * load addresses. Built with a stripped copy of dlmtwice_lib.c (no symbols), so its frames stay
 * unnamed: tests/differential/test_filereplay.py checks the native replay counts them as the reference path
 * does (once per address space and distinct pcs).
 *
 * usage: dlmtwice LIB.so */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

typedef long (*fn_t)(long);

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    void *a = dlopen(argv[1], RTLD_NOW);
    void *b = dlmopen(LM_ID_NEWLM, argv[1], RTLD_NOW);
    if (!a || !b) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    fn_t f[2] = {(fn_t)dlsym(a, "run"), (fn_t)dlsym(b, "run")};
    if (!f[0] || !f[1])
        return 1;
    long s = 0;
    for (long i = 0; i < 400; i++)
        s += f[i & 1](1000000);
    return (int)(s & 1);
}
