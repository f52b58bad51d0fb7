/* fastpath.h: the native pipeline context of unwindd._unwcore: index a perf.data data section
 * or ring chunks, order them by perf's round rule, unwind runs of SAMPLE records straight from
 * the raw bytes and aggregate identical stacks. Python decodes only the rare non-SAMPLE
 * records, applies them to the process table and symbolizes each unique stack once; its two
 * drivers are the replay (daemon/unwindd/pipeline/filereplay.py) and the live step
 * (daemon/unwindd/pipeline/ringstep.py), their shared vocabulary pipeline/context.py.
 *
 * fp_ / FP_ stands for fastpath (this interface and its internals), never for frame pointer:
 * the unwinder's frame-pointer names say fpwalk (unwcore.h fpwalk_frames).
 *
 * The stages, one C file each (shared internals: fastpath_int.h, fastpath_util.h):
 * index.c (fp_index: records, SAMPLE fields), order.c (fp_order, fp_live_order_*: perf's
 * round rule), stacks.c (unwind + aggregate one sample, the fp_stack / fp_frame accessors),
 * parallel.c (fp_unwind_run and its worker thread), context.c (struct fp_ctx: its life,
 * spaces, comms), live.c (the live step: fp_live_index, fp_live_run, fp_live_groups_*); fold.c
 * and mapfile.c add the functions marked with their names.
 *
 * Like unwcore.h this is a cffi cdef as well as a C header: no includes, fixed-width types only.
 *
 * Invariants:
 * - Every read of the data buffer is bounds-checked against [data, data + len): garbage, cut
 *   and hostile input end the index with a counted error, never a read outside.
 * - fp_index validates every SAMPLE exactly as decoder.RecordDecoder._sample does, with the same
 *   error names (FP_ERR_*, in context.SAMPLE_ERRORS), so the decode counts are the same.
 * - fp_order reproduces ordering.RoundOrderer.feed_file_order (same delivery order, same stats).
 * - A struct fp_ctx owns all its memory (fp_ctx_new / fp_ctx_free), and so do struct
 *   fp_live_order, fp_live_groups and fp_fold (their _new / _free); the index arrays returned
 *   by fp_index and fp_live_index are malloc'd and released with unw_free. Nothing else
 *   allocates across calls.
 * Cost: fp_index O(records); fp_order O(records log queued); fp_unwind_run O(samples * depth *
 * (log modules + log rows)) plus O(stack words) to hash each stack.
 */

#define FP_TIMED 1      /* fp_rec.flags: time is valid */
#define FP_HAS_CPU 2    /* cpu is valid */
#define FP_MARKER 4     /* FINISHED_ROUND: ends a round, is not delivered */
#define FP_SAMPLE 8     /* a SAMPLE that decoded (err == 0): the native path owns it */

/* SAMPLE decode errors, decoder.py's reasons in this order (context.SAMPLE_ERRORS) */
#define FP_ERR_NONE 0
#define FP_ERR_SHORT_BODY 1
#define FP_ERR_BAD_CALLCHAIN_NR 2
#define FP_ERR_BAD_RAW_SIZE 3
#define FP_ERR_BAD_BRANCH_NR 4
#define FP_ERR_SHORT_REGS 5
#define FP_ERR_BAD_STACK_SIZE 6
#define FP_ERR_BAD_DYN_SIZE 7

/* How the index ended (perfdata._Framer): FP_END_OK, or the error it counts. */
#define FP_END_OK 0
#define FP_END_TRUNCATED 1          /* decoder.stats.errors["truncated"] */
#define FP_END_BAD_SIZE 2           /* decoder.stats.errors["bad_size"] */
#define FP_END_PAYLOAD_TRUNCATED 3  /* PerfData.errors["payload_truncated"] */

/* A format's SAMPLE layout: the same numbers formats.SampleLayout computes. */
struct fp_layout {
    uint64_t sample_type;
    uint64_t regs_mask;     /* sample_regs_user */
    uint32_t nprefix;       /* u64 slots IDENTIFIER..PERIOD present */
    int32_t i_ip, i_tid, i_time, i_cpu, i_period;   /* slot index or -1 */
    uint32_t read_group, read_times, read_per_value;
    uint32_t branch_hw_index, branch_counters;
    uint32_t nregs;         /* popcount(regs_mask) */
};

