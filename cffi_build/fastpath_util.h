/* fastpath_util.h: inline helpers the fastpath files share (not part of the cffi interface).
 *
 * ld64 / ld32: a u64 / u32 of a record buffer at any alignment (memcpy), in the host's byte
 * order, as every read of record bytes in the fastpath files. mix: the hash of every
 * open-addressing set of the context and the live groups (spaces, comms, frames, stacks,
 * pairs, symbol tables, groups); SLOT(h, cap) its slot in a table of cap slots, a power of two.
 * tally: a value counted into first-seen (value, count) pairs. CTX_*: the callchain context markers. O(1) each; no state, no allocation.
 */
#ifndef FASTPATH_UTIL_H
#define FASTPATH_UTIL_H

#include <stdint.h>
#include <string.h>

static inline uint64_t ld64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t ld32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t mix(uint64_t h, uint64_t v)
{
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    return h * 0xBF58476D1CE4E5B9ull;
}

#define SLOT(h, cap) ((h) & ((cap) - 1))

/* v counted into (value, count) pairs in first-seen order (*d distinct so far) through tab,
 * tcap slots (a power of two, more than the values ever tallied into it), each one a pair's
 * index + 1: fp_count_flagged's and fp_live_round's per-value counts. O(1) expected. */
static inline void tally(uint32_t *tab, uint64_t tcap, uint64_t *pairs, uint64_t *d, uint32_t v)
{
    uint64_t j = SLOT(mix(0, v), tcap);
    for (; tab[j]; j = SLOT(j + 1, tcap)) {
        if (pairs[2 * (tab[j] - 1)] == v) {
            pairs[2 * (tab[j] - 1) + 1]++;
            return;
        }
    }
    pairs[2 * *d] = v;
    pairs[2 * *d + 1] = 1;
    tab[j] = (uint32_t)++*d;
}

/* include/uapi/linux/perf_event.h: callchain context markers as u64 (abi.CONTEXT_*); an entry
 * >= CTX_MAX is a marker, the entries after it are of that context up to the next one. */
#define CTX_MAX ((uint64_t)-4095)
#define CTX_KERNEL ((uint64_t)-128)
#define CTX_USER ((uint64_t)-512)

#endif
