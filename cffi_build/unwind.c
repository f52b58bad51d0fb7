/* unwind.c: the batched DWARF CFI unwinder over compiled tables (cfi.c).
 *
 * Contract (framehop's, STYLE.md 5): the caller supplies modules (absolute [start,end), load bias,
 * compiled table) and, per sample, perf's REGS_USER dump and the STACK_USER copy; we return
 * absolute pcs only, leaf first, and one status per sample.
 *
 * Invariants:
 *   - Every memory read is a read of the sample's stack copy, bounds-checked against
 *     [sp0, sp0 + stack_len) where sp0 is the sampled sp (perf copies from there; kernel
 *     perf_output_sample_ustack). A read outside is UNW_TRUNCATED, never a fault.
 *   - Tables were validated once by the caller (unw_table_validate); lookups stay inside them.
 *   - Termination: every frame either stops or strictly increases the stack pointer (the CFA),
 *     except across a signal frame (sigaltstack may move it anywhere), and at most max_depth pcs
 *     are written. A run of signal frames cannot loop forever either: the depth cap bounds it.
 *     Cost per frame: O(log modules + log rows).
 *   - Registers are recovered lazily in effect, like libunwind's (perf's unwinder): every
 *     callee-saved column of the rule (unw_rule.regs) is evaluated, but a slot that cannot be
 *     read (outside the stack copy) only makes that register unknown ("lost"). A walk fails
 *     only when an unknown register is needed: the CFA base, the return address, or the base
 *     of a rule that is itself needed; the status is TRUNCATED if the register was lost to the
 *     copy's bounds, else BAD_CFI. Example: python3.11 0x5c53e3, an epilogue after the pops,
 *     has "CFA=rsp+8, rbp at CFA-32": rbp's slot is below sp, yet the caller never needs it.
 *   - Across an ordinary frame, callee-saved registers follow their rules (default: same value),
 *     sp becomes the CFA and the pc the return address; caller-saved registers become unknown.
 *     At a UNW_CFA_SIGFRAME frame every register is restored from the kernel's saved context
 *     (arch descriptor sigctx_off), so rules in the interrupted frame may use any of them.
 *
 * Frame rules (DWARF 5 6.4.4): a return address points after the call, so non-leaf frames are
 * looked up at pc - 1; a frame entered from a signal frame holds the exact interrupted pc, so it
 * is looked up at pc (libgcc unwind-dw2.c _Unwind_Find_FDE with context->signal_frame).
 */
#include <string.h>

#include "unwcore_int.h"

struct frame {
    uint64_t regs[UNW_MAX_DWARF];
    uint64_t valid; /* bit d: regs[d] known */
    uint64_t lost;  /* bit d: unknown because its save slot lay outside the stack copy */
    uint64_t pc;
};

struct sample {
    const uint8_t *stack;
    uint64_t sp0, len;
};

static inline int rd_stack(const struct sample *s, uint64_t addr, uint64_t *v)
{
    if (addr < s->sp0 || addr - s->sp0 > s->len || s->len - (addr - s->sp0) < 8)
        return 0;
    memcpy(v, s->stack + (addr - s->sp0), 8);
    return 1;
}

