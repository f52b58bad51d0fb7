/* live_fuzz.c: the live step's native API (cffi_build/live.c fp_live_*) under ASan/UBSan
 * and valgrind (tests/native/test_ringstep_sanitizers.py).
 *
 * usage: live_fuzz DRAINS sample_type regs_mask nprefix i_ip i_tid i_time i_cpu i_period
 *                  read_group read_times read_per_value branch_hw_index branch_counters nregs
 *                  ITERS
 *
 * DRAINS: real ring drains (tests/support/captured.py's capture), each as u32 nchunks, then per
 * chunk u32 cpu, u32 len, len bytes. Each stream replays the drains through the call sequence
 * of daemon/unwindd/pipeline/ringstep.py's NativeStep: per round the carry (records still queued, copied
 * by fp_live_gather) plus 1-3 drains' chunks are indexed (fp_live_index), side-band records get
 * the flags/time/cpu Python would set (carried ones keep theirs; fp_live_index_round instead
 * when there are none and the arrays hold the round, at random), then fp_live_round: new samples
 * counted by pid and cpu, the round ordered (small queue caps: forced flushes), its columns, the
 * carry copied into an arena as large as the round or smaller (then by fp_live_gather),
 * runs of samples between side-band records are unwound (fp_live_run answering NEED_PLACE by
 * placing or holding and NEED_COMM with an id), side-band records forget spaces/comms, the
 * stacks and frames are read back (fp_nframes/fp_frame/fp_nstacks/fp_stack) and the samples
 * grouped (fp_live_group); the context is rebuilt past small stack/space caps and each stream
 * ends with a flush round. Iteration 0 is the real capture, whole; the others truncate chunks,
 * mutate bytes, drop/duplicate drains and add absurd pids and tables (huge pids, empty,
 * unsorted and large range tables, many spaces and comms). Every buffer the library reads is
 * malloc'd at its exact size so an over-read is reported. Prints "ok N" (N checks).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "unwcore_int.h"
#include "fastpath.h"

#define HARNESS_SEED 0x2545F4914F6CDD1Dull
#include "harness.h"

#define HELD UINT32_MAX
#define IP_BIT 8 /* abi.X86_REG_NAMES.index("ip") */

/* coverage counts, printed at the end */
static unsigned long long n_rounds, n_place, n_held, n_comm, n_carried, n_forced, n_late, n_ctx,
    n_raised, n_retired, n_fused;

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

