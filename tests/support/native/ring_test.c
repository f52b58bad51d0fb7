/* Native harness for cffi_build/perfcore.c, run under ASan+UBSan and under valgrind by
 * tests/native/test_native_sanitizers.py.
 *
 * Synthetic rings use the real struct perf_event_mmap_page for the control page and an
 * exactly-sized heap block for the data area, so any read past the data area's end (a wrap
 * handled wrong) is an ASan heap-buffer-overflow / valgrind invalid read, not silent garbage.
 * Positions are free-running u64 like the kernel's (kernel/events/ring_buffer.c: head and tail
 * only grow; offsets are pos & (size - 1)); tests start near 2^64 to cover the overflow too.
 *
 * Prints "ok <checks>" and exits 0 when everything holds; any failure prints the line and
 * exits 1.
 */
#include <errno.h>
#include <linux/perf_event.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "perfcore.h"

static int checks;

#define CHECK(cond)                                                                \
    do {                                                                           \
        checks++;                                                                  \
        if (!(cond)) {                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                               \
        }                                                                          \
    } while (0)

typedef struct {
    struct perf_event_mmap_page *meta;
    pc_ring ring;
} fake_ring;

static void fake_init(fake_ring *f, uint64_t data_size, uint64_t pos)
{
    f->meta = calloc(1, sizeof(*f->meta));
    CHECK(f->meta != NULL);
    memset(&f->ring, 0, sizeof(f->ring));
    f->ring.meta = f->meta;
    f->ring.data = malloc(data_size); /* exact size: overreads are caught */
    CHECK(f->ring.data != NULL);
    memset(f->ring.data, 0xAB, data_size);
    f->ring.data_size = data_size;
    f->ring.fd = -1;
    f->meta->data_head = pos;
    f->meta->data_tail = pos;
}

static void fake_free(fake_ring *f)
{
    free(f->ring.data);
    free(f->meta);
}

/* Build a record: header {type, misc, size} then a payload whose every byte encodes (seq, i), so
 * a misplaced or torn copy cannot compare equal. */
static void make_record(unsigned char *dst, uint16_t size, uint32_t seq)
{
    struct perf_event_header h = {.type = PERF_RECORD_SAMPLE, .misc = (uint16_t)seq, .size = size};
    memcpy(dst, &h, sizeof(h));
    for (uint16_t i = sizeof(h); i < size; i++)
        dst[i] = (unsigned char)(seq * 31u + i);
}

/* Kernel side of the protocol: write len bytes at head (wrapping), then publish head. */
static void produce(fake_ring *f, const unsigned char *src, size_t len)
{
    /* the kernel reads data_tail before it writes (perf_output_begin: READ_ONCE, then
     * smp_mb): the consumer's reads of the space it freed come first */
    (void)__atomic_load_n(&f->meta->data_tail, __ATOMIC_ACQUIRE);
    uint64_t head = f->meta->data_head;
    uint64_t mask = f->ring.data_size - 1;
    for (size_t i = 0; i < len; i++)
        f->ring.data[(head + i) & mask] = src[i];
    __atomic_store_n(&f->meta->data_head, head + len, __ATOMIC_RELEASE);
}

static int64_t drain1(fake_ring *f, unsigned char *out, size_t cap, uint64_t *size)
{
    return pc_drain(&f->ring, 1, 0, out, cap, size);
}

