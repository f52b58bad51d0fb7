/* Sanitizer/valgrind harness for the CFI compiler + unwind.c (tests/native/test_unwcore_sanitizers.py).
 *
 *   unw_fuzz EH_FRAME_FILE EH_ADDR HDR_FILE HDR_ADDR ITERATIONS [TRUNCATIONS]
 *
 * Every input buffer is malloc'd at its exact size, so any read one byte past it is an ASan
 * report (or a valgrind error). Checks, all with a fixed-seed xorshift so runs are repeatable:
 *   1. the real section compiles, validates, and every row is found again by lookup;
 *   2. truncations of the section at ~TRUNCATIONS lengths (300 unless given), spread over
 *      it; random prefixes with random byte mutations
 *      (with and without the hdr, also fed as .debug_frame): compile + validate must succeed;
 *   3. corrupted blobs: validate either rejects them or they are safe to look up in;
 *   4. random registers and random stacks (some full of pointers into the table's range)
 *      unwound against the real table: bounded counts, known statuses;
 *   5. JIT code (a UNW_MOD_JIT module, no table: the frame-pointer walk): crafted rbps (past
 *      the copy, its last word, below sp, a self loop) stop with the expected status, and
 *      random rbp chains mixing JIT and libc return addresses stay bounded.
 * Prints "ok <checks>"; a failed CHECK exits 1.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "unwcore.h"

static unsigned long checks;
#define CHECK(c)                                                                   \
    do {                                                                           \
        checks++;                                                                  \
        if (!(c)) {                                                                \
            fprintf(stderr, "CHECK failed %s:%d: %s\n", __FILE__, __LINE__, #c);   \
            exit(1);                                                               \
        }                                                                          \
    } while (0)

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void)
{
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return rng_state = x;
}

static uint8_t *slurp(const char *path, uint64_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        exit(2);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(n ? (size_t)n : 1);
    if (fread(b, 1, (size_t)n, f) != (size_t)n)
        exit(2);
    fclose(f);
    *len = (uint64_t)n;
    return b;
}

/* compile an exact-size copy of eh[0..n) (+ optional hdr), validate, free */
static uint8_t *compile(const uint8_t *eh, uint64_t n, uint64_t eh_addr, const uint8_t *hdr,
                        uint64_t hlen, uint64_t haddr, const uint8_t *dbg, uint64_t dlen,
                        uint64_t *blen)
{
    uint8_t *img = malloc(n + hlen ? n + hlen : 1);
    memcpy(img, eh, n);
    if (hlen)
        memcpy(img + n, hdr, hlen);
    struct unw_sections s;
    memset(&s, 0, sizeof s);
    s.eh_frame_off = 0;
    s.eh_frame_size = n;
    s.eh_frame_addr = eh_addr;
    s.eh_hdr_off = n;
    s.eh_hdr_size = hlen;
    s.eh_hdr_addr = haddr;
    uint8_t *out = NULL;
    int rc = unw_cfi_compile(UNW_ARCH_X86_64, img, n + hlen, &s, dbg, dlen, &out, blen);
    CHECK(rc == 0 && out != NULL);
    CHECK(unw_table_validate(out, *blen) == 0);
    free(img);
    return out;
}

static void lookups(const uint8_t *blob, uint64_t base, uint64_t span, int n)
{
    struct unw_rule r;
    uint64_t start;
    for (int i = 0; i < n; i++) {
        uint64_t pc = base + (span ? rnd() % span : 0) - 16;
        int64_t k = unw_table_lookup(blob, pc, &r, &start);
        CHECK(k < 0 || start <= pc);
    }
}

