/* unwind.c: the batched DWARF CFI unwinder over compiled tables (cfitable.c).
 *
 * Contract (framehop's: the unwinder returns addresses only): the caller supplies modules
 * (absolute [start,end), load bias, compiled table) and, per sample, perf's REGS_USER dump and
 * the STACK_USER copy; we return absolute pcs only, leaf first, and one status per sample.
 *
 * Invariants:
 *   - Every memory read is a read of the sample's stack copy, bounds-checked against
 *     [sp0, sp0 + stack_len) where sp0 is the sampled sp (perf copies from there; kernel
 *     perf_output_sample_ustack). A read outside is UNW_TRUNCATED, never a fault.
 *   - Tables were validated once by the caller (unw_table_validate); lookups stay inside them.
 *   - Termination: every frame either stops or strictly increases the stack pointer (the CFA),
 *     except across a signal frame (sigaltstack may move it anywhere), and at most max_depth pcs
 *     are written. A run of signal frames cannot loop forever either: the depth cap bounds it.
 *     Cost per frame: O(1) when the lookup cache below hits, else O(log modules + log rows).
 *   - Registers are recovered lazily in effect, like libunwind's (perf's unwinder): every
 *     callee-saved column of the rule (unw_rule.regs) is evaluated, but a slot that cannot be
 *     read (outside the stack copy) only makes that register unknown ("lost"). A walk fails
 *     only when an unknown register is needed: the CFA base, the return address, or the base
 *     of a rule that is itself needed; the status is TRUNCATED if the register was lost to the
 *     copy's bounds, else BAD_CFI. Example: an epilogue after the pops can have
 *     "CFA=rsp+8, rbp at CFA-32": rbp's slot is below sp, yet the caller never needs it.
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
    uint64_t o = addr - s->sp0; /* wraps above len when addr < sp0 */
    if (o > s->len || s->len - o < 8)
        return 0;
    memcpy(v, s->stack + o, 8);
    return 1;
}

