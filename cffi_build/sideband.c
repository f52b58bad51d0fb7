/* sideband.c: find the side-band records a replay may skip, natively (filereplay.py:
 * unw_sb_scan/unw_sb_compact below, unw_sb_unsampled and unw_sb_noop_mmaps further down, each
 * with its proof; unw_sb_lazy, unw_sb_lazy_exits: records counted in bulk, decoded only if
 * applied); list and mark the live step's side-band records in bulk (ringstep.py:
 * unw_sb_rows, unw_sb_marks, unw_sb_trailer_marks, unw_sb_slots, each the C form of a Python
 * loop it replaced, tests/unit/test_sideband_live.py holds them to it; they read and write
 * only the index entries and arrays they are given, O(entries)).
 *
 * Why: deep CPython recursion mmaps/munmaps frame chunks, so a profile can carry hundreds of
 * thousands of MMAP2 records of anonymous read/write memory, each costly to decode and apply
 * in Python; none of them changes the process table (proctable.py: a non-executable mapping
 * is never inserted and cuts only what it overlaps).
 *
 * Invariants of unw_sb_scan (the proof that a skipped record is a no-op for
 * ProcessTable.apply in replay):
 * - Every mapping a replay's table ever holds is a piece of the range of an executable
 *   MMAP/MMAP2 record of the file (records are the only source in replay; cuts and FORK copies
 *   only shrink or copy ranges). A non-executable MMAP2 whose range overlaps no such range
 *   (taken over the WHOLE file, any pid, conservatively) therefore cuts nothing.
 * - add_mapping creates the pid's space (space_for) even when it changes nothing else, and in
 *   replay a space is never dropped for good (FORK over a used pid re-creates it at once). So
 *   the first candidate of each pid in delivered order is kept (Python applies it); only later
 *   ones are skipped.
 * - A candidate is a record Python would decode without error or repair: not flagged
 *   PERF_RECORD_MISC_MMAP_BUILD_ID, body long enough for the fixed part (64 bytes) and the
 *   sample_id trailer, start + len not wrapping. Its time/cpu/flags are set in its index entry
 *   exactly as filereplay.py sets them from the decoded record.
 *
 * Cost: O(R log R) for R side-band records; memory O(exec ranges + candidate pids); the later
 * passes O(R) and O(pids + their ranges).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "unwcore.h"
#include "fastpath.h"

#define REC_MMAP 1
#define REC_COMM 3
#define REC_EXIT 4
#define REC_FORK 7
#define REC_MMAP2 10
#define MISC_MMAP_DATA 0x2000
#define MISC_MMAP_BUILD_ID 0x4000
#define PROT_EXEC 4

struct range { uint64_t lo, hi; };

static int cmp_range(const void *a, const void *b)
{
    const struct range *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

static uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* The time/cpu/flags context.record_marks gives a record whose sample_id trailer is at sid
 * (t_off, c_off: the trailer's time and cpu offsets, < 0 when absent). */
static void mark(struct fp_rec *r, const uint8_t *sid, int32_t t_off, int32_t c_off)
{
    uint8_t flags = 0;
    if (t_off >= 0) {
        r->time = rd64(sid + t_off);
        flags |= FP_TIMED;
    }
    if (c_off >= 0) {
        r->cpu = rd32(sid + c_off);
        flags |= FP_HAS_CPU;
    }
    r->flags = flags;
}

