/* fp_fuzz.c: the native replay path (cffi_build/fastpath.h: index.c, order.c, stacks.c,
 * parallel.c, context.c) under ASan/UBSan and TSan (tests/differential/test_filereplay.py).
 *
 * usage: fp_fuzz DATA sample_type regs_mask nprefix i_tid i_time i_cpu i_period nregs ITERS
 *        [i_ip] (default -1: the samples' ip is read only without user registers)
 *
 * DATA is a real perf.data data section. Each iteration copies a truncated and byte-mutated
 * version into a buffer malloc'd at its exact size (so any over-read is reported), then runs
 * the whole native replay on it: fp_index, fp_order (with a small queue cap, so forced flushes
 * happen), fp_unwind_run over every run of samples (answering NEED_SPACE with frame-pointer
 * only modules and NEED_COMM with an id), by address space or by code (fp_ctx_by_code), and
 * reads back every unique stack and frame, one by one and in bulk (fp_stacks_export, which must
 * agree). Every replay runs twice, on one thread and with the parallel unwind (fp_ctx_par, any
 * prefix length): the stops, ids, stacks, frames and pairs must be the same. Built with small
 * PAR_BLOCK / PAR_NBLOCKS / PAR_SEG (test_filereplay.py), so the ring wraps and segments end
 * inside runs; under ThreadSanitizer too. By code, the stacks are also folded (fold.c) with
 * random name ranks and rendered through random small buffers: the lines must be distinct,
 * sorted by their rank sequences, and their counts must add up to the samples. Prints "ok N".
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "unwcore_int.h"
#include "fastpath.h"

#define HARNESS_SEED 88172645463325252ull
#include "harness.h"

static uint64_t sym_asks; /* FP_RUN_NEED_SYMS answered (by function) */
static uint64_t fold_lines; /* folded lines rendered (fold.c) */

static int cmp_u64(const void *x, const void *y)
{
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return a < b ? -1 : a > b;
}

/* fold.c on context c (by code): names are the ranks themselves spelled in base 26 ("a",
 * "b", .., "ba", ..: one letter more per 26x), so a line can be parsed back to its ranks; the
 * ranks of comms, frames and kernel ips are drawn at random (so distinct stacks can share
 * names and merge). Checks the errors for an unranked frame and a bad rank too. */
