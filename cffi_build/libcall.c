/* libcall.c: the libc and libstdc++ functions the Python side would otherwise reach through
 * ctypes: libstdc++'s __cxa_demangle (demangle.py; found with dlopen/dlsym on first use),
 * libiberty's cplus_demangle from a shared library that exports it (demangle.py finds it) and
 * glibc's malloc_trim (elfcache.py).
 *
 * Why: ctypes costs a replay its import, and argument marshalling on every call (demangling
 * makes one call per distinct mangled name); the native module is loaded anyway and a cffi
 * call costs far less. The same functions of the same libraries are called, so the
 * results are the same (demangle.py keeps ctypes as its fallback where no libstdc++ is found
 * here).
 *
 * Invariants: unw_cxa_demangle reads the NUL-terminated name and writes at most cap bytes of
 * out; it frees what __cxa_demangle returns; the library is looked up once per process
 * (pthread_once: callers may run on several threads, cffi releasing the GIL).
 * Cost: one __cxa_demangle call and one copy of its result; malloc_trim(0) as glibc's.
 */
#include <dlfcn.h>
#include <malloc.h>
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

/* A demangler's malloc'd answer s copied to out (cap bytes, no NUL) and freed: its length, or
 * -3 - length when it does not fit (the caller retries with that much room). */
static int64_t take_name(char *s, char *out, uint64_t cap)
{
    size_t n = strlen(s);
    if (n > cap || n > (size_t)INT64_MAX - 3) {
        free(s);
        return -3 - (int64_t)n;
    }
    memcpy(out, s, n);
    free(s);
    return (int64_t)n;
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
    return take_name(s, out, cap);
}

/* libiberty's cplus_demangle, as exported by a shared library that links libiberty in (GNU
 * binutils' libbfd): the demangler perf 6.1 calls (tools/perf/util/symbol-elf.c
 * demangle_sym, through bfd_demangle or cplus_demangle). The path is found by demangle.py;
 * the library is opened once (the first path given wins) and never unloaded. */
typedef char *(*cplus_demangle_fn)(const char *, int);
static cplus_demangle_fn iberty;
static pthread_mutex_t iberty_lock = PTHREAD_MUTEX_INITIALIZER;

int unw_iberty_open(const char *path)
{
    pthread_mutex_lock(&iberty_lock);
    if (!iberty) {
        void *h = dlopen(path, RTLD_LAZY | RTLD_LOCAL);
        cplus_demangle_fn fn = h ? (cplus_demangle_fn)dlsym(h, "cplus_demangle") : NULL;
        if (fn)
            __atomic_store_n(&iberty, fn, __ATOMIC_RELEASE);
        else if (h)
            dlclose(h);
    }
    int ok = iberty ? 0 : -1;
    pthread_mutex_unlock(&iberty_lock);
    return ok;
}

int64_t unw_iberty_demangle(const char *name, int options, char *out, uint64_t cap)
{
    cplus_demangle_fn fn = __atomic_load_n(&iberty, __ATOMIC_ACQUIRE);
    if (!fn)
        return -1;
    char *s = fn(name, options);
    if (!s)
        return -2;
    return take_name(s, out, cap);
}

int unw_malloc_trim(int dry)
{
#ifdef __GLIBC__
    if (!dry)
        malloc_trim(0);
    return 0;
#else
    (void)dry;
    return -1;
#endif
}
