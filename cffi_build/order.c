/* order.c: perf's round rule (tools/perf/util/ordered-events.c; session.c
 * process_finished_round), as ordering.RoundOrderer implements it (its docstring has the rule
 * and why it is safe): fp_order for a whole file (FINISHED_ROUND records end the rounds:
 * RoundOrderer.feed_file_order) and fp_live_order_* across the live step's rounds (one call per
 * round: RoundOrderer.push, end_round, flush_all), on one heap and one per-CPU map.
 *
 * Invariants:
 * - The same delivery order and counts as RoundOrderer: entries are (time, seq) in a binary
 *   min-heap, seq the push order, so equal times keep arrival order; an untimed record takes
 *   the last time of its CPU, else of the last timed record, else last_flush; a record older
 *   than last_flush is counted late and delivered anyway; past max_queued records the oldest
 *   half goes out at once (_force_half).
 * - Nothing is lost: a record pushed is delivered exactly once, by this call or (live) a later
 *   one, its queue carried across calls; markers are consumed, never delivered. fp_order
 *   returns with pushed == delivered (queued 0) unless it fails (-1, allocation).
 * Cost: O(log queued) per record (a push and a pop, O(1) expected per CPU-map probe); memory:
 * the heap (n entries) and the CPU map (O(CPUs)), fp_order's freed before it returns.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "unwcore.h"
#include "fastpath.h"

struct hent {
    uint64_t t, seq;
    uint32_t idx;
};

static inline int hless(const struct hent *a, const struct hent *b)
{
    return a->t < b->t || (a->t == b->t && a->seq < b->seq);
}

static void hpush(struct hent *h, uint64_t *n, struct hent e)
{
    uint64_t i = (*n)++;
    while (i) {
        uint64_t p = (i - 1) / 2;
        if (!hless(&e, &h[p]))
            break;
        h[i] = h[p];
        i = p;
    }
    h[i] = e;
}

static struct hent hpop(struct hent *h, uint64_t *n)
{
    struct hent top = h[0], last = h[--(*n)];
    uint64_t i = 0, m = *n;
    for (;;) {
        uint64_t l = 2 * i + 1, s = i;
        const struct hent *best = &last;
        if (l < m && hless(&h[l], best)) {
            s = l;
            best = &h[l];
        }
        if (l + 1 < m && hless(&h[l + 1], best))
            s = l + 1;
        if (s == i)
            break;
        h[i] = h[s];
        i = s;
    }
    if (m)
        h[i] = last;
    return top;
}

/* Per-CPU last time for untimed records: open addressing, cpu + 1 as key (0 = empty). */
struct cpumap {
    uint64_t *keys, *vals;
    uint64_t cap, n;
};

static int cpumap_put(struct cpumap *m, uint64_t cpu, uint64_t t)
{
    if (2 * (m->n + 1) > m->cap) {
        uint64_t ncap = m->cap ? 2 * m->cap : 64;
        uint64_t *nk = calloc(ncap, 8), *nv = calloc(ncap, 8);
        if (!nk || !nv) {
            free(nk);
            free(nv);
            return -1;
        }
        for (uint64_t i = 0; i < m->cap; i++) {
            if (!m->keys[i])
                continue;
            uint64_t j = (m->keys[i] * 0x9E3779B97F4A7C15ull) & (ncap - 1);
            while (nk[j])
                j = (j + 1) & (ncap - 1);
            nk[j] = m->keys[i];
            nv[j] = m->vals[i];
        }
        free(m->keys);
        free(m->vals);
        m->keys = nk;
        m->vals = nv;
        m->cap = ncap;
    }
    uint64_t k = cpu + 1, j = (k * 0x9E3779B97F4A7C15ull) & (m->cap - 1);
    while (m->keys[j] && m->keys[j] != k)
        j = (j + 1) & (m->cap - 1);
    if (!m->keys[j]) {
        m->keys[j] = k;
        m->n++;
    }
    m->vals[j] = t;
    return 0;
}

static int cpumap_get(const struct cpumap *m, uint64_t cpu, uint64_t *t)
{
    if (!m->cap)
        return 0;
    uint64_t k = cpu + 1, j = (k * 0x9E3779B97F4A7C15ull) & (m->cap - 1);
    while (m->keys[j]) {
        if (m->keys[j] == k) {
            *t = m->vals[j];
            return 1;
        }
        j = (j + 1) & (m->cap - 1);
    }
    return 0;
}

/* ------------------------------------------------------------------ the rule, once */

/* RoundOrderer's state: the queue (a heap of (time, seq, index)), its seq counter and times. */
struct order {
    struct hent *h;
    uint64_t hn, seq, next_flush, last_flush, max_time, last_time, max_queued;
    int have_last;
    struct cpumap cm;
};

static void ord_free(struct order *o)
{
    free(o->h);
    free(o->cm.keys);
    free(o->cm.vals);
}

static void ord_pop(struct order *o, uint32_t *perm, uint64_t *out)
{
    struct hent e = hpop(o->h, &o->hn);
    perm[(*out)++] = e.idx;
    if (e.t > o->last_flush)
        o->last_flush = e.t;
}

/* RoundOrderer.push of record r (not a marker) as index i: an untimed record takes the last
 * time of its CPU, else of the last timed record, else last_flush; one older than last_flush
 * is counted late; past max_queued the oldest half goes out now (_force_half, delivered
 * first, as end_round returns _ready). The heap has room for one more. 0, or -1 (memory). */
