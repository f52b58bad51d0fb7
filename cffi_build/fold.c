/* fold.c: the folded-stacks text (flamegraph.pl's collapsed form) of a replay context that
 * aggregates by function (filereplay.py, --format folded): stacks named, merged, sorted and
 * rendered natively.
 *
 * Why: done in Python, each unique stack becomes a joined string of its names, a dict entry
 * and a string sort, and the whole text one more copy. Here a stack is a sequence of name
 * ranks (u32), so merging is one hash and sorting compares at most depth u32 pairs.
 *
 * Invariants:
 * - The same bytes as stackfmt.render_folded over the same stacks (test_filereplay.py
 *   compares with the Python replay): a stack's names are its comm's, then its user frames'
 *   outermost first (none when its sample had no user registers and it has kernel frames: the
 *   engine's kernel_only), then its kernel ips' outermost first (engine.kernel_ips: the
 *   callchain entries after a PERF_CONTEXT_KERNEL marker, up to the next marker); stacks with
 *   the same names are one line, counts summed; lines are in the order of the stacks' tuples
 *   of names. The caller ranks the distinct names in Python's str order, so comparing rank
 *   sequences (a proper prefix first) is comparing those tuples.
 * - Reads the context only through fp_stack; the caller's arrays only during the call that
 *   takes them. A struct fp_fold owns its memory (fp_fold_free).
 * Cost: O(W) to build and hash the sequences (W: names over all unique stacks), O(U log U)
 * comparisons of O(depth) to sort the U merged ones, O(output bytes) to render.
 */
#define _GNU_SOURCE /* qsort_r */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "unwcore.h"
#include "fastpath.h"
#include "fastpath_util.h" /* CTX_*, tally */

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

struct fold_ent {
    uint64_t off;   /* its ranks: seq[off, off + len) */
    uint64_t hash, count;
    uint32_t len;
};

struct fp_fold {
    uint32_t *seq;
    uint64_t nseq, capseq;
    struct fold_ent *ents;
    uint64_t nents, capents;
    uint32_t *tab;      /* open addressing: entry index + 1 */
    uint64_t tabcap;
    uint32_t *order;    /* entries sorted */
    uint64_t next;      /* fp_fold_text: the next line to render */
};

void fp_fold_free(struct fp_fold *f)
{
    if (!f)
        return;
    free(f->seq);
    free(f->ents);
    free(f->tab);
    free(f->order);
    free(f);
}

static int seq_reserve(struct fp_fold *f, uint64_t n)
{
    if (f->nseq + n <= f->capseq)
        return 0;
    uint64_t cap = f->capseq ? f->capseq : 4096;
    while (cap < f->nseq + n)
        cap *= 2;
    uint32_t *q = realloc(f->seq, cap * sizeof *q);
    if (!q)
        return -1;
    f->seq = q;
    f->capseq = cap;
    return 0;
}

static int tab_grow(struct fp_fold *f)
{
    uint64_t cap = f->tabcap ? 2 * f->tabcap : 4096;
    uint32_t *t = calloc(cap, sizeof *t);
    if (!t)
        return -1;
    for (uint64_t i = 0; i < f->nents; i++) {
        uint64_t j = f->ents[i].hash & (cap - 1);
        while (t[j])
            j = (j + 1) & (cap - 1);
        t[j] = (uint32_t)i + 1;
    }
    free(f->tab);
    f->tab = t;
    f->tabcap = cap;
    return 0;
}

/* the index of kernel ip in kips (sorted, distinct), or -1 */
static int64_t kip_index(const uint64_t *kips, uint64_t n, uint64_t ip)
{
    uint64_t lo = 0, hi = n;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (kips[mid] < ip)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && kips[lo] == ip ? (int64_t)lo : -1;
}

/* The next kernel ip of st's callchain from *i on (engine.kernel_ips: entries after a
 * PERF_CONTEXT_KERNEL marker, up to the next marker), *in_k the walk's state (start 0):
 * 1 and *ip, or 0 at the end. */
static int next_kip(const struct fp_stack *st, uint32_t *i, int *in_k, uint64_t *ip)
{
    while (*i < st->nkc) {
        uint64_t v = st->kc[(*i)++];
        if (v >= CTX_MAX) {
            *in_k = v == CTX_KERNEL;
        } else if (*in_k) {
            *ip = v;
            return 1;
        }
    }
    return 0;
}

/* The stack's kernel ip count (engine.kernel_ips) and user frame count as the engine counts
 * them: none when its sample had no user registers and it has kernel frames (kernel_only). */
static void stack_counts(const struct fp_stack *st, uint64_t *nk, uint32_t *nu, int *konly)
{
    uint64_t n = 0, ip;
    uint32_t i = 0;
    int in_k = 0;
    while (next_kip(st, &i, &in_k, &ip))
        n++;
    *nk = n;
    *konly = st->regs_none && n;
    *nu = *konly ? 0 : st->npcs;
}

