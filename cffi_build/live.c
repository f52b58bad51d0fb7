/* live.c: the live step's native half (daemon/unwindd/pipeline/ringstep.py): ring chunks in
 * place of a file. fp_live_index indexes each ring's drain as decoder.RecordDecoder.decode
 * frames ring chunks: by perf_event_header.size alone (include/uapi/linux/perf_event.h; a
 * chunk holds whole records, perfcore.c's drain copies up to the head the kernel publishes
 * after whole records, kernel/events/ring_buffer.c), no perf.data payloads. fp_live_gather
 * copies the records order.c's live orderer keeps for the next round; fp_live_run unwinds like
 * fp_unwind_run after placing each sample as livetable.LiveTable.place's fast answer does;
 * fp_live_groups_* count samples per (time bucket, pid, tid, stack) until the daemon takes them;
 * fp_live_round does a round's counting, ordering, columns and carry copy in one call, and
 * fp_live_index_round the index too when the round is samples only.
 *
 * Invariants: reads stay inside the caller's buffer (a record's offset and size are checked
 * against len, the one word placing reads against the record); a sample that cannot be placed
 * here stops the run (FP_RUN_NEED_PLACE) before its stack is counted; a context of the live
 * step is never by function (a NEED_SYMS_ID answer is an error); groups keep first-seen order
 * and each its newest time.
 * Cost: fp_live_index O(records); fp_live_run like fp_unwind_run plus O(log mappings) per
 * sample to place it; fp_live_groups_add O(samples) expected (a table at most half full);
 * fp_live_groups_take O(groups + table); fp_live_round O(records) expected plus the orderer's
 * and the kept records' bytes.
 */
#include <stdlib.h>
#include <string.h>

#include "fastpath_int.h"

int fp_live_index(const struct fp_layout *lay, const uint8_t *data, const uint64_t *bounds,
                  uint32_t nchunks, struct fp_rec **recs, uint64_t *nrec, uint64_t *other,
                  int *ends, uint64_t *stopped_at)
{
    struct fp_rec *all = NULL;
    uint64_t n = 0, cap = 0;
    *recs = NULL;
    *nrec = *other = 0;
    *stopped_at = UINT64_MAX;
    for (uint32_t i = 0; i < nchunks; i++) {
        uint64_t base = bounds[i], len = bounds[i + 1] - bounds[i];
        struct fp_rec *r;
        uint64_t m, oth, stop;
        if (index_records(lay, data + base, len, 0, &r, &m, &oth, &ends[i], &stop)) {
            free(all);
            return -1;
        }
        if (stop != UINT64_MAX && *stopped_at == UINT64_MAX)
            *stopped_at = base + stop;
        if (n + m > cap) {
            uint64_t ncap = cap ? cap : 1024;
            while (ncap < n + m)
                ncap *= 2;
            struct fp_rec *q = realloc(all, ncap * sizeof *q);
            if (!q) {
                free(r);
                free(all);
                return -1;
            }
            all = q;
            cap = ncap;
        }
        for (uint64_t j = 0; j < m; j++) {
            all[n + j] = r[j];
            all[n + j].off += base;
        }
        n += m;
        *other += oth;
        free(r);
    }
    if (!all && !(all = malloc(sizeof *all)))
        return -1;
    *recs = all;
    *nrec = n;
    return 0;
}

uint64_t fp_live_gather(const uint8_t *data, const struct fp_rec *recs, const uint32_t *keep,
                        uint64_t n, uint8_t *out)
{
    uint64_t w = 0;
    for (uint64_t j = 0; j < n; j++) {
        const struct fp_rec *r = &recs[keep[j]];
        if (out)
            memcpy(out + w, data + r->off, r->size);
        w += r->size;
    }
    return w;
}

