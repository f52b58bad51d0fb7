/* index.c: the first stage of the native path (contract: fastpath.h): frame a data section
 * into struct fp_rec entries (fp_index: a perf.data file's; live.c's fp_live_index: ring
 * chunks, through index_records) and decode, for each PERF_RECORD_SAMPLE, the fields later
 * stages need and where its variable parts are; columns of the indexed records
 * (fp_select_other, fp_columns).
 *
 * Layouts followed (include/uapi/linux/perf_event.h, Linux 6.x), as decoder.py decodes them:
 *
 *   struct perf_event_header { u32 type; u16 misc; u16 size; };      size includes the header
 *   PERF_RECORD_SAMPLE body:
 *     { u64 IDENTIFIER, IP, TID(pid|tid<<32), TIME, ADDR, ID, STREAM_ID, CPU(cpu|res<<32),
 *       PERIOD }                                    each slot only if its sample_type bit is set
 *     { READ }  { u64 nr; u64 ips[nr]; } CALLCHAIN  { u32 size; char raw[size]; } RAW
 *     { u64 nr; {u64 hw_idx;} {from,to,flags}[nr]; {u64 cntr[nr];} } BRANCH_STACK
 *     { u64 abi; u64 regs[popcount(mask)] (if abi); } REGS_USER
 *     { u64 size; char data[size]; u64 dyn_size (if size); } STACK_USER
 *   perf.data user records with a payload after header.size (perf session.c): AUXTRACE (71)
 *   { u64 size; ... } then size bytes; HEADER_TRACING_DATA (66) { u32 size; } then size padded
 *   to 8.
 *
 * Invariants: every read is bounds-checked against [data, data + len) first (a record's header
 * before its body, each part's count before the part): garbage, cut and hostile input end the
 * index with a counted FP_END_*, never a read outside. parse_sample makes
 * decoder.RecordDecoder._sample's checks in its order, so the FP_ERR_* counts are its counts.
 * Offsets are computed in unsigned __int128, so no count in the input can wrap them (decoder.py
 * uses Python integers; the comparisons here are the same ones).
 * Cost: O(records) time; one array of 56-byte entries (doubling); nothing kept across calls.
 */
#include <stdlib.h>
#include <string.h>

#include "fastpath_int.h"

#define S_IP (1ull << 0)
#define S_TID (1ull << 1)
#define S_TIME (1ull << 2)
#define S_READ (1ull << 4)
#define S_CALLCHAIN (1ull << 5)
#define S_CPU (1ull << 7)
#define S_PERIOD (1ull << 8)
#define S_RAW (1ull << 10)
#define S_BRANCH_STACK (1ull << 11)
#define S_REGS_USER (1ull << 12)
#define S_STACK_USER (1ull << 13)

#define T_SAMPLE 9
#define T_HEADER_TRACING_DATA 66
#define T_FINISHED_ROUND 68
#define T_AUXTRACE 71

typedef unsigned __int128 u128;

/* Where a sample's variable parts are (offsets from the body start). */
struct sample_view {
    uint64_t cc_off, cc_nr;     /* callchain */
    uint64_t regs_abi, regs_off;
    uint64_t stack_off, dyn;
};

/* decoder.RecordDecoder._sample's checks, in its order; 0 or FP_ERR_*. */
static int parse_sample(const struct fp_layout *L, const uint8_t *b, uint64_t n,
                        struct sample_view *v)
{
    uint64_t st = L->sample_type;
    u128 off = (u128)L->nprefix * 8;
    memset(v, 0, sizeof *v);
    if (off > n)
        return FP_ERR_SHORT_BODY;
    if (st & S_READ) {
        if (L->read_group) {
            if (off + 8 > n)
                return FP_ERR_SHORT_BODY;
            uint64_t nr = ld64(b + (uint64_t)off);
            off += 8 + 8 * ((u128)L->read_times + (u128)nr * L->read_per_value);
        } else {
            off += 8 * ((u128)L->read_times + L->read_per_value);
        }
        if (off > n)
            return FP_ERR_SHORT_BODY;
    }
    if (st & S_CALLCHAIN) {
        if (off + 8 > n)
            return FP_ERR_SHORT_BODY;
        uint64_t nr = ld64(b + (uint64_t)off);
        off += 8;
        if (off + 8 * (u128)nr > n)
            return FP_ERR_BAD_CALLCHAIN_NR;
        v->cc_off = (uint64_t)off;
        v->cc_nr = nr;
        off += 8 * (u128)nr;
    }
    if (st & S_RAW) {
        if (off + 4 > n)
            return FP_ERR_SHORT_BODY;
        off += 4 + (u128)ld32(b + (uint64_t)off);
        if (off > n)
            return FP_ERR_BAD_RAW_SIZE;
    }
    if (st & S_BRANCH_STACK) {
        if (off + 8 > n)
            return FP_ERR_SHORT_BODY;
        uint64_t nr = ld64(b + (uint64_t)off);
        off += 8 + 8 * (u128)L->branch_hw_index + (24 + 8 * (u128)L->branch_counters) * nr;
        if (off > n)
            return FP_ERR_BAD_BRANCH_NR;
    }
    if (st & S_REGS_USER) {
        if (off + 8 > n)
            return FP_ERR_SHORT_BODY;
        v->regs_abi = ld64(b + (uint64_t)off);
        off += 8;
        if (v->regs_abi) {
            if (off + 8 * (u128)L->nregs > n)
                return FP_ERR_SHORT_REGS;
            v->regs_off = (uint64_t)off;
            off += 8 * (u128)L->nregs;
        }
    }
    if (st & S_STACK_USER) {
        if (off + 8 > n)
            return FP_ERR_SHORT_BODY;
        uint64_t size = ld64(b + (uint64_t)off);
        off += 8;
        if (size) {
            if (off + size + 8 > n)
                return FP_ERR_BAD_STACK_SIZE;
            uint64_t dyn = ld64(b + (uint64_t)(off + size));
            if (dyn > size)
                return FP_ERR_BAD_DYN_SIZE;
            v->stack_off = (uint64_t)off;
            v->dyn = dyn;
        }
    }
    return 0;
}

