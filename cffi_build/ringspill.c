/* The spill (perfcore.h, pc_spill_*): a thread that keeps the kernel's rings from overflowing
 * while their consumer is held up, by moving their records into memory it holds.
 *
 * Why a thread, and not larger rings: a ring is locked memory mapped for the daemon's life and
 * sized for the worst wait, and the kernel reserves a whole stack copy per sample in it; the
 * spill holds only the records it had to move, cut to the stack bytes the kernel filled
 * (pc_drain_trim), and only while the consumer is behind. It never polls the rings' fds: a
 * perf fd's readiness is consumed by the poll that sees it (kernel/events/core.c perf_poll
 * takes rb->poll with atomic_xchg), so a second poller would steal the loop's wakeups. It
 * reads the control pages instead, at a pace set by how fast the rings fill.
 *
 * Invariants:
 * - A ring and its spill are read under that ring's lock only (the thread's spill, the
 *   consumer's pc_drain_spill), so each ring has one consumer at a time, as pc__drain_ring
 *   requires, and a ring's records leave spill first, then ring: in the kernel's order.
 * - held (the bytes in every ring's [start, end)) never exceeds cap_bytes: the thread moves at
 *   most cap_bytes - held at a time. A ring's buffer is freed when the consumer empties it.
 * - The thread blocks every signal (the interpreter's handlers run on its own threads) and
 *   takes no lock but a ring's and its own sleep's.
 * Cost: a wake is O(rings) loads, plus one copy (and at most one realloc) per ring it spills;
 * pc_drain_spill adds a lock and unlock per ring to pc_drain_trim, and one copy of what the
 * spill held.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/perf_event.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "perfcore.h"
#include "perfcore_int.h"

#define NS_PER_MS 1000000ull
#define SPILL_ALIGN (64u << 10) /* buffers grow in 64 KiB steps */

typedef struct {
    pthread_mutex_t lock;   /* held by whichever side reads the ring or its spill */
    unsigned char *buf;     /* spilled records in [start, end): whole, in ring order */
    size_t cap, start, end;
    uint64_t last_head;     /* the thread's own: data_head at its last wake */
} spill_ring;

