/* pywalk.c: the frame-chain walk of CPython 3.11+ threads in another process (the hot part of
 * daemon/unwindd/procs/pyframes.py's Interpreter.walk), read with process_vm_readv(2) in
 * batches: thread state -> current frame -> previous ... -> each frame's code object header.
 * procs/pywalk.py calls it; pyframes.py decodes names, files and lines from what it returns.
 *
 * Why C: the daemon's reader thread walks each sampled thread every few ms. In Python every step
 * of a walk needs the GIL, which the event loop holds most of the time on a loaded machine; a
 * cffi API-mode call releases the GIL, so a walk here runs while the loop runs, and the reader
 * takes the GIL once per batch of walks (unw_py_walk takes many jobs) instead of once per step.
 *
 * Layouts: the offsets come in struct unw_py_layout, filled from pyframes.py's Layout (the
 * structs of Include/internal/pycore_{runtime,interp,frame,code}.h and cpython/pystate.h, or a
 * 3.13 process's own _Py_DebugOffsets); nothing here knows a version.
 *
 * Batching: 3.11+ push frames on the thread's data stack (pycore_frame.h _PyStackChunk, frames
 * growing upwards), so a frame's callers sit just below it. A frame outside the windows already
 * read brings a window of WIN bytes ending at the frame's end, read page by page downwards in
 * one call (a partial read stops at the first unmapped page: the rest of the window is what did
 * read); generator frames and shims elsewhere bring windows of their own. Then the code headers
 * of the distinct code objects are read in one call per CODE_BATCH.
 *
 * Invariants: every remote address goes through the kernel (never dereferenced here); an
 * address of 0 or >= 2^63, a read that falls short, a cycle (a frame seen twice), more than
 * max_frames frames or more records than the caller's buffer end the job with a status, never
 * a crash; writes only the caller's recs (within cap), jobs and scratch.
 * Pacing: a job's not_before makes the walk sleep until then (clock_nanosleep), so one call
 * can read the same threads every few ms for a while with no GIL at all; struct unw_py_sync
 * publishes each finished job to another thread, which may also end the batch early.
 * Cost per job: O(frames) time; syscalls: one per thread state visited (one when the caller's
 * hint still has the tid), one for 3.11/3.12's cframe, one per window, one per CODE_BATCH
 * distinct code objects; no allocation.
 * Beside the walk, unw_py_short_slice: the walking thread asks the scheduler for a short slice
 * (its reads are as timely as its wakeups).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "unwcore.h"

#define PAGE 4096u
#define WIN 16384u           /* one window: pycore_frame.h's first data stack chunk's size */
#define NWIN 4
#define WIN_IOV (WIN / PAGE + 1)
#define CODE_BATCH 256
#define CODE_HASH 512        /* slots: twice CODE_BATCH */
#define MAX_CODE_BYTES 256   /* a code header the layout asks for; 3.11-3.13 need < 200 */
#define MAX_FRAME_BYTES 1024
#define MAX_HEAD_BYTES 4096  /* the thread state's head: its next, tid and cframe fields */
#define OWNED_BY_CSTACK 3    /* pycore_frame.h FRAME_OWNED_BY_CSTACK (3.12, 3.13) */
#define ADDR_LIMIT (1ull << 63)

/* scratch: the visited-frame set, the windows, the code headers of one batch, its code set */
#define SEEN_SLOTS (2 * UNW_PY_MAX_FRAMES)
#define OFF_SEEN 0
#define OFF_WIN (OFF_SEEN + SEEN_SLOTS * 8)
#define OFF_CODES (OFF_WIN + NWIN * WIN)
#define OFF_CKEYS (OFF_CODES + CODE_BATCH * MAX_CODE_BYTES)
#define OFF_CIDX (OFF_CKEYS + CODE_HASH * 8)
#define SCRATCH_NEED (OFF_CIDX + CODE_HASH * 2)

_Static_assert(SCRATCH_NEED <= UNW_PY_SCRATCH, "UNW_PY_SCRATCH holds the walk's scratch");

