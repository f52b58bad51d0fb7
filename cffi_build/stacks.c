/* stacks.c: what the context (struct fp_ctx) makes of one indexed SAMPLE: its unwind from the
 * raw bytes (unwind.c's unw_unwind_one), its frames and stack interned and counted; and the
 * accessors that export stacks, frames and pairs. The sets it fills (stacks, frames, pairs,
 * symbol tables) are this file's alone: their structs are defined here. Which thread unwinds
 * which sample is parallel.c's (it and live.c drive the per-sample functions).
 *
 * Layouts followed: the SAMPLE parts index.c located (include/uapi/linux/perf_event.h):
 * REGS_USER { u64 abi; u64 regs[] } (abi PERF_SAMPLE_REGS_ABI_NONE 0, _32 1, _64 2: only _64
 * registers are unwound), STACK_USER data[dyn_size], the CALLCHAIN ips[] kept raw in the key.
 *
 * Invariants:
 * - The unwind reads only its record's bytes: the stored view is checked against the record
 *   (rec_view_ok) before use; a bad one is UNW_BAD_VIEW (an error), never a read outside.
 * - A frame or stack id, once given, names the same key for the context's life; identical keys
 *   (key layout: before pc_words) share one id; ids stay below NEED_SYMS_ID.
 * - Interning runs on the calling thread only, in sample order, so ids and counts never depend
 *   on threads (unwind_sample alone may run on the worker).
 * Cost: per sample O(depth * (log modules + log rows)) to unwind, O(key words) to hash and
 * compare its key, O(1) expected per set probe (open addressing, at most half full, doubling:
 * amortized O(1) per insert); by code O(1) per pc on a memo hit, else O(log modules).
 * Memory: the sets only grow for the context's life (the live step drops the context whole past
 * its bounds, ringstep.py); ctx_sets_bytes reports their capacities in O(1).
 */
#include <stdlib.h>
#include <string.h>

#include "fastpath_int.h"

/* The sets of this file (struct fp_ctx points at them; no other file reads them). */
struct stack_ent {
    uint64_t woff;      /* its key: words[woff, woff + nwords) */
    uint64_t hash, count;
    uint64_t foff;      /* frame ids of its pcs: fids[foff, foff + npcs); by code: unused */
    uint32_t nwords;
    uint32_t space0;    /* by code: the space of its first sample (fp_stack.space_id) */
};

/* A distinct user frame: what symbolization depends on. Stacks of one profile share most
 * frames, so Python names each frame once, not once per stack. Its identity is (tag, addr,
 * exact): tag = space id and addr = pc, or, by code (fp_ctx_by_code) for a named address
 * inside a module, tag = FRAME_CODE | module key and addr = its ELF vaddr (named address -
 * bias), so the same code in every process that maps the binary is one frame. (space_id,
 * pc) is where it was first seen: Python names it from that space's snapshot. */
#define FRAME_CODE (1ull << 63)
/* A retired code frame (fp_ctx_retire_code): its tag no lookup builds (module keys of frames by
 * code stay below bit 62, fastpath.h), so it stays in the set, probed past, matching nothing. */
#define FRAME_RETIRED (1ull << 62)
struct frame_ent {
    uint64_t tag, addr;
    uint64_t pc;
    uint32_t space_id;
    uint8_t exact;      /* pc is exact (leaf, or after a signal trampoline), else pc - 1 is named */
    uint8_t pad[3];
};

/* A retired stack (fp_ctx_retire_code): its stored hash with this bit set, which no key's hash
 * has (intern_stack clears it), so it stays in the set, probed past, matching nothing: the next
 * sample with its key adds a new stack, whose frame ids are looked up again. */
#define STACK_RETIRED (1ull << 63)

/* by code: the (space, stack, hash of the raw pcs) triples seen, in first-seen order
 * (fp_pairs), and their set. The Python reference counts unsymbolized frames once per new (snapshot,
 * pcs) key: Python counts a code stack's unnamed frames once per new (space, pcs hash). (The
 * frame ids alone do not stand for the pcs: a process mapping one binary twice, dlopen plus
 * dlmopen, runs the same code frames at two addresses.) */
struct pair_ent {
    uint32_t space_id, stack_id;
    uint64_t pcs_hash;
};

/* by function (fp_ctx_by_code(c, 2)): a module key's symbol table, the caller's arrays
 * (symtab.SymbolTable.starts/ends, kept alive by the caller for the context's life). */
