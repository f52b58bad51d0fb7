/* unwindd native perf core (see perfcore.h for the interface and its invariants).
 *
 * Cost bounds: pc_open / pc_ring_map are one syscall each (two for a build_id fallback).
 * pc_drain is O(bytes copied + number of rings) with two memcpy per wrapped record and no
 * syscalls; it is the only per-batch call on the hot path, so Python crosses into C once per
 * batch, never per record (docs/architecture.md, "Cross the native boundary per batch").
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/perf_event.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "perfcore.h"
#include "perfcore_int.h"

/* The fixed part of the sample layout (include/uapi/linux/perf_event.h, PERF_RECORD_SAMPLE):
 *   { u64 ip; } { u32 pid, tid; } { u64 time; } { u32 cpu, res; } { u64 period; }
 *   { u64 nr; u64 ips[nr]; }                      kernel part only: exclude_callchain_user
 *   { u64 abi; u64 regs[hweight64(mask)]; }       REGS_USER, when a mask is given
 *   { u64 size; char data[size]; u64 dyn_size; }  STACK_USER, when a size is given
 * decoder.RecordDecoder decodes exactly this from pc_sample_type's value. */
#define PC_BASE_SAMPLE_TYPE                                                                     \
    (PERF_SAMPLE_IP | PERF_SAMPLE_TID | PERF_SAMPLE_TIME | PERF_SAMPLE_CPU | PERF_SAMPLE_PERIOD | \
     PERF_SAMPLE_CALLCHAIN)

uint64_t pc_sample_type(const pc_attr_config *cfg)
{
    uint64_t st = PC_BASE_SAMPLE_TYPE;
    /* A zero regs mask with REGS_USER is EINVAL on x86 (perf_reg_validate), and a zero stack
     * size would only add an empty u64: leave the bit out so the layout says what is there. */
    if (cfg->sample_regs_user)
        st |= PERF_SAMPLE_REGS_USER;
    if (cfg->sample_stack_user)
        st |= PERF_SAMPLE_STACK_USER;
    return st;
}

static void pc_fill_attr(struct perf_event_attr *attr, const pc_attr_config *cfg, int build_id)
{
    memset(attr, 0, sizeof(*attr));
    attr->size = sizeof(*attr);
    attr->type = cfg->type;
    attr->config = cfg->config;
    if (cfg->sample_period) {
        attr->sample_period = cfg->sample_period;
    } else {
        attr->freq = 1;
        attr->sample_freq = cfg->sample_freq;
    }
    attr->sample_type = pc_sample_type(cfg);
    attr->sample_regs_user = cfg->sample_regs_user;
    attr->sample_stack_user = cfg->sample_stack_user;
    /* User stacks are unwound by us from REGS_USER + STACK_USER; the kernel's frame-pointer
     * walk of user space would be wrong for -fomit-frame-pointer code and costs time. */
    attr->exclude_callchain_user = 1;
    /* Every side-band record carries pid/tid/time/cpu so it can be ordered with samples. */
    attr->sample_id_all = 1;
    /* One clock for all rings, comparable with clock_gettime(CLOCK_MONOTONIC) in Python. */
    attr->use_clockid = 1;
    attr->clockid = CLOCK_MONOTONIC;
    /* Opened disabled so every fd exists and is mapped before the first record is written. */
    attr->disabled = 1;
    attr->inherit = cfg->inherit ? 1 : 0;
    /* tools/perf/util/evsel.c evsel__fallback: where kernel.perf_event_paranoid > 1 keeps an
     * unprivileged user out of kernel space, perf samples user space only (exclude_kernel and
     * exclude_hv). No kernel callchain either: with exclude_kernel every sample is taken in
     * user mode (kernel/events/core.c perf_exclude_event), so the kernel part would be empty. */
    if (cfg->user_only) {
        attr->exclude_kernel = 1;
        attr->exclude_hv = 1;
        attr->exclude_callchain_kernel = 1;
    }
    /* tools/perf/util/evlist.c evlist__prepare_workload: a workload's events are opened on
     * the held child and enabled by the kernel at its exec (perf_event_enable_on_exec), so
     * the first sample is of the new image. */
    attr->enable_on_exec = cfg->enable_on_exec ? 1 : 0;
    if (cfg->wakeup_watermark) {
        /* kernel/events/ring_buffer.c perf_output_put_handle: with watermark, poll() wakes
         * once at least wakeup_watermark bytes are unread, not once per record. */
        attr->watermark = 1;
        attr->wakeup_watermark = cfg->wakeup_watermark;
    } else {
        attr->wakeup_events = 1;
    }
    if (cfg->sideband) {
        attr->mmap = 1;
        attr->mmap2 = 1;
        attr->comm = 1;
        attr->comm_exec = 1;
        attr->task = 1;
        attr->build_id = build_id ? 1 : 0;
    }
}