static const struct unw_module *find_module(const struct unw_item *it, uint64_t pc)
{
    uint32_t lo = 0, hi = it->nmods;
    while (lo < hi) { /* first module with start > pc */
        uint32_t mid = lo + (hi - lo) / 2;
        if (it->mods[mid].start <= pc)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (!lo || pc >= it->mods[lo - 1].end)
        return NULL;
    return &it->mods[lo - 1];
}

static inline int reg_get(const struct frame *f, uint8_t r, uint64_t *v)
{
    if (r >= UNW_MAX_DWARF || !(f->valid >> r & 1))
        return 0;
    *v = f->regs[r];
    return 1;
}

static inline int reg_lost(const struct frame *f, uint8_t r)
{
    return r < UNW_MAX_DWARF && (f->lost >> r & 1);
}

/* Why a needed register is unknown: lost to the copy's bounds, or never known. */
static inline uint8_t need_fail(const struct frame *f, uint8_t r)
{
    return reg_lost(f, r) ? UNW_TRUNCATED : UNW_BAD_CFI;
}

static inline void reg_set(struct frame *f, uint8_t r, uint64_t v)
{
    f->regs[r] = v;
    f->valid |= 1ull << r;
    f->lost &= ~(1ull << r);
}

/* EV_READ: the value lies outside the stack copy (directly, or its base register was lost). */
enum { EV_OK, EV_UNDEF, EV_BAD, EV_READ };

/* Evaluate the rule of column col given the callee's registers and the CFA. */
static int eval_reg(const struct frame *f, const struct sample *s, const struct unw_regrule *rr,
                    uint64_t cfa, uint8_t col, uint64_t *out)
{
    uint64_t base;
    switch (rr->kind) {
    case UNW_REG_SAME:
        if (reg_get(f, col, out))
            return EV_OK;
        return reg_lost(f, col) ? EV_READ : EV_UNDEF;
    case UNW_REG_UNDEF:
        return EV_UNDEF;
    case UNW_REG_AT_CFA:
        return rd_stack(s, cfa + (uint64_t)(int64_t)rr->off, out) ? EV_OK : EV_READ;
    case UNW_REG_VAL_CFA:
        *out = cfa + (uint64_t)(int64_t)rr->off;
        return EV_OK;
    case UNW_REG_AT_REG:
        if (!reg_get(f, rr->reg, &base))
            return reg_lost(f, rr->reg) ? EV_READ : EV_BAD;
        return rd_stack(s, base + (uint64_t)(int64_t)rr->off, out) ? EV_OK : EV_READ;
    case UNW_REG_VAL_REG:
        if (!reg_get(f, rr->reg, &base))
            return reg_lost(f, rr->reg) ? EV_READ : EV_BAD;
        *out = base + (uint64_t)(int64_t)rr->off;
        return EV_OK;
    case UNW_REG_REGISTER:
        if (reg_get(f, rr->reg, out))
            return EV_OK;
        return reg_lost(f, rr->reg) ? EV_READ : EV_BAD;
    default:
        return EV_BAD;
    }
}

uint8_t unw_unwind_one(const struct unw_arch_desc *a, const struct unw_item *it,
                       uint32_t max_depth, uint64_t *out, uint8_t *kinds, uint32_t *count,
                       uint16_t *fpf, uint16_t *sigf)
{
    struct frame f, nf;
    f.valid = f.lost = 0;
    *count = 0;
    *fpf = 0;
    *sigf = 0;
    if (!it->regs || !it->nregs)
        return UNW_NO_REGS;
    /* perf dumps registers in ascending bit order of regs_mask (kernel perf_output_sample_regs) */
    int have_pc = 0;
    for (uint32_t d = 0; d <= UNW_MAX_DWARF; d++) {
        int p = d < a->ndwarf ? a->dwarf_to_perf[d] : (d == UNW_MAX_DWARF ? a->perf_ip : -1);
        if (p < 0 || p >= 64 || !(it->regs_mask >> p & 1))
            continue;
        uint32_t idx = (uint32_t)__builtin_popcountll(it->regs_mask & ((1ull << p) - 1));
        if (idx >= it->nregs)
            continue;
        if (d == UNW_MAX_DWARF) {
            f.pc = it->regs[idx];
            have_pc = 1;
        } else {
            reg_set(&f, (uint8_t)d, it->regs[idx]);
        }
    }
    if (!have_pc || !(f.valid >> a->sp & 1))
        return UNW_NO_REGS;
    if (!max_depth)
        return UNW_DEPTH_CAP;
    kinds[*count] = 0;
    out[(*count)++] = f.pc;
    if (!it->stack || !it->stack_len)
        return UNW_NO_REGS;
    uint64_t saved_mask = 0; /* callee-saved columns other than fp and RA */
    for (unsigned i = 0; i < a->nsaved; i++)
        if (i != UNW_SLOT_FP && i != UNW_SLOT_RA)
            saved_mask |= 1ull << a->saved[i];
    struct sample s = {it->stack, f.regs[a->sp], it->stack_len};
    int leaf = 1, exact = 0; /* exact: look up pc itself (leaf, or entered from a signal frame) */
    for (;;) {
        if (f.pc == 0)
            return UNW_OK;
        uint64_t lpc = (leaf || exact) ? f.pc : f.pc - 1;
        const struct unw_module *m = find_module(it, lpc);
        if (!m)
            return UNW_UNMAPPED_PC;
        struct unw_rule rule;
        uint64_t row_pc;
        int have = 0;
        if (m->table && unw_table_lookup(m->table, lpc - m->bias, &rule, &row_pc) >= 0 &&
            rule.cfa_kind != UNW_CFA_NONE)
            have = 1;
        if (!have && !leaf && !exact && m->table &&
            unw_table_lookup(m->table, f.pc - m->bias, &rule, &row_pc) >= 0 &&
            (rule.flags & UNW_RULE_SIGNAL))
            have = 1; /* a signal trampoline whose FDE does not start one byte early */

        uint64_t sp = f.regs[a->sp], cfa = 0, npc = 0;
        int signal = 0;
        nf.valid = nf.lost = 0;
        if (!have) {
            /* Frame-pointer fallback (System V AMD64 ABI 3.3.2 convention): push rbp; mov rsp,rbp
             * gives [rbp] = caller's rbp, [rbp+8] = return address, caller's rsp = rbp + 16.
             * Other callee-saved registers keep their values (libunwind does the same). */
            uint64_t fp, v;
            if (!reg_get(&f, a->fp, &fp))
                return reg_lost(&f, a->fp) ? UNW_TRUNCATED : UNW_NO_CFI;
            if (fp < sp || fp - s.sp0 >= s.len)
                return UNW_NO_CFI;
            if (!rd_stack(&s, fp + 8, &npc))
                return UNW_TRUNCATED;
            nf.valid = f.valid & saved_mask;
            nf.lost = f.lost & saved_mask;
            for (unsigned i = 0; i < a->nsaved; i++)
                nf.regs[a->saved[i]] = f.regs[a->saved[i]];
            if (rd_stack(&s, fp, &v))
                reg_set(&nf, a->fp, v);
            else
                nf.lost |= 1ull << a->fp;
            cfa = fp + 16;
            kinds[*count - 1] |= UNW_FRAME_FP;
            (*fpf)++;
        } else {
            uint64_t base, addr;
            signal = rule.flags & UNW_RULE_SIGNAL;
            if (signal) {
                kinds[*count - 1] |= UNW_FRAME_SIGNAL;
                (*sigf)++;
            }
            switch (rule.cfa_kind) {
            case UNW_CFA_REG_OFF:
                if (!reg_get(&f, rule.cfa_reg, &base))
                    return need_fail(&f, rule.cfa_reg);
                cfa = base + (uint64_t)(int64_t)rule.cfa_off;
                break;
            case UNW_CFA_DEREF:
            case UNW_CFA_SIGFRAME: /* glibc __restore_rt: CFA = uc_mcontext.rsp, read from the
                                    * rt_sigframe on the stack (DW_OP_breg7 160; DW_OP_deref) */
                if (!reg_get(&f, rule.cfa_kind == UNW_CFA_SIGFRAME ? a->sp : rule.cfa_reg, &base))
                    return need_fail(&f, rule.cfa_reg);
                addr = base + (uint64_t)(int64_t)rule.cfa_off;
                if (!rd_stack(&s, addr, &cfa))
                    return UNW_TRUNCATED;
                break;
            case UNW_CFA_PLT: /* binutils PLT: rsp + 8, + 8 more once the push has executed */
                cfa = sp + (uint64_t)(int64_t)rule.cfa_off +
                      (((f.pc & 15) >= rule.cfa_reg) ? 8 : 0);
                break;
            default:
                return UNW_BAD_CFI;
            }
            if (!signal && cfa <= sp)
                return UNW_NO_PROGRESS; /* before any read: a stuck CFA says more than a bad read */
            if (rule.cfa_kind == UNW_CFA_SIGFRAME) {
                /* The interrupted context, every register of it, from the saved sigcontext.
                 * (On aarch64 the pc column is separate from the RA (x30): its desc will name it.) */
                for (uint8_t d = 0; d < a->ndwarf; d++) {
                    uint64_t v;
                    if (a->sigctx_off[d] < 0)
                        continue;
                    if (rd_stack(&s, sp + (uint64_t)(int64_t)a->sigctx_off[d], &v))
                        reg_set(&nf, d, v);
                    else
                        nf.lost |= 1ull << d;
                }
                if (!reg_get(&nf, a->ra, &npc))
                    return UNW_TRUNCATED;
            } else {
                int e = eval_reg(&f, &s, &rule.regs[UNW_SLOT_RA], cfa, a->ra, &npc);
                if (e == EV_UNDEF)
                    return UNW_OK; /* DWARF 5 6.4.4: undefined RA marks the outermost frame */
                if (e == EV_BAD)
                    return UNW_BAD_CFI;
                if (e == EV_READ)
                    return UNW_TRUNCATED;
                for (unsigned i = 0; i < a->nsaved; i++) {
                    uint64_t v;
                    if (i == UNW_SLOT_RA)
                        continue;
                    e = eval_reg(&f, &s, &rule.regs[i], cfa, a->saved[i], &v);
                    if (e == EV_OK)
                        reg_set(&nf, a->saved[i], v);
                    else if (e == EV_READ)
                        nf.lost |= 1ull << a->saved[i];
                    /* EV_UNDEF / EV_BAD: unknown; BAD_CFI if a later rule needs it */
                }
            }
        }
        if (!signal && cfa <= sp)
            return UNW_NO_PROGRESS;
        if (npc == 0)
            return UNW_OK;
        if (*count >= max_depth)
            return UNW_DEPTH_CAP;
        kinds[*count] = 0;
        out[(*count)++] = npc;
        reg_set(&nf, a->sp, cfa); /* the CFA is the caller's sp (x86_64 and aarch64 psABIs) */
        if (a->dwarf_to_perf[a->ra] == a->perf_ip) /* x86: the RA column is the pc */
            reg_set(&nf, a->ra, npc);
        nf.pc = npc;
        f = nf;
        leaf = 0;
        exact = signal;
    }
}

int unw_unwind_batch(int arch, const struct unw_item *items, uint32_t n, uint32_t max_depth,
                     uint64_t *pcs, uint8_t *kinds, uint32_t *counts, uint8_t *status,
                     uint16_t *fp_frames, uint16_t *sig_frames)
{
    const struct unw_arch_desc *a = unw_arch(arch);
    if (!a || !max_depth || max_depth > (1u << 16))
        return -1;
    for (uint32_t i = 0; i < n; i++)
        status[i] = unw_unwind_one(a, &items[i], max_depth, pcs + (uint64_t)i * max_depth,
                                   kinds + (uint64_t)i * max_depth, &counts[i], &fp_frames[i],
                                   &sig_frames[i]);
    return 0;
}
