/* context.c: the native context (struct fp_ctx, fastpath_int.h): its life (fp_ctx_new,
 * fp_ctx_free) and the two tables every stage after indexing reads, the caller's address spaces
 * (pid -> modules) and comms ((pid, tid) -> comm id). What a sample makes of them is stacks.c's;
 * which thread unwinds which sample is parallel.c's.
 *
 * Invariants:
 * - The context owns all its memory, the parallel unwind's worker and ring too: fp_ctx_free
 *   stops and joins the worker (par_free) before it frees what the worker reads.
 * - A space or comm entry is never removed: forgetting a space clears its valid flag,
 *   forgetting the comms clears the whole table, so probing needs no tombstones.
 * - The caller's module arrays are only pointed at (kept alive by the caller, fastpath.h).
 * Cost: fp_set_space and fp_set_comm O(1) expected (open addressing, at most half full,
 * doubling from 256 slots: amortized O(1) per insert); fp_forget_space O(1) expected,
 * fp_forget_comms O(slots).
 */
#include <stdlib.h>
#include <string.h>

#include "fastpath_int.h"

struct fp_ctx *fp_ctx_new(int arch, uint32_t max_depth)
{
    const struct unw_arch_desc *a = unw_arch(arch);
    if (!a || !max_depth || max_depth > (1u << 16))
        return NULL;
    struct fp_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->arch = a;
    c->max_depth = max_depth;
    c->par_min = PAR_MIN;
    c->pcs = malloc(max_depth * sizeof *c->pcs);
    c->kinds = malloc(max_depth);
    if (!c->pcs || !c->kinds) {
        fp_ctx_free(c);
        return NULL;
    }
    return c;
}

void fp_ctx_free(struct fp_ctx *c)
{
    if (!c)
        return;
    par_free(c->par);
    free(c->pcs);
    free(c->kinds);
    free(c->key);
    free(c->spaces);
    free(c->comms);
    free(c->stacks);
    free(c->stab);
    free(c->words);
    free(c->frames);
    free(c->ftab);
    free(c->fids);
    free(c->pairs);
    free(c->ptab);
    free(c->memo);
    free(c->syms);
    free(c);
}

int fp_set_space(struct fp_ctx *c, uint32_t pid, const struct unw_module *mods, uint32_t nmods,
                 uint32_t space_id)
{
    if (2 * (c->sn + 1) > c->scap) {
        struct space_ent *old = c->spaces;
        uint64_t ocap = c->scap, ncap = ocap ? 2 * ocap : 256;
        struct space_ent *ns = calloc(ncap, sizeof *ns);
        if (!ns)
            return -1;
        c->spaces = ns;
        c->scap = ncap;
        for (uint64_t i = 0; i < ocap; i++)
            if (old[i].used)
                *space_slot(c, old[i].pid) = old[i];
        free(old);
    }
    struct space_ent *e = space_slot(c, pid);
    if (!e->used)
        c->sn++;
    *e = (struct space_ent){pid, space_id, mods, NULL, 0, nmods, 0, 0, 1, 1};
    return 0;
}

void fp_forget_space(struct fp_ctx *c, uint32_t pid)
{
    if (c->scap) {
        struct space_ent *e = space_slot(c, pid);
        if (e->used)
            e->valid = 0;
    }
}

int fp_set_comm(struct fp_ctx *c, uint32_t pid, uint32_t tid, uint32_t comm_id)
{
    if (2 * (c->cn + 1) > c->ccap) {
        struct comm_ent *old = c->comms;
        uint64_t ocap = c->ccap, ncap = ocap ? 2 * ocap : 256;
        struct comm_ent *ns = calloc(ncap, sizeof *ns);
        if (!ns)
            return -1;
        c->comms = ns;
        c->ccap = ncap;
        for (uint64_t i = 0; i < ocap; i++)
            if (old[i].used)
                *comm_slot(c, old[i].pid, old[i].tid) = old[i];
        free(old);
    }
    struct comm_ent *e = comm_slot(c, pid, tid);
    if (!e->used)
        c->cn++;
    *e = (struct comm_ent){pid, tid, comm_id, 1};
    return 0;
}

void fp_forget_comms(struct fp_ctx *c)
{
    if (c->ccap)
        memset(c->comms, 0, c->ccap * sizeof *c->comms);
    c->cn = 0;
}