const struct unw_module *unw_module_find(const struct unw_module *mods, uint32_t nmods,
                                         uint64_t pc)
{
    uint32_t lo = 0, hi = nmods;
    while (lo < hi) { /* first module with start > pc */
        uint32_t mid = lo + (hi - lo) / 2;
        if (mods[mid].start <= pc)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (!lo || pc >= mods[lo - 1].end)
        return NULL;
    return &mods[lo - 1];
}

static const struct unw_module *find_module(const struct unw_item *it, uint64_t pc)
{
    return unw_module_find(it->mods, it->nmods, pc);
}

/* Lookup cache: lookup pc -> (module index, CFI row), direct-mapped, per thread.
 *
 * Why: a profile's stacks repeat the same return addresses, and the two binary searches per
 * frame -- modules, then the rows of a table of up to ~10^5 rows, a cache miss per probe --
 * are a large part of an unwind; a profile's distinct (address space, pc) pairs are few
 * enough that a cache of 1 << LK_BITS entries serves nearly every lookup (BENCHMARKS.md,
 * "Unwinder loop", has the hit rate).
 *
 * Why it cannot change a result: an entry is only a hint, checked against the current inputs
 * before use. The module hint is used only if it indexes the item's own module array and that
 * module covers the pc; modules are sorted and non-overlapping (unwcore.h), so that module is
 * the one find_module returns. The row hint goes to unw_table_lookup_hint, which accepts it only
 * if it meets the search's own end conditions in the current table (cfilookup.c find_row). So
 * a stale entry (a module array or table freed and another allocated at the same address, another
 * process) costs the searches, never a different row (test_unwinder.py
 * test_lookup_cache_never_serves_stale_entries). The cache never dereferences a pointer it
 * holds: mods is only compared, and the index is checked against the item's nmods first.
 *
 * Why per thread (__thread) rather than per call or per context: stacks.c calls
 * unw_unwind_one once per sample, so a cache must outlive the call to help it; per thread needs
 * no locking and no API change. Bound: 1 << LK_BITS entries of 24 bytes (96 KiB) per thread that
 * unwinds, allocated zeroed by the dynamic loader's TLS on first use, freed at thread exit.
 * Cost: one multiply-shift hash and O(1) checks per frame on a hit; a miss adds the
 * O(log modules + log rows) searches. */
#ifndef LK_BITS
#define LK_BITS 12
#endif

struct lk_ent {
    uint64_t pc;                   /* lookup pc (absolute; pc - 1 for return addresses) */
    const struct unw_module *mods; /* module array the entry was filled from (compared only) */
    uint32_t mod;                  /* index of the covering module in that array */
    uint32_t row;                  /* row index in its table, UINT32_MAX if none */
};

static __thread struct lk_ent lk_cache[1u << LK_BITS];

static inline struct lk_ent *lk_slot(struct lk_ent *cache, const struct unw_item *it, uint64_t pc)
{
    uint64_t h = (pc ^ ((uint64_t)(uintptr_t)it->mods >> 4)) * 0x9e3779b97f4a7c15ull;
    return &cache[h >> (64 - LK_BITS)];
}

/* find_module through the cache; *e is the pc's slot, refilled on a miss (row unknown). */
static inline const struct unw_module *lk_module(const struct unw_item *it, struct lk_ent *e,
                                                 uint64_t pc)
{
    if (e->pc == pc && e->mods == it->mods && e->mod < it->nmods) {
        const struct unw_module *m = &it->mods[e->mod];
        if (m->start <= pc && pc < m->end)
            return m;
    }
    const struct unw_module *m = find_module(it, pc);
    if (m) {
        e->pc = pc;
        e->mods = it->mods;
        e->mod = (uint32_t)(m - it->mods);
        e->row = UINT32_MAX;
    }
    return m;
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

/* Evaluate the rule of column col given the callee's registers and the CFA. Inlined into the
 * per-frame loop: it runs nsaved times per frame (7 on x86_64). */
static inline __attribute__((always_inline)) int
eval_reg(const struct frame *f, const struct sample *s, const struct unw_regrule *rr, uint64_t cfa,
         uint8_t col, uint64_t *out)
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

/* How far ahead of the CFA the stack copy is prefetched (bytes; see unw_unwind_one). */
#ifndef UNW_PF_DIST
#define UNW_PF_DIST 512
#endif

uint8_t unw_unwind_one(const struct unw_arch_desc *a, const struct unw_item *it,
                       uint32_t max_depth, uint64_t *out, uint8_t *kinds, uint32_t *count,
                       uint16_t *fpf, uint16_t *sigf)
{
    /* Two frames used in turn: the callee (*f) and the caller being built (*nf). Only the
     * valid/lost masks are reset per frame, never the 34 registers: regs[d] is read only when
     * valid bit d is set (reg_get), and the FP fallback copies unset ones only to mask them off
     * again, so a frame costs no copy of the whole register file. */
    struct frame fr[2];
    struct frame *f = &fr[0], *nf = &fr[1];
    uint32_t n = 0;      /* pcs written; stored to *count on every return */
    uint16_t nfp = 0, nsig = 0;
    uint8_t st;
    f->valid = f->lost = 0;
    *count = 0;
    *fpf = 0;
    *sigf = 0;
    if (!it->regs || !it->nregs)
        return UNW_NO_REGS;
    /* perf dumps registers in ascending bit order of regs_mask (kernel perf_output_sample_regs):
     * pos[p] = index of perf register p in the dump, for the bits set in regs_mask (a
     * popcount per register would be a libgcc call without -mpopcnt). */
    uint8_t pos[64];
    uint32_t k = 0;
    for (uint64_t msk = it->regs_mask; msk; msk &= msk - 1)
        pos[__builtin_ctzll(msk)] = (uint8_t)k++;
    int have_pc = 0;
    for (uint32_t d = 0; d <= UNW_MAX_DWARF; d++) {
        int p = d < a->ndwarf ? a->dwarf_to_perf[d] : (d == UNW_MAX_DWARF ? a->perf_ip : -1);
        if (p < 0 || p >= 64 || !(it->regs_mask >> p & 1))
            continue;
        uint32_t idx = pos[p];
        if (idx >= it->nregs)
            continue;
        if (d == UNW_MAX_DWARF) {
            f->pc = it->regs[idx];
            have_pc = 1;
        } else {
            reg_set(f, (uint8_t)d, it->regs[idx]);
        }
    }
    if (!have_pc || !(f->valid >> a->sp & 1))
        return UNW_NO_REGS;
    if (!max_depth)
        return UNW_DEPTH_CAP;
    kinds[0] = 0;
    out[0] = f->pc;
    n = *count = 1;
    if (!it->stack || !it->stack_len)
        return UNW_NO_REGS;
    /* The arch descriptor's fields, read once: kinds[] is uint8_t, which may alias anything,
     * so every store to it would otherwise force the compiler to reload them. */
    const uint8_t sp_col = a->sp, frameptr_col = a->fp, ra_col = a->ra, nsaved = a->nsaved;
    const int ra_is_pc = a->dwarf_to_perf[ra_col] == a->perf_ip; /* x86: the RA column is rip */
    uint8_t saved[UNW_NSAVED];
    uint64_t saved_mask = 0; /* callee-saved columns other than fp and RA */
    for (unsigned i = 0; i < nsaved; i++) {
        saved[i] = a->saved[i];
        if (i != UNW_SLOT_FP && i != UNW_SLOT_RA)
            saved_mask |= 1ull << a->saved[i];
    }
    const struct sample s = {it->stack, f->regs[sp_col], it->stack_len};
    /* Software prefetch of the stack copy, UNW_PF_DIST bytes ahead of the CFA: the walk reads
     * the copy upward, one or two slots per frame, each read on the critical path (its value is
     * the next pc, whose lookup gives the next read's address), and the copies of a replay
     * (8 KiB x samples) are never in cache. pf_hi: offsets below it were prefetched; each line
     * is prefetched once (a frame can span several lines). Only addresses inside the copy are
     * formed; a prefetch never faults. Cost: len / 64 prefetches per sample at most. */
    uint64_t pf_hi = 0;
    for (; pf_hi < UNW_PF_DIST && pf_hi < s.len; pf_hi += 64)
        __builtin_prefetch(s.stack + pf_hi);
    struct lk_ent *cache = lk_cache; /* one TLS address computation per sample, not per frame */
    int leaf = 1, exact = 0; /* exact: look up pc itself (leaf, or entered from a signal frame) */
    for (;;) {
        if (f->pc == 0) {
            st = UNW_OK;
            break;
        }
        uint64_t lpc = (leaf || exact) ? f->pc : f->pc - 1;
        struct lk_ent *e = lk_slot(cache, it, lpc);
        const struct unw_module *m = lk_module(it, e, lpc);
        if (!m) {
            st = UNW_UNMAPPED_PC;
            break;
        }
        struct unw_rule rule;
        int have = 0;
        if (m->table) {
            int64_t row = unw_table_lookup_hint(m->table, lpc - m->bias, e->row, &rule);
            e->row = row >= 0 ? (uint32_t)row : UINT32_MAX;
            have = row >= 0 && rule.cfa_kind != UNW_CFA_NONE;
        }
        if (!have && !leaf && !exact && m->table &&
            unw_table_lookup_hint(m->table, f->pc - m->bias, UINT32_MAX, &rule) >= 0 &&
            (rule.flags & UNW_RULE_SIGNAL))
            have = 1; /* a signal trampoline whose FDE does not start one byte early */

        uint64_t sp = f->regs[sp_col], cfa = 0, npc = 0;
        int signal = 0;
        nf->valid = nf->lost = 0;
        if (!have) {
            /* Frame-pointer fallback (System V AMD64 ABI 3.3.2 convention): push rbp; mov rsp,rbp
             * gives [rbp] = caller's rbp, [rbp+8] = return address, caller's rsp = rbp + 16.
             * Other callee-saved registers keep their values (libunwind does the same).
             * JIT code (UNW_MOD_JIT: no table at all) is walked so: V8, and HotSpot with
             * -XX:+PreserveFramePointer, keep rbp chains in compiled code. A JIT leaf sampled
             * before its prologue's push still has its caller's rbp, so the caller is skipped,
             * as in perf's frame-pointer callchains; rbp must lie in [sp, end of copy), so a
             * stale or foreign rbp stops the walk (NO_CFI) rather than reading outside it or
             * going down. */
            uint64_t fp, v;
            if (!reg_get(f, frameptr_col, &fp)) {
                st = reg_lost(f, frameptr_col) ? UNW_TRUNCATED : UNW_NO_CFI;
                break;
            }
            if (fp < sp || fp - s.sp0 >= s.len) {
                st = UNW_NO_CFI;
                break;
            }
            if (!rd_stack(&s, fp + 8, &npc)) {
                st = UNW_TRUNCATED;
                break;
            }
            nf->valid = f->valid & saved_mask;
            nf->lost = f->lost & saved_mask;
            for (unsigned i = 0; i < nsaved; i++)
                nf->regs[saved[i]] = f->regs[saved[i]];
            if (rd_stack(&s, fp, &v))
                reg_set(nf, frameptr_col, v);
            else
                nf->lost |= 1ull << frameptr_col;
            cfa = fp + 16;
            kinds[n - 1] |= UNW_FRAME_FP;
            nfp++;
        } else {
            uint64_t base, addr;
            signal = rule.flags & UNW_RULE_SIGNAL;
            if (signal) {
                kinds[n - 1] |= UNW_FRAME_SIGNAL;
                nsig++;
            }
            st = UNW_OK;
            switch (rule.cfa_kind) {
            case UNW_CFA_REG_OFF:
                if (!reg_get(f, rule.cfa_reg, &base))
                    st = need_fail(f, rule.cfa_reg);
                else
                    cfa = base + (uint64_t)(int64_t)rule.cfa_off;
                break;
            case UNW_CFA_DEREF:
            case UNW_CFA_SIGFRAME: /* glibc __restore_rt: CFA = uc_mcontext.rsp, read from the
                                    * rt_sigframe on the stack (DW_OP_breg7 160; DW_OP_deref) */
                if (!reg_get(f, rule.cfa_kind == UNW_CFA_SIGFRAME ? sp_col : rule.cfa_reg, &base))
                    st = need_fail(f, rule.cfa_reg);
                else if (addr = base + (uint64_t)(int64_t)rule.cfa_off,
                         !rd_stack(&s, addr, &cfa))
                    st = UNW_TRUNCATED;
                break;
            case UNW_CFA_PLT: /* binutils PLT: rsp + 8, + 8 more once the push has executed */
                cfa = sp + (uint64_t)(int64_t)rule.cfa_off +
                      (((f->pc & 15) >= rule.cfa_reg) ? 8 : 0);
                break;
            default:
                st = UNW_BAD_CFI;
            }
            if (st != UNW_OK)
                break;
            if (!signal && cfa <= sp) {
                st = UNW_NO_PROGRESS; /* before any read: a stuck CFA says more than a bad read */
                break;
            }
            if (rule.cfa_kind == UNW_CFA_SIGFRAME) {
                /* The interrupted context, every register of it, from the saved sigcontext.
                 * (On aarch64 the pc column is separate from the RA (x30): its desc will name
                 * it.) */
                for (uint8_t d = 0; d < a->ndwarf; d++) {
                    uint64_t v;
                    if (a->sigctx_off[d] < 0)
                        continue;
                    if (rd_stack(&s, sp + (uint64_t)(int64_t)a->sigctx_off[d], &v))
                        reg_set(nf, d, v);
                    else
                        nf->lost |= 1ull << d;
                }
                if (!reg_get(nf, ra_col, &npc)) {
                    st = UNW_TRUNCATED;
                    break;
                }
            } else {
                int e = eval_reg(f, &s, &rule.regs[UNW_SLOT_RA], cfa, ra_col, &npc);
                if (e != EV_OK) {
                    /* DWARF 5 6.4.4: undefined RA marks the outermost frame */
                    st = e == EV_UNDEF ? UNW_OK : e == EV_BAD ? UNW_BAD_CFI : UNW_TRUNCATED;
                    break;
                }
                for (unsigned i = 0; i < nsaved; i++) {
                    uint64_t v;
                    if (i == UNW_SLOT_RA)
                        continue;
                    e = eval_reg(f, &s, &rule.regs[i], cfa, saved[i], &v);
                    if (e == EV_OK)
                        reg_set(nf, saved[i], v);
                    else if (e == EV_READ)
                        nf->lost |= 1ull << saved[i];
                    /* EV_UNDEF / EV_BAD: unknown; BAD_CFI if a later rule needs it */
                }
            }
        }
        if (!signal && cfa <= sp) {
            st = UNW_NO_PROGRESS;
            break;
        }
        if (cfa - s.sp0 < s.len) {
            uint64_t want = cfa - s.sp0 + UNW_PF_DIST;
            for (; pf_hi < want && pf_hi < s.len; pf_hi += 64)
                __builtin_prefetch(s.stack + pf_hi);
        }
        if (npc == 0) {
            st = UNW_OK;
            break;
        }
        if (n >= max_depth) {
            st = UNW_DEPTH_CAP;
            break;
        }
        kinds[n] = 0;
        out[n++] = npc;
        reg_set(nf, sp_col, cfa); /* the CFA is the caller's sp (x86_64 and aarch64 psABIs) */
        if (ra_is_pc)
            reg_set(nf, ra_col, npc);
        nf->pc = npc;
        struct frame *t = f;
        f = nf;
        nf = t;
        leaf = 0;
        exact = signal;
    }
    *count = n;
    *fpf = nfp;
    *sigf = nsig;
    return st;
}

int unw_unwind_batch(int arch, const struct unw_item *items, uint32_t n, uint32_t max_depth,
                     uint64_t *pcs, uint8_t *kinds, uint32_t *counts, uint8_t *status,
                     uint16_t *fpwalk_frames, uint16_t *sig_frames)
{
    const struct unw_arch_desc *a = unw_arch(arch);
    if (!a || !max_depth || max_depth > (1u << 16))
        return -1;
    for (uint32_t i = 0; i < n; i++)
        status[i] = unw_unwind_one(a, &items[i], max_depth, pcs + (uint64_t)i * max_depth,
                                   kinds + (uint64_t)i * max_depth, &counts[i],
                                   &fpwalk_frames[i], &sig_frames[i]);
    return 0;
}