struct pc_spill {
    pc_ring *rings;
    size_t nrings;
    uint64_t cap_bytes;
    uint32_t nregs, high_pct;
    uint64_t max_sleep; /* ns */
    pthread_t thread;
    pthread_mutex_t mu; /* stop, and the thread's sleep */
    pthread_cond_t cv;
    int stop;
    /* atomics (relaxed: counters, read for stats) */
    uint64_t held, held_max, records, bytes, full, wakeups;
    spill_ring r[];
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void add(uint64_t *v, uint64_t n)
{
    __atomic_fetch_add(v, n, __ATOMIC_RELAXED);
}

static uint64_t get(const uint64_t *v)
{
    return __atomic_load_n(v, __ATOMIC_RELAXED);
}

/* Move what ring i holds into its spill, as much as cap_bytes leaves room for. Under its lock. */
static void spill_one(pc_spill *sp, size_t i)
{
    pc_ring *r = &sp->rings[i];
    spill_ring *s = &sp->r[i];
    uint64_t pending = pc__ring_head(r) - pc__ring_tail(r);
    uint64_t held = get(&sp->held);
    uint64_t room = held < sp->cap_bytes ? sp->cap_bytes - held : 0;
    uint64_t want = pending < room ? pending : room;
    if (want < sizeof(struct perf_event_header)) {
        if (pending)
            add(&sp->full, 1);
        return;
    }
    if (s->start) { /* what the consumer took leaves room at the front */
        memmove(s->buf, s->buf + s->start, s->end - s->start);
        s->end -= s->start;
        s->start = 0;
    }
    if (s->cap - s->end < want) {
        size_t cap = (s->end + (size_t)want + SPILL_ALIGN - 1) & ~(size_t)(SPILL_ALIGN - 1);
        unsigned char *buf = realloc(s->buf, cap);
        if (!buf) {
            add(&sp->full, 1);
            return;
        }
        s->buf = buf;
        s->cap = cap;
    }
    uint64_t before = r->records;
    size_t n = pc__drain_ring(r, s->buf + s->end, (size_t)want, sp->nregs);
    s->end += n;
    add(&sp->records, r->records - before);
    add(&sp->bytes, n);
    uint64_t now = __atomic_add_fetch(&sp->held, n, __ATOMIC_RELAXED);
    uint64_t max = get(&sp->held_max);
    while (now > max &&
           !__atomic_compare_exchange_n(&sp->held_max, &max, now, 0, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
    }
    if (want < pending && pc__ring_head(r) != pc__ring_tail(r))
        add(&sp->full, 1); /* cap_bytes left records in the ring */
}

/* One wake: spill every ring past high_pct (or about to be); the ns until the fastest-filling ring could get
 * there at the rate it filled since the last wake (halved: a margin), within
 * [PC_SPILL_MIN_SLEEP_MS, max_sleep]. */
static uint64_t wake(pc_spill *sp, uint64_t dt)
{
    uint64_t next = sp->max_sleep;
    for (size_t i = 0; i < sp->nrings; i++) {
        pc_ring *r = &sp->rings[i];
        spill_ring *s = &sp->r[i];
        if (!pc__ring_usable(r))
            continue;
        uint64_t high = r->data_size / 100 * sp->high_pct;
        uint64_t head = pc__ring_head(r);
        uint64_t pending = head - pc__ring_tail(r);
        uint64_t grew = head - s->last_head;
        s->last_head = head;
        /* past high_pct, or would be by the next wake if it fills as fast as since the last */
        if (pending + grew >= high) {
            pthread_mutex_lock(&s->lock);
            spill_one(sp, i);
            pthread_mutex_unlock(&s->lock);
            pending = pc__ring_head(r) - pc__ring_tail(r);
        }
        if (grew && dt) {
            uint64_t left = pending < high ? high - pending : 0;
            double t = (double)left / (double)grew * (double)dt / 2;
            if (t < (double)next)
                next = (uint64_t)t;
        }
    }
    if (next < PC_SPILL_MIN_SLEEP_MS * NS_PER_MS)
        next = PC_SPILL_MIN_SLEEP_MS * NS_PER_MS;
    return next;
}

static void *spill_main(void *arg)
{
    pc_spill *sp = arg;
    uint64_t last = now_ns(), sleep = PC_SPILL_MIN_SLEEP_MS * NS_PER_MS;
    for (size_t i = 0; i < sp->nrings; i++)
        if (pc__ring_usable(&sp->rings[i]))
            sp->r[i].last_head = pc__ring_head(&sp->rings[i]);
    pthread_mutex_lock(&sp->mu);
    while (!sp->stop) {
        uint64_t until = now_ns() + sleep;
        struct timespec dl = {(time_t)(until / 1000000000ull), (long)(until % 1000000000ull)};
        while (!sp->stop && pthread_cond_timedwait(&sp->cv, &sp->mu, &dl) != ETIMEDOUT) {
        }
        if (sp->stop)
            break;
        pthread_mutex_unlock(&sp->mu);
        add(&sp->wakeups, 1);
        uint64_t t = now_ns();
        sleep = wake(sp, t - last);
        last = t;
        pthread_mutex_lock(&sp->mu);
    }
    pthread_mutex_unlock(&sp->mu);
    return NULL;
}

int pc_spill_start(pc_spill **out, pc_ring *rings, size_t nrings, uint64_t cap_bytes,
                   uint32_t nregs, uint32_t high_pct, uint32_t max_sleep_us)
{
    if (!out || (nrings && !rings) || high_pct < 1 || high_pct > 99 || nrings > (1u << 20))
        return -EINVAL;
    pc_spill *sp = calloc(1, sizeof(*sp) + nrings * sizeof(spill_ring));
    if (!sp)
        return -ENOMEM;
    sp->rings = rings;
    sp->nrings = nrings;
    sp->cap_bytes = cap_bytes;
    sp->nregs = nregs;
    sp->high_pct = high_pct;
    sp->max_sleep = PC_SPILL_MAX_SLEEP_MS * NS_PER_MS;
    if (max_sleep_us && max_sleep_us * 1000ull < sp->max_sleep)
        sp->max_sleep = max_sleep_us * 1000ull;
    for (size_t i = 0; i < nrings; i++)
        pthread_mutex_init(&sp->r[i].lock, NULL);
    pthread_mutex_init(&sp->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&sp->cv, &ca);
    pthread_condattr_destroy(&ca);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the thread inherits the full mask */
    int rc = pthread_create(&sp->thread, NULL, spill_main, sp);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc) {
        pthread_cond_destroy(&sp->cv);
        pthread_mutex_destroy(&sp->mu);
        for (size_t i = 0; i < nrings; i++)
            pthread_mutex_destroy(&sp->r[i].lock);
        free(sp);
        return -rc;
    }
    pthread_setname_np(sp->thread, "unwindd-spill");
    *out = sp;
    return 0;
}

void pc_spill_stop(pc_spill *sp)
{
    if (!sp)
        return;
    pthread_mutex_lock(&sp->mu);
    sp->stop = 1;
    pthread_cond_signal(&sp->cv);
    pthread_mutex_unlock(&sp->mu);
    pthread_join(sp->thread, NULL);
    for (size_t i = 0; i < sp->nrings; i++) {
        free(sp->r[i].buf);
        pthread_mutex_destroy(&sp->r[i].lock);
    }
    pthread_cond_destroy(&sp->cv);
    pthread_mutex_destroy(&sp->mu);
    free(sp);
}

/* The whole records of ring i's spill that fit in out[0, cap), taken; its buffer freed once
 * empty. Under the ring's lock. */
static size_t take_spilled(pc_spill *sp, spill_ring *s, unsigned char *out, size_t cap)
{
    size_t n = 0, have = s->end - s->start;
    while (n < have) {
        struct perf_event_header h; /* sizes pc__drain_ring checked (>= 8, aligned, whole) */
        memcpy(&h, s->buf + s->start + n, sizeof h);
        if (h.size > cap - n)
            break;
        n += h.size;
    }
    if (n) {
        memcpy(out, s->buf + s->start, n);
        s->start += n;
        __atomic_fetch_sub(&sp->held, n, __ATOMIC_RELAXED);
    }
    if (s->start == s->end && s->buf) {
        free(s->buf);
        s->buf = NULL;
        s->cap = s->start = s->end = 0;
    }
    return n;
}

int64_t pc_drain_spill(pc_spill *sp, size_t start, unsigned char *out, size_t out_cap,
                       uint64_t *sizes)
{
    if (!sp || (sp->nrings && !sizes) || (out_cap && !out))
        return -EINVAL;
    size_t total = 0, nr = sp->nrings;
    for (size_t i = 0; i < nr; i++)
        sizes[i] = 0;
    if (out_cap == 0)
        return 0;
    for (size_t k = 0; k < nr; k++) {
        size_t i = (start + k) % nr;
        pc_ring *r = &sp->rings[i];
        spill_ring *s = &sp->r[i];
        if (!pc__ring_usable(r))
            continue;
        pthread_mutex_lock(&s->lock);
        size_t n = take_spilled(sp, s, out + total, out_cap - total);
        if (s->start == s->end) /* the ring's own records only after all it spilled */
            n += pc__drain_ring(r, out + total + n, out_cap - total - n, sp->nregs);
        pthread_mutex_unlock(&s->lock);
        sizes[i] = n;
        total += n;
    }
    return (int64_t)total;
}

uint64_t pc_spill_pending(pc_spill *sp)
{
    if (!sp)
        return 0;
    return pc_pending_total(sp->rings, sp->nrings) + get(&sp->held);
}

void pc_spill_get_stats(pc_spill *sp, pc_spill_stats *st)
{
    if (!sp || !st)
        return;
    st->records = get(&sp->records);
    st->bytes = get(&sp->bytes);
    st->held = get(&sp->held);
    st->held_max = get(&sp->held_max);
    st->full = get(&sp->full);
    st->wakeups = get(&sp->wakeups);
}
