/* stackenc_fuzz.c: cffi_build/stackenc.c (the stack table's CodeStack encoding) on random
 * code slots, ips and serials, every array malloc'd at its exact size so that an access past
 * one is reported under AddressSanitizer or valgrind. Each result is checked against a plain
 * restatement of stacktable._encode_at's rules (deltas in first-seen order, at most
 * UNW_ST_NO_DELTA, int64 range; a frame id only from a live slot that keys its frame), the
 * packed bytes field by field, and unw_st_hold's counts and refusals. Prints ``ok <checks>``. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HARNESS_SEED 0x5EEDC0DE12345ull
#include "harness.h"
#include "unwcore.h"

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    CHECK(p);
    return p;
}

/* an ip or rel: mostly near a few bases (shared deltas), now and then anything */
static uint64_t addr(void) {
    static const uint64_t bases[] = {0, 0x400000, 0x7f0000000000ull, 0xffffffff81000000ull,
                                     0x8000000000000000ull};
    if (rnd() % 8 == 0)
        return rnd();
    return bases[rnd() % 5] + rnd() % 0x3000;
}

static void one(uint64_t n, uint64_t nslots, uint64_t nuids, int wide) {
    int32_t *slots = xmalloc(4 * n);
    uint64_t *words = xmalloc(8 * UNW_ST_WORDS * nslots), *ips = xmalloc(8 * n);
    uint64_t *uids = xmalloc(8 * nuids);
    uint32_t *fids = xmalloc(4 * n), *miss = xmalloc(4 * n), nd = 0;
    uint8_t *di = xmalloc(n);
    int64_t *deltas = xmalloc(8 * UNW_ST_NO_DELTA);
    for (uint64_t u = 0; u < nuids; u++)
        uids[u] = rnd() % 4 ? 1 + u : 0; /* freed ids: 0 */
    for (uint64_t s = 0; s < nslots; s++) {
        uint64_t *w = words + UNW_ST_WORDS * s;
        uint64_t fid = rnd() % (nuids + 2);
        w[0] = fid | ((uint64_t)(wide || rnd() % 2 ? UNW_ST_HAS_REL : 0) << 32);
        w[1] = rnd() % 3 == 0 ? 0 : (fid < nuids && rnd() % 4 ? uids[fid] : rnd() % 50);
        w[2] = addr();
        w[3] = addr();
    }
    for (uint64_t i = 0; i < n; i++) {
        slots[i] = (int32_t)(rnd() % nslots);
        const uint64_t *w = words + UNW_ST_WORDS * slots[i];
        uint64_t k = rnd() % 4;
        if (wide)
            ips[i] = w[2] + rnd() % 0x100000;
        else
            ips[i] = k == 0 ? w[3] : k == 1 ? w[2] + rnd() % 4 * 0x10000 : addr();
    }
    int64_t nmiss = unw_st_resolve(n, slots, nslots, words, ips, uids, nuids, fids, di, deltas,
                                   &nd, miss);
    CHECK(nmiss >= 0 && (uint64_t)nmiss <= n && nd <= UNW_ST_NO_DELTA);
    /* the rules, restated */
    int64_t want[UNW_ST_NO_DELTA];
    uint32_t nw = 0;
    int64_t k = 0;
    for (uint64_t i = 0; i < n; i++) {
        const uint64_t *w = words + UNW_ST_WORDS * slots[i];
        uint8_t d = UNW_ST_NO_DELTA;
        int keyed;
        if ((w[0] >> 32) & UNW_ST_HAS_REL) {
            __int128 delta = (__int128)ips[i] - (__int128)w[2];
            if (delta >= INT64_MIN && delta <= INT64_MAX) {
                for (uint32_t j = 0; j < nw; j++)
                    if (want[j] == (int64_t)delta)
                        d = (uint8_t)j;
                if (d == UNW_ST_NO_DELTA && nw < UNW_ST_NO_DELTA) {
                    want[nw] = (int64_t)delta;
                    d = (uint8_t)nw++;
                }
            }
            keyed = d != UNW_ST_NO_DELTA;
        } else {
            keyed = ips[i] == w[3];
        }
        CHECK(di[i] == d);
        uint32_t fid = (uint32_t)w[0];
        if (keyed && w[1] && fid < nuids && uids[fid] == w[1]) {
            CHECK(fids[i] == fid);
        } else {
            CHECK(k < nmiss && miss[k] == ((uint32_t)i | (keyed ? UNW_ST_KEYED : 0)));
            k++;
        }
    }
    CHECK(k == nmiss && nd == nw && (nw == 0 || memcmp(deltas, want, 8 * nw) == 0));
    /* packed: header, ids, deltas, indices */
    uint64_t cap = 6 + 13 * n;
    uint8_t *out = xmalloc(cap);
    uint64_t len = unw_st_pack(n, fids, deltas, nd, di, out);
    uint32_t mx = 0, hn;
    for (uint64_t i = 0; i < n; i++)
        mx = fids[i] > mx ? fids[i] : mx;
    uint8_t wd = mx < (1u << 16) ? 2 : 4;
    CHECK(len == 6 + wd * n + 8 * nd + n && len <= cap);
    memcpy(&hn, out, 4);
    CHECK(hn == n && out[4] == nd && out[5] == wd);
    for (uint64_t i = 0; i < n; i++) {
        uint32_t v = 0;
        memcpy(&v, out + 6 + wd * i, wd);
        CHECK(v == fids[i]);
    }
    CHECK(nd == 0 || memcmp(out + 6 + wd * n, deltas, 8 * nd) == 0);
    CHECK(n == 0 || memcmp(out + 6 + wd * n + 8 * nd, di, n) == 0);
    /* held: +1 per occurrence, or nothing at all past nfrefs or on short bytes */
    uint64_t nfrefs = mx + 1 - (rnd() % 3 == 0 && n ? 1 : 0);
    uint32_t *frefs = xmalloc(4 * nfrefs), *was = xmalloc(4 * nfrefs);
    for (uint64_t f = 0; f < nfrefs; f++)
        was[f] = frefs[f] = (uint32_t)(rnd() % 5);
    int64_t held = unw_st_hold(out, len, frefs, nfrefs);
    if (n && mx >= nfrefs) {
        CHECK(held == -1 && memcmp(frefs, was, 4 * nfrefs) == 0);
    } else {
        CHECK(held == (int64_t)n);
        for (uint64_t i = 0; i < n; i++)
            was[fids[i]]++;
        CHECK(memcmp(frefs, was, 4 * nfrefs) == 0);
    }
    CHECK(unw_st_hold(out, len < 6 ? len : 5, frefs, nfrefs) == -1);
    if (n) /* bytes cut short: refused, nothing held */
        CHECK(unw_st_hold(out, len - n - 8 * nd - 1, frefs, nfrefs) == -1);
    /* a slot out of range: refused */
    if (n) {
        int32_t keep = slots[n - 1];
        slots[n - 1] = rnd() % 2 ? -1 : (int32_t)nslots;
        CHECK(unw_st_resolve(n, slots, nslots, words, ips, uids, nuids, fids, di, deltas, &nd,
                             miss) == -1);
        slots[n - 1] = keep;
    }
    free(slots), free(words), free(ips), free(uids), free(fids), free(miss), free(di);
    free(deltas), free(out), free(frefs), free(was);
}

int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : 3000;
    for (long r = 0; r < rounds; r++) {
        /* now and then a stack of more distinct deltas than the delta index names */
        int wide = rnd() % 16 == 0;
        uint64_t n = wide ? 256 + rnd() % 300 : rnd() % 8 == 0 ? rnd() % 600 : rnd() % 40;
        one(n, 1 + rnd() % (n + 3), rnd() % 80000 + (rnd() % 2 ? 0 : 70000), wide);
    }
    one(0, 1, 0, 0);
    printf("real: %ld rounds\nok %llu\n", rounds, checks);
    return 0;
}
