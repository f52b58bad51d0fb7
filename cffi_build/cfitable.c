/* cfitable.c: unw_cfi_compile, the top of the CFI compiler: the sections' walks (ehframe.c)
 * fill a compile context (cfistore.c) with each FDE's rows, and its rows become the packed
 * blob of unwcore.h here.
 *
 * Policy (the tests' cfiref.py mirrors it):
 *   - Each FDE's rows are one group, clipped to its [start, end). eh_frame groups first, sorted,
 *     overlapping ones dropped; then debug_frame groups only where they fall entirely in
 *     eh_frame's gaps (eh_frame wins). Every drop is counted (UNW_ERR_OVERLAP).
 *   - A NONE row (rule 0, always "no CFI") marks each gap; equal neighbours are merged.
 *   - Rows are addressed by 32 bits from the table's base: past 4 GiB of text the table keeps
 *     the first 4 GiB (counted, UNW_ERR_RANGE), and the cut still ends in a NONE row.
 *   - Rules are interned (cfistore.c): row indices are 2 bytes when there are at most 65536
 *     rules, else 4.
 * Cost: O(G log G) for G groups plus O(rows) for the emission; memory O(rows + rules). On OOM
 * nothing is returned (-1) and everything is freed.
 */
#include "cfi_int.h"

void unw_free(void *p) { free(p); }

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
    if (cfi_intern(&c, &none) != 0) /* rule 0 is always "no CFI" */
        goto oom;

    if (sec && sec->eh_frame_size && sec->eh_frame_off <= img_len &&
        sec->eh_frame_size <= img_len - sec->eh_frame_off) {
        struct section s = {img + sec->eh_frame_off, sec->eh_frame_size,
                            {img + sec->eh_frame_off, sec->eh_frame_addr, sec->text_addr,
                             sec->data_addr}, 1};
        int used_hdr = -1;
        if (sec->eh_hdr_size && sec->eh_hdr_off <= img_len &&
            sec->eh_hdr_size <= img_len - sec->eh_hdr_off) {
            used_hdr = cfi_walk_hdr(&c, &s, img + sec->eh_hdr_off, sec->eh_hdr_size,
                                    sec->eh_hdr_addr);
            if (used_hdr)
                err(&c, UNW_ERR_BAD_HDR);
        }
        if (used_hdr)
            cfi_walk_section(&c, &s, 0);
    }
    uint32_t n_eh = c.ngroups;
    if (debug_frame && debug_frame_len) {
        struct section s = {debug_frame, debug_frame_len, {debug_frame, 0, 0, 0}, 0};
        cfi_walk_section(&c, &s, 1);
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