/* One record of the data section, in file order (56 bytes). */
struct fp_rec {
    uint64_t off;       /* offset of its header in data */
    uint64_t time;
    uint64_t period;    /* SAMPLE: PERF_SAMPLE_PERIOD if present */
    uint32_t pid, tid, cpu;
    uint16_t size, misc;
    uint8_t type;       /* header type (types > 255 never index: see fp_index) */
    uint8_t flags;      /* FP_* */
    uint8_t err;        /* FP_ERR_* for a SAMPLE */
    /* FP_SAMPLE: where its variable parts are, so the unwind reads only the bytes it uses
     * instead of walking the body again (a record is < 64 KiB: u16 offsets from the body,
     * i.e. the byte after the header, fit). regs_abi: the REGS_USER abi, 3 for any value > 2
     * (only == 0, == 2 and != 0 matter). */
    uint8_t regs_abi;
    uint16_t cc_off, cc_nr;     /* PERF_SAMPLE_CALLCHAIN ips[] and nr (0 if absent) */
    uint16_t regs_off;          /* regs[] (abi != 0) */
    uint16_t stack_off, dyn;    /* STACK_USER data[] and dyn_size (0: no stack) */
    uint16_t pad;
};

/* Frame data[0, len) into records (perfdata._Framer rules: AUXTRACE and TRACING_DATA payloads
 * skipped) and decode the SAMPLE fields the replay needs. *recs is malloc'd (unw_free), *nrec
 * records; *end is FP_END_*; *other counts records that are not FP_SAMPLE. A record type > 255
 * stops the index with *end = FP_END_OK and *stopped_at = its offset (the caller falls back).
 * Returns 0, or -1 on allocation failure. */
int fp_index(const struct fp_layout *lay, const uint8_t *data, uint64_t len,
             struct fp_rec **recs, uint64_t *nrec, uint64_t *other, int *end,
             uint64_t *stopped_at);

/* mapfile.c: fill the page tables of [p, p + len), a read-only file mapping starting at p, so
 * the replay's reads do not fault page by page; reads only. 0 (madvise), 1 (pages touched one
 * by one), -1 (bad arguments). Called without the GIL (cffi), from a thread of its own. */
int fp_prefault(const uint8_t *p, uint64_t len);

struct fp_order_stats {
    uint64_t pushed, delivered, queued, late, max_lateness_ns, rounds, forced_flushes, untimed;
};

/* Order recs[0, n) by ordering.RoundOrderer.feed_file_order: perm[0, *nout) receives the
 * delivered record indices (markers are consumed); late_ns[0, *nlate) the lateness of each late
 * record, in push order. perm and late_ns hold n entries. Returns 0, or -1 on allocation failure
 * or max_queued == 0. */
int fp_order(const struct fp_rec *recs, uint64_t n, uint64_t max_queued, uint32_t *perm,
             uint64_t *nout, uint64_t *late_ns, uint64_t *nlate, struct fp_order_stats *st);

struct fp_ctx;

struct fp_ctx *fp_ctx_new(int arch, uint32_t max_depth);
void fp_ctx_free(struct fp_ctx *c);

/* The unwinder's view of pid: its modules (kept alive by the caller until replaced or the
 * context is freed) and the caller's id for that address-space snapshot. Returns 0 or -1 (OOM). */
int fp_set_space(struct fp_ctx *c, uint32_t pid, const struct unw_module *mods, uint32_t nmods,
                 uint32_t space_id);
void fp_forget_space(struct fp_ctx *c, uint32_t pid);
/* The comm id of thread tid of pid (the caller's interned comm_of(pid, tid)). */
int fp_set_comm(struct fp_ctx *c, uint32_t pid, uint32_t tid, uint32_t comm_id);
void fp_forget_comms(struct fp_ctx *c);

/* Stack statuses past the unwinder's UNW_* (0..7): a sample of a layout that samples no user
 * registers (sample_regs_user 0: perf record -g, frame pointers, or no call graph at all) has
 * nothing to unwind; stacks.c unwind_sample takes its frames the way perf script does. */
