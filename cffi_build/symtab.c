/* symtab.c: ELF symbol tables and /proc/kallsyms scanned in one native pass (elfsyms.py,
 * kallsyms.py).
 *
 * Why native: a Python loop over .symtab costs a bytecode loop per symbol, tables hold tens of
 * thousands of symbols, and a replay loads every binary its samples touch; here a symbol is a
 * few compares and stores.
 *
 * Invariants:
 * - Same selection and order as perf 6.1 (tools/perf/util/symbol-elf.c dso__load_sym,
 *   symbol.c symbols__fixup_end / symbols__fixup_duplicate / choose_best_symbol); see the rules
 *   at the top of elfsyms.py, which this file implements for everything that does not need a
 *   demangled name. A tie that does (same start, same size class, binding, and a name that
 *   demangles (Itanium, Rust v0, _GLOBAL_) or is not ASCII) is left to Python: every member of
 *   that group gets keep == UNW_SYM_UNDECIDED.
 * - Names are never copied: a symbol carries its st_name offset into the caller's string
 *   table, checked to lie inside it (the name ends at the next NUL or the table's end).
 * - Every read is bounded by the lengths passed in; no allocation outlives a call.
 *
 * Cost: O(n log n) for n symbols (one qsort), O(1) extra memory besides a sort buffer.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "unwcore.h"

/* Elf64_Sym (include/uapi/linux/elf.h), 24 bytes, little-endian:
 *   u32 st_name; u8 st_info (bind << 4 | type); u8 st_other (visibility & 3);
 *   u16 st_shndx; u64 st_value; u64 st_size */
#define SYM_SIZE 24
#define STT_NOTYPE 0
#define STT_FUNC 2
#define STT_GNU_IFUNC 10
#define STB_GLOBAL 1
#define STB_WEAK 2
#define STV_INTERNAL 1
#define STV_HIDDEN 2
#define SHN_UNDEF 0
#define SHN_LORESERVE 0xff00
#define PAGE 4096ULL

