/* cfienc.c: the pointer encodings of .eh_frame and .eh_frame_hdr (LSB 5.0 Core 10.5,
 * DW_EH_PE_*): one encoded value read through the bounded reader (cfi_int.h). Both the
 * section reader (ehframe.c: FDE pc_begin/pc_range, the personality pointer, the hdr's fields
 * and search table) and the CFA interpreter (cfaprog.c: DW_CFA_set_loc, DWARF 5 6.4.2.1) read
 * them, so they sit below both; it calls nothing of the other files.
 *
 * Rules:
 *   - Low nibble = the value's format, bits 4-6 = what it is relative to (LSB 10.5.1);
 *     DW_EH_PE_omit reads nothing and is 0.
 *   - Every read goes through struct rd, so a value cut by its section's end latches r->err.
 *   - What we cannot decode honestly sets *bad, never a guess: an illegal format, a base we
 *     were not given (textrel, datarel), and funcrel, aligned and indirect (the pointer lives in
 *     the loaded image's data, which we do not have; none is used for FDE fields).
 * Cost: O(1): at most one LEB128 (10 bytes) or one fixed 8-byte read; no state, no allocation.
 */
#include "cfi_int.h"

uint64_t cfi_rd_enc(struct rd *r, uint8_t enc, const struct encctx *c, int *bad)
{
    if (enc == DW_EH_PE_omit)
        return 0;
    uint64_t field = c->sec_addr + (uint64_t)(r->p - c->sec);
    uint64_t v;
    switch (enc & 0x0f) {
    case 0x00: v = rd_le(r, 8); break;                          /* absptr (64-bit) */
    case 0x01: v = rd_uleb(r); break;
    case 0x02: v = rd_le(r, 2); break;
    case 0x03: v = rd_le(r, 4); break;
    case 0x04: v = rd_le(r, 8); break;
    case 0x09: v = (uint64_t)rd_sleb(r); break;
    case 0x0a: v = (uint64_t)(int64_t)(int16_t)rd_le(r, 2); break;
    case 0x0b: v = (uint64_t)(int64_t)(int32_t)rd_le(r, 4); break;
    case 0x0c: v = rd_le(r, 8); break;
    default: *bad = 1; return 0;
    }
    switch (enc & 0x70) {
    case 0x00: break;
    case 0x10: v += field; break;                               /* pcrel */
    case 0x20: if (!c->text) { *bad = 1; return 0; } v += c->text; break;
    case 0x30: if (!c->data) { *bad = 1; return 0; } v += c->data; break;
    default: *bad = 1; return 0;                                /* funcrel, aligned */
    }
    if (enc & DW_EH_PE_indirect)
        *bad = 1;
    return v;
}