#define FP_STATUS_CALLCHAIN 8   /* the recorded callchain's kernel and user entries */
#define FP_STATUS_IP_ONLY 9     /* no callchain entries: the sample ip alone, one frame */

#define FP_RUN_DONE 0
#define FP_RUN_NEED_SPACE 1   /* no space for *need_pid: fp_set_space, then resume at *stopped */
#define FP_RUN_NEED_COMM 2    /* no comm for (*need_pid, *need_tid): fp_set_comm, resume */
#define FP_RUN_ERROR -1       /* allocation failure */
#define FP_RUN_NEED_SYMS 4    /* by function: module *need_tid of *need_pid's space has no symbol
                               * table: fp_set_symbols for its key, then resume at *stopped */

/* Unwind the SAMPLE records recs[perm[k]] for k in [from, to) (all FP_SAMPLE) from the raw
 * bytes and write each one's stack id to stack_ids[k]. Identical (space, comm, unwind status,
 * regs-abi-none, user pcs and their kinds, raw callchain) keys share an id. */
int fp_unwind_run(struct fp_ctx *c, const struct fp_layout *lay, const uint8_t *data,
                  uint64_t len, const struct fp_rec *recs, const uint32_t *perm, uint64_t from,
                  uint64_t to, uint32_t *stack_ids, uint64_t *stopped, uint32_t *need_pid,
                  uint32_t *need_tid);

/* Parallel unwind: of a run, a prefix of at least min_run samples that are all ready (space
 * and comm set) is unwound by the calling thread and one worker thread the context owns
 * (started on first use, joined by fp_ctx_free; no worker if it cannot start), and interned
 * in sample order by the calling thread, so ids, counts and stops are what one thread gives.
 * While the two threads do not get two CPUs (a busy machine) stretches of samples run on one
 * thread (parallel.c par_judge). min_run 0: one thread only; 1: any prefix (tests). Default
 * 256 (fastpath_int.h PAR_MIN). Returns 0. */
int fp_ctx_par(struct fp_ctx *c, uint32_t min_run);

/* Tests: start the worker now and make it take blocks (the calling thread waits until the
 * worker has done one block of each job; no busy verdicts), so the threaded path is sure to
 * run; results are the same.
 * Returns 0, or -1 if no worker could start. fp_ctx_par_stats: the samples the worker has
 * unwound so far (0 without a worker). */
int fp_ctx_par_stress(struct fp_ctx *c, int on);
uint64_t fp_ctx_par_stats(const struct fp_ctx *c);

/* The bytes the context holds on the heap: its tables at their capacities (stacks, their keys
 * and frame ids, frames, pairs, spaces, comms, symbol tables, the memo) and the parallel
 * unwind's ring; not the caller's modules and tables it points at. O(1): computed from the
 * capacities, which only grow for the context's life. */
uint64_t fp_ctx_bytes(const struct fp_ctx *c);

/* Aggregate by code (before any run; -1 after): a user frame whose named address lies in a
 * module is identified by (module key, ELF vaddr, exact) instead of (space, pc, exact), and a
 * stack by (comm, status, regs-abi-none, frame ids and kinds, raw callchain) without its
 * space, so the same code run by many processes (ASLR gives each its own pcs) is one frame and
 * one stack. fp_stack then gives no pcs (NULL) and space_id is its first sample's space;
 * fp_frame gives where a frame was first seen. For output that does not print addresses
 * (folded). The caller's module keys must identify everything a name depends on. */
int fp_ctx_by_code(struct fp_ctx *c, int on);

/* Frames by code, stacks by space (before any run, not with fp_ctx_by_code; -1 otherwise): a
 * user frame whose named address lies in a module other than JIT code is identified by (module
 * key, ELF vaddr, exact), as by code, while a stack stays (space, comm, status, pcs, kinds,
 * callchain) with its pcs (fp_stacks_pcs). So a new process of a known binary, or a process
 * whose mappings changed, adds new stacks but no new frames: its frames are the ones named
 * before at another address (fp_frame gives where a frame was first seen), the same but for
 * their address. The caller's module keys must identify everything a name depends on besides
 * the address and its ELF vaddr. */
