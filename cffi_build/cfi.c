/* cfi.c: compile .eh_frame / .debug_frame call frame information into a packed row table.
 *
 * Formats followed:
 *   - DWARF 5 section 6.4 (Call Frame Information): CIE/FDE layout (6.4.1), the CFA
 *     instructions (6.4.2) and the row model; DW_CFA_* / DW_OP_* values from DWARF 5 section 7.24
 *     and 7.7.1.
 *   - LSB 5.0 Core, "Exception Frames" (10.6) for .eh_frame: CIE id 0, CIE pointer relative to
 *     its own field, the z/L/P/R augmentation data, DW_EH_PE_* pointer encodings (10.5); the
 *     GCC 'S' (signal frame) augmentation character (libgcc unwind-dw2.c, extract_cie_info).
 *   - .eh_frame_hdr: LSB 10.6.2 (version 1, eh_frame_ptr, fde_count, sorted search table).
 *
 * Invariants:
 *   - Every read goes through struct rd, which never reads past its end and latches an error;
 *     a failed read makes the current CIE/FDE count an error and be skipped. Nothing here can
 *     read outside [img, img+img_len) or [debug_frame, +len), whatever the bytes say.
 *   - Bounded work: each FDE's program is at most UNW_MAX_PROG bytes and emits at most
 *     UNW_MAX_FDE_ROWS rows; the remember_state stack is UNW_MAX_STATE deep; the whole table is
 *     capped at UNW_MAX_ROWS rows. Each CFA instruction moves forward by >= 1 byte, so a program
 *     runs in O(its length). A "looping" eh_frame cannot loop: the walk only moves forward by
 *     each entry's length (>= 4 + 4), and the hdr table is walked by index.
 *   - Only rules the unwinder can evaluate are kept precisely; any other expression becomes an
 *     UNSUPPORTED kind (the unwinder stops there with BAD_CFI) and is counted.
 */
#include <stdlib.h>
#include <string.h>

#include "unwcore_int.h"

#define UNW_MAX_PROG (1u << 20)       /* bytes of CFA program per CIE/FDE */
#define UNW_MAX_FDE_ROWS (1u << 16)   /* rows emitted by one FDE */
#define UNW_MAX_ROWS (1u << 26)       /* rows in one table (~400 MB of CFI: never real) */
#define UNW_MAX_STATE 64              /* DW_CFA_remember_state nesting */
#define UNW_MAX_ENTRIES (1u << 24)    /* CIE/FDE entries walked per section */

/* ------------------------------------------------------------------ arch descriptors */

static const struct unw_arch_desc ARCH_X86_64 = {
    .id = UNW_ARCH_X86_64,
    .ndwarf = 17,
    .sp = 7, .fp = 6, .ra = 16,
    .perf_ip = 8,
    /* System V AMD64 ABI fig. 3.36 DWARF numbering -> perf arch/x86/include/uapi/asm/perf_regs.h:
     * rax rdx rcx rbx rsi rdi rbp rsp r8..r15 RA(rip) */
    .dwarf_to_perf = {0, 3, 2, 1, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23, 8,
                      -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
    /* System V AMD64 ABI 3.2.1: rbx, rbp, r12-r15 are callee-saved (plus the RA column) */
    .nsaved = 7,
    .saved = {6, 16, 3, 12, 13, 14, 15},
    .slot_of = {-1, -1, -1, 2, -1, -1, 0, -1, -1, -1, -1, -1, 3, 4, 5, 6, 1,
                -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
    /* Linux x86_64 rt_sigframe: the handler's `ret` pops pretcode, so at __restore_rt rsp points
     * at the struct ucontext (arch/x86/include/asm/sigframe.h); uc_mcontext is at +40 (uc_flags,
     * uc_link, 24-byte stack_t), and struct sigcontext_64 (arch/x86/include/uapi/asm/
     * sigcontext.h) holds r8..r15, rdi, rsi, rbp, rbx, rdx, rax, rcx, rsp, rip, 8 bytes each.
     * glibc's __restore_rt CFI says the same (libc_sigaction.c do_expr(oRBP ...)). */
    .sigctx_off = {144, 136, 152, 128, 112, 104, 120, 160, 40, 48, 56, 64, 72, 80, 88, 96, 168,
                   -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
};

const struct unw_arch_desc *unw_arch(int id)
{
    return id == UNW_ARCH_X86_64 ? &ARCH_X86_64 : NULL;
}

void unw_free(void *p) { free(p); }

/* ------------------------------------------------------------------ bounded reader */

struct rd {
    const uint8_t *p, *end;
    int err;
};

static inline int rd_need(struct rd *r, uint64_t n)
{
    if (r->err || (uint64_t)(r->end - r->p) < n) {
        r->err = 1;
        return 0;
    }
    return 1;
}

static inline uint64_t rd_le(struct rd *r, unsigned n)
{
    if (!rd_need(r, n))
        return 0;
    uint64_t v = 0;
    for (unsigned i = 0; i < n; i++)
        v |= (uint64_t)r->p[i] << (8 * i);
    r->p += n;
    return v;
}

static inline uint8_t rd_u8(struct rd *r) { return (uint8_t)rd_le(r, 1); }

/* LEB128 (DWARF 5 section 7.6); more than 10 bytes cannot be a 64-bit value: error. */
static uint64_t rd_uleb(struct rd *r)
{
    uint64_t v = 0;
    for (unsigned shift = 0; shift < 70; shift += 7) {
        if (!rd_need(r, 1))
            return 0;
        uint8_t b = *r->p++;
        if (shift < 64)
            v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80))
            return v;
    }
    r->err = 1;
    return 0;
}

static int64_t rd_sleb(struct rd *r)
{
    uint64_t v = 0;
    unsigned shift = 0;
    uint8_t b = 0;
    do {
        if (shift >= 70 || !rd_need(r, 1)) {
            r->err = 1;
            return 0;
        }
        b = *r->p++;
        if (shift < 64)
            v |= (uint64_t)(b & 0x7f) << shift;
        shift += 7;
    } while (b & 0x80);
    if (shift < 64 && (b & 0x40))
        v |= ~(uint64_t)0 << shift;
    return (int64_t)v;
}

/* ------------------------------------------------------------------ pointer encodings */

#define DW_EH_PE_omit 0xff
#define DW_EH_PE_indirect 0x80

struct encctx {
    const uint8_t *sec;   /* section start in memory */
    uint64_t sec_addr;    /* its sh_addr */
    uint64_t text, data;
};

/* LSB 10.5 DW_EH_PE_*: low nibble = format, bits 4-6 = application. Returns 0 and sets *bad for
 * encodings that are illegal or need memory we do not have (indirect: the pointer is in the
 * loaded image's data, aligned/funcrel: not used for FDE fields). */
static uint64_t rd_enc(struct rd *r, uint8_t enc, const struct encctx *c, int *bad)
{
    if (enc == DW_EH_PE_omit)
        return 0;
    uint64_t field = c->sec_addr + (uint64_t)(r->p - c->sec);
    uint64_t v;
    switch (enc & 0x0f) {
    case 0x00: v = rd_le(r, 8); break;                          /* absptr (64-bit) */
    case 0x01: v = rd_uleb(r); break;
    case 0x02: v = rd_le(r, 2); break;
    case 0x03: v = rd_le(r, 4); break;
    case 0x04: v = rd_le(r, 8); break;
    case 0x09: v = (uint64_t)rd_sleb(r); break;
    case 0x0a: v = (uint64_t)(int64_t)(int16_t)rd_le(r, 2); break;
    case 0x0b: v = (uint64_t)(int64_t)(int32_t)rd_le(r, 4); break;
    case 0x0c: v = rd_le(r, 8); break;
    default: *bad = 1; return 0;
    }
    switch (enc & 0x70) {
    case 0x00: break;
    case 0x10: v += field; break;                               /* pcrel */
    case 0x20: if (!c->text) { *bad = 1; return 0; } v += c->text; break;
    case 0x30: if (!c->data) { *bad = 1; return 0; } v += c->data; break;
    default: *bad = 1; return 0;                                /* funcrel, aligned */
    }
    if (enc & DW_EH_PE_indirect)
        *bad = 1;
    return v;
}

/* Size-only variant for pc_range: LSB says the range uses the format nibble only. */
static uint64_t rd_enc_value(struct rd *r, uint8_t enc, int *bad)
{
    struct encctx none = {r->p, 0, 0, 0};
    return rd_enc(r, enc & 0x0f, &none, bad);
}

/* ------------------------------------------------------------------ compile context */

struct rowbuf {
    uint64_t pc;
    uint32_t rule;
};

struct group {          /* the rows of one FDE, [start, end) */
    uint64_t start, end;
    uint32_t first, n;
    uint32_t prio;      /* 0 eh_frame, 1 debug_frame */
    uint32_t seq;
};

struct ctx {
    const struct unw_arch_desc *arch;
    uint32_t errors[UNW_NERR];
    struct rowbuf *rows;
    uint32_t nrows, caprows;
    struct group *groups;
    uint32_t ngroups, capgroups;
    struct unw_rule *rules;
    uint32_t nrules, caprules;
    uint32_t *hash;          /* open addressing, rule index + 1, 0 = empty */
    uint32_t hashcap;        /* power of two */
    int oom;
};

static void err(struct ctx *c, int e) { c->errors[e]++; }

static uint32_t rule_hash(const struct unw_rule *r)
{
    uint8_t b[sizeof *r];
    memcpy(b, r, sizeof b);
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < sizeof b; i++)
        h = (h ^ b[i]) * 16777619u;
    return h;
}

