/* harness.h: what the fuzz harnesses in tests/support/native share — CHECK (counts every check, exits
 * 3 on the first failure so the pytest side sees a non-zero status), a xorshift64 generator
 * seeded per harness (define HARNESS_SEED before including) so runs are reproducible, and
 * slurp() of a whole file into an exact-size buffer. static inline: a harness that does not use
 * a helper gets no unused-function warning under -Werror. */
#ifndef UNWINDD_TEST_HARNESS_H
#define UNWINDD_TEST_HARNESS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef HARNESS_SEED
#define HARNESS_SEED 0x9E3779B97F4A7C15ull
#endif

static unsigned long long checks;

#define CHECK(c)                                                                  \
    do {                                                                          \
        if (!(c)) {                                                               \
            fprintf(stderr, "CHECK failed %s:%d: %s\n", __FILE__, __LINE__, #c); \
            exit(3);                                                              \
        }                                                                         \
        checks++;                                                                 \
    } while (0)

static uint64_t rs = HARNESS_SEED;

static inline uint64_t rnd(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return rs;
}

static inline uint8_t *slurp(const char *path, uint64_t *len)
{
    FILE *f = fopen(path, "rb");
    CHECK(f);
    fseek(f, 0, SEEK_END);
    *len = (uint64_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(*len ? *len : 1);
    CHECK(b && fread(b, 1, *len, f) == *len);
    fclose(f);
    return b;
}

#endif