static void fold_check(struct fp_ctx *c, uint64_t samples)
{
    uint32_t nst = fp_nstacks(c), nfr = fp_nframes(c), ncomm = 1;
    uint64_t nk = 0, capk = 16;
    uint64_t *kips = malloc(capk * 8);
    int any_user = 0;
    CHECK(kips);
    for (uint32_t i = 0; i < nst; i++) {
        struct fp_stack s;
        CHECK(fp_stack(c, i, &s) == 0);
        if (s.comm_id >= ncomm)
            ncomm = s.comm_id + 1;
        uint64_t nk0 = nk;
        int in_k = 0;
        for (uint32_t j = 0; j < s.nkc; j++) {
            uint64_t v = s.kc[j];
            if (v >= (uint64_t)-4095) {
                in_k = v == (uint64_t)-128;
            } else if (in_k) {
                if (nk == capk) {
                    capk *= 2;
                    kips = realloc(kips, capk * 8);
                    CHECK(kips);
                }
                kips[nk++] = v;
            }
        }
        if (s.npcs && !(s.regs_none && nk > nk0)) /* kernel_only: no user frames */
            any_user = 1;
    }
    qsort(kips, nk, 8, cmp_u64);
    uint64_t nd = 0;
    for (uint64_t i = 0; i < nk; i++)
        if (!nd || kips[nd - 1] != kips[i])
            kips[nd++] = kips[i];
    /* fp_kernel_ips: the room it needs when short of it, then the same distinct ips */
    uint64_t *kx = malloc(8 * (nk + 1));
    CHECK(kx);
    CHECK(nk == 0 || fp_kernel_ips(c, kx, nk - 1) == nk);
    CHECK(fp_kernel_ips(c, kx, nk) == nd && !memcmp(kx, kips, 8 * nd));
    free(kx);
    /* fp_fold_stats and fp_stacks_unsym against the same counts taken here */
    uint64_t by[FP_FOLD_NSTATUS], uf, kf, want_by[FP_FOLD_NSTATUS] = {0}, want_uf = 0, want_kf = 0;
    uint32_t first[FP_FOLD_NSTATUS], want_first[FP_FOLD_NSTATUS];
    uint8_t *flag = malloc((size_t)nfr + 1);
    uint32_t *nun = malloc(4 * ((size_t)nst + 1));
    CHECK(flag && nun);
    for (uint32_t i = 0; i < nfr; i++)
        flag[i] = (uint8_t)(rnd() % 3 == 0);
    for (int k = 0; k < FP_FOLD_NSTATUS; k++)
        want_first[k] = UINT32_MAX;
    uint32_t from = nst ? (uint32_t)(rnd() % nst) : 0;
    fp_stacks_unsym(c, from, nst, flag, nfr, nun);
    for (uint32_t i = 0; i < nst; i++) {
        struct fp_stack s;
        CHECK(fp_stack(c, i, &s) == 0);
        uint64_t k = 0;
        int in_k = 0;
        for (uint32_t j = 0; j < s.nkc; j++) {
            if (s.kc[j] >= (uint64_t)-4095)
                in_k = s.kc[j] == (uint64_t)-128;
            else
                k += in_k;
        }
        int konly = s.regs_none && k;
        uint32_t nu = konly ? 0 : s.npcs, st = konly ? FP_FOLD_NSTATUS - 1 : s.status, u = 0;
        for (uint32_t j = 0; j < nu; j++)
            u += flag[s.fids[j]];
        if (i >= from)
            CHECK(nun[i - from] == u);
        want_by[st] += s.count;
        if (want_first[st] == UINT32_MAX)
            want_first[st] = i;
        want_uf += nu * s.count;
        want_kf += k * s.count;
    }
    CHECK(fp_fold_stats(c, by, first, &uf, &kf) == 0);
    CHECK(!memcmp(by, want_by, sizeof by) && !memcmp(first, want_first, sizeof first));
    CHECK(uf == want_uf && kf == want_kf);
    free(flag), free(nun);
    uint32_t nnames = 1 + (uint32_t)(rnd() % 40);
    uint32_t *cr = malloc(4 * (size_t)ncomm), *fr = malloc(4 * ((size_t)nfr + 1));
    uint32_t *kr = malloc(4 * (nd + 1));
    CHECK(cr && fr && kr);
    for (uint32_t i = 0; i < ncomm; i++)
        cr[i] = (uint32_t)(rnd() % nnames);
    for (uint32_t i = 0; i < nfr; i++)
        fr[i] = (uint32_t)(rnd() % nnames);
    for (uint64_t i = 0; i < nd; i++)
        kr[i] = (uint32_t)(rnd() % nnames);
    char *names = malloc(8 * (size_t)nnames);
    uint64_t *off = malloc(8 * ((size_t)nnames + 1));
    CHECK(names && off);
    off[0] = 0;
    for (uint32_t r = 0; r < nnames; r++) {
        char t[8];
        int n = 0;
        uint32_t v = r;
        do {
            t[n++] = (char)('a' + v % 26);
            v /= 26;
        } while (v);
        for (int i = 0; i < n; i++)
            names[off[r] + (uint64_t)i] = t[n - 1 - i];
        off[r + 1] = off[r] + (uint64_t)n;
    }
    struct fp_fold *f;
    /* a frame without a rank (none is ranked): refused iff a stack names a user frame */
    int rc = fp_fold_new(c, cr, ncomm, fr, 0, kips, kr, nd, &f);
    CHECK(rc == (any_user ? -2 : 0));
    if (!rc)
        fp_fold_free(f);
    /* a kernel ip without a rank (none is ranked): refused iff a stack has kernel frames */
    rc = fp_fold_new(c, cr, ncomm, fr, nfr, kips, kr, 0, &f);
    CHECK(rc == (nd ? -2 : 0));
    if (!rc)
        fp_fold_free(f);
    CHECK(fp_fold_new(c, cr, ncomm, fr, nfr, kips, kr, nd, &f) == 0 && f);
    uint64_t lines = fp_fold_lines(f);
    CHECK(lines <= nst && (nst == 0) == (lines == 0));
    uint64_t cap = 1 + rnd() % 200, total = 0, got = 0;
    uint8_t *buf = malloc(cap);
    CHECK(buf);
    uint32_t prev[8192], cur[8192];
    uint32_t nprev = 0;
    int have_prev = 0;
    for (;;) {
        int64_t w = fp_fold_text(f, (const uint8_t *)names, off, nnames, buf, cap);
        if (w == 0)
            break;
        CHECK(w != INT64_MIN);
        if (w < 0) { /* one line needs more room: exactly what it asked for is enough */
            cap = (uint64_t)-w;
            buf = realloc(buf, cap);
            CHECK(buf);
            continue;
        }
        CHECK((uint64_t)w <= cap && buf[w - 1] == '\n');
        uint64_t i = 0;
        while (i < (uint64_t)w) { /* each line: names joined by ';', ' ', count, '\n' */
            uint32_t n = 0;
            for (;;) {
                uint32_t v = 0;
                CHECK(buf[i] >= 'a' && buf[i] <= 'z');
                while (buf[i] >= 'a' && buf[i] <= 'z')
                    v = v * 26 + (uint32_t)(buf[i++] - 'a');
                CHECK(n < 8192);
                cur[n++] = v;
                if (buf[i] != ';')
                    break;
                i++;
            }
            CHECK(buf[i++] == ' ');
            uint64_t cnt = 0;
            while (buf[i] >= '0' && buf[i] <= '9')
                cnt = cnt * 10 + (uint64_t)(buf[i++] - '0');
            CHECK(buf[i++] == '\n' && cnt >= 1);
            total += cnt;
            got++;
            if (have_prev) { /* strictly after the previous line (a prefix sorts first) */
                uint32_t m = n < nprev ? n : nprev, j = 0;
                while (j < m && cur[j] == prev[j])
                    j++;
                CHECK(j < m ? cur[j] > prev[j] : n > nprev);
            }
            memcpy(prev, cur, 4 * (size_t)n);
            nprev = n;
            have_prev = 1;
        }
    }
    CHECK(fp_fold_text(f, (const uint8_t *)names, off, nnames, buf, cap) == 0);
    CHECK(got == lines && total == samples);
    fold_lines += got;
    fp_fold_free(f);
    if (nst) { /* a rank past the names (every line starts with its comm's): refused */
        for (uint32_t i = 0; i < ncomm; i++)
            cr[i] = nnames;
        CHECK(fp_fold_new(c, cr, ncomm, fr, nfr, kips, kr, nd, &f) == 0);
        CHECK(fp_fold_text(f, (const uint8_t *)names, off, nnames, buf, cap) == INT64_MIN);
        fp_fold_free(f);
    }
    free(buf), free(names), free(off), free(cr), free(fr), free(kr), free(kips);
}
static uint64_t worker_samples; /* unwound by the parallel unwind's worker thread */

