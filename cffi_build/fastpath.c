/* fastpath.c: the native replay path (contract and invariants: fastpath.h).
 *
 * Layouts followed (include/uapi/linux/perf_event.h, Linux 6.x), as records.py decodes them:
 *
 *   struct perf_event_header { u32 type; u16 misc; u16 size; };      size includes the header
 *   PERF_RECORD_SAMPLE body:
 *     { u64 IDENTIFIER, IP, TID(pid|tid<<32), TIME, ADDR, ID, STREAM_ID, CPU(cpu|res<<32),
 *       PERIOD }                                    each slot only if its sample_type bit is set
 *     { READ }  { u64 nr; u64 ips[nr]; } CALLCHAIN  { u32 size; char raw[size]; } RAW
 *     { u64 nr; {u64 hw_idx;} {from,to,flags}[nr]; {u64 cntr[nr];} } BRANCH_STACK
 *     { u64 abi; u64 regs[popcount(mask)] (if abi); } REGS_USER
 *     { u64 size; char data[size]; u64 dyn_size (if size); } STACK_USER
 *   perf.data user records with a payload after header.size (perf session.c): AUXTRACE (71)
 *   { u64 size; ... } then size bytes; HEADER_TRACING_DATA (66) { u32 size; } then size padded
 *   to 8.
 *
 * Offsets are computed in unsigned __int128, so no count in the input can wrap them (records.py
 * uses Python integers; the comparisons here are the same ones).
 */
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "unwcore_int.h"
#include "fastpath.h"

#define S_IP (1ull << 0)
#define S_TID (1ull << 1)
#define S_TIME (1ull << 2)
#define S_READ (1ull << 4)
#define S_CALLCHAIN (1ull << 5)
#define S_CPU (1ull << 7)
#define S_PERIOD (1ull << 8)
#define S_RAW (1ull << 10)
#define S_BRANCH_STACK (1ull << 11)
#define S_REGS_USER (1ull << 12)
#define S_STACK_USER (1ull << 13)

#define T_SAMPLE 9
#define T_HEADER_TRACING_DATA 66
#define T_FINISHED_ROUND 68
#define T_AUXTRACE 71

typedef unsigned __int128 u128;

static inline uint64_t ld64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t ld32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Where a sample's variable parts are (offsets from the body start). */
struct sample_view {
    uint64_t cc_off, cc_nr;     /* callchain */
    uint64_t regs_abi, regs_off;
    uint64_t stack_off, dyn;
};

/* records.RecordDecoder._sample's checks, in its order; 0 or FP_ERR_*. */
static int parse_sample(const struct fp_layout *L, const uint8_t *b, uint64_t n,
                        struct sample_view *v)
{
    uint64_t st = L->sample_type;
    u128 off = (u128)L->nprefix * 8;
    memset(v, 0, sizeof *v);
    if (off > n)
        return FP_ERR_SHORT_BODY;
    if (st & S_READ) {
        if (L->read_group) {
            if (off + 8 > n)
                return FP_ERR_SHORT_BODY;
            uint64_t nr = ld64(b + (uint64_t)off);
            off += 8 + 8 * ((u128)L->read_times + (u128)nr * L->read_per_value);
        } else {
            off += 8 * ((u128)L->read_times + L->read_per_value);
        }
        if (off > n)
            return FP_ERR_SHORT_BODY;
    }
    if (st & S_CALLCHAIN) {
        if (off + 8 > n)
            return FP_ERR_SHORT_BODY;
        uint64_t nr = ld64(b + (uint64_t)off);
        off += 8;
        if (off + 8 * (u128)nr > n)
            return FP_ERR_BAD_CALLCHAIN_NR;
        v->cc_off = (uint64_t)off;
        v->cc_nr = nr;
        off += 8 * (u128)nr;
    }
    if (st & S_RAW) {
        if (off + 4 > n)
            return FP_ERR_SHORT_BODY;
        off += 4 + (u128)ld32(b + (uint64_t)off);
        if (off > n)
            return FP_ERR_BAD_RAW_SIZE;
    }
    if (st & S_BRANCH_STACK) {
        if (off + 8 > n)
            return FP_ERR_SHORT_BODY;
        uint64_t nr = ld64(b + (uint64_t)off);
        off += 8 + 8 * (u128)L->branch_hw_index + (24 + 8 * (u128)L->branch_counters) * nr;
        if (off > n)
            return FP_ERR_BAD_BRANCH_NR;
    }
    if (st & S_REGS_USER) {
        if (off + 8 > n)
            return FP_ERR_SHORT_BODY;
        v->regs_abi = ld64(b + (uint64_t)off);
        off += 8;
        if (v->regs_abi) {
            if (off + 8 * (u128)L->nregs > n)
                return FP_ERR_SHORT_REGS;
            v->regs_off = (uint64_t)off;
            off += 8 * (u128)L->nregs;
        }
    }
    if (st & S_STACK_USER) {
        if (off + 8 > n)
            return FP_ERR_SHORT_BODY;
        uint64_t size = ld64(b + (uint64_t)off);
        off += 8;
        if (size) {
            if (off + size + 8 > n)
                return FP_ERR_BAD_STACK_SIZE;
            uint64_t dyn = ld64(b + (uint64_t)(off + size));
            if (dyn > size)
                return FP_ERR_BAD_DYN_SIZE;
            v->stack_off = (uint64_t)off;
            v->dyn = dyn;
        }
    }
    return 0;
}

/* fp_index; payloads: skip AUXTRACE/TRACING_DATA payloads (perf.data framing). Ring chunks
 * have none (records.RecordDecoder.decode frames them by header.size only). */