int pc_build_attr(const pc_attr_config *cfg, unsigned char *out, size_t cap)
{
    struct perf_event_attr attr;
    if (cap < sizeof(attr))
        return -EINVAL;
    pc_fill_attr(&attr, cfg, cfg->sideband && cfg->build_id);
    memcpy(out, &attr, sizeof(attr));
    return (int)sizeof(attr);
}

static int sys_perf_event_open(struct perf_event_attr *attr, int pid, int cpu, int group_fd,
                               unsigned long flags)
{
    /* CLOEXEC always: a profiler must never leak its perf fds into the processes it spawns. */
    long fd = syscall(SYS_perf_event_open, attr, (pid_t)pid, cpu, group_fd,
                      flags | PERF_FLAG_FD_CLOEXEC);
    return fd < 0 ? -errno : (int)fd;
}

int pc_open(const pc_attr_config *cfg, int pid, int cpu, int group_fd, unsigned long flags,
            int *build_id_granted)
{
    struct perf_event_attr attr;
    int want_bid = cfg->sideband && cfg->build_id;
    pc_fill_attr(&attr, cfg, want_bid);
    int fd = sys_perf_event_open(&attr, pid, cpu, group_fd, flags);
    if (fd == -EINVAL && want_bid) {
        /* attr.build_id exists since Linux 5.12 (commit 88a16a130933); older kernels reject
         * the unknown bit with EINVAL (perf_copy_attr checks reserved bits). MMAP2 records then
         * carry maj/min/ino/ino_generation instead. */
        want_bid = 0;
        pc_fill_attr(&attr, cfg, 0);
        fd = sys_perf_event_open(&attr, pid, cpu, group_fd, flags);
    }
    if (build_id_granted)
        *build_id_granted = fd >= 0 && want_bid;
    return fd;
}

static int pc_ioctl(int fd, unsigned long req, unsigned long arg)
{
    return ioctl(fd, req, arg) < 0 ? -errno : 0;
}

int pc_set_output(int fd, int target_fd)
{
    return pc_ioctl(fd, PERF_EVENT_IOC_SET_OUTPUT, (unsigned long)target_fd);
}

int pc_enable(int fd)
{
    return pc_ioctl(fd, PERF_EVENT_IOC_ENABLE, 0);
}

int pc_disable(int fd)
{
    return pc_ioctl(fd, PERF_EVENT_IOC_DISABLE, 0);
}

int pc_close(int fd)
{
    return close(fd) < 0 ? -errno : 0;
}

int pc_ring_map(pc_ring *ring, int fd, int cpu, uint32_t data_pages)
{
    if (!ring || data_pages == 0 || (data_pages & (data_pages - 1)))
        return -EINVAL;
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0)
        return -EINVAL;
    size_t len = (size_t)(1 + (uint64_t)data_pages) * (size_t)page;
    /* PROT_WRITE makes the ring non-overwriting: the kernel honours our data_tail and drops
     * (counting PERF_RECORD_LOST) rather than overwrite unread records (kernel/events/core.c
     * perf_mmap: rb flags RING_BUFFER_WRITABLE). */
    void *base = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED)
        return -errno;
    struct perf_event_mmap_page *pg = base;
    memset(ring, 0, sizeof(*ring));
    ring->meta = base;
    /* data_offset/data_size exist since Linux 4.1; before that the data area is page 1..n. */
    uint64_t off = pg->data_offset ? pg->data_offset : (uint64_t)page;
    uint64_t size = pg->data_size ? pg->data_size : (uint64_t)data_pages * (uint64_t)page;
    ring->data = (unsigned char *)base + off;
    ring->data_size = size;
    ring->map_size = len;
    ring->fd = fd;
    ring->cpu = cpu;
    return 0;
}

void pc_ring_unmap(pc_ring *ring)
{
    if (!ring)
        return;
    if (ring->meta && ring->map_size)
        munmap(ring->meta, ring->map_size);
    ring->meta = NULL;
    ring->data = NULL;
    ring->map_size = 0;
    ring->data_size = 0;
}

/* Ordering (kernel/events/ring_buffer.c, comment above perf_output_put_handle, and
 * tools/include/linux/ring_buffer.h ring_buffer_read_head/ring_buffer_write_tail):
 *   kernel:  write records; smp_wmb(); data_head = head       (B pairs with our acquire)
 *   us:      head = load_acquire(data_head); read records; store_release(data_tail, tail)
 * The release keeps our reads of [tail, new tail) before the kernel can see the space as free
 * and overwrite it (its smp_mb() pairs with it). data_tail has no other writer, so a relaxed
 * load of it is exact. */
static uint64_t ring_load_head(const struct perf_event_mmap_page *pg)
{
    return __atomic_load_n(&pg->data_head, __ATOMIC_ACQUIRE);
}

