/* dlopen/dlclose loop whose library moves between loads: after each dlclose an anonymous
 * PROT_NONE placeholder is mapped (and kept) where the library was, so the next dlopen lands
 * at another address.  Each load calls dl_entry -> dl_inner -> dl_hot through call_lib, and
 * prints the address dl_entry had, one line per load.
 * argv[1]: library; argv[2]: loads (default 12); argv[3]: calls per load (default 4). */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

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
    if (argc < 2) { fprintf(stderr, "usage: dlmove LIB [loads] [calls]\n"); return 2; }
    long loads = argc > 2 ? atol(argv[2]) : 12;
    long calls = argc > 3 ? atol(argv[3]) : 4;
    for (long load = 0; load < loads; load++) {
        void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
        if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 1; }
        entry_fn f = (entry_fn)dlsym(h, "dl_entry");
        if (!f) { fprintf(stderr, "dlsym: %s\n", dlerror()); return 1; }
        printf("%p\n", (void *)f);
        fflush(stdout);
        sink += call_lib(f, calls);
        if (dlclose(h) != 0) { fprintf(stderr, "dlclose: %s\n", dlerror()); return 1; }
        /* plug the hole the library left with small placeholders (kept), so the next load
         * has to go elsewhere: mmap fills the highest gap that fits first */
        for (int k = 0; k < 8; k++)
            if (mmap(NULL, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) == MAP_FAILED) {
                perror("mmap");
                return 1;
            }
    }
    return 0;
}