struct triple {
    uint64_t a, b; /* space << 32 | stack, pcs hash */
};

static int cmp_triple(const void *x, const void *y)
{
    const struct triple *p = x, *q = y;
    if (p->a != q->a)
        return p->a < q->a ? -1 : 1;
    return p->b < q->b ? -1 : p->b > q->b;
}

/* Every run of samples of perm[0, nout) through fp_unwind_run on a new context, answering
 * its stops from the shared fixtures (the same rnd() draws for the same stops); ids gets each
 * sample's stack id. */
struct fixtures {
    uint32_t max_depth;
    int by_code;
    uint64_t starts[2][8], ends[2][8], nsyms[2];
    struct unw_module mods[2];
};

static struct fp_ctx *run_all(const struct fixtures *fx, uint32_t par_min, int stress,
                              const struct fp_layout *lay, const uint8_t *buf, uint64_t len,
                              const struct fp_rec *recs, const uint32_t *perm, uint64_t nout,
                              uint32_t *ids)
{
    struct fp_ctx *c = fp_ctx_new(UNW_ARCH_X86_64, fx->max_depth);
    CHECK(c);
    CHECK(fp_ctx_by_code(c, fx->by_code) == 0);
    CHECK(fp_ctx_par(c, par_min) == 0);
    if (stress)
        CHECK(fp_ctx_par_stress(c, 1) == 0);
    memset(ids, 0xff, (nout ? nout : 1) * sizeof *ids);
    uint64_t k = 0;
    while (k < nout) {
        uint64_t b = k;
        while (b < nout && (recs[perm[b]].flags & FP_SAMPLE))
            b++;
        uint64_t at = k;
        while (at < b) {
            uint64_t stopped;
            uint32_t pid, tid;
            int rc = fp_unwind_run(c, lay, buf, len, recs, perm, at, b, ids, &stopped, &pid, &tid);
            CHECK(rc != FP_RUN_ERROR && stopped >= at && stopped <= b);
            if (rc == FP_RUN_DONE)
                break;
            if (rc == FP_RUN_NEED_SPACE) {
                CHECK(fp_set_space(c, pid, fx->mods, rnd() % 3, (uint32_t)(rnd() % 5)) == 0);
            } else if (rc == FP_RUN_NEED_SYMS) {
                CHECK(fx->by_code == 2 && tid < 2);
                sym_asks++;
                uint64_t key = fx->mods[tid].key, m = key - 1;
                CHECK(fp_set_symbols(c, key, fx->starts[m], fx->ends[m], fx->nsyms[m]) == 0);
                CHECK(fp_set_symbols(c, key, fx->starts[m], fx->ends[m], fx->nsyms[m]) == -1);
            } else
                CHECK(fp_set_comm(c, pid, tid, (uint32_t)(rnd() % 3)) == 0);
            at = stopped;
        }
        if (b < nout && rnd() % 2)
            fp_forget_space(c, recs[perm[b]].pid);
        if (rnd() % 5 == 0)
            fp_forget_comms(c);
        k = b + 1;
    }
    return c;
}