int fp_ctx_code_frames(struct fp_ctx *c, int on);

/* Frames by code: the frames of modules keys[0..n) are named no more (a table their names
 * depend on arrived after they were named), nor are the stacks that hold them: the next
 * sample that runs their code, in a process seen before or a new one, adds a new stack with
 * new frame ids, named again, while the ids already given keep their meaning (counts held
 * under them stay theirs). Module keys of frames by code must stay below 1 << 62. Returns the
 * frames retired; -2 unless frames are by code (fp_ctx_code_frames), -1 on allocation
 * failure. O(frames * log n + stacks' frame ids) after an O(n log n) sort of a copy of keys. */
int64_t fp_ctx_retire_code(struct fp_ctx *c, const uint64_t *keys, uint32_t n);

/* The user pcs of stacks [from, to), back to back (fp_stacks_words of them); nothing by code. */
void fp_stacks_pcs(const struct fp_ctx *c, uint32_t from, uint32_t to, uint64_t *pcs);

/* on = 2, by function: a module frame is (module key, symbol region, exact), the region being
 * which symbol of the module's table (fp_set_symbols) names the ELF vaddr, or none: every
 * address of one function is one frame, and a stack is its functions (folded output names
 * nothing finer). A run stops with FP_RUN_NEED_SYMS at the first frame in a module whose key
 * has no table yet. fp_frame gives the address the frame was first seen at (any address of
 * the region names it). */

/* by function: module key's symbol table, sorted starts and their ends (n each, the arrays
 * symtab.SymbolTable.lookup searches; kept alive by the caller while the context lives).
 * Returns 0, or -1 (not by function, key already set, allocation failure). */
int fp_set_symbols(struct fp_ctx *c, uint64_t key, const uint64_t *starts, const uint64_t *ends,
                   uint64_t n);

/* The region of ELF vaddr addr in a table: SymbolTable.lookup's answer as a number, i + 1 when
 * it names symbol i (i = bisect_right(starts, addr) - 1, and addr < ends[i] or addr ==
 * starts[i]), 0 when it names nothing; every address of one region gets the same name. */
uint64_t fp_sym_region(const uint64_t *starts, const uint64_t *ends, uint64_t n, uint64_t addr);

/* by code: the distinct (space, stack, hash of the raw user pcs) triples of the samples so
 * far, in first-seen order: copies triples [from, from + max) and returns how many it copied.
 * (What the Python reference's per-(snapshot, pcs) unsymbolized count needs.) */
uint64_t fp_pairs(const struct fp_ctx *c, uint64_t from, uint32_t *space_ids,
                  uint32_t *stack_ids, uint64_t *pcs_hashes, uint64_t max);

/* One unique stack (pointers valid until the next fp_unwind_run or fp_ctx_free). */
struct fp_stack {
    uint32_t space_id, comm_id;
    uint8_t status;         /* UNW_* */
    uint8_t regs_none;      /* the sample's regs_abi was PERF_SAMPLE_REGS_ABI_NONE and it was
                             * unwound (status an UNW_*): kernel_only if it has kernel frames */
    uint16_t pad;
    uint32_t npcs, nkc;
    const uint64_t *pcs;    /* user pcs, leaf first (unwinder output); by code NULL */
    const uint8_t *kinds;   /* UNW_FRAME_* per pc */
    const uint64_t *kc;     /* the raw PERF_SAMPLE_CALLCHAIN; FP_STATUS_IP_ONLY of a kernel
                             * ip: { PERF_CONTEXT_KERNEL, ip } */
    uint64_t count;         /* samples so far */
    const uint32_t *fids;   /* frame id of each pc (fp_frame) */
};

uint32_t fp_nstacks(const struct fp_ctx *c);
int fp_stack(const struct fp_ctx *c, uint32_t id, struct fp_stack *out);

/* Stacks [from, to) in bulk (one call instead of one fp_stack each): fp_stacks_words gives
 * the room fids (its return value) and kc (*nkc) need; fp_stacks_export fills per stack its
 * comm id, space id, status, regs_none, npcs and nkc, and the frame ids and raw callchain
 * words of all of them back to back; returns the stacks exported. fp_stack_counts: every
 * stack's count (out holds fp_nstacks). O(stacks + their words). */
