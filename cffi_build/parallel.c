/* parallel.c: the unwind run (fp_unwind_run, contract: fastpath.h) on the calling thread and
 * one worker thread; stacks.c does the unwinding (unwind_sample) and the interning
 * (intern_sample).
 *
 * Why: unwinding (unw_unwind_one) is most of fp_unwind_run (interning the stacks is the
 * rest), and samples unwind independently: the calling thread and one worker thread unwind
 * blocks of a run's ready prefix into ring slots, and the calling thread alone interns them in
 * sample order, so frame and stack ids, counts and pairs are exactly the one-thread ones.
 *
 * Thread safety of the unwind half (unwind_sample): it reads the record, the buffer, the
 * space table (space_slot: the calling thread does not change spaces during a job) and the
 * modules and tables (the caller keeps them alive and unchanged), and writes only its ring
 * slots and its own thread's lookup cache (unwind.c lk_cache is __thread).
 *
 * Bounds: one worker per context (created on first use, joined by fp_ctx_free); ring = g *
 * PAR_NBLOCKS samples of max_depth pcs and kinds, at most ~PAR_RING_BYTES (g shrinks for deep
 * max_depth, at least 1; 1024 samples, 1.2 MB at max_depth 128). A run stopped by
 * FP_RUN_NEED_SYMS has unwound at most ring samples past the stop, unwound again on resume.
 * Lock traffic: O(1) per block; futex wakes of the worker: O(1) per job plus one per half
 * ring it waits for (par_wake). BENCHMARKS.md has the wall and CPU times with and without the
 * worker. */
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fastpath_int.h"

/* Record r lies within the len bytes of the buffer. */
static inline int rec_inside(const struct fp_rec *r, uint64_t len)
{
    return r->off <= len && r->size <= len - r->off;
}

/* Prefetch what unwind_sample reads first of sample r: its registers and the head of its
 * stack copy. The records of a replay (8 KiB apiece, read once, from a mapped file) are never
 * in cache, and both reads stall the walk's start; issued while the sample before r is walked,
 * their misses overlap that walk. Only addresses inside r are formed, and a prefetch never
 * faults. Always inlined: as a function of its own, GCC's interprocedural analysis finds no
 * side effect in it (a prefetch has none) and drops its calls. */
static inline __attribute__((always_inline)) void prefetch_sample(const uint8_t *data,
                                                                  uint64_t len,
                                                                  const struct fp_rec *r)
{
    if (r->size < 8 || !rec_inside(r, len))
        return;
    const uint8_t *body = data + r->off + 8;
    uint64_t blen = r->size - 8u;
    for (uint64_t o = r->regs_off; r->regs_abi && o < blen && o < r->regs_off + 192u; o += 64)
        __builtin_prefetch(body + o);
    for (uint64_t o = r->stack_off; r->dyn && o < blen && o < r->stack_off + 256u; o += 64)
        __builtin_prefetch(body + o);
}

/* The checks fp_unwind_run makes before unwinding perm[k]: 0 if the sample can be unwound
 * now (*sp, *ce set), else the FP_RUN_* to return (*need_pid / *need_tid set). */
static int run_ready(const struct fp_ctx *c, const struct fp_rec *r, uint64_t len,
                     const struct space_ent **sp, const struct comm_ent **ce, uint32_t *need_pid,
                     uint32_t *need_tid)
{
    if (!(r->flags & FP_SAMPLE) || !rec_inside(r, len))
        return FP_RUN_ERROR; /* the caller passes only indexed samples of this buffer */
    *sp = c->scap ? space_slot(c, r->pid) : NULL;
    if (!*sp || !(*sp)->used || !(*sp)->valid) {
        *need_pid = r->pid;
        return FP_RUN_NEED_SPACE;
    }
    *ce = c->ccap ? comm_slot(c, r->pid, r->tid) : NULL;
    if (!*ce || !(*ce)->used) {
        *need_pid = r->pid;
        *need_tid = r->tid;
        return FP_RUN_NEED_COMM;
    }
    return 0;
}

