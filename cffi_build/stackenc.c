/* stackenc.c: the store's stack table encodes a CodeStack (store/stacktable.py ``_encode_at``)
 * natively: a new process's stack of known code is a delta and a remembered frame id per frame
 * in C, not a Python loop over frame objects; a new stack's frames are held here too.
 *
 * Why: the live step brings a new stack for most samples of a new process (ASLR moves every
 * ip), and each of its frames cost a Python iteration (a delta, a dict probe, a serial check)
 * and another to count its reference.
 *
 * Invariants:
 * - A code slot (store/codeslots.py) is UNW_ST_WORDS u64 words: frame id | flags << 32, the
 *   frame's serial in the table when it was resolved (0: not yet), its ``rel`` and its ``ip``.
 *   A frame id is taken only while ``uids[fid]`` still holds that serial: the table never
 *   reuses a serial, so a freed and reused frame id never matches.
 * - Delta indices are given as ``_encode_at`` gives them: the distinct ``ip - rel`` (as
 *   Python ints) in first-seen order, at most UNW_ST_NO_DELTA of them and each in int64 range;
 *   any other frame, and one without ``rel``, gets UNW_ST_NO_DELTA.
 * - A frame id is taken from its slot only where ``_encode_at`` keys the frame as the slot's
 *   frame itself: with a delta index, or without ``rel`` at the frame's own ip. Every other
 *   frame is listed for the caller (UNW_ST_KEYED set when it is such a frame, unresolved).
 * - unw_st_pack writes the bytes stacktable._pack writes (a little-endian host: the table's
 *   arrays are native-endian); unw_st_hold reads such bytes.
 * - Reads and writes only the caller's arrays, within the sizes it gives; no allocation.
 * Cost: O(n * distinct deltas) per stack (a stack's distinct deltas are its mappings: a few).
 */
#include <stdint.h>
#include <string.h>

#include "unwcore.h"

int64_t unw_st_resolve(uint64_t n, const int32_t *slots, uint64_t nslots, const uint64_t *words,
                       const uint64_t *ips, const uint64_t *uids, uint64_t nuids, uint32_t *fids,
                       uint8_t *di, int64_t *deltas, uint32_t *nd, uint32_t *miss) {
    uint32_t nds = 0;
    int64_t nmiss = 0;
    if (n > UNW_ST_MAX_FRAMES)
        return -1;
    for (uint64_t i = 0; i < n; i++) {
        int32_t s = slots[i];
        if (s < 0 || (uint64_t)s >= nslots)
            return -1;
        const uint64_t *w = words + (uint64_t)s * UNW_ST_WORDS;
        uint64_t ip = ips[i];
        uint8_t d = UNW_ST_NO_DELTA;
        int keyed;
        if ((w[0] >> 32) & UNW_ST_HAS_REL) {
            uint64_t rel = w[2];
            int64_t delta;
            int fits;
            if (ip >= rel) { /* ip - rel in [-2^63, 2^63) as a Python int, or not */
                uint64_t u = ip - rel;
                fits = u <= (uint64_t)INT64_MAX;
                delta = (int64_t)u;
            } else {
                uint64_t u = rel - ip;
                fits = u <= (uint64_t)INT64_MAX + 1;
                delta = (int64_t)(0 - u);
            }
            if (fits) {
                for (uint32_t j = 0; j < nds; j++) {
                    if (deltas[j] == delta) {
                        d = (uint8_t)j;
                        break;
                    }
                }
                if (d == UNW_ST_NO_DELTA && nds < UNW_ST_NO_DELTA) {
                    deltas[nds] = delta;
                    d = (uint8_t)nds++;
                }
            }
            keyed = d != UNW_ST_NO_DELTA;
        } else {
            keyed = ip == w[3];
        }
        di[i] = d;
        uint32_t fid = (uint32_t)w[0];
        uint64_t serial = w[1];
        if (keyed && serial && fid < nuids && uids[fid] == serial) {
            fids[i] = fid;
        } else {
            fids[i] = 0;
            miss[nmiss++] = (uint32_t)i | (keyed ? UNW_ST_KEYED : 0);
        }
    }
    *nd = nds;
    return nmiss;
}

uint64_t unw_st_pack(uint64_t n, const uint32_t *fids, const int64_t *deltas, uint32_t nd,
                     const uint8_t *di, uint8_t *out) {
    uint32_t mx = 0;
    for (uint64_t i = 0; i < n; i++)
        mx = fids[i] > mx ? fids[i] : mx;
    uint8_t w = mx < (1u << 16) ? 2 : 4;
    uint32_t n32 = (uint32_t)n;
    uint8_t *p = out;
    memcpy(p, &n32, 4); /* the header "<IBB": frames, distinct deltas, id width */
    p[4] = (uint8_t)nd;
    p[5] = w;
    p += 6;
    for (uint64_t i = 0; i < n; i++, p += w) {
        if (w == 2) {
            uint16_t v = (uint16_t)fids[i];
            memcpy(p, &v, 2);
        } else {
            memcpy(p, &fids[i], 4);
        }
    }
    memcpy(p, deltas, 8 * (size_t)nd);
    p += 8 * (size_t)nd;
    memcpy(p, di, n);
    p += n;
    return (uint64_t)(p - out);
}

int64_t unw_st_hold(const uint8_t *enc, uint64_t len, uint32_t *frefs, uint64_t nfrefs) {
    uint32_t n;
    if (len < 6)
        return -1;
    memcpy(&n, enc, 4);
    uint8_t w = enc[5];
    if ((w != 2 && w != 4) || (uint64_t)w * n > len - 6)
        return -1;
    const uint8_t *p = enc + 6;
    for (uint32_t i = 0; i < n; i++, p += w) { /* every id in range first: all or nothing */
        uint32_t v = 0;
        memcpy(&v, p, w); /* (little-endian: the low bytes) */
        if (v >= nfrefs)
            return -1;
    }
    p = enc + 6;
    for (uint32_t i = 0; i < n; i++, p += w) {
        uint32_t v = 0;
        memcpy(&v, p, w);
        frefs[v]++;
    }
    return n;
}