static void unwind_random(const uint8_t *blob, uint64_t base, uint64_t span, int iters)
{
    struct unw_module mods[2] = {
        {0x7f0000000000ull + base, 0x7f0000000000ull + base + span, 0x7f0000000000ull, blob, 1, 0},
        {0x7f1000000000ull, 0x7f1000001000ull, 0x7f1000000000ull, NULL, 2, 0},
    };
    enum { DEPTH = 32, N = 16 };
    for (int it = 0; it < iters; it++) {
        struct unw_item items[N];
        uint64_t *regs[N];
        uint8_t *stacks[N];
        for (int i = 0; i < N; i++) {
            uint32_t nregs = (uint32_t)(rnd() % 21);
            regs[i] = malloc(sizeof(uint64_t) * (nregs ? nregs : 1));
            uint64_t sp = 0x7ffd00000000ull + (rnd() % 4096) * 8;
            for (uint32_t k = 0; k < nregs; k++)
                regs[i][k] = rnd() % 3 ? sp + (rnd() % 512) * 8 : rnd();
            if (nregs > 8) /* ip = 9th register (perf IP) in the standard mask */
                regs[i][8] = mods[0].start + rnd() % span;
            if (nregs > 7)
                regs[i][7] = sp;
            uint64_t slen = (rnd() % 64) * 8 + rnd() % 8;
            stacks[i] = malloc(slen ? slen : 1);
            for (uint64_t k = 0; k + 8 <= slen; k += 8) {
                uint64_t v = rnd() % 2 ? mods[0].start + rnd() % span
                                       : (rnd() % 2 ? sp + (rnd() % 1024) * 8 : rnd());
                memcpy(stacks[i] + k, &v, 8);
            }
            items[i] = (struct unw_item){mods, 2, nregs, 0xff0fffull, regs[i], stacks[i], slen};
        }
        uint64_t pcs[N * DEPTH];
        uint32_t counts[N];
        uint8_t status[N];
        uint16_t fp[N], sig[N];
        uint8_t kinds[N * DEPTH];
        CHECK(unw_unwind_batch(UNW_ARCH_X86_64, items, N, DEPTH, pcs, kinds, counts, status, fp,
                               sig) == 0);
        for (int i = 0; i < N; i++) {
            CHECK(counts[i] <= DEPTH && status[i] <= UNW_NO_REGS && sig[i] <= counts[i]);
            for (uint32_t k = 0; k < counts[i]; k++)
                CHECK(kinds[i * DEPTH + k] <= (UNW_FRAME_SIGNAL | UNW_FRAME_FP));
            free(regs[i]);
            free(stacks[i]);
        }
    }
}

/* perf regs of mask 0xff0fff, in dump order: rbp at 6, rsp at 7, rip at 8 (20 in all) */
enum { NREGS_STD = 20, R_BP = 6, R_SP = 7, R_IP = 8 };

static uint8_t unwind_one_jit(const struct unw_module *mods, uint64_t ip, uint64_t sp,
                              uint64_t bp, const uint8_t *stack, uint64_t slen, uint32_t *count)
{
    uint64_t *regs = calloc(NREGS_STD, sizeof *regs);
    regs[R_BP] = bp;
    regs[R_SP] = sp;
    regs[R_IP] = ip;
    struct unw_item it = {mods, 2, NREGS_STD, 0xff0fffull, regs, stack, slen};
    enum { DEPTH = 16 };
    uint64_t pcs[DEPTH];
    uint8_t kinds[DEPTH], status;
    uint16_t fp, sig;
    CHECK(unw_unwind_batch(UNW_ARCH_X86_64, &it, 1, DEPTH, pcs, kinds, count, &status, &fp,
                           &sig) == 0);
    CHECK(*count >= 1 && *count <= DEPTH && pcs[0] == ip && fp <= *count);
    free(regs);
    return status;
}

static void unwind_jit(const uint8_t *blob, uint64_t base, uint64_t span, int iters)
{
    const uint64_t jit = 0x7f2000000000ull, jlen = 0x10000;
    struct unw_module mods[2] = {
        {0x7f0000000000ull + base, 0x7f0000000000ull + base + span, 0x7f0000000000ull, blob, 1, 0},
        {jit, jit + jlen, 0, NULL, 0, UNW_MOD_JIT},
    };
    const uint64_t sp = 0x7ffd00001000ull;
    uint32_t n;
    /* crafted: 64-byte copy at sp, exact size */
    uint8_t *st = malloc(64);
    uint64_t w[8] = {0, 0, sp + 48, jit + 0x20, 0, 0, 0, 0};
    memcpy(st, w, 64);
    CHECK(unwind_one_jit(mods, jit + 0x10, sp, sp + 64, st, 64, &n) == UNW_NO_CFI && n == 1);
    CHECK(unwind_one_jit(mods, jit + 0x10, sp, sp + 56, st, 64, &n) == UNW_TRUNCATED && n == 1);
    CHECK(unwind_one_jit(mods, jit + 0x10, sp, sp - 8, st, 64, &n) == UNW_NO_CFI && n == 1);
    CHECK(unwind_one_jit(mods, jit + 0x10, sp, ~0ull - 7, st, 64, &n) == UNW_NO_CFI && n == 1);
    /* one good step to rbp = sp + 48, whose return slot (sp + 56) is the copy's last word: 0 */
    CHECK(unwind_one_jit(mods, jit + 0x10, sp, sp + 16, st, 64, &n) == UNW_OK && n == 2);
    w[2] = sp + 16; /* a saved rbp pointing at its own slot: one step, then below the new sp */
    memcpy(st, w, 64);
    CHECK(unwind_one_jit(mods, jit + 0x10, sp, sp + 16, st, 64, &n) == UNW_NO_CFI && n == 2);
    free(st);
    /* random rbp chains */
    for (int it = 0; it < iters * 4; it++) {
        uint64_t slen = (rnd() % 64) * 8 + rnd() % 8;
        uint8_t *s = malloc(slen ? slen : 1);
        for (uint64_t k = 0; k + 8 <= slen; k += 8) {
            uint64_t r = rnd() % 4, v;
            if (r == 0)
                v = sp + k + 8 * (rnd() % 8); /* a saved rbp, mostly higher */
            else if (r == 1)
                v = jit + rnd() % jlen;
            else if (r == 2)
                v = mods[0].start + rnd() % span;
            else
                v = rnd();
            memcpy(s + k, &v, 8);
        }
        uint64_t bp = rnd() % 3 ? sp + (rnd() % 72) * 8 - 32 : rnd();
        uint8_t status = unwind_one_jit(mods, jit + rnd() % jlen, sp, bp, s, slen, &n);
        CHECK(status <= UNW_NO_REGS);
        free(s);
    }
}

