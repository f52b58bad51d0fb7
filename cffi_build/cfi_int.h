/* cfi_int.h: what the CFI compiler's files share (not part of the cffi interface).
 *
 * The compiler turns .eh_frame / .debug_frame into the packed row table of unwcore.h. Its
 * files, each calling only files listed before it (and arch.c's unw_arch):
 *   cfienc.c   pointer encodings (DW_EH_PE_*)
 *   cfistore.c the compile context's growable arrays and its interned rules
 *   cfaprog.c  runs each CIE/FDE's CFA program into rows
 *   ehframe.c  reads the sections (CIE/FDE layout, .eh_frame_hdr), each FDE run by cfaprog.c
 *   cfitable.c builds the table from the rows (unw_cfi_compile)
 * and cfilookup.c, beside them, validates and searches a built table.
 *
 * Rules:
 *   - Every read goes through struct rd, which never reads past its end and latches an error.
 *   - The limits below bound all work; every CIE/FDE failure is counted in ctx.errors
 *     (UNW_ERR_*, stored in the table header), never fatal to the rest of the section.
 *   - Functions one file lends another are CFI_INTERNAL (hidden): the module exports the
 *     unwcore.h interface only.
 *   - LEB128 (DWARF 5 section 7.6) and the bounded reader are inline (dwread.h): both the
 *     section reader and the CFA interpreter decode them in their inner loops.
 */
#ifndef CFI_INT_H
#define CFI_INT_H

#include <stdlib.h>
#include <string.h>

#include "dwread.h"
#include "unwcore_int.h"

#define CFI_INTERNAL __attribute__((visibility("hidden")))

#define UNW_MAX_PROG (1u << 20)       /* bytes of CFA program per CIE/FDE */
#define UNW_MAX_FDE_ROWS (1u << 16)   /* rows emitted by one FDE */
#define UNW_MAX_ROWS (1u << 26)       /* rows in one table (~400 MB of CFI: never real) */
#define UNW_MAX_STATE 64              /* DW_CFA_remember_state nesting */
#define UNW_MAX_ENTRIES (1u << 24)    /* CIE/FDE entries walked per section */

/* ------------------------------------------------------------------ pointer encodings */

#define DW_EH_PE_omit 0xff
#define DW_EH_PE_indirect 0x80

struct encctx {
    const uint8_t *sec;   /* section start in memory */
    uint64_t sec_addr;    /* its sh_addr */
    uint64_t text, data;
};

/* LSB 10.5.1 DW_EH_PE_* (cfienc.c): low nibble = format, bits 4-6 = application. Returns 0 and
 * sets *bad for encodings that are illegal or need memory we do not have (indirect: the pointer
 * is in the loaded image's data, aligned/funcrel: not used for FDE fields). */
CFI_INTERNAL uint64_t cfi_rd_enc(struct rd *r, uint8_t enc, const struct encctx *c, int *bad);

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

static inline void err(struct ctx *c, int e) { c->errors[e]++; }

/* Grow *p (elements of elem bytes, capacity *cap) to hold need: doubling, from 64. 0, or -1 on
 * overflow or OOM (*p unchanged). cfistore.c. */
CFI_INTERNAL int cfi_grow(void **p, uint32_t *cap, size_t elem, uint32_t need);

/* Intern a rule: its index in c->rules, O(1) expected. UINT32_MAX (and c->oom) on OOM.
 * cfistore.c. */
CFI_INTERNAL uint32_t cfi_intern(struct ctx *c, const struct unw_rule *r);

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

/* Run one CFA program (cfaprog.c). For the CIE (emit == 0) it only builds *s. For an FDE it
 * emits rows for [loc, end) into c->rows starting from *s (the CIE's state, kept in *init for
 * DW_CFA_restore); first is the FDE's first row. Returns 0, or -1 if the program is malformed
 * or over a limit (the FDE is then dropped) or on OOM (c->oom). */
CFI_INTERNAL int cfi_run_program(struct ctx *c, const struct cie *cie, const uint8_t *p,
                                 const uint8_t *pend, struct state *s, const struct state *init,
                                 int emit, uint64_t loc, uint64_t end, const struct encctx *ec,
                                 uint32_t first);

/* ------------------------------------------------------------------ sections (ehframe.c) */

struct section {
    const uint8_t *buf;
    uint64_t len;
    struct encctx ec;
    int is_eh;         /* .eh_frame (LSB) vs .debug_frame (DWARF) conventions */
};

/* Walk every entry of a section in file order (bounded by UNW_MAX_ENTRIES); each FDE's rows
 * become one group of priority prio (0 eh_frame, 1 debug_frame). */
CFI_INTERNAL void cfi_walk_section(struct ctx *c, const struct section *s, uint32_t prio);

/* .eh_frame_hdr search table (LSB 10.6.2): returns 0 if it was used. The table gives each FDE's
 * address; we still parse every FDE, but need no pass to find them and they arrive sorted. */
CFI_INTERNAL int cfi_walk_hdr(struct ctx *c, const struct section *s, const uint8_t *hdr,
                              uint64_t hlen, uint64_t haddr);

#endif
