/* cfilookup.c: read a compiled table (the blob layout of unwcore.h): validate one (from the
 * compiler or a disk cache) and find the row covering a pc.
 *
 * Invariants:
 *   - unw_table_validate checks everything the readers rely on (header fields, array sizes,
 *     sorted row starts within each 64 KiB page, rule indices, rule kinds and registers), so
 *     the lookups below trust a validated blob and do no bounds checks of their own.
 *   - Reads go through memcpy (the blob has no alignment guarantee beyond its arrays').
 *   - A lookup hint is only a guess: it is accepted only if it meets exactly the conditions the
 *     search would end on, so any value is safe.
 *   - unw_map_file maps a cache file read-only and shared (MAP_SHARED, PROT_READ): a table
 *     read in place from it is page cache the kernel may reclaim and every process mapping
 *     the file shares, not a private copy. Python's mmap module would also do, but it keeps
 *     a dup of the fd per mapping (CPython Modules/mmapmodule.c new_mmap_object), one more
 *     open file per cached table.
 *   - Every live unw_map_file mapping is listed (maps, under map_lock) with its class until
 *     unw_unmap_file, which unmaps it under the same lock: unw_mapped_release never advises a
 *     range that was unmapped, or that a later mmap reused, meanwhile. The class only chooses
 *     which releases drop a mapping's pages (the CFI tables every sample reads, less often).
 * Cost: validation O(rows + rules); a lookup O(log pages) to find the page only when the row
 * lies before its pc's page, else O(log rows in the page), O(1) with a correct hint.
 */
#include "cfi_int.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>

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

/* The live mappings of unw_map_file, for unw_mapped_release. Each is a whole cache table,
 * so there are as many as tables held (hundreds at most): a linear search is enough. */
struct mapped_file {
    const uint8_t *p;
    uint64_t len;
    uint32_t cls; /* one UNW_MAP_* bit */
};
static pthread_mutex_t map_lock = PTHREAD_MUTEX_INITIALIZER;
static struct mapped_file *maps;
static size_t nmaps, capmaps;

const uint8_t *unw_map_file(int fd, uint64_t len, uint32_t cls)
{
    if (len == 0 || len > (uint64_t)SIZE_MAX || (cls != UNW_MAP_COLD && cls != UNW_MAP_HOT)) {
        errno = EINVAL;
        return NULL;
    }
    void *p = mmap(NULL, (size_t)len, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return NULL;
    pthread_mutex_lock(&map_lock);
    if (nmaps == capmaps) {
        size_t ncap = capmaps ? 2 * capmaps : 64;
        struct mapped_file *n = realloc(maps, ncap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&map_lock);
            munmap(p, (size_t)len);
            errno = ENOMEM;
            return NULL;
        }
        maps = n;
        capmaps = ncap;
    }
    maps[nmaps++] = (struct mapped_file){p, len, cls};
    pthread_mutex_unlock(&map_lock);
    return p;
}

void unw_unmap_file(const uint8_t *p, uint64_t len)
{
    if (!p || !len)
        return;
    pthread_mutex_lock(&map_lock);
    for (size_t i = 0; i < nmaps; i++)
        if (maps[i].p == p) {
            maps[i] = maps[--nmaps];
            break;
        }
    munmap((void *)p, (size_t)len);
    pthread_mutex_unlock(&map_lock);
}

uint64_t unw_mapped_release(uint64_t *nfiles, uint32_t classes)
{
    uint64_t bytes = 0, n = 0;
    pthread_mutex_lock(&map_lock);
    /* MADV_DONTNEED on a shared file mapping only removes the pages from this process's page
     * tables (mm/madvise.c madvise_dontneed_single_vma -> zap_page_range_single): the page
     * cache keeps them, and the next read of one maps it again with a minor fault
     * (mm/filemap.c filemap_map_pages maps cached pages around it too: fault_around_bytes,
     * or the whole large folio the file's page cache holds it in). */
    for (size_t i = 0; i < nmaps; i++)
        if ((maps[i].cls & classes) &&
            madvise((void *)maps[i].p, (size_t)maps[i].len, MADV_DONTNEED) == 0) {
            bytes += maps[i].len;
            n++;
        }
    if (nfiles)
        *nfiles = n;
    pthread_mutex_unlock(&map_lock);
    return bytes;
}

uint64_t unw_mapped_release_one(const uint8_t *q)
{
    uint64_t bytes = 0;
    pthread_mutex_lock(&map_lock);
    for (size_t i = 0; i < nmaps; i++)
        if (q >= maps[i].p && q < maps[i].p + maps[i].len) {
            if (madvise((void *)maps[i].p, (size_t)maps[i].len, MADV_DONTNEED) == 0)
                bytes = maps[i].len;
            break;
        }
    pthread_mutex_unlock(&map_lock);
    return bytes;
}