/* Records that wrap the end of the data area come out whole and in order. */
static void test_wrap(void)
{
    fake_ring f;
    /* 256-byte ring; start 200 bytes into it, 2^64 - 56 free-running (wraps the u64 too). */
    uint64_t start = (uint64_t)0 - 256 + 200;
    fake_init(&f, 256, start);
    unsigned char src[24 + 40 + 48 + 8 + 64];
    size_t sizes[] = {24, 40, 48, 8, 64}, off = 0;
    /* offsets: 200..224, 224..264 (wraps: 32 + 8), 8..56, 56..64, 64..128 */
    for (size_t i = 0; i < 5; i++) {
        make_record(src + off, (uint16_t)sizes[i], (uint32_t)i + 1);
        off += sizes[i];
    }
    produce(&f, src, off);
    unsigned char *out = malloc(off);
    uint64_t got;
    CHECK(drain1(&f, out, off, &got) == (int64_t)off);
    CHECK(got == off);
    CHECK(memcmp(out, src, off) == 0);
    CHECK(f.meta->data_tail == f.meta->data_head);
    CHECK(f.ring.records == 5 && f.ring.errors == 0 && f.ring.bytes == off);
    /* Nothing new: an empty drain copies nothing and keeps the tail. */
    CHECK(drain1(&f, out, off, &got) == 0 && got == 0);
    free(out);

    /* A record whose header is the last 8 bytes of the area and whose body starts at 0. */
    fake_ring g;
    fake_init(&g, 64, 7 * 64 + 56);
    unsigned char rec[32];
    make_record(rec, 32, 9);
    produce(&g, rec, 32);
    unsigned char out2[32];
    CHECK(drain1(&g, out2, sizeof(out2), &got) == 32 && memcmp(out2, rec, 32) == 0);
    fake_free(&f);
    fake_free(&g);
}

/* A full output stops at a record boundary; the rest stays in the ring for the next drain. */
static void test_output_full(void)
{
    fake_ring f;
    fake_init(&f, 128, 96);
    unsigned char src[24 + 40 + 16];
    make_record(src, 24, 1);
    make_record(src + 24, 40, 2); /* 120..160: wraps */
    make_record(src + 64, 16, 3);
    produce(&f, src, sizeof(src));
    unsigned char out[80];
    uint64_t got;
    CHECK(drain1(&f, out, 24 + 40 - 1, &got) == 24 && got == 24);
    CHECK(memcmp(out, src, 24) == 0);
    CHECK(f.meta->data_tail == 96 + 24);
    CHECK(drain1(&f, out, 7, &got) == 0); /* not even a header fits */
    CHECK(f.meta->data_tail == 96 + 24);
    CHECK(drain1(&f, out, sizeof(out), &got) == 56 && memcmp(out, src + 24, 56) == 0);
    CHECK(f.meta->data_tail == f.meta->data_head && f.ring.errors == 0);
    fake_free(&f);
}

/* Every kind of corrupt header is counted once, resyncs tail to head and never loops. */
static void test_corrupt(void)
{
    uint16_t bad_sizes[] = {0, 4, 12, 200 /* > what was published */};
    for (size_t k = 0; k < sizeof(bad_sizes) / sizeof(bad_sizes[0]); k++) {
        fake_ring f;
        fake_init(&f, 128, 1000);
        unsigned char src[16 + 8 + 40];
        make_record(src, 16, 1);
        struct perf_event_header h = {.type = 9, .misc = 0, .size = bad_sizes[k]};
        memcpy(src + 16, &h, 8);
        make_record(src + 24, 40, 3);
        produce(&f, src, sizeof(src));
        unsigned char out[128];
        uint64_t got;
        /* The good record before the corruption is still delivered. */
        CHECK(drain1(&f, out, sizeof(out), &got) == 16 && memcmp(out, src, 16) == 0);
        CHECK(f.ring.errors == 1);
        CHECK(f.meta->data_tail == f.meta->data_head);
        /* Fresh data after the resync drains normally. */
        unsigned char rec[32];
        make_record(rec, 32, 4);
        produce(&f, rec, 32);
        CHECK(drain1(&f, out, sizeof(out), &got) == 32 && memcmp(out, rec, 32) == 0);
        CHECK(f.ring.errors == 1);
        fake_free(&f);
    }
    /* head - tail larger than the ring: nothing is trusted. */
    fake_ring f;
    fake_init(&f, 64, 0);
    __atomic_store_n(&f.meta->data_head, 64 + 8, __ATOMIC_RELEASE);
    unsigned char out[64];
    uint64_t got;
    CHECK(drain1(&f, out, sizeof(out), &got) == 0 && f.ring.errors == 1);
    CHECK(f.meta->data_tail == 72);
    /* Only 4 bytes published: a header cannot even be read. */
    __atomic_store_n(&f.meta->data_head, 76, __ATOMIC_RELEASE);
    CHECK(drain1(&f, out, sizeof(out), &got) == 0 && f.ring.errors == 2);
    fake_free(&f);
}

