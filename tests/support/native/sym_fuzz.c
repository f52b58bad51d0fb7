/* sym_fuzz.c: cffi_build/symtab.c and sideband.c under ASan/UBSan (tests/unit/test_symbolize.py).
 *
 * usage: sym_fuzz SYMS STRTAB KALLSYMS DATA sample_type regs_mask nprefix i_tid i_time i_cpu
 *                 i_period nregs sid_size t_off c_off ITERS
 *
 * SYMS/STRTAB: a real .symtab and its string table; KALLSYMS: kallsyms text; DATA: a real
 * perf.data data section. Each iteration copies truncated, byte-mutated versions into buffers
 * malloc'd at their exact size (any over-read is reported) and runs unw_symtab_scan +
 * unw_symtab_compact (random section flags, both arm modes), unw_kallsyms_parse, and
 * fp_index + fp_order + unw_sb_scan + unw_sb_lazy + unw_sb_lazy_exits + unw_sb_compact +
 * unw_sb_unsampled + unw_sb_noop_mmaps, checking the outputs' invariants.
 * Prints "ok N".
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "unwcore_int.h"
#include "fastpath.h"

#define HARNESS_SEED 0x9E3779B97F4A7C15ull
#include "harness.h"

/* An exact-size copy of src[0, n) with a few random bytes changed (none on even iterations). */
static uint8_t *mutated(const uint8_t *src, uint64_t n, int it)
{
    uint8_t *b = malloc(n ? n : 1);
    CHECK(b);
    memcpy(b, src, n);
    if (n && it % 2)
        for (int k = 0; k < 1 + it % 7; k++)
            b[rnd() % n] = (uint8_t)rnd();
    return b;
}

static void symtab(const uint8_t *syms0, uint64_t slen0, const uint8_t *str0, uint64_t strlen0,
                   int it)
{
    uint64_t slen = it % 3 ? slen0 : rnd() % (slen0 + 1);
    uint64_t strsz = it % 5 ? strlen0 : rnd() % (strlen0 + 1);
    uint8_t *syms = mutated(syms0, slen, it), *str = mutated(str0, strsz, it);
    uint32_t nsec = 1 + (uint32_t)(rnd() % 64);
    uint8_t *flags = malloc(nsec);
    for (uint32_t i = 0; i < nsec; i++)
        flags[i] = (uint8_t)(rnd() % 4);
    uint64_t nsyms = slen / 24, und = 0;
    struct unw_sym *out = malloc((nsyms ? nsyms : 1) * sizeof *out);
    int64_t n = unw_symtab_scan(syms, nsyms, str, strsz, flags, nsec, it % 4 == 0, out, &und);
    CHECK(n >= 0 && (uint64_t)n <= nsyms);
    uint64_t u = 0;
    for (int64_t i = 0; i < n; i++) {
        CHECK(out[i].name < strsz);
        CHECK(out[i].keep <= 2);
        u += out[i].keep == 2;
        if (i)
            CHECK(out[i - 1].start <= out[i].start);
    }
    CHECK(u == und);
    for (int64_t i = 0; i < n; i++) /* Python decides undecided groups: keep the first */
        if (out[i].keep == 2)
            out[i].keep = i == 0 || out[i - 1].start != out[i].start;
    uint64_t m = unw_symtab_compact(out, (uint64_t)n);
    for (uint64_t i = 1; i < m; i++)
        CHECK(out[i - 1].start < out[i].start);
    free(out);
    free(flags);
    free(syms);
    free(str);
}

static void kallsyms(const uint8_t *k0, uint64_t klen0, int it)
{
    uint64_t len = it % 3 ? klen0 : rnd() % (klen0 + 1);
    uint8_t *k = mutated(k0, len, it);
    uint64_t cap = 1 + rnd() % 20000;
    struct unw_ksym *out = malloc(cap * sizeof *out);
    int64_t n = unw_kallsyms_parse(k, len, out, cap);
    CHECK(n >= 0 && (uint64_t)n <= cap);
    for (int64_t i = 0; i < n; i++) {
        CHECK((uint64_t)out[i].name_off + out[i].name_len <= len);
        CHECK((uint64_t)out[i].mod_off + out[i].mod_len <= len);
        if (i)
            CHECK(out[i - 1].addr <= out[i].addr);
    }
    free(out);
    free(k);
}

