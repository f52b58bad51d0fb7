/* fastpath_int.h: internals shared by the fastpath files (not part of the cffi interface):
 * the native context (struct fp_ctx) with the two tables every stage after indexing reads
 * (spaces, comms), the parallel unwind's knobs, and the functions one file lends another.
 *
 * The files, each calling only files listed before it: index.c (records), order.c (round
 * order), stacks.c (one sample's unwind + aggregate, the stack and frame export), parallel.c
 * (fp_unwind_run and its worker), context.c (the context's life, spaces, comms), live.c (the
 * live step). Each exported fp_* function's contract is in fastpath.h (fp_ = fastpath).
 *
 * Invariants: only the calling thread changes a context; while a parallel job runs
 * (parallel.c) nothing in it changes, and the worker reads only its arch and its spaces
 * (space_slot), the caller's modules and tables and the job's records. The stacks, frames,
 * pairs and symbol tables of a context are stacks.c's alone (their structs are defined there).
 * Cost: space_slot and comm_slot are O(1) expected (tables at most half full).
 */
#ifndef FASTPATH_INT_H
#define FASTPATH_INT_H

#include <stdint.h>

#include "unwcore_int.h"
#include "fastpath.h"
#include "fastpath_util.h"

/* Functions one fastpath file lends another: hidden, so the module exports the fastpath.h
 * interface only. */
#define FP_INTERNAL __attribute__((visibility("hidden")))

/* The parallel unwind's knobs (parallel.c; tests build with small ones). fp_ctx_new reads PAR_MIN.
 * PAR_MIN: below some length a ready prefix costs more to hand to the worker than the worker
 * saves (waking it, claiming blocks, waiting for the last one); 256 is past where the worker
 * starts to pay on the replay benchmark, with a margin. */
#ifndef PAR_SEG
#define PAR_SEG 8192        /* samples scanned for readiness at a time (fp_unwind_run) */
#endif
#ifndef PAR_BLOCK
#define PAR_BLOCK 32        /* samples per claim: enough unwinding to outweigh the lock */
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

struct stack_ent;
struct frame_ent;
struct pair_ent;
struct sym_ent;
struct fid_memo;
struct fp_par;

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
    int code_frames;        /* fp_ctx_code_frames */
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

static inline struct space_ent *space_slot(const struct fp_ctx *c, uint32_t pid)
{
    uint64_t j = SLOT(mix(0, pid), c->scap);
    while (c->spaces[j].used && c->spaces[j].pid != pid)
        j = SLOT(j + 1, c->scap);
    return &c->spaces[j];
}

static inline struct comm_ent *comm_slot(const struct fp_ctx *c, uint32_t pid, uint32_t tid)
{
    uint64_t j = SLOT(mix(mix(0, pid), tid), c->ccap);
    while (c->comms[j].used && (c->comms[j].pid != pid || c->comms[j].tid != tid))
        j = SLOT(j + 1, c->ccap);
    return &c->comms[j];
}

/* index.c: fp_index's framing of data[0, len); payloads: skip the AUXTRACE / TRACING_DATA
 * payloads after header.size (perf.data framing, fp_index), 0 for ring chunks (live.c's
 * fp_live_index: decoder.RecordDecoder.decode frames them by header.size only). */
FP_INTERNAL int index_records(const struct fp_layout *lay, const uint8_t *data, uint64_t len,
                              int payloads, struct fp_rec **recs, uint64_t *nrec,
                              uint64_t *other, int *end, uint64_t *stopped_at);

/* stacks.c: a sample's unwind (any thread: parallel.c's worker too), its interning (the
 * calling thread), and both for one sample; contracts at their definitions. UNW_BAD_VIEW:
 * unwind_sample's status for a record whose stored view is not inside it (intern_sample then
 * fails the sample). */
#define UNW_BAD_VIEW 0xFF
FP_INTERNAL uint8_t unwind_sample(const struct unw_arch_desc *arch, uint32_t max_depth,
                                  const struct fp_layout *lay, const uint8_t *data,
                                  const struct fp_rec *r, const struct space_ent *sp,
                                  uint64_t *pcs, uint8_t *kinds, uint32_t *npcs);
FP_INTERNAL uint32_t intern_sample(struct fp_ctx *c, const struct fp_layout *lay,
                                   const uint8_t *data, const struct fp_rec *r,
                                   const struct space_ent *sp, const struct comm_ent *ce,
                                   uint8_t status, const uint64_t *pcs, const uint8_t *kinds,
                                   uint32_t npcs);
FP_INTERNAL uint32_t unwind_rec(struct fp_ctx *c, const struct fp_layout *lay,
                                const uint8_t *data, const struct fp_rec *r,
                                const struct space_ent *sp, const struct comm_ent *ce);

/* parallel.c: stop and join the worker (unless a fork's child: not its thread) and free the
 * ring (fp_ctx_free). */
FP_INTERNAL void par_free(struct fp_par *P);
/* stacks.c: the bytes the context and its sets hold, by capacity, O(1) (fp_ctx_bytes, in
 * parallel.c, adds the worker's ring). */
FP_INTERNAL uint64_t ctx_sets_bytes(const struct fp_ctx *c);

#endif