/* Several rings into one output: laid out in visiting order from `start`, sizes per ring. */
static void test_multi(void)
{
    fake_ring r[3];
    pc_ring rings[3];
    unsigned char recs[3][48];
    for (int i = 0; i < 3; i++) {
        fake_init(&r[i], 64, (uint64_t)(40 + 8 * i));
        make_record(recs[i], (uint16_t)(16 + 16 * i), (uint32_t)(10 + i));
        produce(&r[i], recs[i], (size_t)(16 + 16 * i));
        rings[i] = r[i].ring;
    }
    unsigned char out[256];
    uint64_t sizes[3];
    /* Start at ring 2, and leave room for ring 2 (48) and ring 0 (16) only. */
    CHECK(pc_drain(rings, 3, 2, out, 48 + 16 + 8, sizes) == 64);
    CHECK(sizes[2] == 48 && sizes[0] == 16 && sizes[1] == 0);
    CHECK(memcmp(out, recs[2], 48) == 0 && memcmp(out + 48, recs[0], 16) == 0);
    CHECK(pc_drain(rings, 3, 0, out, sizeof(out), sizes) == 32 && sizes[1] == 32);
    CHECK(memcmp(out, recs[1], 32) == 0);
    /* Unmapped ring entries are skipped; bad arguments are refused. */
    pc_ring empty;
    memset(&empty, 0, sizeof(empty));
    CHECK(pc_drain(&empty, 1, 0, out, sizeof(out), sizes) == 0 && sizes[0] == 0);
    CHECK(pc_drain(rings, 3, 0, NULL, 16, sizes) == -EINVAL);
    CHECK(pc_drain(rings, 3, 0, out, sizeof(out), NULL) == -EINVAL);
    for (int i = 0; i < 3; i++)
        fake_free(&r[i]);
}

static uint32_t rnd(uint64_t *seed)
{
    *seed = *seed * 6364136223846793005ULL + 1442695040888963407ULL; /* Knuth's MMIX LCG */
    return (uint32_t)(*seed >> 33);
}

/* Random record streams, random output sizes: the concatenation of all drains equals what was
 * produced, every drain ends on a record boundary, and the ring never reports an error. */
static void test_random(void)
{
    uint64_t seed = 0x9e3779b97f4a7c15ULL;
#define RND() rnd(&seed)
    for (int round = 0; round < 300; round++) {
        uint64_t size = 64u << (RND() % 4); /* 64..512 */
        fake_ring f;
        fake_init(&f, size, ((uint64_t)RND() << 32 | RND()) & ~(uint64_t)7);
        unsigned char produced[4096], consumed[4096];
        size_t np = 0, nc = 0;
        uint32_t seq = 0;
        for (int step = 0; step < 60; step++) {
            /* produce while there is room (the kernel never overwrites unread bytes) */
            uint64_t used = f.meta->data_head - f.meta->data_tail;
            uint16_t rs = (uint16_t)(8 * (1 + RND() % 8));
            if (used + rs <= size && np + rs <= sizeof(produced) && RND() % 3) {
                make_record(produced + np, rs, ++seq);
                produce(&f, produced + np, rs);
                np += rs;
            }
            size_t cap = RND() % 96;
            unsigned char *out = malloc(cap ? cap : 1);
            uint64_t got;
            int64_t n = drain1(&f, out, cap, &got);
            CHECK(n >= 0 && (uint64_t)n == got && (size_t)n <= cap);
            /* whole records only */
            for (int64_t p = 0; p < n;) {
                struct perf_event_header h;
                memcpy(&h, out + p, sizeof(h));
                CHECK(h.size >= 8 && p + h.size <= n);
                p += h.size;
            }
            memcpy(consumed + nc, out, (size_t)n);
            nc += (size_t)n;
            free(out);
        }
        unsigned char out[512];
        uint64_t got;
        int64_t n = drain1(&f, out, sizeof(out), &got);
        memcpy(consumed + nc, out, (size_t)n);
        nc += (size_t)n;
        CHECK(nc == np && memcmp(consumed, produced, np) == 0);
        CHECK(f.ring.errors == 0 && f.meta->data_tail == f.meta->data_head);
        fake_free(&f);
    }
#undef RND
}