struct window {
    uint64_t base, lo, hi; /* buf[0] is base; [lo, hi) read */
    uint8_t *buf;
};

struct walk {
    const struct unw_py_layout *lay;
    int pid;
    uint32_t syscalls;
    uint64_t *seen;
    uint32_t seen_mask;
    struct window win[NWIN];
    uint32_t next_win;
    uint8_t *codes;
    uint64_t *ckeys;
    uint16_t *cidx;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t u64at(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static uint32_t u32at(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static int ok_range(uint64_t addr, uint64_t n)
{
    return addr && addr < ADDR_LIMIT && n < ADDR_LIMIT - addr;
}

/* The status of a call that returned got of want bytes (errno when got < 0), as
 * pyframes.ProcessMemory reads it: ESRCH gone, EPERM denied, else (EFAULT, short) moved. */
static int32_t read_status(ssize_t got, uint64_t want, int err)
{
    if (got >= 0 && (uint64_t)got == want)
        return UNW_PY_OK;
    if (got < 0 && err == ESRCH)
        return UNW_PY_GONE;
    if (got < 0 && err == EPERM)
        return UNW_PY_DENIED;
    return UNW_PY_MOVED;
}

static ssize_t vm_read(struct walk *w, const struct iovec *loc, const struct iovec *rem,
                       unsigned long n, int *err)
{
    w->syscalls++;
    errno = 0;
    ssize_t got = process_vm_readv(w->pid, loc, n, rem, n, 0);
    *err = errno;
    return got;
}

/* n bytes at addr into out: one call. */
static int32_t read_one(struct walk *w, uint64_t addr, void *out, uint64_t n)
{
    if (!ok_range(addr, n))
        return UNW_PY_MOVED;
    struct iovec loc = {out, n}, rem = {(void *)(uintptr_t)addr, n};
    int err;
    ssize_t got = vm_read(w, &loc, &rem, 1, &err);
    return read_status(got, n, err);
}

/* The fb bytes of the frame at addr, from a window already read or from a new one. */
static int32_t frame_bytes(struct walk *w, uint64_t addr, uint64_t fb, const uint8_t **out)
{
    if (!ok_range(addr, fb))
        return UNW_PY_MOVED;
    uint64_t top = addr + fb;
    for (int i = 0; i < NWIN; i++) {
        struct window *x = &w->win[i];
        if (x->hi && addr >= x->lo && top <= x->hi) {
            *out = x->buf + (addr - x->base);
            return UNW_PY_OK;
        }
    }
    struct window *x = &w->win[w->next_win];
    w->next_win = (w->next_win + 1) % NWIN;
    uint64_t base = top > WIN ? top - WIN : 1;
    /* pages from the top down: a short read has read the top part, down to a page boundary */
    struct iovec loc[WIN_IOV], rem[WIN_IOV];
    uint64_t piece_lo[WIN_IOV];
    unsigned long n = 0;
    for (uint64_t cur = top; cur > base && n < WIN_IOV; n++) {
        uint64_t lo = (cur - 1) & ~(uint64_t)(PAGE - 1);
        if (lo < base)
            lo = base;
        loc[n].iov_base = x->buf + (lo - base);
        loc[n].iov_len = cur - lo;
        rem[n].iov_base = (void *)(uintptr_t)lo;
        rem[n].iov_len = cur - lo;
        piece_lo[n] = lo;
        cur = lo;
    }
    int err;
    ssize_t got = vm_read(w, loc, rem, n, &err);
    x->hi = 0;
    if (got <= 0)
        return read_status(got, fb, err);
    uint64_t lo = top, left = (uint64_t)got;
    for (unsigned long i = 0; i < n && left >= loc[i].iov_len; i++) {
        left -= loc[i].iov_len;
        lo = piece_lo[i];
    }
    if (lo > addr)
        return UNW_PY_MOVED; /* the frame itself did not read */
    x->base = base;
    x->lo = lo;
    x->hi = top;
    *out = x->buf + (addr - base);
    return UNW_PY_OK;
}

/* Adds frame addr to the visited set: 0 if it was new, 1 if it was there (a cycle). */
static int seen_before(struct walk *w, uint64_t addr)
{
    uint64_t h = (addr >> 3) * 0x9E3779B97F4A7C15ull;
    for (uint32_t i = (uint32_t)(h >> 40) & w->seen_mask;; i = (i + 1) & w->seen_mask) {
        if (w->seen[i] == addr)
            return 1;
        if (!w->seen[i]) {
            w->seen[i] = addr;
            return 0;
        }
    }
}

/* The thread state of job->tid: the hint when it still has the tid, else the first in
 * runtime -> interpreters -> thread states that has it (pyframes.Interpreter.thread_state);
 * its head (hb bytes) in head. */
static int32_t thread_state(struct walk *w, struct unw_py_job *job, uint8_t *head, uint64_t hb,
                            uint64_t *ts_out)
{
    const struct unw_py_layout *L = w->lay;
    int32_t st;
    if (job->tstate) {
        if ((st = read_one(w, job->tstate, head, hb)))
            return st;
        if (u64at(head + L->ts_native_thread_id) == (uint64_t)(uint32_t)job->tid) {
            *ts_out = job->tstate;
            return UNW_PY_OK;
        }
    }
    uint64_t interp, ts;
    uint32_t seen = 0;
    if ((st = read_one(w, job->runtime + L->interpreters_head, &interp, 8)))
        return st;
    while (interp && seen < UNW_PY_MAX_THREADS) {
        if ((st = read_one(w, interp + L->interp_threads_head, &ts, 8)))
            return st;
        while (ts && seen < UNW_PY_MAX_THREADS) {
            seen++;
            if ((st = read_one(w, ts, head, hb)))
                return st;
            if (u64at(head + L->ts_native_thread_id) == (uint64_t)(uint32_t)job->tid) {
                *ts_out = ts;
                return UNW_PY_OK;
            }
            ts = u64at(head + L->ts_next);
        }
        if ((st = read_one(w, interp + L->interp_next, &interp, 8)))
            return st;
    }
    return UNW_PY_NO_THREAD;
}

/* The code header fields of recs[0, n), CODE_BATCH distinct code objects per call. */
static int32_t code_headers(struct walk *w, struct unw_py_rec *recs, uint64_t n)
{
    const struct unw_py_layout *L = w->lay;
    uint64_t cb = L->code_bytes;
    struct iovec loc[CODE_BATCH], rem[CODE_BATCH];
    uint64_t i = 0;
    while (i < n) {
        memset(w->ckeys, 0, CODE_HASH * 8);
        uint64_t start = i;
        uint32_t k = 0;
        for (; i < n; i++) {
            uint64_t c = recs[i].code;
            if (!c)
                continue;
            if (!ok_range(c, cb))
                return UNW_PY_MOVED;
            uint32_t s = (uint32_t)(((c >> 3) * 0x9E3779B97F4A7C15ull) >> 40) & (CODE_HASH - 1);
            while (w->ckeys[s] && w->ckeys[s] != c)
                s = (s + 1) & (CODE_HASH - 1);
            if (w->ckeys[s])
                continue;
            if (k == CODE_BATCH)
                break;
            w->ckeys[s] = c;
            w->cidx[s] = (uint16_t)k;
            loc[k].iov_base = w->codes + (uint64_t)k * cb;
            loc[k].iov_len = cb;
            rem[k].iov_base = (void *)(uintptr_t)c;
            rem[k].iov_len = cb;
            k++;
        }
        if (k) {
            int err;
            ssize_t got = vm_read(w, loc, rem, k, &err);
            int32_t st = read_status(got, (uint64_t)k * cb, err);
            if (st)
                return st;
        }
        for (uint64_t j = start; j < i; j++) {
            uint64_t c = recs[j].code;
            if (!c)
                continue;
            uint32_t s = (uint32_t)(((c >> 3) * 0x9E3779B97F4A7C15ull) >> 40) & (CODE_HASH - 1);
            while (w->ckeys[s] != c)
                s = (s + 1) & (CODE_HASH - 1);
            const uint8_t *h = w->codes + (uint64_t)w->cidx[s] * cb;
            recs[j].qualname = u64at(h + L->code_qualname);
            recs[j].filename = u64at(h + L->code_filename);
            recs[j].linetable = u64at(h + L->code_linetable);
            recs[j].firstlineno = u32at(h + L->code_firstlineno);
        }
    }
    return UNW_PY_OK;
}

static uint64_t max3(uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t m = a > b ? a : b;
    return m > c ? m : c;
}

static int layout_ok(const struct unw_py_layout *L)
{
    uint64_t fb = L->frame_bytes, cb = L->code_bytes;
    if (!fb || fb > MAX_FRAME_BYTES || !cb || cb > MAX_CODE_BYTES)
        return 0;
    if (L->frame_code + 8 > fb || L->frame_previous + 8 > fb || L->frame_instr + 8 > fb ||
        L->frame_owner >= fb || (L->frame_is_entry >= 0 && (uint64_t)L->frame_is_entry >= fb))
        return 0;
    if (L->code_qualname + 8 > cb || L->code_filename + 8 > cb || L->code_linetable + 8 > cb ||
        L->code_firstlineno + 4 > cb)
        return 0;
    uint64_t cf = L->ts_cframe >= 0 ? (uint64_t)L->ts_cframe : L->current_frame;
    return L->ts_cframe < MAX_HEAD_BYTES &&
           max3(L->ts_next, L->ts_native_thread_id, cf) + 8 <= MAX_HEAD_BYTES;
}

static int32_t walk_one(struct walk *w, struct unw_py_job *job, struct unw_py_rec *recs,
                        uint64_t cap, uint64_t *used)
{
    const struct unw_py_layout *L = w->lay;
    uint8_t head[MAX_HEAD_BYTES];
    uint64_t cf = L->ts_cframe >= 0 ? (uint64_t)L->ts_cframe : L->current_frame;
    uint64_t hb = max3(L->ts_next, L->ts_native_thread_id, cf) + 8, ts = 0, frame;
    int32_t st = thread_state(w, job, head, hb, &ts);
    if (st == UNW_PY_NO_THREAD)
        job->tstate = 0; /* the hint had another thread's id: not a hint any more */
    if (st)
        return st;
    job->tstate = ts;
    if (L->ts_cframe >= 0) {
        uint64_t cframe = u64at(head + L->ts_cframe);
        if (!cframe)
            return UNW_PY_OK;
        if ((st = read_one(w, cframe + L->current_frame, &frame, 8)))
            return st;
    } else {
        frame = u64at(head + L->current_frame);
    }
    uint32_t maxf = job->max_frames < UNW_PY_MAX_FRAMES ? job->max_frames : UNW_PY_MAX_FRAMES;
    uint32_t slots = 64;
    while (slots < 2 * maxf)
        slots *= 2;
    w->seen_mask = slots - 1;
    memset(w->seen, 0, (uint64_t)slots * 8);
    uint32_t nseen = 0;
    uint64_t n = 0;
    while (frame) {
        if (seen_before(w, frame))
            return UNW_PY_MOVED;
        if (nseen >= maxf)
            return UNW_PY_TOO_DEEP;
        nseen++;
        const uint8_t *buf = NULL;
        if ((st = frame_bytes(w, frame, L->frame_bytes, &buf)))
            return st;
        if (n >= cap)
            return UNW_PY_TOO_DEEP;
        struct unw_py_rec *r = &recs[n++];
        memset(r, 0, sizeof *r);
        if (L->frame_is_entry < 0 && buf[L->frame_owner] == OWNED_BY_CSTACK) {
            r->flags = UNW_PY_SHIM;
        } else {
            r->code = u64at(buf + L->frame_code);
            if (!r->code)
                return UNW_PY_MOVED;
            r->instr = u64at(buf + L->frame_instr);
            if (L->frame_is_entry >= 0 && buf[L->frame_is_entry])
                r->flags = UNW_PY_ENTRY;
        }
        frame = u64at(buf + L->frame_previous);
        *used = n;
    }
    return code_headers(w, recs, n);
}

uint32_t unw_py_progress(const struct unw_py_sync *sync)
{
    return __atomic_load_n(&sync->done, __ATOMIC_ACQUIRE);
}

void unw_py_stop(struct unw_py_sync *sync)
{
    __atomic_store_n(&sync->stop, 1, __ATOMIC_RELEASE);
}

/* Until CLOCK_MONOTONIC t (absolute: a signal's early return sleeps again). */
static void sleep_until(uint64_t t)
{
    struct timespec ts = {(time_t)(t / 1000000000u), (long)(t % 1000000000u)};
    while (now_ns() < t && clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

int64_t unw_py_walk(struct unw_py_job *jobs, uint32_t n, struct unw_py_rec *recs,
                    uint64_t cap, uint8_t *scratch, uint64_t scratch_len,
                    struct unw_py_sync *sync)
{
    if (!scratch || scratch_len < SCRATCH_NEED || ((uintptr_t)scratch & 7) || (n && (!jobs || (cap && !recs))))
        return -1;
    for (uint32_t j = 0; j < n; j++)
        if (!jobs[j].lay || !layout_ok(jobs[j].lay))
            return -1;
    struct walk w;
    memset(&w, 0, sizeof w);
    w.seen = (uint64_t *)(void *)(scratch + OFF_SEEN);
    w.codes = scratch + OFF_CODES;
    w.ckeys = (uint64_t *)(void *)(scratch + OFF_CKEYS);
    w.cidx = (uint16_t *)(void *)(scratch + OFF_CIDX);
    uint64_t used = 0;
    for (uint32_t j = 0; j < n; j++) {
        struct unw_py_job *job = &jobs[j];
        w.lay = job->lay;
        w.pid = job->pid;
        w.syscalls = 0;
        for (int i = 0; i < NWIN; i++) {
            w.win[i].hi = 0;
            w.win[i].buf = scratch + OFF_WIN + (uint64_t)i * WIN;
        }
        w.next_win = 0;
        if (sync && __atomic_load_n(&sync->stop, __ATOMIC_ACQUIRE))
            break;
        if (job->not_before)
            sleep_until(job->not_before);
        if (sync && __atomic_load_n(&sync->stop, __ATOMIC_ACQUIRE))
            break;
        uint64_t t0 = now_ns(), got = 0;
        job->first = (uint32_t)used;
        job->status = walk_one(&w, job, recs + used, cap - used, &got);
        job->count = job->status ? 0 : (uint32_t)got;
        used += job->count;
        job->syscalls = w.syscalls;
        job->t_ns = (t0 + now_ns()) / 2;
        if (sync)
            __atomic_store_n(&sync->done, j + 1, __ATOMIC_RELEASE);
    }
    return (int64_t)used;
}

/* struct sched_attr's first version (include/uapi/linux/sched/types.h, SCHED_ATTR_SIZE_VER0):
 * glibc before 2.41 has no declaration of it. */
struct attr0 {
    uint32_t size, policy;
    uint64_t flags;
    int32_t nice;
    uint32_t priority;
    uint64_t runtime, deadline, period;
};

int unw_py_short_slice(uint64_t slice_ns)
{
#if defined(SYS_sched_getattr) && defined(SYS_sched_setattr)
    struct attr0 a;
    memset(&a, 0, sizeof a);
    if (syscall(SYS_sched_getattr, 0, &a, (unsigned)sizeof a, 0) != 0)
        return -errno;
    if (a.policy != 0 && a.policy != 3) /* SCHED_OTHER, SCHED_BATCH: the fair class only */
        return -EINVAL;
    a.size = sizeof a;
    a.flags = 0;
    a.runtime = slice_ns; /* policy and nice as they were */
    if (syscall(SYS_sched_setattr, 0, &a, 0) != 0)
        return -errno;
    return 0;
#else
    (void)slice_ns;
    return -ENOSYS;
#endif
}
