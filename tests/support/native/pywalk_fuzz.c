/* pywalk_fuzz.c: pywalk.c's unw_py_walk on a fake CPython thread built in this process's own
 * memory (runtime -> interpreter -> thread states -> cframe -> frames on a data stack and
 * elsewhere -> code headers, at the offsets of the layout given on the command line), read
 * back through process_vm_readv of this pid, then of forked children that exit mid-walk.
 *
 * Checks: the exact records of the intact chain; a cycle, a self-loop, a chain longer than
 * max_frames or than the records, garbage and truncated pointers each end with their status;
 * random byte mutations of every structure end with a valid status and records within bounds;
 * a child exiting (or unmapping its frames) while walked gives only OK / GONE (/ MOVED). The
 * records and scratch are exact-size heap buffers, so a write past them is reported by
 * AddressSanitizer or valgrind. Prints "real: ..." and "ok <checks>".
 *
 * usage: pywalk_fuzz ITERATIONS LAYOUT_FIELD... (struct unw_py_layout's fields, in order) */
#define _GNU_SOURCE
#define HARNESS_SEED 0x5157A1C0FFEEull
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "unwcore.h"

#define K 40            /* frames of the intact chain */
#define NCODE 7
#define TID 4242
#define REGION (64 * 1024)
#define BIG 16384     /* runtime and interpreter: 3.13's interpreter offsets pass 4 KiB */

static struct unw_py_layout L;
static uint8_t *runtime, *interp, *ts[3], *cframe, *stack, *far[6], *codes[NCODE];
static uint64_t frames[K];
static uint8_t *scratch;

static void put64(uint8_t *p, uint64_t off, uint64_t v) { memcpy(p + off, &v, 8); }
static uint64_t addr(const void *p) { return (uint64_t)(uintptr_t)p; }
static uint8_t *at(uint64_t a) { return (uint8_t *)(uintptr_t)a; }

static uint64_t head_bytes(void)
{
    uint64_t cf = L.ts_cframe >= 0 ? (uint64_t)L.ts_cframe : L.current_frame;
    uint64_t m = L.ts_next > L.ts_native_thread_id ? L.ts_next : L.ts_native_thread_id;
    return (m > cf ? m : cf) + 8;
}

/* The intact image: frames 0..K-1 innermost first; most on the stack region (callers below),
 * every 7th in a "far" buffer (a generator's frame), the 3.11 entry flag or a 3.12+ shim every
 * 10th. */
static void build(void)
{
    memset(runtime, 0, BIG);
    memset(interp, 0, BIG);
    put64(runtime, L.interpreters_head, addr(interp));
    put64(interp, L.interp_threads_head, addr(ts[0]));
    for (int i = 0; i < 3; i++) {
        memset(ts[i], 0, 4096);
        put64(ts[i], L.ts_native_thread_id, i == 2 ? TID : 1000 + (uint64_t)i);
        put64(ts[i], L.ts_next, i < 2 ? addr(ts[i + 1]) : 0);
    }
    memset(stack, 0, REGION);
    uint64_t fb = L.frame_bytes, pos = REGION - 2 * 4096; /* innermost highest */
    for (int i = 0; i < K; i++) {
        uint8_t *f;
        if (i % 7 == 3) {
            f = far[i % 6];
            memset(f, 0, 2048);
        } else {
            pos -= fb + 8 * (rnd() % 8);
            f = stack + pos;
        }
        frames[i] = addr(f);
    }
    for (int i = 0; i < K; i++) {
        uint8_t *f = at(frames[i]);
        int shim = L.frame_is_entry < 0 && i % 10 == 9;
        put64(f, L.frame_previous, i + 1 < K ? frames[i + 1] : 0);
        f[L.frame_owner] = shim ? 3 : 0;
        if (!shim) {
            put64(f, L.frame_code, addr(codes[i % NCODE]));
            put64(f, L.frame_instr, addr(codes[i % NCODE]) + 100 + 2 * (uint64_t)i);
            if (L.frame_is_entry >= 0)
                f[L.frame_is_entry] = i % 10 == 9;
        }
    }
    for (int c = 0; c < NCODE; c++) {
        memset(codes[c], 0, L.code_bytes);
        put64(codes[c], L.code_qualname, 0x1000 + (uint64_t)c);
        put64(codes[c], L.code_filename, 0x2000 + (uint64_t)c);
        put64(codes[c], L.code_linetable, 0x3000 + (uint64_t)c);
        uint32_t fl = 10 + (uint32_t)c;
        memcpy(codes[c] + L.code_firstlineno, &fl, 4);
    }
    if (L.ts_cframe >= 0) {
        memset(cframe, 0, 64);
        put64(ts[2], (uint64_t)L.ts_cframe, addr(cframe));
        put64(cframe, L.current_frame, frames[0]);
    } else {
        put64(ts[2], L.current_frame, frames[0]);
    }
}

