/* a -> b -> c -> spin, no frame pointers: only DWARF CFI can unwind it.
 *
 * spin does the bulk of the work (the harness expects >= 80% of samples with spin as the
 * leaf); every round it also calls into libc (memcpy and strlen on sizes the compiler
 * cannot see, and qsort with a callback of ours), so some samples land inside libc.so.6 and
 * some in cmp_u32 with qsort's frames between it and c.  128 copies make libc ~5% of the
 * samples: with 32 (~1%), a 400-sample recording once had only 2 in libc.
 *
 * argv[1]: rounds (default 40).  Fixed work, not wall time: the sample count depends on CPU
 * speed only, and no clock calls show up in the stacks. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NOIN __attribute__((noinline, noclone))

volatile uint64_t sink;
volatile size_t copy_len = (1 << 16) - 32;
static char src_buf[1 << 16], dst_buf[1 << 16];
static uint32_t keys[2048];

NOIN int cmp_u32(const void *x, const void *y)
{
    uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
    return (a > b) - (a < b);
}

NOIN uint64_t spin(uint64_t n)
{
    uint64_t acc = sink;
    for (uint64_t i = 0; i < n; i++) {
        acc = acc * 6364136223846793005ULL + i;
        acc ^= acc >> 29;
    }
    for (int k = 0; k < 128; k++) {
        memcpy(dst_buf, src_buf + k, copy_len - (size_t)k);
        acc += strlen(dst_buf);
    }
    return acc;
}

NOIN uint64_t c(uint64_t n)
{
    uint64_t r = spin(n);
    for (int i = 0; i < 2048; i++)
        keys[i] = (uint32_t)((r + (uint64_t)i) * 2654435761u);
    qsort(keys, 2048, sizeof keys[0], cmp_u32);
    return r + keys[0];
}

NOIN uint64_t b(uint64_t n) { return c(n) + 1; }
NOIN uint64_t a(uint64_t n) { return b(n) + 1; }

int main(int argc, char **argv)
{
    long rounds = argc > 1 ? atol(argv[1]) : 40;
    memset(src_buf, 'x', sizeof src_buf - 32);
    for (long r = 0; r < rounds; r++)
        sink += a(2000000);
    return 0;
}