int64_t unw_sb_scan(const uint8_t *data, uint64_t len, void *recs_, uint32_t *idx,
                    uint64_t n, uint32_t sid_size, int32_t t_off, int32_t c_off,
                    uint8_t *cand, uint32_t *pids, uint64_t *nrest)
{
    struct fp_rec *recs = recs_;
    struct range *ex = malloc((n ? n : 1) * sizeof *ex);
    if (!ex)
        return -1;
    uint64_t nex = 0;
    /* 1. every range an executable mapping of the file could cover (unreadable ones too) */
    for (uint64_t i = 0; i < n; i++) {
        const struct fp_rec *r = &recs[idx[i]];
        if ((r->type != REC_MMAP && r->type != REC_MMAP2) || r->off + r->size > len)
            continue;
        const uint8_t *b = data + r->off + 8;
        uint64_t blen = r->size >= 8 ? r->size - 8u : 0;
        if (blen < 24)
            continue; /* no range to read: Python cannot decode it either (short_body) */
        uint64_t addr = rd64(b + 8), l = rd64(b + 16);
        int exec = r->type == REC_MMAP ? !(r->misc & MISC_MMAP_DATA)
                                       : blen < 64 || (rd32(b + 56) & PROT_EXEC);
        if (!exec)
            continue;
        ex[nex].lo = addr;
        ex[nex].hi = addr + l < addr ? UINT64_MAX : addr + l;
        nex++;
    }
    qsort(ex, nex, sizeof *ex, cmp_range);
    uint64_t m = 0; /* merge into disjoint, sorted ranges */
    for (uint64_t i = 0; i < nex; i++) {
        if (m && ex[i].lo <= ex[m - 1].hi) {
            if (ex[i].hi > ex[m - 1].hi)
                ex[m - 1].hi = ex[i].hi;
        } else {
            ex[m++] = ex[i];
        }
    }
    /* 2. candidates */
    int64_t ncand = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t ri = idx[i];
        struct fp_rec *r = &recs[ri];
        if (r->type != REC_MMAP2 || (r->misc & MISC_MMAP_BUILD_ID) || r->off + r->size > len)
            continue;
        uint64_t blen = r->size >= 8 ? r->size - 8u : 0;
        if (blen < 64 + (uint64_t)sid_size)
            continue;
        const uint8_t *b = data + r->off + 8;
        uint64_t addr = rd64(b + 8), l = rd64(b + 16);
        if ((rd32(b + 56) & PROT_EXEC) || l == 0 || addr + l < addr)
            continue;
        uint64_t hi = addr + l, a = 0, z = m; /* first merged range with lo >= hi */
        while (a < z) {
            uint64_t mid = a + (z - a) / 2;
            if (ex[mid].lo < hi)
                a = mid + 1;
            else
                z = mid;
        }
        if (a > 0 && ex[a - 1].hi > addr)
            continue; /* overlaps an executable range */
        mark(r, b + blen - sid_size, t_off, c_off);
        cand[ri] = 1;
        pids[ri] = rd32(b);
        ncand++;
    }
    free(ex);
    uint64_t w = 0; /* idx keeps the non-candidates, in order */
    for (uint64_t i = 0; i < n; i++)
        if (!cand[idx[i]])
            idx[w++] = idx[i];
    *nrest = w;
    return ncand;
}

uint64_t unw_sb_compact(uint32_t *perm, uint64_t m, uint8_t *cand, const uint32_t *pids,
                        uint64_t ncand, const void *recs_, uint32_t *kept, uint64_t *nkept,
                        uint32_t *skipped_cpus)
{
    const struct fp_rec *recs = recs_;
    uint64_t nk = 0, ns = 0;
    /* open-addressing set of pids whose first candidate was already delivered */
    uint64_t cap = 16;
    while (cap < 2 * ncand + 2)
        cap <<= 1;
    uint64_t *set = malloc(cap * sizeof *set);
    if (!set)
        return UINT64_MAX;
    memset(set, 0xff, cap * sizeof *set); /* UINT64_MAX = empty; pids are 32-bit */
    uint64_t w = 0;
    for (uint64_t k = 0; k < m; k++) {
        uint32_t ri = perm[k];
        if (cand[ri]) {
            uint64_t pid = pids[ri], h = (pid * 0x9E3779B97F4A7C15ULL) & (cap - 1);
            while (set[h] != UINT64_MAX && set[h] != pid)
                h = (h + 1) & (cap - 1);
            if (set[h] == pid) { /* a later candidate of a pid with a space: skipped */
                skipped_cpus[ns++] = recs[ri].cpu;
                continue;
            }
            set[h] = pid;
            cand[ri] = 2; /* kept: Python decodes and applies it */
            kept[nk++] = ri;
        }
        perm[w++] = ri;
    }
    free(set);
    *nkept = nk;
    return w;
}

/* The MMAP2 records a replay decodes only when it applies them (filereplay.py): every MMAP2
 * that RecordDecoder decodes without error or repair (not flagged
 * PERF_RECORD_MISC_MMAP_BUILD_ID, its fixed part and sample_id trailer inside the body, the
 * record inside the data) gets the time/cpu/flags record_marks would give it, and
 * is listed in lazy; the decoder's and StreamStats' counts of them are taken in bulk (a MMAP2
 * counts by type and cpu only). So no MMAP2 is decoded twice, and one the replay finds to
 * change nothing is never decoded. */