static struct unw_py_job job(int pid, uint32_t max_frames)
{
    struct unw_py_job j;
    memset(&j, 0, sizeof j);
    j.lay = &L;
    j.pid = pid;
    j.tid = TID;
    j.runtime = addr(runtime);
    j.max_frames = max_frames;
    return j;
}

/* One walk of one job into an exact-size records buffer of cap; its status. */
static int32_t walk(struct unw_py_job *j, uint64_t cap, struct unw_py_rec **out)
{
    struct unw_py_rec *recs = malloc((cap ? cap : 1) * sizeof *recs);
    CHECK(recs);
    int64_t used = unw_py_walk(j, 1, recs, cap, scratch, UNW_PY_SCRATCH, NULL);
    CHECK(used >= 0 && (uint64_t)used <= cap);
    CHECK(j->status >= UNW_PY_OK && j->status <= UNW_PY_NO_THREAD);
    CHECK(j->status ? j->count == 0 : (uint64_t)j->first + j->count == (uint64_t)used);
    CHECK(j->count <= j->max_frames && j->t_ns > 0);
    if (out)
        *out = recs;
    else
        free(recs);
    return j->status;
}

static void check_intact(const struct unw_py_rec *r, uint32_t n)
{
    CHECK(n == K);
    for (int i = 0; i < K; i++) {
        int shim = L.frame_is_entry < 0 && i % 10 == 9;
        if (shim) {
            CHECK(r[i].code == 0 && r[i].flags == UNW_PY_SHIM);
            continue;
        }
        int c = i % NCODE;
        CHECK(r[i].code == addr(codes[c]));
        CHECK(r[i].instr == addr(codes[c]) + 100 + 2 * (uint64_t)i);
        CHECK(r[i].qualname == 0x1000 + (uint64_t)c && r[i].filename == 0x2000 + (uint64_t)c);
        CHECK(r[i].linetable == 0x3000 + (uint64_t)c && r[i].firstlineno == 10 + (uint32_t)c);
        CHECK(r[i].flags == (L.frame_is_entry >= 0 && i % 10 == 9 ? UNW_PY_ENTRY : 0u));
    }
}

static int32_t walk_self(uint32_t max_frames)
{
    struct unw_py_job j = job(getpid(), max_frames);
    return walk(&j, K + 8, NULL);
}

/* A pointer field set to v: the walk ends with want. */
static void expect_with(uint8_t *p, uint64_t off, uint64_t v, int32_t want)
{
    uint64_t old;
    memcpy(&old, p + off, 8);
    put64(p, off, v);
    CHECK(walk_self(128) == want);
    put64(p, off, old);
}