/* Protocol (all under par->mu): a job is samples [k0, k1) of perm, every one ready
 * (run_ready). Blocks are [b * g, (b + 1) * g) of perm indices clipped to the job; a thread
 * claims the lowest unclaimed block (next), unwinds it outside the lock into ring slots k %
 * ring, and marks it done (bdone[b % PAR_NBLOCKS] = b + 1). A block may be claimed only when
 * its slots are free: b below the first uninterned block + PAR_NBLOCKS (limit). The calling
 * thread interns block after block, claiming and unwinding blocks itself while the one it needs
 * is not done (so it never idles while there is work). When it cannot claim because the ring
 * is full behind the block the worker holds (a preempted worker: the machines are shared), it
 * unwinds that block itself, on one thread, and the worker's late copy is ignored (its slots
 * stay the worker's until it lets go: the claim limit also counts the worker's block). It
 * sleeps only at a job's tail, when the worker holds the last unfinished block. Before
 * returning it deactivates the job and waits until the worker is idle: after fp_unwind_run
 * returns nothing reads the caller's buffers. */
/* (the PAR_* knobs are in fastpath_int.h: fp_ctx_new reads PAR_MIN) */

struct par_slot {
    uint32_t npcs;
    uint8_t status;
};

struct par_job {
    const struct fp_ctx *c;
    const struct fp_layout *lay;
    const uint8_t *data;
    uint64_t len;
    const struct fp_rec *recs;
    const uint32_t *perm;
};

struct fp_par {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t work;    /* worker: a claimable block, or quit */
    pthread_cond_t done;    /* calling thread: a block done, or the worker idle */
    unsigned long forks;    /* par_forks when th started (a fork's child has no th) */
    int quit, active, worker_busy, worker_waiting, main_waiting;
    uint64_t wstart;        /* while worker_busy: the first sample of the worker's block */
    clockid_t wclock;       /* the worker's CPU-time clock */
    int have_wclock;
    uint64_t serial_left;   /* samples to unwind on one thread before the next probe */
    uint32_t busy_streak;   /* busy verdicts in a row */
    uint64_t acc_wall, acc_cpu; /* jobs since the last verdict: their wall and CPU time */
    struct par_job job;     /* valid while active */
    uint64_t k1, next, limit;
    uint64_t bdone[PAR_NBLOCKS];
    uint32_t g, max_depth;
    uint64_t ring;
    uint64_t *pcs;
    uint8_t *kinds;
    struct par_slot *slots;
    uint64_t worker_samples; /* unwound by the worker (fp_ctx_par_stats) */
    int stress;             /* fp_ctx_par_stress */
    int wtook;              /* the worker finished a block of the current job */
};

/* Unwind samples [s, e) of the job into their ring slots (either thread, outside the lock). */
static void par_block(const struct fp_par *P, const struct par_job *J, uint64_t s, uint64_t e)
{
    const struct fp_ctx *c = J->c;
    for (uint64_t k = s; k < e; k++) {
        const struct fp_rec *r = &J->recs[J->perm[k]];
        if (k + 1 < e)
            prefetch_sample(J->data, J->len, &J->recs[J->perm[k + 1]]);
        uint64_t i = k % P->ring;
        struct par_slot *sl = &P->slots[i];
        sl->status = unwind_sample(c->arch, P->max_depth, J->lay, J->data, r,
                                   space_slot(c, r->pid), P->pcs + i * P->max_depth,
                                   P->kinds + i * P->max_depth, &sl->npcs);
    }
}

/* Claim the next block if its slots are free (mu held): 1 and [*s, *e), else 0. */
static int par_claim(struct fp_par *P, uint64_t *s, uint64_t *e)
{
    /* the slots of a block the worker still holds stay its own, even if the calling thread
     * stole that block (par_run) and moved on */
    uint64_t lim = P->limit;
    if (P->worker_busy && P->wstart / P->g * P->g + P->ring < lim)
        lim = P->wstart / P->g * P->g + P->ring;
    if (!P->active || P->next >= P->k1 || P->next >= lim)
        return 0;
    *s = P->next;
    *e = *s / P->g * P->g + P->g;
    if (*e > P->k1)
        *e = P->k1;
    P->next = *e;
    return 1;
}

