/* dwarfline.c: a binary's DWARF line programs and inline trees compiled into one compact,
 * position-independent table (unw_srcline_compile), the table srclines.py looks source lines
 * and inline chains up in by binary search.
 *
 * What it reads (DWARF 5 sections 6.2 and 7.5, DWARF 4 likewise): every unit of .debug_info
 * (versions 2..5; type units skipped), its abbreviations, each compile unit's line program
 * (.debug_line, with the DWARF 5 entry-format file tables and .debug_line_str), and every
 * DW_TAG_inlined_subroutine with its pc ranges (low_pc/high_pc, DW_AT_ranges through
 * .debug_ranges or .debug_rnglists, addrx through .debug_addr), its call_file/call_line and the
 * name of what was inlined, followed through DW_AT_abstract_origin / DW_AT_specification to a
 * DW_AT_linkage_name (preferred, as binutils' dwarf2.c find_abstract_instance does) or
 * DW_AT_name. Each function's DW_AT_decl_file/DW_AT_decl_line (where its source starts: pprof's
 * Function.filename and start_line) are taken from the first DIE of that same chain that has
 * them, starting at the subprogram or inlined subroutine itself (gcc puts them on an
 * out-of-class C++ definition, on the abstract instance an inlined or out-of-line copy points
 * to, or on the declaration a definition's DW_AT_specification names); a decl_file is an index
 * into the line program of the unit that holds its DIE, so one found in another unit
 * (DW_FORM_ref_addr) keeps its line and loses its file.
 * Compressed sections are inflated by the caller (srclines.py): no zlib here.
 *
 * Invariants:
 * - Every read is bounds-checked (struct rd latches an error); bad input is counted in the
 *   table's errors[] (UNW_SL_ERR_*) and the unit, program or DIE it is in is skipped, never
 *   the whole compile.
 * - Work and memory are O(input): each DIE and line opcode is read once; an origin chain is at
 *   most SL_MAX_HOPS long and its answer is memoised; DIE nesting is capped at SL_MAX_DEPTH;
 *   rows, nodes and ranges are each bounded by the bytes that encode them, and the whole table
 *   by UNW_SL_MAX_ROWS. No allocation outlives the call but *out (unw_free).
 * - Table (little-endian, columns so that Python can array.frombytes each one):
 *     struct unw_srcline_hdr
 *     u64 line_addr[nlines]; u32 line_file[nlines]; u32 line_no[nlines]
 *         rows ascending by address; row i covers [addr_i, addr_{i+1}); file UNW_SL_NONE
 *         means no line there (an end of sequence)
 *     u64 seg_addr[nsegs]; u32 seg_node[nsegs]
 *         the innermost inline node from seg_addr_i on (UNW_SL_NONE: none)
 *     u32 node_name[nnodes], node_file[], node_line[], node_parent[], node_kind[],
 *         node_decl_file[], node_decl_line[]
 *         a DW_TAG_subprogram with code (kind UNW_SL_SUBPROGRAM) or a DW_TAG_inlined_subroutine
 *         (UNW_SL_INLINED); name: string offset (UNW_SL_NONE: unknown); file/line: an inlined
 *         one's call site; parent: the node the call site is in, a lower index, or
 *         UNW_SL_NONE; decl_file/decl_line: where the function's source starts (file
 *         UNW_SL_NONE, line 0: unknown)
 *     u32 file_name[nfiles]: string offsets of full paths
 *     strtab (NUL-terminated strings)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dwread.h"
#include "unwcore.h"

#define SL_MAX_HOPS 16
#define SL_MAX_DEPTH 256
#define SL_MAX_ATTRS 256

/* DW_FORM_* (DWARF 5 7.5.6, GNU extensions) */
enum {
    F_addr = 0x01, F_block2 = 0x03, F_block4 = 0x04, F_data2 = 0x05, F_data4 = 0x06,
    F_data8 = 0x07, F_string = 0x08, F_block = 0x09, F_block1 = 0x0a, F_data1 = 0x0b,
    F_flag = 0x0c, F_sdata = 0x0d, F_strp = 0x0e, F_udata = 0x0f, F_ref_addr = 0x10,
    F_ref1 = 0x11, F_ref2 = 0x12, F_ref4 = 0x13, F_ref8 = 0x14, F_ref_udata = 0x15,
    F_indirect = 0x16, F_sec_offset = 0x17, F_exprloc = 0x18, F_flag_present = 0x19,
    F_strx = 0x1a, F_addrx = 0x1b, F_ref_sup4 = 0x1c, F_strp_sup = 0x1d, F_data16 = 0x1e,
    F_line_strp = 0x1f, F_ref_sig8 = 0x20, F_implicit_const = 0x21, F_loclistx = 0x22,
    F_rnglistx = 0x23, F_ref_sup8 = 0x24, F_strx1 = 0x25, F_strx2 = 0x26, F_strx3 = 0x27,
    F_strx4 = 0x28, F_addrx1 = 0x29, F_addrx2 = 0x2a, F_addrx3 = 0x2b, F_addrx4 = 0x2c,
    F_GNU_addr_index = 0x1f01, F_GNU_str_index = 0x1f02, F_GNU_ref_alt = 0x1f20,
    F_GNU_strp_alt = 0x1f21,
};
/* DW_AT_* / DW_TAG_* used */
enum {
    AT_name = 0x03, AT_stmt_list = 0x10, AT_low_pc = 0x11, AT_high_pc = 0x12,
    AT_comp_dir = 0x1b, AT_decl_file = 0x3a, AT_decl_line = 0x3b, AT_abstract_origin = 0x31,
    AT_specification = 0x47, AT_ranges = 0x55,
    AT_call_file = 0x58, AT_call_line = 0x59, AT_linkage_name = 0x6e,
    AT_str_offsets_base = 0x72, AT_addr_base = 0x73, AT_rnglists_base = 0x74,
    AT_MIPS_linkage_name = 0x2007, AT_GNU_addr_base = 0x2133,
    TAG_inlined_subroutine = 0x1d, TAG_subprogram = 0x2e,
};

/* ------------------------------------------------------------------ bounded reader */

static void skip(struct rd *r, uint64_t n)
{
    if (rd_need(r, n))
        r->p += n;
}

/* A NUL-terminated string at r (advanced past it), NULL if unterminated. */
static const char *cstr(struct rd *r)
{
    if (r->err)
        return NULL;
    const uint8_t *z = memchr(r->p, 0, (size_t)(r->end - r->p));
    if (!z) {
        r->err = 1;
        r->p = r->end;
        return NULL;
    }
    const char *s = (const char *)r->p;
    r->p = z + 1;
    return s;
}

/* The string at off of a string section, NULL if off is outside it or it is unterminated. */
static const char *sec_str(const uint8_t *sec, uint64_t len, uint64_t off)
{
    if (!sec || off >= len || !memchr(sec + off, 0, len - off))
        return NULL;
    return (const char *)sec + off;
}

