/* ehframe.c: read .eh_frame / .debug_frame / .eh_frame_hdr: CIE and FDE entries and the
 * walks that hand each FDE's CFA program to cfaprog.c and keep its rows as one group
 * (cfistore.c); pointer encodings are read by cfienc.c.
 *
 * Formats followed:
 *   - DWARF 5 section 6.4.1 (CIE/FDE layout), 7.4 (32/64-bit format), 7.6 (LEB128).
 *   - LSB 5.0 Core, "Exception Frames" (10.6) for .eh_frame: CIE id 0, CIE pointer relative to
 *     its own field, the z/L/P/R augmentation data, DW_EH_PE_* pointer encodings (10.5); the
 *     GCC 'S' (signal frame) augmentation character (libgcc unwind-dw2.c, extract_cie_info).
 *   - .eh_frame_hdr: LSB 10.6.2 (version 1, eh_frame_ptr, fde_count, sorted search table).
 *
 * Invariants: nothing here reads outside [buf, buf+len) of a section, whatever the bytes say
 * (struct rd); a failed read makes the current CIE/FDE count an error and be skipped. A
 * "looping" eh_frame cannot loop: the walk only moves forward by each entry's length
 * (>= 4 + 4), at most UNW_MAX_ENTRIES entries, and the hdr table is walked by index. Cost: one
 * pass over the section plus each FDE's program; a CIE is parsed and run once per run of FDEs
 * that share it (the one-entry CIE cache).
 */
#include "cfi_int.h"

/* Size-only variant for pc_range: LSB says the range uses the format nibble only. */
static uint64_t rd_enc_value(struct rd *r, uint8_t enc, int *bad)
{
    struct encctx none = {r->p, 0, 0, 0};
    return cfi_rd_enc(r, enc & 0x0f, &none, bad);
}

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
        if (cfi_run_program(c, cie_cache, cie_cache->insns, cie_cache->insns_end, &init, NULL, 0,
                            0, 0, &s->ec, 0)) {
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
        start = cfi_rd_enc(&r, cie->fde_enc, &s->ec, &bad);
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
    if (cfi_run_program(c, cie, r.p, bend, &st, cie_state, 1, start, start + range, &s->ec,
                        first)) {
        c->nrows = first; /* drop the partial group */
        return;
    }
    if (c->nrows == first)
        return;
    if (cfi_grow((void **)&c->groups, &c->capgroups, sizeof *c->groups, c->ngroups + 1)) {
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
void cfi_walk_section(struct ctx *c, const struct section *s, uint32_t prio)
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
int cfi_walk_hdr(struct ctx *c, const struct section *s, const uint8_t *hdr, uint64_t hlen,
                    uint64_t haddr)
{
    struct rd r = {hdr, hdr + hlen, 0};
    struct encctx hc = {hdr, haddr, 0, haddr}; /* datarel in the hdr = relative to the hdr */
    uint8_t version = rd_u8(&r), ptr_enc = rd_u8(&r), cnt_enc = rd_u8(&r), tab_enc = rd_u8(&r);
    int bad = 0;
    if (r.err || version != 1 || ptr_enc == DW_EH_PE_omit || cnt_enc == DW_EH_PE_omit ||
        tab_enc != 0x3b) /* datarel|sdata4 is the only table encoding binutils/lld write */
        return -1;
    uint64_t eh_ptr = cfi_rd_enc(&r, ptr_enc, &hc, &bad);
    uint64_t count = cfi_rd_enc(&r, cnt_enc, &hc, &bad);
    if (bad || r.err || eh_ptr != s->ec.sec_addr || count > (uint64_t)(r.end - r.p) / 8)
        return -1;
    uint64_t cie_off = UINT64_MAX;
    struct cie cie;
    struct state cst;
    int cie_ok = 0;
    for (uint64_t i = 0; i < count && !c->oom; i++) {
        /* initial_location: the FDE itself is the truth */
        (void)cfi_rd_enc(&r, tab_enc, &hc, &bad);
        uint64_t fde = cfi_rd_enc(&r, tab_enc, &hc, &bad);
        if (bad || r.err || fde < s->ec.sec_addr || fde - s->ec.sec_addr >= s->len) {
            err(c, UNW_ERR_BAD_FDE);
            bad = 0;
            continue;
        }
        do_fde(c, s, fde - s->ec.sec_addr, 0, &cie_off, &cie, &cst, &cie_ok);
    }
    return 0;
}