/* Wake a waiting worker (mu held) once half the ring, or the rest of the job, is claimable:
 * a worker that ran a full ring ahead then sleeps until it can run far again, not once per
 * block the calling thread frees (a futex wake and a context switch each). */
static void par_wake(struct fp_par *P)
{
    if (!P->worker_waiting || !P->active || P->next >= P->k1)
        return;
    uint64_t end = P->limit < P->k1 ? P->limit : P->k1;
    if (end > P->next && (end - P->next >= P->ring / 2 || end == P->k1)) {
        P->worker_waiting = 0; /* one wake is enough */
        pthread_cond_signal(&P->work);
    }
}

static void *par_worker(void *arg)
{
    struct fp_par *P = arg;
    pthread_mutex_lock(&P->mu);
    while (!P->quit) {
        uint64_t s, e;
        if (!par_claim(P, &s, &e)) {
            P->worker_waiting = 1;
            pthread_cond_wait(&P->work, &P->mu);
            P->worker_waiting = 0;
            continue;
        }
        struct par_job J = P->job;
        P->worker_busy = 1;
        P->wstart = s;
        pthread_mutex_unlock(&P->mu);
        par_block(P, &J, s, e);
        pthread_mutex_lock(&P->mu);
        P->bdone[s / P->g % PAR_NBLOCKS] = s / P->g + 1;
        P->worker_samples += e - s;
        P->wtook = 1;
        P->worker_busy = 0;
        if (P->main_waiting)
            pthread_cond_signal(&P->done);
    }
    pthread_mutex_unlock(&P->mu);
    return NULL;
}

/* Forks seen by this process image (a pthread_atfork child handler counts them): a worker
 * belongs to the image whose count it was started at. A pid comparison would not do: a
 * later descendant may be given the original process's pid. */
static unsigned long par_forks;
static pthread_once_t par_atfork_once = PTHREAD_ONCE_INIT;

static void par_on_fork_child(void) { par_forks++; }

static void par_register_atfork(void) { pthread_atfork(NULL, NULL, par_on_fork_child); }

static int par_ours(const struct fp_par *P) { return P->forks == par_forks; }

void par_free(struct fp_par *P)
{
    if (!P)
        return;
    if (par_ours(P)) {
        pthread_mutex_lock(&P->mu);
        P->quit = 1;
        pthread_cond_signal(&P->work);
        pthread_mutex_unlock(&P->mu);
        pthread_join(P->th, NULL);
        pthread_cond_destroy(&P->work);
        pthread_cond_destroy(&P->done);
        pthread_mutex_destroy(&P->mu);
    } /* else a fork's child: no thread to stop, and the lock may be a copy of a held one */
    free(P->pcs);
    free(P->kinds);
    free(P->slots);
    free(P);
}