/* fp_index; payloads: skip AUXTRACE/TRACING_DATA payloads (perf.data framing). Ring chunks
 * have none (decoder.RecordDecoder.decode frames them by header.size only). */
int index_records(const struct fp_layout *lay, const uint8_t *data, uint64_t len,
                  int payloads, struct fp_rec **recs, uint64_t *nrec, uint64_t *other,
                  int *end, uint64_t *stopped_at)
{
    uint64_t cap = 1024, n = 0, pos = 0;
    struct fp_rec *r = malloc(cap * sizeof *r);
    *recs = NULL;
    *nrec = *other = 0;
    *end = FP_END_OK;
    *stopped_at = UINT64_MAX;
    if (!r)
        return -1;
    while (pos < len) {
        if (len - pos < 8) {
            *end = FP_END_TRUNCATED;
            break;
        }
        uint32_t type = ld32(data + pos);
        uint16_t misc, size;
        memcpy(&misc, data + pos + 4, 2);
        memcpy(&size, data + pos + 6, 2);
        if (size < 8) {
            *end = FP_END_BAD_SIZE;
            break;
        }
        if (size > len - pos) {
            *end = FP_END_TRUNCATED;
            break;
        }
        if (type > 255) {
            *stopped_at = pos;
            break;
        }
        if (n == cap) {
            struct fp_rec *q = realloc(r, 2 * cap * sizeof *r);
            if (!q) {
                free(r);
                return -1;
            }
            r = q;
            cap *= 2;
        }
        struct fp_rec *e = &r[n++];
        memset(e, 0, sizeof *e);
        e->off = pos;
        e->size = size;
        e->misc = misc;
        e->type = (uint8_t)type;
        const uint8_t *body = data + pos + 8;
        uint64_t blen = size - 8u;
        if (type == T_SAMPLE) {
            struct sample_view v;
            int err = parse_sample(lay, body, blen, &v);
            e->err = (uint8_t)err;
            if (!err) {
                e->flags = FP_SAMPLE;
                /* body offsets and counts < 64 KiB (size is a u16) */
                e->regs_abi = (uint8_t)(v.regs_abi > 2 ? 3 : v.regs_abi);
                e->cc_off = (uint16_t)v.cc_off;
                e->cc_nr = (uint16_t)v.cc_nr;
                e->regs_off = (uint16_t)v.regs_off;
                e->stack_off = (uint16_t)v.stack_off;
                e->dyn = (uint16_t)v.dyn;
                if (lay->i_time >= 0) {
                    e->time = ld64(body + 8 * (uint64_t)lay->i_time);
                    e->flags |= FP_TIMED;
                }
                if (lay->i_tid >= 0) {
                    uint64_t t = ld64(body + 8 * (uint64_t)lay->i_tid);
                    e->pid = (uint32_t)t;
                    e->tid = (uint32_t)(t >> 32);
                }
                if (lay->i_cpu >= 0) {
                    e->cpu = (uint32_t)ld64(body + 8 * (uint64_t)lay->i_cpu);
                    e->flags |= FP_HAS_CPU;
                }
                if (lay->i_period >= 0)
                    e->period = ld64(body + 8 * (uint64_t)lay->i_period);
            }
        } else if (type == T_FINISHED_ROUND) {
            e->flags = FP_MARKER;
        }
        if (!(e->flags & FP_SAMPLE))
            (*other)++;
        pos += size;
        /* payloads outside header.size (perfdata._payload_after) */
        u128 extra = 0;
        if (!payloads)
            ;
        else if (type == T_AUXTRACE && blen >= 8)
            extra = ld64(body);
        else if (type == T_HEADER_TRACING_DATA && blen >= 4)
            extra = ((u128)ld32(body) + 7) & ~(u128)7;
        if (extra) {
            if (extra > len - pos) {
                *end = FP_END_PAYLOAD_TRUNCATED;
                break;
            }
            pos += (uint64_t)extra;
        }
    }
    *recs = r;
    *nrec = n;
    return 0;
}

int fp_index(const struct fp_layout *lay, const uint8_t *data, uint64_t len,
             struct fp_rec **recs, uint64_t *nrec, uint64_t *other, int *end,
             uint64_t *stopped_at)
{
    return index_records(lay, data, len, 1, recs, nrec, other, end, stopped_at);
}

uint64_t fp_select_other(const struct fp_rec *recs, uint64_t n, uint32_t *out)
{
    uint64_t k = 0;
    for (uint64_t i = 0; i < n && i <= UINT32_MAX; i++)
        if (!(recs[i].flags & FP_SAMPLE))
            out[k++] = (uint32_t)i;
    return k;
}

void fp_columns(const struct fp_rec *recs, const uint32_t *perm, uint64_t nout,
                uint8_t *is_sample, uint64_t *time, uint64_t *period, uint32_t *pid,
                uint32_t *tid, uint32_t *cpu)
{
    for (uint64_t k = 0; k < nout; k++) {
        const struct fp_rec *r = &recs[perm[k]];
        is_sample[k] = (r->flags & FP_SAMPLE) ? 1 : 0;
        time[k] = r->time;
        period[k] = r->period;
        pid[k] = r->pid;
        tid[k] = r->tid;
        cpu[k] = r->cpu;
    }
}