/* The contexts a (one thread) and b (parallel unwind) hold the same stacks, frames, counts
 * and pairs, in the same order. */
static void same_results(const struct fp_ctx *a, const struct fp_ctx *b)
{
    uint32_t nst = fp_nstacks(a), nfr = fp_nframes(a);
    CHECK(fp_nstacks(b) == nst && fp_nframes(b) == nfr);
    for (uint32_t i = 0; i < nst; i++) {
        struct fp_stack x, y;
        CHECK(fp_stack(a, i, &x) == 0 && fp_stack(b, i, &y) == 0);
        CHECK(x.space_id == y.space_id && x.comm_id == y.comm_id && x.status == y.status);
        CHECK(x.regs_none == y.regs_none && x.npcs == y.npcs && x.nkc == y.nkc);
        CHECK(x.count == y.count && (x.pcs == NULL) == (y.pcs == NULL));
        CHECK(!x.npcs || !memcmp(x.kinds, y.kinds, x.npcs));
        CHECK(!x.npcs || !memcmp(x.fids, y.fids, 4 * (size_t)x.npcs));
        CHECK(!x.npcs || !x.pcs || !memcmp(x.pcs, y.pcs, 8 * (size_t)x.npcs));
        CHECK(!x.nkc || !memcmp(x.kc, y.kc, 8 * (size_t)x.nkc));
    }
    for (uint32_t f = 0; f < nfr; f++) {
        uint32_t s1, s2;
        uint64_t p1, p2;
        uint8_t e1, e2;
        CHECK(fp_frame(a, f, &s1, &p1, &e1) == 0 && fp_frame(b, f, &s2, &p2, &e2) == 0);
        CHECK(s1 == s2 && p1 == p2 && e1 == e2);
    }
    uint32_t ps[2][64], pst[2][64];
    uint64_t ph[2][64], at = 0, got;
    while ((got = fp_pairs(a, at, ps[0], pst[0], ph[0], 64)) > 0) {
        CHECK(fp_pairs(b, at, ps[1], pst[1], ph[1], 64) == got);
        CHECK(!memcmp(ps[0], ps[1], 4 * got) && !memcmp(pst[0], pst[1], 4 * got));
        CHECK(!memcmp(ph[0], ph[1], 8 * got));
        at += got;
    }
    CHECK(fp_pairs(b, at, ps[1], pst[1], ph[1], 64) == 0);
}

