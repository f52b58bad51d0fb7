/* crc32c.c: CRC-32C (Castagnoli; reflected polynomial 0x82F63B78, initial and final XOR
 * 0xFFFFFFFF, as iSCSI, ext4 and btrfs use it: RFC 3720 B.4) of a disk cache file's body
 * (binaries/cachefiles.py ``checksum``), the check that every load of a CFI, symbol or line
 * table makes over the whole table.
 *
 * Why CRC-32C and not zlib's CRC-32: x86-64 has an instruction for it (SSE4.2 crc32, Intel SDM
 * vol. 2A "CRC32"), 8 bytes at a time, several times the speed of zlib's table-driven
 * CRC-32 on the same machine; the load check of a replay's tables reads tens of MB.
 *
 * Invariants:
 *   - unw_crc32c(p, n, crc) continues a running CRC: unw_crc32c(b, nb, unw_crc32c(a, na, 0))
 *     equals the CRC of a then b (as zlib.crc32's second argument), so a file's parts can be
 *     checked one after another.
 *   - The instruction is used only when the CPU says it has it (__builtin_cpu_supports, read
 *     once); otherwise, and on other architectures, the portable slice-by-8 tables give the
 *     same value (unw_crc32c_portable, which the tests compare against the instruction).
 *   - The tables are built once per process (pthread_once: callers may run on several threads,
 *     cffi releasing the GIL).
 * Cost: O(n); ~1 cycle per 3 bytes with the instruction, ~1 per byte with the tables.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "unwcore.h"

#define POLY 0x82F63B78u

static uint32_t tab[8][256];
static pthread_once_t tab_once = PTHREAD_ONCE_INIT;

static void tab_build(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        tab[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            tab[t][i] = (tab[t - 1][i] >> 8) ^ tab[0][tab[t - 1][i] & 0xFF];
}

/* slice-by-8 (Intel's "Slicing-by-8", Kounavis & Berry 2005), little-endian loads */
static uint32_t crc_portable(uint32_t c, const uint8_t *p, uint64_t n)
{
    pthread_once(&tab_once, tab_build);
    while (n && ((uintptr_t)p & 7)) {
        c = (c >> 8) ^ tab[0][(c ^ *p++) & 0xFF];
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        w ^= c;
        c = tab[7][w & 0xFF] ^ tab[6][(w >> 8) & 0xFF] ^ tab[5][(w >> 16) & 0xFF] ^
            tab[4][(w >> 24) & 0xFF] ^ tab[3][(w >> 32) & 0xFF] ^ tab[2][(w >> 40) & 0xFF] ^
            tab[1][(w >> 48) & 0xFF] ^ tab[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = (c >> 8) ^ tab[0][(c ^ *p++) & 0xFF];
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_HW 1
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c, const uint8_t *p,
                                                          uint64_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        c = __builtin_ia32_crc32qi(c, *p++);
        n--;
    }
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = __builtin_ia32_crc32di(c64, w);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--)
        c = __builtin_ia32_crc32qi(c, *p++);
    return c;
}

static int hw_ok(void)
{
    static int ok = -1; /* (a benign race: every thread computes the same value) */
    if (ok < 0)
        ok = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    return ok;
}
#else
#define HAVE_HW 0
#endif

uint32_t unw_crc32c(const uint8_t *p, uint64_t n, uint32_t crc)
{
    uint32_t c = ~crc;
#if HAVE_HW
    if (hw_ok())
        return ~crc_hw(c, p, n);
#endif
    return ~crc_portable(c, p, n);
}

uint32_t unw_crc32c_portable(const uint8_t *p, uint64_t n, uint32_t crc)
{
    return ~crc_portable(~crc, p, n);
}

int unw_crc32c_hw(void)
{
#if HAVE_HW
    return hw_ok();
#else
    return 0;
#endif
}