static int index_records(const struct fp_layout *lay, const uint8_t *data, uint64_t len,
                         int payloads, struct fp_rec **recs, uint64_t *nrec, uint64_t *other,
                         int *end, uint64_t *stopped_at)
{
    uint64_t cap = 1024, n = 0, pos = 0;
    struct fp_rec *r = malloc(cap * sizeof *r);
    *recs = NULL;
    *nrec = *other = 0;
    *end = FP_END_OK;
    *stopped_at = UINT64_MAX;
    if (!r)
        return -1;
    while (pos < len) {
        if (len - pos < 8) {
            *end = FP_END_TRUNCATED;
            break;
        }
        uint32_t type = ld32(data + pos);
        uint16_t misc, size;
        memcpy(&misc, data + pos + 4, 2);
        memcpy(&size, data + pos + 6, 2);
        if (size < 8) {
            *end = FP_END_BAD_SIZE;
            break;
        }
        if (size > len - pos) {
            *end = FP_END_TRUNCATED;
            break;
        }
        if (type > 255) {
            *stopped_at = pos;
            break;
        }
        if (n == cap) {
            struct fp_rec *q = realloc(r, 2 * cap * sizeof *r);
            if (!q) {
                free(r);
                return -1;
            }
            r = q;
            cap *= 2;
        }
        struct fp_rec *e = &r[n++];
        memset(e, 0, sizeof *e);
        e->off = pos;
        e->size = size;
        e->misc = misc;
        e->type = (uint8_t)type;
        const uint8_t *body = data + pos + 8;
        uint64_t blen = size - 8u;
        if (type == T_SAMPLE) {
            struct sample_view v;
            int err = parse_sample(lay, body, blen, &v);
            e->err = (uint8_t)err;
            if (!err) {
                e->flags = FP_SAMPLE;
                /* body offsets and counts < 64 KiB (size is a u16) */
                e->regs_abi = (uint8_t)(v.regs_abi > 2 ? 3 : v.regs_abi);
                e->cc_off = (uint16_t)v.cc_off;
                e->cc_nr = (uint16_t)v.cc_nr;
                e->regs_off = (uint16_t)v.regs_off;
                e->stack_off = (uint16_t)v.stack_off;
                e->dyn = (uint16_t)v.dyn;
                if (lay->i_time >= 0) {
                    e->time = ld64(body + 8 * (uint64_t)lay->i_time);
                    e->flags |= FP_TIMED;
                }
                if (lay->i_tid >= 0) {
                    uint64_t t = ld64(body + 8 * (uint64_t)lay->i_tid);
                    e->pid = (uint32_t)t;
                    e->tid = (uint32_t)(t >> 32);
                }
                if (lay->i_cpu >= 0) {
                    e->cpu = (uint32_t)ld64(body + 8 * (uint64_t)lay->i_cpu);
                    e->flags |= FP_HAS_CPU;
                }
                if (lay->i_period >= 0)
                    e->period = ld64(body + 8 * (uint64_t)lay->i_period);
            }
        } else if (type == T_FINISHED_ROUND) {
            e->flags = FP_MARKER;
        }
        if (!(e->flags & FP_SAMPLE))
            (*other)++;
        pos += size;
        /* payloads outside header.size (perfdata._payload_after) */
        u128 extra = 0;
        if (!payloads)
            ;
        else if (type == T_AUXTRACE && blen >= 8)
            extra = ld64(body);
        else if (type == T_HEADER_TRACING_DATA && blen >= 4)
            extra = ((u128)ld32(body) + 7) & ~(u128)7;
        if (extra) {
            if (extra > len - pos) {
                *end = FP_END_PAYLOAD_TRUNCATED;
                break;
            }
            pos += (uint64_t)extra;
        }
    }
    *recs = r;
    *nrec = n;
    return 0;
}

int fp_index(const struct fp_layout *lay, const uint8_t *data, uint64_t len,
             struct fp_rec **recs, uint64_t *nrec, uint64_t *other, int *end,
             uint64_t *stopped_at)
{
    return index_records(lay, data, len, 1, recs, nrec, other, end, stopped_at);
}

/* ------------------------------------------------------------------ ordering */

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

int fp_order(const struct fp_rec *recs, uint64_t n, uint64_t max_queued, uint32_t *perm,
             uint64_t *nout, uint64_t *late_ns, uint64_t *nlate, struct fp_order_stats *st)
{
    memset(st, 0, sizeof *st);
    *nout = *nlate = 0;
    if (!max_queued || n > UINT32_MAX)
        return -1;
    struct hent *h = malloc((n ? n : 1) * sizeof *h);
    if (!h)
        return -1;
    struct cpumap cm = {0, 0, 0, 0};
    uint64_t hn = 0, seq = 0, next_flush = 0, last_flush = 0, max_time = 0, last_time = 0;
    int have_last = 0, rc = 0;
    uint64_t out = 0;
    for (uint64_t i = 0; i < n; i++) {
        const struct fp_rec *r = &recs[i];
        if (r->flags & FP_MARKER) { /* end_round */
            st->rounds++;
            uint64_t lim = next_flush > last_flush ? next_flush : last_flush;
            while (hn && h[0].t <= lim) {
                struct hent e = hpop(h, &hn);
                perm[out++] = e.idx;
                if (e.t > last_flush)
                    last_flush = e.t;
            }
            next_flush = max_time;
            continue;
        }
        uint64_t t;
        if (!(r->flags & FP_TIMED)) {
            st->untimed++;
            if ((r->flags & FP_HAS_CPU) && cpumap_get(&cm, r->cpu, &t))
                ;
            else if (have_last)
                t = last_time;
            else
                t = last_flush;
        } else {
            t = r->time;
            if (t < last_flush) {
                uint64_t late = last_flush - t;
                st->late++;
                late_ns[(*nlate)++] = late;
                if (late > st->max_lateness_ns)
                    st->max_lateness_ns = late;
            }
            if (t > max_time)
                max_time = t;
            last_time = t;
            have_last = 1;
            if ((r->flags & FP_HAS_CPU) && cpumap_put(&cm, r->cpu, t)) {
                rc = -1;
                break;
            }
        }
        hpush(h, &hn, (struct hent){t, seq++, (uint32_t)i});
        st->pushed++;
        if (hn > max_queued) { /* _force_half: the oldest half goes out now */
            uint64_t k = hn / 2 ? hn / 2 : 1;
            for (uint64_t j = 0; j < k; j++) {
                struct hent e = hpop(h, &hn);
                perm[out++] = e.idx;
                if (e.t > last_flush)
                    last_flush = e.t;
            }
            st->forced_flushes++;
        }
    }
    while (!rc && hn) { /* flush_all */
        struct hent e = hpop(h, &hn);
        perm[out++] = e.idx;
        if (e.t > last_flush)
            last_flush = e.t;
    }
    free(h);
    free(cm.keys);
    free(cm.vals);
    st->delivered = out;
    st->queued = st->pushed - out;
    *nout = out;
    return rc;
}

/* ------------------------------------------------------------------ unwind + aggregate */

/* pid -> address space. Keys are never removed (a pid that comes back reuses its slot), so
 * "forget" only clears valid and probing needs no tombstones. */
struct space_ent {
    uint32_t pid, space_id;
    const struct unw_module *mods;
    const uint64_t *ranges;     /* live: sorted [start, end) pairs of the table's mappings */
    uint64_t last_used;         /* live: record time at its last placed sample */
    uint32_t nmods, nranges;
    uint32_t touch;             /* live: fp_live_run call that last touched it */
    uint8_t used, valid;
};

/* (pid, tid) -> comm id; cleared whole by fp_forget_comms. */
struct comm_ent {
    uint32_t pid, tid, comm_id;
    uint32_t used;
};

struct stack_ent {
    uint64_t woff;      /* its key: words[woff, woff + nwords) */
    uint64_t hash, count;
    uint64_t foff;      /* frame ids of its pcs: fids[foff, foff + npcs); by code: unused */
    uint32_t nwords;
    uint32_t space0;    /* by code: the space of its first sample (fp_stack.space_id) */
};