int64_t unw_sb_lazy(const uint8_t *data, uint64_t len, void *recs_, uint32_t *idx, uint64_t n,
                    uint32_t sid_size, int32_t t_off, int32_t c_off, uint32_t *lazy,
                    uint64_t *nrest)
{
    struct fp_rec *recs = recs_;
    int64_t nlazy = 0;
    uint64_t w = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t ri = idx[i];
        struct fp_rec *r = &recs[ri];
        uint64_t blen = r->size >= 8 ? r->size - 8u : 0;
        if (r->type != REC_MMAP2 || (r->misc & MISC_MMAP_BUILD_ID) || r->off + r->size > len
            || blen < 64 + (uint64_t)sid_size) {
            idx[w++] = ri;
            continue;
        }
        mark(r, data + r->off + 8 + blen - sid_size, t_off, c_off);
        lazy[nlazy++] = ri;
    }
    *nrest = w;
    return nlazy;
}

/* ---- unw_sb_unsampled: side-band records no sample depends on (filereplay.py)
 *
 * A replay applies side-band records only for what its samples read: pid P's address space
 * (ProcessTable.space_for, for placing and naming) and thread T's name (engine.comm_of: T's,
 * else P's). What each record type does to those (proctable.py, engine.note_comm):
 * - MMAP/MMAP2 of pid P changes space(P) from its previous value (cuts, inserts);
 * - COMM of tid T sets comm(T); with PERF_RECORD_MISC_COMM_EXEC and pid == tid it also clears
 *   space(P) (exec: nothing before it survives, fs/exec.c begin_new_exec);
 * - FORK (pid P, ppid Q, tid T, ptid U) sets comm(T) from comm(U), else comm(Q) (perf's
 *   thread__fork); for a new process (P != Q) space(P) becomes a copy of space(Q) (a thread,
 *   P == Q, leaves every space alone);
 * - EXIT only retires a space, which no replay reads;
 * - any other record type changes neither (LOST, THROTTLE, ... are kept all the same).
 * So the records that matter are found backwards, as liveness: walking the delivered order
 * from its end, a set D holds every space(P) and comm(T) some later sample or kept record
 * reads before it is wholly set again. A sample of (P, T) adds space(P), comm(T), comm(P). A
 * record is kept iff it sets something in D; a record that sets a value wholly (COMM, FORK,
 * exec) removes it from D, then a kept FORK adds what it copied from: comm(U) and comm(Q) for
 * comm(T), space(Q) for space(P). A MMAP keeps space(P) in D (it changes what was there).
 * Every other record changes nothing a sample reads, at any later time: skipping it leaves
 * each sample's space mappings and comm as they were (pid reuse is a FORK that sets the new
 * process's space wholly; a process not sampled after a point keeps its records from then on
 * only as far as a child forked later reads them). A space a kept record creates exists as
 * before: spaces are created by their pid's MMAPs, exec, FORK as a child, or a sample, and
 * never dropped for good in a replay; while space(P) is in D every record that could have
 * created it before is kept back to the one that set it wholly (itself a creator).
 * A record that may not decode (too short for its fixed part and the trailer, or a MMAP2
 * flagged PERF_RECORD_MISC_MMAP_BUILD_ID with a build-id size over 20: a BadRecord, no effect,
 * decoder.py) is kept and sets nothing, so a record dropped is one ProcessTable.apply counts
 * as ``counts`` does. A file with a jitdump mapping (a name ending in ".dump":
 * the replay cuts runs at its code replacements, across pids) skips nothing.
 * Cost: O(m) time, O(distinct pids and tids) memory. */

#define PERF_RECORD_MISC_COMM_EXEC 0x2000
#define KIND_SPACE (1ULL << 32)
#define KIND_COMM (2ULL << 32)

/* A growable open-addressing set of u64 keys (never 0), each on or off. */
struct kset {
    uint64_t *keys;
    uint8_t *on;
    uint64_t cap, n;
};