static void sideband(const struct fp_layout *lay, const uint8_t *d0, uint64_t dlen0, uint32_t sid,
                     int32_t toff, int32_t coff, int it)
{
    uint64_t len = it % 3 ? dlen0 : rnd() % (dlen0 + 1);
    uint8_t *d = mutated(d0, len, it);
    struct fp_rec *recs;
    uint64_t n, other, stop;
    int end;
    CHECK(fp_index(lay, d, len, &recs, &n, &other, &end, &stop) == 0);
    uint32_t *idx = malloc((other ? other : 1) * sizeof *idx);
    uint64_t no = fp_select_other(recs, n, idx);
    CHECK(no == other);
    uint8_t *cand = calloc(n ? n : 1, 1);
    uint32_t *pids = calloc(n ? n : 1, sizeof *pids);
    uint64_t nrest;
    int64_t nc = unw_sb_scan(d, len, recs, idx, no, sid, toff, coff, cand, pids, &nrest);
    CHECK(nc >= 0 && (uint64_t)nc + nrest == no);
    for (uint64_t i = 0; i < nrest; i++)
        CHECK(!cand[idx[i]]);
    uint32_t *lazy = malloc((nrest ? nrest : 1) * sizeof *lazy);
    uint64_t nrest2;
    int64_t nl = unw_sb_lazy(d, len, recs, idx, nrest, sid, toff, coff, lazy, &nrest2);
    CHECK(nl >= 0 && (uint64_t)nl + nrest2 == nrest);
    for (int64_t i = 0; i < nl; i++)
        CHECK(recs[lazy[i]].type == 10 && recs[lazy[i]].off + recs[lazy[i]].size <= len);
    uint64_t nrest3;
    int64_t ne = unw_sb_lazy_exits(d, len, recs, idx, nrest2, sid, toff, coff, lazy, &nrest3);
    CHECK(ne >= 0 && (uint64_t)ne + nrest3 == nrest2);
    for (int64_t i = 0; i < ne; i++)
        CHECK(recs[lazy[i]].type == 4 && (recs[lazy[i]].flags & FP_TIMED)
              && recs[lazy[i]].off + recs[lazy[i]].size <= len);
    free(lazy);
    uint32_t *perm = malloc((n ? n : 1) * sizeof *perm);
    uint64_t *late = malloc((n ? n : 1) * sizeof *late);
    uint64_t nout, nlate;
    struct fp_order_stats st;
    CHECK(fp_order(recs, n, 1 + rnd() % 64, perm, &nout, late, &nlate, &st) == 0);
    uint32_t *kept = malloc((nc ? (uint64_t)nc : 1) * sizeof *kept);
    uint32_t *cpus = malloc((nc ? (uint64_t)nc : 1) * sizeof *cpus);
    uint64_t nk;
    uint64_t m = unw_sb_compact(perm, nout, cand, pids, (uint64_t)nc, recs, kept, &nk, cpus);
    CHECK(m <= nout && nk <= (uint64_t)nc && (nout - m) + nk <= (uint64_t)nc);
    for (uint64_t k = 0; k < m; k++)
        CHECK(cand[perm[k]] != 1);
    /* the skips keep a subsequence: every sample, in order */
    uint32_t *before = malloc((m ? m : 1) * sizeof *before);
    memcpy(before, perm, m * sizeof *before);
    uint64_t counts[UNW_SB_NCOUNTS];
    int64_t m2 = unw_sb_unsampled(d, len, recs, perm, m, sid, counts);
    CHECK(m2 >= 0 && (uint64_t)m2 <= m);
    uint64_t dropped = 0;
    for (int i = 0; i < UNW_SB_NCOUNTS; i++)
        dropped += counts[i];
    CHECK(dropped == m - (uint64_t)m2);
    int64_t m3 = unw_sb_noop_mmaps(d, len, recs, perm, (uint64_t)m2, sid);
    if (m3 == UNW_SB_UNTOUCHED)
        m3 = m2;
    CHECK(m3 >= 0 && m3 <= m2);
    uint64_t j = 0;
    for (uint64_t k = 0; k < m; k++) {
        if (j < (uint64_t)m3 && perm[j] == before[k])
            j++;
        else
            CHECK(!(recs[before[k]].flags & FP_SAMPLE));
    }
    CHECK(j == (uint64_t)m3);
    free(before);
    free(kept);
    free(cpus);
    free(perm);
    free(late);
    free(cand);
    free(pids);
    free(idx);
    unw_free(recs);
    free(d);
}

int main(int argc, char **argv)
{
    if (argc != 17) {
        fprintf(stderr, "usage: see the file header\n");
        return 2;
    }
    uint64_t slen, strl, klen, dlen;
    uint8_t *syms = slurp(argv[1], &slen), *str = slurp(argv[2], &strl);
    uint8_t *k = slurp(argv[3], &klen), *d = slurp(argv[4], &dlen);
    struct fp_layout lay = {0};
    lay.sample_type = strtoull(argv[5], NULL, 0);
    lay.regs_mask = strtoull(argv[6], NULL, 0);
    lay.nprefix = (uint32_t)atoi(argv[7]);
    lay.i_ip = -1;
    lay.i_tid = atoi(argv[8]);
    lay.i_time = atoi(argv[9]);
    lay.i_cpu = atoi(argv[10]);
    lay.i_period = atoi(argv[11]);
    lay.nregs = (uint32_t)atoi(argv[12]);
    uint32_t sid = (uint32_t)atoi(argv[13]);
    int32_t toff = atoi(argv[14]), coff = atoi(argv[15]);
    int iters = atoi(argv[16]);
    for (int it = 0; it < iters; it++) {
        symtab(syms, slen, str, strl, it);
        kallsyms(k, klen, it);
        if (it % 4 == 0)
            sideband(&lay, d, dlen, sid, toff, coff, it);
    }
    printf("ok %llu\n", checks);
    free(syms);
    free(str);
    free(k);
    free(d);
    return 0;
}