/* 1 if the worker runs (started now if this is the first use), else 0 (one thread). */
static int par_ready(struct fp_ctx *c)
{
    if (c->par)
        return par_ours(c->par);
    if (c->par_failed)
        return 0;
    c->par_failed = 1; /* until the worker runs */
    uint64_t per = 9 * (uint64_t)c->max_depth; /* a slot's pcs and kinds */
    uint64_t g = PAR_RING_BYTES / (per * PAR_NBLOCKS);
    if (g < 1) /* max_depth past ~7k frames: one thread, so the ring stays PAR_RING_BYTES */
        return 0;
    struct fp_par *P = calloc(1, sizeof *P);
    if (!P)
        return 0;
    P->g = g > PAR_BLOCK ? PAR_BLOCK : (uint32_t)g;
    P->max_depth = c->max_depth;
    P->ring = (uint64_t)P->g * PAR_NBLOCKS;
    P->pcs = malloc(P->ring * c->max_depth * sizeof *P->pcs);
    P->kinds = malloc(P->ring * c->max_depth);
    P->slots = malloc(P->ring * sizeof *P->slots);
    pthread_once(&par_atfork_once, par_register_atfork);
    P->forks = par_forks;
    if (!P->pcs || !P->kinds || !P->slots || pthread_mutex_init(&P->mu, NULL)) {
        free(P->pcs), free(P->kinds), free(P->slots), free(P);
        return 0;
    }
    int ok = !pthread_cond_init(&P->work, NULL);
    if (ok && pthread_cond_init(&P->done, NULL)) {
        pthread_cond_destroy(&P->work);
        ok = 0;
    }
    if (ok) {
        /* every signal blocked in the worker: the process's handlers (Python's) run in the
         * threads that expect them; the mask is inherited, so block, create, restore */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        ok = !pthread_create(&P->th, NULL, par_worker, P);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (!ok) {
            pthread_cond_destroy(&P->work);
            pthread_cond_destroy(&P->done);
        }
    }
    if (!ok) {
        pthread_mutex_destroy(&P->mu);
        free(P->pcs), free(P->kinds), free(P->slots), free(P);
        return 0;
    }
    P->have_wclock = !pthread_getcpuclockid(P->th, &P->wclock);
    c->par = P;
    c->par_failed = 0;
    return 1;
}

/* Whether this ready prefix of n samples goes to the two threads: not while a busy verdict's
 * stretch of one-thread samples lasts (par_judge). */
static int par_turn(struct fp_par *P, uint64_t n)
{
    if (!P->serial_left)
        return 1;
    P->serial_left -= n < P->serial_left ? n : P->serial_left;
    return 0;
}