static uint64_t kslot(const struct kset *s, uint64_t key)
{
    uint64_t h = (key * 0x9E3779B97F4A7C15ULL) >> 17 & (s->cap - 1);
    while (s->keys[h] && s->keys[h] != key)
        h = (h + 1) & (s->cap - 1);
    return h;
}

static int kset_has(const struct kset *s, uint64_t key)
{
    uint64_t h = kslot(s, key);
    return s->keys[h] == key && s->on[h];
}

static int kset_put(struct kset *s, uint64_t key, uint8_t on)
{
    if (2 * (s->n + 1) > s->cap) {
        struct kset t = { calloc(2 * s->cap, 8), calloc(2 * s->cap, 1), 2 * s->cap, s->n };
        if (!t.keys || !t.on) {
            free(t.keys);
            free(t.on);
            return -1;
        }
        for (uint64_t i = 0; i < s->cap; i++)
            if (s->keys[i]) {
                uint64_t h = kslot(&t, s->keys[i]);
                t.keys[h] = s->keys[i];
                t.on[h] = s->on[i];
            }
        free(s->keys);
        free(s->on);
        *s = t;
    }
    uint64_t h = kslot(s, key);
    if (!s->keys[h]) {
        if (!on)
            return 0; /* off and absent are the same */
        s->keys[h] = key;
        s->n++;
    }
    s->on[h] = on;
    return 0;
}

/* The body of r and the end of its fixed part and strings (before the sample_id trailer), or
 * NULL when the record is not inside data or too short for fixed + trailer bytes. */
static const uint8_t *sb_body(const uint8_t *data, uint64_t len, const struct fp_rec *r,
                              uint64_t fixed, uint32_t sid_size, uint64_t *end)
{
    uint64_t blen = r->size >= 8 ? r->size - 8u : 0;
    if (r->off + r->size > len || blen < fixed + (uint64_t)sid_size)
        return NULL;
    *end = blen - sid_size;
    return data + r->off + 8;
}

/* Whether the C string at b[from, end) (to its NUL) ends with ".dump". */
static int dump_name(const uint8_t *b, uint64_t from, uint64_t end)
{
    const uint8_t *z = memchr(b + from, 0, end - from);
    uint64_t n = z ? (uint64_t)(z - (b + from)) : end - from;
    return n >= 5 && memcmp(b + from + n - 5, ".dump", 5) == 0;
}

/* perm[0..m) with only the entries keep[] marks, in order; the new length. */
static int64_t keep_only(uint32_t *perm, const uint8_t *keep, uint64_t m)
{
    uint64_t w = 0;
    for (uint64_t k = 0; k < m; k++)
        if (keep[k])
            perm[w++] = perm[k];
    return (int64_t)w;
}