/* A distinct user frame: what symbolization depends on. Stacks of one profile share most
 * frames, so Python names each frame once, not once per stack. Its identity is (tag, addr,
 * exact): tag = space id and addr = pc, or, by code (fp_ctx_by_code) for a named address
 * inside a module, tag = FRAME_CODE | module key and addr = its ELF vaddr (named address -
 * bias), so the same code in every process that maps the binary is one frame. (space_id,
 * pc) is where it was first seen: Python names it from that space's snapshot. */
#define FRAME_CODE (1ull << 63)
struct frame_ent {
    uint64_t tag, addr;
    uint64_t pc;
    uint32_t space_id;
    uint8_t exact;      /* pc is exact (leaf, or after a signal trampoline), else pc - 1 is named */
    uint8_t pad[3];
};

/* by code: the (space, stack, hash of the raw pcs) triples seen, in first-seen order
 * (fp_pairs), and their set. The slow path counts unsymbolized frames once per new (snapshot,
 * pcs) key: Python counts a code stack's unnamed frames once per new (space, pcs hash). (The
 * frame ids alone do not stand for the pcs: a process mapping one binary twice, dlopen plus
 * dlmopen, runs the same code frames at two addresses.) */
struct pair_ent {
    uint32_t space_id, stack_id;
    uint64_t pcs_hash;
};

/* by function (fp_ctx_by_code(c, 2)): a module key's symbol table, the caller's arrays
 * (symbolize.SymbolTable.starts/ends, kept alive by the caller for the context's life). */
struct sym_ent {
    uint64_t key;
    const uint64_t *starts, *ends;
    uint64_t n;
    uint32_t used;
};

/* The parallel unwind's knobs (see "parallel unwind" below; tests build with small ones).
 * PAR_MIN: on the issue-3 bench file cut into calls of n samples, the worker made
 * fp_unwind_run slower at n = 32 and 64 (0.22, 0.20 s vs 0.18 s on one thread) and faster
 * from 128 on (0.15 s at 128, 0.14 s at 256), at ~1.3x the CPU time: 256 keeps a margin. */
#ifndef PAR_SEG
#define PAR_SEG 8192        /* samples scanned for readiness at a time (fp_unwind_run) */
#endif
#ifndef PAR_BLOCK
#define PAR_BLOCK 32        /* samples per claim (~40 us of unwinding) */
#endif
#ifndef PAR_NBLOCKS
#define PAR_NBLOCKS 32      /* blocks in the ring (par_wake: a full ring sleeps till half free) */
#endif
#ifndef PAR_MIN
#define PAR_MIN 256         /* default fp_ctx_par: shorter ready prefixes run on one thread */
#endif
#define PAR_RING_BYTES (2u << 20)
#ifndef PAR_JUDGE_NS
#define PAR_JUDGE_NS 2000000 /* wall time of the jobs behind each verdict (par_judge) */
#endif
#ifndef PAR_BACKOFF
#define PAR_BACKOFF 16384   /* samples on one thread after a busy verdict (doubling, x64 max) */
#endif

struct fp_par;
static void par_free(struct fp_par *P);

struct fp_ctx {
    const struct unw_arch_desc *arch;
    uint32_t max_depth;
    uint64_t *pcs;
    uint8_t *kinds;
    uint64_t *key;          /* scratch for one key */
    uint64_t keycap;
    struct space_ent *spaces;
    uint64_t scap, sn;
    struct comm_ent *comms;
    uint64_t ccap, cn;
    struct stack_ent *stacks;
    uint64_t nstk, capstk;
    uint32_t *stab;         /* open addressing: stack id + 1, 0 empty */
    uint64_t stabcap;
    uint64_t *words;
    uint64_t nwords, capwords;
    struct frame_ent *frames;
    uint64_t nfr, capfr;
    uint32_t *ftab;         /* open addressing: frame id + 1 */
    uint64_t ftabcap;
    uint32_t *fids;
    uint64_t nfids, capfids;
    uint32_t touch_gen;     /* fp_live_run calls so far (space_ent.touch) */
    int by_code;            /* fp_ctx_by_code */
    struct fid_memo *memo;  /* by code: FID_MEMO slots, see frame_id */
    struct pair_ent *pairs; /* by code: pairs in first-seen order */
    uint64_t npairs, cappairs;
    uint32_t *ptab;         /* open addressing: pair index + 1 */
    uint64_t ptabcap;
    struct sym_ent *syms;   /* by function: open addressing by module key */
    uint64_t symcap, nsym;
    uint32_t need_mod;      /* by function: the module whose table a run stopped for */
    struct fp_par *par;     /* the parallel unwind's worker and ring (par_ready), or NULL */
    uint32_t par_min;       /* fp_ctx_par */
    int par_failed;         /* the worker could not be started: one thread */
};

/* intern_frame / frame_id / unwind_rec: "stop, a module needs its symbol table" (never an
 * id: frame and stack ids stay below UINT32_MAX - 1) */
#define NEED_SYMS_ID (UINT32_MAX - 1)

struct fp_ctx *fp_ctx_new(int arch, uint32_t max_depth)
{
    const struct unw_arch_desc *a = unw_arch(arch);
    if (!a || !max_depth || max_depth > (1u << 16))
        return NULL;
    struct fp_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->arch = a;
    c->max_depth = max_depth;
    c->par_min = PAR_MIN;
    c->pcs = malloc(max_depth * sizeof *c->pcs);
    c->kinds = malloc(max_depth);
    if (!c->pcs || !c->kinds) {
        fp_ctx_free(c);
        return NULL;
    }
    return c;
}

void fp_ctx_free(struct fp_ctx *c)
{
    if (!c)
        return;
    par_free(c->par);
    free(c->pcs);
    free(c->kinds);
    free(c->key);
    free(c->spaces);
    free(c->comms);
    free(c->stacks);
    free(c->stab);
    free(c->words);
    free(c->frames);
    free(c->ftab);
    free(c->fids);
    free(c->pairs);
    free(c->ptab);
    free(c->memo);
    free(c->syms);
    free(c);
}

static inline uint64_t mix(uint64_t h, uint64_t v)
{
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    return h * 0xBF58476D1CE4E5B9ull;
}

#define SLOT(h, cap) ((h) & ((cap) - 1))

static struct space_ent *space_slot(const struct fp_ctx *c, uint32_t pid)
{
    uint64_t j = SLOT(mix(0, pid), c->scap);
    while (c->spaces[j].used && c->spaces[j].pid != pid)
        j = SLOT(j + 1, c->scap);
    return &c->spaces[j];
}