static void replay(const struct fp_layout *lay, const uint8_t *buf, uint64_t len)
{
    struct fp_rec *recs;
    uint64_t n, other, stop;
    int end;
    CHECK(fp_index(lay, buf, len, &recs, &n, &other, &end, &stop) == 0);
    CHECK(other <= n && end >= FP_END_OK && end <= FP_END_PAYLOAD_TRUNCATED);
    for (uint64_t i = 0; i < n; i++) {
        CHECK(recs[i].off < len && recs[i].size >= 8 && recs[i].size <= len - recs[i].off);
        if (!(recs[i].flags & FP_SAMPLE) && !(recs[i].flags & FP_MARKER))
            recs[i].flags = (uint8_t)(rnd() % 4); /* what Python sets for side-band records */
    }
    uint32_t *perm = malloc((n ? n : 1) * sizeof *perm);
    uint64_t *late = malloc((n ? n : 1) * sizeof *late);
    uint64_t nout, nlate;
    struct fp_order_stats st;
    CHECK(perm && late);
    CHECK(fp_order(recs, n, 1 + rnd() % 64, perm, &nout, late, &nlate, &st) == 0);
    CHECK(nout <= n && st.delivered == nout && st.queued == 0 && nlate == st.late);
    struct fixtures fx;
    fx.max_depth = 1 + (uint32_t)(rnd() % 64);
    fx.by_code = (int)(rnd() % 3);
    int by_code = fx.by_code;
    /* by function: per module key a random symbol table (sorted starts, duplicates, empty and
     * reversed ranges), set when a run asks for it */
    for (int m = 0; m < 2; m++) {
        fx.nsyms[m] = rnd() % 9;
        uint64_t a = rnd() % 0x1000;
        for (uint64_t i = 0; i < fx.nsyms[m]; i++) {
            a += rnd() % 3 ? rnd() % 0x4000 : 0;
            fx.starts[m][i] = a;
            fx.ends[m][i] = rnd() % 4 ? a + rnd() % 0x3000 : a - rnd() % 2;
        }
    }
    /* two frame-pointer-only modules; by code, their keys decide which frames are shared,
     * unless the second is JIT code (UNW_MOD_JIT: its frames stay per space) */
    struct unw_module mods[2] = {
        {0x400000, 0x400000 + (rnd() % 0x100000), 0x400000, NULL, 1 + rnd() % 2, 0},
        {0x7f0000000000, 0x7f0000000000 + (rnd() % 0x100000), 0x7f0000000000 - 0x1000, NULL,
         1 + rnd() % 2, 0},
    };
    if (rnd() % 3 == 0)
        mods[1].flags = UNW_MOD_JIT;
    if (rnd() % 2) { /* wide: the real samples' pcs (PIE and libraries) fall inside */
        mods[0].end = 0x600000000000;
        mods[1].end = 0x800000000000;
    }
    memcpy(fx.mods, mods, sizeof mods);
    /* The same replay on one thread and with the parallel unwind (any prefix, or from a
     * random length on): the same stops in the same order (so the same rnd() draws answer
     * them), the same ids and the same stacks, frames and pairs. */
    uint32_t par_min = rnd() % 4 ? 1 : 1 + (uint32_t)(rnd() % 40);
    /* half the threaded replays with the worker made to take blocks (and no busy verdicts),
     * the other half as production runs them (verdicts, one-thread stretches) */
    int stress = (int)(rnd() % 2);
    uint32_t *ids = malloc((nout ? nout : 1) * sizeof *ids);
    uint32_t *ids1 = malloc((nout ? nout : 1) * sizeof *ids1);
    CHECK(ids && ids1);
    uint64_t rs0 = rs;
    struct fp_ctx *c1 = run_all(&fx, 0, 0, lay, buf, len, recs, perm, nout, ids1);
    uint64_t rs1 = rs;
    rs = rs0;
    struct fp_ctx *c = run_all(&fx, par_min, stress, lay, buf, len, recs, perm, nout, ids);
    worker_samples += fp_ctx_par_stats(c);
    CHECK(rs == rs1);
    CHECK(!memcmp(ids, ids1, (nout ? nout : 1) * sizeof *ids));
    same_results(c1, c);
    fp_ctx_free(c1);
    free(ids1);
    /* every sample was counted once, in the stack its id names (a resume after a NEED_* stop
     * must not count a sample twice) */
    uint64_t *per = calloc((size_t)fp_nstacks(c) + 1, sizeof *per);
    CHECK(per);
    for (uint64_t k = 0; k < nout; k++) {
        if (!(recs[perm[k]].flags & FP_SAMPLE))
            continue;
        CHECK(ids[k] < fp_nstacks(c));
        per[ids[k]]++;
    }
    for (uint32_t i = 0; i < fp_nstacks(c); i++) {
        struct fp_stack s;
        CHECK(fp_stack(c, i, &s) == 0 && s.count == per[i]);
    }
    free(per);
    uint64_t total = 0;
    uint32_t nst = fp_nstacks(c), nfr = fp_nframes(c);
    for (uint32_t i = 0; i < nst; i++) {
        struct fp_stack s;
        CHECK(fp_stack(c, i, &s) == 0);
        CHECK(s.count >= 1 && s.status <= FP_STATUS_IP_ONLY);
        /* a sample with nothing to unwind: frames from its callchain or ip, all exact, never
         * kernel_only; its ip alone is one frame (user) or one kernel entry */
        CHECK(s.status < FP_STATUS_CALLCHAIN || (!s.regs_none && !(s.npcs && s.kinds[0])));
        CHECK(s.status != FP_STATUS_IP_ONLY || s.npcs + (s.nkc == 2) == 1);
        CHECK(by_code ? s.pcs == NULL : s.pcs != NULL);
        for (uint32_t j = 0; j < s.npcs; j++) {
            CHECK(s.fids[j] < nfr);
            total += (by_code ? 0 : s.pcs[j]) + s.kinds[j];
        }
        for (uint32_t j = 0; j < s.nkc; j++)
            total += s.kc[j];
    }
    CHECK(fp_stack(c, nst, &(struct fp_stack){0}) == -1);
    for (uint32_t f = 0; f < nfr; f++) {
        uint32_t sp;
        uint64_t pc;
        uint8_t ex;
        CHECK(fp_frame(c, f, &sp, &pc, &ex) == 0 && ex <= 1);
    }
    /* the bulk export agrees with fp_stack, stack by stack */
    uint32_t from = nst ? (uint32_t)(rnd() % nst) : 0;
    uint64_t nkc;
    uint64_t nf = fp_stacks_words(c, from, nst, &nkc);
    uint32_t cnt = nst - from;
    uint32_t *comm = malloc((cnt + 1) * 4), *space = malloc((cnt + 1) * 4);
    uint32_t *npcs = malloc((cnt + 1) * 4), *nkcs = malloc((cnt + 1) * 4);
    uint8_t *status = malloc(cnt + 1), *rn = malloc(cnt + 1);
    uint32_t *fids = malloc((nf + 1) * 4);
    uint64_t *kc = malloc((nkc + 1) * 8), *counts = malloc((nst + 1) * 8);
    CHECK(comm && space && npcs && nkcs && status && rn && fids && kc && counts);
    CHECK(fp_stacks_export(c, from, nst, comm, space, status, rn, npcs, nkcs, fids, kc) == cnt);
    fp_stack_counts(c, counts);
    uint64_t fo = 0, ko = 0;
    for (uint32_t j = 0; j < cnt; j++) {
        struct fp_stack s;
        CHECK(fp_stack(c, from + j, &s) == 0);
        CHECK(comm[j] == s.comm_id && space[j] == s.space_id && status[j] == s.status);
        CHECK(rn[j] == s.regs_none && npcs[j] == s.npcs && nkcs[j] == s.nkc);
        CHECK(!memcmp(fids + fo, s.fids, 4 * (size_t)s.npcs));
        CHECK(!memcmp(kc + ko, s.kc, 8 * (size_t)s.nkc));
        CHECK(counts[from + j] == s.count);
        fo += s.npcs;
        ko += s.nkc;
    }
    CHECK(fo == nf && ko == nkc);
    if (by_code) { /* triples: every one names a real stack, and no two are equal */
        uint32_t ps[64], pst[64];
        uint64_t ph[64], at = 0, got, cap = 0;
        struct triple *all = NULL;
        while ((got = fp_pairs(c, at, ps, pst, ph, 64)) > 0) {
            if (at + got > cap) {
                cap = 2 * (at + got);
                all = realloc(all, cap * sizeof *all);
                CHECK(all);
            }
            for (uint64_t j = 0; j < got; j++) {
                CHECK(pst[j] < nst);
                all[at + j].a = (uint64_t)ps[j] << 32 | pst[j];
                all[at + j].b = ph[j];
            }
            at += got;
        }
        if (at) {
            qsort(all, at, sizeof *all, cmp_triple);
            for (uint64_t i = 1; i < at; i++)
                CHECK(all[i].a != all[i - 1].a || all[i].b != all[i - 1].b);
        }
        free(all);
        uint64_t samples = 0;
        for (uint32_t i = 0; i < nst; i++)
            samples += counts[i];
        fold_check(c, samples);
    }
    free(comm), free(space), free(npcs), free(nkcs), free(status), free(rn), free(fids);
    free(kc), free(counts);
    (void)total;
    fp_ctx_free(c);
    free(ids);
    free(perm);
    free(late);
    unw_free(recs);
}