int64_t unw_sb_unsampled(const uint8_t *data, uint64_t len, const void *recs_, uint32_t *perm,
                         uint64_t m, uint32_t sid_size, uint64_t *counts)
{
    const struct fp_rec *recs = recs_;
    for (int i = 0; i < UNW_SB_NCOUNTS; i++)
        counts[i] = 0;
    uint8_t *keep = malloc(m ? m : 1);
    struct kset d = { calloc(1024, 8), calloc(1024, 1), 1024, 0 };
    int64_t rc = -1;
    if (!keep || !d.keys || !d.on)
        goto out;
    for (uint64_t k = m; k-- > 0;) {
        const struct fp_rec *r = &recs[perm[k]];
        uint64_t end;
        const uint8_t *b;
        keep[k] = 1;
        if (r->flags & FP_SAMPLE) {
            if (kset_put(&d, KIND_SPACE | r->pid, 1) || kset_put(&d, KIND_COMM | r->tid, 1)
                || kset_put(&d, KIND_COMM | r->pid, 1))
                goto out;
            continue;
        }
        switch (r->type) {
        case REC_MMAP:
        case REC_MMAP2: {
            uint64_t fixed = r->type == REC_MMAP ? 32 : 64;
            if (!(b = sb_body(data, len, r, fixed, sid_size, &end)))
                break; /* a BadRecord: kept, sets nothing */
            if (dump_name(b, fixed, end)) {
                rc = (int64_t)m; /* a jitdump: nothing skipped */
                for (int i = 0; i < UNW_SB_NCOUNTS; i++)
                    counts[i] = 0;
                goto out;
            }
            if (r->type == REC_MMAP2 && (r->misc & MISC_MMAP_BUILD_ID) && b[32] > 20)
                break; /* maybe a BadRecord: kept (it can change only its pid's space) */
            if (!kset_has(&d, KIND_SPACE | rd32(b))) {
                keep[k] = 0;
                counts[r->type == REC_MMAP ? UNW_SB_MMAP : UNW_SB_MMAP2]++;
            }
            break;
        }
        case REC_COMM: {
            if (!(b = sb_body(data, len, r, 8, sid_size, &end)))
                break;
            uint32_t pid = rd32(b), tid = rd32(b + 4);
            int exec = (r->misc & PERF_RECORD_MISC_COMM_EXEC) && pid == tid;
            if (!kset_has(&d, KIND_COMM | tid) && !(exec && kset_has(&d, KIND_SPACE | pid))) {
                keep[k] = 0;
                counts[exec ? UNW_SB_EXEC : UNW_SB_COMM]++;
            }
            if (kset_put(&d, KIND_COMM | tid, 0) || (exec && kset_put(&d, KIND_SPACE | pid, 0)))
                goto out;
            break;
        }
        case REC_FORK: {
            if (!(b = sb_body(data, len, r, 24, sid_size, &end)))
                break;
            uint32_t pid = rd32(b), ppid = rd32(b + 4), tid = rd32(b + 8), ptid = rd32(b + 12);
            int comm = kset_has(&d, KIND_COMM | tid);
            int space = pid != ppid && kset_has(&d, KIND_SPACE | pid);
            if (!comm && !space) {
                keep[k] = 0;
                counts[UNW_SB_FORK]++;
                break;
            }
            /* what it sets wholly first, then what it reads (a FORK reading what it sets
             * keeps it in D) */
            if ((comm && kset_put(&d, KIND_COMM | tid, 0))
                || (space && kset_put(&d, KIND_SPACE | pid, 0))
                || (comm && (kset_put(&d, KIND_COMM | ptid, 1)
                             || kset_put(&d, KIND_COMM | ppid, 1)))
                || (space && kset_put(&d, KIND_SPACE | ppid, 1)))
                goto out;
            break;
        }
        case REC_EXIT:
            if (sb_body(data, len, r, 24, sid_size, &end)) {
                keep[k] = 0;
                counts[UNW_SB_EXIT]++;
            }
            break;
        default:
            break;
        }
    }
    rc = keep_only(perm, keep, m);
out:
    free(keep);
    free(d.keys);
    free(d.on);
    return rc;
}

/* ---- unw_sb_noop_mmaps: data MMAP2s that change no space, found by following each space
 *
 * ProcessTable.add_mapping of a non-executable mapping only cuts the executable mappings it
 * overlaps (and creates the pid's space): one of a pid that has a space and overlapping none
 * of its mappings changes nothing (filereplay.py _raw_noop asks the same of the table). Here
 * the union of each pid's executable ranges is followed through the delivered records the
 * replay applies, as proctable.py changes them: an executable MMAP2 (or MMAP without
 * PERF_RECORD_MISC_MMAP_DATA) cuts what it overlaps and is inserted, a data one cuts, an exec
 * (COMM with PERF_RECORD_MISC_COMM_EXEC, pid == tid) empties the space, a FORK of a new
 * process copies its parent's (empty if the parent has none), an empty mapping changes
 * nothing. A space exists from its pid's first sample, non-empty mapping, exec or FORK as a
 * child (never dropped in a replay). The ranges followed are a superset of the table's and
 * "exists" implies the table has the space: a MMAP2 that may or may not decode (flagged
 * PERF_RECORD_MISC_MMAP_BUILD_ID with a build-id size over 20) adds its range if executable
 * and cuts nothing; a record too short to decode is a BadRecord, no change. So a data MMAP2
 * found here to overlap nothing of an existing space is a no-op for the table: dropped.
 * A range past 2^64 (addr + len wraps: Python's are unbounded) drops nothing at all, nor does
 * a file that maps a jitdump (a dropped record would merge two runs of samples, and the replay
 * names JIT frames per run: unw_sb_unsampled).
 * Cost: O(m + mappings per pid per change) time, O(mappings of all pids) memory. */