int fp_live_round(struct fp_live_order *o, const uint8_t *data, uint64_t len,
                  const struct fp_rec *recs, uint64_t ncarry, uint64_t n, int final,
                  struct fp_live_round *r)
{
    r->nsamples = r->busy = r->npids = r->ncpus = r->nout = r->nlate = r->nkeep = 0;
    r->carry_len = 0;
    if (ncarry > n || n > r->cap || n > UINT32_MAX)
        return -1;
    uint64_t m = n - ncarry, tcap = 16;
    while (tcap < 2 * m)
        tcap *= 2;
    uint32_t *tab = calloc(2 * tcap, sizeof *tab); /* pids', then cpus' */
    if (!tab)
        return -1;
    for (uint64_t i = ncarry; i < n; i++) {
        if (!(recs[i].flags & FP_SAMPLE))
            continue;
        r->nsamples++;
        r->busy += recs[i].pid != 0;
        tally(tab, tcap, r->by_pid, &r->npids, recs[i].pid);
        tally(tab + tcap, tcap, r->by_cpu, &r->ncpus, recs[i].cpu);
    }
    free(tab);
    if (fp_live_order_round(o, recs, ncarry, n, final, r->perm, &r->nout, r->late_ns, &r->nlate,
                            &r->st, r->keep, &r->nkeep))
        return -1;
    fp_columns(recs, r->perm, r->nout, r->is_sample, r->time, r->period, r->pid, r->tid, r->cpu);
    uint64_t size = 0;
    for (uint64_t j = 0; j < r->nkeep; j++) {
        const struct fp_rec *k = &recs[r->keep[j]];
        if (k->off > len || k->size > len - k->off)
            return -1;
        size += k->size;
    }
    r->carry_len = size;
    if (size > r->carry_cap)
        return 1;
    if (size)
        fp_live_gather(data, recs, r->keep, r->nkeep, r->carry);
    return 0;
}

int fp_live_index_round(const struct fp_layout *lay, const uint8_t *data, const uint64_t *bounds,
                        uint32_t nchunks, struct fp_rec **recs, uint64_t *nrec, uint64_t *other,
                        int *ends, uint64_t *stopped_at, struct fp_live_order *o,
                        uint64_t ncarry, int final, struct fp_live_round *r)
{
    if (fp_live_index(lay, data, bounds, nchunks, recs, nrec, other, ends, stopped_at))
        return -1;
    if (*other || *stopped_at != UINT64_MAX || *nrec > r->cap || !nchunks)
        return 2;
    return fp_live_round(o, data, bounds[nchunks], *recs, ncarry, *nrec, final, r);
}

int fp_set_live_space(struct fp_ctx *c, uint32_t pid, const struct unw_module *mods,
                      uint32_t nmods, uint32_t space_id, const uint64_t *ranges,
                      uint32_t nranges)
{
    if (fp_set_space(c, pid, mods, nmods, space_id))
        return -1;
    struct space_ent *e = space_slot(c, pid);
    e->ranges = ranges;
    e->nranges = nranges;
    return 0;
}

void fp_forget_all_spaces(struct fp_ctx *c)
{
    for (uint64_t i = 0; i < c->scap; i++)
        c->spaces[i].valid = 0;
}

/* livetable.LiveTable.place's fast answer: pc inside one of the space's mappings. */
static int in_ranges(const struct space_ent *sp, uint64_t pc)
{
    uint32_t lo = 0, hi = sp->nranges; /* first start > pc */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (sp->ranges[2 * mid] <= pc)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo > 0 && pc < sp->ranges[2 * (lo - 1) + 1];
}