int fp_set_space(struct fp_ctx *c, uint32_t pid, const struct unw_module *mods, uint32_t nmods,
                 uint32_t space_id)
{
    if (2 * (c->sn + 1) > c->scap) {
        struct space_ent *old = c->spaces;
        uint64_t ocap = c->scap, ncap = ocap ? 2 * ocap : 256;
        struct space_ent *ns = calloc(ncap, sizeof *ns);
        if (!ns)
            return -1;
        c->spaces = ns;
        c->scap = ncap;
        for (uint64_t i = 0; i < ocap; i++)
            if (old[i].used)
                *space_slot(c, old[i].pid) = old[i];
        free(old);
    }
    struct space_ent *e = space_slot(c, pid);
    if (!e->used)
        c->sn++;
    *e = (struct space_ent){pid, space_id, mods, NULL, 0, nmods, 0, 0, 1, 1};
    return 0;
}

void fp_forget_space(struct fp_ctx *c, uint32_t pid)
{
    if (c->scap) {
        struct space_ent *e = space_slot(c, pid);
        if (e->used)
            e->valid = 0;
    }
}

static struct comm_ent *comm_slot(const struct fp_ctx *c, uint32_t pid, uint32_t tid)
{
    uint64_t j = SLOT(mix(mix(0, pid), tid), c->ccap);
    while (c->comms[j].used && (c->comms[j].pid != pid || c->comms[j].tid != tid))
        j = SLOT(j + 1, c->ccap);
    return &c->comms[j];
}

int fp_set_comm(struct fp_ctx *c, uint32_t pid, uint32_t tid, uint32_t comm_id)
{
    if (2 * (c->cn + 1) > c->ccap) {
        struct comm_ent *old = c->comms;
        uint64_t ocap = c->ccap, ncap = ocap ? 2 * ocap : 256;
        struct comm_ent *ns = calloc(ncap, sizeof *ns);
        if (!ns)
            return -1;
        c->comms = ns;
        c->ccap = ncap;
        for (uint64_t i = 0; i < ocap; i++)
            if (old[i].used)
                *comm_slot(c, old[i].pid, old[i].tid) = old[i];
        free(old);
    }
    struct comm_ent *e = comm_slot(c, pid, tid);
    if (!e->used)
        c->cn++;
    *e = (struct comm_ent){pid, tid, comm_id, 1};
    return 0;
}

void fp_forget_comms(struct fp_ctx *c)
{
    if (c->ccap)
        memset(c->comms, 0, c->ccap * sizeof *c->comms);
    c->cn = 0;
}

static int grow_words(struct fp_ctx *c, uint64_t need)
{
    if (c->nwords + need <= c->capwords)
        return 0;
    uint64_t ncap = c->capwords ? c->capwords : 4096;
    while (ncap < c->nwords + need)
        ncap *= 2;
    uint64_t *q = realloc(c->words, ncap * 8);
    if (!q)
        return -1;
    c->words = q;
    c->capwords = ncap;
    return 0;
}

static inline uint64_t frame_hash(uint64_t tag, uint64_t addr, uint8_t exact)
{
    return mix(mix(tag, addr), exact);
}

static inline uint64_t pair_hash(uint32_t space_id, uint32_t stack_id, uint64_t pcs_hash)
{
    return mix(mix(space_id, stack_id), pcs_hash);
}

static uint64_t frame_hash_of(const struct fp_ctx *c, uint64_t i)
{
    const struct frame_ent *f = &c->frames[i];
    return frame_hash(f->tag, f->addr, f->exact);
}

static uint64_t stack_hash_of(const struct fp_ctx *c, uint64_t i) { return c->stacks[i].hash; }

static uint64_t pair_hash_of(const struct fp_ctx *c, uint64_t i)
{
    const struct pair_ent *q = &c->pairs[i];
    return pair_hash(q->space_id, q->stack_id, q->pcs_hash);
}

/* The frame, stack and pair sets: open addressing over ids [0, n) (slot = id + 1, 0 empty).
 * Before adding id n, keep *tab at most half full: double it (first 4096 slots) and place
 * every id again by hash(c, id). -1 on allocation failure. O(n) per doubling, amortized O(1). */
static int index_reserve(const struct fp_ctx *c, uint32_t **tab, uint64_t *cap, uint64_t n,
                         uint64_t (*hash)(const struct fp_ctx *, uint64_t))
{
    if (2 * (n + 1) <= *cap)
        return 0;
    uint64_t ncap = *cap ? 2 * *cap : 4096;
    uint32_t *nt = calloc(ncap, sizeof *nt);
    if (!nt)
        return -1;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t j = SLOT(hash(c, i), ncap);
        while (nt[j])
            j = SLOT(j + 1, ncap);
        nt[j] = (uint32_t)i + 1;
    }
    free(*tab);
    *tab = nt;
    *cap = ncap;
    return 0;
}

/* key's slot in the symbol-table set: its entry, or the empty slot it would take (symcap
 * > 0), as space_slot and comm_slot do for theirs. */
static struct sym_ent *sym_slot(const struct fp_ctx *c, uint64_t key)
{
    uint64_t j = SLOT(mix(0, key), c->symcap);
    while (c->syms[j].used && c->syms[j].key != key)
        j = SLOT(j + 1, c->symcap);
    return &c->syms[j];
}

static const struct sym_ent *sym_find(const struct fp_ctx *c, uint64_t key)
{
    if (!c->symcap)
        return NULL;
    const struct sym_ent *e = sym_slot(c, key);
    return e->used ? e : NULL;
}

