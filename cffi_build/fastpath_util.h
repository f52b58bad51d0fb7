/* fastpath_util.h: inline helpers the fastpath files share (not part of the cffi interface).
 *
 * ld64 / ld32: a u64 / u32 of a record buffer at any alignment (memcpy), in the host's byte
 * order, as every read of record bytes in the fastpath files. mix: the hash of every
 * open-addressing set of the context and the live groups (spaces, comms, frames, stacks,
 * pairs, symbol tables, groups); SLOT(h, cap) its slot in a table of cap slots, a power of two.
 * CTX_*: the callchain context markers. O(1) each; no state, no allocation.
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

/* include/uapi/linux/perf_event.h: callchain context markers as u64 (abi.CONTEXT_*); an entry
 * >= CTX_MAX is a marker, the entries after it are of that context up to the next one. */
#define CTX_MAX ((uint64_t)-4095)
#define CTX_KERNEL ((uint64_t)-128)
#define CTX_USER ((uint64_t)-512)

#endif