struct pranges {
    uint32_t pid;
    uint8_t used, exists;
    uint32_t n, cap;
    struct range *r; /* sorted, disjoint (a union: adjacent ranges may be merged) */
};

struct ptable {
    struct pranges *p;
    uint64_t cap, n;
};

static struct pranges *pt_get(struct ptable *t, uint32_t pid)
{
    if (2 * (t->n + 1) > t->cap) {
        struct ptable u = { calloc(2 * t->cap, sizeof *t->p), 2 * t->cap, 0 };
        if (!u.p)
            return NULL;
        for (uint64_t i = 0; i < t->cap; i++)
            if (t->p[i].used) {
                uint64_t h = (t->p[i].pid * 0x9E3779B97F4A7C15ULL) >> 20 & (u.cap - 1);
                while (u.p[h].used)
                    h = (h + 1) & (u.cap - 1);
                u.p[h] = t->p[i];
                u.n++;
            }
        free(t->p);
        *t = u;
    }
    uint64_t h = (pid * 0x9E3779B97F4A7C15ULL) >> 20 & (t->cap - 1);
    while (t->p[h].used && t->p[h].pid != pid)
        h = (h + 1) & (t->cap - 1);
    if (!t->p[h].used) {
        t->p[h].used = 1;
        t->p[h].pid = pid;
        t->n++;
    }
    return &t->p[h];
}

static int pr_reserve(struct pranges *s, uint32_t n)
{
    if (n <= s->cap)
        return 0;
    uint32_t cap = s->cap ? s->cap : 8;
    while (cap < n)
        cap *= 2;
    struct range *r = realloc(s->r, cap * sizeof *r);
    if (!r)
        return -1;
    s->r = r;
    s->cap = cap;
    return 0;
}

/* The index of the first range ending after lo. */
static uint32_t pr_first(const struct pranges *s, uint64_t lo)
{
    uint32_t a = 0, z = s->n;
    while (a < z) {
        uint32_t mid = a + (z - a) / 2;
        if (s->r[mid].hi <= lo)
            a = mid + 1;
        else
            z = mid;
    }
    return a;
}

static int pr_overlaps(const struct pranges *s, uint64_t lo, uint64_t hi)
{
    uint32_t i = pr_first(s, lo);
    return i < s->n && s->r[i].lo < hi;
}

/* Remove [lo, hi) (keeping the pieces before and after it); with ins, insert it then. */
static int pr_cut(struct pranges *s, uint64_t lo, uint64_t hi, int ins)
{
    uint32_t i = pr_first(s, lo), j = i;
    while (j < s->n && s->r[j].lo < hi)
        j++;
    /* ranges [i, j) overlap [lo, hi): they become a head piece, [lo, hi) if ins, a tail */
    struct range head = { 0, 0 }, tail = { 0, 0 };
    int nh = 0, nt = 0;
    if (i < j && s->r[i].lo < lo) {
        head.lo = s->r[i].lo;
        head.hi = lo;
        nh = 1;
    }
    if (i < j && s->r[j - 1].hi > hi) {
        tail.lo = hi;
        tail.hi = s->r[j - 1].hi;
        nt = 1;
    }
    uint32_t put = (uint32_t)(nh + nt + (ins ? 1 : 0)), old = j - i;
    if (pr_reserve(s, s->n - old + put))
        return -1;
    if (j < s->n) /* (s->r may be NULL when there is nothing to move) */
        memmove(s->r + i + put, s->r + j, (s->n - j) * sizeof *s->r);
    s->n = s->n - old + put;
    if (nh)
        s->r[i++] = head;
    if (ins) {
        s->r[i].lo = lo;
        s->r[i++].hi = hi;
    }
    if (nt)
        s->r[i] = tail;
    return 0;
}