/* A SAMPLE of pc_open's REGS_USER | STACK_USER layout (nregs registers), or one broken in
 * one of its stack fields (kind 1: dyn_size > size; 2: a size that does not end the record;
 * 3: no stack), or another record type (4). Returns its size. */
static size_t make_sample(unsigned char *dst, uint64_t *seed, uint32_t nregs, int kind)
{
    uint64_t w[64];
    size_t n = 0;
    w[n++] = 0; /* header, below */
    for (int i = 0; i < 5; i++)
        w[n++] = (uint64_t)rnd(seed) << 32 | rnd(seed); /* ip, pid/tid, time, cpu, period */
    uint64_t nr = rnd(seed) % 4;
    w[n++] = nr;
    for (uint64_t i = 0; i < nr; i++)
        w[n++] = 0xffffffff81000000ull + rnd(seed);
    uint64_t abi = (rnd(seed) % 4) ? 2 : 0;
    w[n++] = abi;
    if (abi)
        for (uint32_t i = 0; i < nregs; i++)
            w[n++] = rnd(seed);
    uint64_t size = kind == 3 ? 0 : 8 * (1 + rnd(seed) % 20);
    uint64_t dyn = size ? rnd(seed) % (size + 1) : 0;
    if (kind == 1)
        dyn = size + 1 + rnd(seed) % 8;
    w[n++] = size + (kind == 2 ? 8 : 0);
    for (uint64_t i = 0; i < size / 8; i++)
        w[n++] = (uint64_t)rnd(seed) << 32 | rnd(seed);
    if (size)
        w[n++] = dyn;
    struct perf_event_header h = {.type = kind == 4 ? PERF_RECORD_MMAP2 : PERF_RECORD_SAMPLE,
                                  .misc = 2, .size = (uint16_t)(8 * n)};
    memcpy(&w[0], &h, 8);
    memcpy(dst, w, 8 * n);
    return 8 * n;
}

static int empty_cuts; /* cut records that kept no stack byte */

/* The cut of pc_trim_records, checked field by field against the record it came from. */
static void check_cut(const unsigned char *orig, size_t olen, const unsigned char *cut,
                      size_t clen, uint32_t nregs)
{
    uint64_t v;
    size_t o = 48;
    memcpy(&v, orig + o, 8);
    o += 8 + 8 * v;
    memcpy(&v, orig + o, 8);
    o += 8 + (v ? 8 * nregs : 0);
    uint64_t size, dyn;
    memcpy(&size, orig + o, 8);
    CHECK(size && o + 16 + size == olen);
    memcpy(&dyn, orig + olen - 8, 8);
    uint64_t keep = (dyn + 7) & ~(uint64_t)7;
    /* nothing filled: the record ends at a zero size, as the kernel writes one without stack */
    CHECK(dyn <= size && keep < size && clen == o + 8 + (keep ? 8 + keep : 0));
    struct perf_event_header h;
    memcpy(&h, cut, 8);
    CHECK(h.size == clen && memcmp(cut, orig, 6) == 0); /* type and misc kept */
    CHECK(memcmp(cut + 8, orig + 8, o - 8) == 0); /* everything before the stack */
    memcpy(&v, cut + o, 8);
    CHECK(v == keep);
    if (keep) {
        CHECK(memcmp(cut + o + 8, orig + o + 8, keep) == 0); /* the kept stack bytes */
        memcpy(&v, cut + o + 8 + keep, 8);
        CHECK(v == dyn);
    }
    empty_cuts += keep == 0;
}

/* pc_drain_trim out of wrapping rings gives exactly pc_trim_records of what was produced;
 * every cut record keeps all but the unfilled stack bytes, broken ones come out whole. */
