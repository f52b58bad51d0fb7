/* dwarf_fuzz.c: dwarfline.c's unw_srcline_compile on real DWARF sections, then on truncations and
 * random mutations of each, every section copied into an exact-size malloc'd buffer so that any
 * over-read is reported by AddressSanitizer or valgrind. Each table is checked: its size adds
 * up, every index in it is in range, parents come before children. Prints "real: ..." for the
 * unmutated compile and "ok <checks>" at the end.
 *
 * usage: dwarf_fuzz ITERATIONS INFO ABBREV LINE STR LINE_STR STR_OFFSETS ADDR RANGES RNGLISTS
 * (a path of "-" is an absent section; the order is struct unw_dwarf_sections'). */
#define HARNESS_SEED 0xD3A4F1E5C0FFEEull
#include <string.h>

#include "harness.h"
#include "unwcore.h"

#define NSEC 9

static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static void check_blob(const uint8_t *b, uint64_t len)
{
    struct unw_srcline_hdr h;
    CHECK(len >= sizeof h);
    memcpy(&h, b, sizeof h);
    CHECK(h.magic == UNW_SL_MAGIC && h.version == UNW_SL_VERSION);
    uint64_t want = sizeof h + (uint64_t)h.nlines * 16 + (uint64_t)h.nsegs * 12 +
                    (uint64_t)h.nnodes * 28 + (uint64_t)h.nfiles * 4 + h.strtab_len;
    CHECK(want == len);
    const uint8_t *lfile = b + sizeof h + (uint64_t)h.nlines * 8;
    for (uint32_t i = 0; i < h.nlines; i++) {
        uint32_t f = rd32(lfile + 4 * i);
        CHECK(f == UNW_SL_NONE || f < h.nfiles);
    }
    const uint8_t *saddr = b + sizeof h + (uint64_t)h.nlines * 16;
    const uint8_t *snode = saddr + (uint64_t)h.nsegs * 8;
    for (uint32_t i = 0; i < h.nsegs; i++) {
        uint32_t n = rd32(snode + 4 * i);
        CHECK(n == UNW_SL_NONE || n < h.nnodes);
        if (i) {
            uint64_t a, p;
            memcpy(&a, saddr + 8 * i, 8);
            memcpy(&p, saddr + 8 * (i - 1), 8);
            CHECK(p < a);
        }
    }
    const uint8_t *nodes = snode + (uint64_t)h.nsegs * 4;
    const uint8_t *files = nodes + (uint64_t)h.nnodes * 28;
    const uint8_t *strtab = files + (uint64_t)h.nfiles * 4;
    for (uint32_t i = 0; i < h.nnodes; i++) {
        uint32_t name = rd32(nodes + 4 * i), file = rd32(nodes + 4 * (h.nnodes + i));
        uint32_t parent = rd32(nodes + 4 * (3 * (uint64_t)h.nnodes + i));
        uint32_t kind = rd32(nodes + 4 * (4 * (uint64_t)h.nnodes + i));
        uint32_t dfile = rd32(nodes + 4 * (5 * (uint64_t)h.nnodes + i));
        CHECK(name == UNW_SL_NONE || name < h.strtab_len);
        CHECK(file == UNW_SL_NONE || file < h.nfiles);
        CHECK(dfile == UNW_SL_NONE || dfile < h.nfiles);
        CHECK(parent == UNW_SL_NONE || parent < i);
        CHECK(kind == UNW_SL_SUBPROGRAM || kind == UNW_SL_INLINED);
    }
    for (uint32_t i = 0; i < h.nfiles; i++)
        CHECK(rd32(files + 4 * i) < h.strtab_len);
    CHECK(h.strtab_len && strtab[h.strtab_len - 1] == 0);
}

static void compile_check(const uint8_t *const *sec, const uint64_t *len, uint64_t *nlines)
{
    struct unw_dwarf_sections s;
    const uint8_t **p[NSEC] = {&s.info, &s.abbrev, &s.line, &s.str, &s.line_str, &s.str_offsets,
                               &s.addr, &s.ranges, &s.rnglists};
    uint64_t *l[NSEC] = {&s.info_len, &s.abbrev_len, &s.line_len, &s.str_len, &s.line_str_len,
                         &s.str_offsets_len, &s.addr_len, &s.ranges_len, &s.rnglists_len};
    for (int i = 0; i < NSEC; i++) {
        *p[i] = len[i] ? sec[i] : NULL;
        *l[i] = len[i];
    }
    uint8_t *out = NULL;
    uint64_t out_len = 0;
    CHECK(unw_srcline_compile(&s, &out, &out_len) == 0 && out);
    check_blob(out, out_len);
    struct unw_srcline_hdr h;
    memcpy(&h, out, sizeof h);
    if (nlines)
        *nlines = h.nlines;
    free(out); /* (unw_free is free: cfitable.c, not linked here) */
}

int main(int argc, char **argv)
{
    CHECK(argc == 2 + NSEC);
    long iters = strtol(argv[1], NULL, 10);
    uint8_t *sec[NSEC];
    uint64_t len[NSEC];
    for (int i = 0; i < NSEC; i++) {
        if (strcmp(argv[2 + i], "-") == 0) {
            sec[i] = NULL;
            len[i] = 0;
        } else {
            sec[i] = slurp(argv[2 + i], &len[i]);
        }
    }
    uint64_t nl = 0;
    compile_check((const uint8_t *const *)sec, len, &nl);
    printf("real: %lu line rows\n", (unsigned long)nl);
    for (long it = 0; it < iters; it++) {
        int k = (int)(rnd() % NSEC);
        if (!len[k])
            continue;
        uint64_t n = rnd() % 2 ? rnd() % (len[k] + 1) : len[k];
        uint8_t *copy = malloc(n ? n : 1);
        CHECK(copy);
        memcpy(copy, sec[k], n);
        if (n && rnd() % 2)
            for (int m = (int)(rnd() % 8) + 1; m > 0; m--)
                copy[rnd() % n] = (uint8_t)rnd();
        const uint8_t *s2[NSEC];
        uint64_t l2[NSEC];
        for (int i = 0; i < NSEC; i++) {
            s2[i] = sec[i];
            l2[i] = len[i];
        }
        s2[k] = copy;
        l2[k] = n;
        compile_check(s2, l2, NULL);
        free(copy);
    }
    for (int i = 0; i < NSEC; i++)
        free(sec[i]);
    printf("ok %llu\n", checks);
    return 0;
}