int main(int argc, char **argv)
{
    if (argc != 6 && argc != 7)
        return 2;
    uint64_t elen, hlen;
    uint8_t *eh = slurp(argv[1], &elen), *hdr = slurp(argv[3], &hlen);
    uint64_t eaddr = strtoull(argv[2], 0, 0), haddr = strtoull(argv[4], 0, 0);
    int iters = atoi(argv[5]);
    uint64_t truncations = argc == 7 ? strtoull(argv[6], 0, 0) : 300;
    if (!truncations)
        return 2;

    /* 1. the real thing */
    uint64_t blen;
    uint8_t *blob = compile(eh, elen, eaddr, hdr, hlen, haddr, NULL, 0, &blen);
    struct unw_table_hdr h;
    memcpy(&h, blob, sizeof h);
    CHECK(h.nrows > 100);
    for (uint32_t i = 0; i < h.nrows; i++) {
        uint64_t pc, start;
        struct unw_rule r, r2;
        CHECK(unw_table_row(blob, i, &pc, &r) == 0);
        CHECK(unw_table_lookup(blob, pc, &r2, &start) == (int64_t)i && start == pc);
        CHECK(memcmp(&r, &r2, sizeof r) == 0);
    }
    uint64_t last;
    struct unw_rule lr;
    unw_table_row(blob, h.nrows - 1, &last, &lr);
    uint64_t span = last - h.base + 64;
    printf("real: %u rows, %lu bytes\n", h.nrows, (unsigned long)blen);

    /* 2. truncations and mutations */
    for (uint64_t n = 0; n < elen; n += elen / truncations + 1) {
        uint64_t bl;
        free(compile(eh, n, eaddr, NULL, 0, 0, NULL, 0, &bl));
        free(compile(eh, n, eaddr, hdr, hlen, haddr, NULL, 0, &bl));
    }
    for (int it = 0; it < iters; it++) {
        uint64_t n = 64 + rnd() % (elen < 8192 ? elen : 8192);
        uint8_t *m = malloc(n);
        memcpy(m, eh, n);
        int flips = 1 + (int)(rnd() % 16);
        for (int k = 0; k < flips; k++)
            m[rnd() % n] = (uint8_t)rnd();
        uint8_t *hm = malloc(hlen);
        memcpy(hm, hdr, hlen);
        if (it % 2)
            hm[rnd() % hlen] = (uint8_t)rnd();
        uint64_t bl;
        uint8_t *b = compile(m, n, eaddr, hm, it % 3 ? hlen : 0, haddr, m, n, &bl);
        lookups(b, eaddr, n * 4, 20);
        free(b);
        free(m);
        free(hm);
    }

    /* 3. corrupted blobs */
    for (int it = 0; it < iters; it++) {
        uint8_t *c = malloc(blen);
        memcpy(c, blob, blen);
        int flips = 1 + (int)(rnd() % 4);
        for (int k = 0; k < flips; k++)
            c[rnd() % (it % 2 ? blen : UNW_HDR_SIZE + 64)] = (uint8_t)rnd();
        uint64_t cl = it % 5 ? blen : rnd() % blen;
        if (unw_table_validate(c, cl) == 0)
            lookups(c, h.base, span, 50);
        free(c);
    }

    /* 4. unwinding garbage */
    unwind_random(blob, h.base, span, iters);

    /* 5. JIT code: the frame-pointer walk */
    unwind_jit(blob, h.base, span, iters);

    free(blob);
    free(eh);
    free(hdr);
    printf("ok %lu\n", checks);
    return 0;
}