/* ------------------------------------------------------------------ growable arrays */

#define VEC(T) struct { T *v; uint64_t n, cap; }
#define VPUSH(ctx, vec, val)                                                        \
    do {                                                                            \
        if ((vec).n == (vec).cap && grow((void **)&(vec).v, &(vec).cap,             \
                                         sizeof(*(vec).v)) != 0) {                  \
            (ctx)->oom = 1;                                                         \
            break;                                                                  \
        }                                                                           \
        (vec).v[(vec).n++] = (val);                                                 \
    } while (0)

static int grow(void **p, uint64_t *cap, size_t elt)
{
    uint64_t nc = *cap ? *cap * 2 : 64;
    if (nc > UNW_SL_MAX_ROWS)
        return -1;
    void *q = realloc(*p, nc * elt);
    if (!q)
        return -1;
    *p = q;
    *cap = nc;
    return 0;
}

struct row { uint64_t addr; uint32_t file, line, idx; uint8_t end; };
struct rng { uint64_t lo, hi; uint32_t node, depth; };
struct node { uint32_t name, file, line, parent, kind, decl_file, decl_line; };
struct attrspec { uint32_t at, form; int64_t implicit; };
struct abbrev { uint64_t code; uint32_t tag, first, nattr; uint8_t children; };
/* what an origin chain resolves to: the name, and the decl line and file (a file index of the
 * line program of unit number decl_unit, UINT32_MAX: none) */
struct origin { uint32_t name, decl_line, decl_file, decl_unit; };
struct memo { uint64_t off; struct origin o; uint32_t used; };

struct unit {
    uint64_t off, end, die_off;     /* unit start, end, first DIE */
    uint64_t abbrev_off;
    uint64_t str_offsets_base, addr_base, rnglists_base, low_pc;
    uint8_t version, addr_size, offset_size, skip;
    uint32_t ab_first, ab_n;        /* its abbrevs in ctx.abbrevs */
    int ab_dense;                   /* code k is abbrevs[ab_first + k - 1] */
};

struct ctx {
    const struct unw_dwarf_sections *s;
    int oom;
    uint32_t errors[UNW_SL_NERR];
    VEC(struct row) rows;
    VEC(struct rng) rngs;
    VEC(struct node) nodes;
    VEC(uint32_t) files;            /* global file id -> string offset */
    VEC(char) strtab;
    VEC(struct attrspec) specs;
    VEC(struct abbrev) abbrevs;
    VEC(struct unit) units;
    VEC(uint32_t) cufiles;          /* this unit's line-program file index -> global file id */
    /* string interning: open addressing over strtab offsets (0 = empty; strtab[0] is "") */
    uint32_t *sh;
    uint64_t shcap, shn;
    /* DIE offset -> what its origin chain resolves to (memo of resolve) */
    struct memo *mh;
    uint64_t mhcap, mhn;
};

static void err(struct ctx *c, int e)
{
    if (c->errors[e] < UINT32_MAX)
        c->errors[e]++;
}

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)s[i]) * 1099511628211ULL;
    return h;
}

/* The strtab offset of string s[0, n) (interned), UNW_SL_NONE on allocation failure. */
static uint32_t intern(struct ctx *c, const char *s, size_t n)
{
    if (c->shn * 2 >= c->shcap) {
        uint64_t nc = c->shcap ? c->shcap * 2 : 1024;
        uint32_t *nh = calloc(nc, sizeof *nh);
        if (!nh) {
            c->oom = 1;
            return UNW_SL_NONE;
        }
        for (uint64_t i = 0; i < c->shcap; i++) {
            uint32_t o = c->sh[i];
            if (!o)
                continue;
            const char *t = c->strtab.v + o;
            uint64_t j = hash_bytes(t, strlen(t)) & (nc - 1);
            while (nh[j])
                j = (j + 1) & (nc - 1);
            nh[j] = o;
        }
        free(c->sh);
        c->sh = nh;
        c->shcap = nc;
    }
    uint64_t j = hash_bytes(s, n) & (c->shcap - 1);
    while (c->sh[j]) {
        const char *t = c->strtab.v + c->sh[j];
        if (strncmp(t, s, n) == 0 && t[n] == 0)
            return c->sh[j];
        j = (j + 1) & (c->shcap - 1);
    }
    if (c->strtab.n + n + 1 >= UINT32_MAX) {
        err(c, UNW_SL_ERR_CAP);
        return UNW_SL_NONE;
    }
    uint32_t off = (uint32_t)c->strtab.n;
    for (size_t i = 0; i < n; i++)
        VPUSH(c, c->strtab, s[i]);
    VPUSH(c, c->strtab, 0);
    if (c->oom)
        return UNW_SL_NONE;
    c->sh[j] = off;
    c->shn++;
    return off;
}

/* ------------------------------------------------------------------ units and abbrevs */

/* Parse the abbreviation table at off into ctx.abbrevs/specs for unit u. */
static int load_abbrevs(struct ctx *c, struct unit *u)
{
    const struct unw_dwarf_sections *s = c->s;
    if (u->abbrev_off >= s->abbrev_len)
        return -1;
    struct rd r = {s->abbrev + u->abbrev_off, s->abbrev + s->abbrev_len, 0};
    u->ab_first = (uint32_t)c->abbrevs.n;
    u->ab_dense = 1;
    for (;;) {
        uint64_t code = rd_uleb(&r);
        if (r.err)
            return -1;
        if (code == 0)
            break;
        struct abbrev a = {code, (uint32_t)rd_uleb(&r), (uint32_t)c->specs.n, 0, 0};
        if (!rd_need(&r, 1))
            return -1;
        a.children = *r.p++;
        for (;;) {
            uint32_t at = (uint32_t)rd_uleb(&r), form = (uint32_t)rd_uleb(&r);
            int64_t ic = form == F_implicit_const ? rd_sleb(&r) : 0;
            if (r.err || a.nattr > SL_MAX_ATTRS)
                return -1;
            if (at == 0 && form == 0)
                break;
            struct attrspec sp = {at, form, ic};
            VPUSH(c, c->specs, sp);
            a.nattr++;
        }
        if (code != c->abbrevs.n - u->ab_first + 1)
            u->ab_dense = 0;
        VPUSH(c, c->abbrevs, a);
        if (c->oom)
            return -1;
    }
    u->ab_n = (uint32_t)(c->abbrevs.n - u->ab_first);
    return 0;
}

static const struct abbrev *find_abbrev(struct ctx *c, const struct unit *u, uint64_t code)
{
    if (u->ab_dense)
        return code >= 1 && code <= u->ab_n ? &c->abbrevs.v[u->ab_first + code - 1] : NULL;
    for (uint32_t i = 0; i < u->ab_n; i++)
        if (c->abbrevs.v[u->ab_first + i].code == code)
            return &c->abbrevs.v[u->ab_first + i];
    return NULL;
}