static int grow(void **p, uint32_t *cap, size_t elem, uint32_t need)
{
    if (need <= *cap)
        return 0;
    uint64_t n = *cap ? *cap : 64;
    while (n < need)
        n *= 2;
    if (n > UINT32_MAX)
        return -1;
    void *q = realloc(*p, n * elem);
    if (!q)
        return -1;
    *p = q;
    *cap = (uint32_t)n;
    return 0;
}

/* Intern a rule: O(1) expected. Returns UINT32_MAX on OOM. */
static uint32_t intern(struct ctx *c, const struct unw_rule *r)
{
    if ((uint64_t)(c->nrules + 1) * 2 > c->hashcap) {
        uint32_t ncap = c->hashcap ? c->hashcap * 2 : 1024;
        uint32_t *nh = calloc(ncap, sizeof *nh);
        if (!nh) {
            c->oom = 1;
            return UINT32_MAX;
        }
        for (uint32_t i = 0; i < c->nrules; i++) {
            uint32_t h = rule_hash(&c->rules[i]) & (ncap - 1);
            while (nh[h])
                h = (h + 1) & (ncap - 1);
            nh[h] = i + 1;
        }
        free(c->hash);
        c->hash = nh;
        c->hashcap = ncap;
    }
    uint32_t h = rule_hash(r) & (c->hashcap - 1);
    while (c->hash[h]) {
        if (!memcmp(&c->rules[c->hash[h] - 1], r, sizeof *r))
            return c->hash[h] - 1;
        h = (h + 1) & (c->hashcap - 1);
    }
    if (grow((void **)&c->rules, &c->caprules, sizeof *r, c->nrules + 1)) {
        c->oom = 1;
        return UINT32_MAX;
    }
    c->rules[c->nrules] = *r;
    c->hash[h] = ++c->nrules;
    return c->nrules - 1;
}

/* ------------------------------------------------------------------ the row model */

struct regrule {
    uint8_t kind, reg;
    int64_t off;
};

struct cfarule {
    uint8_t kind, reg; /* reg: DWARF reg; for PLT the lit threshold */
    int64_t off;
};

struct state {
    struct cfarule cfa;
    struct regrule regs[UNW_NSAVED]; /* slot order: arch->saved[] */
};

struct cie {
    uint64_t code_align;
    int64_t data_align;
    uint64_t ra_reg;
    uint8_t fde_enc;
    uint8_t has_z, signal;
    uint8_t addr_size;
    const uint8_t *insns, *insns_end;
};

/* DW_OP values, DWARF 5 section 7.7.1 */
#define OP_deref 0x06
#define OP_and 0x1a
#define OP_plus 0x22
#define OP_shl 0x24
#define OP_ge 0x2a
#define OP_lit0 0x30
#define OP_breg0 0x70

/* "DW_OP_bregN off" alone (what GCC/glibc write for sigcontext slots). */
static int expr_breg(const uint8_t *e, uint64_t n, uint8_t *reg, int64_t *off)
{
    struct rd r = {e, e + n, 0};
    uint8_t op = rd_u8(&r);
    if (op < OP_breg0 || op > OP_breg0 + 31)
        return 0;
    *reg = (uint8_t)(op - OP_breg0);
    *off = rd_sleb(&r);
    return !r.err && r.p == r.end;
}

/* Classify a DW_CFA_def_cfa_expression (x86_64 patterns; other arches: UNSUPPORTED). */
static struct cfarule classify_cfa_expr(const struct ctx *c, const uint8_t *e, uint64_t n)
{
    struct cfarule out = {UNW_CFA_UNSUPPORTED, 0, 0};
    struct rd r = {e, e + n, 0};
    uint8_t op = rd_u8(&r);
    if (op < OP_breg0 || op > OP_breg0 + 31)
        return out;
    uint8_t reg = (uint8_t)(op - OP_breg0);
    int64_t off = rd_sleb(&r);
    if (r.err)
        return out;
    /* DW_OP_bregN off; DW_OP_deref: realigned-stack functions (CFA saved in a slot) and
     * glibc's __restore_rt (sysdeps/unix/sysv/linux/x86_64/libc_sigaction.c do_cfa_expr). */
    if (r.end - r.p == 1 && r.p[0] == OP_deref) {
        out.kind = UNW_CFA_DEREF;
        out.reg = reg;
        out.off = off;
        return out;
    }
    /* binutils elf_x86_64_eh_frame_plt / glibc PLT: breg7 8; breg16 0; lit15; and; lit11|lit10;
     * ge; lit3; shl; plus. CFA = rsp + 8 + (((rip & 15) >= lit) << 3). */
    if (c->arch->id == UNW_ARCH_X86_64 && reg == 7) {
        static const uint8_t tail[] = {OP_breg0 + 16, 0x00, OP_lit0 + 15, OP_and, 0xff, OP_ge,
                                       OP_lit0 + 3, OP_shl, OP_plus};
        if ((uint64_t)(r.end - r.p) == sizeof tail) {
            int ok = 1;
            for (size_t i = 0; i < sizeof tail && ok; i++)
                ok = tail[i] == 0xff ? (r.p[i] == OP_lit0 + 10 || r.p[i] == OP_lit0 + 11)
                                     : r.p[i] == tail[i];
            if (ok) {
                out.kind = UNW_CFA_PLT;
                out.reg = (uint8_t)(r.p[4] - OP_lit0);
                out.off = off;
                return out;
            }
        }
    }
    return out;
}

