/* unwcore_int.h: internals shared by the CFI compiler (cfi_int.h) and unwind.c (not part of the
 * cffi interface).
 *
 * The arch descriptor is the whole register model: which DWARF columns are the stack pointer,
 * frame pointer and return address, and where each DWARF register sits in perf's REGS_USER dump.
 * Adding aarch64 means adding one descriptor (DWARF for Arm AArch64 ABI, section 4.1: x29 fp,
 * x30 lr, 31 sp, 32 pc; perf arch/arm64/include/uapi/asm/perf_regs.h: x0..x30 = 0..30, sp 31,
 * pc 32) plus its signal-frame layout; nothing else in the unwinder names a register.
 */
#ifndef UNWCORE_INT_H
#define UNWCORE_INT_H

#include <stddef.h>
#include <stdint.h>

#include "unwcore.h"

#define UNW_MAX_DWARF 34 /* tracked DWARF columns (aarch64 needs 0..32) */

struct unw_arch_desc {
    int id;
    uint8_t ndwarf;       /* DWARF columns 0..ndwarf-1 are registers we can hold values for */
    uint8_t sp, fp, ra;   /* DWARF numbers */
    uint8_t perf_ip;      /* perf register number of the program counter */
    int8_t dwarf_to_perf[UNW_MAX_DWARF]; /* -1: not in the perf dump */
    /* Columns a compiled rule carries (unw_rule.regs slot i = saved[i]; slot 0 fp, slot 1 RA):
     * the callee-saved registers, whose values a caller may still depend on. */
    uint8_t nsaved;
    uint8_t saved[UNW_NSAVED];
    int8_t slot_of[UNW_MAX_DWARF];        /* inverse of saved[]; -1: column not carried */
    /* The kernel's signal frame: offset from the trampoline's sp of each DWARF register's slot
     * in the saved user context, -1 if absent (restored at a UNW_CFA_SIGFRAME frame). */
    int16_t sigctx_off[UNW_MAX_DWARF];
};

const struct unw_arch_desc *unw_arch(int id);

/* The module containing pc in mods[0, nmods) (sorted by start, disjoint), or NULL:
 * O(log nmods) (unwind.c; stacks.c's aggregation by code uses it too). */
const struct unw_module *unw_module_find(const struct unw_module *mods, uint32_t nmods,
                                         uint64_t pc);

/* One sample's unwind (unwind.c), for the batch entry point and stacks.c's unwind_sample: the
 * same contract as one item of unw_unwind_batch. pcs/kinds hold max_depth entries. */
uint8_t unw_unwind_one(const struct unw_arch_desc *a, const struct unw_item *it,
                       uint32_t max_depth, uint64_t *pcs, uint8_t *kinds, uint32_t *count,
                       uint16_t *fpwalk_frames, uint16_t *sig_frames);

/* unw_table_lookup for the unwinder's lookup cache (cfilookup.c): the same row and *rule (no
 * row_start), trying row `hint` first. The hint is checked against the table in O(1), so any
 * value is safe (a wrong one costs the O(log rows) search); UINT32_MAX for none. */
int64_t unw_table_lookup_hint(const uint8_t *blob, uint64_t pc, uint32_t hint,
                              struct unw_rule *rule);

/* Offsets of the arrays in a blob (layout: unwcore.h). */
static inline uint64_t unw_blob_lo_off(uint32_t npages)
{
    return UNW_HDR_SIZE + ((uint64_t)npages + 1) * 4;
}

static inline uint64_t unw_blob_idx_off(uint32_t npages, uint32_t nrows)
{
    return unw_blob_lo_off(npages) + (uint64_t)nrows * 2;
}

static inline uint64_t unw_blob_rules_off(uint32_t npages, uint32_t nrows, uint32_t idx_width)
{
    uint64_t off = unw_blob_idx_off(npages, nrows) + (uint64_t)nrows * idx_width;
    return (off + 3) & ~(uint64_t)3;
}

#endif
