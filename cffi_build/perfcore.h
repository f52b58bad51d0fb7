/* unwindd native perf core: perf_event_open, ring mmap, batched ring drain.
 *
 * This header is BOTH the C interface of perfcore.c AND the cffi cdef (build_perfcore.py feeds it
 * to ffibuilder.cdef verbatim), so it must stay inside the C subset cffi's parser accepts: no
 * #include, no #ifdef, no function-like macros, no kernel types; only integer #defines, plain
 * structs and prototypes. Everything kernel-specific (struct perf_event_attr,
 * struct perf_event_mmap_page, atomics) lives in perfcore.c.
 *
 * Invariants:
 * - Every function that can fail returns -errno (never sets errno for the caller to read).
 * - pc_drain copies only whole records, and only ever advances data_tail over bytes it copied or
 *   over a range it declared corrupt (counted in pc_ring.errors). It terminates in
 *   O(bytes available + number of rings): each step advances tail by >= 8 or leaves the ring.
 * - No function but the spill's allocates memory; the caller owns the pc_ring array and the
 *   output buffer.
 */

#define PC_MAX_STACK_USER 65528
#define PC_MAX_RECORD 65535

/* What perf_event_open's attr is built from (see pc_fill_attr in perfcore.c for the rest of the
 * attr, which is fixed policy: sample_type, sample_id_all, clockid, exclude_callchain_user ...). */
typedef struct {
    uint32_t type;              /* PERF_TYPE_SOFTWARE ... */
    uint64_t config;            /* PERF_COUNT_SW_CPU_CLOCK ... */
    uint64_t sample_freq;       /* Hz; used when sample_period == 0 */
    uint64_t sample_period;     /* events per sample; 0 = use sample_freq */
    uint64_t sample_regs_user;  /* 0 = no PERF_SAMPLE_REGS_USER */
    uint32_t sample_stack_user; /* 0 = no PERF_SAMPLE_STACK_USER; multiple of 8, <= 65528 */
    uint32_t wakeup_watermark;  /* bytes of ring fill that wake poll(); 0 = one per sample */
    int sideband;               /* mmap/mmap2/comm/comm_exec/task on this event */
    int build_id;               /* ask for attr.build_id (only with sideband) */
    int inherit;                /* attr.inherit: follow future children of the task */
    int user_only;              /* exclude_kernel, exclude_hv, exclude_callchain_kernel */
    int enable_on_exec;         /* attr.enable_on_exec: the kernel enables it at the next exec */
} pc_attr_config;

/* One mmap'd perf ring. `meta` is the struct perf_event_mmap_page (first page of the mapping);
 * `data` is the data area, `data_size` bytes, a power of two. A synthetic ring (tests) points
 * meta/data at ordinary memory and has map_size == 0. */
typedef struct {
    void *meta;
    unsigned char *data;
    uint64_t data_size;
    size_t map_size;
    int fd;
    int cpu;
    uint64_t errors;   /* corrupt headers seen; each one resynchronised tail to head */
    uint64_t records;  /* whole records copied out, ever */
    uint64_t bytes;    /* bytes copied out, ever */
} pc_ring;

/* The sample_type pc_open will request for this config. */
uint64_t pc_sample_type(const pc_attr_config *cfg);

/* The struct perf_event_attr pc_open would pass for cfg (build_id as asked), written to
 * out[0, cap): returns its size (attr.size), or -EINVAL if cap is smaller. Tests read it. */
int pc_build_attr(const pc_attr_config *cfg, unsigned char *out, size_t cap);

/* perf_event_open(attr built from cfg, pid, cpu, group_fd, flags) then, on success, the fd.
 * If cfg asks for build_id and the kernel says EINVAL, retries once without it; *build_id_granted
 * (may be NULL) tells which form was opened. The event is opened disabled. Returns fd or -errno. */
int pc_open(const pc_attr_config *cfg, int pid, int cpu, int group_fd, unsigned long flags,
            int *build_id_granted);

/* PERF_EVENT_IOC_SET_OUTPUT: send fd's records into target_fd's ring. 0 or -errno. */
int pc_set_output(int fd, int target_fd);
int pc_enable(int fd);
int pc_disable(int fd);
int pc_close(int fd);

/* mmap 1 + data_pages pages of fd (data_pages a power of two) and fill *ring. 0 or -errno. */
int pc_ring_map(pc_ring *ring, int fd, int cpu, uint32_t data_pages);
/* munmap (if mapped) and clear the pointers; the fd is not closed. Idempotent. */
void pc_ring_unmap(pc_ring *ring);

/* Bytes the kernel has published and we have not consumed yet (head - tail), or 0. */
uint64_t pc_ring_pending(const pc_ring *ring);
/* pc_ring_pending summed over rings[0, n): what one pc_drain would copy at most, O(n). */
uint64_t pc_pending_total(const pc_ring *rings, size_t nrings);

