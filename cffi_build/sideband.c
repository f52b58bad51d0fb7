/* sideband.c: find the side-band records a replay may skip, natively (filereplay.py); list
 * and mark the live step's side-band records in bulk (ringstep.py: unw_sb_rows, unw_sb_marks,
 * unw_sb_trailer_marks, unw_sb_slots, each the C form of a Python loop it replaced,
 * tests/unit/test_sideband_live.py holds them to it; they read and write only the index entries and arrays they are given,
 * O(entries)).
 *
 * Why: deep CPython recursion mmaps/munmaps frame chunks, so a profile can carry hundreds of
 * thousands of MMAP2 records of anonymous read/write memory, each costly to decode and apply
 * in Python; none of them changes the process table (proctable.py: a non-executable mapping
 * is never inserted and cuts only what it overlaps).
 *
 * Invariants (the proof that a skipped record is a no-op for ProcessTable.apply in replay):
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
 * Cost: O(R log R) for R side-band records; memory O(exec ranges + candidate pids).
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