struct sym_ent {
    uint64_t key;
    const uint64_t *starts, *ends;
    uint64_t n;
    uint32_t used;
};

static int grow_words(struct fp_ctx *c, uint64_t need)
{
    if (c->nwords + need <= c->capwords)
        return 0;
    uint64_t ncap = c->capwords ? c->capwords : 4096;
    while (ncap < c->nwords + need)
        ncap *= 2;
    uint64_t *q = realloc(c->words, ncap * 8);
    if (!q)
        return -1;
    c->words = q;
    c->capwords = ncap;
    return 0;
}

static inline uint64_t frame_hash(uint64_t tag, uint64_t addr, uint8_t exact)
{
    return mix(mix(tag, addr), exact);
}

static inline uint64_t pair_hash(uint32_t space_id, uint32_t stack_id, uint64_t pcs_hash)
{
    return mix(mix(space_id, stack_id), pcs_hash);
}

static uint64_t frame_hash_of(const struct fp_ctx *c, uint64_t i)
{
    const struct frame_ent *f = &c->frames[i];
    return frame_hash(f->tag, f->addr, f->exact);
}

static uint64_t stack_hash_of(const struct fp_ctx *c, uint64_t i) { return c->stacks[i].hash; }

static uint64_t pair_hash_of(const struct fp_ctx *c, uint64_t i)
{
    const struct pair_ent *q = &c->pairs[i];
    return pair_hash(q->space_id, q->stack_id, q->pcs_hash);
}

/* The frame, stack and pair sets: open addressing over ids [0, n) (slot = id + 1, 0 empty).
 * Before adding id n, keep *tab at most half full: double it (first 4096 slots) and place
 * every id again by hash(c, id). -1 on allocation failure. O(n) per doubling, amortized O(1). */
static int index_reserve(const struct fp_ctx *c, uint32_t **tab, uint64_t *cap, uint64_t n,
                         uint64_t (*hash)(const struct fp_ctx *, uint64_t))
{
    if (2 * (n + 1) <= *cap)
        return 0;
    uint64_t ncap = *cap ? 2 * *cap : 4096;
    uint32_t *nt = calloc(ncap, sizeof *nt);
    if (!nt)
        return -1;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t j = SLOT(hash(c, i), ncap);
        while (nt[j])
            j = SLOT(j + 1, ncap);
        nt[j] = (uint32_t)i + 1;
    }
    free(*tab);
    *tab = nt;
    *cap = ncap;
    return 0;
}

/* key's slot in the symbol-table set: its entry, or the empty slot it would take (symcap
 * > 0), as space_slot and comm_slot do for theirs. */
static struct sym_ent *sym_slot(const struct fp_ctx *c, uint64_t key)
{
    uint64_t j = SLOT(mix(0, key), c->symcap);
    while (c->syms[j].used && c->syms[j].key != key)
        j = SLOT(j + 1, c->symcap);
    return &c->syms[j];
}

static const struct sym_ent *sym_find(const struct fp_ctx *c, uint64_t key)
{
    if (!c->symcap)
        return NULL;
    const struct sym_ent *e = sym_slot(c, key);
    return e->used ? e : NULL;
}