/* Pack the current state into a rule; out-of-range offsets make the rule unusable, never wrong. */
static uint32_t emit_rule(struct ctx *c, const struct state *s, const struct cie *cie)
{
    struct unw_rule r;
    memset(&r, 0, sizeof r);
    r.cfa_kind = s->cfa.kind;
    r.cfa_reg = s->cfa.reg;
    if (s->cfa.off < INT32_MIN || s->cfa.off > INT32_MAX) {
        err(c, UNW_ERR_RANGE);
        r.cfa_kind = UNW_CFA_UNSUPPORTED;
    } else {
        r.cfa_off = (int32_t)s->cfa.off;
    }
    if (r.cfa_kind == UNW_CFA_UNSUPPORTED) {
        r.cfa_reg = 0;
        r.cfa_off = 0;
    }
    if (cie->signal) {
        r.flags |= UNW_RULE_SIGNAL;
        if (r.cfa_kind == UNW_CFA_DEREF && r.cfa_reg == c->arch->sp)
            r.cfa_kind = UNW_CFA_SIGFRAME;
    }
    for (unsigned i = 0; i < c->arch->nsaved; i++) {
        const struct regrule *in = &s->regs[i];
        struct unw_regrule *o = &r.regs[i];
        o->kind = in->kind;
        if (in->kind == UNW_REG_SAME || in->kind == UNW_REG_UNDEF ||
            in->kind == UNW_REG_UNSUPPORTED)
            continue;
        if (in->off < INT16_MIN || in->off > INT16_MAX) {
            err(c, UNW_ERR_RANGE);
            o->kind = UNW_REG_UNSUPPORTED;
            continue;
        }
        o->reg = in->reg;
        o->off = (int16_t)in->off;
    }
    return intern(c, &r);
}

static int push_row(struct ctx *c, uint64_t pc, uint32_t rule, uint32_t first)
{
    if (c->nrows > first && c->rows[c->nrows - 1].pc == pc) {
        c->rows[c->nrows - 1].rule = rule; /* several rows at one pc: the last one wins */
        return 0;
    }
    if (c->nrows - first >= UNW_MAX_FDE_ROWS || c->nrows >= UNW_MAX_ROWS) {
        err(c, UNW_ERR_CAP);
        return -1;
    }
    if (grow((void **)&c->rows, &c->caprows, sizeof *c->rows, c->nrows + 1)) {
        c->oom = 1;
        return -1;
    }
    c->rows[c->nrows].pc = pc;
    c->rows[c->nrows].rule = rule;
    c->nrows++;
    return 0;
}

/* DW_CFA opcodes, DWARF 5 section 7.24 */
enum {
    CFA_nop = 0x00, CFA_set_loc = 0x01, CFA_advance_loc1 = 0x02, CFA_advance_loc2 = 0x03,
    CFA_advance_loc4 = 0x04, CFA_offset_extended = 0x05, CFA_restore_extended = 0x06,
    CFA_undefined = 0x07, CFA_same_value = 0x08, CFA_register = 0x09, CFA_remember_state = 0x0a,
    CFA_restore_state = 0x0b, CFA_def_cfa = 0x0c, CFA_def_cfa_register = 0x0d,
    CFA_def_cfa_offset = 0x0e, CFA_def_cfa_expression = 0x0f, CFA_expression = 0x10,
    CFA_offset_extended_sf = 0x11, CFA_def_cfa_sf = 0x12, CFA_def_cfa_offset_sf = 0x13,
    CFA_val_offset = 0x14, CFA_val_offset_sf = 0x15, CFA_val_expression = 0x16,
    CFA_MIPS_advance_loc8 = 0x1d, CFA_GNU_args_size = 0x2e,
    CFA_GNU_negative_offset_extended = 0x2f,
};

/* Factored offsets (DWARF 5 6.4.2): v * factor. An overflow saturates to INT64_MAX, which
 * emit_rule then reports as UNW_ERR_RANGE: never undefined behaviour, never a wrong rule. */
static int64_t fac_u(uint64_t v, int64_t f)
{
    int64_t out;
    if (v > INT64_MAX || __builtin_mul_overflow((int64_t)v, f, &out))
        return INT64_MAX;
    return out;
}

static int64_t fac_s(int64_t v, int64_t f)
{
    int64_t out;
    if (__builtin_mul_overflow(v, f, &out))
        return INT64_MAX;
    return out;
}

static struct regrule *track(struct state *s, const struct unw_arch_desc *a, uint64_t reg)
{
    if (reg >= UNW_MAX_DWARF || a->slot_of[reg] < 0)
        return NULL; /* a caller-saved column: no caller may depend on it, so it is not kept */
    return &s->regs[a->slot_of[reg]];
}

/* Run one CFA program. For the CIE (fde_start == NULL-range: emit == 0) it only builds *s.
 * For an FDE it emits rows for [loc, end) starting from *s (the CIE's state, kept in *init for
 * DW_CFA_restore). Returns 0, or -1 if the program is malformed (the FDE is then dropped). */