/* Drain every ring, visiting rings[start % n], rings[(start+1) % n], ... once each, into `out`
 * back to back, in visiting order. sizes[i] receives the byte count copied from rings[i] (0 if
 * none). A ring's copy stops at the last whole record that fits; the rest stays in the ring.
 * Returns the total bytes written to out (<= out_cap), or -EINVAL on bad arguments. */
int64_t pc_drain(pc_ring *rings, size_t nrings, size_t start, unsigned char *out, size_t out_cap,
                 uint64_t *sizes);

/* pc_drain, and each SAMPLE record of pc_sample_type's layout with REGS_USER (nregs registers)
 * and STACK_USER is written with its user stack copy cut to dyn_size rounded up to 8: the
 * kernel always reserves the requested size, but only dyn_size bytes hold the stack (often a
 * small part of it), and every later copy and read of the record pays for the rest. The cut
 * record decodes the same except for its size fields (stack size = the kept bytes). A record
 * that does not parse as that layout is copied whole (its decoder judges it). Only the kept
 * bytes are copied out of the ring. nregs PC_NO_TRIM: pc_drain. */
#define PC_NO_TRIM 0xFFFFFFFFu
/* The nregs pc_drain_trim needs for records of this sample_type and user regs mask (one of
 * pc_open's layouts with REGS_USER and STACK_USER), else PC_NO_TRIM. */
uint32_t pc_trim_nregs(uint64_t sample_type, uint64_t regs_mask);
int64_t pc_drain_trim(pc_ring *rings, size_t nrings, size_t start, unsigned char *out,
                      size_t out_cap, uint64_t *sizes, uint32_t nregs);

/* The same cut applied in place to buf[0, len) holding whole records back to back (tests and
 * captured drains): returns the new length, records compacted to the front. */
size_t pc_trim_records(unsigned char *buf, size_t len, uint32_t nregs);

/* The spill (ringspill.c): a thread of its own that moves records out of a ring the caller has
 * left more than high_pct percent full into memory it holds (cut as pc_drain_trim with nregs
 * cuts them), so that a consumer held up for longer than a ring's worth of samples (a slow
 * round, the GIL, a busy machine's run queue) loses nothing while the spill has room. The
 * kernel drops records only when a ring is full (PERF_RECORD_LOST): with a spill, only when
 * the ring is full and the spill holds cap_bytes too.
 * - Each ring is read by one side at a time (a lock per ring), and pc_drain_spill hands out a
 *   ring's spilled records before anything still in the ring, so each ring's records leave
 *   in the order the kernel wrote them, whole, exactly once, and pc_drain's round rule holds.
 * - The thread wakes when the fastest-filling ring could reach high_pct (at the rate it filled
 *   since the last wake), at least every max_sleep_us (0: PC_SPILL_MAX_SLEEP_MS; the caller
 *   passes the time a ring takes to get there at the most its events can write, so a burst
 *   after a quiet spell is seen in time) and at most every PC_SPILL_MIN_SLEEP_MS; each wake
 *   is O(rings) loads of the control pages, plus the copy of what it spills. No syscall but
 *   its sleep.
 * - Memory: at most cap_bytes held over all rings, allocated as a ring needs it and freed
 *   when pc_drain_spill has taken it all; none while every ring is drained in time. */
#define PC_SPILL_MIN_SLEEP_MS 2
#define PC_SPILL_MAX_SLEEP_MS 100
typedef struct pc_spill pc_spill;
typedef struct {
    uint64_t records;   /* records moved from the rings into the spill, ever */
    uint64_t bytes;     /* bytes moved (as cut) */
    uint64_t held;      /* bytes held now */
    uint64_t held_max;  /* the most held at once */
    uint64_t full;      /* spills that left records in a ring for want of room (cap_bytes) */
    uint64_t wakeups;   /* the thread's wakeups */
} pc_spill_stats;

/* Start the spill's thread over rings[0, nrings), which must stay mapped (and the array in
 * place) until pc_spill_stop. *out receives it. 0, -EINVAL (bad arguments, high_pct not in
 * 1..99), -ENOMEM, or pthread_create's error. */
int pc_spill_start(pc_spill **out, pc_ring *rings, size_t nrings, uint64_t cap_bytes,
                   uint32_t nregs, uint32_t high_pct, uint32_t max_sleep_us);
/* Stop and join the thread, free everything (records still held are dropped: drain first). */
void pc_spill_stop(pc_spill *sp);
/* pc_drain_trim over the spill's rings and nregs, each ring's spilled records first. */
int64_t pc_drain_spill(pc_spill *sp, size_t start, unsigned char *out, size_t out_cap,
                       uint64_t *sizes);
/* Bytes the rings and the spill hold together: what pc_drain_spill copies at most. */
uint64_t pc_spill_pending(pc_spill *sp);
void pc_spill_get_stats(pc_spill *sp, pc_spill_stats *st);
