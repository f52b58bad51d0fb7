/* Loads argv[1] (a shared library) with dlopen three times; each time it calls dl_entry
 * through call_lib for a while, then dlcloses it, so the recording holds three MMAP2 records
 * for the same .so with munmaps in between.  argv[2]: calls per load (default 6). */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define NOIN __attribute__((noipa))

typedef uint64_t (*entry_fn)(uint64_t, uint64_t);
volatile uint64_t sink;

NOIN uint64_t call_lib(entry_fn f, long calls)
{
    uint64_t acc = 0;
    for (long i = 0; i < calls; i++) acc += f(3000000, (uint64_t)i);
    return acc;
}

int main(int argc, char **argv)
{
    if (argc < 2) { fprintf(stderr, "usage: dlmain LIB [calls]\n"); return 2; }
    long calls = argc > 2 ? atol(argv[2]) : 6;
    for (int load = 0; load < 3; load++) {
        void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
        if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 1; }
        entry_fn f = (entry_fn)dlsym(h, "dl_entry");
        if (!f) { fprintf(stderr, "dlsym: %s\n", dlerror()); return 1; }
        sink += call_lib(f, calls);
        if (dlclose(h) != 0) { fprintf(stderr, "dlclose: %s\n", dlerror()); return 1; }
    }
    return 0;
}