int fp_live_run(struct fp_ctx *c, const struct fp_layout *lay, const uint8_t *data,
                uint64_t len, const struct fp_rec *recs, const uint32_t *perm, uint64_t from,
                uint64_t to, int force_first, uint32_t ip_bit, uint64_t *record_time,
                uint32_t *stack_ids, uint64_t *stopped, uint32_t *need_pid, uint32_t *need_tid,
                uint32_t *touched, uint64_t *touched_t, uint64_t *ntouched)
{
    uint32_t gen = ++c->touch_gen;
    uint64_t nt = 0;
    int rc = FP_RUN_DONE;
    *stopped = to;
    for (uint64_t k = from; k < to; k++) {
        const struct fp_rec *r = &recs[perm[k]];
        *stopped = k;
        if (!(r->flags & FP_SAMPLE) || r->off > len || r->size > len - r->off) {
            rc = FP_RUN_ERROR;
            break;
        }
        struct space_ent *sp = c->scap ? space_slot(c, r->pid) : NULL;
        if (!sp || !sp->used || !sp->valid) {
            *need_pid = r->pid;
            rc = FP_RUN_NEED_PLACE;
            break;
        }
        if (!(force_first && k == from)) {
            /* The view fp_live_index stored (struct fp_rec), not a second parse; the one word
             * read is checked to lie inside the record (a caller's rec could be anything). */
            const uint8_t *body = data + r->off + 8;
            uint64_t blen = r->size >= 8 ? r->size - 8u : 0;
            /* place(): the idle task and samples without user registers pass unchecked */
            int32_t spid = (int32_t)r->pid;
            if (spid > 0 && r->regs_abi != 0 && lay->nregs) {
                uint64_t at = UINT64_MAX;
                if (ip_bit < 64 && (lay->regs_mask >> ip_bit & 1))
                    at = r->regs_off +
                         8 * (uint64_t)__builtin_popcountll(lay->regs_mask & ((1ull << ip_bit) - 1));
                else if (lay->i_ip >= 0)
                    at = 8 * (uint64_t)lay->i_ip;
                if (at != UINT64_MAX && at + 8 > blen) {
                    rc = FP_RUN_ERROR;
                    break;
                }
                uint64_t pc = at == UINT64_MAX ? 0 : ld64(body + at);
                if (!in_ranges(sp, pc)) {
                    *need_pid = r->pid;
                    rc = FP_RUN_NEED_PLACE;
                    break;
                }
                if (r->time > *record_time)
                    *record_time = r->time;
                sp->last_used = *record_time;
                if (sp->touch != gen) {
                    sp->touch = gen;
                    touched[nt++] = r->pid;
                }
            }
        }
        const struct comm_ent *ce = c->ccap ? comm_slot(c, r->pid, r->tid) : NULL;
        if (!ce || !ce->used) {
            *need_pid = r->pid;
            *need_tid = r->tid;
            rc = FP_RUN_NEED_COMM;
            break;
        }
        uint32_t id = unwind_rec(c, lay, data, r, sp, ce);
        if (id >= NEED_SYMS_ID) { /* never by function here */
            rc = FP_RUN_ERROR;
            break;
        }
        stack_ids[k] = id;
        *stopped = k + 1;
    }
    for (uint64_t j = 0; j < nt; j++)
        touched_t[j] = space_slot(c, touched[j])->last_used;
    *ntouched = nt;
    return rc;
}

/* (bucket, pid, tid, stack) groups of the placed samples: open addressing over group ids. */
struct fp_live_groups {
    uint64_t bucket_ns;
    uint64_t n, cap; /* groups held, room in the columns */
    uint64_t tcap;   /* hash slots: a power of two >= 2 * cap */
    uint32_t *tab;   /* group index + 1; 0 = empty */
    uint64_t *time, *count;
    uint32_t *pid, *tid, *sid;
};

struct fp_live_groups *fp_live_groups_new(uint64_t bucket_ns)
{
    if (!bucket_ns)
        return NULL;
    struct fp_live_groups *g = calloc(1, sizeof *g);
    if (g)
        g->bucket_ns = bucket_ns;
    return g;
}

void fp_live_groups_free(struct fp_live_groups *g)
{
    if (!g)
        return;
    free(g->tab), free(g->time), free(g->count), free(g->pid), free(g->tid), free(g->sid);
    free(g);
}

uint64_t fp_live_groups_len(const struct fp_live_groups *g) { return g->n; }