static void test_trim(void)
{
    uint64_t seed = 0x2545F4914F6CDD1DULL;
    const uint32_t nregs = 3;
    CHECK(pc_trim_nregs(0, 0) == PC_NO_TRIM);
    for (int round = 0; round < 200; round++) {
        uint64_t size = 512u << (rnd(&seed) % 4); /* 512..4096 */
        fake_ring f;
        fake_init(&f, size, ((uint64_t)rnd(&seed) << 32 | rnd(&seed)) & ~(uint64_t)7);
        unsigned char produced[16384], expect[16384], got[16384];
        size_t np = 0, ng = 0, cut = 0;
        for (int step = 0; step < 40; step++) {
            unsigned char rec[1024];
            int kind = (rnd(&seed) % 3) ? 0 : 1 + (int)(rnd(&seed) % 4);
            size_t rs = make_sample(rec, &seed, nregs, kind);
            uint64_t used = f.meta->data_head - f.meta->data_tail;
            if (used + rs <= size && np + rs <= sizeof(produced)) {
                memcpy(produced + np, rec, rs);
                produce(&f, rec, rs);
                np += rs;
            }
            size_t cap = 64 + rnd(&seed) % 1024;
            unsigned char *out = malloc(cap);
            uint64_t sz;
            int64_t n = pc_drain_trim(&f.ring, 1, 0, out, cap, &sz, nregs);
            CHECK(n >= 0 && (uint64_t)n == sz && (size_t)n <= cap);
            memcpy(got + ng, out, (size_t)n);
            ng += (size_t)n;
            free(out);
        }
        uint64_t sz;
        int64_t n;
        while ((n = pc_drain_trim(&f.ring, 1, 0, got + ng, sizeof(got) - ng, &sz, nregs)) > 0)
            ng += (size_t)n;
        CHECK(f.ring.errors == 0 && f.meta->data_tail == f.meta->data_head);
        /* the same cut, in place on the produced bytes */
        memcpy(expect, produced, np);
        size_t ne = pc_trim_records(expect, np, nregs);
        CHECK(ne == ng && memcmp(expect, got, ng) == 0);
        CHECK(pc_trim_records(expect, ne, PC_NO_TRIM) == ne); /* no cut: unchanged */
        CHECK(memcmp(expect, got, ng) == 0);
        /* record by record: cut ones checked against their original, others byte-equal */
        size_t po = 0, pc = 0;
        while (po < np) {
            struct perf_event_header ho, hc;
            memcpy(&ho, produced + po, 8);
            memcpy(&hc, got + pc, 8);
            if (hc.size != ho.size) {
                check_cut(produced + po, ho.size, got + pc, hc.size, nregs);
                cut++;
            } else {
                CHECK(memcmp(produced + po, got + pc, ho.size) == 0);
            }
            po += ho.size;
            pc += hc.size;
        }
        CHECK(pc == ng && (np == 0 || cut > 0));
        fake_free(&f);
    }
    CHECK(empty_cuts > 0); /* dyn_size 0 came up */
}

/* A real kernel ring: 4 data pages and 8 KiB stack copies wrap within a few samples. Drain with
 * a small output so the output-full path runs on real records too. */
static void test_real_ring(void)
{
    pc_attr_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.type = PERF_TYPE_SOFTWARE;
    cfg.config = PERF_COUNT_SW_CPU_CLOCK;
    cfg.sample_freq = 2000;
    cfg.sample_regs_user = 0xff0fff; /* unwindd.source.abi.X86_64_REGS_MASK */
    cfg.sample_stack_user = 8192;
    cfg.wakeup_watermark = 4096;
    cfg.sideband = 1;
    cfg.build_id = 1;
    int granted = -1;
    /* This process, on whatever CPU it runs: pid=0, cpu=-1 needs no system-wide rights. */
    int fd = pc_open(&cfg, 0, -1, -1, 0, &granted);
    CHECK(fd >= 0);
    CHECK(granted == 0 || granted == 1);
    pc_ring ring;
    CHECK(pc_ring_map(&ring, fd, -1, 3) == -EINVAL); /* not a power of two */
    CHECK(pc_ring_map(&ring, fd, -1, 4) == 0);
    CHECK(ring.data_size == 4 * (uint64_t)sysconf(_SC_PAGESIZE));
    CHECK(pc_enable(fd) == 0);
    size_t cap = 3 * 8192, total = 0, records = 0;
    unsigned char *out = malloc(cap);
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    volatile uint64_t spin = 0;
    do {
        for (int i = 0; i < 200000; i++)
            spin += (uint64_t)i;
        uint64_t got;
        int64_t n = pc_drain(&ring, 1, 0, out, cap, &got);
        CHECK(n >= 0 && (size_t)n <= cap);
        for (int64_t p = 0; p < n;) {
            struct perf_event_header h;
            memcpy(&h, out + p, sizeof(h));
            CHECK(h.size >= 8 && (h.size & 7) == 0 && p + h.size <= n);
            CHECK(h.type >= PERF_RECORD_MMAP && h.type < PERF_RECORD_MAX);
            records++;
            p += h.size;
        }
        total += (size_t)n;
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < 150000000L);
    CHECK(pc_disable(fd) == 0);
    uint64_t got;
    int64_t n;
    while ((n = pc_drain(&ring, 1, 0, out, cap, &got)) > 0)
        total += (size_t)n;
    CHECK(pc_ring_pending(&ring) == 0);
    CHECK(ring.errors == 0);
    CHECK(records > 10);
    /* the ring wrapped at least once */
    CHECK(ring.bytes == total && total > ring.data_size);
    pc_ring_unmap(&ring);
    pc_ring_unmap(&ring); /* idempotent */
    CHECK(pc_close(fd) == 0);
    CHECK(pc_close(fd) == -EBADF);
    free(out);
    printf("real ring: %zu records, %zu bytes, build_id=%d\n", records, total, granted);
}