static int ord_push(struct order *o, const struct fp_rec *r, uint32_t i, uint32_t *perm,
                    uint64_t *out, uint64_t *late_ns, uint64_t *nlate,
                    struct fp_order_stats *st)
{
    uint64_t t;
    if (!(r->flags & FP_TIMED)) {
        st->untimed++;
        if ((r->flags & FP_HAS_CPU) && cpumap_get(&o->cm, r->cpu, &t))
            ;
        else if (o->have_last)
            t = o->last_time;
        else
            t = o->last_flush;
    } else {
        t = r->time;
        if (t < o->last_flush) {
            uint64_t late = o->last_flush - t;
            st->late++;
            late_ns[(*nlate)++] = late;
            if (late > st->max_lateness_ns)
                st->max_lateness_ns = late;
        }
        if (t > o->max_time)
            o->max_time = t;
        o->last_time = t;
        o->have_last = 1;
        if ((r->flags & FP_HAS_CPU) && cpumap_put(&o->cm, r->cpu, t))
            return -1;
    }
    hpush(o->h, &o->hn, (struct hent){t, o->seq++, i});
    st->pushed++;
    if (o->hn > o->max_queued) {
        uint64_t k = o->hn / 2 ? o->hn / 2 : 1;
        for (uint64_t j = 0; j < k; j++)
            ord_pop(o, perm, out);
        st->forced_flushes++;
    }
    return 0;
}

/* RoundOrderer.end_round: out goes what is not newer than the previous round's newest time. */
static void ord_end_round(struct order *o, uint32_t *perm, uint64_t *out,
                          struct fp_order_stats *st)
{
    st->rounds++;
    uint64_t lim = o->next_flush > o->last_flush ? o->next_flush : o->last_flush;
    while (o->hn && o->h[0].t <= lim)
        ord_pop(o, perm, out);
    o->next_flush = o->max_time;
}

/* ------------------------------------------------------------------ a whole file */

int fp_order(const struct fp_rec *recs, uint64_t n, uint64_t max_queued, uint32_t *perm,
             uint64_t *nout, uint64_t *late_ns, uint64_t *nlate, struct fp_order_stats *st)
{
    memset(st, 0, sizeof *st);
    *nout = *nlate = 0;
    if (!max_queued || n > UINT32_MAX)
        return -1;
    struct order o = {.max_queued = max_queued};
    o.h = malloc((n ? n : 1) * sizeof *o.h);
    if (!o.h)
        return -1;
    int rc = 0;
    uint64_t out = 0;
    for (uint64_t i = 0; i < n && !rc; i++) {
        if (recs[i].flags & FP_MARKER)
            ord_end_round(&o, perm, &out, st);
        else
            rc = ord_push(&o, &recs[i], (uint32_t)i, perm, &out, late_ns, nlate, st);
    }
    while (!rc && o.hn) /* flush_all */
        ord_pop(&o, perm, &out);
    ord_free(&o);
    st->delivered = out;
    st->queued = st->pushed - out;
    *nout = out;
    return rc;
}

/* ------------------------------------------------------------------ across live rounds */

struct fp_live_order {
    struct order o;
    uint64_t hcap;
};

struct fp_live_order *fp_live_order_new(uint64_t max_queued)
{
    if (!max_queued)
        return NULL;
    struct fp_live_order *lo = calloc(1, sizeof *lo);
    if (lo)
        lo->o.max_queued = max_queued;
    return lo;
}

void fp_live_order_free(struct fp_live_order *lo)
{
    if (!lo)
        return;
    ord_free(&lo->o);
    free(lo);
}

uint64_t fp_live_order_queued(const struct fp_live_order *lo) { return lo->o.hn; }

int fp_live_order_round(struct fp_live_order *lo, const struct fp_rec *recs, uint64_t ncarry,
                        uint64_t n, int final, uint32_t *perm, uint64_t *nout, uint64_t *late_ns,
                        uint64_t *nlate, struct fp_order_stats *st, uint32_t *keep,
                        uint64_t *nkeep)
{
    struct order *o = &lo->o;
    memset(st, 0, sizeof *st);
    *nout = *nlate = *nkeep = 0;
    if (ncarry != o->hn || n < ncarry || n > UINT32_MAX)
        return -1;
    if (n > lo->hcap) {
        struct hent *q = realloc(o->h, n * sizeof *q);
        if (!q)
            return -1;
        o->h = q;
        lo->hcap = n;
    }
    uint64_t out = 0;
    for (uint64_t i = ncarry; i < n; i++) {
        /* rings never carry FINISHED_ROUND; a marker is counted by the caller */
        if (!(recs[i].flags & FP_MARKER) &&
            ord_push(o, &recs[i], (uint32_t)i, perm, &out, late_ns, nlate, st))
            return -1;
    }
    if (final) { /* flush_all */
        while (o->hn)
            ord_pop(o, perm, &out);
        o->next_flush = o->max_time;
    } else {
        ord_end_round(o, perm, &out, st);
    }
    /* What stays queued is re-indexed 0.. in heap-array order (the heap property depends on
     * (t, seq) only): the caller copies recs[keep[j]] to slot j of the next round's buffer. */
    for (uint64_t j = 0; j < o->hn; j++) {
        keep[j] = o->h[j].idx;
        o->h[j].idx = (uint32_t)j;
    }
    *nkeep = o->hn;
    st->delivered = out;
    st->queued = o->hn;
    *nout = out;
    return 0;
}