/* Add stack st (counted count) to f: 0, -1 (memory), -2 (an id or ip the caller did not rank) */
static int fold_add(struct fp_fold *f, const struct fp_stack *st, const uint32_t *comm_rank,
                    uint32_t ncomm, const uint32_t *frame_rank, uint32_t nframes,
                    const uint64_t *kips, const uint32_t *krank, uint64_t nkips)
{
    uint64_t nk;
    uint32_t nu;
    int in_k;
    stack_counts(st, &nk, &nu, &in_k);
    if (nk > UINT32_MAX - 1 - (uint64_t)nu)
        return -2;
    uint32_t len = 1 + nu + (uint32_t)nk;
    if (seq_reserve(f, len))
        return -1;
    uint32_t *s = f->seq + f->nseq;
    if (st->comm_id >= ncomm)
        return -2;
    s[0] = comm_rank[st->comm_id];
    for (uint32_t i = 0; i < nu; i++) { /* fids are leaf first: outermost first here */
        uint32_t fid = st->fids[nu - 1 - i];
        if (fid >= nframes)
            return -2;
        s[1 + i] = frame_rank[fid];
    }
    uint32_t *k = s + 1 + nu + nk; /* kernel ips leaf first too: filled from the end */
    uint64_t ip;
    uint32_t i = 0;
    in_k = 0;
    while (next_kip(st, &i, &in_k, &ip)) {
        int64_t x = kip_index(kips, nkips, ip);
        if (x < 0)
            return -2;
        *--k = krank[x];
    }
    uint64_t h = 0x9e3779b97f4a7c15ull ^ len;
    for (uint32_t i = 0; i < len; i++)
        h = (h ^ s[i]) * 0xff51afd7ed558ccdull;
    h ^= h >> 32;
    if (4 * (f->nents + 1) > 3 * f->tabcap && tab_grow(f))
        return -1;
    uint64_t j = h & (f->tabcap - 1);
    while (f->tab[j]) {
        struct fold_ent *e = &f->ents[f->tab[j] - 1];
        if (e->hash == h && e->len == len && !memcmp(f->seq + e->off, s, 4 * (size_t)len)) {
            e->count += st->count; /* the sequence just written is dropped (not kept) */
            return 0;
        }
        j = (j + 1) & (f->tabcap - 1);
    }
    if (f->nents >= UINT32_MAX - 1)
        return -1;
    if (f->nents == f->capents) {
        uint64_t cap = f->capents ? 2 * f->capents : 1024;
        struct fold_ent *q = realloc(f->ents, cap * sizeof *q);
        if (!q)
            return -1;
        f->ents = q;
        f->capents = cap;
    }
    f->ents[f->nents] = (struct fold_ent){f->nseq, h, st->count, len};
    f->tab[j] = (uint32_t)++f->nents;
    f->nseq += len;
    return 0;
}

static int cmp_ent(const void *a, const void *b, void *arg)
{
    const struct fp_fold *f = arg;
    const struct fold_ent *x = &f->ents[*(const uint32_t *)a];
    const struct fold_ent *y = &f->ents[*(const uint32_t *)b];
    const uint32_t *p = f->seq + x->off, *q = f->seq + y->off;
    uint32_t n = x->len < y->len ? x->len : y->len;
    for (uint32_t i = 0; i < n; i++)
        if (p[i] != q[i])
            return p[i] < q[i] ? -1 : 1;
    return x->len < y->len ? -1 : x->len > y->len; /* (equal sequences are merged) */
}

int fp_fold_new(const struct fp_ctx *c, const uint32_t *comm_rank, uint32_t ncomm,
                const uint32_t *frame_rank, uint32_t nframes, const uint64_t *kips,
                const uint32_t *krank, uint64_t nkips, struct fp_fold **out)
{
    *out = NULL;
    struct fp_fold *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    uint32_t n = fp_nstacks(c);
    for (uint32_t id = 0; id < n; id++) {
        struct fp_stack st;
        int rc = fp_stack(c, id, &st);
        if (!rc)
            rc = fold_add(f, &st, comm_rank, ncomm, frame_rank, nframes, kips, krank, nkips);
        if (rc) {
            fp_fold_free(f);
            return rc < 0 ? rc : -2;
        }
    }
    f->order = malloc((f->nents ? f->nents : 1) * sizeof *f->order);
    if (!f->order) {
        fp_fold_free(f);
        return -1;
    }
    for (uint64_t i = 0; i < f->nents; i++)
        f->order[i] = (uint32_t)i;
    qsort_r(f->order, f->nents, sizeof *f->order, cmp_ent, f);
    *out = f;
    return 0;
}

uint64_t fp_fold_lines(const struct fp_fold *f) { return f->nents; }