static int run_program(struct ctx *c, const struct cie *cie, const uint8_t *p, const uint8_t *pend,
                       struct state *s, const struct state *init, int emit, uint64_t loc,
                       uint64_t end, const struct encctx *ec, uint32_t first)
{
    const struct unw_arch_desc *a = c->arch;
    struct state stack[UNW_MAX_STATE];
    unsigned depth = 0;
    struct rd r = {p, pend, 0};
    if ((uint64_t)(pend - p) > UNW_MAX_PROG) {
        err(c, UNW_ERR_CAP);
        return -1;
    }
    while (r.p < r.end && !r.err) {
        uint8_t op = rd_u8(&r);
        uint8_t hi = op & 0xc0, low = op & 0x3f;
        uint64_t reg = 0, adv = 0;
        int advance = 0;
        int64_t off = 0;
        struct regrule *rr;
        if (hi == 0x40) {               /* DW_CFA_advance_loc */
            adv = low;
            advance = 1;
        } else if (hi == 0x80) {        /* DW_CFA_offset */
            off = fac_u(rd_uleb(&r), cie->data_align);
            if ((rr = track(s, a, low)))
                *rr = (struct regrule){UNW_REG_AT_CFA, 0, off};
        } else if (hi == 0xc0) {        /* DW_CFA_restore */
            if (!init)
                goto bad;
            if ((rr = track(s, a, low)))
                *rr = *track((struct state *)init, a, low);
        } else {
            switch (op) {
            case CFA_nop:
                break;
            case CFA_GNU_args_size:
                rd_uleb(&r);
                break;
            case CFA_set_loc: {
                int bad = 0;
                uint64_t nl = rd_enc(&r, cie->fde_enc, ec, &bad);
                if (bad || nl < loc)
                    goto bad;          /* set_loc may only move forward (DWARF 5 6.4.2.1) */
                if (emit) {
                    if (loc < end && push_row(c, loc, emit_rule(c, s, cie), first))
                        return -1;
                }
                loc = nl;
                break;
            }
            case CFA_advance_loc1: adv = rd_le(&r, 1); advance = 1; break;
            case CFA_advance_loc2: adv = rd_le(&r, 2); advance = 1; break;
            case CFA_advance_loc4: adv = rd_le(&r, 4); advance = 1; break;
            case CFA_MIPS_advance_loc8: adv = rd_le(&r, 8); advance = 1; break;
            case CFA_offset_extended:
                reg = rd_uleb(&r);
                off = fac_u(rd_uleb(&r), cie->data_align);
                if ((rr = track(s, a, reg)))
                    *rr = (struct regrule){UNW_REG_AT_CFA, 0, off};
                break;
            case CFA_offset_extended_sf:
                reg = rd_uleb(&r);
                off = fac_s(rd_sleb(&r), cie->data_align);
                if ((rr = track(s, a, reg)))
                    *rr = (struct regrule){UNW_REG_AT_CFA, 0, off};
                break;
            case CFA_GNU_negative_offset_extended:
                reg = rd_uleb(&r);
                off = -fac_u(rd_uleb(&r), cie->data_align);
                if ((rr = track(s, a, reg)))
                    *rr = (struct regrule){UNW_REG_AT_CFA, 0, off};
                break;
            case CFA_val_offset:
                reg = rd_uleb(&r);
                off = fac_u(rd_uleb(&r), cie->data_align);
                if ((rr = track(s, a, reg)))
                    *rr = (struct regrule){UNW_REG_VAL_CFA, 0, off};
                break;
            case CFA_val_offset_sf:
                reg = rd_uleb(&r);
                off = fac_s(rd_sleb(&r), cie->data_align);
                if ((rr = track(s, a, reg)))
                    *rr = (struct regrule){UNW_REG_VAL_CFA, 0, off};
                break;
            case CFA_restore_extended:
                reg = rd_uleb(&r);
                if (!init)
                    goto bad;
                if ((rr = track(s, a, reg)))
                    *rr = *track((struct state *)init, a, reg);
                break;
            case CFA_undefined:
                if ((rr = track(s, a, rd_uleb(&r))))
                    *rr = (struct regrule){UNW_REG_UNDEF, 0, 0};
                break;
            case CFA_same_value:
                if ((rr = track(s, a, rd_uleb(&r))))
                    *rr = (struct regrule){UNW_REG_SAME, 0, 0};
                break;
            case CFA_register: {
                reg = rd_uleb(&r);
                uint64_t r2 = rd_uleb(&r);
                if ((rr = track(s, a, reg))) {
                    if (r2 < a->ndwarf)
                        *rr = (struct regrule){UNW_REG_REGISTER, (uint8_t)r2, 0};
                    else
                        *rr = (struct regrule){UNW_REG_UNSUPPORTED, 0, 0};
                }
                break;
            }
            case CFA_remember_state:
                if (depth >= UNW_MAX_STATE) {
                    err(c, UNW_ERR_STATE_STACK);
                    return -1;
                }
                stack[depth++] = *s;
                break;
            case CFA_restore_state:
                if (!depth) {
                    err(c, UNW_ERR_STATE_STACK);
                    return -1;
                }
                *s = stack[--depth];
                break;
            case CFA_def_cfa:
                reg = rd_uleb(&r);
                off = (int64_t)rd_uleb(&r);
                s->cfa = (struct cfarule){reg < a->ndwarf ? UNW_CFA_REG_OFF : UNW_CFA_UNSUPPORTED,
                                          (uint8_t)(reg < a->ndwarf ? reg : 0), off};
                break;
            case CFA_def_cfa_sf:
                reg = rd_uleb(&r);
                off = fac_s(rd_sleb(&r), cie->data_align); /* DWARF 5 6.4.2.2: factored */
                s->cfa = (struct cfarule){reg < a->ndwarf ? UNW_CFA_REG_OFF : UNW_CFA_UNSUPPORTED,
                                          (uint8_t)(reg < a->ndwarf ? reg : 0), off};
                break;
            case CFA_def_cfa_register:
                reg = rd_uleb(&r);
                /* only legal when the CFA is register+offset (DWARF 5 6.4.2.2) */
                if (s->cfa.kind != UNW_CFA_REG_OFF || reg >= a->ndwarf)
                    s->cfa.kind = UNW_CFA_UNSUPPORTED;
                else
                    s->cfa.reg = (uint8_t)reg;
                break;
            case CFA_def_cfa_offset:
                off = (int64_t)rd_uleb(&r);
                if (s->cfa.kind != UNW_CFA_REG_OFF)
                    s->cfa.kind = UNW_CFA_UNSUPPORTED;
                else
                    s->cfa.off = off;
                break;
            case CFA_def_cfa_offset_sf:
                off = fac_s(rd_sleb(&r), cie->data_align);
                if (s->cfa.kind != UNW_CFA_REG_OFF)
                    s->cfa.kind = UNW_CFA_UNSUPPORTED;
                else
                    s->cfa.off = off;
                break;
            case CFA_def_cfa_expression: {
                uint64_t n = rd_uleb(&r);
                if (!rd_need(&r, n))
                    goto bad;
                s->cfa = classify_cfa_expr(c, r.p, n);
                if (s->cfa.kind == UNW_CFA_UNSUPPORTED)
                    err(c, UNW_ERR_UNSUP_EXPR);
                r.p += n;
                break;
            }
            case CFA_expression:
            case CFA_val_expression: {
                reg = rd_uleb(&r);
                uint64_t n = rd_uleb(&r);
                if (!rd_need(&r, n))
                    goto bad;
                if ((rr = track(s, a, reg))) {
                    uint8_t breg = 0;
                    if (expr_breg(r.p, n, &breg, &off) && breg < a->ndwarf) {
                        *rr = (struct regrule){op == CFA_expression ? UNW_REG_AT_REG
                                                                    : UNW_REG_VAL_REG,
                                               breg, off};
                    } else {
                        *rr = (struct regrule){UNW_REG_UNSUPPORTED, 0, 0};
                        err(c, UNW_ERR_UNSUP_EXPR);
                    }
                }
                r.p += n;
                break;
            }
            default:
                goto bad; /* DW_CFA_GNU_window_save and unknown vendor ops */
            }
        }
        if (advance) {
            if (r.err)
                goto bad;
            uint64_t step, nl;
            if (__builtin_mul_overflow(adv, cie->code_align, &step) ||
                __builtin_add_overflow(loc, step, &nl))
                goto bad;
            if (emit && loc < end && nl > loc &&
                push_row(c, loc, emit_rule(c, s, cie), first))
                return -1;
            loc = nl;
        }
        if (c->oom)
            return -1;
    }
    if (r.err)
        goto bad;
    if (emit && loc < end && push_row(c, loc, emit_rule(c, s, cie), first))
        return -1;
    return c->oom ? -1 : 0;
bad:
    err(c, UNW_ERR_BAD_OP);
    return -1;
}