static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static int cmp_sym(const void *a, const void *b)
{
    const struct unw_sym *x = a, *y = b;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

/* Name of s: [p, p + *len). */
static const uint8_t *sym_name(const uint8_t *strtab, uint64_t strsz, uint32_t off, uint64_t *len)
{
    const uint8_t *p = strtab + off;
    const uint8_t *z = memchr(p, 0, strsz - off);
    *len = z ? (uint64_t)(z - p) : strsz - off;
    return p;
}

/* The name step of choose_best_symbol compares demangled names; demangling is the identity for
 * names not starting with "_Z", "_R" (Rust v0) or "_GLOBAL_" (demangle.py _IBERTY_PREFIXES),
 * and byte length equals Python's len() only for ASCII. Anything else goes back to Python. */
static int name_is_plain(const uint8_t *p, uint64_t len)
{
    if (len >= 2 && p[0] == '_' && (p[1] == 'Z' || p[1] == 'R'))
        return 0;
    if (len >= 8 && memcmp(p, "_GLOBAL_", 8) == 0)
        return 0;
    for (uint64_t i = 0; i < len; i++)
        if (p[i] & 0x80)
            return 0;
    return 1;
}

/* choose_best_symbol(a, b) (symbol.c): 1 if a wins, 0 if b wins, -1 if only demangled names
 * can tell. */
static int a_is_best(const struct unw_sym *a, const struct unw_sym *b, const uint8_t *strtab,
                     uint64_t strsz)
{
    int za = a->end == a->start, zb = b->end == b->start;
    if (za != zb)
        return zb;
    int wa = a->bind == STB_WEAK, wb = b->bind == STB_WEAK;
    if (wa != wb)
        return wb;
    int ga = a->bind == STB_GLOBAL, gb = b->bind == STB_GLOBAL;
    if (ga != gb)
        return ga;
    uint64_t la, lb;
    const uint8_t *na = sym_name(strtab, strsz, a->name, &la);
    const uint8_t *nb = sym_name(strtab, strsz, b->name, &lb);
    if (!name_is_plain(na, la) || !name_is_plain(nb, lb))
        return -1;
    uint64_t ua = 0, ub = 0;
    while (ua < la && na[ua] == '_')
        ua++;
    while (ub < lb && nb[ub] == '_')
        ub++;
    if (ua != ub)
        return ua < ub;
    if (la != lb)
        return la > lb;
    return 1;
}

int64_t unw_symtab_scan(const uint8_t *syms, uint64_t nsyms, const uint8_t *strtab,
                        uint64_t strsz, const uint8_t *secflags, uint32_t nsec, int arm,
                        struct unw_sym *out, uint64_t *nundecided)
{
    uint64_t n = 0;
    *nundecided = 0;
    for (uint64_t i = 0; i < nsyms; i++) {
        const uint8_t *s = syms + i * SYM_SIZE;
        uint32_t st_name = rd32(s);
        uint8_t info = s[4], other = s[5];
        uint16_t shndx = rd16(s + 6);
        if (st_name == 0 || shndx == SHN_UNDEF || shndx >= SHN_LORESERVE || shndx >= nsec)
            continue;
        uint8_t type = info & 0xf, sf = secflags[shndx];
        if (type != STT_FUNC && type != STT_GNU_IFUNC) {
            if (type != STT_NOTYPE || (other & 3) == STV_HIDDEN || (other & 3) == STV_INTERNAL)
                continue;
            if (!(sf & UNW_SEC_TEXT))
                continue;
        }
        if (!(sf & UNW_SEC_ALLOC) || st_name >= strsz)
            continue;
        if (arm) { /* ARM mapping symbols $a $d $t $x, optionally ".suffix" (perf rejects) */
            uint64_t len;
            const uint8_t *p = sym_name(strtab, strsz, st_name, &len);
            if (len >= 2 && p[0] == '$' && memchr("adtx", p[1], 4) && (len == 2 || p[2] == '.'))
                continue;
        }
        uint64_t value = rd64(s + 8), size = rd64(s + 16);
        struct unw_sym *o = &out[n++];
        o->start = value;
        o->end = value + size;
        o->name = st_name;
        o->index = (uint32_t)i;
        o->bind = info >> 4;
        o->keep = 1;
        o->pad = 0;
        o->pad2 = 0;
    }
    qsort(out, n, sizeof *out, cmp_sym);
    /* symbols__fixup_end: a zero-size symbol runs to the next start; the last one to the
     * next page boundary + one page. */
    for (uint64_t i = 0; i + 1 < n; i++)
        if (out[i].end == out[i].start)
            out[i].end = out[i + 1].start;
    if (n && out[n - 1].end == out[n - 1].start)
        out[n - 1].end = (out[n - 1].start + PAGE - 1) / PAGE * PAGE + PAGE;
    /* symbols__fixup_duplicate, group by group: the survivor of a left-to-right fold. */
    for (uint64_t g = 0; g < n;) {
        uint64_t e = g + 1;
        while (e < n && out[e].start == out[g].start)
            e++;
        if (e - g > 1) {
            uint64_t best = g;
            int undecided = 0;
            for (uint64_t k = g + 1; k < e && !undecided; k++) {
                int r = a_is_best(&out[best], &out[k], strtab, strsz);
                if (r < 0)
                    undecided = 1;
                else if (!r)
                    best = k;
            }
            for (uint64_t k = g; k < e; k++)
                out[k].keep = undecided ? UNW_SYM_UNDECIDED : k == best;
            if (undecided)
                *nundecided += e - g;
        }
        g = e;
    }
    return (int64_t)n;
}

uint64_t unw_symtab_compact(struct unw_sym *syms, uint64_t n)
{
    uint64_t w = 0;
    for (uint64_t i = 0; i < n; i++)
        if (syms[i].keep == 1)
            syms[w++] = syms[i];
    return w;
}

/* ------------------------------------------------------------------ /proc/kallsyms */

static int is_hex(uint8_t c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

static int is_space(uint8_t c) /* Python's \s on ASCII */
{
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}

static int cmp_ksym(const void *a, const void *b)
{
    const struct unw_ksym *x = a, *y = b;
    if (x->addr != y->addr)
        return x->addr < y->addr ? -1 : 1;
    return x->line < y->line ? -1 : x->line > y->line;
}

int64_t unw_kallsyms_parse(const uint8_t *text, uint64_t len, struct unw_ksym *out,
                           uint64_t cap)
{
    uint64_t n = 0, line = 0;
    for (uint64_t pos = 0; pos < len && n < cap; line++) {
        const uint8_t *nl = memchr(text + pos, '\n', len - pos);
        uint64_t end = nl ? (uint64_t)(nl - text) : len, next = end + 1;
        /* ^([0-9a-fA-F]+) [tTwW] (\S+)(?:[ \t]+\[([^\]\s]+)\])?[ \t]*$ (kallsyms.py) */
        uint64_t p = pos, addr = 0, nd = 0;
        while (p < end && is_hex(text[p])) {
            uint8_t c = text[p++];
            addr = addr << 4 | (uint64_t)(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
            nd++;
        }
        pos = next;
        if (nd == 0 || nd > 16 || p + 3 > end || text[p] != ' ' || text[p + 2] != ' ')
            continue;
        uint8_t t = text[p + 1];
        if (t != 't' && t != 'T' && t != 'w' && t != 'W')
            continue;
        uint64_t ns = p + 3, ne = ns;
        while (ne < end && !is_space(text[ne]))
            ne++;
        if (ne == ns || ne - ns > 0xffff)
            continue;
        uint64_t q = ne, ms = 0, me = 0;
        while (q < end && (text[q] == ' ' || text[q] == '\t'))
            q++;
        if (q > ne && q < end && text[q] == '[') {
            uint64_t a = q + 1, b = a;
            while (b < end && text[b] != ']' && !is_space(text[b]))
                b++;
            if (b > a && b < end && text[b] == ']' && b - a <= 0xffff) {
                ms = a;
                me = b;
                q = b + 1;
                while (q < end && (text[q] == ' ' || text[q] == '\t'))
                    q++;
            }
        }
        if (q != end || ns > UINT32_MAX || ms > UINT32_MAX)
            continue;
        struct unw_ksym *o = &out[n++];
        o->addr = addr;
        o->end = 0;
        o->name_off = (uint32_t)ns;
        o->name_len = (uint16_t)(ne - ns);
        o->mod_len = (uint16_t)(me - ms);
        o->mod_off = (uint32_t)ms;
        o->line = (uint32_t)line;
    }
    /* /proc/kallsyms lists the kernel's text in address order (modules after it, usually
     * above it): the sort is skipped when the symbols already are in (addr, line) order, an
     * O(n) check (glibc's qsort, a merge sort, costs O(n log n) on sorted input too). */
    uint64_t sorted = 1;
    while (sorted < n && cmp_ksym(&out[sorted - 1], &out[sorted]) <= 0)
        sorted++;
    if (sorted < n)
        qsort(out, n, sizeof *out, cmp_ksym);
    /* symbols__fixup_end(is_kallsyms): up to the next symbol, except across the kernel/module
     * boundary, where a symbol gets one page. */
    for (uint64_t i = 0; i + 1 < n; i++) {
        if ((out[i].mod_len == 0) != (out[i + 1].mod_len == 0))
            out[i].end = (out[i].addr + PAGE) / PAGE * PAGE + PAGE;
        else
            out[i].end = out[i + 1].addr;
    }
    if (n)
        out[n - 1].end = (out[n - 1].addr + PAGE - 1) / PAGE * PAGE + PAGE;
    return (int64_t)n;
}

uint32_t unw_symtab_max_offset(const uint8_t *offs, uint64_t n, uint32_t skip, uint64_t *nskip)
{
    uint32_t top = 0;
    uint64_t k = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t v;
        memcpy(&v, offs + 4 * i, 4);
        if (v == skip)
            k++;
        else if (v > top)
            top = v;
    }
    *nskip = k;
    return top;
}

/* The function-padding symbol the kernel names after the function that follows it
 * (CONFIG_FUNCTION_PADDING_BYTES: "__pfx_" + name, 16 bytes before it, so next in address
 * order): about half of a recent x86-64 kernel's text symbols. */
static const char PFX[] = "__pfx_";
#define PFX_LEN (sizeof PFX - 1)
#define KSYM_BLOCK 16 /* kallsyms.py _BLOCK */

int64_t unw_kallsyms_pack(const uint8_t *text, const struct unw_ksym *syms, uint64_t n,
                          uint8_t *names, uint64_t *names_len, uint32_t *block_at,
                          uint32_t *run_at, uint16_t *run_mod, uint64_t *nruns,
                          uint32_t *mods_off, uint16_t *mods_len, uint64_t mods_cap,
                          uint64_t base, uint32_t *starts32)
{
    uint64_t pos = 0, nmods = 1; /* module 0: the kernel image (no module) */
    uint64_t last = 0, runs = 0;
    for (uint64_t i = 0; i < n; i++) {
        const struct unw_ksym *s = &syms[i];
        if (starts32)
            starts32[i] = (uint32_t)(s->addr - base);
        if (i % KSYM_BLOCK == 0)
            block_at[i / KSYM_BLOCK] = (uint32_t)pos;
        const struct unw_ksym *nx = i + 1 < n ? &syms[i + 1] : NULL;
        /* "__pfx_" + the next symbol's name: kept as an empty name (a parsed name never is
         * one), spelled out again on lookup */
        uint64_t len = s->name_len;
        if (nx && len == PFX_LEN + nx->name_len && memcmp(text + s->name_off, PFX, PFX_LEN) == 0 &&
            memcmp(text + s->name_off + PFX_LEN, text + nx->name_off, nx->name_len) == 0)
            len = 0;
        if (len < 255) {
            names[pos++] = (uint8_t)len;
        } else {
            names[pos] = 255;
            names[pos + 1] = (uint8_t)(len & 0xff);
            names[pos + 2] = (uint8_t)(len >> 8);
            pos += 3;
        }
        memcpy(names + pos, text + s->name_off, len);
        pos += len;
        uint64_t m = 0;
        if (s->mod_len) {
            const uint8_t *mp = text + s->mod_off;
            if (last && mods_len[last] == s->mod_len &&
                memcmp(text + mods_off[last], mp, s->mod_len) == 0) {
                m = last;
            } else {
                for (m = 1; m < nmods; m++)
                    if (mods_len[m] == s->mod_len && memcmp(text + mods_off[m], mp, s->mod_len) == 0)
                        break;
                if (m == nmods) {
                    if (nmods >= mods_cap || nmods > 0xffff)
                        return -1;
                    mods_off[m] = s->mod_off;
                    mods_len[m] = s->mod_len;
                    nmods++;
                }
                last = m;
            }
        }
        if (runs == 0 || run_mod[runs - 1] != m) {
            run_at[runs] = (uint32_t)i;
            run_mod[runs++] = (uint16_t)m;
        }
    }
    *names_len = pos;
    *nruns = runs;
    return (int64_t)nmods;
}