int64_t fp_fold_text(struct fp_fold *f, const uint8_t *names, const uint64_t *name_off,
                     uint32_t nnames, uint8_t *buf, uint64_t cap)
{
    uint64_t w = 0;
    for (; f->next < f->nents; f->next++) {
        const struct fold_ent *e = &f->ents[f->order[f->next]];
        const uint32_t *s = f->seq + e->off;
        uint64_t need = e->len + 22; /* ';'s, ' ', count (<= 20 digits), '\n' */
        for (uint32_t i = 0; i < e->len; i++) {
            if (s[i] >= nnames || name_off[s[i] + 1] < name_off[s[i]])
                return INT64_MIN;
            need += name_off[s[i] + 1] - name_off[s[i]];
        }
        if (w + need > cap) {
            if (w)
                break;
            return -(int64_t)need; /* this line alone needs a larger buffer */
        }
        for (uint32_t i = 0; i < e->len; i++) {
            uint64_t a = name_off[s[i]], z = name_off[s[i] + 1];
            if (i)
                buf[w++] = ';';
            memcpy(buf + w, names + a, z - a);
            w += z - a;
        }
        buf[w++] = ' ';
        char dig[20];
        int nd = 0;
        uint64_t v = e->count;
        do {
            dig[nd++] = (char)('0' + v % 10);
            v /= 10;
        } while (v);
        while (nd)
            buf[w++] = (uint8_t)dig[--nd];
        buf[w++] = '\n';
    }
    return (int64_t)w;
}

int fp_fold_stats(const struct fp_ctx *c, uint64_t *by_status, uint32_t *first,
                  uint64_t *user_frames, uint64_t *kernel_frames)
{
    for (int k = 0; k < FP_FOLD_NSTATUS; k++) {
        by_status[k] = 0;
        first[k] = UINT32_MAX;
    }
    *user_frames = *kernel_frames = 0;
    uint32_t n = fp_nstacks(c);
    for (uint32_t id = 0; id < n; id++) {
        struct fp_stack st;
        if (fp_stack(c, id, &st))
            return -1;
        uint64_t nk;
        uint32_t nu;
        int konly;
        stack_counts(&st, &nk, &nu, &konly);
        int k = konly ? FP_FOLD_NSTATUS - 1 : st.status;
        if (k >= FP_FOLD_NSTATUS - 1 && !konly)
            return -1;
        by_status[k] += st.count;
        if (first[k] == UINT32_MAX)
            first[k] = id;
        *user_frames += (uint64_t)nu * st.count;
        *kernel_frames += nk * st.count;
    }
    return 0;
}

uint64_t fp_kernel_ips(const struct fp_ctx *c, uint64_t *out, uint64_t cap)
{
    /* every kernel ip of every stack into out while it fits, then sorted and made distinct
     * in place; the count needed if it does not fit (the caller calls again with room) */
    uint64_t n = 0;
    uint32_t ns = fp_nstacks(c);
    for (uint32_t id = 0; id < ns; id++) {
        struct fp_stack st;
        if (fp_stack(c, id, &st))
            continue;
        uint64_t ip;
        uint32_t i = 0;
        int in_k = 0;
        while (next_kip(&st, &i, &in_k, &ip)) {
            if (n < cap)
                out[n] = ip;
            n++;
        }
    }
    if (n > cap)
        return n;
    qsort(out, n, sizeof *out, cmp_u64);
    uint64_t d = 0;
    for (uint64_t i = 0; i < n; i++)
        if (!d || out[d - 1] != out[i])
            out[d++] = out[i];
    return d;
}

void fp_stacks_unsym(const struct fp_ctx *c, uint32_t from, uint32_t to, const uint8_t *unsym,
                     uint32_t nframes, uint32_t *out)
{
    for (uint32_t id = from; id < to; id++) {
        struct fp_stack st;
        uint32_t k = 0;
        if (!fp_stack(c, id, &st)) {
            uint64_t nk;
            uint32_t nu;
            int konly;
            stack_counts(&st, &nk, &nu, &konly);
            for (uint32_t i = 0; i < nu; i++)
                k += st.fids[i] < nframes && unsym[st.fids[i]];
        }
        out[id - from] = k;
    }
}

/* The replay's stream counts (filereplay._stream_stats): the distinct vals[k] of the k < n
 * with flag[k] set, in first-seen order, with how many times each occurs, as (value, count)
 * pairs (room for 2n). Returns their number, UINT64_MAX on allocation failure. O(n) expected. */
uint64_t fp_count_flagged(const uint8_t *flag, const uint32_t *vals, uint64_t n, uint64_t *pairs)
{
    uint64_t tcap = 16, d = 0;
    while (tcap < 2 * n)
        tcap *= 2;
    uint32_t *tab = calloc(tcap, sizeof *tab);
    if (!tab)
        return UINT64_MAX;
    for (uint64_t k = 0; k < n; k++)
        if (flag[k])
            tally(tab, tcap, pairs, &d, vals[k]);
    free(tab);
    return d;
}
