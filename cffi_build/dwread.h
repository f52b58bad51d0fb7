/* dwread.h: the bounded reader of DWARF-encoded bytes, shared by the CFI compiler (cfi_int.h)
 * and the line/inline table compiler (dwarfline.c).
 *
 * Every read checks the bytes left; the first short read latches err and moves p to end, so
 * nothing after it is read and a loop on p < end stops. LEB128 follows DWARF 5 section 7.6;
 * more than 10 bytes cannot hold a 64-bit value and is an error. Inline: both compilers decode
 * in their inner loops.
 */
#ifndef DWREAD_H
#define DWREAD_H

#include <stdint.h>

/* ------------------------------------------------------------------ bounded reader */

struct rd {
    const uint8_t *p, *end;
    int err;
};

static inline int rd_need(struct rd *r, uint64_t n)
{
    if (r->err || (uint64_t)(r->end - r->p) < n) {
        r->err = 1;
        r->p = r->end; /* nothing more is read: a loop on p < end ends */
        return 0;
    }
    return 1;
}

static inline uint64_t rd_le(struct rd *r, unsigned n)
{
    if (!rd_need(r, n))
        return 0;
    uint64_t v = 0;
    for (unsigned i = 0; i < n; i++)
        v |= (uint64_t)r->p[i] << (8 * i);
    r->p += n;
    return v;
}

static inline uint8_t rd_u8(struct rd *r) { return (uint8_t)rd_le(r, 1); }

/* LEB128 (DWARF 5 section 7.6); more than 10 bytes cannot be a 64-bit value: error. */
static inline uint64_t rd_uleb(struct rd *r)
{
    uint64_t v = 0;
    for (unsigned shift = 0; shift < 70; shift += 7) {
        if (!rd_need(r, 1))
            return 0;
        uint8_t b = *r->p++;
        if (shift < 64)
            v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80))
            return v;
    }
    r->err = 1;
    r->p = r->end;
    return 0;
}

static inline int64_t rd_sleb(struct rd *r)
{
    uint64_t v = 0;
    unsigned shift = 0;
    uint8_t b = 0;
    do {
        if (shift >= 70 || !rd_need(r, 1)) {
            r->err = 1;
            r->p = r->end;
            return 0;
        }
        b = *r->p++;
        if (shift < 64)
            v |= (uint64_t)(b & 0x7f) << shift;
        shift += 7;
    } while (b & 0x80);
    if (shift < 64 && (b & 0x40))
        v |= ~(uint64_t)0 << shift;
    return (int64_t)v;
}

#endif
