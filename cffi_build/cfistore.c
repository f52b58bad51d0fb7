/* cfistore.c: the compile context's storage (struct ctx, cfi_int.h): the growable arrays that
 * hold rows, FDE groups and rules (cfi_grow) and the set that gives each distinct rule one
 * index (cfi_intern). The bottom of the CFI compiler: it calls nothing of the other files.
 *
 * Rules:
 *   - An array grows by doubling from 64 elements and never past UINT32_MAX of them (row and
 *     rule indices are u32 in the table, unwcore.h); a failed growth leaves it as it was, so
 *     the caller may still free it.
 *   - Each distinct rule is stored once, compared byte for byte (its callers build it from a
 *     zeroed struct, so the pad bytes compare too); its index is what a table row carries.
 *   - The rule set is open addressing on FNV-1a (the Fowler-Noll-Vo 32-bit parameters) over
 *     the rule's bytes, a power-of-two table at most half full, rebuilt at double size.
 *   - OOM is latched in ctx.oom; nothing here counts a CIE/FDE error.
 * Cost: amortized O(1) per appended element; cfi_intern O(1) expected, a rebuild O(rules),
 * memory O(rules) for the set.
 */
#include "cfi_int.h"

static uint32_t rule_hash(const struct unw_rule *r)
{
    uint8_t b[sizeof *r];
    memcpy(b, r, sizeof b);
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < sizeof b; i++)
        h = (h ^ b[i]) * 16777619u;
    return h;
}

int cfi_grow(void **p, uint32_t *cap, size_t elem, uint32_t need)
{
    if (need <= *cap)
        return 0;
    uint64_t n = *cap ? *cap : 64;
    while (n < need)
        n *= 2;
    if (n > UINT32_MAX)
        return -1;
    void *q = realloc(*p, n * elem);
    if (!q)
        return -1;
    *p = q;
    *cap = (uint32_t)n;
    return 0;
}

uint32_t cfi_intern(struct ctx *c, const struct unw_rule *r)
{
    if ((uint64_t)(c->nrules + 1) * 2 > c->hashcap) {
        uint32_t ncap = c->hashcap ? c->hashcap * 2 : 1024;
        uint32_t *nh = calloc(ncap, sizeof *nh);
        if (!nh) {
            c->oom = 1;
            return UINT32_MAX;
        }
        for (uint32_t i = 0; i < c->nrules; i++) {
            uint32_t h = rule_hash(&c->rules[i]) & (ncap - 1);
            while (nh[h])
                h = (h + 1) & (ncap - 1);
            nh[h] = i + 1;
        }
        free(c->hash);
        c->hash = nh;
        c->hashcap = ncap;
    }
    uint32_t h = rule_hash(r) & (c->hashcap - 1);
    while (c->hash[h]) {
        if (!memcmp(&c->rules[c->hash[h] - 1], r, sizeof *r))
            return c->hash[h] - 1;
        h = (h + 1) & (c->hashcap - 1);
    }
    if (cfi_grow((void **)&c->rules, &c->caprules, sizeof *r, c->nrules + 1)) {
        c->oom = 1;
        return UINT32_MAX;
    }
    c->rules[c->nrules] = *r;
    c->hash[h] = ++c->nrules;
    return c->nrules - 1;
}