uint64_t fp_stacks_words(const struct fp_ctx *c, uint32_t from, uint32_t to, uint64_t *nkc);
uint32_t fp_stacks_export(const struct fp_ctx *c, uint32_t from, uint32_t to, uint32_t *comm,
                          uint32_t *space, uint8_t *status, uint8_t *regs_none, uint32_t *npcs, uint32_t *nkc,
                          uint32_t *fids, uint64_t *kc);
void fp_stack_counts(const struct fp_ctx *c, uint64_t *out);

/* fold.c, by code: the folded text of every stack so far. comm_rank[comm id], frame_rank[frame
 * id] and krank[i] (of kips[i], the distinct kernel ips, ascending) rank each name in the
 * order the text sorts names in. fp_fold_new: 0, -1 (memory) or -2 (an id or ip without a
 * rank); *out is freed with fp_fold_free. fp_fold_text renders the next lines that fit in
 * buf[0, cap), name r being names[name_off[r], name_off[r + 1]): bytes written (0 once all
 * are), -(bytes needed) if the next line alone does not fit, INT64_MIN for a bad rank. */
struct fp_fold;
int fp_fold_new(const struct fp_ctx *c, const uint32_t *comm_rank, uint32_t ncomm,
                const uint32_t *frame_rank, uint32_t nframes, const uint64_t *kips,
                const uint32_t *krank, uint64_t nkips, struct fp_fold **out);
uint64_t fp_fold_lines(const struct fp_fold *f);
int64_t fp_fold_text(struct fp_fold *f, const uint8_t *names, const uint64_t *name_off,
                     uint32_t nnames, uint8_t *buf, uint64_t cap);
void fp_fold_free(struct fp_fold *f);

/* fold.c, the engine's counts of the stacks so far without a Python pass over them:
 * fp_fold_stats: samples by_status[UNW_* or FP_STATUS_*], by_status[FP_FOLD_NSTATUS - 1]
 * kernel_only (unwound without user registers, kernel frames), first[k] the first stack of each (UINT32_MAX: none), and
 * the user and kernel frames of all samples; 0, or -1 on a bad status. fp_kernel_ips: the
 * distinct kernel ips of all stacks ascending in out, their number; a number > cap is the
 * room needed (out then unordered). fp_stacks_unsym: per stack of [from, to), its user frames
 * (none for kernel_only) whose frame id is flagged in unsym[0, nframes). */
#define FP_FOLD_NSTATUS 11
int fp_fold_stats(const struct fp_ctx *c, uint64_t *by_status, uint32_t *first,
                  uint64_t *user_frames, uint64_t *kernel_frames);
uint64_t fp_kernel_ips(const struct fp_ctx *c, uint64_t *out, uint64_t cap);
void fp_stacks_unsym(const struct fp_ctx *c, uint32_t from, uint32_t to, const uint8_t *unsym,
                     uint32_t nframes, uint32_t *out);

/* fold.c: the distinct vals[k] (k < n, flag[k] set) in first-seen order, each with its
 * occurrences, as (value, count) pairs (room for 2n); their number, UINT64_MAX without memory. */
uint64_t fp_count_flagged(const uint8_t *flag, const uint32_t *vals, uint64_t n, uint64_t *pairs);

/* Distinct user frames (space, pc, exact) of all stacks (by code: see fp_ctx_by_code), ids
 * dense from 0: a frame is named from pc if exact (leaf, or right after a signal trampoline),
 * else from pc - 1. */
uint32_t fp_nframes(const struct fp_ctx *c);
int fp_frame(const struct fp_ctx *c, uint32_t id, uint32_t *space_id, uint64_t *pc,
             uint8_t *exact);

/* Indices of the records that are not FP_SAMPLE (out holds n entries); returns their count. */
uint64_t fp_select_other(const struct fp_rec *recs, uint64_t n, uint32_t *out);

/* Columns of the delivered records perm[0, nout), in delivered order. */
void fp_columns(const struct fp_rec *recs, const uint32_t *perm, uint64_t nout,
                uint8_t *is_sample, uint64_t *time, uint64_t *period, uint32_t *pid,
                uint32_t *tid, uint32_t *cpu);