static uint64_t ring_load_tail(const struct perf_event_mmap_page *pg)
{
    return __atomic_load_n(&pg->data_tail, __ATOMIC_RELAXED);
}

static void ring_store_tail(struct perf_event_mmap_page *pg, uint64_t tail)
{
    __atomic_store_n(&pg->data_tail, tail, __ATOMIC_RELEASE);
}

uint64_t pc_ring_pending(const pc_ring *ring)
{
    if (!ring || !ring->meta)
        return 0;
    const struct perf_event_mmap_page *pg = ring->meta;
    return ring_load_head(pg) - ring_load_tail(pg);
}

uint64_t pc_pending_total(const pc_ring *rings, size_t nrings)
{
    uint64_t total = 0;
    for (size_t i = 0; rings && i < nrings; i++)
        total += pc_ring_pending(&rings[i]);
    return total;
}

/* Copy len bytes starting at free-running position pos of a power-of-two ring, in up to two
 * pieces: a record may wrap the end of the data area (tools/lib/perf/mmap.c perf_mmap__read
 * does the same split), and we hand out each record contiguous. */
static void ring_copy(unsigned char *dst, const unsigned char *data, uint64_t data_size,
                      uint64_t pos, size_t len)
{
    uint64_t off = pos & (data_size - 1);
    size_t first = len;
    if (off + len > data_size)
        first = (size_t)(data_size - off);
    memcpy(dst, data + off, first);
    if (first < len)
        memcpy(dst + first, data, len - first);
}

/* The layout of a SAMPLE record's user stack copy (perfcore.h, PC_BASE_SAMPLE_TYPE |
 * REGS_USER | STACK_USER; kernel/events/core.c perf_output_sample): ip, pid/tid, time,
 * cpu/res, period (8 bytes each after the header), then { nr; ips[nr] }, { abi; regs[nregs]
 * when abi != 0 }, { size; data[size]; dyn_size when size != 0 }, and nothing after (samples
 * carry no sample_id trailer). For the record of len bytes at ring position pos: 1 and *field
 * (offset of the size u64), *keep (dyn_size rounded up to 8) and *dyn if its copy can be cut;
 * 0 if not (no stack, nothing to cut, or fields that do not add up: copied whole). O(1). */
static int sample_cut(const unsigned char *data, uint64_t data_size, uint64_t pos, size_t len,
                      uint32_t nregs, size_t *field, uint64_t *keep, uint64_t *dyn)
{
    uint64_t v;
    size_t o = 8 + 5 * 8; /* header, ip, pid/tid, time, cpu/res, period */
    if (o + 8 > len)
        return 0;
    ring_copy((unsigned char *)&v, data, data_size, pos + o, 8); /* callchain nr */
    if (v > (len - o - 8) / 8)
        return 0;
    o += 8 + 8 * (size_t)v;
    if (o + 8 > len)
        return 0;
    ring_copy((unsigned char *)&v, data, data_size, pos + o, 8); /* regs abi */
    o += 8 + (v ? 8 * (size_t)nregs : 0);
    if (o + 16 > len)
        return 0;
    uint64_t size;
    ring_copy((unsigned char *)&size, data, data_size, pos + o, 8);
    if (size == 0 || (size & 7) || size != len - o - 16)
        return 0; /* no stack, or not exactly { size; data[size]; dyn_size } to the end */
    ring_copy((unsigned char *)dyn, data, data_size, pos + o + 8 + size, 8);
    if (*dyn > size)
        return 0;
    *keep = (*dyn + 7) & ~(uint64_t)7;
    if (*keep == size)
        return 0;
    *field = o;
    return 1;
}

uint32_t pc_trim_nregs(uint64_t sample_type, uint64_t regs_mask)
{
    if (sample_type != (PC_BASE_SAMPLE_TYPE | PERF_SAMPLE_REGS_USER | PERF_SAMPLE_STACK_USER))
        return PC_NO_TRIM;
    return (uint32_t)__builtin_popcountll(regs_mask);
}

/* The cut record at dst: its first field + 8 + keep bytes are in place; fix the sizes and put
 * dyn_size after the kept bytes. Nothing kept (dyn_size 0: the kernel's nofault copy of the
 * user stack failed, e.g. in exec): the record ends at a zero size, with no dyn_size, as the
 * kernel writes a sample without a stack (perf_output_sample_ustack). Returns its length. */
static size_t finish_cut(unsigned char *dst, size_t field, uint64_t keep, uint64_t dyn)
{
    size_t n = field + 8 + (keep ? (size_t)keep + 8 : 0);
    uint16_t hsize = (uint16_t)n; /* n < the original size, a u16 */
    memcpy(dst + offsetof(struct perf_event_header, size), &hsize, 2);
    memcpy(dst + field, &keep, 8);
    if (keep)
        memcpy(dst + field + 8 + keep, &dyn, 8);
    return n;
}