int64_t unw_sb_noop_mmaps(const uint8_t *data, uint64_t len, const void *recs_, uint32_t *perm,
                          uint64_t m, uint32_t sid_size)
{
    const struct fp_rec *recs = recs_;
    struct ptable t = { calloc(256, sizeof(struct pranges)), 256, 0 };
    uint8_t *keep = malloc(m ? m : 1);
    int64_t rc = -1;
    if (!t.p || !keep)
        goto out;
    for (uint64_t k = 0; k < m; k++) {
        const struct fp_rec *r = &recs[perm[k]];
        uint64_t end;
        const uint8_t *b;
        struct pranges *s, *q;
        keep[k] = 1;
        if (r->flags & FP_SAMPLE) {
            if (!(s = pt_get(&t, r->pid)))
                goto out;
            s->exists = 1;
            continue;
        }
        switch (r->type) {
        case REC_MMAP:
        case REC_MMAP2: {
            uint64_t fixed = r->type == REC_MMAP ? 32 : 64;
            if (!(b = sb_body(data, len, r, fixed, sid_size, &end)))
                break; /* a BadRecord */
            uint64_t addr = rd64(b + 8), l = rd64(b + 16);
            if (addr + l < addr || dump_name(b, fixed, end)) {
                rc = UNW_SB_UNTOUCHED; /* past 2^64, or a jitdump (as unw_sb_unsampled) */
                goto out;
            }
            if (!l)
                break; /* add_mapping ignores it */
            int exec = r->type == REC_MMAP ? !(r->misc & MISC_MMAP_DATA)
                                           : (rd32(b + 56) & PROT_EXEC) != 0;
            if (!(s = pt_get(&t, rd32(b))))
                goto out;
            if (r->type == REC_MMAP2 && (r->misc & MISC_MMAP_BUILD_ID) && b[32] > 20) {
                /* maybe a BadRecord: its range kept if executable, nothing cut or created */
                if (exec && pr_cut(s, addr, addr + l, 1))
                    goto out;
                break;
            }
            if (!exec && s->exists && !pr_overlaps(s, addr, addr + l)
                && r->type == REC_MMAP2) {
                keep[k] = 0;
                break;
            }
            s->exists = 1;
            if (pr_cut(s, addr, addr + l, exec))
                goto out;
            break;
        }
        case REC_COMM:
            if (!(b = sb_body(data, len, r, 8, sid_size, &end)) || !(r->misc & PERF_RECORD_MISC_COMM_EXEC)
                || rd32(b) != rd32(b + 4))
                break;
            if (!(s = pt_get(&t, rd32(b))))
                goto out;
            s->exists = 1;
            s->n = 0;
            break;
        case REC_FORK: {
            if (!(b = sb_body(data, len, r, 24, sid_size, &end)) || rd32(b) == rd32(b + 4))
                break;
            if (!(q = pt_get(&t, rd32(b + 4))))
                goto out;
            uint32_t ppid_exists = q->exists, nq = q->n;
            struct range *copy = NULL;
            if (ppid_exists && nq) {
                if (!(copy = malloc(nq * sizeof *copy)))
                    goto out;
                memcpy(copy, q->r, nq * sizeof *copy);
            }
            if (!(s = pt_get(&t, rd32(b)))) { /* (may move q: the table grows) */
                free(copy);
                goto out;
            }
            s->exists = 1;
            s->n = 0;
            if (copy) {
                if (pr_reserve(s, nq)) {
                    free(copy);
                    goto out;
                }
                memcpy(s->r, copy, nq * sizeof *copy);
                s->n = nq;
                free(copy);
            }
            break;
        }
        default:
            break;
        }
    }
    rc = keep_only(perm, keep, m);
out:
    if (t.p)
        for (uint64_t i = 0; i < t.cap; i++)
            free(t.p[i].r);
    free(t.p);
    free(keep);
    return rc;
}

/* The EXIT records a replay never decodes (filereplay.py _lazy_exits): every EXIT whose body
 * holds its fixed part (24 bytes) and the sample_id trailer, inside the data (what
 * RecordDecoder decodes without error), gets the marks context.record_marks gives its value
 * (the body's time, always set, and the trailer's cpu, as unw_sb_trailer_marks) and is listed
 * in lazy; their counts are taken in bulk (an EXIT counts by type and cpu only). */