/* The unit containing .debug_info offset off (units are sorted by offset). */
static struct unit *unit_of(struct ctx *c, uint64_t off)
{
    uint64_t lo = 0, hi = c->units.n;
    while (lo < hi) {
        uint64_t mid = (lo + hi) / 2;
        if (c->units.v[mid].off <= off)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (!lo)
        return NULL;
    struct unit *u = &c->units.v[lo - 1];
    return off >= u->die_off && off < u->end && !u->skip ? u : NULL;
}

/* One attribute value, decoded as far as this file needs: */
struct val {
    uint64_t u;       /* constants, addresses (resolved addrx), offsets, references (absolute) */
    const char *str;  /* string forms, resolved */
    uint8_t is_ref, is_str, is_addr, is_const, is_index, bad;
};

static uint64_t addr_at(struct ctx *c, const struct unit *u, uint64_t idx, int *ok)
{
    const struct unw_dwarf_sections *s = c->s;
    uint64_t off = u->addr_base + idx * u->addr_size;
    if (idx > s->addr_len || off + u->addr_size > s->addr_len || off < u->addr_base) {
        *ok = 0;
        return 0;
    }
    struct rd r = {s->addr + off, s->addr + s->addr_len, 0};
    return rd_le(&r, u->addr_size);
}

static const char *strx_at(struct ctx *c, const struct unit *u, uint64_t idx)
{
    const struct unw_dwarf_sections *s = c->s;
    uint64_t off = u->str_offsets_base + idx * u->offset_size;
    if (idx > s->str_offsets_len || off + u->offset_size > s->str_offsets_len)
        return NULL;
    struct rd r = {s->str_offsets + off, s->str_offsets + s->str_offsets_len, 0};
    return sec_str(s->str, s->str_len, rd_le(&r, u->offset_size));
}

/* Read one attribute of form `form` at r. Unknown forms set r->err (the DIE cannot be
 * walked past). */
static void read_form(struct ctx *c, const struct unit *u, struct rd *r, uint32_t form,
                      int64_t implicit, struct val *v)
{
    const struct unw_dwarf_sections *s = c->s;
    memset(v, 0, sizeof *v);
    int ok = 1;
    for (int ind = 0; form == F_indirect && ind < 4; ind++)
        form = (uint32_t)rd_uleb(r);
    switch (form) {
    case F_addr: v->u = rd_le(r, u->addr_size); v->is_addr = 1; break;
    case F_addrx: case F_GNU_addr_index:
        v->u = addr_at(c, u, rd_uleb(r), &ok); v->is_addr = 1; v->bad = !ok; break;
    case F_addrx1: case F_addrx2: case F_addrx3: case F_addrx4:
        v->u = addr_at(c, u, rd_le(r, form - F_addrx1 + 1), &ok); v->is_addr = 1; v->bad = !ok;
        break;
    case F_block1: skip(r, rd_le(r, 1)); break;
    case F_block2: skip(r, rd_le(r, 2)); break;
    case F_block4: skip(r, rd_le(r, 4)); break;
    case F_block: case F_exprloc: skip(r, rd_uleb(r)); break;
    case F_data1: case F_ref1: case F_flag: case F_strx1:
        v->u = rd_le(r, 1); break;
    case F_data2: case F_ref2: case F_strx2: v->u = rd_le(r, 2); break;
    case F_strx3: v->u = rd_le(r, 3); break;
    case F_data4: case F_ref4: case F_ref_sup4: case F_strx4: v->u = rd_le(r, 4); break;
    case F_data8: case F_ref8: case F_ref_sig8: case F_ref_sup8: v->u = rd_le(r, 8); break;
    case F_data16: skip(r, 16); break;
    case F_sdata: v->u = (uint64_t)rd_sleb(r); break;
    case F_udata: case F_ref_udata: case F_strx: case F_GNU_str_index: case F_loclistx:
    case F_rnglistx:
        v->u = rd_uleb(r); break;
    case F_implicit_const: v->u = (uint64_t)implicit; break;
    case F_flag_present: v->u = 1; break;
    case F_string: v->str = cstr(r); v->is_str = v->str != NULL; break;
    case F_strp: case F_line_strp: case F_sec_offset: case F_strp_sup: case F_GNU_strp_alt:
    case F_GNU_ref_alt:
        v->u = rd_le(r, u->offset_size); break;
    case F_ref_addr: v->u = rd_le(r, u->version <= 2 ? u->addr_size : u->offset_size); break;
    default: r->err = 1; return;
    }
    switch (form) {
    case F_data1: case F_data2: case F_data4: case F_data8: case F_sdata: case F_udata:
    case F_implicit_const:
        v->is_const = 1; break;
    case F_ref1: case F_ref2: case F_ref4: case F_ref8: case F_ref_udata:
        v->u += u->off; v->is_ref = 1; break;
    case F_ref_addr: v->is_ref = 1; break;
    case F_strp: v->str = sec_str(s->str, s->str_len, v->u); v->is_str = v->str != NULL; break;
    case F_line_strp:
        v->str = sec_str(s->line_str, s->line_str_len, v->u); v->is_str = v->str != NULL; break;
    case F_strx: case F_GNU_str_index: case F_strx1: case F_strx2: case F_strx3: case F_strx4:
        v->str = strx_at(c, u, v->u); v->is_str = v->str != NULL; break;
    case F_rnglistx: v->is_index = 1; break;
    default: break;
    }
}

/* What the walk needs of one DIE. */
struct die {
    uint32_t tag;
    uint8_t children, has_lo, has_hi, hi_is_off, has_ranges, ranges_index;
    uint64_t lo, hi, ranges, origin, spec, call_file, call_line, decl_file, decl_line;
    uint8_t has_origin, has_spec, has_decl;
    const char *name, *linkage;
};

/* Read the DIE at r (its abbrev code first). Returns 1 for a DIE, 0 for a null entry, -1 on
 * error. */
static int read_die(struct ctx *c, const struct unit *u, struct rd *r, struct die *d)
{
    uint64_t code = rd_uleb(r);
    if (r->err)
        return -1;
    if (code == 0)
        return 0;
    const struct abbrev *a = find_abbrev(c, u, code);
    if (!a)
        return -1;
    memset(d, 0, sizeof *d);
    d->tag = a->tag;
    d->children = a->children;
    struct val v;
    for (uint32_t i = 0; i < a->nattr; i++) {
        const struct attrspec *sp = &c->specs.v[a->first + i];
        read_form(c, u, r, sp->form, sp->implicit, &v);
        if (r->err)
            return -1;
        switch (sp->at) {
        case AT_low_pc: if (v.is_addr && !v.bad) { d->lo = v.u; d->has_lo = 1; } break;
        case AT_high_pc:
            if (v.bad)
                break;
            d->hi = v.u;
            d->has_hi = 1;
            d->hi_is_off = v.is_const;
            break;
        case AT_ranges: d->ranges = v.u; d->has_ranges = 1; d->ranges_index = v.is_index; break;
        case AT_abstract_origin:
            if (v.is_ref) { d->origin = v.u; d->has_origin = 1; } break;
        case AT_specification: if (v.is_ref) { d->spec = v.u; d->has_spec = 1; } break;
        case AT_name: if (v.is_str) d->name = v.str; break;
        case AT_linkage_name: case AT_MIPS_linkage_name: if (v.is_str) d->linkage = v.str; break;
        case AT_call_file: d->call_file = v.u; break;
        case AT_call_line: d->call_line = v.u; break;
        case AT_decl_file: if (v.is_const) d->decl_file = v.u; break;
        case AT_decl_line: if (v.is_const) { d->decl_line = v.u; d->has_decl = 1; } break;
        default: break;
        }
    }
    return 1;
}

/* ------------------------------------------------------------------ names */

static struct origin *memo_slot(struct ctx *c, uint64_t off, int insert)
{
    if (insert && c->mhn * 2 >= c->mhcap) {
        uint64_t nc = c->mhcap ? c->mhcap * 2 : 1024;
        struct memo *nh = calloc(nc, sizeof *nh);
        if (!nh) {
            c->oom = 1;
            return NULL;
        }
        for (uint64_t i = 0; i < c->mhcap; i++) {
            if (!c->mh[i].used)
                continue;
            uint64_t j = (c->mh[i].off * 0x9E3779B97F4A7C15ULL >> 20) & (nc - 1);
            while (nh[j].used)
                j = (j + 1) & (nc - 1);
            nh[j] = c->mh[i];
        }
        free(c->mh);
        c->mh = nh;
        c->mhcap = nc;
    }
    if (!c->mhcap)
        return NULL;
    uint64_t j = (off * 0x9E3779B97F4A7C15ULL >> 20) & (c->mhcap - 1);
    while (c->mh[j].used) {
        if (c->mh[j].off == off)
            return &c->mh[j].o;
        j = (j + 1) & (c->mhcap - 1);
    }
    if (!insert)
        return NULL;
    c->mh[j].used = 1;
    c->mh[j].off = off;
    c->mh[j].o.name = UNW_SL_NONE;
    c->mh[j].o.decl_line = 0;
    c->mh[j].o.decl_file = c->mh[j].o.decl_unit = UINT32_MAX;
    c->mhn++;
    return &c->mh[j].o;
}

/* The name of the function the DIE at .debug_info offset off stands for: its linkage name,
 * else its name, else its origin's or specification's, at most SL_MAX_HOPS DIEs deep (a cycle
 * or a longer chain is a counted UNW_SL_ERR_REF); and the decl line and file of the first DIE
 * on that chain that has a decl line. Memoised by offset. */
static struct origin resolve(struct ctx *c, uint64_t off)
{
    struct origin *m = memo_slot(c, off, 0);
    if (m)
        return *m;
    uint64_t chain[SL_MAX_HOPS];
    uint32_t nchain = 0;
    struct origin o = {UNW_SL_NONE, 0, UINT32_MAX, UINT32_MAX};
    int named = 0;
    const char *plain = NULL;
    uint64_t cur = off;
    for (;;) {
        struct origin *hit = memo_slot(c, cur, 0);
        if (hit && nchain) {
            if (!named)
                o.name = hit->name;
            if (!o.decl_line) {
                o.decl_line = hit->decl_line;
                o.decl_file = hit->decl_file;
                o.decl_unit = hit->decl_unit;
            }
            break;
        }
        if (nchain == SL_MAX_HOPS) {
            err(c, UNW_SL_ERR_REF);
            break;
        }
        chain[nchain++] = cur;
        struct unit *u = unit_of(c, cur);
        if (!u) {
            err(c, UNW_SL_ERR_REF);
            break;
        }
        struct rd r = {c->s->info + cur, c->s->info + u->end, 0};
        struct die d;
        if (read_die(c, u, &r, &d) != 1) {
            err(c, UNW_SL_ERR_REF);
            break;
        }
        if (d.has_decl && !o.decl_line && d.decl_line && d.decl_line < UINT32_MAX) {
            o.decl_line = (uint32_t)d.decl_line;
            o.decl_file = d.decl_file < UINT32_MAX ? (uint32_t)d.decl_file : UINT32_MAX;
            o.decl_unit = (uint32_t)(u - c->units.v);
        }
        if (d.linkage && !named) {
            o.name = intern(c, d.linkage, strlen(d.linkage));
            named = 1;
        }
        if (d.name && !plain)
            plain = d.name;
        if (named && o.decl_line)
            break;
        if (d.has_origin)
            cur = d.origin;
        else if (d.has_spec)
            cur = d.spec;
        else
            break;
        int cyc = 0;
        for (uint32_t i = 0; i < nchain; i++)
            cyc |= chain[i] == cur;
        if (cyc) {
            err(c, UNW_SL_ERR_REF);
            break;
        }
    }
    if (o.name == UNW_SL_NONE && plain)
        o.name = intern(c, plain, strlen(plain));
    m = memo_slot(c, off, 1);
    if (m)
        *m = o;
    return o;
}

/* ------------------------------------------------------------------ line programs */

/* dir + "/" + name (name alone if absolute or dir empty) interned as a file id. */
static uint32_t add_file(struct ctx *c, const char *dir, const char *cdir, const char *name)
{
    char buf[4096];
    size_t n = 0;
    const char *parts[3] = {NULL, NULL, name};
    if (name[0] != '/') {
        parts[1] = dir;
        if (dir && dir[0] != '/')
            parts[0] = cdir;
    }
    for (int i = 0; i < 3; i++) {
        const char *p = parts[i];
        if (!p || !p[0])
            continue;
        size_t l = strlen(p);
        if (n && buf[n - 1] != '/' && n < sizeof buf)
            buf[n++] = '/';
        if (n + l >= sizeof buf) {
            l = sizeof buf - 1 - n;
        }
        memcpy(buf + n, p, l);
        n += l;
    }
    uint32_t off = intern(c, buf, n);
    if (off == UNW_SL_NONE)
        return UNW_SL_NONE;
    /* file ids are deduplicated through the string: a path interned earlier has its id */
    for (uint64_t i = c->files.n; i > 0 && i + 64 > c->files.n; i--)
        if (c->files.v[i - 1] == off)
            return (uint32_t)(i - 1);
    VPUSH(c, c->files, off);
    return c->oom ? UNW_SL_NONE : (uint32_t)(c->files.n - 1);
}

/* DWARF 5 6.2.4.1 entry formats: read one directory/file entry as (path, dir index). */
struct lfmt { uint32_t type, form; };

static int read_entry(struct ctx *c, const struct unit *lu, struct rd *r, const struct lfmt *f,
                      uint32_t nf, const char **path, uint64_t *dir)
{
    *path = NULL;
    *dir = 0;
    for (uint32_t i = 0; i < nf; i++) {
        struct val v;
        read_form(c, lu, r, f[i].form, 0, &v);
        if (r->err)
            return -1;
        if (f[i].type == 1 && v.is_str) /* DW_LNCT_path */
            *path = v.str;
        else if (f[i].type == 2) /* DW_LNCT_directory_index */
            *dir = v.u;
    }
    return 0;
}

#define MAX_DIRS 65536

/* Run the line program at .debug_line offset off of unit u (comp_dir, cu name for DWARF <= 4
 * directory/file 0), appending rows and filling ctx.cufiles. */
static int line_program(struct ctx *c, const struct unit *u, uint64_t off, const char *comp_dir)
{
    const struct unw_dwarf_sections *s = c->s;
    c->cufiles.n = 0;
    if (off >= s->line_len)
        return -1;
    struct rd r = {s->line + off, s->line + s->line_len, 0};
    uint64_t len = rd_le(&r, 4);
    unsigned osz = 4;
    if (len == 0xffffffff) {
        len = rd_le(&r, 8);
        osz = 8;
    }
    if (r.err || len > (uint64_t)(r.end - r.p))
        return -1;
    const uint8_t *end = r.p + len;
    r.end = end;
    uint16_t ver = (uint16_t)rd_le(&r, 2);
    if (ver < 2 || ver > 5)
        return -1;
    struct unit lu = *u; /* forms inside the header use the line table's sizes */
    lu.offset_size = (uint8_t)osz;
    if (ver >= 5) {
        lu.addr_size = (uint8_t)rd_le(&r, 1);
        rd_le(&r, 1); /* segment selector size */
    }
    uint64_t hlen = rd_le(&r, osz);
    if (r.err || hlen > (uint64_t)(end - r.p))
        return -1;
    const uint8_t *prog = r.p + hlen;
    unsigned min_inst = (unsigned)rd_le(&r, 1);
    if (ver >= 4)
        rd_le(&r, 1); /* maximum_operations_per_instruction: VLIW only */
    rd_le(&r, 1);     /* default_is_stmt */
    int line_base = (int8_t)rd_le(&r, 1);
    unsigned line_range = (unsigned)rd_le(&r, 1);
    unsigned opbase = (unsigned)rd_le(&r, 1);
    if (r.err || line_range == 0 || opbase == 0)
        return -1;
    uint8_t oplen[256] = {0};
    for (unsigned i = 1; i < opbase; i++)
        oplen[i] = (uint8_t)rd_le(&r, 1);
    const char *dirs_small[256];
    const char **dirs = dirs_small;
    uint64_t ndirs = 0;
    int rc = -1;
    if (ver >= 5) {
        struct lfmt df[32], ff[32];
        uint32_t ndf = (uint32_t)rd_le(&r, 1);
        if (ndf > 32)
            return -1;
        for (uint32_t i = 0; i < ndf; i++) {
            df[i].type = (uint32_t)rd_uleb(&r);
            df[i].form = (uint32_t)rd_uleb(&r);
        }
        ndirs = rd_uleb(&r);
        if (r.err || ndirs > MAX_DIRS)
            return -1;
        if (ndirs > 256 && !(dirs = malloc(ndirs * sizeof *dirs))) {
            c->oom = 1;
            return -1;
        }
        for (uint64_t i = 0; i < ndirs; i++) {
            uint64_t dummy;
            if (read_entry(c, &lu, &r, df, ndf, &dirs[i], &dummy) != 0)
                goto out;
        }
        uint32_t nff = (uint32_t)rd_le(&r, 1);
        if (nff > 32)
            goto out;
        for (uint32_t i = 0; i < nff; i++) {
            ff[i].type = (uint32_t)rd_uleb(&r);
            ff[i].form = (uint32_t)rd_uleb(&r);
        }
        uint64_t nfiles = rd_uleb(&r);
        if (r.err || nfiles > (uint64_t)(end - r.p))
            goto out;
        for (uint64_t i = 0; i < nfiles; i++) {
            const char *path;
            uint64_t d;
            if (read_entry(c, &lu, &r, ff, nff, &path, &d) != 0)
                goto out;
            uint32_t id = path ? add_file(c, d < ndirs ? dirs[d] : NULL, comp_dir, path)
                               : UNW_SL_NONE;
            VPUSH(c, c->cufiles, id);
        }
    } else {
        /* DWARF 4 6.2.4: directory 0 is the compilation directory; file 0 is not used */
        dirs[ndirs++] = comp_dir;
        for (;;) {
            const char *d = cstr(&r);
            if (!d)
                goto out;
            if (!d[0])
                break;
            if (ndirs == MAX_DIRS)
                goto out;
            if (ndirs == 256) {
                const char **nd = malloc(MAX_DIRS * sizeof *nd);
                if (!nd) {
                    c->oom = 1;
                    goto out;
                }
                memcpy(nd, dirs_small, sizeof dirs_small);
                dirs = nd;
            }
            dirs[ndirs++] = d;
        }
        VPUSH(c, c->cufiles, UNW_SL_NONE);
        for (;;) {
            const char *f = cstr(&r);
            if (!f)
                goto out;
            if (!f[0])
                break;
            uint64_t d = rd_uleb(&r);
            rd_uleb(&r);
            rd_uleb(&r);
            VPUSH(c, c->cufiles, add_file(c, d < ndirs ? dirs[d] : NULL, comp_dir, f));
        }
    }
    if (r.err || c->oom || prog > end)
        goto out;
    /* the program (DWARF 5 6.2.5) */
    r.p = prog;
    uint64_t addr = 0, file = 1, line = 1;
    uint64_t rows0 = c->rows.n;
    while (r.p < end && !r.err && !c->oom) {
        unsigned op = *r.p++;
        int emit = 0, endseq = 0;
        if (op >= opbase) {
            unsigned adj = op - opbase;
            addr += (uint64_t)(adj / line_range) * min_inst;
            line += (int64_t)line_base + (int64_t)(adj % line_range);
            emit = 1;
        } else if (op == 0) {
            uint64_t n = rd_uleb(&r);
            if (n == 0 || !rd_need(&r, n))
                break;
            const uint8_t *next = r.p + n;
            unsigned sub = *r.p++;
            if (sub == 1) {
                emit = endseq = 1;
            } else if (sub == 2) {
                struct rd a = {r.p, next, 0};
                addr = rd_le(&a, n - 1 > 8 ? 8 : (unsigned)(n - 1));
            }
            r.p = next;
        } else {
            switch (op) {
            case 1: emit = 1; break;
            case 2: addr += rd_uleb(&r) * min_inst; break;
            case 3: line += (uint64_t)rd_sleb(&r); break;
            case 4: file = rd_uleb(&r); break;
            case 8: addr += (uint64_t)((255 - opbase) / line_range) * min_inst; break;
            case 9: addr += rd_le(&r, 2); break;
            default:
                for (unsigned i = 0; i < oplen[op]; i++)
                    rd_uleb(&r);
            }
        }
        if (emit) {
            uint32_t f = UNW_SL_NONE;
            if (!endseq && file < c->cufiles.n)
                f = c->cufiles.v[file];
            struct row row = {addr, f, (uint32_t)line, 0, (uint8_t)endseq};
            if (endseq || f == UNW_SL_NONE) {
                row.file = UNW_SL_NONE;
                row.line = 0;
            }
            /* one row per address in a sequence, the last (binutils dwarf2.c add_line_info) */
            if (c->rows.n > rows0 && c->rows.v[c->rows.n - 1].addr == addr)
                c->rows.v[c->rows.n - 1] = row;
            else
                VPUSH(c, c->rows, row);
            if (endseq) {
                addr = 0;
                file = 1;
                line = 1;
                rows0 = c->rows.n;
            }
        }
    }
    rc = r.err ? -1 : 0;
out:
    if (dirs != dirs_small)
        free(dirs);
    return c->oom ? -1 : rc;
}

/* ------------------------------------------------------------------ ranges */

static void add_range(struct ctx *c, uint64_t lo, uint64_t hi, uint32_t node, uint32_t depth)
{
    if (hi <= lo || lo == 0)
        return; /* empty, or code the linker discarded (its addresses resolved to 0) */
    struct rng g = {lo, hi, node, depth};
    VPUSH(c, c->rngs, g);
}

/* The ranges of DW_AT_ranges value v (DWARF 4 2.17.3 .debug_ranges; DWARF 5 2.17.3
 * .debug_rnglists), each added for node. */
static int die_ranges(struct ctx *c, const struct unit *u, const struct die *d, uint32_t node,
                      uint32_t depth)
{
    const struct unw_dwarf_sections *s = c->s;
    uint64_t base = u->low_pc;
    unsigned as = u->addr_size;
    if (u->version < 5) {
        if (d->ranges >= s->ranges_len)
            return -1;
        struct rd r = {s->ranges + d->ranges, s->ranges + s->ranges_len, 0};
        uint64_t maxa = as == 8 ? UINT64_MAX : (1ULL << (8 * as)) - 1;
        for (uint32_t k = 0; k < (1u << 20); k++) {
            uint64_t a = rd_le(&r, as), b = rd_le(&r, as);
            if (r.err)
                return -1;
            if (a == 0 && b == 0)
                return 0;
            if (a == maxa)
                base = b;
            else
                add_range(c, base + a, base + b, node, depth);
        }
        return -1;
    }
    uint64_t off = d->ranges;
    if (d->ranges_index) {
        uint64_t at = u->rnglists_base + d->ranges * u->offset_size;
        if (d->ranges > s->rnglists_len || at + u->offset_size > s->rnglists_len)
            return -1;
        struct rd r = {s->rnglists + at, s->rnglists + s->rnglists_len, 0};
        off = u->rnglists_base + rd_le(&r, u->offset_size);
    }
    if (off >= s->rnglists_len)
        return -1;
    struct rd r = {s->rnglists + off, s->rnglists + s->rnglists_len, 0};
    int ok = 1;
    for (uint32_t k = 0; k < (1u << 20) && !r.err && ok; k++) {
        unsigned kind = (unsigned)rd_le(&r, 1);
        uint64_t a, b;
        switch (kind) {
        case 0: return r.err ? -1 : 0; /* DW_RLE_end_of_list */
        case 1: base = addr_at(c, u, rd_uleb(&r), &ok); break;
        case 2: a = addr_at(c, u, rd_uleb(&r), &ok); b = addr_at(c, u, rd_uleb(&r), &ok);
            add_range(c, a, b, node, depth); break;
        case 3: a = addr_at(c, u, rd_uleb(&r), &ok); b = rd_uleb(&r);
            add_range(c, a, a + b, node, depth); break;
        case 4: a = rd_uleb(&r); b = rd_uleb(&r); add_range(c, base + a, base + b, node, depth); break;
        case 5: base = rd_le(&r, as); break;
        case 6: a = rd_le(&r, as); b = rd_le(&r, as); add_range(c, a, b, node, depth); break;
        case 7: a = rd_le(&r, as); b = rd_uleb(&r); add_range(c, a, a + b, node, depth); break;
        default: return -1;
        }
    }
    return -1;
}

/* ------------------------------------------------------------------ the DIE walk */

/* Walk unit u's DIEs: its root first (bases, line program), then every inlined subroutine. */
static void walk_unit(struct ctx *c, struct unit *u)
{
    const struct unw_dwarf_sections *s = c->s;
    struct rd r = {s->info + u->die_off, s->info + u->end, 0};
    struct die d;
    if (read_die(c, u, &r, &d) != 1) {
        err(c, UNW_SL_ERR_DIE);
        return;
    }
    u->low_pc = d.has_lo ? d.lo : 0;
    /* the root's stmt_list (read again raw: read_die keeps only what inlines need) */
    {
        struct rd r0 = {s->info + u->die_off, s->info + u->end, 0};
        const struct abbrev *a = find_abbrev(c, u, rd_uleb(&r0));
        const char *comp_dir = NULL;
        uint64_t stmt = UINT64_MAX;
        for (uint32_t i = 0; a && i < a->nattr && !r0.err; i++) {
            const struct attrspec *sp = &c->specs.v[a->first + i];
            struct val v;
            read_form(c, u, &r0, sp->form, sp->implicit, &v);
            if (sp->at == AT_stmt_list)
                stmt = v.u;
            else if (sp->at == AT_comp_dir && v.is_str)
                comp_dir = v.str;
        }
        c->cufiles.n = 0;
        if (stmt != UINT64_MAX && line_program(c, u, stmt, comp_dir) != 0)
            err(c, UNW_SL_ERR_LINE);
    }
    if (!d.children)
        return;
    uint32_t stack[SL_MAX_DEPTH];
    uint32_t depth = 1;
    stack[0] = UNW_SL_NONE;
    while (depth > 0 && r.p < r.end && !c->oom) {
        uint64_t die_off = (uint64_t)(r.p - s->info);
        int k = read_die(c, u, &r, &d);
        if (k < 0) {
            err(c, UNW_SL_ERR_DIE);
            return;
        }
        if (k == 0) {
            depth--;
            continue;
        }
        uint32_t parent = stack[depth - 1];
        uint32_t mine = parent;
        int sub = d.tag == TAG_subprogram;
        if (sub)
            mine = UNW_SL_NONE;
        if ((sub && (d.has_ranges || (d.has_lo && d.has_hi))) ||
            d.tag == TAG_inlined_subroutine) {
            if (c->nodes.n >= UNW_SL_MAX_ROWS) {
                err(c, UNW_SL_ERR_CAP);
                return;
            }
            struct node n = {UNW_SL_NONE, UNW_SL_NONE, 0, sub ? UNW_SL_NONE : parent,
                             sub ? UNW_SL_SUBPROGRAM : UNW_SL_INLINED, UNW_SL_NONE, 0};
            /* the name: the DIE's own linkage name, else its origin's or specification's
             * chain (resolve, from the DIE itself), else its own name; the decl line and
             * file likewise from the first DIE of the chain that has them */
            struct origin o = {UNW_SL_NONE, 0, UINT32_MAX, UINT32_MAX};
            if (d.has_origin || d.has_spec) {
                o = resolve(c, die_off);
            } else if (d.has_decl && d.decl_line < UINT32_MAX) {
                o.decl_line = (uint32_t)d.decl_line;
                o.decl_file = d.decl_file < UINT32_MAX ? (uint32_t)d.decl_file : UINT32_MAX;
                o.decl_unit = (uint32_t)(u - c->units.v);
            }
            if (d.linkage)
                n.name = intern(c, d.linkage, strlen(d.linkage));
            else if (d.has_origin || d.has_spec)
                n.name = o.name;
            else if (d.name)
                n.name = intern(c, d.name, strlen(d.name));
            n.decl_line = o.decl_line;
            /* a decl_file indexes the line program of the unit its DIE is in: only this
             * unit's is at hand (ctx.cufiles) */
            if (o.decl_unit == (uint32_t)(u - c->units.v) && o.decl_file < c->cufiles.n)
                n.decl_file = c->cufiles.v[o.decl_file];
            if (!sub) {
                n.line = (uint32_t)d.call_line;
                if (d.call_file < c->cufiles.n)
                    n.file = c->cufiles.v[d.call_file];
            }
            mine = (uint32_t)c->nodes.n;
            VPUSH(c, c->nodes, n);
            if (d.has_ranges) {
                if (die_ranges(c, u, &d, mine, depth) != 0)
                    err(c, UNW_SL_ERR_RANGES);
            } else if (d.has_lo && d.has_hi) {
                add_range(c, d.lo, d.hi_is_off ? d.lo + d.hi : d.hi, mine, depth);
            }
        }
        if (d.children) {
            if (depth == SL_MAX_DEPTH) {
                err(c, UNW_SL_ERR_DIE);
                return;
            }
            stack[depth++] = mine;
        }
    }
}

/* Every unit header of .debug_info, sorted by offset (they are, in a section), with its
 * abbreviations parsed. */
static void read_bases(struct ctx *c, struct unit *u)
{
    /* the root's bases come first: strx, addrx and rnglistx forms anywhere in the unit (and
     * in references into it from other units) are resolved through them */
    const struct unw_dwarf_sections *s = c->s;
    struct rd r = {s->info + u->die_off, s->info + u->end, 0};
    const struct abbrev *a = find_abbrev(c, u, rd_uleb(&r));
    for (uint32_t i = 0; a && i < a->nattr && !r.err; i++) {
        const struct attrspec *sp = &c->specs.v[a->first + i];
        struct val v;
        read_form(c, u, &r, sp->form, sp->implicit, &v);
        if (sp->at == AT_str_offsets_base)
            u->str_offsets_base = v.u;
        else if (sp->at == AT_addr_base || sp->at == AT_GNU_addr_base)
            u->addr_base = v.u;
        else if (sp->at == AT_rnglists_base)
            u->rnglists_base = v.u;
    }
}

static void read_units(struct ctx *c)
{
    const struct unw_dwarf_sections *s = c->s;
    uint64_t off = 0;
    while (off + 11 <= s->info_len && !c->oom) {
        struct rd r = {s->info + off, s->info + s->info_len, 0};
        struct unit u;
        memset(&u, 0, sizeof u);
        u.off = off;
        uint64_t len = rd_le(&r, 4);
        u.offset_size = 4;
        if (len == 0xffffffff) {
            len = rd_le(&r, 8);
            u.offset_size = 8;
        }
        if (r.err || len < 2 || len > (uint64_t)(r.end - r.p)) {
            err(c, UNW_SL_ERR_UNIT);
            return; /* nothing after a bad length can be found */
        }
        u.end = (uint64_t)(r.p - s->info) + len;
        u.version = (uint8_t)rd_le(&r, 2);
        unsigned ut = 1; /* DW_UT_compile */
        if (u.version >= 5) {
            ut = (unsigned)rd_le(&r, 1);
            u.addr_size = (uint8_t)rd_le(&r, 1);
            u.abbrev_off = rd_le(&r, u.offset_size);
            if (ut == 4 || ut == 5) /* DW_UT_skeleton, DW_UT_split_compile: dwo_id */
                rd_le(&r, 8);
            else if (ut == 2 || ut == 6) { /* type units: signature, type offset */
                rd_le(&r, 8);
                rd_le(&r, u.offset_size);
            }
        } else {
            u.abbrev_off = rd_le(&r, u.offset_size);
            u.addr_size = (uint8_t)rd_le(&r, 1);
        }
        u.die_off = (uint64_t)(r.p - s->info);
        if (r.err || u.version < 2 || u.version > 5 || (u.addr_size != 4 && u.addr_size != 8)
            || u.die_off > u.end) {
            err(c, UNW_SL_ERR_UNIT);
            u.skip = 1;
        } else {
            u.skip = ut == 2 || ut == 6;
            if (c->units.n && c->units.v[c->units.n - 1].abbrev_off == u.abbrev_off &&
                !c->units.v[c->units.n - 1].skip) {
                const struct unit *p = &c->units.v[c->units.n - 1];
                u.ab_first = p->ab_first;
                u.ab_n = p->ab_n;
                u.ab_dense = p->ab_dense;
            } else if (load_abbrevs(c, &u) != 0) {
                err(c, UNW_SL_ERR_ABBREV);
                u.skip = 1;
            }
            if (!u.skip)
                read_bases(c, &u);
        }
        VPUSH(c, c->units, u);
        off = u.end;
    }
}

/* ------------------------------------------------------------------ the table */

static int cmp_row(const void *a, const void *b)
{
    const struct row *x = a, *y = b;
    if (x->addr != y->addr)
        return x->addr < y->addr ? -1 : 1;
    /* at one address an end of sequence goes first: the row that starts there wins */
    if (x->end != y->end)
        return x->end ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

static int cmp_rng(const void *a, const void *b)
{
    const struct rng *x = a, *y = b;
    if (x->lo != y->lo)
        return x->lo < y->lo ? -1 : 1;
    if (x->depth != y->depth)
        return x->depth < y->depth ? -1 : 1;
    if (x->hi != y->hi)
        return x->hi > y->hi ? -1 : 1;
    return x->node < y->node ? -1 : x->node > y->node;
}

struct seg { uint64_t addr; uint32_t node; };

static void put(uint8_t **p, const void *src, uint64_t n)
{
    memcpy(*p, src, n);
    *p += n;
}

int unw_srcline_compile(const struct unw_dwarf_sections *s, uint8_t **out, uint64_t *out_len)
{
    *out = NULL;
    *out_len = 0;
    struct ctx c;
    memset(&c, 0, sizeof c);
    c.s = s;
    struct seg *segs = NULL;
    uint64_t nsegs = 0;
    int rc = -1;
    VPUSH(&c, c.strtab, 0); /* offset 0: "" (never a hash slot: 0 marks an empty one) */
    if (s->info && s->abbrev)
        read_units(&c);
    for (uint64_t i = 0; i < c.units.n && !c.oom; i++)
        if (!c.units.v[i].skip)
            walk_unit(&c, &c.units.v[i]);
    if (c.oom)
        goto done;
    for (uint64_t i = 0; i < c.rows.n; i++)
        c.rows.v[i].idx = (uint32_t)i;
    if (c.rows.n) /* (qsort of NULL, even for 0 items, is undefined) */
        qsort(c.rows.v, c.rows.n, sizeof *c.rows.v, cmp_row);
    /* one row per address: the last one sorted there */
    uint64_t nl = 0;
    for (uint64_t i = 0; i < c.rows.n; i++) {
        if (nl && c.rows.v[nl - 1].addr == c.rows.v[i].addr)
            nl--;
        c.rows.v[nl++] = c.rows.v[i];
    }
    c.rows.n = nl;
    /* inline segments: a sweep over the ranges sorted by (lo, depth, -hi) with a stack of the
     * open ones; each range is clamped into the one it starts in, so they nest and the
     * boundaries come out ascending */
    if (c.rngs.n)
        qsort(c.rngs.v, c.rngs.n, sizeof *c.rngs.v, cmp_rng);
    segs = malloc((2 * c.rngs.n + 1) * sizeof *segs);
    struct rng *open = malloc((c.rngs.n + 1) * sizeof *open);
    if (!segs || !open) {
        free(open);
        goto done;
    }
    uint64_t nopen = 0;
#define EMIT(a, nd)                                                              \
    do {                                                                         \
        if (nsegs && segs[nsegs - 1].addr == (a))                                \
            segs[nsegs - 1].node = (nd);                                         \
        else {                                                                   \
            segs[nsegs].addr = (a);                                              \
            segs[nsegs++].node = (nd);                                           \
        }                                                                        \
    } while (0)
    for (uint64_t i = 0; i <= c.rngs.n; i++) {
        uint64_t lo = i < c.rngs.n ? c.rngs.v[i].lo : UINT64_MAX;
        while (nopen && open[nopen - 1].hi <= lo) {
            uint64_t hi = open[--nopen].hi;
            /* ranges closing at the same address close together */
            while (nopen && open[nopen - 1].hi == hi)
                nopen--;
            EMIT(hi, nopen ? open[nopen - 1].node : UNW_SL_NONE);
        }
        if (i == c.rngs.n)
            break;
        struct rng g = c.rngs.v[i];
        if (nopen && g.hi > open[nopen - 1].hi)
            g.hi = open[nopen - 1].hi;
        if (g.hi <= g.lo)
            continue;
        open[nopen++] = g;
        EMIT(g.lo, g.node);
    }
#undef EMIT
    free(open);
    /* the blob */
    struct unw_srcline_hdr h;
    memset(&h, 0, sizeof h);
    h.magic = UNW_SL_MAGIC;
    h.version = UNW_SL_VERSION;
    h.nlines = (uint32_t)c.rows.n;
    h.nsegs = (uint32_t)nsegs;
    h.nnodes = (uint32_t)c.nodes.n;
    h.nfiles = (uint32_t)c.files.n;
    h.strtab_len = (uint32_t)c.strtab.n;
    uint64_t total = sizeof h + c.rows.n * 16 + nsegs * 12 + c.nodes.n * 28 + c.files.n * 4 +
                     c.strtab.n;
    if (c.rows.n > UNW_SL_MAX_ROWS || nsegs > UNW_SL_MAX_ROWS) {
        err(&c, UNW_SL_ERR_CAP);
        h.nlines = h.nsegs = h.nnodes = h.nfiles = 0;
        c.rows.n = nsegs = c.nodes.n = c.files.n = 0;
        total = sizeof h + c.strtab.n;
    }
    memcpy(h.errors, c.errors, sizeof h.errors);
    uint8_t *blob = malloc(total ? total : 1);
    if (!blob)
        goto done;
    uint8_t *p = blob;
    put(&p, &h, sizeof h);
    for (uint64_t i = 0; i < c.rows.n; i++)
        put(&p, &c.rows.v[i].addr, 8);
    for (uint64_t i = 0; i < c.rows.n; i++)
        put(&p, &c.rows.v[i].file, 4);
    for (uint64_t i = 0; i < c.rows.n; i++)
        put(&p, &c.rows.v[i].line, 4);
    for (uint64_t i = 0; i < nsegs; i++)
        put(&p, &segs[i].addr, 8);
    for (uint64_t i = 0; i < nsegs; i++)
        put(&p, &segs[i].node, 4);
    for (uint64_t i = 0; i < c.nodes.n; i++)
        put(&p, &c.nodes.v[i].name, 4);
    for (uint64_t i = 0; i < c.nodes.n; i++)
        put(&p, &c.nodes.v[i].file, 4);
    for (uint64_t i = 0; i < c.nodes.n; i++)
        put(&p, &c.nodes.v[i].line, 4);
    for (uint64_t i = 0; i < c.nodes.n; i++)
        put(&p, &c.nodes.v[i].parent, 4);
    for (uint64_t i = 0; i < c.nodes.n; i++)
        put(&p, &c.nodes.v[i].kind, 4);
    for (uint64_t i = 0; i < c.nodes.n; i++)
        put(&p, &c.nodes.v[i].decl_file, 4);
    for (uint64_t i = 0; i < c.nodes.n; i++)
        put(&p, &c.nodes.v[i].decl_line, 4);
    put(&p, c.files.v ? (const void *)c.files.v : (const void *)"", c.files.n * 4);
    put(&p, c.strtab.v, c.strtab.n);
    *out = blob;
    *out_len = total;
    rc = 0;
done:
    free(segs);
    free(c.rows.v);
    free(c.rngs.v);
    free(c.nodes.v);
    free(c.files.v);
    free(c.strtab.v);
    free(c.specs.v);
    free(c.abbrevs.v);
    free(c.units.v);
    free(c.cufiles.v);
    free(c.sh);
    free(c.mh);
    return rc;
}
