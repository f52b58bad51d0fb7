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
 * - No function allocates memory; the caller owns the pc_ring array and the output buffer.
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