static void *xcalloc(size_t n, size_t sz)
{
    void *p = calloc(n ? n : 1, sz);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

struct chunk {
    uint32_t cpu, len;
    uint8_t *data;
};

struct drain {
    uint32_t n;
    struct chunk *c;
};

/* A snapshot the "engine" handed the context: modules and ranges live as long as the ctx. */
struct snap {
    struct unw_module *mods;
    uint32_t nmods;
    uint64_t *ranges;
    uint32_t nranges;
};

/* What NativeStep keeps across rounds. */
struct step {
    const struct fp_layout *lay;
    struct fp_live_order *o;
    uint8_t *carry;
    uint64_t carry_len, ncarry;
    uint8_t *cflags;    /* carried side-band records: flags/time/cpu by slot (_carry_objs) */
    uint64_t *ctime;
    uint32_t *ccpu;
    uint8_t *cvalid;
    struct fp_ctx *ctx;
    struct snap *snaps;
    uint32_t nsnaps, capsnaps;
    uint32_t ncomms;        /* comm ids handed out */
    uint32_t max_stacks, max_spaces;
    int absurd;             /* absurd pids/tables */
    int code_frames;        /* this context's frames are by code (fp_ctx_code_frames) */
    uint64_t record_time;
    uint64_t nstacks_seen, nframes_seen;
    uint64_t samples_new, samples_grouped, samples_held;
    struct fp_live_groups *acc; /* counts accumulated across rounds (NativeStep.flush_counts) */
    uint64_t samples_added;     /* into acc since its last take */
};

/* NativeStep.flush_counts: every group held names a stack of the current context, the counts
 * sum to what the rounds added, and acc is empty after. */
static void take_groups(struct step *s)
{
    uint64_t ng = fp_live_groups_len(s->acc);
    uint64_t *gt = xmalloc(ng * 8), *gc = xmalloc(ng * 8);
    uint32_t *gp = xmalloc(ng * 4), *gtid = xmalloc(ng * 4), *gs = xmalloc(ng * 4);
    fp_live_groups_take(s->acc, gt, gp, gtid, gs, gc);
    uint64_t got = 0;
    for (uint64_t g = 0; g < ng; g++) {
        CHECK(gc[g] >= 1 && gs[g] < fp_nstacks(s->ctx));
        got += gc[g];
    }
    CHECK(ng <= s->samples_added && got == s->samples_added);
    CHECK(fp_live_groups_len(s->acc) == 0);
    s->samples_grouped += got;
    s->samples_added = 0;
    free(gt), free(gc), free(gp), free(gtid), free(gs);
}

static void free_snaps(struct step *s)
{
    for (uint32_t i = 0; i < s->nsnaps; i++) {
        free(s->snaps[i].mods);
        free(s->snaps[i].ranges);
    }
    free(s->snaps);
    s->snaps = NULL;
    s->nsnaps = s->capsnaps = 0;
}

static void new_ctx(struct step *s)
{
    if (s->ctx) {
        take_groups(s); /* their stack ids are this context's */
        fp_ctx_free(s->ctx);
    }
    free_snaps(s);
    uint32_t depth = (rnd() % 4) ? 128 : 1 + (uint32_t)(rnd() % 8);
    s->ctx = fp_ctx_new(UNW_ARCH_X86_64, depth);
    n_ctx++;
    CHECK(s->ctx);
    s->code_frames = rnd() % 2; /* the live step's frames by code (ringstep.py) */
    if (s->code_frames)
        CHECK(fp_ctx_code_frames(s->ctx, 1) == 0);
    s->ncomms = 0;
    s->nstacks_seen = s->nframes_seen = 0;
}

/* A new snapshot (NativeStep._set_space): frame-pointer-only modules and sorted ranges, or
 * with s->absurd sometimes empty, unsorted, inverted or large tables. */
static uint32_t new_snap(struct step *s)
{
    if (s->nsnaps == s->capsnaps) {
        s->capsnaps = s->capsnaps ? 2 * s->capsnaps : 16;
        struct snap *q = realloc(s->snaps, s->capsnaps * sizeof *q);
        CHECK(q);
        s->snaps = q;
    }
    struct snap *p = &s->snaps[s->nsnaps];
    uint32_t kind = (uint32_t)(rnd() % (s->absurd ? 6 : 3));
    uint32_t nr;
    switch (kind) {
    case 0: /* everything: every sample places */
    case 1:
        nr = 1;
        break;
    case 2: /* a few random mappings: some samples need placing */
        nr = 1 + (uint32_t)(rnd() % 8);
        break;
    case 3:
        nr = 0;
        break;
    case 4:
        nr = 1 + (uint32_t)(rnd() % 20000);
        break;
    default:
        nr = 1 + (uint32_t)(rnd() % 16);
        break;
    }
    p->nranges = nr;
    p->ranges = xmalloc(2 * (size_t)nr * sizeof *p->ranges); /* exact size */
    if (kind <= 1) {
        p->ranges[0] = kind ? 0x1000 : 0;
        p->ranges[1] = kind ? 0x800000000000ull : UINT64_MAX;
    } else if (kind == 2 || kind == 4) {
        uint64_t a = rnd() % 0x10000;
        for (uint32_t i = 0; i < nr; i++) {
            a += 1 + rnd() % (kind == 2 ? 0x100000000000ull : 0x100000000ull);
            uint64_t b = a + 1 + rnd() % 0x1000000;
            p->ranges[2 * i] = a;
            p->ranges[2 * i + 1] = b;
            a = b;
        }
    } else {
        for (uint32_t i = 0; i < 2 * nr; i++)
            p->ranges[i] = rnd() >> (rnd() % 64);
    }
    uint32_t nm = (uint32_t)(rnd() % (s->absurd ? 5 : 3));
    p->nmods = nm;
    p->mods = nm ? xmalloc(nm * sizeof *p->mods) : NULL;
    uint64_t base = 0x400000;
    for (uint32_t i = 0; i < nm; i++) {
        uint64_t len = (rnd() % 3) ? 0x800000000000ull : 1 + rnd() % 0x1000000;
        p->mods[i] = (struct unw_module){base, base + len, base, NULL, i + 1, 0};
        base += len;
    }
    return s->nsnaps++;
}

static void set_space(struct step *s, uint32_t pid)
{
    uint32_t sid = (s->nsnaps && rnd() % 3) ? (uint32_t)(rnd() % s->nsnaps) : new_snap(s);
    struct snap *p = &s->snaps[sid];
    CHECK(fp_set_live_space(s->ctx, pid, p->mods, p->nmods, sid, p->ranges, p->nranges) == 0);
}

static uint32_t absurd_pid(void)
{
    switch (rnd() % 4) {
    case 0:
        return UINT32_MAX - (uint32_t)(rnd() % 4);
    case 1:
        return 0;
    case 2:
        return (uint32_t)rnd();
    default:
        return 1u << 31 | (uint32_t)(rnd() % 64);
    }
}

/* NativeStep._run over [a, b) of the delivered order. */
static void run(struct step *s, const uint8_t *buf, uint64_t len, struct fp_rec *recs,
                const uint32_t *perm, uint64_t a, uint64_t b, uint32_t *stack_ids)
{
    uint32_t *touched = xmalloc((b - a) * sizeof *touched);
    uint64_t *touched_t = xmalloc((b - a) * sizeof *touched_t);
    uint64_t k = a;
    int force = 0;
    for (;;) {
        uint64_t stopped = UINT64_MAX, nt = UINT64_MAX, rt = s->record_time;
        uint32_t need_pid = 0, need_tid = 0;
        int rc = fp_live_run(s->ctx, s->lay, buf, len, recs, perm, k, b, force, IP_BIT, &rt,
                             stack_ids, &stopped, &need_pid, &need_tid, touched, touched_t, &nt);
        CHECK(rc == FP_RUN_DONE || rc == FP_RUN_NEED_PLACE || rc == FP_RUN_NEED_COMM);
        CHECK(stopped >= k && stopped <= b && nt <= b - k && rt >= s->record_time);
        for (uint64_t j = 0; j < nt; j++)
            CHECK(touched_t[j] <= rt);
        s->record_time = rt;
        for (uint64_t j = k; j < stopped; j++)
            CHECK(stack_ids[j] < fp_nstacks(s->ctx));
        k = stopped;
        if (rc == FP_RUN_DONE) {
            CHECK(k == b);
            break;
        }
        CHECK(k < b);
        if (rc == FP_RUN_NEED_PLACE) {
            n_place++;
            const struct fp_rec *r = &recs[perm[k]];
            CHECK(need_pid == r->pid);
            fp_forget_space(s->ctx, r->pid); /* LiveTable.place may have changed it */
            if (rnd() % 6 == 0)
                fp_forget_comms(s->ctx); /* a rescan set a comm */
            if (rnd() % 4) { /* placed */
                set_space(s, r->pid);
                force = 1;
            } else { /* held (or deferred) */
                stack_ids[k] = HELD;
                n_held++;
                s->samples_held++;
                k++;
                force = 0;
                if (k >= b)
                    break;
            }
            continue;
        }
        n_comm++;
        CHECK(need_pid == recs[perm[k]].pid && need_tid == recs[perm[k]].tid);
        CHECK(fp_set_comm(s->ctx, need_pid, need_tid, (uint32_t)(rnd() % (s->ncomms + 1))) == 0);
        if (s->ncomms < 8)
            s->ncomms++;
    }
    free(touched);
    free(touched_t);
}

/* NativeStep._name_new: read back what the runs added. */
static void name_new(struct step *s)
{
    uint32_t nfr = fp_nframes(s->ctx), nst = fp_nstacks(s->ctx);
    CHECK(nfr >= s->nframes_seen && nst >= s->nstacks_seen);
    for (uint32_t f = (uint32_t)s->nframes_seen; f < nfr; f++) {
        uint32_t sp;
        uint64_t pc;
        uint8_t ex;
        CHECK(fp_frame(s->ctx, f, &sp, &pc, &ex) == 0);
        CHECK(sp < s->nsnaps && ex <= 1);
    }
    uint32_t dummy;
    uint64_t dpc;
    uint8_t dex;
    CHECK(fp_frame(s->ctx, nfr, &dummy, &dpc, &dex) == -1);
    for (uint32_t i = (uint32_t)s->nstacks_seen; i < nst; i++) {
        struct fp_stack st;
        CHECK(fp_stack(s->ctx, i, &st) == 0);
        CHECK(st.count >= 1 && st.status <= UNW_NO_REGS && st.space_id < s->nsnaps);
        CHECK(st.comm_id <= s->ncomms && st.npcs <= 1u << 16);
        uint64_t sum = 0;
        for (uint32_t j = 0; j < st.npcs; j++) {
            CHECK(st.fids[j] < nfr);
            sum += st.pcs[j] + st.kinds[j];
        }
        for (uint32_t j = 0; j < st.nkc; j++)
            sum += st.kc[j];
        (void)sum;
    }
    s->nframes_seen = nfr;
    s->nstacks_seen = nst;
    /* a binary's table arrived (LiveProfiler.names_changed): retire one or two of the module
     * keys new_snap gives (1..5) or an unknown one; ids already given stay readable */
    if (s->code_frames && rnd() % 8 == 0) {
        uint64_t keys[2] = {1 + rnd() % 6, 1 + rnd() % 6};
        int64_t got = fp_ctx_retire_code(s->ctx, keys, 1 + (uint32_t)(rnd() % 2));
        CHECK(got >= 0 && (uint64_t)got <= nfr);
        n_retired += (uint64_t)got;
        struct fp_stack st;
        CHECK(!nst || fp_stack(s->ctx, nst - 1, &st) == 0);
    }
}

/* Side-band record applied (NativeStep._apply / _dropped / forget_all). */
static void apply_side_band(struct step *s, const struct fp_rec *r)
{
    switch (rnd() % 5) {
    case 0: /* COMM */
        fp_forget_comms(s->ctx);
        fp_forget_space(s->ctx, r->pid);
        break;
    case 1: /* LOST */
        fp_forget_all_spaces(s->ctx);
        break;
    case 2: /* a drop */
        fp_forget_space(s->ctx, s->absurd ? absurd_pid() : r->pid);
        fp_forget_comms(s->ctx);
        break;
    default: /* MMAP/FORK/EXIT...: its pid */
        fp_forget_space(s->ctx, r->pid);
        break;
    }
}

/* Mutate record headers and sample fields in place: walk the records of b[0, L) and hit a few
 * with another type (kernel types, perf's synthesized ones incl. AUXTRACE/TRACING_DATA/
 * FINISHED_ROUND, > 255), size or misc, or an absurd u64 in the body (pid/tid, time, cpu,
 * callchain nr, regs abi, stack sizes...). */
static void mutate_headers(uint8_t *b, uint32_t L, uint32_t every)
{
    static const uint32_t types[] = {1, 2, 3, 4, 9, 10, 14, 15, 16, 19, 64, 66, 67, 68, 71, 72,
                                     81, 255, 256, 0x10009, 0xFFFFFFFF};
    static const uint64_t vals[] = {0, 1, 2, 7, 8, 0x7FFFFFFF, 0xFFFFFFFF, 0x100000000ull,
                                    0xFFFFFFFFFFFFFFFFull, 0x8000000000000000ull, 0xFFF0, 0x10000};
    uint32_t pos = 0;
    while (L - pos >= 8) {
        uint16_t size;
        memcpy(&size, b + pos + 6, 2);
        if (size < 8 || size > L - pos)
            break;
        if (rnd() % every == 0) {
            uint32_t what = (uint32_t)(rnd() % 6);
            if (what == 0) {
                uint32_t t = types[rnd() % (sizeof types / sizeof *types)];
                memcpy(b + pos, &t, 4);
            } else if (what == 1) {
                uint16_t ns = (uint16_t)(rnd() % 3 ? (uint64_t)size + rnd() % 33 - 16 : rnd());
                memcpy(b + pos + 6, &ns, 2);
            } else if (what == 2) {
                uint16_t m = (uint16_t)rnd();
                memcpy(b + pos + 4, &m, 2);
            } else if (size >= 16) {
                uint32_t slot = (uint32_t)(what == 3 ? rnd() % 6 : rnd() % ((size - 8u) / 8));
                uint64_t v = vals[rnd() % (sizeof vals / sizeof *vals)];
                if (8 + 8 * slot + 8 <= size)
                    memcpy(b + pos + 8 + 8 * slot, &v, 8);
            }
        }
        pos += size;
    }
}

/* One NativeStep._round over chunks (ch[0, nch)); flush: the final flush_all round. Returns
 * 0, or 1 when the step would raise (a record type > 255: a new stream starts). */
static int round_(struct step *s, struct chunk *ch, uint32_t nch, int flush)
{
    if (fp_nstacks(s->ctx) > s->max_stacks || s->nsnaps > s->max_spaces)
        new_ctx(s);
    if (rnd() % 8 == 0) { /* live.due() rescanned: forget all */
        fp_forget_all_spaces(s->ctx);
        fp_forget_comms(s->ctx);
    }
    if (s->absurd) { /* absurd pids and table growth outside the data */
        int m = (int)(rnd() % 40);
        for (int i = 0; i < m; i++) {
            uint32_t pid = absurd_pid();
            switch (rnd() % 4) {
            case 0:
                set_space(s, pid);
                break;
            case 1:
                CHECK(fp_set_comm(s->ctx, pid, absurd_pid(), 0) == 0);
                break;
            case 2:
                fp_forget_space(s->ctx, pid);
                break;
            default:
                if (rnd() % 8 == 0)
                    fp_forget_all_spaces(s->ctx);
                break;
            }
        }
    }
    uint32_t nparts = nch + 1;
    uint64_t *bounds = xmalloc((nparts + 1) * sizeof *bounds);
    bounds[0] = 0;
    bounds[1] = s->carry_len;
    for (uint32_t i = 0; i < nch; i++)
        bounds[i + 2] = bounds[i + 1] + ch[i].len;
    uint64_t len = bounds[nparts];
    uint8_t *buf = xmalloc(len);
    if (s->carry_len)
        memcpy(buf, s->carry, s->carry_len);
    for (uint32_t i = 0; i < nch; i++)
        if (ch[i].len)
            memcpy(buf + bounds[i + 1], ch[i].data, ch[i].len);
    /* fp_live_round's arrays, made before the index as the step's are (sized by earlier
     * rounds): room for every record the buffer can hold, or for a few (the round then runs
     * apart, after they grow); the carry arena as large as the round, or not */
    uint64_t capn = rnd() % 2 ? len / 8 + 1 : 1 + rnd() % 8;
    uint32_t *perm = xmalloc(capn * sizeof *perm), *keep = xmalloc(capn * sizeof *keep);
    uint64_t *late = xmalloc(capn * 8);
    uint8_t *is_sample = xmalloc(capn);
    uint64_t *ctime = xmalloc(capn * 8), *cperiod = xmalloc(capn * 8);
    uint32_t *cpid = xmalloc(capn * 4), *ctid = xmalloc(capn * 4), *ccpu = xmalloc(capn * 4);
    uint64_t *bpid = xmalloc(2 * capn * 8), *bcpu = xmalloc(2 * capn * 8); /* (value, count) */
    uint64_t cap = rnd() % 2 ? len : rnd() % (len + 1);
    uint8_t *carry = xmalloc(cap);
    struct fp_live_round lr = {
        .perm = perm, .keep = keep, .late_ns = late, .is_sample = is_sample, .time = ctime,
        .period = cperiod, .pid = cpid, .tid = ctid, .cpu = ccpu, .by_pid = bpid, .by_cpu = bcpu,
        .carry = carry, .carry_cap = cap, .cap = capn,
    };
    /* -- index: alone, or with the round when it is samples only (fp_live_index_round) */
    struct fp_rec *recs = NULL;
    uint64_t n = UINT64_MAX, other = UINT64_MAX, stop = 0;
    int *ends = xmalloc(nparts * sizeof *ends);
    int rc = 2;
    if (rnd() % 2) {
        rc = fp_live_index_round(s->lay, buf, bounds, nparts, &recs, &n, &other, ends, &stop,
                                 s->o, s->ncarry, flush, &lr);
        CHECK(rc == 0 || rc == 1 || rc == 2);
        CHECK((rc == 2) == (other || stop != UINT64_MAX || n > capn));
        if (rc != 2)
            n_fused++;
    } else {
        CHECK(fp_live_index(s->lay, buf, bounds, nparts, &recs, &n, &other, ends, &stop) == 0);
    }
    CHECK(recs && other <= n);
    for (uint32_t i = 0; i < nparts; i++)
        CHECK(ends[i] >= FP_END_OK && ends[i] <= FP_END_PAYLOAD_TRUNCATED);
    for (uint64_t i = 0; i < n; i++)
        CHECK(recs[i].off < len && recs[i].size >= 8 && recs[i].size <= len - recs[i].off);
    if (stop != UINT64_MAX) { /* RuntimeError in the step */
        CHECK(stop < len);
        free(perm), free(keep), free(late), free(is_sample), free(ctime), free(cperiod);
        free(cpid), free(ctid), free(ccpu), free(bpid), free(bcpu), free(carry);
        unw_free(recs);
        free(ends);
        free(buf);
        free(bounds);
        return 1;
    }
    /* the carry re-indexes to the records it was made of */
    CHECK(n >= s->ncarry && ends[0] == FP_END_OK);
    for (uint64_t i = 0; i < s->ncarry; i++)
        CHECK(recs[i].off < s->carry_len);
    /* -- side-band records: what Python sets (carried ones keep theirs) */
    uint32_t *idx = xmalloc(n * sizeof *idx);
    uint64_t no = fp_select_other(recs, n, idx);
    CHECK(no == other);
    uint64_t new_other = 0;
    for (uint64_t j = 0; j < no; j++) {
        uint32_t i = idx[j];
        CHECK(!(recs[i].flags & FP_SAMPLE) && (j == 0 || idx[j - 1] < i));
        uint8_t fl;
        uint64_t t;
        uint32_t cpu;
        if (i < s->ncarry) {
            CHECK(s->cvalid[i]);
            fl = s->cflags[i];
            t = s->ctime[i];
            cpu = s->ccpu[i];
        } else {
            new_other++;
            fl = (uint8_t)(rnd() % 4);
            t = s->record_time + (rnd() % 3 ? rnd() % 4000000 : rnd() % 2 ? 0 : rnd());
            cpu = (uint32_t)(rnd() % 3 ? rnd() % 64 : rnd());
        }
        if (fl & FP_TIMED)
            recs[i].time = t;
        if (fl & FP_HAS_CPU)
            recs[i].cpu = cpu;
        recs[i].flags = fl;
    }
    uint64_t nsamples = n - s->ncarry - new_other;
    /* -- fp_live_round (_order): the new samples counted by pid and cpu, the round ordered, its
     * columns, the carry copied when it fits (the carry arena: as large as the round, or not) */
    uint64_t m = n ? n : 1;
    if (rc == 2) { /* side-band records marked first, or the arrays grown first (_grow) */
        if (n > capn) {
            free(perm), free(keep), free(late), free(is_sample), free(ctime), free(cperiod);
            free(cpid), free(ctid), free(ccpu), free(bpid), free(bcpu);
            perm = xmalloc(m * sizeof *perm), keep = xmalloc(m * sizeof *keep);
            late = xmalloc(m * 8), is_sample = xmalloc(m);
            ctime = xmalloc(m * 8), cperiod = xmalloc(m * 8);
            cpid = xmalloc(m * 4), ctid = xmalloc(m * 4), ccpu = xmalloc(m * 4);
            bpid = xmalloc(2 * m * 8), bcpu = xmalloc(2 * m * 8);
            lr.perm = perm, lr.keep = keep, lr.late_ns = late, lr.is_sample = is_sample;
            lr.time = ctime, lr.period = cperiod, lr.pid = cpid, lr.tid = ctid, lr.cpu = ccpu;
            lr.by_pid = bpid, lr.by_cpu = bcpu, lr.cap = m;
        }
        rc = fp_live_round(s->o, buf, len, recs, s->ncarry, n, flush, &lr);
    }
    CHECK(rc == 0 || rc == 1);
    CHECK(lr.nsamples == nsamples && lr.npids <= nsamples && lr.ncpus <= nsamples);
    {
        /* each distinct pid / cpu once, first-seen order, with its count; busy: pid != 0 */
        uint64_t tp = 0, tc = 0, busy = 0;
        for (uint64_t j = 0; j < lr.npids; j++) {
            tp += bpid[2 * j + 1];
            busy += bpid[2 * j] ? bpid[2 * j + 1] : 0;
        }
        for (uint64_t j = 0; j < lr.ncpus; j++)
            tc += bcpu[2 * j + 1];
        CHECK(tp == nsamples && tc == nsamples && busy == lr.busy);
        if (lr.npids + lr.ncpus <= 64) {
            uint64_t jp = 0, jc = 0;
            for (uint64_t i = s->ncarry; i < n; i++) {
                if (!(recs[i].flags & FP_SAMPLE))
                    continue;
                uint64_t j = 0;
                while (j < lr.npids && bpid[2 * j] != recs[i].pid)
                    j++;
                CHECK(j < lr.npids && j <= jp); /* seen, and not before its first sample */
                jp += j == jp;
                for (j = 0; j < lr.ncpus && bcpu[2 * j] != recs[i].cpu;)
                    j++;
                CHECK(j < lr.ncpus && j <= jc);
                jc += j == jc;
            }
            CHECK(jp == lr.npids && jc == lr.ncpus);
            for (uint64_t j = 0; j < lr.npids; j++) {
                uint64_t c = 0;
                for (uint64_t i = s->ncarry; i < n; i++)
                    c += (recs[i].flags & FP_SAMPLE) && recs[i].pid == bpid[2 * j];
                CHECK(c == bpid[2 * j + 1]);
            }
            for (uint64_t j = 0; j < lr.ncpus; j++) {
                uint64_t c = 0;
                for (uint64_t i = s->ncarry; i < n; i++)
                    c += (recs[i].flags & FP_SAMPLE) && recs[i].cpu == bcpu[2 * j];
                CHECK(c == bcpu[2 * j + 1]);
            }
        }
    }
    s->samples_new += nsamples;
    uint64_t nout = lr.nout, nlate = lr.nlate, nkeep = lr.nkeep;
    struct fp_order_stats ost = lr.st;
    CHECK(nout + nkeep <= n && nlate == ost.late && ost.delivered == nout);
    CHECK(ost.queued == nkeep && fp_live_order_queued(s->o) == nkeep && (!flush || !nkeep));
    n_rounds++;
    n_carried += s->ncarry;
    n_forced += ost.forced_flushes;
    n_late += ost.late;
    CHECK(ost.pushed == n - s->ncarry && nout + nkeep == n); /* no markers left */
    {
        /* every record delivered or kept at most once, markers never */
        uint8_t *seen = xcalloc(m, 1);
        for (uint64_t k = 0; k < nout; k++) {
            CHECK(perm[k] < n && !seen[perm[k]] && !(recs[perm[k]].flags & FP_MARKER));
            seen[perm[k]] = 1;
        }
        for (uint64_t k = 0; k < nkeep; k++) {
            CHECK(keep[k] < n && !seen[keep[k]]);
            seen[keep[k]] = 1;
        }
        free(seen);
    }
    uint64_t d = nout;
    for (uint64_t k = 0; k < d; k++) { /* fp_columns' */
        const struct fp_rec *r = &recs[perm[k]];
        CHECK(is_sample[k] == !!(r->flags & FP_SAMPLE) && ctime[k] == r->time &&
              cperiod[k] == r->period && cpid[k] == r->pid && ctid[k] == r->tid &&
              ccpu[k] == r->cpu);
    }
    uint32_t *stack_ids = xcalloc(m, sizeof *stack_ids);
    /* the carry: the kept records back to back, in keep order */
    uint64_t size = fp_live_gather(buf, recs, keep, nkeep, NULL);
    CHECK(lr.carry_len == size && (rc == 1) == (size > cap));
    if (rc == 1) { /* _carry_round: room made, copied then */
        free(carry);
        carry = xmalloc(size);
        CHECK(fp_live_gather(buf, recs, keep, nkeep, carry) == size);
    }
    {
        uint64_t w = 0;
        for (uint64_t j = 0; j < nkeep; j++) {
            const struct fp_rec *r = &recs[keep[j]];
            CHECK(memcmp(carry + w, buf + r->off, r->size) == 0);
            w += r->size;
        }
        CHECK(w == size);
    }
    /* -- runs of samples between side-band records, in delivered order */
    uint64_t pos = 0;
    while (pos < d) {
        uint64_t e = pos;
        while (e < d && is_sample[e])
            e++;
        if (e > pos) {
            run(s, buf, len, recs, perm, pos, e, stack_ids);
            name_new(s);
        }
        if (e >= d)
            break;
        apply_side_band(s, &recs[perm[e]]);
        pos = e + 1;
    }
    uint8_t *cfl = xmalloc(nkeep ? nkeep : 1), *cva = xcalloc(nkeep ? nkeep : 1, 1);
    uint64_t *ct = xmalloc((nkeep ? nkeep : 1) * 8);
    uint32_t *cc = xmalloc((nkeep ? nkeep : 1) * 4);
    for (uint64_t j = 0; j < nkeep; j++) {
        const struct fp_rec *r = &recs[keep[j]];
        if (!(r->flags & FP_SAMPLE)) {
            cva[j] = 1;
            cfl[j] = r->flags;
            ct[j] = r->time;
            cc[j] = r->cpu;
        }
    }
    free(s->carry), free(s->cflags), free(s->ctime), free(s->ccpu), free(s->cvalid);
    s->carry = carry, s->carry_len = size, s->ncarry = nkeep;
    s->cflags = cfl, s->ctime = ct, s->ccpu = cc, s->cvalid = cva;
    /* -- aggregate */
    if (d) {
        uint64_t want = 0;
        for (uint64_t k = 0; k < d; k++)
            want += is_sample[k] && stack_ids[k] != HELD;
        uint64_t added = fp_live_groups_add(s->acc, is_sample, stack_ids, ctime, cpid, ctid, d);
        CHECK(added == want);
        s->samples_added += added;
    }
    if (flush || rnd() % 3 == 0)
        take_groups(s);
    free(is_sample), free(ctime), free(cperiod), free(cpid), free(ctid), free(ccpu);
    free(bpid), free(bcpu);
    free(stack_ids);
    free(perm), free(keep), free(late), free(idx);
    unw_free(recs);
    free(ends);
    free(buf);
    free(bounds);
    return 0;
}

static void step_init(struct step *s, const struct fp_layout *lay, int absurd)
{
    memset(s, 0, sizeof *s);
    s->lay = lay;
    s->absurd = absurd;
    CHECK(fp_live_order_new(0) == NULL);
    s->o = fp_live_order_new((rnd() % 3) ? 1 + rnd() % 64 : 1 << 20);
    CHECK(s->o);
    s->max_stacks = (rnd() % 2) ? 1 + (uint32_t)(rnd() % 50) : 1u << 16;
    s->max_spaces = (rnd() % 2) ? 1 + (uint32_t)(rnd() % 8) : 4096;
    CHECK(fp_live_groups_new(0) == NULL);
    uint64_t bucket = (rnd() % 4) ? 100000000 : 1 + rnd() % (rnd() % 2 ? 1000 : UINT64_MAX - 1);
    s->acc = fp_live_groups_new(bucket);
    CHECK(s->acc);
    new_ctx(s);
}

static void step_free(struct step *s)
{
    take_groups(s);
    fp_live_groups_free(s->acc);
    fp_live_order_free(s->o);
    fp_ctx_free(s->ctx);
    free_snaps(s);
    free(s->carry), free(s->cflags), free(s->ctime), free(s->ccpu), free(s->cvalid);
    memset(s, 0, sizeof *s);
}

/* Replay drains (mutated copies when mutate) through fresh NativeSteps. */
static void stream(const struct fp_layout *lay, const struct drain *dr, uint32_t ndr, int mutate)
{
    struct step s;
    step_init(&s, lay, mutate && rnd() % 2);
    uint32_t i = 0;
    while (i < ndr) {
        uint32_t take = mutate ? 1 + (uint32_t)(rnd() % 3) : 1 + (uint32_t)(i % 2);
        if (take > ndr - i)
            take = ndr - i;
        uint32_t nch = 0;
        for (uint32_t j = 0; j < take; j++)
            nch += dr[i + j].n;
        if (mutate && rnd() % 8 == 0)
            nch = 0; /* an empty pass */
        struct chunk *ch = xmalloc((nch ? nch : 1) * sizeof *ch);
        uint32_t w = 0;
        for (uint32_t j = 0; j < take && w < nch; j++)
            for (uint32_t q = 0; q < dr[i + j].n; q++) {
                struct chunk c = dr[i + j].c[q];
                if (mutate) {
                    uint32_t L = c.len;
                    if (rnd() % 4 == 0)
                        L = L ? (uint32_t)(rnd() % (L + 1)) : 0;
                    uint8_t *b = xmalloc(L);
                    if (L)
                        memcpy(b, c.data, L);
                    int muts = (rnd() % 2) ? 0 : (int)(rnd() % 12);
                    for (int u = 0; u < muts && L; u++)
                        b[rnd() % L] = (uint8_t)rnd();
                    if (rnd() % 2)
                        mutate_headers(b, L, 1 + (uint32_t)(rnd() % 64));
                    c.len = L;
                    c.data = b;
                }
                ch[w++] = c;
            }
        int raised = round_(&s, ch, w, 0);
        if (mutate)
            for (uint32_t j = 0; j < w; j++)
                free(ch[j].data);
        free(ch);
        if (raised) {
            n_raised++; /* the profiler stops; a new one starts from the next drain */
            step_free(&s);
            step_init(&s, lay, mutate && rnd() % 2);
        }
        i += (mutate && rnd() % 16 == 0) ? 0 : take; /* sometimes a drain comes twice */
    }
    CHECK(round_(&s, NULL, 0, 1) == 0); /* close(): the flush round */
    CHECK(s.ncarry == 0 && s.carry_len == 0 && fp_live_order_queued(s.o) == 0);
    if (!mutate) {
        CHECK(s.samples_new > 100 && s.samples_grouped + s.samples_held == s.samples_new);
        printf("real: %llu samples, %llu unwound, %llu held\n",
               (unsigned long long)s.samples_new, (unsigned long long)s.samples_grouped,
               (unsigned long long)s.samples_held);
    }
    step_free(&s);
}

int main(int argc, char **argv)
{
    if (argc != 17)
        return 2;
    FILE *f = fopen(argv[1], "rb");
    if (!f)
        return 2;
    struct drain *dr = NULL;
    uint32_t ndr = 0, cap = 0, nc;
    while (fread(&nc, 4, 1, f) == 1) {
        if (ndr == cap) {
            cap = cap ? 2 * cap : 64;
            dr = realloc(dr, cap * sizeof *dr);
            CHECK(dr);
        }
        struct drain *d = &dr[ndr++];
        d->n = nc;
        d->c = xmalloc((nc ? nc : 1) * sizeof *d->c);
        for (uint32_t i = 0; i < nc; i++) {
            uint32_t hdr[2];
            CHECK(fread(hdr, 4, 2, f) == 2);
            d->c[i].cpu = hdr[0];
            d->c[i].len = hdr[1];
            d->c[i].data = xmalloc(hdr[1]);
            CHECK(fread(d->c[i].data, 1, hdr[1], f) == hdr[1]);
        }
    }
    fclose(f);
    CHECK(ndr > 0);
    struct fp_layout lay;
    memset(&lay, 0, sizeof lay);
    lay.sample_type = strtoull(argv[2], NULL, 0);
    lay.regs_mask = strtoull(argv[3], NULL, 0);
    lay.nprefix = (uint32_t)strtoul(argv[4], NULL, 0);
    lay.i_ip = (int32_t)strtol(argv[5], NULL, 0);
    lay.i_tid = (int32_t)strtol(argv[6], NULL, 0);
    lay.i_time = (int32_t)strtol(argv[7], NULL, 0);
    lay.i_cpu = (int32_t)strtol(argv[8], NULL, 0);
    lay.i_period = (int32_t)strtol(argv[9], NULL, 0);
    lay.read_group = (uint32_t)strtoul(argv[10], NULL, 0);
    lay.read_times = (uint32_t)strtoul(argv[11], NULL, 0);
    lay.read_per_value = (uint32_t)strtoul(argv[12], NULL, 0);
    lay.branch_hw_index = (uint32_t)strtoul(argv[13], NULL, 0);
    lay.branch_counters = (uint32_t)strtoul(argv[14], NULL, 0);
    lay.nregs = (uint32_t)strtoul(argv[15], NULL, 0);
    int iters = atoi(argv[16]);
    stream(&lay, dr, ndr, 0); /* the real capture, whole */
    for (int it = 0; it < iters; it++) {
        /* a random window of the capture, mutated */
        uint32_t a = (uint32_t)(rnd() % ndr), b = a + 1 + (uint32_t)(rnd() % (ndr - a));
        stream(&lay, dr + a, b - a, 1);
    }
    for (uint32_t i = 0; i < ndr; i++) {
        for (uint32_t j = 0; j < dr[i].n; j++)
            free(dr[i].c[j].data);
        free(dr[i].c);
    }
    free(dr);
    printf("rounds %llu, need_place %llu (held %llu), need_comm %llu, carried records %llu, "
           "forced flushes %llu, late %llu, contexts %llu, raised %llu, retired frames %llu, "
           "index+round %llu\n",
           n_rounds, n_place, n_held, n_comm, n_carried, n_forced, n_late, n_ctx, n_raised,
           n_retired, n_fused);
    printf("ok %llu\n", checks);
    return 0;
}