/* fastpath.h. By function a frame is (module key, region, exact). O(log n). */
uint64_t fp_sym_region(const uint64_t *starts, const uint64_t *ends, uint64_t n, uint64_t addr)
{
    uint64_t lo = 0, hi = n; /* first index with starts[i] > addr */
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (starts[mid] <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (!lo)
        return 0;
    uint64_t i = lo - 1;
    return (addr < ends[i] || addr == starts[i]) ? i + 1 : 0;
}

static inline uint64_t sym_region(const struct sym_ent *se, uint64_t addr)
{
    return fp_sym_region(se->starts, se->ends, se->n, addr);
}

int fp_set_symbols(struct fp_ctx *c, uint64_t key, const uint64_t *starts, const uint64_t *ends,
                   uint64_t n)
{
    if (c->by_code != 2 || (n && (!starts || !ends)))
        return -1;
    if (2 * (c->nsym + 1) > c->symcap) {
        struct sym_ent *old = c->syms;
        uint64_t ocap = c->symcap, ncap = ocap ? 2 * ocap : 64;
        struct sym_ent *ns = calloc(ncap, sizeof *ns);
        if (!ns)
            return -1;
        c->syms = ns;
        c->symcap = ncap;
        for (uint64_t i = 0; i < ocap; i++)
            if (old[i].used)
                *sym_slot(c, old[i].key) = old[i];
        free(old);
    }
    struct sym_ent *e = sym_slot(c, key);
    if (e->used)
        return -1; /* a frame may already carry the old table's regions */
    *e = (struct sym_ent){key, starts, ends, n, 1};
    c->nsym++;
    return 0;
}

/* The id of the frame at pc (seen in space sp), added if new; UINT32_MAX on allocation
 * failure, NEED_SYMS_ID (by function) when pc's module has no symbol table yet. Identity:
 * see struct frame_ent. */
static uint32_t intern_frame(struct fp_ctx *c, const struct space_ent *sp, uint64_t pc,
                             uint8_t exact)
{
    uint64_t tag = sp->space_id, addr = pc;
    if (c->by_code) {
        uint64_t named = exact ? pc : pc - 1;
        const struct unw_module *m = unw_module_find(sp->mods, sp->nmods, named);
        if (m) {
            tag = FRAME_CODE | m->key;
            addr = named - m->bias;
            if (c->by_code == 2) {
                const struct sym_ent *se = sym_find(c, m->key);
                if (!se) {
                    c->need_mod = (uint32_t)(m - sp->mods);
                    return NEED_SYMS_ID;
                }
                addr = sym_region(se, addr);
            }
        }
    }
    if (index_reserve(c, &c->ftab, &c->ftabcap, c->nfr, frame_hash_of))
        return UINT32_MAX;
    uint64_t j = SLOT(frame_hash(tag, addr, exact), c->ftabcap);
    while (c->ftab[j]) {
        const struct frame_ent *f = &c->frames[c->ftab[j] - 1];
        if (f->addr == addr && f->tag == tag && f->exact == exact)
            return c->ftab[j] - 1;
        j = SLOT(j + 1, c->ftabcap);
    }
    if (c->nfr >= UINT32_MAX - 1)
        return UINT32_MAX;
    if (c->nfr == c->capfr) {
        uint64_t ncap = c->capfr ? 2 * c->capfr : 1024;
        struct frame_ent *q = realloc(c->frames, ncap * sizeof *q);
        if (!q)
            return UINT32_MAX;
        c->frames = q;
        c->capfr = ncap;
    }
    c->frames[c->nfr] = (struct frame_ent){tag, addr, pc, sp->space_id, exact, {0, 0, 0}};
    c->ftab[j] = (uint32_t)c->nfr + 1;
    return (uint32_t)c->nfr++;
}

/* by code: (space, pc, exact) -> frame id, direct-mapped. Every sample turns each of its pcs
 * into a frame id (a module search and a set probe, ~30 ns); the same return addresses recur,
 * so a memo hit makes that one compare. Exact: frame ids never change, and a space id names
 * one snapshot (fp_set_space), so its modules, and the pc's frame, are fixed. 96 KiB. */
#define FID_MEMO 4096
struct fid_memo {
    uint64_t pc, sx;    /* sx: space_id << 1 | exact */
    uint32_t fid1;      /* frame id + 1, 0 empty */
};

static uint32_t frame_id(struct fp_ctx *c, const struct space_ent *sp, uint64_t pc,
                         uint8_t exact)
{
    uint64_t sx = (uint64_t)sp->space_id << 1 | exact;
    struct fid_memo *m = &c->memo[SLOT(mix(sx, pc), FID_MEMO)];
    if (m->fid1 && m->pc == pc && m->sx == sx)
        return m->fid1 - 1;
    uint32_t fid = intern_frame(c, sp, pc, exact);
    if (fid < NEED_SYMS_ID)
        *m = (struct fid_memo){pc, sx, fid + 1};
    return fid;
}

/* Frame ids of a new stack's pcs: the leaf and a frame after a signal trampoline are exact. */
static int stack_fids(struct fp_ctx *c, const struct space_ent *sp, const uint64_t *pcs,
                      const uint8_t *kinds, uint32_t npcs, uint64_t *foff)
{
    if (c->nfids + npcs > c->capfids) {
        uint64_t ncap = c->capfids ? c->capfids : 4096;
        while (ncap < c->nfids + npcs)
            ncap *= 2;
        uint32_t *q = realloc(c->fids, ncap * sizeof *q);
        if (!q)
            return -1;
        c->fids = q;
        c->capfids = ncap;
    }
    *foff = c->nfids;
    for (uint32_t i = 0; i < npcs; i++) {
        uint8_t exact = i == 0 || (kinds[i - 1] & UNW_FRAME_SIGNAL);
        uint32_t id = intern_frame(c, sp, pcs[i], exact);
        if (id == UINT32_MAX)
            return -1;
        c->fids[c->nfids++] = id;
    }
    return 0;
}

/* The id of key[0, nw): found, or added with count 0. UINT32_MAX on allocation failure. */
static uint32_t intern_stack(struct fp_ctx *c, const struct space_ent *sp, const uint64_t *key,
                             uint32_t nw)
{
    uint64_t h = 0;
    for (uint32_t i = 0; i < nw; i++)
        h = mix(h, key[i]);
    if (index_reserve(c, &c->stab, &c->stabcap, c->nstk, stack_hash_of))
        return UINT32_MAX;
    uint64_t j = SLOT(h, c->stabcap);
    while (c->stab[j]) {
        const struct stack_ent *s = &c->stacks[c->stab[j] - 1];
        if (s->hash == h && s->nwords == nw && !memcmp(c->words + s->woff, key, 8 * (size_t)nw))
            return c->stab[j] - 1;
        j = SLOT(j + 1, c->stabcap);
    }
    if (c->nstk >= UINT32_MAX - 1 || grow_words(c, nw))
        return UINT32_MAX;
    if (c->nstk == c->capstk) {
        uint64_t ncap = c->capstk ? 2 * c->capstk : 1024;
        struct stack_ent *q = realloc(c->stacks, ncap * sizeof *q);
        if (!q)
            return UINT32_MAX;
        c->stacks = q;
        c->capstk = ncap;
    }
    uint64_t foff = UINT64_MAX;
    uint32_t npcs = (uint32_t)(key[1] >> 32);
    const uint64_t *pcs = key + 2;
    if (!c->by_code &&
        stack_fids(c, sp, pcs, (const uint8_t *)(pcs + npcs), npcs, &foff))
        return UINT32_MAX;
    memcpy(c->words + c->nwords, key, 8 * (size_t)nw);
    c->stacks[c->nstk] = (struct stack_ent){c->nwords, h, 0, foff, nw, sp->space_id};
    c->nwords += nw;
    c->stab[j] = (uint32_t)c->nstk + 1;
    return (uint32_t)c->nstk++;
}

/* Key layout (u64 words):
 *   [0] space_id | comm_id << 32                    (by code: comm_id << 32 only)
 *   [1] status | regs_none << 8 | npcs << 32        (npcs <= 65536; nkc follows from the size)
 *   [2 ..] npcs pcs (by code: ceil(npcs / 2) words of u32 frame ids), then ceil(npcs / 8)
 *          words of kinds bytes, then nkc callchain words */
static inline uint32_t pc_words(const struct fp_ctx *c, uint32_t npcs)
{
    return c->by_code ? (npcs + 1) / 2 : npcs;
}

static inline uint32_t key_words(const struct fp_ctx *c, uint32_t npcs, uint64_t nkc)
{
    return 2 + pc_words(c, npcs) + (npcs + 7) / 8 + (uint32_t)nkc;
}

/* by code: note (space, stack) in the pair set; -1 on allocation failure. O(1) expected. */
static int note_pair(struct fp_ctx *c, uint32_t space_id, uint32_t stack_id, uint64_t pcs_hash)
{
    if (c->npairs >= UINT32_MAX - 1 ||
        index_reserve(c, &c->ptab, &c->ptabcap, c->npairs, pair_hash_of))
        return -1;
    uint64_t j = SLOT(pair_hash(space_id, stack_id, pcs_hash), c->ptabcap);
    while (c->ptab[j]) {
        const struct pair_ent *q = &c->pairs[c->ptab[j] - 1];
        if (q->space_id == space_id && q->stack_id == stack_id && q->pcs_hash == pcs_hash)
            return 0;
        j = SLOT(j + 1, c->ptabcap);
    }
    if (c->npairs == c->cappairs) {
        uint64_t ncap = c->cappairs ? 2 * c->cappairs : 1024;
        struct pair_ent *q = realloc(c->pairs, ncap * sizeof *q);
        if (!q)
            return -1;
        c->pairs = q;
        c->cappairs = ncap;
    }
    c->pairs[c->npairs] = (struct pair_ent){space_id, stack_id, pcs_hash};
    c->ptab[j] = (uint32_t)++c->npairs;
    return 0;
}

/* The stored view of an indexed SAMPLE stays inside its record: true for every record
 * fp_index / fp_live_index made; checked anyway (O(1), the rec only), so a caller's bad
 * struct fp_rec can never make the unwind read outside the record (the run's bounds check of
 * off and size keeps the record inside the buffer). */
static inline int rec_view_ok(const struct fp_layout *lay, const struct fp_rec *r)
{
    uint64_t blen = r->size - 8u; /* size >= 8: the caller checked FP_SAMPLE records */
    uint32_t nregs = lay->nregs > 64 ? 64 : lay->nregs;
    return r->size >= 8 && (uint64_t)r->cc_off + 8 * (uint64_t)r->cc_nr <= blen &&
           (r->regs_abi != 2 || !lay->regs_mask ||
            (uint64_t)r->regs_off + 8 * (uint64_t)nregs <= blen) &&
           (uint64_t)r->stack_off + r->dyn <= blen;
}

/* The unwinder's half of a sample: unwind the indexed SAMPLE r against the modules of sp into
 * pcs/kinds (max_depth each); its UNW_* status and *npcs, or UNW_BAD_VIEW if its stored view is
 * not inside the record. Reads only r, the record's bytes, the modules and their tables, and
 * writes only pcs, kinds and the calling thread's lookup cache (unwind.c, __thread): so any
 * thread may run it while the context is not being changed (the parallel run, par_*). */
#define UNW_BAD_VIEW 0xFF
static uint8_t unwind_sample(const struct unw_arch_desc *arch, uint32_t max_depth,
                             const struct fp_layout *lay, const uint8_t *data,
                             const struct fp_rec *r, const struct space_ent *sp, uint64_t *pcs,
                             uint8_t *kinds, uint32_t *npcs)
{
    uint64_t regs[64];
    uint32_t nregs_lay = lay->nregs > 64 ? 64 : lay->nregs;
    const uint8_t *body = data + r->off + 8;
    *npcs = 0;
    /* The view fp_index stored (struct fp_rec): the sample is not parsed again, so only the
     * registers, the stack bytes the walk reads and the callchain are touched. */
    if (!rec_view_ok(lay, r))
        return UNW_BAD_VIEW;
    /* unwinder.Unwinder.unwind_batch: registers of 64-bit tasks only */
    uint32_t nregs = (r->regs_abi == 2 && lay->regs_mask) ? nregs_lay : 0;
    if (nregs)
        memcpy(regs, body + r->regs_off, 8 * (size_t)nregs);
    struct unw_item it = {sp->mods, sp->nmods, nregs, lay->regs_mask, regs,
                          r->dyn ? body + r->stack_off : NULL, r->dyn};
    uint16_t fpf, sigf;
    return unw_unwind_one(arch, &it, max_depth, pcs, kinds, npcs, &fpf, &sigf);
}

/* The aggregating half (calling thread only): the stack id of sample r (space sp, comm ce)
 * whose unwind gave status and pcs/kinds[0, npcs), counted; UINT32_MAX on failure,
 * NEED_SYMS_ID (by function, nothing counted) when a module needs its symbol table. */
static uint32_t intern_sample(struct fp_ctx *c, const uint8_t *data, const struct fp_rec *r,
                              const struct space_ent *sp, const struct comm_ent *ce,
                              uint8_t status, const uint64_t *pcs, const uint8_t *kinds,
                              uint32_t npcs)
{
    if (status == UNW_BAD_VIEW)
        return UINT32_MAX;
    const uint8_t *body = data + r->off + 8;
    uint64_t nkc = r->cc_nr;
    if (nkc > UINT32_MAX - 2 * (uint64_t)c->max_depth - 4)
        return UINT32_MAX; /* cannot happen: records are < 64 KiB */
    uint32_t nw = key_words(c, npcs, nkc);
    if (nw > c->keycap) {
        uint64_t *q = realloc(c->key, 8 * (size_t)nw);
        if (!q)
            return UINT32_MAX;
        c->key = q;
        c->keycap = nw;
    }
    uint64_t *key = c->key;
    key[1] = (uint64_t)status | (uint64_t)(r->regs_abi == 0) << 8 | (uint64_t)npcs << 32;
    uint32_t npw = pc_words(c, npcs);
    uint64_t pcs_hash = npcs;
    if (c->by_code) {
        /* every pc to its frame id first: O(npcs * (log modules + 1)) expected per sample */
        key[0] = (uint64_t)ce->comm_id << 32;
        if (npcs & 1)
            key[2 + npw - 1] = 0; /* the pad half of an odd count */
        for (uint32_t i = 0; i < npcs; i++) {
            uint8_t exact = i == 0 || (kinds[i - 1] & UNW_FRAME_SIGNAL);
            uint32_t fid = frame_id(c, sp, pcs[i], exact);
            if (fid >= NEED_SYMS_ID)
                return fid; /* nothing counted yet: the sample is unwound again on resume */
            pcs_hash = mix(pcs_hash, pcs[i]);
            memcpy((uint8_t *)(key + 2) + 4 * (size_t)i, &fid, 4); /* no u32 store into u64s */
        }
    } else {
        key[0] = (uint64_t)sp->space_id | (uint64_t)ce->comm_id << 32;
        if (npcs)
            memcpy(key + 2, pcs, 8 * (size_t)npcs);
    }
    uint64_t *kw = key + 2 + npw;
    memset(kw, 0, 8 * (size_t)((npcs + 7) / 8));
    if (npcs)
        memcpy(kw, kinds, npcs);
    if (nkc)
        memcpy(kw + (npcs + 7) / 8, body + r->cc_off, 8 * (size_t)nkc);
    uint32_t id = intern_stack(c, sp, key, nw);
    if (id == UINT32_MAX)
        return id;
    c->stacks[id].count++;
    if (c->by_code && note_pair(c, sp->space_id, id, pcs_hash))
        return UINT32_MAX;
    return id;
}

/* Unwind one indexed SAMPLE r against space sp, comm ce; its stack id, or UINT32_MAX. */
static uint32_t unwind_rec(struct fp_ctx *c, const struct fp_layout *lay, const uint8_t *data,
                           const struct fp_rec *r, const struct space_ent *sp,
                           const struct comm_ent *ce)
{
    uint32_t npcs;
    uint8_t status = unwind_sample(c->arch, c->max_depth, lay, data, r, sp, c->pcs, c->kinds,
                                   &npcs);
    return intern_sample(c, data, r, sp, ce, status, c->pcs, c->kinds, npcs);
}

/* The checks fp_unwind_run makes before unwinding perm[k]: 0 if the sample can be unwound
 * now (*sp, *ce set), else the FP_RUN_* to return (*need_pid / *need_tid set). */
static int run_ready(const struct fp_ctx *c, const struct fp_rec *r, uint64_t len,
                     const struct space_ent **sp, const struct comm_ent **ce, uint32_t *need_pid,
                     uint32_t *need_tid)
{
    if (!(r->flags & FP_SAMPLE) || r->off > len || r->size > len - r->off)
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

/* ------------------------------------------------------------------ parallel unwind
 *
 * Why: unwinding (unw_unwind_one) is most of fp_unwind_run (on the issue-3 bench file ~3/4 of
 * it; interning the stacks the rest), and samples unwind independently: the calling thread
 * and one worker thread (the machines have 2 vCPUs) unwind blocks of a run's ready prefix into
 * ring slots, and the calling thread alone interns them in sample order, so frame and stack
 * ids, counts and pairs are exactly the one-thread ones.
 *
 * Protocol (all under par->mu): a job is samples [k0, k1) of perm, every one ready
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
 * returns nothing reads the caller's buffers.
 *
 * Thread safety of the unwind half (unwind_sample): it reads the record, the buffer, the
 * space table (space_slot: the calling thread does not change spaces during a job) and the
 * modules and tables (the caller keeps them alive and unchanged), and writes only its ring
 * slots and its own thread's lookup cache (unwind.c lk_cache is __thread).
 *
 * Bounds: one worker per context (created on first use, joined by fp_ctx_free); ring = g *
 * PAR_NBLOCKS samples of max_depth pcs and kinds, at most ~PAR_RING_BYTES (g shrinks for deep
 * max_depth, at least 1; 1024 samples, 1.2 MB at max_depth 128). A run stopped by
 * FP_RUN_NEED_SYMS has unwound at most ring samples past the stop, unwound again on resume
 * (bench file: ~3k extra unwinds of 80k, 30 stops). Lock traffic: O(1) per block; futex
 * wakes of the worker: O(1) per job plus one per half ring it waits for (par_wake). Measured
 * on the bench file with the second vCPU idle: fp_unwind_run 0.16-0.17 s -> 0.10-0.11 s, at
 * ~1.15x the CPU time. */
/* (the PAR_* knobs are defined before struct fp_ctx) */

struct par_slot {
    uint32_t npcs;
    uint8_t status;
};

struct par_job {
    const struct fp_ctx *c;
    const struct fp_layout *lay;
    const uint8_t *data;
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

static void par_free(struct fp_par *P)
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
 * threads it runs), and then the worker only adds its overhead: on the issue-3 bench file,
 * under load from other jobs, fp_unwind_run took ~10% longer with the worker than without,
 * where an idle second CPU makes it ~40% shorter. So the jobs are judged, every PAR_JUDGE_NS
 * of their wall time, by the CPU time their threads got over that wall time: under 1.3 CPUs,
 * busy; the next PAR_BACKOFF << streak samples (streak: busy verdicts in a row, at most 6)
 * then run on one thread, and the jobs after them probe again. Cost: four clock reads per
 * job. A verdict changes only which thread unwinds, never a result. */
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
                   const struct fp_rec *recs, const uint32_t *perm, uint64_t k0, uint64_t k1,
                   uint32_t *stack_ids, uint64_t *stopped, uint32_t *need_pid,
                   uint32_t *need_tid)
{
    struct fp_par *P = c->par;
    const uint64_t g = P->g, ring = P->ring;
    uint64_t t0 = clock_ns(CLOCK_MONOTONIC), m0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
    uint64_t w0 = P->have_wclock ? clock_ns(P->wclock) : 0;
    pthread_mutex_lock(&P->mu);
    P->job = (struct par_job){c, lay, data, recs, perm};
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
                id = intern_sample(c, data, r, sp, ce, sl->status, P->pcs + i * P->max_depth,
                                   P->kinds + i * P->max_depth, sl->npcs);
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
                int rc = par_run(c, lay, data, recs, perm, k, p, stack_ids, stopped, need_pid,
                                 need_tid);
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

uint32_t fp_nstacks(const struct fp_ctx *c) { return (uint32_t)c->nstk; }

int fp_stack(const struct fp_ctx *c, uint32_t id, struct fp_stack *out)
{
    if (id >= c->nstk)
        return -1;
    const struct stack_ent *s = &c->stacks[id];
    const uint64_t *w = c->words + s->woff;
    uint32_t npcs = (uint32_t)(w[1] >> 32), npw = pc_words(c, npcs);
    out->space_id = c->by_code ? s->space0 : (uint32_t)w[0];
    out->comm_id = (uint32_t)(w[0] >> 32);
    out->status = (uint8_t)w[1];
    out->regs_none = (uint8_t)(w[1] >> 8);
    out->pad = 0;
    out->npcs = npcs;
    out->pcs = c->by_code ? NULL : w + 2;
    out->kinds = (const uint8_t *)(w + 2 + npw);
    out->nkc = s->nwords - 2 - npw - (npcs + 7) / 8;
    out->kc = w + 2 + npw + (npcs + 7) / 8;
    out->count = s->count;
    /* never NULL (memcpy/memcmp take no NULL even for 0 bytes): c->fids is allocated only
     * once a stack with a user pc exists */
    static const uint32_t no_fids[1];
    out->fids = c->by_code ? (const uint32_t *)(w + 2) : c->fids ? c->fids + s->foff : no_fids;
    return 0;
}

uint64_t fp_stacks_words(const struct fp_ctx *c, uint32_t from, uint32_t to, uint64_t *nkc)
{
    uint64_t n = 0, k = 0;
    for (uint64_t id = from; id < to && id < c->nstk; id++) {
        const uint64_t *w = c->words + c->stacks[id].woff;
        uint32_t npcs = (uint32_t)(w[1] >> 32);
        n += npcs;
        k += c->stacks[id].nwords - 2 - pc_words(c, npcs) - (npcs + 7) / 8;
    }
    *nkc = k;
    return n;
}

uint32_t fp_stacks_export(const struct fp_ctx *c, uint32_t from, uint32_t to, uint32_t *comm,
                          uint32_t *space, uint8_t *status, uint8_t *regs_none, uint32_t *npcs, uint32_t *nkc,
                          uint32_t *fids, uint64_t *kc)
{
    uint32_t k = 0;
    for (uint64_t id = from; id < to && id < c->nstk; id++, k++) {
        struct fp_stack st;
        fp_stack(c, (uint32_t)id, &st);
        comm[k] = st.comm_id;
        space[k] = st.space_id;
        status[k] = st.status;
        regs_none[k] = st.regs_none;
        npcs[k] = st.npcs;
        nkc[k] = st.nkc;
        if (st.npcs)
            memcpy(fids, st.fids, 4 * (size_t)st.npcs);
        fids += st.npcs;
        if (st.nkc)
            memcpy(kc, st.kc, 8 * (size_t)st.nkc);
        kc += st.nkc;
    }
    return k;
}

void fp_stack_counts(const struct fp_ctx *c, uint64_t *out)
{
    for (uint64_t id = 0; id < c->nstk; id++)
        out[id] = c->stacks[id].count;
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

int fp_ctx_by_code(struct fp_ctx *c, int on)
{
    if (c->nstk || c->nfr)
        return -1;
    if (on < 0 || on > 2)
        return -1;
    if (on && !c->memo && !(c->memo = calloc(FID_MEMO, sizeof *c->memo)))
        return -1;
    c->by_code = on;
    return 0;
}

uint64_t fp_pairs(const struct fp_ctx *c, uint64_t from, uint32_t *space_ids,
                  uint32_t *stack_ids, uint64_t *pcs_hashes, uint64_t max)
{
    uint64_t k = 0;
    for (uint64_t i = from; i < c->npairs && k < max; i++, k++) {
        space_ids[k] = c->pairs[i].space_id;
        stack_ids[k] = c->pairs[i].stack_id;
        pcs_hashes[k] = c->pairs[i].pcs_hash;
    }
    return k;
}

uint32_t fp_nframes(const struct fp_ctx *c) { return (uint32_t)c->nfr; }

int fp_frame(const struct fp_ctx *c, uint32_t id, uint32_t *space_id, uint64_t *pc,
             uint8_t *exact)
{
    if (id >= c->nfr)
        return -1;
    *space_id = c->frames[id].space_id;
    *pc = c->frames[id].pc;
    *exact = c->frames[id].exact;
    return 0;
}

uint64_t fp_select_other(const struct fp_rec *recs, uint64_t n, uint32_t *out)
{
    uint64_t k = 0;
    for (uint64_t i = 0; i < n && i <= UINT32_MAX; i++)
        if (!(recs[i].flags & FP_SAMPLE))
            out[k++] = (uint32_t)i;
    return k;
}

void fp_columns(const struct fp_rec *recs, const uint32_t *perm, uint64_t nout,
                uint8_t *is_sample, uint64_t *time, uint64_t *period, uint32_t *pid,
                uint32_t *tid, uint32_t *cpu)
{
    for (uint64_t k = 0; k < nout; k++) {
        const struct fp_rec *r = &recs[perm[k]];
        is_sample[k] = (r->flags & FP_SAMPLE) ? 1 : 0;
        time[k] = r->time;
        period[k] = r->period;
        pid[k] = r->pid;
        tid[k] = r->tid;
        cpu[k] = r->cpu;
    }
}

/* ------------------------------------------------------------------ the live step */

struct fp_live_order {
    struct hent *h;
    uint64_t hn, hcap, seq, next_flush, last_flush, max_time, last_time, max_queued;
    int have_last;
    struct cpumap cm;
};

struct fp_live_order *fp_live_order_new(uint64_t max_queued)
{
    if (!max_queued)
        return NULL;
    struct fp_live_order *o = calloc(1, sizeof *o);
    if (o)
        o->max_queued = max_queued;
    return o;
}

void fp_live_order_free(struct fp_live_order *o)
{
    if (!o)
        return;
    free(o->h);
    free(o->cm.keys);
    free(o->cm.vals);
    free(o);
}

uint64_t fp_live_order_queued(const struct fp_live_order *o) { return o->hn; }

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

static void live_pop(struct fp_live_order *o, uint32_t *perm, uint64_t *out)
{
    struct hent e = hpop(o->h, &o->hn);
    perm[(*out)++] = e.idx;
    if (e.t > o->last_flush)
        o->last_flush = e.t;
}

int fp_live_order_round(struct fp_live_order *o, const struct fp_rec *recs, uint64_t ncarry,
                        uint64_t n, int final, uint32_t *perm, uint64_t *nout, uint64_t *late_ns,
                        uint64_t *nlate, struct fp_order_stats *st, uint32_t *keep,
                        uint64_t *nkeep)
{
    memset(st, 0, sizeof *st);
    *nout = *nlate = *nkeep = 0;
    if (ncarry != o->hn || n < ncarry || n > UINT32_MAX)
        return -1;
    if (n > o->hcap) {
        struct hent *q = realloc(o->h, n * sizeof *q);
        if (!q)
            return -1;
        o->h = q;
        o->hcap = n;
    }
    uint64_t out = 0;
    for (uint64_t i = ncarry; i < n; i++) { /* RoundOrderer.push */
        const struct fp_rec *r = &recs[i];
        if (r->flags & FP_MARKER)
            continue; /* rings never carry FINISHED_ROUND; counted by the caller */
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
        hpush(o->h, &o->hn, (struct hent){t, o->seq++, (uint32_t)i});
        st->pushed++;
        if (o->hn > o->max_queued) { /* _force_half: out first, as end_round returns _ready */
            uint64_t k = o->hn / 2 ? o->hn / 2 : 1;
            for (uint64_t j = 0; j < k; j++)
                live_pop(o, perm, &out);
            st->forced_flushes++;
        }
    }
    if (final) { /* flush_all */
        while (o->hn)
            live_pop(o, perm, &out);
    } else { /* end_round */
        st->rounds++;
        uint64_t lim = o->next_flush > o->last_flush ? o->next_flush : o->last_flush;
        while (o->hn && o->h[0].t <= lim)
            live_pop(o, perm, &out);
    }
    o->next_flush = o->max_time;
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