/* fastpath.h. By function a frame is (module key, region, exact). O(log n). */
uint64_t fp_sym_region(const uint64_t *starts, const uint64_t *ends, uint64_t n, uint64_t addr)
{
    uint64_t lo = 0, hi = n; /* first index with starts[i] > addr */
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (starts[mid] <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (!lo)
        return 0;
    uint64_t i = lo - 1;
    return (addr < ends[i] || addr == starts[i]) ? i + 1 : 0;
}

static inline uint64_t sym_region(const struct sym_ent *se, uint64_t addr)
{
    return fp_sym_region(se->starts, se->ends, se->n, addr);
}

int fp_set_symbols(struct fp_ctx *c, uint64_t key, const uint64_t *starts, const uint64_t *ends,
                   uint64_t n)
{
    if (c->by_code != 2 || (n && (!starts || !ends)))
        return -1;
    if (2 * (c->nsym + 1) > c->symcap) {
        struct sym_ent *old = c->syms;
        uint64_t ocap = c->symcap, ncap = ocap ? 2 * ocap : 64;
        struct sym_ent *ns = calloc(ncap, sizeof *ns);
        if (!ns)
            return -1;
        c->syms = ns;
        c->symcap = ncap;
        for (uint64_t i = 0; i < ocap; i++)
            if (old[i].used)
                *sym_slot(c, old[i].key) = old[i];
        free(old);
    }
    struct sym_ent *e = sym_slot(c, key);
    if (e->used)
        return -1; /* a frame may already carry the old table's regions */
    *e = (struct sym_ent){key, starts, ends, n, 1};
    c->nsym++;
    return 0;
}

/* The id of the frame at pc (seen in space sp), added if new; UINT32_MAX on allocation
 * failure, NEED_SYMS_ID (by function) when pc's module has no symbol table yet. Identity:
 * see struct frame_ent. */
static uint32_t intern_frame(struct fp_ctx *c, const struct space_ent *sp, uint64_t pc,
                             uint8_t exact)
{
    uint64_t tag = sp->space_id, addr = pc;
    if (c->by_code || c->code_frames) {
        uint64_t named = exact ? pc : pc - 1;
        const struct unw_module *m = unw_module_find(sp->mods, sp->nmods, named);
        if (m && !(m->flags & UNW_MOD_JIT)) { /* JIT code: one process's, keyed by its pc */
            tag = FRAME_CODE | m->key;
            addr = named - m->bias;
            if (c->by_code == 2) {
                const struct sym_ent *se = sym_find(c, m->key);
                if (!se) {
                    c->need_mod = (uint32_t)(m - sp->mods);
                    return NEED_SYMS_ID;
                }
                addr = sym_region(se, addr);
            }
        }
    }
    if (index_reserve(c, &c->ftab, &c->ftabcap, c->nfr, frame_hash_of))
        return UINT32_MAX;
    uint64_t j = SLOT(frame_hash(tag, addr, exact), c->ftabcap);
    while (c->ftab[j]) {
        const struct frame_ent *f = &c->frames[c->ftab[j] - 1];
        if (f->addr == addr && f->tag == tag && f->exact == exact)
            return c->ftab[j] - 1;
        j = SLOT(j + 1, c->ftabcap);
    }
    if (c->nfr >= UINT32_MAX - 1)
        return UINT32_MAX;
    if (c->nfr == c->capfr) {
        uint64_t ncap = c->capfr ? 2 * c->capfr : 1024;
        struct frame_ent *q = realloc(c->frames, ncap * sizeof *q);
        if (!q)
            return UINT32_MAX;
        c->frames = q;
        c->capfr = ncap;
    }
    c->frames[c->nfr] = (struct frame_ent){tag, addr, pc, sp->space_id, exact, {0, 0, 0}};
    c->ftab[j] = (uint32_t)c->nfr + 1;
    return (uint32_t)c->nfr++;
}

/* by code: (space, pc, exact) -> frame id, direct-mapped. Every sample turns each of its pcs
 * into a frame id (a module search and a set probe); the same return addresses recur,
 * so a memo hit makes that one compare. Exact: frame ids never change, and a space id names
 * one snapshot (fp_set_space), so its modules, and the pc's frame, are fixed. 96 KiB. */
#define FID_MEMO 4096
struct fid_memo {
    uint64_t pc, sx;    /* sx: space_id << 1 | exact */
    uint32_t fid1;      /* frame id + 1, 0 empty */
};

static uint32_t frame_id(struct fp_ctx *c, const struct space_ent *sp, uint64_t pc,
                         uint8_t exact)
{
    uint64_t sx = (uint64_t)sp->space_id << 1 | exact;
    struct fid_memo *m = &c->memo[SLOT(mix(sx, pc), FID_MEMO)];
    if (m->fid1 && m->pc == pc && m->sx == sx)
        return m->fid1 - 1;
    uint32_t fid = intern_frame(c, sp, pc, exact);
    if (fid < NEED_SYMS_ID)
        *m = (struct fid_memo){pc, sx, fid + 1};
    return fid;
}

/* Whether pcs[i] is named as it is (exact) or at pc - 1 (a return address): the leaf, a frame
 * after a signal trampoline, and every recorded callchain entry (FP_STATUS_*) are exact. */
static inline uint8_t pc_exact(uint8_t status, const uint8_t *kinds, uint32_t i)
{
    return i == 0 || status >= FP_STATUS_CALLCHAIN || (kinds[i - 1] & UNW_FRAME_SIGNAL);
}

/* Frame ids of a new stack's pcs (pc_exact). */
static int stack_fids(struct fp_ctx *c, const struct space_ent *sp, uint8_t status,
                      const uint64_t *pcs, const uint8_t *kinds, uint32_t npcs, uint64_t *foff)
{
    if (c->nfids + npcs > c->capfids) {
        uint64_t ncap = c->capfids ? c->capfids : 4096;
        while (ncap < c->nfids + npcs)
            ncap *= 2;
        uint32_t *q = realloc(c->fids, ncap * sizeof *q);
        if (!q)
            return -1;
        c->fids = q;
        c->capfids = ncap;
    }
    *foff = c->nfids;
    for (uint32_t i = 0; i < npcs; i++) {
        uint32_t id = intern_frame(c, sp, pcs[i], pc_exact(status, kinds, i));
        if (id == UINT32_MAX)
            return -1;
        c->fids[c->nfids++] = id;
    }
    return 0;
}

/* The id of key[0, nw): found, or added with count 0. UINT32_MAX on allocation failure. */
static uint32_t intern_stack(struct fp_ctx *c, const struct space_ent *sp, const uint64_t *key,
                             uint32_t nw)
{
    uint64_t h = 0;
    for (uint32_t i = 0; i < nw; i++)
        h = mix(h, key[i]);
    h &= ~STACK_RETIRED;
    if (index_reserve(c, &c->stab, &c->stabcap, c->nstk, stack_hash_of))
        return UINT32_MAX;
    uint64_t j = SLOT(h, c->stabcap);
    while (c->stab[j]) {
        const struct stack_ent *s = &c->stacks[c->stab[j] - 1];
        if (s->hash == h && s->nwords == nw && !memcmp(c->words + s->woff, key, 8 * (size_t)nw))
            return c->stab[j] - 1;
        j = SLOT(j + 1, c->stabcap);
    }
    if (c->nstk >= UINT32_MAX - 1 || grow_words(c, nw))
        return UINT32_MAX;
    if (c->nstk == c->capstk) {
        uint64_t ncap = c->capstk ? 2 * c->capstk : 1024;
        struct stack_ent *q = realloc(c->stacks, ncap * sizeof *q);
        if (!q)
            return UINT32_MAX;
        c->stacks = q;
        c->capstk = ncap;
    }
    uint64_t foff = UINT64_MAX;
    uint32_t npcs = (uint32_t)(key[1] >> 32);
    const uint64_t *pcs = key + 2;
    if (!c->by_code &&
        stack_fids(c, sp, (uint8_t)key[1], pcs, (const uint8_t *)(pcs + npcs), npcs, &foff))
        return UINT32_MAX;
    memcpy(c->words + c->nwords, key, 8 * (size_t)nw);
    c->stacks[c->nstk] = (struct stack_ent){c->nwords, h, 0, foff, nw, sp->space_id};
    c->nwords += nw;
    c->stab[j] = (uint32_t)c->nstk + 1;
    return (uint32_t)c->nstk++;
}

/* Key layout (u64 words):
 *   [0] space_id | comm_id << 32                    (by code: comm_id << 32 only)
 *   [1] status | regs_none << 8 | npcs << 32        (npcs <= 65536; nkc follows from the size)
 *   [2 ..] npcs pcs (by code: ceil(npcs / 2) words of u32 frame ids), then ceil(npcs / 8)
 *          words of kinds bytes, then nkc callchain words */
static inline uint32_t pc_words(const struct fp_ctx *c, uint32_t npcs)
{
    return c->by_code ? (npcs + 1) / 2 : npcs;
}

static inline uint32_t key_words(const struct fp_ctx *c, uint32_t npcs, uint64_t nkc)
{
    return 2 + pc_words(c, npcs) + (npcs + 7) / 8 + (uint32_t)nkc;
}

/* by code: note (space, stack) in the pair set; -1 on allocation failure. O(1) expected. */
static int note_pair(struct fp_ctx *c, uint32_t space_id, uint32_t stack_id, uint64_t pcs_hash)
{
    if (c->npairs >= UINT32_MAX - 1 ||
        index_reserve(c, &c->ptab, &c->ptabcap, c->npairs, pair_hash_of))
        return -1;
    uint64_t j = SLOT(pair_hash(space_id, stack_id, pcs_hash), c->ptabcap);
    while (c->ptab[j]) {
        const struct pair_ent *q = &c->pairs[c->ptab[j] - 1];
        if (q->space_id == space_id && q->stack_id == stack_id && q->pcs_hash == pcs_hash)
            return 0;
        j = SLOT(j + 1, c->ptabcap);
    }
    if (c->npairs == c->cappairs) {
        uint64_t ncap = c->cappairs ? 2 * c->cappairs : 1024;
        struct pair_ent *q = realloc(c->pairs, ncap * sizeof *q);
        if (!q)
            return -1;
        c->pairs = q;
        c->cappairs = ncap;
    }
    c->pairs[c->npairs] = (struct pair_ent){space_id, stack_id, pcs_hash};
    c->ptab[j] = (uint32_t)++c->npairs;
    return 0;
}

/* The stored view of an indexed SAMPLE stays inside its record: true for every record
 * fp_index / fp_live_index made; checked anyway (O(1), the rec only), so a caller's bad
 * struct fp_rec can never make the unwind read outside the record (the run's bounds check of
 * off and size keeps the record inside the buffer). */
static inline int rec_view_ok(const struct fp_layout *lay, const struct fp_rec *r)
{
    uint64_t blen = r->size - 8u; /* size >= 8: the caller checked FP_SAMPLE records */
    uint32_t nregs = lay->nregs > 64 ? 64 : lay->nregs;
    return r->size >= 8 && (uint64_t)r->cc_off + 8 * (uint64_t)r->cc_nr <= blen &&
           (r->regs_abi != 2 || !lay->regs_mask ||
            (uint64_t)r->regs_off + 8 * (uint64_t)nregs <= blen) &&
           (uint64_t)r->stack_off + r->dyn <= blen;
}

/* A sample ip (PERF_SAMPLE_IP) taken in kernel mode: header.misc's cpumode, which perf's
 * thread__find_map picks the kernel's maps by (include/uapi/linux/perf_event.h
 * PERF_RECORD_MISC_KERNEL). */
#define MISC_CPUMODE_MASK 7
#define MISC_KERNEL 1

/* The sample ip of r (*ip), 1; 0 when its layout has none (or, never for an indexed record,
 * the slot is outside it). */
static int sample_ip(const struct fp_layout *lay, const uint8_t *data, const struct fp_rec *r,
                     uint64_t *ip)
{
    if (lay->i_ip < 0 || 8 * (uint64_t)lay->i_ip + 8 > r->size - 8u)
        return 0;
    *ip = ld64(data + r->off + 8 + 8 * (uint64_t)lay->i_ip);
    return 1;
}

/* A sample of a layout without user registers (nothing to unwind) gets the frames perf
 * script shows for it (tools/perf/util/machine.c thread__resolve_callchain_sample): the
 * callchain's user entries, those after PERF_CONTEXT_USER (or before any marker) up to the
 * next marker, each as
 * recorded (add_callchain_ip names the address itself, no return address - 1: every one is
 * exact), leaf first, at most max_depth; its kernel entries are the key's raw callchain
 * (intern_sample). A sample with no callchain entries: its ip alone (user mode: pcs[0]; kernel
 * mode: intern_sample's callchain), as perf prints it without a call graph. */
static uint8_t recorded_frames(uint32_t max_depth, const struct fp_layout *lay,
                               const uint8_t *data, const struct fp_rec *r, uint64_t *pcs,
                               uint32_t *npcs)
{
    const uint8_t *body = data + r->off + 8;
    if (r->cc_nr) {
        int in_user = 1; /* perf starts in PERF_RECORD_MISC_USER, before any marker */
        for (uint32_t i = 0; i < r->cc_nr && *npcs < max_depth; i++) {
            uint64_t v = ld64(body + r->cc_off + 8 * (uint64_t)i);
            if (v >= CTX_MAX)
                in_user = v == CTX_USER;
            else if (in_user)
                pcs[(*npcs)++] = v;
        }
        return FP_STATUS_CALLCHAIN;
    }
    uint64_t ip;
    if (!sample_ip(lay, data, r, &ip))
        return UNW_NO_REGS;
    if ((r->misc & MISC_CPUMODE_MASK) != MISC_KERNEL)
        pcs[(*npcs)++] = ip;
    return FP_STATUS_IP_ONLY;
}

/* The unwinder's half of a sample: unwind the indexed SAMPLE r against the modules of sp into
 * pcs/kinds (max_depth each); its UNW_* status and *npcs, or UNW_BAD_VIEW if its stored view is
 * not inside the record; a layout without user registers: recorded_frames' FP_STATUS_*. Reads
 * only r, the record's bytes, the modules and their tables, and writes only pcs, kinds and the
 * calling thread's lookup cache (unwind.c, __thread): so any thread may run it while the
 * context is not being changed (the parallel run, par_*). */
uint8_t unwind_sample(const struct unw_arch_desc *arch, uint32_t max_depth,
                      const struct fp_layout *lay, const uint8_t *data,
                      const struct fp_rec *r, const struct space_ent *sp, uint64_t *pcs,
                      uint8_t *kinds, uint32_t *npcs)
{
    uint64_t regs[64];
    uint32_t nregs_lay = lay->nregs > 64 ? 64 : lay->nregs;
    const uint8_t *body = data + r->off + 8;
    *npcs = 0;
    /* The view fp_index stored (struct fp_rec): the sample is not parsed again, so only the
     * registers, the stack bytes the walk reads and the callchain are touched. */
    if (!rec_view_ok(lay, r))
        return UNW_BAD_VIEW;
    if (!lay->regs_mask) {
        uint8_t st = recorded_frames(max_depth, lay, data, r, pcs, npcs);
        memset(kinds, 0, *npcs);
        return st;
    }
    /* unwinder.Unwinder.unwind_batch: registers of 64-bit tasks only */
    uint32_t nregs = (r->regs_abi == 2 && lay->regs_mask) ? nregs_lay : 0;
    if (nregs)
        memcpy(regs, body + r->regs_off, 8 * (size_t)nregs);
    struct unw_item it = {sp->mods, sp->nmods, nregs, lay->regs_mask, regs,
                          r->dyn ? body + r->stack_off : NULL, r->dyn};
    uint16_t fpf, sigf;
    return unw_unwind_one(arch, &it, max_depth, pcs, kinds, npcs, &fpf, &sigf);
}

/* The aggregating half (calling thread only): the stack id of sample r (space sp, comm ce)
 * whose unwind gave status and pcs/kinds[0, npcs), counted; UINT32_MAX on failure,
 * NEED_SYMS_ID (by function, nothing counted) when a module needs its symbol table. The key's
 * callchain is the raw one; for the ip alone of a kernel-mode sample (FP_STATUS_IP_ONLY, no
 * pcs) { PERF_CONTEXT_KERNEL, ip }, so its one frame is a kernel frame like a callchain's. */
uint32_t intern_sample(struct fp_ctx *c, const struct fp_layout *lay, const uint8_t *data,
                       const struct fp_rec *r, const struct space_ent *sp,
                       const struct comm_ent *ce, uint8_t status, const uint64_t *pcs,
                       const uint8_t *kinds, uint32_t npcs)
{
    if (status == UNW_BAD_VIEW)
        return UINT32_MAX;
    const uint8_t *body = data + r->off + 8;
    uint64_t nkc = r->cc_nr;
    uint64_t kip[2] = {CTX_KERNEL, 0};
    const uint8_t *kc = body + r->cc_off;
    if (status == FP_STATUS_IP_ONLY && !npcs && sample_ip(lay, data, r, &kip[1])) {
        kc = (const uint8_t *)kip;
        nkc = 2;
    }
    if (nkc > UINT32_MAX - 2 * (uint64_t)c->max_depth - 4)
        return UINT32_MAX; /* cannot happen: records are < 64 KiB */
    uint32_t nw = key_words(c, npcs, nkc);
    if (nw > c->keycap) {
        uint64_t *q = realloc(c->key, 8 * (size_t)nw);
        if (!q)
            return UINT32_MAX;
        c->key = q;
        c->keycap = nw;
    }
    uint64_t *key = c->key;
    /* kernel_only (fp_stack.regs_none) is for unwound samples only */
    uint64_t regs_none = r->regs_abi == 0 && status < FP_STATUS_CALLCHAIN;
    key[1] = (uint64_t)status | regs_none << 8 | (uint64_t)npcs << 32;
    uint32_t npw = pc_words(c, npcs);
    uint64_t pcs_hash = npcs;
    if (c->by_code) {
        /* every pc to its frame id first: O(npcs * (log modules + 1)) expected per sample */
        key[0] = (uint64_t)ce->comm_id << 32;
        if (npcs & 1)
            key[2 + npw - 1] = 0; /* the pad half of an odd count */
        for (uint32_t i = 0; i < npcs; i++) {
            uint32_t fid = frame_id(c, sp, pcs[i], pc_exact(status, kinds, i));
            if (fid >= NEED_SYMS_ID)
                return fid; /* nothing counted yet: the sample is unwound again on resume */
            pcs_hash = mix(pcs_hash, pcs[i]);
            memcpy((uint8_t *)(key + 2) + 4 * (size_t)i, &fid, 4); /* no u32 store into u64s */
        }
    } else {
        key[0] = (uint64_t)sp->space_id | (uint64_t)ce->comm_id << 32;
        if (npcs)
            memcpy(key + 2, pcs, 8 * (size_t)npcs);
    }
    uint64_t *kw = key + 2 + npw;
    memset(kw, 0, 8 * (size_t)((npcs + 7) / 8));
    if (npcs)
        memcpy(kw, kinds, npcs);
    if (nkc)
        memcpy(kw + (npcs + 7) / 8, kc, 8 * (size_t)nkc);
    uint32_t id = intern_stack(c, sp, key, nw);
    if (id == UINT32_MAX)
        return id;
    c->stacks[id].count++;
    if (c->by_code && note_pair(c, sp->space_id, id, pcs_hash))
        return UINT32_MAX;
    return id;
}

/* Unwind one indexed SAMPLE r against space sp, comm ce; its stack id, or UINT32_MAX. */
uint32_t unwind_rec(struct fp_ctx *c, const struct fp_layout *lay, const uint8_t *data,
                    const struct fp_rec *r, const struct space_ent *sp,
                    const struct comm_ent *ce)
{
    uint32_t npcs;
    uint8_t status = unwind_sample(c->arch, c->max_depth, lay, data, r, sp, c->pcs, c->kinds,
                                   &npcs);
    return intern_sample(c, lay, data, r, sp, ce, status, c->pcs, c->kinds, npcs);
}

uint32_t fp_nstacks(const struct fp_ctx *c) { return (uint32_t)c->nstk; }

int fp_stack(const struct fp_ctx *c, uint32_t id, struct fp_stack *out)
{
    if (id >= c->nstk)
        return -1;
    const struct stack_ent *s = &c->stacks[id];
    const uint64_t *w = c->words + s->woff;
    uint32_t npcs = (uint32_t)(w[1] >> 32), npw = pc_words(c, npcs);
    out->space_id = c->by_code ? s->space0 : (uint32_t)w[0];
    out->comm_id = (uint32_t)(w[0] >> 32);
    out->status = (uint8_t)w[1];
    out->regs_none = (uint8_t)(w[1] >> 8);
    out->pad = 0;
    out->npcs = npcs;
    out->pcs = c->by_code ? NULL : w + 2;
    out->kinds = (const uint8_t *)(w + 2 + npw);
    out->nkc = s->nwords - 2 - npw - (npcs + 7) / 8;
    out->kc = w + 2 + npw + (npcs + 7) / 8;
    out->count = s->count;
    /* never NULL (memcpy/memcmp take no NULL even for 0 bytes): c->fids is allocated only
     * once a stack with a user pc exists */
    static const uint32_t no_fids[1];
    out->fids = c->by_code ? (const uint32_t *)(w + 2) : c->fids ? c->fids + s->foff : no_fids;
    return 0;
}

uint64_t fp_stacks_words(const struct fp_ctx *c, uint32_t from, uint32_t to, uint64_t *nkc)
{
    uint64_t n = 0, k = 0;
    for (uint64_t id = from; id < to && id < c->nstk; id++) {
        const uint64_t *w = c->words + c->stacks[id].woff;
        uint32_t npcs = (uint32_t)(w[1] >> 32);
        n += npcs;
        k += c->stacks[id].nwords - 2 - pc_words(c, npcs) - (npcs + 7) / 8;
    }
    *nkc = k;
    return n;
}

uint32_t fp_stacks_export(const struct fp_ctx *c, uint32_t from, uint32_t to, uint32_t *comm,
                          uint32_t *space, uint8_t *status, uint8_t *regs_none, uint32_t *npcs, uint32_t *nkc,
                          uint32_t *fids, uint64_t *kc)
{
    uint32_t k = 0;
    for (uint64_t id = from; id < to && id < c->nstk; id++, k++) {
        struct fp_stack st;
        fp_stack(c, (uint32_t)id, &st);
        comm[k] = st.comm_id;
        space[k] = st.space_id;
        status[k] = st.status;
        regs_none[k] = st.regs_none;
        npcs[k] = st.npcs;
        nkc[k] = st.nkc;
        if (st.npcs)
            memcpy(fids, st.fids, 4 * (size_t)st.npcs);
        fids += st.npcs;
        if (st.nkc)
            memcpy(kc, st.kc, 8 * (size_t)st.nkc);
        kc += st.nkc;
    }
    return k;
}

void fp_stack_counts(const struct fp_ctx *c, uint64_t *out)
{
    for (uint64_t id = 0; id < c->nstk; id++)
        out[id] = c->stacks[id].count;
}

int fp_ctx_code_frames(struct fp_ctx *c, int on)
{
    if (c->nstk || c->nfr || c->by_code || (on != 0 && on != 1))
        return -1;
    c->code_frames = on;
    return 0;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int64_t fp_ctx_retire_code(struct fp_ctx *c, const uint64_t *keys, uint32_t n)
{
    if (!c->code_frames)
        return -2;
    uint64_t *sorted = malloc(8 * (size_t)n + 8);
    if (!sorted)
        return -1;
    memcpy(sorted, keys, 8 * (size_t)n);
    qsort(sorted, n, 8, cmp_u64);
    uint8_t *gone = calloc(c->nfr + 1, 1); /* the frames retired now */
    if (!gone) {
        free(sorted);
        return -1;
    }
    int64_t got = 0;
    for (uint64_t i = 0; i < c->nfr && n; i++) {
        struct frame_ent *f = &c->frames[i];
        if ((f->tag & (FRAME_CODE | FRAME_RETIRED)) != FRAME_CODE)
            continue;
        uint64_t key = f->tag & ~FRAME_CODE;
        if (bsearch(&key, sorted, n, 8, cmp_u64)) {
            f->tag |= FRAME_RETIRED;
            gone[i] = 1;
            got++;
        }
    }
    free(sorted);
    /* the stacks holding one of them: their next sample makes a new stack (stacks by space
     * keep their frame ids at fids[foff, foff + npcs)) */
    for (uint64_t id = 0; id < c->nstk && got; id++) {
        struct stack_ent *s = &c->stacks[id];
        if (s->foff == UINT64_MAX || (s->hash & STACK_RETIRED))
            continue;
        uint32_t npcs = (uint32_t)(c->words[s->woff + 1] >> 32);
        for (uint32_t i = 0; i < npcs; i++)
            if (gone[c->fids[s->foff + i]]) {
                s->hash |= STACK_RETIRED;
                break;
            }
    }
    free(gone);
    return got;
}

void fp_stacks_pcs(const struct fp_ctx *c, uint32_t from, uint32_t to, uint64_t *pcs)
{
    for (uint64_t id = from; id < to && id < c->nstk && !c->by_code; id++) {
        const uint64_t *w = c->words + c->stacks[id].woff;
        uint32_t npcs = (uint32_t)(w[1] >> 32);
        if (npcs)
            memcpy(pcs, w + 2, 8 * (size_t)npcs);
        pcs += npcs;
    }
}

int fp_ctx_by_code(struct fp_ctx *c, int on)
{
    if (c->nstk || c->nfr || c->code_frames)
        return -1;
    if (on < 0 || on > 2)
        return -1;
    if (on && !c->memo && !(c->memo = calloc(FID_MEMO, sizeof *c->memo)))
        return -1;
    c->by_code = on;
    return 0;
}

uint64_t fp_pairs(const struct fp_ctx *c, uint64_t from, uint32_t *space_ids,
                  uint32_t *stack_ids, uint64_t *pcs_hashes, uint64_t max)
{
    uint64_t k = 0;
    for (uint64_t i = from; i < c->npairs && k < max; i++, k++) {
        space_ids[k] = c->pairs[i].space_id;
        stack_ids[k] = c->pairs[i].stack_id;
        pcs_hashes[k] = c->pairs[i].pcs_hash;
    }
    return k;
}

uint32_t fp_nframes(const struct fp_ctx *c) { return (uint32_t)c->nfr; }

uint64_t ctx_sets_bytes(const struct fp_ctx *c)
{
    return sizeof *c + (uint64_t)c->max_depth * (sizeof *c->pcs + 1) + c->keycap * 8 +
           c->scap * sizeof *c->spaces + c->ccap * sizeof *c->comms +
           c->capstk * sizeof *c->stacks + c->stabcap * sizeof *c->stab + c->capwords * 8 +
           c->capfr * sizeof *c->frames + c->ftabcap * sizeof *c->ftab +
           c->capfids * sizeof *c->fids + c->cappairs * sizeof *c->pairs +
           c->ptabcap * sizeof *c->ptab + c->symcap * sizeof *c->syms +
           (c->memo ? FID_MEMO * sizeof *c->memo : 0);
}

int fp_frame(const struct fp_ctx *c, uint32_t id, uint32_t *space_id, uint64_t *pc,
             uint8_t *exact)
{
    if (id >= c->nfr)
        return -1;
    *space_id = c->frames[id].space_id;
    *pc = c->frames[id].pc;
    *exact = c->frames[id].exact;
    return 0;
}