/* ---- the live step (daemon/unwindd/pipeline/ringstep.py): ring chunks instead of a file.
 * Cost: fp_live_index O(records); fp_live_order_round O(new records log queued + queued);
 * fp_live_run like fp_unwind_run plus O(log mappings) per sample to place it;
 * fp_live_groups_add O(samples) expected; fp_live_round fp_live_order_round's plus O(records)
 * expected and the kept records' bytes. */

#define FP_RUN_NEED_PLACE 3   /* no space for *need_pid, or the sample's user pc is outside every
                               * mapping of it: the caller places it (LiveTable.place), then
                               * resumes at *stopped with force_first (or past it if held) */

/* Like fp_index on each whole-record chunk data[bounds[i], bounds[i+1]) (one ring's drain
 * each), merged, except that records are framed by header.size alone, as RecordDecoder.decode
 * frames ring chunks (no AUXTRACE/TRACING_DATA payloads: those exist only in perf.data files);
 * offsets are relative to data; ends[i] is chunk i's FP_END_*. */
int fp_live_index(const struct fp_layout *lay, const uint8_t *data, const uint64_t *bounds,
                  uint32_t nchunks, struct fp_rec **recs, uint64_t *nrec, uint64_t *other,
                  int *ends, uint64_t *stopped_at);

/* ordering.RoundOrderer kept across live rounds: its queue lives here as (time, seq, index). */
struct fp_live_order;
struct fp_live_order *fp_live_order_new(uint64_t max_queued);
void fp_live_order_free(struct fp_live_order *o);
uint64_t fp_live_order_queued(const struct fp_live_order *o);

/* One round: recs[0, ncarry) are the records still queued (the previous call's keep order),
 * recs[ncarry, n) the new ones in drain order (pushed); then end_round (final = 0) or
 * flush_all (final = 1). perm[0, *nout) = delivered indices; st = this call's counts (queued:
 * the gauge); keep[0, *nkeep) = indices still queued, to become the next call's carry. perm,
 * late_ns and keep hold n entries. Returns 0, or -1 (allocation, carry mismatch). */
int fp_live_order_round(struct fp_live_order *o, const struct fp_rec *recs, uint64_t ncarry,
                        uint64_t n, int final, uint32_t *perm, uint64_t *nout, uint64_t *late_ns,
                        uint64_t *nlate, struct fp_order_stats *st, uint32_t *keep,
                        uint64_t *nkeep);

/* Copy recs[keep[j]] back to back into out; returns the bytes (out NULL: only counts). */
uint64_t fp_live_gather(const uint8_t *data, const struct fp_rec *recs, const uint32_t *keep,
                        uint64_t n, uint8_t *out);

/* One live round's fixed work after its side-band records are marked, in one call (the
 * live step's per-round cost is mostly calls across the boundary, not their work):
 * - the good SAMPLEs among the new records recs[ncarry, n): their number, those of pids other
 *   than 0 (the idle task's) in busy, and their distinct pids and cpus in first-seen order as
 *   (value, count) pairs in by_pid and by_cpu (the stream's per-pid and per-cpu counts,
 *   ringstep.NativeStep._count_new_samples; fp_count_flagged's answer on each column);
 * - fp_live_order_round into perm / late_ns / keep and st;
 * - fp_columns of the delivered records perm[0, nout);
 * - fp_live_gather of the kept records into carry (the next round's arena), their bytes in
 *   carry_len: the data is not written while the round runs, so the copy can come first
 *   (when they fit: the arena grows only to what a carry needs).
 * The caller's arrays hold cap >= n entries each (by_pid and by_cpu: 2 cap), carry carry_cap
 * bytes. */
struct fp_live_round {
    uint32_t *perm, *keep;
    uint64_t *late_ns;
    uint8_t *is_sample;
    uint64_t *time, *period;
    uint32_t *pid, *tid, *cpu;
    uint64_t *by_pid, *by_cpu;
    uint8_t *carry;
    uint64_t carry_cap;
    uint64_t cap;
    /* answers */
    uint64_t nsamples, busy, npids, ncpus, nout, nlate, nkeep, carry_len;
    struct fp_order_stats st;
};
/* Returns 0; 1: the kept records need carry_len > carry_cap bytes and none was copied (the
 * caller makes room and calls fp_live_gather), the rest done; -1: n > cap,
 * fp_live_order_round failed, no memory for the counts, or a kept record lies outside
 * data[0, len). */