/* ---- the spill (ringspill.c) */

static pc_spill_stats spill_stats(pc_spill *sp)
{
    pc_spill_stats st;
    pc_spill_get_stats(sp, &st);
    return st;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Check the records in out[0, n) are make_record(*seq, ...) for consecutive seqs. */
static void check_seq(const unsigned char *out, int64_t n, uint32_t *seq)
{
    for (int64_t p = 0; p < n;) {
        struct perf_event_header h;
        memcpy(&h, out + p, sizeof(h));
        CHECK(h.size >= 8 && p + h.size <= n);
        unsigned char want[128];
        CHECK(h.size <= sizeof(want));
        make_record(want, h.size, *seq);
        CHECK(memcmp(out + p, want, h.size) == 0); /* the next seq, whole */
        (*seq)++;
        p += h.size;
    }
}

/* Records the spill moved come out before those still in the ring, in order, whole, once;
 * the spill holds no more than its cap and counts the records it had no room for. */
static void test_spill_order(void)
{
    fake_ring f;
    fake_init(&f, 1024, (uint64_t)0 - 512); /* the free-running u64 wraps too */
    unsigned char rec[64];
    uint32_t made = 0;
    for (int i = 0; i < 14; i++) { /* 896 bytes: 87 % full */
        make_record(rec, 64, made++);
        produce(&f, rec, 64);
    }
    pc_spill *sp = NULL;
    CHECK(pc_spill_start(&sp, &f.ring, 1, 1 << 20, PC_NO_TRIM, 0, 0) == -EINVAL);
    CHECK(pc_spill_start(&sp, &f.ring, 1, 1 << 20, PC_NO_TRIM, 100, 0) == -EINVAL);
    CHECK(pc_spill_start(NULL, &f.ring, 1, 1 << 20, PC_NO_TRIM, 50, 0) == -EINVAL);
    CHECK(pc_spill_start(&sp, &f.ring, 1, 1 << 20, PC_NO_TRIM, 50, 0) == 0 && sp);
    for (int t = 0; t < 5000 && spill_stats(sp).records < 14; t++)
        sleep_ms(1);
    pc_spill_stats st = spill_stats(sp);
    CHECK(st.records == 14 && st.bytes == 14 * 64 && st.held == 14 * 64 && st.full == 0);
    CHECK(pc_ring_pending(&f.ring) == 0 && pc_spill_pending(sp) == 14 * 64);
    for (int i = 0; i < 4; i++) { /* more, into the ring (below the spill's 50 %) */
        make_record(rec, 64, made++);
        produce(&f, rec, 64);
    }
    CHECK(pc_spill_pending(sp) == 18 * 64);
    unsigned char out[200];
    uint64_t size;
    uint32_t seq = 0;
    int64_t n;
    while ((n = pc_drain_spill(sp, 0, out, sizeof(out), &size)) > 0) {
        CHECK((uint64_t)n == size && n <= (int64_t)sizeof(out) && n % 64 == 0);
        check_seq(out, n, &seq);
    }
    CHECK(n == 0 && seq == made);
    st = spill_stats(sp);
    CHECK(st.held == 0 && st.held_max == 14 * 64 && pc_spill_pending(sp) == 0);
    CHECK(pc_drain_spill(sp, 0, out, 0, &size) == 0);
    CHECK(pc_drain_spill(NULL, 0, out, sizeof(out), &size) == -EINVAL);
    pc_spill_stop(sp);

    /* A cap of 3 records: the spill takes 3 and counts the rest as no room */
    for (int i = 0; i < 14; i++) {
        make_record(rec, 64, made++);
        produce(&f, rec, 64);
    }
    CHECK(pc_spill_start(&sp, &f.ring, 1, 3 * 64 + 32, PC_NO_TRIM, 50, 0) == 0);
    for (int t = 0; t < 5000 && spill_stats(sp).full == 0; t++)
        sleep_ms(1);
    st = spill_stats(sp);
    CHECK(st.records == 3 && st.held == 3 * 64 && st.full >= 1);
    CHECK(pc_ring_pending(&f.ring) == 11 * 64);
    /* stopped with records held: they are freed (ASan/valgrind: no leak) */
    pc_spill_stop(sp);
    pc_spill_stop(NULL);
    fake_free(&f);
}

typedef struct {
    fake_ring *f;
    uint32_t n;
    uint64_t seed;
} producer_arg;

/* The kernel's side, except that it waits for room instead of dropping: every record must
 * reach the consumer. */
static void *producer(void *p)
{
    producer_arg *a = p;
    unsigned char rec[128];
    for (uint32_t seq = 0; seq < a->n; seq++) {
        uint16_t size = (uint16_t)(8 * (1 + rnd(&a->seed) % 16));
        make_record(rec, size, seq);
        while (a->f->ring.data_size - pc_ring_pending(&a->f->ring) < size)
            sleep_ms(0);
        produce(a->f, rec, size);
    }
    return NULL;
}

/* A producer, a consumer that drains at random and pauses, and the spill between them: every
 * record arrives once, in order, whole; the spill moved some during the long pause. */
static void test_spill_concurrent(void)
{
    fake_ring f;
    fake_init(&f, 2048, 12345 * 8);
    pc_spill *sp = NULL;
    CHECK(pc_spill_start(&sp, &f.ring, 1, 16 << 10, PC_NO_TRIM, 60, 0) == 0);
    producer_arg a = {&f, 6000, 99};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, producer, &a) == 0);
    unsigned char out[1024];
    uint64_t size, seed = 7;
    uint32_t seq = 0;
    int paused = 0;
    while (seq < a.n) {
        if (!paused && seq > a.n / 2) {
            sleep_ms(3 * PC_SPILL_MAX_SLEEP_MS); /* the ring fills: the spill must move it */
            paused = 1;
        } else if (rnd(&seed) % 64 == 0) {
            sleep_ms(1 + rnd(&seed) % 4);
        }
        size_t cap = 128 + rnd(&seed) % (sizeof(out) - 128);
        int64_t n = pc_drain_spill(sp, 0, out, cap, &size);
        CHECK(n >= 0 && (size_t)n <= cap && (uint64_t)n == size);
        check_seq(out, n, &seq);
    }
    CHECK(pthread_join(th, NULL) == 0);
    CHECK(pc_spill_pending(sp) == 0);
    pc_spill_stats st = spill_stats(sp);
    CHECK(st.records > 0 && st.held == 0 && st.held_max <= 16 << 10 && st.wakeups > 0);
    CHECK(f.ring.errors == 0);
    pc_spill_stop(sp);
    fake_free(&f);
}

int main(int argc, char **argv)
{
    int real = !(argc > 1 && !strcmp(argv[1], "--synthetic-only"));
    test_wrap();
    test_output_full();
    test_corrupt();
    test_multi();
    test_random();
    test_trim();
    test_spill_order();
    test_spill_concurrent();
    if (real)
        test_real_ring();
    printf("ok %d\n", checks);
    return 0;
}