static void garbage(void)
{
    uint8_t *mid = at(frames[K / 2]);
    uint64_t bad[] = {0x10, 0xffff800000000000ull, 0x7fffffffffffff00ull, UINT64_MAX - 8};
    for (unsigned i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        expect_with(mid, L.frame_previous, bad[i], UNW_PY_MOVED);
        expect_with(mid, L.frame_code, bad[i], UNW_PY_MOVED);
        expect_with(ts[1], L.ts_next, bad[i], UNW_PY_MOVED);
        expect_with(runtime, L.interpreters_head, bad[i], UNW_PY_MOVED);
    }
    expect_with(mid, L.frame_code, 0, UNW_PY_MOVED);
    /* an unmapped page, and a frame that starts on a mapped page and ends on an unmapped one */
    uint8_t *pg = mmap(NULL, 3 * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(pg != MAP_FAILED);
    CHECK(munmap(pg + 4096, 4096) == 0);
    expect_with(mid, L.frame_previous, addr(pg + 4096 + 64), UNW_PY_MOVED);
    uint8_t *cut = pg + 4096 - L.frame_bytes / 2;
    memcpy(cut, at(frames[K / 2 + 1]), L.frame_bytes / 2);
    expect_with(mid, L.frame_previous, addr(cut), UNW_PY_MOVED);
    expect_with(mid, L.frame_code, addr(pg + 4096 - L.code_bytes / 2), UNW_PY_MOVED);
    /* a frame that starts on the unmapped page and ends on a mapped one */
    expect_with(mid, L.frame_previous, addr(pg + 2 * 4096 - L.frame_bytes / 2), UNW_PY_MOVED);
    /* a code header at the very end of a mapping reads; one byte further does not */
    uint8_t *edge = pg + 4096 - L.code_bytes;
    memcpy(edge, codes[0], L.code_bytes);
    expect_with(mid, L.frame_code, addr(edge), UNW_PY_OK);
    expect_with(mid, L.frame_code, addr(edge + 1), UNW_PY_MOVED);
    munmap(pg, 3 * 4096);
}

static void structure(void)
{
    /* cycles: back to the innermost frame, and a frame its own caller */
    expect_with(at(frames[K - 1]), L.frame_previous, frames[0], UNW_PY_MOVED);
    expect_with(at(frames[5]), L.frame_previous, frames[5], UNW_PY_MOVED);
    /* deeper than max_frames, or than the records */
    CHECK(walk_self(K - 1) == UNW_PY_TOO_DEEP);
    CHECK(walk_self(K) == UNW_PY_OK);
    struct unw_py_job j = job(getpid(), 128);
    CHECK(walk(&j, K - 1, NULL) == UNW_PY_TOO_DEEP);
    /* no such thread: the hint forgotten */
    j = job(getpid(), 128);
    j.tid = 77;
    j.tstate = addr(ts[0]);
    CHECK(walk(&j, K, NULL) == UNW_PY_NO_THREAD && j.tstate == 0);
    /* a stale hint (another thread's state) finds the right one; a right hint costs less */
    j = job(getpid(), 128);
    j.tstate = addr(ts[1]);
    CHECK(walk(&j, K, NULL) == UNW_PY_OK && j.tstate == addr(ts[2]));
    uint32_t searched = j.syscalls;
    CHECK(walk(&j, K, NULL) == UNW_PY_OK && j.syscalls < searched);
    /* no frame (idle thread) */
    if (L.ts_cframe >= 0)
        expect_with(ts[2], (uint64_t)L.ts_cframe, 0, UNW_PY_OK);
    expect_with(L.ts_cframe >= 0 ? cframe : ts[2], L.current_frame, 0, UNW_PY_OK);
    /* paced: each job walks no earlier than its not_before, progress counts them */
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    uint64_t now = (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
    struct unw_py_job paced[3] = {job(getpid(), 128), job(getpid(), 128), job(getpid(), 128)};
    for (int i = 0; i < 3; i++)
        paced[i].not_before = now + 2000000u * (uint64_t)i;
    struct unw_py_sync sync = {0, 0};
    struct unw_py_rec *pr = malloc(3 * K * sizeof *pr);
    CHECK(pr && unw_py_walk(paced, 3, pr, 3 * K, scratch, UNW_PY_SCRATCH, &sync) == 3 * K);
    CHECK(unw_py_progress(&sync) == 3);
    for (int i = 0; i < 3; i++) {
        CHECK(paced[i].status == UNW_PY_OK && paced[i].t_ns >= paced[i].not_before);
        CHECK(paced[i].first == (uint32_t)(i * K));
        check_intact(pr + paced[i].first, paced[i].count);
    }
    /* stopped: no job walked, none touched */
    struct unw_py_job stopped[2] = {job(getpid(), 128), job(getpid(), 128)};
    stopped[1].status = 77;
    unw_py_stop(&sync);
    sync.done = 0;
    CHECK(unw_py_walk(stopped, 2, pr, 3 * K, scratch, UNW_PY_SCRATCH, &sync) == 0);
    CHECK(unw_py_progress(&sync) == 0 && stopped[1].status == 77 && stopped[0].t_ns == 0);
    free(pr);
    /* bad arguments */
    struct unw_py_layout bad = L;
    bad.frame_bytes = 1 << 20;
    j = job(getpid(), 128);
    j.lay = &bad;
    struct unw_py_rec r[2];
    CHECK(unw_py_walk(&j, 1, r, 2, scratch, UNW_PY_SCRATCH, NULL) == -1);
    j.lay = &L;
    CHECK(unw_py_walk(&j, 1, r, 2, scratch, 1000, NULL) == -1);
    CHECK(unw_py_walk(&j, 1, r, 2, scratch + 1, UNW_PY_SCRATCH - 8, NULL) == -1);
}

/* Random byte changes anywhere in the structures: any status, never out of bounds. */
static void mutate(long iters)
{
    uint64_t st[6] = {0};
    uint8_t *areas[] = {stack, ts[2], ts[1], cframe, codes[0], far[0], runtime, interp};
    uint64_t sizes[] = {REGION, 4096, 4096, 64, L.code_bytes, 2048, BIG, BIG};
    for (long it = 0; it < iters; it++) {
        build();
        int nm = 1 + (int)(rnd() % 4);
        for (int m = 0; m < nm; m++) {
            unsigned a = (unsigned)(rnd() % 8);
            uint8_t *p = areas[a];
            uint64_t off;
            if (a == 0 && rnd() % 2) /* a field of a chain frame */
                p = at(frames[rnd() % K]), off = rnd() % L.frame_bytes;
            else
                off = rnd() % sizes[a];
            p[off] = rnd() % 3 ? (uint8_t)rnd() : (uint8_t)(p[off] ^ (1u << (rnd() % 8)));
        }
        if (rnd() % 16 == 0) /* the thread id */
            ts[2][L.ts_native_thread_id + rnd() % 4] ^= (uint8_t)(1 + rnd() % 255);
        struct unw_py_job jobs[2] = {job(getpid(), 1 + (uint32_t)(rnd() % 64)),
                                     job(getpid(), 128)};
        uint64_t cap = rnd() % 4 ? 2 * K + rnd() % K : rnd() % (2 * K);
        struct unw_py_rec *recs = malloc((cap ? cap : 1) * sizeof *recs);
        CHECK(recs);
        int64_t used = unw_py_walk(jobs, 2, recs, cap, scratch, UNW_PY_SCRATCH, NULL);
        CHECK(used >= 0 && (uint64_t)used <= cap);
        for (int i = 0; i < 2; i++) {
            CHECK(jobs[i].status >= 0 && jobs[i].status <= UNW_PY_NO_THREAD);
            CHECK(jobs[i].count <= jobs[i].max_frames);
            CHECK((uint64_t)jobs[i].first + jobs[i].count <= (uint64_t)used);
            st[jobs[i].status]++;
        }
        free(recs);
    }
    printf("mutated: ok %llu gone %llu denied %llu moved %llu too_deep %llu no_thread %llu\n",
           (unsigned long long)st[0], (unsigned long long)st[1], (unsigned long long)st[2],
           (unsigned long long)st[3], (unsigned long long)st[4], (unsigned long long)st[5]);
    CHECK(st[0] && st[3] && st[4] && st[5]);
}

/* Children (forks: the same image at the same addresses) that exit, or unmap their frames and
 * exit, while walked. */
static void exiting(int rounds)
{
    uint64_t st[6] = {0};
    for (int r = 0; r < rounds; r++) {
        int unmap = r % 2;
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            struct timespec d = {0, (long)(rnd() % 3000000)};
            if (unmap) {
                nanosleep(&d, NULL);
                munmap(stack, REGION);
            }
            nanosleep(&d, NULL);
            _exit(0);
        }
        int32_t s;
        long n = 0;
        do {
            struct unw_py_job j = job(pid, 128);
            s = walk(&j, K, NULL);
            CHECK(s == UNW_PY_OK || s == UNW_PY_GONE || (unmap && s == UNW_PY_MOVED));
            st[s]++;
            n++;
        } while (s != UNW_PY_GONE && n < 1000000); /* (a zombie reads as gone: no mm) */
        CHECK(s == UNW_PY_GONE);
        CHECK(waitpid(pid, NULL, 0) == pid);
        struct unw_py_job j = job(pid, 128);
        CHECK(walk(&j, K, NULL) == UNW_PY_GONE);
    }
    printf("exiting: ok %llu moved %llu gone %llu\n", (unsigned long long)st[0],
           (unsigned long long)st[3], (unsigned long long)st[1]);
    CHECK(st[0] > 0);
}

int main(int argc, char **argv)
{
    const int nf = (int)(sizeof L / 8);
    CHECK(argc == 2 + nf);
    long iters = atol(argv[1]);
    for (int i = 0; i < nf; i++) {
        int64_t v = strtoll(argv[2 + i], NULL, 0);
        memcpy((uint8_t *)&L + 8 * i, &v, 8);
    }
    scratch = malloc(UNW_PY_SCRATCH);
    runtime = malloc(BIG);
    interp = malloc(BIG);
    cframe = malloc(64);
    for (int i = 0; i < 3; i++)
        ts[i] = malloc(4096);
    for (int i = 0; i < 6; i++)
        far[i] = malloc(2048);
    for (int c = 0; c < NCODE; c++)
        codes[c] = malloc(L.code_bytes);
    stack = mmap(NULL, REGION, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(scratch && runtime && interp && cframe && stack != MAP_FAILED);
    CHECK(head_bytes() <= 4096);
    CHECK(L.interpreters_head + 8 <= BIG && L.interp_threads_head + 8 <= BIG);
    CHECK(L.interp_next + 8 <= BIG);

    build();
    struct unw_py_job j = job(getpid(), 128);
    struct unw_py_rec *recs;
    CHECK(walk(&j, K, &recs) == UNW_PY_OK);
    check_intact(recs + j.first, j.count);
    printf("real: frames %u syscalls %u\n", j.count, j.syscalls);
    CHECK(j.syscalls <= 12); /* thread search, cframe, windows (stack + far), code batch */
    free(recs);

    garbage();
    structure();
    exiting(20);
    mutate(iters);
    build();

    for (int i = 0; i < 3; i++)
        free(ts[i]);
    for (int i = 0; i < 6; i++)
        free(far[i]);
    for (int c = 0; c < NCODE; c++)
        free(codes[c]);
    free(scratch);
    free(runtime);
    free(interp);
    free(cframe);
    munmap(stack, REGION);
    printf("ok %llu\n", checks);
    return 0;
}