/* ------------------------------------------------------------------ CIE / FDE parsing */

struct section {
    const uint8_t *buf;
    uint64_t len;
    struct encctx ec;
    int is_eh;         /* .eh_frame (LSB) vs .debug_frame (DWARF) conventions */
};

/* Entry header: length (u32, or 0xffffffff + u64: DWARF 5 7.4 64-bit format). On success
 * body and bend delimit the entry after its length field and *dwarf64 tells the id width. */
static int entry_bounds(const struct section *s, uint64_t off, const uint8_t **body,
                        const uint8_t **bend, int *dwarf64, uint64_t *next)
{
    struct rd r = {s->buf + off, s->buf + s->len, 0};
    if (off >= s->len)
        return -1;
    uint64_t len = rd_le(&r, 4);
    *dwarf64 = 0;
    if (len == 0xffffffffu) {
        len = rd_le(&r, 8);
        *dwarf64 = 1;
    }
    if (r.err || len == 0 || len > (uint64_t)(r.end - r.p))
        return -1;
    *body = r.p;
    *bend = r.p + len;
    *next = (uint64_t)(*bend - s->buf);
    return 0;
}

static int parse_cie(struct ctx *c, const struct section *s, uint64_t off, struct cie *out)
{
    const uint8_t *body, *bend;
    int d64;
    uint64_t next;
    if (entry_bounds(s, off, &body, &bend, &d64, &next))
        return -1;
    struct rd r = {body, bend, 0};
    uint64_t id = rd_le(&r, d64 ? 8 : 4);
    uint64_t want = s->is_eh ? 0 : (d64 ? UINT64_MAX : 0xffffffffu);
    if (r.err || id != want)
        return -1;
    uint8_t version = rd_u8(&r);
    if (version != 1 && version != 3 && version != 4)
        return -1;
    const uint8_t *aug = r.p;
    while (r.p < r.end && *r.p)
        r.p++;
    if (r.p >= r.end)
        return -1;
    const uint8_t *aug_end = r.p++;
    memset(out, 0, sizeof *out);
    out->addr_size = 8;
    if (version == 4) {
        out->addr_size = rd_u8(&r);
        if (rd_u8(&r) != 0 || (out->addr_size != 8 && out->addr_size != 4))
            return -1; /* segment selectors: never on Linux */
    }
    out->code_align = rd_uleb(&r);
    out->data_align = rd_sleb(&r);
    out->ra_reg = version == 1 ? rd_u8(&r) : rd_uleb(&r);
    out->fde_enc = out->addr_size == 8 ? 0x00 : 0x03; /* absptr unless 'R' says otherwise */
    if (aug < aug_end && aug[0] == 'z') {
        out->has_z = 1;
        uint64_t alen = rd_uleb(&r);
        if (!rd_need(&r, alen))
            return -1;
        struct rd ar = {r.p, r.p + alen, 0};
        for (const uint8_t *a = aug + 1; a < aug_end; a++) {
            int bad = 0;
            if (*a == 'R') {
                out->fde_enc = rd_u8(&ar);
            } else if (*a == 'L') {
                rd_u8(&ar); /* LSDA encoding: the FDE's augmentation data is skipped by length */
            } else if (*a == 'P') {
                uint8_t penc = rd_u8(&ar);
                /* the personality pointer may be indirect: we only need its size */
                rd_enc_value(&ar, penc, &bad);
                if (bad)
                    return -1;
            } else if (*a == 'S') {
                out->signal = 1;
            } else if (*a == 'B' || *a == 'G') {
                /* aarch64 BTI / MTE: no data, no effect on unwinding */
            } else {
                break; /* unknown: 'z' lets us skip the rest by length (LSB 10.6.1.1) */
            }
        }
        if (ar.err)
            return -1;
        r.p += alen;
    } else if (aug < aug_end) {
        return -1; /* pre-'z' augmentations ("eh") have no length: cannot skip them */
    }
    /* Real factors are 1 (x86) or 4 (aarch64) and -8/-4: bounding them keeps every factored
     * product and negation well defined. */
    if (r.err || out->code_align == 0 || out->code_align > (1u << 16) ||
        out->data_align < -(1 << 16) || out->data_align > (1 << 16) ||
        out->ra_reg != c->arch->ra)
        return -1;
    out->insns = r.p;
    out->insns_end = bend;
    return 0;
}

/* Parse and run one FDE at section offset off; rows go into c->rows as one group. */
static void do_fde(struct ctx *c, const struct section *s, uint64_t off, uint32_t prio,
                   uint64_t *cie_cache_off, struct cie *cie_cache, struct state *cie_state,
                   int *cie_ok)
{
    const uint8_t *body, *bend;
    int d64;
    uint64_t next;
    if (entry_bounds(s, off, &body, &bend, &d64, &next)) {
        err(c, UNW_ERR_BAD_FDE);
        return;
    }
    struct rd r = {body, bend, 0};
    uint64_t idpos = (uint64_t)(body - s->buf);
    uint64_t id = rd_le(&r, d64 ? 8 : 4);
    uint64_t cie_off;
    if (s->is_eh) {
        if (id == 0 || id > idpos)
            goto bad;
        cie_off = idpos - id; /* LSB: CIE pointer is relative to the field itself */
    } else {
        cie_off = id;
    }
    if (cie_off != *cie_cache_off) {
        *cie_cache_off = cie_off;
        *cie_ok = 0;
        if (parse_cie(c, s, cie_off, cie_cache)) {
            err(c, UNW_ERR_BAD_CIE);
            return;
        }
        struct state init;
        memset(&init, 0, sizeof init); /* every column UNW_REG_SAME (0) until the CIE says */
        init.cfa = (struct cfarule){UNW_CFA_UNSUPPORTED, 0, 0};
        if (run_program(c, cie_cache, cie_cache->insns, cie_cache->insns_end, &init, NULL, 0, 0, 0,
                        &s->ec, 0)) {
            err(c, UNW_ERR_BAD_CIE);
            return;
        }
        *cie_state = init;
        *cie_ok = 1;
    }
    if (!*cie_ok)
        return; /* counted once when its CIE failed */
    const struct cie *cie = cie_cache;
    int bad = 0;
    uint64_t start, range;
    if (s->is_eh) {
        start = rd_enc(&r, cie->fde_enc, &s->ec, &bad);
        range = rd_enc_value(&r, cie->fde_enc, &bad);
    } else {
        start = rd_le(&r, cie->addr_size);
        range = rd_le(&r, cie->addr_size);
    }
    if (bad) {
        err(c, UNW_ERR_BAD_ENCODING);
        return;
    }
    if (s->is_eh && cie->has_z) {
        uint64_t alen = rd_uleb(&r);
        if (!rd_need(&r, alen))
            goto bad;
        r.p += alen;
    }
    if (r.err || start + range < start)
        goto bad;
    if (range == 0) {
        err(c, UNW_ERR_ZERO_FDE);
        return;
    }
    uint32_t first = c->nrows;
    struct state st = *cie_state;
    if (run_program(c, cie, r.p, bend, &st, cie_state, 1, start, start + range, &s->ec, first)) {
        c->nrows = first; /* drop the partial group */
        return;
    }
    if (c->nrows == first)
        return;
    if (grow((void **)&c->groups, &c->capgroups, sizeof *c->groups, c->ngroups + 1)) {
        c->oom = 1;
        return;
    }
    c->groups[c->ngroups] = (struct group){start, start + range, first, c->nrows - first, prio,
                                           c->ngroups};
    c->ngroups++;
    return;
bad:
    err(c, UNW_ERR_BAD_FDE);
}