int main(int argc, char **argv)
{
    if (argc != 11 && argc != 12)
        return 2;
    FILE *f = fopen(argv[1], "rb");
    if (!f)
        return 2;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *data = malloc(sz ? (size_t)sz : 1);
    if (!data || fread(data, 1, (size_t)sz, f) != (size_t)sz)
        return 2;
    fclose(f);
    struct fp_layout lay;
    memset(&lay, 0, sizeof lay);
    lay.sample_type = strtoull(argv[2], NULL, 0);
    lay.regs_mask = strtoull(argv[3], NULL, 0);
    lay.nprefix = (uint32_t)strtoul(argv[4], NULL, 0);
    lay.i_ip = argc > 11 ? (int32_t)strtol(argv[11], NULL, 0) : -1;
    lay.i_tid = (int32_t)strtol(argv[5], NULL, 0);
    lay.i_time = (int32_t)strtol(argv[6], NULL, 0);
    lay.i_cpu = (int32_t)strtol(argv[7], NULL, 0);
    lay.i_period = (int32_t)strtol(argv[8], NULL, 0);
    lay.nregs = (uint32_t)strtoul(argv[9], NULL, 0);
    lay.read_per_value = 1;
    int iters = atoi(argv[10]);
    replay(&lay, data, (uint64_t)sz); /* the real section, whole */
    for (int it = 0; it < iters; it++) {
        uint64_t len = sz ? rnd() % ((uint64_t)sz + 1) : 0;
        uint8_t *b = malloc(len ? len : 1);
        memcpy(b, data, len);
        int muts = (int)(rnd() % 16);
        for (int m = 0; m < muts && len; m++)
            b[rnd() % len] = (uint8_t)rnd();
        replay(&lay, b, len);
        free(b);
    }
    free(data);
    printf("ok %llu sym_asks %llu worker_samples %llu fold_lines %llu\n", checks,
           (unsigned long long)sym_asks, (unsigned long long)worker_samples,
           (unsigned long long)fold_lines);
    return 0;
}