static uint64_t clock_ns(clockid_t id)
{
    struct timespec t;
    if (clock_gettime(id, &t))
        return 0;
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Why: the two threads help only if the process gets a second CPU. On a busy shared machine
 * it does not (with autogroup scheduling a session's share stays the same however many
 * threads it runs), and then the worker only adds its overhead: fp_unwind_run takes longer
 * with it than without, where an idle second CPU makes it much shorter. So the jobs are
 * judged, every PAR_JUDGE_NS of their wall time, by the CPU time their threads got over that
 * wall time: under 1.3 CPUs, busy; the next PAR_BACKOFF << streak samples (streak: busy
 * verdicts in a row, at most 6) then run on one thread, and the jobs after them probe again.
 * Cost: four clock reads per job. A verdict changes only which thread unwinds, never a
 * result. */
static void par_judge(struct fp_par *P, uint64_t wall, uint64_t cpu)
{
    P->acc_wall += wall;
    P->acc_cpu += cpu;
#if PAR_JUDGE_NS > 0 /* (tests build it as 0: every job judged) */
    if (P->acc_wall < PAR_JUDGE_NS)
        return;
#endif
    wall = P->acc_wall;
    cpu = P->acc_cpu;
    P->acc_wall = P->acc_cpu = 0;
    if (10 * cpu >= 13 * wall) {
        P->busy_streak = 0;
        return;
    }
    P->serial_left = (uint64_t)PAR_BACKOFF << P->busy_streak;
    if (P->busy_streak < 6)
        P->busy_streak++;
}

/* Samples [k0, k1), all ready: unwound by both threads, interned here in order. Returns
 * FP_RUN_DONE, or the stop (FP_RUN_NEED_SYMS, FP_RUN_ERROR) at *stopped, like the one-thread
 * loop. */
static int par_run(struct fp_ctx *c, const struct fp_layout *lay, const uint8_t *data,
                   uint64_t len, const struct fp_rec *recs, const uint32_t *perm, uint64_t k0,
                   uint64_t k1, uint32_t *stack_ids, uint64_t *stopped, uint32_t *need_pid,
                   uint32_t *need_tid)
{
    struct fp_par *P = c->par;
    const uint64_t g = P->g, ring = P->ring;
    uint64_t t0 = clock_ns(CLOCK_MONOTONIC), m0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
    uint64_t w0 = P->have_wclock ? clock_ns(P->wclock) : 0;
    pthread_mutex_lock(&P->mu);
    P->job = (struct par_job){c, lay, data, len, recs, perm};
    P->k1 = k1;
    P->next = k0;
    P->limit = k0 / g * g + ring;
    memset(P->bdone, 0, sizeof P->bdone);
    P->active = 1;
    P->wtook = 0;
    par_wake(P);
    /* tests (fp_ctx_par_stress): the worker does at least one block of every job, whatever
     * the scheduler does (timing only: the results are the same) */
    while (P->stress && !P->wtook && P->next < k1) {
        P->main_waiting = 1;
        pthread_cond_wait(&P->done, &P->mu);
        P->main_waiting = 0;
    }
    pthread_mutex_unlock(&P->mu);
    int rc = FP_RUN_DONE;
    uint64_t k = k0;
    while (k < k1 && rc == FP_RUN_DONE) {
        uint64_t b = k / g, e = b * g + g;
        if (e > k1)
            e = k1;
        int steal = 0;
        pthread_mutex_lock(&P->mu);
        while (P->bdone[b % PAR_NBLOCKS] != b + 1) {
            uint64_t s, se;
            if (par_claim(P, &s, &se)) { /* help rather than wait */
                pthread_mutex_unlock(&P->mu);
                par_block(P, &P->job, s, se);
                pthread_mutex_lock(&P->mu);
                P->bdone[s / g % PAR_NBLOCKS] = s / g + 1;
                continue;
            }
            if (P->next < k1) {
                /* The ring is full behind block b, which the worker holds: it is slow, most
                 * likely preempted (a shared machine). Do b here rather than wait for it (its
                 * unwind is done twice; the worker's copy is ignored). If the worker holds an
                 * older, already stolen block instead, b is unclaimed: nobody else takes it. */
                if (P->next <= k)
                    P->next = e;
                steal = 1;
                break;
            }
            P->main_waiting = 1; /* the job's tail: the worker's block is the last work */
            pthread_cond_wait(&P->done, &P->mu);
            P->main_waiting = 0;
        }
        pthread_mutex_unlock(&P->mu);
        for (; k < e; k++) {
            const struct fp_rec *r = &recs[perm[k]];
            const struct space_ent *sp = space_slot(c, r->pid);
            const struct comm_ent *ce = comm_slot(c, r->pid, r->tid);
            *stopped = k;
            uint32_t id;
            if (steal) {
                id = unwind_rec(c, lay, data, r, sp, ce);
            } else {
                const struct par_slot *sl = &P->slots[k % ring];
                uint64_t i = k % ring;
                id = intern_sample(c, lay, data, r, sp, ce, sl->status,
                                   P->pcs + i * P->max_depth, P->kinds + i * P->max_depth,
                                   sl->npcs);
            }
            if (id == NEED_SYMS_ID) {
                *need_pid = r->pid;
                *need_tid = c->need_mod;
                rc = FP_RUN_NEED_SYMS;
                break;
            }
            if (id == UINT32_MAX) {
                rc = FP_RUN_ERROR;
                break;
            }
            stack_ids[k] = id;
        }
        if (rc == FP_RUN_DONE) { /* block b interned: its slots are free */
            pthread_mutex_lock(&P->mu);
            P->limit = e + ring;
            par_wake(P);
            pthread_mutex_unlock(&P->mu);
        }
    }
    pthread_mutex_lock(&P->mu);
    P->active = 0;
    while (P->worker_busy) {
        P->main_waiting = 1;
        pthread_cond_wait(&P->done, &P->mu);
        P->main_waiting = 0;
    }
    pthread_mutex_unlock(&P->mu);
    if (P->have_wclock && !P->stress) {
        uint64_t cpu = clock_ns(CLOCK_THREAD_CPUTIME_ID) - m0 + clock_ns(P->wclock) - w0;
        par_judge(P, clock_ns(CLOCK_MONOTONIC) - t0, cpu);
    }
    return rc;
}

int fp_unwind_run(struct fp_ctx *c, const struct fp_layout *lay, const uint8_t *data,
                  uint64_t len, const struct fp_rec *recs, const uint32_t *perm, uint64_t from,
                  uint64_t to, uint32_t *stack_ids, uint64_t *stopped, uint32_t *need_pid,
                  uint32_t *need_tid)
{
    uint64_t k = from;
    while (k < to) {
        /* Segments end at multiples of PAR_SEG (a resume at a stop rescans at most that far,
         * and meets the same boundaries). Of a long enough segment, the ready prefix [k, p)
         * (every sample with its space and comm set) is unwound in parallel (par_run). */
        uint64_t seg = k / PAR_SEG * PAR_SEG + PAR_SEG;
        if (seg > to)
            seg = to;
        uint64_t end = seg; /* one at a time up to here */
        /* No readiness scan (two probes a sample) when its answer could not be used: no
         * worker, or a busy verdict's one-thread stretch, which this segment counts down. */
        int par_off = (!c->par && c->par_failed) || (c->par && c->par->serial_left);
        if (par_off && c->par && seg - k >= c->par_min)
            par_turn(c->par, seg - k);
        if (c->par_min && seg - k >= c->par_min && !par_off) {
            const struct space_ent *sp;
            const struct comm_ent *ce;
            uint32_t np, nt;
            uint64_t p = k;
            while (p < seg && !run_ready(c, &recs[perm[p]], len, &sp, &ce, &np, &nt))
                p++;
            if (p - k >= c->par_min && par_ready(c) && par_turn(c->par, p - k)) {
                int rc = par_run(c, lay, data, len, recs, perm, k, p, stack_ids, stopped,
                                 need_pid, need_tid);
                if (rc != FP_RUN_DONE)
                    return rc;
                k = p;
            }
            /* then the sample that is not ready, alone (its FP_RUN_*), or the short prefix */
            end = p < seg ? (p > k ? p : k + 1) : seg;
        }
        for (; k < end; k++) {
            const struct fp_rec *r = &recs[perm[k]];
            const struct space_ent *sp;
            const struct comm_ent *ce;
            *stopped = k;
            int rc = run_ready(c, r, len, &sp, &ce, need_pid, need_tid);
            if (rc)
                return rc;
            if (k + 1 < end)
                prefetch_sample(data, len, &recs[perm[k + 1]]);
            uint32_t id = unwind_rec(c, lay, data, r, sp, ce);
            if (id == NEED_SYMS_ID) {
                *need_pid = r->pid;
                *need_tid = c->need_mod;
                return FP_RUN_NEED_SYMS;
            }
            if (id == UINT32_MAX)
                return FP_RUN_ERROR;
            stack_ids[k] = id;
        }
    }
    *stopped = to;
    return FP_RUN_DONE;
}

int fp_ctx_par(struct fp_ctx *c, uint32_t min_run)
{
    c->par_min = min_run;
    return 0;
}

int fp_ctx_par_stress(struct fp_ctx *c, int on)
{
    if (on && !par_ready(c))
        return -1;
    if (c->par)
        c->par->stress = !!on;
    return 0;
}

uint64_t fp_ctx_par_stats(const struct fp_ctx *c)
{
    struct fp_par *P = c->par;
    if (!P || !par_ours(P))
        return 0;
    pthread_mutex_lock(&P->mu);
    uint64_t n = P->worker_samples;
    pthread_mutex_unlock(&P->mu);
    return n;
}

/* What the context holds: its sets (stacks.c) and the worker's ring, by capacity, O(1). */
uint64_t fp_ctx_bytes(const struct fp_ctx *c)
{
    const struct fp_par *P = c->par;
    uint64_t ring = P ? sizeof *P + P->ring * P->max_depth * (sizeof *P->pcs + 1) +
                            P->ring * sizeof *P->slots
                      : 0;
    return ctx_sets_bytes(c) + ring;
}