/* Room for `want` groups: the columns grow (realloc keeps them) and the table is rebuilt
 * from them; on failure g is unchanged except for columns that grew (still valid). */
static int groups_reserve(struct fp_live_groups *g, uint64_t want)
{
    if (want <= g->cap)
        return 0;
    uint64_t cap = g->cap ? g->cap : 64;
    while (cap < want)
        cap *= 2;
    if (cap > (UINT32_MAX - 1) / 2)
        return -1;
    uint64_t *t = realloc(g->time, cap * 8);
    if (t)
        g->time = t;
    uint64_t *cn = t ? realloc(g->count, cap * 8) : NULL;
    if (cn)
        g->count = cn;
    uint32_t *p = cn ? realloc(g->pid, cap * 4) : NULL;
    if (p)
        g->pid = p;
    uint32_t *td = p ? realloc(g->tid, cap * 4) : NULL;
    if (td)
        g->tid = td;
    uint32_t *sd = td ? realloc(g->sid, cap * 4) : NULL;
    if (sd)
        g->sid = sd;
    uint64_t tcap = 2 * cap;
    uint32_t *tab = sd ? calloc(tcap, sizeof *tab) : NULL;
    if (!tab)
        return -1;
    for (uint64_t k = 0; k < g->n; k++) {
        uint64_t j = SLOT(mix(mix(mix(mix(0, g->time[k] / g->bucket_ns), g->pid[k]), g->tid[k]),
                              g->sid[k]),
                          tcap);
        while (tab[j])
            j = SLOT(j + 1, tcap);
        tab[j] = (uint32_t)k + 1;
    }
    free(g->tab);
    g->tab = tab;
    g->tcap = tcap;
    g->cap = cap;
    return 0;
}

uint64_t fp_live_groups_add(struct fp_live_groups *g, const uint8_t *is_sample,
                            const uint32_t *stack_ids, const uint64_t *time, const uint32_t *pid,
                            const uint32_t *tid, uint64_t n)
{
    if (n > UINT32_MAX || groups_reserve(g, g->n + n))
        return UINT64_MAX;
    uint64_t added = 0, bns = g->bucket_ns, tcap = g->tcap;
    for (uint64_t k = 0; k < n; k++) {
        if (!is_sample[k] || stack_ids[k] == UINT32_MAX)
            continue;
        added++;
        uint64_t b = time[k] / bns;
        uint64_t j = SLOT(mix(mix(mix(mix(0, b), pid[k]), tid[k]), stack_ids[k]), tcap);
        for (;;) {
            uint32_t e = g->tab[j];
            if (!e) {
                uint64_t x = g->n++;
                g->tab[j] = (uint32_t)x + 1;
                g->time[x] = time[k];
                g->pid[x] = pid[k];
                g->tid[x] = tid[k];
                g->sid[x] = stack_ids[k];
                g->count[x] = 1;
                break;
            }
            e--;
            if (g->sid[e] == stack_ids[k] && g->pid[e] == pid[k] && g->tid[e] == tid[k] &&
                g->time[e] / bns == b) {
                g->count[e]++;
                if (time[k] > g->time[e])
                    g->time[e] = time[k];
                break;
            }
            j = SLOT(j + 1, tcap);
        }
    }
    return added;
}

void fp_live_groups_take(struct fp_live_groups *g, uint64_t *g_time, uint32_t *g_pid,
                         uint32_t *g_tid, uint32_t *g_sid, uint64_t *g_count)
{
    uint64_t n = g->n;
    if (n) {
        memcpy(g_time, g->time, n * 8), memcpy(g_count, g->count, n * 8);
        memcpy(g_pid, g->pid, n * 4), memcpy(g_tid, g->tid, n * 4), memcpy(g_sid, g->sid, n * 4);
        memset(g->tab, 0, g->tcap * sizeof *g->tab);
    }
    g->n = 0;
}