/* Walk every entry of a section in file order (bounded by UNW_MAX_ENTRIES). */
static void walk_section(struct ctx *c, const struct section *s, uint32_t prio)
{
    uint64_t off = 0, cie_off = UINT64_MAX;
    struct cie cie;
    struct state cst;
    int cie_ok = 0;
    for (uint32_t n = 0; off + 4 <= s->len && n < UNW_MAX_ENTRIES && !c->oom; n++) {
        const uint8_t *body, *bend;
        int d64;
        uint64_t next;
        struct rd r = {s->buf + off, s->buf + s->len, 0};
        if (s->is_eh && rd_le(&r, 4) == 0)
            break; /* LSB: a zero length terminates .eh_frame */
        if (entry_bounds(s, off, &body, &bend, &d64, &next)) {
            err(c, UNW_ERR_BAD_FDE);
            break; /* the length is our only way forward */
        }
        struct rd ir = {body, bend, 0};
        uint64_t id = rd_le(&ir, d64 ? 8 : 4);
        int is_cie = s->is_eh ? id == 0 : id == (d64 ? UINT64_MAX : 0xffffffffu);
        if (!ir.err && !is_cie)
            do_fde(c, s, off, prio, &cie_off, &cie, &cst, &cie_ok);
        off = next;
    }
}

/* .eh_frame_hdr search table (LSB 10.6.2): returns 0 if it was used. The table gives each FDE's
 * address; we still parse every FDE, but need no pass to find them and they arrive sorted. */
static int walk_hdr(struct ctx *c, const struct section *s, const uint8_t *hdr, uint64_t hlen,
                    uint64_t haddr)
{
    struct rd r = {hdr, hdr + hlen, 0};
    struct encctx hc = {hdr, haddr, 0, haddr}; /* datarel in the hdr = relative to the hdr */
    uint8_t version = rd_u8(&r), ptr_enc = rd_u8(&r), cnt_enc = rd_u8(&r), tab_enc = rd_u8(&r);
    int bad = 0;
    if (r.err || version != 1 || ptr_enc == DW_EH_PE_omit || cnt_enc == DW_EH_PE_omit ||
        tab_enc != 0x3b) /* datarel|sdata4 is the only table encoding binutils/lld write */
        return -1;
    uint64_t eh_ptr = rd_enc(&r, ptr_enc, &hc, &bad);
    uint64_t count = rd_enc(&r, cnt_enc, &hc, &bad);
    if (bad || r.err || eh_ptr != s->ec.sec_addr || count > (uint64_t)(r.end - r.p) / 8)
        return -1;
    uint64_t cie_off = UINT64_MAX;
    struct cie cie;
    struct state cst;
    int cie_ok = 0;
    for (uint64_t i = 0; i < count && !c->oom; i++) {
        (void)rd_enc(&r, tab_enc, &hc, &bad); /* initial_location: the FDE itself is the truth */
        uint64_t fde = rd_enc(&r, tab_enc, &hc, &bad);
        if (bad || r.err || fde < s->ec.sec_addr || fde - s->ec.sec_addr >= s->len) {
            err(c, UNW_ERR_BAD_FDE);
            bad = 0;
            continue;
        }
        do_fde(c, s, fde - s->ec.sec_addr, 0, &cie_off, &cie, &cst, &cie_ok);
    }
    return 0;
}

/* ------------------------------------------------------------------ table assembly */

