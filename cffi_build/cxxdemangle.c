/* cxxdemangle.c: libstdc++'s __cxa_demangle for demangle.py, found with dlopen/dlsym on
 * first use.
 *
 * Why: through ctypes, demangling the C++ symbols of a replay cost ~8 ms (importing ctypes,
 * loading the library through it, ~5 us of argument marshalling a call); the native module is
 * loaded anyway and a cffi call costs well under a microsecond. The same function of the same
 * library is called either way, so the names are the same (demangle.py keeps ctypes as its
 * fallback where this finds no libstdc++).
 *
 * Invariants: reads the NUL-terminated name and writes at most cap bytes of out; frees what
 * __cxa_demangle returns; the library is looked up once per process (pthread_once: callers
 * may run on several threads, cffi releasing the GIL).
 * Cost: one __cxa_demangle call and one copy of its result.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "unwcore.h"

typedef char *(*cxa_demangle_fn)(const char *, char *, size_t *, int *);
static cxa_demangle_fn cxa;
static pthread_once_t cxa_once = PTHREAD_ONCE_INIT;

static void cxa_load(void)
{
    /* the soname, as demangle.py's ctypes path tries first; never unloaded */
    void *h = dlopen("libstdc++.so.6", RTLD_LAZY | RTLD_LOCAL);
    if (h)
        cxa = (cxa_demangle_fn)dlsym(h, "__cxa_demangle");
}

int64_t unw_cxa_demangle(const char *name, char *out, uint64_t cap)
{
    pthread_once(&cxa_once, cxa_load);
    if (!cxa)
        return -1;
    int status = 0;
    char *s = cxa(name, NULL, NULL, &status);
    if (!s)
        return -2;
    if (status != 0) {
        free(s);
        return -2;
    }
    size_t n = strlen(s);
    if (n > cap || n > (size_t)INT64_MAX - 3) {
        free(s);
        return -3 - (int64_t)n;
    }
    memcpy(out, s, n);
    free(s);
    return (int64_t)n;
}
