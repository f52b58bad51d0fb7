/* cfaprog.c: the CFA program interpreter: runs a CIE's or FDE's call frame instructions
 * (DWARF 5 section 6.4.2, DW_CFA_* values from section 7.24) and emits one row per location
 * the FDE covers, each row's rule interned in the compile context.
 *
 * Invariants:
 *   - Bounded work: a program is at most UNW_MAX_PROG bytes and one FDE emits at most
 *     UNW_MAX_FDE_ROWS rows (the table at most UNW_MAX_ROWS); the remember_state stack is
 *     UNW_MAX_STATE deep. Each instruction moves forward by >= 1 byte, so a program runs in
 *     O(its length).
 *   - Only rules the unwinder can evaluate are kept precisely; any other expression becomes an
 *     UNSUPPORTED kind (the unwinder stops there with BAD_CFI) and is counted. Offsets that do
 *     not fit the packed rule make it unusable, never wrong. Only the callee-saved columns of
 *     the arch descriptor are tracked.
 *   - Several rows at one pc: the last one wins. set_loc may only move forward.
 */
#include "cfi_int.h"

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
    return cfi_intern(c, &r);
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
    if (cfi_grow((void **)&c->rows, &c->caprows, sizeof *c->rows, c->nrows + 1)) {
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
int cfi_run_program(struct ctx *c, const struct cie *cie, const uint8_t *p, const uint8_t *pend,
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
                uint64_t nl = cfi_rd_enc(&r, cie->fde_enc, ec, &bad);
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