static int group_cmp(const void *a, const void *b)
{
    const struct group *x = a, *y = b;
    if (x->prio != y->prio)
        return x->prio < y->prio ? -1 : 1;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

static int group_cmp_start(const void *a, const void *b)
{
    const struct group *x = a, *y = b;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    if (x->prio != y->prio)
        return x->prio < y->prio ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* Does [start,end) overlap any prio-0 group? groups[0..n) sorted by start, non-overlapping
 * after the caller's pass. O(log n). */
static int overlaps(const struct group *g, uint32_t n, uint64_t start, uint64_t end)
{
    uint32_t lo = 0, hi = n;
    while (lo < hi) { /* first group with start >= end */
        uint32_t mid = lo + (hi - lo) / 2;
        if (g[mid].start < end)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo > 0 && g[lo - 1].end > start;
}

int unw_cfi_compile(int arch, const uint8_t *img, uint64_t img_len, const struct unw_sections *sec,
                    const uint8_t *debug_frame, uint64_t debug_frame_len, uint8_t **out,
                    uint64_t *out_len)
{
    *out = NULL;
    *out_len = 0;
    struct ctx c;
    memset(&c, 0, sizeof c);
    c.arch = unw_arch(arch);
    if (!c.arch)
        return -2;
    struct unw_rule none;
    memset(&none, 0, sizeof none);
    none.cfa_kind = UNW_CFA_NONE;
    if (intern(&c, &none) != 0) /* rule 0 is always "no CFI" */
        goto oom;

    if (sec && sec->eh_frame_size && sec->eh_frame_off <= img_len &&
        sec->eh_frame_size <= img_len - sec->eh_frame_off) {
        struct section s = {img + sec->eh_frame_off, sec->eh_frame_size,
                            {img + sec->eh_frame_off, sec->eh_frame_addr, sec->text_addr,
                             sec->data_addr}, 1};
        int used_hdr = -1;
        if (sec->eh_hdr_size && sec->eh_hdr_off <= img_len &&
            sec->eh_hdr_size <= img_len - sec->eh_hdr_off) {
            used_hdr = walk_hdr(&c, &s, img + sec->eh_hdr_off, sec->eh_hdr_size, sec->eh_hdr_addr);
            if (used_hdr)
                err(&c, UNW_ERR_BAD_HDR);
        }
        if (used_hdr)
            walk_section(&c, &s, 0);
    }
    uint32_t n_eh = c.ngroups;
    if (debug_frame && debug_frame_len) {
        struct section s = {debug_frame, debug_frame_len, {debug_frame, 0, 0, 0}, 0};
        walk_section(&c, &s, 1);
    }
    if (c.oom)
        goto oom;

    /* eh_frame groups first, sorted, overlaps dropped; then debug_frame groups that fall
     * entirely in eh_frame's gaps. Cost O(G log G). */
    if (c.ngroups) /* qsort(NULL, 0, ...) is undefined (C11 7.22.5p1) */
        qsort(c.groups, c.ngroups, sizeof *c.groups, group_cmp);
    uint32_t keep = 0;
    for (uint32_t i = 0; i < n_eh; i++) {
        if (keep && c.groups[i].start < c.groups[keep - 1].end) {
            err(&c, UNW_ERR_OVERLAP);
            continue;
        }
        c.groups[keep++] = c.groups[i];
    }
    uint32_t eh_kept = keep;
    for (uint32_t i = n_eh; i < c.ngroups; i++) {
        if (overlaps(c.groups, eh_kept, c.groups[i].start, c.groups[i].end))
            continue; /* eh_frame already covers (part of) it: eh_frame wins */
        c.groups[keep++] = c.groups[i];
    }
    c.ngroups = keep;
    if (c.ngroups)
        qsort(c.groups, c.ngroups, sizeof *c.groups, group_cmp_start);

    /* Emit: rows of each group, a NONE row at each gap, dedupe equal neighbours. */
    uint32_t cap = 0;
    for (uint32_t i = 0; i < c.ngroups; i++)
        cap += c.groups[i].n + 1;
    uint64_t *pcs = malloc(((uint64_t)cap + 1) * sizeof *pcs);
    uint32_t *idx = malloc(((uint64_t)cap + 1) * sizeof *idx);
    if (!pcs || !idx) {
        free(pcs);
        free(idx);
        goto oom;
    }
    uint32_t n = 0, nfdes = 0;
    uint64_t cur_end = 0;
    for (uint32_t i = 0; i < c.ngroups; i++) {
        const struct group *g = &c.groups[i];
        if (n && g->start < cur_end) {
            err(&c, UNW_ERR_OVERLAP); /* two debug_frame FDEs overlapping each other */
            continue;
        }
        if (n && g->start > cur_end && idx[n - 1] != 0) {
            pcs[n] = cur_end;
            idx[n++] = 0;
        }
        nfdes++;
        for (uint32_t k = 0; k < g->n; k++) {
            const struct rowbuf *rb = &c.rows[g->first + k];
            if (n && idx[n - 1] == rb->rule)
                continue;
            if (n && pcs[n - 1] == rb->pc) { /* a gap row at the same pc: replaced */
                idx[n - 1] = rb->rule;
                if (n > 1 && idx[n - 2] == rb->rule)
                    n--;
                continue;
            }
            pcs[n] = rb->pc;
            idx[n++] = rb->rule;
        }
        cur_end = g->end;
    }
    if (n && idx[n - 1] != 0) {
        pcs[n] = cur_end;
        idx[n++] = 0;
    }
    uint64_t base = n ? pcs[0] : 0;
    if (n && pcs[n - 1] - base > UINT32_MAX) {
        err(&c, UNW_ERR_RANGE); /* > 4 GiB of text: keep the first 4 GiB */
        while (n && pcs[n - 1] - base > UINT32_MAX)
            n--;
        if (n && idx[n - 1] != 0) /* the cut must end in "no CFI" */
            idx[n - 1] = 0;
        if (n > 1 && idx[n - 2] == 0) /* after a gap that row repeats it: no equal neighbours */
            n--;
    }
    uint32_t width = c.nrules > 65536 ? 4 : 2;
    uint32_t npages = n ? (uint32_t)((pcs[n - 1] - base) >> 16) + 1 : 0;
    uint64_t roff = unw_blob_rules_off(npages, n, width);
    uint64_t total = roff + (uint64_t)c.nrules * sizeof(struct unw_rule);
    uint8_t *blob = calloc(1, total);
    if (!blob) {
        free(pcs);
        free(idx);
        goto oom;
    }
    struct unw_table_hdr h;
    memset(&h, 0, sizeof h);
    h.magic = UNW_TABLE_MAGIC;
    h.version = UNW_TABLE_VERSION;
    h.arch = (uint8_t)arch;
    h.idx_width = (uint8_t)width;
    h.nrows = n;
    h.nrules = c.nrules;
    h.base = base;
    h.nfdes = nfdes;
    h.npages = npages;
    memcpy(h.errors, c.errors, sizeof h.errors);
    memcpy(blob, &h, sizeof h);
    uint8_t *pf = blob + UNW_HDR_SIZE, *lo = blob + unw_blob_lo_off(npages);
    uint8_t *ip = blob + unw_blob_idx_off(npages, n);
    uint32_t page = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t rel = pcs[i] - base;
        while (page <= (rel >> 16)) { /* pages up to and including this row's start here */
            memcpy(pf + 4 * (uint64_t)page, &i, 4);
            page++;
        }
        uint16_t l = (uint16_t)(rel & 0xffff);
        memcpy(lo + 2 * (uint64_t)i, &l, 2);
        if (width == 2) {
            uint16_t v = (uint16_t)idx[i];
            memcpy(ip + 2 * (uint64_t)i, &v, 2);
        } else {
            memcpy(ip + 4 * (uint64_t)i, &idx[i], 4);
        }
    }
    while (page <= npages) {
        memcpy(pf + 4 * (uint64_t)page, &n, 4);
        page++;
    }
    memcpy(blob + roff, c.rules, (uint64_t)c.nrules * sizeof(struct unw_rule));
    free(pcs);
    free(idx);
    free(c.rows);
    free(c.groups);
    free(c.rules);
    free(c.hash);
    *out = blob;
    *out_len = total;
    return 0;
oom:
    free(c.rows);
    free(c.groups);
    free(c.rules);
    free(c.hash);
    return -1;
}

/* ------------------------------------------------------------------ table access */

static inline uint32_t rd32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint16_t rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline uint32_t row_rule(const uint8_t *blob, const struct unw_table_hdr *h, uint32_t i)
{
    const uint8_t *ip = blob + unw_blob_idx_off(h->npages, h->nrows);
    return h->idx_width == 2 ? rd16(ip + 2 * (uint64_t)i) : rd32(ip + 4 * (uint64_t)i);
}

int unw_table_validate(const uint8_t *blob, uint64_t len)
{
    struct unw_table_hdr h;
    if (!blob || len < UNW_HDR_SIZE)
        return -1;
    memcpy(&h, blob, sizeof h);
    if (h.magic != UNW_TABLE_MAGIC)
        return -2;
    if (h.version != UNW_TABLE_VERSION)
        return -3;
    if (!unw_arch(h.arch))
        return -4;
    if ((h.idx_width != 2 && h.idx_width != 4) || h.nrules == 0 || h.nrows > UNW_MAX_ROWS ||
        (h.nrows == 0) != (h.npages == 0) || h.npages > (1u << 16))
        return -5;
    uint64_t roff = unw_blob_rules_off(h.npages, h.nrows, h.idx_width);
    if (roff + (uint64_t)h.nrules * sizeof(struct unw_rule) != len)
        return -6;
    const uint8_t *pf = blob + UNW_HDR_SIZE, *lo = blob + unw_blob_lo_off(h.npages);
    if (h.nrows && (rd32(pf) != 0 || rd32(pf + 4 * (uint64_t)h.npages) != h.nrows))
        return -7;
    for (uint32_t p = 0; p < h.npages; p++) {
        uint32_t a = rd32(pf + 4 * (uint64_t)p), b = rd32(pf + 4 * ((uint64_t)p + 1));
        if (a > b || b > h.nrows)
            return -7;
        for (uint32_t i = a; i < b; i++)
            if (i > a && rd16(lo + 2 * (uint64_t)i) <= rd16(lo + 2 * ((uint64_t)i - 1)))
                return -7;
    }
    if (h.nrows && rd16(lo) != 0) /* base is row 0's pc */
        return -7;
    for (uint32_t i = 0; i < h.nrows; i++)
        if (row_rule(blob, &h, i) >= h.nrules)
            return -8;
    for (uint32_t i = 0; i < h.nrules; i++) {
        struct unw_rule r;
        memcpy(&r, blob + roff + (uint64_t)i * sizeof r, sizeof r);
        if (r.cfa_kind > UNW_CFA_UNSUPPORTED || r.cfa_reg >= UNW_MAX_DWARF)
            return -9;
        for (unsigned k = 0; k < UNW_NSAVED; k++)
            if (r.regs[k].kind > UNW_REG_UNSUPPORTED || r.regs[k].reg >= UNW_MAX_DWARF)
                return -9;
    }
    return 0;
}

/* Row i of page p: its pc and rule. */
static inline void get_row(const uint8_t *blob, const struct unw_table_hdr *h, uint32_t page,
                           uint32_t i, uint64_t *pc, struct unw_rule *rule)
{
    *pc = h->base + ((uint64_t)page << 16) +
          rd16(blob + unw_blob_lo_off(h->npages) + 2 * (uint64_t)i);
    memcpy(rule,
           blob + unw_blob_rules_off(h->npages, h->nrows, h->idx_width) +
               (uint64_t)row_rule(blob, h, i) * sizeof *rule,
           sizeof *rule);
}

/* The page holding row i: last p with page_first[p] <= i (pages without rows share the value
 * of the next page with rows, so "last" picks the page the row really lives in). O(log pages). */
static uint32_t page_of(const uint8_t *blob, const struct unw_table_hdr *h, uint32_t i)
{
    const uint8_t *pf = blob + UNW_HDR_SIZE;
    uint32_t lo = 0, hi = h->npages;
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (rd32(pf + 4 * (uint64_t)mid) <= i)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

int unw_table_row(const uint8_t *blob, uint32_t i, uint64_t *pc, struct unw_rule *rule)
{
    struct unw_table_hdr h;
    memcpy(&h, blob, sizeof h);
    if (i >= h.nrows)
        return -1;
    get_row(blob, &h, page_of(blob, &h, i), i, pc, rule);
    return 0;
}

/* The row covering vaddr pc, or -1; *page = the page the search ended in (the row's own page
 * unless the row was found as "the previous row overall", then page_of() tells). hint: a row
 * index remembered from an earlier lookup, or anything else (UINT32_MAX: none). It is accepted
 * only if it meets exactly the conditions the binary search would end on (row in this pc's page,
 * pc_lo <= key, next row of the page > key), so a stale or wrong hint -- even one remembered for
 * another table that now sits at the same address -- costs the search, never a wrong row.
 * Reads only the header fields it needs, not a copy of the whole 96-byte header per lookup.
 * Cost: O(1) with a correct hint, else O(log rows in the page). */
static inline int64_t find_row(const uint8_t *blob, uint64_t pc, uint32_t hint, uint32_t *page_out,
                               uint32_t *npages_out)
{
    uint32_t nrows, npages;
    uint64_t base;
    memcpy(&nrows, blob + offsetof(struct unw_table_hdr, nrows), 4);
    memcpy(&npages, blob + offsetof(struct unw_table_hdr, npages), 4);
    memcpy(&base, blob + offsetof(struct unw_table_hdr, base), 8);
    *npages_out = npages;
    if (!nrows || pc < base)
        return -1;
    uint64_t rel = pc - base;
    const uint8_t *pf = blob + UNW_HDR_SIZE, *lo16 = blob + unw_blob_lo_off(npages);
    int in = (rel >> 16) < npages;
    uint32_t page = in ? (uint32_t)(rel >> 16) : npages - 1;
    uint32_t key = in ? (uint32_t)(rel & 0xffff) : 0xffff;
    uint32_t a = rd32(pf + 4 * (uint64_t)page), b = rd32(pf + 4 * ((uint64_t)page + 1));
    *page_out = page;
    if (a == b || rd16(lo16 + 2 * (uint64_t)a) > key) {
        /* pc precedes this page's first row: the covering row is the previous row overall */
        if (a == 0)
            return -1;
        *page_out = UINT32_MAX;
        return a - 1;
    }
    if (hint >= a && hint < b && rd16(lo16 + 2 * (uint64_t)hint) <= key &&
        (hint + 1 == b || rd16(lo16 + 2 * ((uint64_t)hint + 1)) > key))
        return hint;
    uint32_t l = a, r = b; /* last row in [a, b) with pc_lo <= key */
    while (r - l > 1) {
        uint32_t mid = l + (r - l) / 2;
        if (rd16(lo16 + 2 * (uint64_t)mid) <= key)
            l = mid;
        else
            r = mid;
    }
    return l;
}

int64_t unw_table_lookup(const uint8_t *blob, uint64_t pc, struct unw_rule *rule,
                         uint64_t *row_start)
{
    uint32_t page, npages;
    int64_t i = find_row(blob, pc, UINT32_MAX, &page, &npages);
    if (i < 0)
        return -1;
    struct unw_table_hdr h;
    memcpy(&h, blob, sizeof h);
    if (page == UINT32_MAX)
        page = page_of(blob, &h, (uint32_t)i);
    get_row(blob, &h, page, (uint32_t)i, row_start, rule);
    return i;
}

int64_t unw_table_lookup_hint(const uint8_t *blob, uint64_t pc, uint32_t hint,
                              struct unw_rule *rule)
{
    uint32_t page, npages;
    int64_t i = find_row(blob, pc, hint, &page, &npages);
    if (i < 0)
        return -1;
    uint32_t nrows, idxw;
    uint8_t w;
    memcpy(&nrows, blob + offsetof(struct unw_table_hdr, nrows), 4);
    memcpy(&w, blob + offsetof(struct unw_table_hdr, idx_width), 1);
    idxw = w;
    const uint8_t *ip = blob + unw_blob_idx_off(npages, nrows);
    uint32_t ri = idxw == 2 ? rd16(ip + 2 * (uint64_t)i) : rd32(ip + 4 * (uint64_t)i);
    memcpy(rule, blob + unw_blob_rules_off(npages, nrows, idxw) + (uint64_t)ri * sizeof *rule,
           sizeof *rule);
    return i;
}