int fp_live_round(struct fp_live_order *o, const uint8_t *data, uint64_t len,
                  const struct fp_rec *recs, uint64_t ncarry, uint64_t n, int final,
                  struct fp_live_round *r);
/* fp_live_index, then, when the round holds no record but good SAMPLEs (nothing for the caller
 * to decode and mark: *other == 0, no stop) and r's arrays hold its records, fp_live_round on it
 * (ncarry: the records of chunk 0, the carry; len: bounds[nchunks]) and its answer; else 2,
 * the round not run (the caller marks the side-band records, makes room, calls fp_live_round),
 * or -1 when fp_live_index fails. One call for the common round of samples only. */
int fp_live_index_round(const struct fp_layout *lay, const uint8_t *data, const uint64_t *bounds,
                        uint32_t nchunks, struct fp_rec **recs, uint64_t *nrec, uint64_t *other,
                        int *ends, uint64_t *stopped_at, struct fp_live_order *o,
                        uint64_t ncarry, int final, struct fp_live_round *r);

/* fp_set_space plus the table's mappings as sorted [start, end) pairs (kept alive by the
 * caller), for the placement check. */
int fp_set_live_space(struct fp_ctx *c, uint32_t pid, const struct unw_module *mods,
                      uint32_t nmods, uint32_t space_id, const uint64_t *ranges,
                      uint32_t nranges);
void fp_forget_all_spaces(struct fp_ctx *c);

/* fp_unwind_run for the live table: each sample is first placed (LiveTable.place's fast
 * answer: pid known and verified, user pc inside a mapping; or no user regs / pid <= 0); if
 * it is not placeable here FP_RUN_NEED_PLACE. force_first skips the check for perm[from]
 * (the caller placed it). *record_time advances like LiveTable.record_time; touched[0,
 * *ntouched) are the pids placed here, touched_t their new last_used (room for to - from). */
int fp_live_run(struct fp_ctx *c, const struct fp_layout *lay, const uint8_t *data,
                uint64_t len, const struct fp_rec *recs, const uint32_t *perm, uint64_t from,
                uint64_t to, int force_first, uint32_t ip_bit, uint64_t *record_time,
                uint32_t *stack_ids, uint64_t *stopped, uint32_t *need_pid, uint32_t *need_tid,
                uint32_t *touched, uint64_t *touched_t, uint64_t *ntouched);

/* Per-(time / bucket_ns, pid, tid, stack id) sample counts accumulated across rounds until
 * the caller takes them (the daemon stores them at an interval, service.py _FLUSH_SECONDS,
 * not every round: a group of a busy stack recurs in most rounds of a bucket and costs a
 * Python store update each time).
 * Groups keep first-seen order; each keeps its newest time (the store's last_seen_ns). */
struct fp_live_groups;
/* NULL on allocation failure or a zero bucket_ns. */
struct fp_live_groups *fp_live_groups_new(uint64_t bucket_ns);
void fp_live_groups_free(struct fp_live_groups *g);
/* Count the samples k < n with is_sample[k] and stack_ids[k] != UINT32_MAX; returns how many,
 * or UINT64_MAX on allocation failure, with nothing added (room for n new groups is made
 * first). O(n) expected. */
uint64_t fp_live_groups_add(struct fp_live_groups *g, const uint8_t *is_sample,
                            const uint32_t *stack_ids, const uint64_t *time, const uint32_t *pid,
                            const uint32_t *tid, uint64_t n);
/* Groups held now. */
uint64_t fp_live_groups_len(const struct fp_live_groups *g);
/* Copy every group out (room for fp_live_groups_len each), in first-seen order, and empty g
 * (its memory is kept for the next rounds). O(groups + table). */
void fp_live_groups_take(struct fp_live_groups *g, uint64_t *g_time, uint32_t *g_pid,
                         uint32_t *g_tid, uint32_t *g_sid, uint64_t *g_count);