size_t pc_trim_records(unsigned char *buf, size_t len, uint32_t nregs)
{
    size_t src = 0, dst = 0;
    while (src + sizeof(struct perf_event_header) <= len) {
        struct perf_event_header hdr;
        memcpy(&hdr, buf + src, sizeof hdr);
        if (hdr.size < sizeof hdr || hdr.size > len - src)
            break;
        size_t field, n = hdr.size;
        uint64_t keep, dyn;
        /* a plain buffer is a ring that never wraps: data_size a power of two > len */
        if (nregs != PC_NO_TRIM && hdr.type == PERF_RECORD_SAMPLE &&
            sample_cut(buf, (uint64_t)1 << 62, src, hdr.size, nregs, &field, &keep, &dyn)) {
            memmove(buf + dst, buf + src, field + 8 + (size_t)keep);
            n = finish_cut(buf + dst, field, keep, dyn);
        } else {
            memmove(buf + dst, buf + src, n);
        }
        src += hdr.size;
        dst += n;
    }
    memmove(buf + dst, buf + src, len - src); /* a torn tail stays as it was */
    return dst + (len - src);
}

uint64_t pc__ring_head(const pc_ring *r)
{
    return ring_load_head(r->meta);
}

uint64_t pc__ring_tail(const pc_ring *r)
{
    return ring_load_tail(r->meta);
}

int pc__ring_usable(const pc_ring *r)
{
    return r->meta && r->data && r->data_size && !(r->data_size & (r->data_size - 1));
}

/* perfcore_int.h */
size_t pc__drain_ring(pc_ring *r, unsigned char *out, size_t cap, uint32_t nregs)
{
    struct perf_event_mmap_page *pg = r->meta;
    uint64_t head = ring_load_head(pg);
    uint64_t tail = ring_load_tail(pg);
    size_t done = 0;
    int corrupt = 0;

    /* A non-overwriting ring never holds more than data_size unread bytes; if it claims to, the
     * tail we wrote or the head we read is garbage and no record boundary can be trusted. */
    if (head - tail > r->data_size)
        corrupt = 1;
    while (!corrupt && head != tail) {
        uint64_t left = head - tail;
        struct perf_event_header hdr;
        if (left < sizeof(hdr)) {
            corrupt = 1;
            break;
        }
        ring_copy((unsigned char *)&hdr, r->data, r->data_size, tail, sizeof(hdr));
        /* The kernel publishes data_head only after whole records, each u64-aligned (sizes
         * are ALIGNed in kernel/events/core.c perf_prepare_sample and friends), so a size
         * below the header, unaligned, or past head can only be corruption. Resync instead of
         * guessing: a bad size could otherwise make us loop or read garbage forever. */
        if (hdr.size < sizeof(hdr) || (hdr.size & 7) || hdr.size > left) {
            corrupt = 1;
            break;
        }
        if (hdr.size > cap - done)
            break; /* output full: leave this and later records for the next drain */
        size_t field;
        uint64_t keep, dyn;
        if (nregs != PC_NO_TRIM && hdr.type == PERF_RECORD_SAMPLE &&
            sample_cut(r->data, r->data_size, tail, hdr.size, nregs, &field, &keep, &dyn)) {
            ring_copy(out + done, r->data, r->data_size, tail, field + 8 + (size_t)keep);
            done += finish_cut(out + done, field, keep, dyn);
        } else {
            ring_copy(out + done, r->data, r->data_size, tail, hdr.size);
            done += hdr.size;
        }
        tail += hdr.size;
        r->records++;
    }
    if (corrupt) {
        r->errors++;
        tail = head;
    }
    r->bytes += done;
    ring_store_tail(pg, tail);
    return done;
}

int64_t pc_drain_trim(pc_ring *rings, size_t nrings, size_t start, unsigned char *out,
                      size_t out_cap, uint64_t *sizes, uint32_t nregs)
{
    if ((nrings && (!rings || !sizes)) || (out_cap && !out))
        return -EINVAL;
    size_t total = 0;
    for (size_t i = 0; i < nrings; i++)
        sizes[i] = 0;
    if (out_cap == 0)
        return 0;
    for (size_t k = 0; k < nrings; k++) {
        size_t i = (start + k) % nrings;
        pc_ring *r = &rings[i];
        if (!pc__ring_usable(r))
            continue;
        size_t n = pc__drain_ring(r, out + total, out_cap - total, nregs);
        sizes[i] = n;
        total += n;
    }
    return (int64_t)total;
}

int64_t pc_drain(pc_ring *rings, size_t nrings, size_t start, unsigned char *out, size_t out_cap,
                 uint64_t *sizes)
{
    return pc_drain_trim(rings, nrings, start, out, out_cap, sizes, PC_NO_TRIM);
}