int64_t unw_sb_lazy_exits(const uint8_t *data, uint64_t len, void *recs_, uint32_t *idx,
                          uint64_t n, uint32_t sid_size, int32_t t_off, int32_t c_off,
                          uint32_t *lazy, uint64_t *nrest)
{
    struct fp_rec *recs = recs_;
    int64_t nlazy = 0;
    uint64_t w = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t ri = idx[i];
        struct fp_rec *r = &recs[ri];
        uint64_t end;
        const uint8_t *b;
        if (r->type != REC_EXIT || !(b = sb_body(data, len, r, 24, sid_size, &end))) {
            idx[w++] = ri;
            continue;
        }
        mark(r, b + end, t_off, c_off);
        r->time = rd64(b + 16);
        r->flags |= FP_TIMED;
        lazy[nlazy++] = ri;
    }
    *nrest = w;
    return nlazy;
}

/* The live step reads every side-band entry's header fields once, here, instead of one cffi
 * attribute access per field per record; and writes back the marks its decoded records give
 * (context.mark_record: a field is written only when its flag is set). */
uint64_t unw_sb_rows(const void *recs_, uint64_t n, uint64_t *rows)
{
    const struct fp_rec *recs = recs_;
    uint64_t k = 0;
    for (uint64_t i = 0; i < n && i <= UINT32_MAX; i++) {
        const struct fp_rec *r = &recs[i];
        if (r->flags & FP_SAMPLE)
            continue;
        uint64_t *row = rows + 5 * k++;
        row[0] = i;
        row[1] = r->type;
        row[2] = r->misc;
        row[3] = r->off;
        row[4] = r->size;
    }
    return k;
}

void unw_sb_marks(void *recs_, const uint32_t *idx, const uint64_t *marks, uint64_t k)
{
    struct fp_rec *recs = recs_;
    for (uint64_t j = 0; j < k; j++) {
        struct fp_rec *r = &recs[idx[j]];
        const uint64_t *m = marks + 3 * j;
        uint8_t flags = (uint8_t)m[2];
        if (flags & FP_TIMED)
            r->time = m[0];
        if (flags & FP_HAS_CPU)
            r->cpu = (uint32_t)m[1];
        r->flags = flags;
    }
}

/* The live step marks the common side-band records of a round here, new and carried ones
 * alike (the carry keeps each record's bytes), as their decoded values would
 * (ringstep.py _decode_others marks the rest, rare: LOST, THROTTLE, a SAMPLE that failed
 * the C checks, a build-id MMAP2, from their decoded values). Layouts: decoder.py (MMAP2's
 * fixed part is 64 bytes, FORK/EXIT's pid, ppid, tid, ptid, time 24, COMM's pid, tid 8). */
uint64_t unw_sb_trailer_marks(const uint8_t *data, uint64_t len, void *recs_, const uint32_t *idx,
                              uint64_t k, uint32_t sid_size, int32_t t_off, int32_t c_off,
                              uint32_t *rest)
{
    struct fp_rec *recs = recs_;
    uint64_t nrest = 0;
    for (uint64_t j = 0; j < k; j++) {
        struct fp_rec *r = &recs[idx[j]];
        uint64_t fixed;
        if (r->type == REC_MMAP2 && !(r->misc & MISC_MMAP_BUILD_ID))
            fixed = 64;
        else if (r->type == REC_COMM)
            fixed = 8;
        else if (r->type == REC_FORK || r->type == REC_EXIT)
            fixed = 24;
        else {
            rest[nrest++] = idx[j];
            continue;
        }
        uint64_t blen = r->size >= 8 ? r->size - 8u : 0;
        if (blen < fixed + sid_size || r->off + r->size > len) {
            r->flags = 0; /* short_body / short_sample_id: a BadRecord, no time, no cpu */
            continue;
        }
        const uint8_t *b = data + r->off + 8;
        mark(r, b + blen - sid_size, t_off, c_off);
        if (r->type == REC_FORK || r->type == REC_EXIT) {
            r->time = rd64(b + 16); /* Fork.time / Exit.time: the body's, never absent */
            r->flags |= FP_TIMED;
        }
    }
    return nrest;
}

/* The carried side-band records' new index entries (ringstep.py _carry_round): the carry is
 * gathered in keep order, so a record's next index is its position in keep. */
void unw_sb_slots(const uint32_t *keep, uint64_t nkeep, const uint32_t *want, uint64_t k,
                  uint32_t *inv, uint32_t *out)
{
    for (uint64_t j = 0; j < nkeep; j++)
        inv[keep[j]] = (uint32_t)j;
    for (uint64_t t = 0; t < k; t++)
        out[t] = inv[want[t]];
}
