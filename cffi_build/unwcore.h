/* unwcore.h: the native CFI compiler (cfi_int.h: arch.c, ehframe.c, cfaprog.c, cfitable.c,
 * cfilookup.c) and unwinder (unwind.c) of unwindd._unwcore, and the helpers beside them:
 * symbol table scans (symtab.c), library calls (libcall.c), the cache files' checksum
 * (crc32c.c), the stack table's encoding (stackenc.c) and the side-band filter
 * (sideband.c). The pipeline context's interface is fastpath.h.
 *
 * This file is both the cffi cdef and the C header (see build_unwcore.py), so it includes
 * nothing and uses only fixed-width types and integer #defines.
 *
 * Invariants:
 * - A compiled table is ONE self-describing, position-independent blob (header + arrays below);
 *   Python keeps it as `bytes`, persists it verbatim and shares it between every address space
 *   that maps the binary. Nothing in it points anywhere.
 * - Every function that takes a blob validates it (unw_table_validate, O(rows)) or trusts it only
 *   because the caller validated it once (AddressSpace construction does).
 * - No function here allocates memory that outlives the call, except unw_cfi_compile's *out blob,
 *   released with unw_free.
 *
 * Blob layout (little-endian; all offsets from the blob start; read with memcpy, so the blob
 * needs no alignment):
 *
 *   struct unw_table_hdr                        UNW_HDR_SIZE bytes
 *   uint32_t page_first[npages + 1]             first row of each 64 KiB pc page
 *   uint16_t pc_lo[nrows]                       row pc = base + (page << 16) + pc_lo
 *   uint16_t or uint32_t rule_idx[nrows]        idx_width bytes each; index into rules[]
 *   (pad to 4)
 *   struct unw_rule rules[nrules]               56 bytes each, deduplicated
 *
 * Rows of page p are page_first[p] .. page_first[p+1]-1, pcs strictly ascending overall.
 * Row i covers [pc_i, pc_{i+1}); the last row is always a UNW_CFA_NONE row ("no CFI here"), so
 * lookups past the end find no rule. A row with the same rule as its predecessor is never
 * emitted, so a row costs 2 + idx_width bytes (idx_width 2 up to 65536 rules; real binaries
 * have hundreds), plus 4 bytes per 64 KiB of text.
 */

#define UNW_TABLE_MAGIC 0x54574e55 /* "UNWT" */
#define UNW_TABLE_VERSION 3 /* bumped with the layout; unw_table_validate refuses others */
#define UNW_HDR_SIZE 96
#define UNW_NSAVED 12         /* register columns a rule carries (aarch64: x19..x30)         */

#define UNW_ARCH_X86_64 1
#define UNW_ARCH_AARCH64 2

/* CFA rule kinds (unw_rule.cfa_kind) */
#define UNW_CFA_NONE 0        /* no FDE covers this pc: the unwinder uses frame pointers */
#define UNW_CFA_REG_OFF 1     /* CFA = reg + off                                          */
#define UNW_CFA_DEREF 2       /* CFA = *(reg + off)   (DW_OP_bregN off; DW_OP_deref)      */
#define UNW_CFA_PLT 3         /* CFA = rsp + off + ((rip & 15) >= reg ? 8 : 0)  (PLT)     */
#define UNW_CFA_SIGFRAME 4    /* signal frame: CFA = *(rsp + off), regs at rsp + k        */
#define UNW_CFA_UNSUPPORTED 5 /* any other expression / corrupt: the unwinder stops       */

/* Register rule kinds (unw_regrule.kind); DWARF 5 section 6.4.1 */
#define UNW_REG_SAME 0        /* same value (or the CIE said nothing)                     */
#define UNW_REG_UNDEF 1       /* undefined: for RA, the outermost frame                   */
#define UNW_REG_AT_CFA 2      /* offset(N): saved at CFA + off                            */
#define UNW_REG_VAL_CFA 3     /* val_offset(N): value is CFA + off                        */
#define UNW_REG_AT_REG 4      /* expression "DW_OP_bregR off": saved at R + off           */
#define UNW_REG_VAL_REG 5     /* val_expression "DW_OP_bregR off": value is R + off       */
#define UNW_REG_REGISTER 6    /* register(R): value is in R                               */
#define UNW_REG_UNSUPPORTED 7 /* other expressions                                        */

#define UNW_RULE_SIGNAL 1     /* unw_rule.flags: FDE's CIE had the 'S' augmentation        */

/* Error counters (unw_table_hdr.errors[]); names in cfi.py ERROR_NAMES, same order. */
#define UNW_ERR_BAD_CIE 0
#define UNW_ERR_BAD_FDE 1
#define UNW_ERR_BAD_OP 2          /* unknown or malformed DW_CFA opcode: FDE skipped       */
#define UNW_ERR_UNSUP_EXPR 3      /* an expression we do not evaluate (row kept, marked)   */
#define UNW_ERR_STATE_STACK 4     /* remember_state nesting too deep / restore w/o remember */
#define UNW_ERR_CAP 5             /* FDE/program/row/table size cap hit                    */
#define UNW_ERR_OVERLAP 6         /* FDE overlapping an earlier one: skipped               */
#define UNW_ERR_BAD_ENCODING 7    /* pointer encoding we cannot or may not decode          */
#define UNW_ERR_RANGE 8           /* offset/pc not representable in the packed row         */
#define UNW_ERR_BAD_HDR 9         /* .eh_frame_hdr unusable: fell back to a linear walk    */
#define UNW_ERR_ZERO_FDE 10       /* FDE with an empty pc range (counted, harmless)        */
#define UNW_NERR 16

struct unw_table_hdr {
    uint32_t magic;
    uint16_t version;
    uint8_t arch;
    uint8_t idx_width;
    uint32_t nrows;
    uint32_t nrules;
    uint64_t base;
    uint32_t nfdes;     /* FDEs that contributed rows */
    uint32_t npages;    /* 64 KiB pc pages spanned by the rows */
    uint32_t errors[UNW_NERR];
};

/* The rule of one register column. Slot i of unw_rule.regs is DWARF column UNW_SAVED_<arch>[i]:
 * x86_64 (System V AMD64 ABI 3.2.1 callee-saved + RA): rbp(6) RA(16) rbx(3) r12 r13 r14 r15;
 * aarch64 (AAPCS64 6.1.1): x29 x30 x19..x28. Slot 0 is always the frame pointer, slot 1 the
 * return address; unused slots stay UNW_REG_SAME with reg 0 off 0. */
struct unw_regrule {
    int16_t off;
    uint8_t kind;
    uint8_t reg;
};

#define UNW_SLOT_FP 0
#define UNW_SLOT_RA 1

struct unw_rule {
    int32_t cfa_off;
    uint8_t cfa_kind;
    uint8_t cfa_reg;    /* DWARF register number; for UNW_CFA_PLT, the DW_OP_lit threshold */
    uint8_t flags;
    uint8_t pad;
    struct unw_regrule regs[UNW_NSAVED];
};

/* Where the sections are inside the ELF image `buf` (file offsets and sizes bounded by the
 * caller to buf_len; re-checked here). size 0 = absent. addr = sh_addr (ELF vaddr). */
struct unw_sections {
    uint64_t eh_frame_off, eh_frame_size, eh_frame_addr;
    uint64_t eh_hdr_off, eh_hdr_size, eh_hdr_addr;
    uint64_t text_addr;
    /* data_addr: base for DW_EH_PE_datarel outside .eh_frame_hdr (GOT); 0 if unknown */
    uint64_t data_addr;
};

/* Compile eh_frame(+hdr) from img, then debug_frame (from dbg, which may be img) for pcs the
 * eh_frame does not cover. *out is a malloc'd blob of *out_len bytes (free with unw_free).
 * Returns 0, or -1 on allocation failure / no memory for caps (then *out is NULL).
 * Bad CFI never fails the call: it is counted in the blob's errors[].
 * Cost: O(E log E + R) time for E FDEs and R rows; memory O(R). */
int unw_cfi_compile(int arch,
                    const uint8_t *img, uint64_t img_len, const struct unw_sections *sec,
                    const uint8_t *debug_frame, uint64_t debug_frame_len,
                    uint8_t **out, uint64_t *out_len);
void unw_free(void *p);

/* 0 if blob is a well-formed table (header, sizes, sorted pcs, rule indices, rule kinds), else
 * a negative code naming the first problem. O(rows + rules). */
int unw_table_validate(const uint8_t *blob, uint64_t len);

/* Row lookup: *rule = the rule covering vaddr pc, *row_start = that row's pc; returns the row
 * index, or -1 if pc is below the first row. O(log rows). */
int64_t unw_table_lookup(const uint8_t *blob, uint64_t pc, struct unw_rule *rule,
                         uint64_t *row_start);

/* Decode row i (for tests/debugging). Returns 0, or -1 if i is out of range. */
int unw_table_row(const uint8_t *blob, uint32_t i, uint64_t *pc, struct unw_rule *rule);

/* A disk cache file (a CFI or symbol table, binaries/cachefiles.py) mapped read-only and
 * shared, so its pages are the file's page cache, not private memory: len bytes of fd from
 * offset 0, or NULL (errno set) when len is 0, cls is not one UNW_MAP_* class, or mmap
 * fails. The fd may be closed once this returns. Release with unw_unmap_file(p, len). The
 * class says which unw_mapped_release calls drop its pages: HOT for a table read at every
 * sample (CFI), COLD for one read when a frame is first named (symbols, lines). */
#define UNW_MAP_COLD 1
#define UNW_MAP_HOT 2
const uint8_t *unw_map_file(int fd, uint64_t len, uint32_t cls);
void unw_unmap_file(const uint8_t *p, uint64_t len);
/* Drop the pages of every live unw_map_file mapping of a class in the mask classes from the
 * process's page tables (MADV_DONTNEED): they stay in the page cache and a later read maps
 * them again (a minor fault). Returns the bytes of the mappings advised; *nfiles (if not
 * NULL) = those mappings. O(mappings) plus the kernel's O(resident pages); any thread. */
uint64_t unw_mapped_release(uint64_t *nfiles, uint32_t classes);
/* Drop the pages of the one live unw_map_file mapping that holds address q (as
 * unw_mapped_release does for all of them); returns its length, 0 if no live mapping holds q. */
uint64_t unw_mapped_release_one(const uint8_t *q);

/* ------------------------------------------------------------------ unwinder */

/* One executable mapping. [start,end) absolute; ELF vaddr = addr - bias. table NULL = no CFI
 * (frame pointers only). Arrays of these must be sorted by start and non-overlapping.
 * flags UNW_MOD_JIT: executable memory without a file (a JIT's code: V8, HotSpot), unwound by
 * frame pointer like any table-less module; its code belongs to one process, so frames in it
 * are never aggregated by code (stacks.c intern_frame) and key is unused. */
struct unw_module {
    uint64_t start, end, bias;
    const uint8_t *table;
    uint64_t key;
    uint64_t flags;
};

#define UNW_MOD_JIT 1

/* One sample. regs: nregs perf registers in ascending perf order for regs_mask (as the kernel
 * dumps them). stack: the user stack copy starting at the sampled sp. */
struct unw_item {
    const struct unw_module *mods;
    uint32_t nmods;
    uint32_t nregs;
    uint64_t regs_mask;
    const uint64_t *regs;
    const uint8_t *stack;
    uint64_t stack_len;
};

#define UNW_OK 0
#define UNW_TRUNCATED 1
#define UNW_NO_PROGRESS 2
#define UNW_DEPTH_CAP 3
#define UNW_UNMAPPED_PC 4
#define UNW_NO_CFI 5
#define UNW_BAD_CFI 6
#define UNW_NO_REGS 7

/* Per-frame kind bits (kinds[] of unw_unwind_batch, parallel to pcs[]). */
#define UNW_FRAME_SIGNAL 1    /* pc is in a signal trampoline (CFI 'S'): the NEXT frame's pc
                               * is the exact interrupted pc, not a return address          */
#define UNW_FRAME_FP 2        /* this frame's caller was found by the frame-pointer fallback */

/* Unwind n items. Item i writes up to max_depth pcs to pcs[i*max_depth ...] and their kind bits
 * to kinds[i*max_depth ...], the count to counts[i], the UNW_* status to status[i], the
 * frame-pointer fallback frames to fpwalk_frames[i] and the number of signal frames to
 * sig_frames[i] (so callers look at kinds[] only when it is non-zero).
 * Cost: O(n * max_depth * (log modules + log rows)); no allocation; never reads outside
 * [stack, stack + stack_len) of an item, nor outside validated tables. Returns 0 or -1 on bad
 * arguments (unknown arch, max_depth 0). */
int unw_unwind_batch(int arch, const struct unw_item *items, uint32_t n, uint32_t max_depth,
                     uint64_t *pcs, uint8_t *kinds, uint32_t *counts, uint8_t *status,
                     uint16_t *fpwalk_frames, uint16_t *sig_frames);

/* ------------------------------------------------------------------ symbols (symtab.c) */

/* secflags[] bits per section index */
#define UNW_SEC_ALLOC 1       /* SHF_ALLOC */
#define UNW_SEC_TEXT 2        /* the section name contains "text" */
#define UNW_SYM_UNDECIDED 2   /* unw_sym.keep: a duplicate group only demangled names decide */

/* One kept ELF symbol; name = st_name offset into the string table. 32 bytes. */
struct unw_sym {
    uint64_t start, end;
    uint32_t name, index;   /* index: position in the symbol table (perf's tie order) */
    uint8_t bind, keep;     /* keep: 1 survivor, 0 duplicate dropped, UNW_SYM_UNDECIDED */
    uint16_t pad;
    uint32_t pad2;
};

/* Kept function symbols of an Elf64_Sym array (nsyms entries at syms, bounded by the caller)
 * per perf's rules, sorted by (start, index), ends fixed, duplicates marked in keep; out has
 * room for nsyms. arm: drop ARM mapping symbols. Returns the count written. O(n log n). */
int64_t unw_symtab_scan(const uint8_t *syms, uint64_t nsyms, const uint8_t *strtab,
                        uint64_t strsz, const uint8_t *secflags, uint32_t nsec, int arm,
                        struct unw_sym *out, uint64_t *nundecided);

/* Drop every symbol whose keep != 1, in place, order kept; returns the new count. O(n). */
uint64_t unw_symtab_compact(struct unw_sym *syms, uint64_t n);

/* A stored table's name offsets checked in one pass (symstore.py): the largest of the n u32
 * values at offs other than skip (0 if none), and in *nskip how many equal skip. offs may be
 * unaligned (read with memcpy). O(n). */
uint32_t unw_symtab_max_offset(const uint8_t *offs, uint64_t n, uint32_t skip, uint64_t *nskip);

/* One /proc/kallsyms text symbol: name/module = byte ranges of the text (mod_len 0: kernel). */
struct unw_ksym {
    uint64_t addr, end;
    uint32_t name_off, mod_off;
    uint16_t name_len, mod_len;
    uint32_t line;
};

/* Text symbols (types t T w W) of kallsyms text, sorted by (addr, line), ends fixed as perf's
 * symbols__fixup_end(is_kallsyms=true); at most cap. Returns the count. O(len + n log n). */
int64_t unw_kallsyms_parse(const uint8_t *text, uint64_t len, struct unw_ksym *out,
                           uint64_t cap);

/* The names of syms[0, n) back to back into names (room: the text's length), each after its
 * length (a byte, or 255 and a little-endian u16), *names_len bytes in all; a name that is
 * "__pfx_" and the next symbol's name is stored empty. block_at[k] (k <= n / 16): where symbol
 * 16k's entry starts. The modules in runs of symbols: run r starts at symbol run_at[r] and is
 * of module run_mod[r] (an index among the distinct modules, whose text ranges go to
 * mods_off/mods_len[1, result); 0: no module), *nruns of them (at most n). Unless starts32 is
 * NULL, starts32[i] = addr - base (the caller checks the span fits). -1 when more than
 * mods_cap modules. */
int64_t unw_kallsyms_pack(const uint8_t *text, const struct unw_ksym *syms, uint64_t n,
                          uint8_t *names, uint64_t *names_len, uint32_t *block_at,
                          uint32_t *run_at, uint16_t *run_mod, uint64_t *nruns,
                          uint32_t *mods_off, uint16_t *mods_len, uint64_t mods_cap,
                          uint64_t base, uint32_t *starts32);

/* libcall.c: libstdc++'s __cxa_demangle of the NUL-terminated name into out[0, cap) (not
 * NUL-terminated): its length; -1 no libstdc++ (or no __cxa_demangle in it), -2 the name does
 * not demangle, -3 - n the result needs n bytes (cap was short). unw_malloc_trim: glibc's
 * malloc_trim(0) (none if dry), 0; -1 without glibc. */
int64_t unw_cxa_demangle(const char *name, char *out, uint64_t cap);
/* libcall.c: unw_iberty_open dlopens path and takes its cplus_demangle (once per process: later
 * calls only report), 0 if there is one, else -1. unw_iberty_demangle: cplus_demangle(name,
 * options) into out[0, cap) like unw_cxa_demangle (-1 no library opened, -2 no demangling,
 * -3 - n short cap). */
int unw_iberty_open(const char *path);
int64_t unw_iberty_demangle(const char *name, int options, char *out, uint64_t cap);
int unw_malloc_trim(int dry);

/* crc32c.c: CRC-32C (Castagnoli) of p[0, n), continuing crc (0 to start; the result of the
 * previous part to go on), as the disk cache files' checksum. The SSE4.2 instruction when the
 * CPU has it, else portable tables: the same value. unw_crc32c_portable: always the tables (for
 * tests). unw_crc32c_hw: 1 if unw_crc32c uses the instruction. */
uint32_t unw_crc32c(const uint8_t *p, uint64_t n, uint32_t crc);
uint32_t unw_crc32c_portable(const uint8_t *p, uint64_t n, uint32_t crc);
int unw_crc32c_hw(void);

/* ------------------------------------------------------------------ side-band (sideband.c) */

/* Mark the MMAP2 records among recs[idx[0..n)] (struct fp_rec, fastpath.h; data = the data
 * section of len bytes) that cannot change a replay's process table (non-executable, overlapping
 * no executable MMAP/MMAP2 range of the file, decodable without error): cand[r] = 1, pids[r] =
 * its pid, and its index entry gets time/cpu/flags from its sample_id trailer (sid_size bytes;
 * time at t_off and cpu at c_off inside it, -1 if absent). cand/pids are indexed by record
 * (zeroed by the caller). idx[0..*nrest) keeps the other records, in order.
 * Returns the number of candidates, -1 on allocation failure. O(n log n). */
int64_t unw_sb_scan(const uint8_t *data, uint64_t len, void *recs, uint32_t *idx,
                    uint64_t n, uint32_t sid_size, int32_t t_off, int32_t c_off,
                    uint8_t *cand, uint32_t *pids, uint64_t *nrest);

/* Remove from perm[0..m) (delivered order) every candidate but the first of each pid, which
 * gets cand = 2 and is listed in kept[0..*nkept); the cpu field of each removed one goes to
 * skipped_cpus (room for ncand). Returns the new length, or UINT64_MAX on allocation failure.
 * O(m). */
uint64_t unw_sb_compact(uint32_t *perm, uint64_t m, uint8_t *cand, const uint32_t *pids,
                        uint64_t ncand, const void *recs, uint32_t *kept, uint64_t *nkept,
                        uint32_t *skipped_cpus);

/* Of idx[0..n) (records of data, a data section of len bytes; sample_id trailer as in
 * unw_sb_scan), every MMAP2 that decodes without error or repair (not flagged
 * PERF_RECORD_MISC_MMAP_BUILD_ID, body >= 64 + sid_size bytes) is listed in lazy (room for
 * n), in idx order, and its index entry gets time/cpu/flags from its trailer.
 * idx[0..*nrest) keeps the other records, in order. Returns how many were listed. O(n). */
int64_t unw_sb_lazy(const uint8_t *data, uint64_t len, void *recs, uint32_t *idx, uint64_t n,
                    uint32_t sid_size, int32_t t_off, int32_t c_off, uint32_t *lazy,
                    uint64_t *nrest);

/* Drop from perm[0..m) (delivered order; recs, data, len and sid_size as in unw_sb_lazy)
 * every side-band record no sample's address space or comm depends on (sideband.c states the
 * rule and its proof): MMAP/MMAP2/COMM/FORK of processes and threads no later sample reads,
 * through FORK ancestry included, and every EXIT. perm keeps the rest, in order. counts
 * (UNW_SB_NCOUNTS) gets the dropped records by what ProcessTable.apply would count them as
 * (UNW_SB_COMM: a COMM it counts nothing for). Nothing is dropped from a file that maps a
 * jitdump. Returns the new length, -1 on allocation failure. O(m). */
#define UNW_SB_MMAP2 0
#define UNW_SB_MMAP 1
#define UNW_SB_FORK 2
#define UNW_SB_EXIT 3
#define UNW_SB_EXEC 4
#define UNW_SB_COMM 5
#define UNW_SB_NCOUNTS 6
int64_t unw_sb_unsampled(const uint8_t *data, uint64_t len, const void *recs, uint32_t *perm,
                         uint64_t m, uint32_t sid_size, uint64_t *counts);

/* Drop from perm[0..m) (as in unw_sb_unsampled) every data MMAP2 (decoding without error)
 * of a pid whose space exists and has no executable mapping it overlaps, at its place in the
 * order: ProcessTable.apply would change nothing (sideband.c follows each pid's executable
 * ranges to tell). perm keeps the rest, in order. Returns the new length, -1 on allocation
 * failure, UNW_SB_UNTOUCHED (perm as it was) for a file that maps a jitdump or a range past
 * 2^64. O(m + changed ranges). */
#define UNW_SB_UNTOUCHED -2
int64_t unw_sb_noop_mmaps(const uint8_t *data, uint64_t len, const void *recs, uint32_t *perm,
                          uint64_t m, uint32_t sid_size);

/* Of idx[0..n) (as in unw_sb_lazy), every EXIT that decodes without error (body >= 24 +
 * sid_size bytes) is listed in lazy (room for n), in idx order, its index entry marked as
 * context.record_marks marks its value (the body's time; the trailer's cpu). idx[0..*nrest)
 * keeps the other records, in order. Returns how many were listed. O(n). */
int64_t unw_sb_lazy_exits(const uint8_t *data, uint64_t len, void *recs, uint32_t *idx,
                          uint64_t n, uint32_t sid_size, int32_t t_off, int32_t c_off,
                          uint32_t *lazy, uint64_t *nrest);

/* The live step's side-band records (ringstep.py _decode_others): every entry of recs[0..n)
 * (struct fp_rec, fastpath.h) not flagged FP_SAMPLE, in index order, as one row of rows
 * (room for 5 n): (index, type, misc, off, size). Returns the number of rows. O(n). */
uint64_t unw_sb_rows(const void *recs, uint64_t n, uint64_t *rows);

/* context.mark_record for each recs[idx[j]], j < k: marks[3 j..3 j + 3) = (time, cpu,
 * flags); time and cpu written only where flags has FP_TIMED / FP_HAS_CPU. O(k). */
void unw_sb_marks(void *recs, const uint32_t *idx, const uint64_t *marks, uint64_t k);

/* context.mark_record of each side-band entry recs[idx[j]], j < k, of data (len bytes) whose
 * decoded value RecordDecoder gives without the body's help beyond fixed offsets: a MMAP2 not
 * flagged PERF_RECORD_MISC_MMAP_BUILD_ID (10), a COMM (3): time and cpu of its sample_id
 * trailer (sid_size bytes at its end; t_off, c_off its time and cpu offsets, < 0 when
 * absent); a FORK (7) or EXIT (4): the time of its body, always set, and the trailer's cpu;
 * each too short for its fixed part and trailer gets flags 0 (its BadRecord's). Any other
 * entry is left as it is (the caller marks it) and listed in rest (room for k). Returns how
 * many were left. O(k). */
uint64_t unw_sb_trailer_marks(const uint8_t *data, uint64_t len, void *recs, const uint32_t *idx,
                              uint64_t k, uint32_t sid_size, int32_t t_off, int32_t c_off,
                              uint32_t *rest);

/* The positions in keep[0..nkeep) (distinct record indices < n) of want[0..k) (each in keep):
 * out[t] = the j with keep[j] == want[t]; inv: scratch of n entries. O(nkeep + k). */
void unw_sb_slots(const uint32_t *keep, uint64_t nkeep, const uint32_t *want, uint64_t k,
                  uint32_t *inv, uint32_t *out);

/* ------------------------------------------------------------------ source lines (dwarfline.c) */

/* A compiled line/inline table (layout at the top of dwarfline.c; srclines.py reads it). */
#define UNW_SL_MAGIC 0x4c535755 /* "UWSL" */
#define UNW_SL_VERSION 2
#define UNW_SL_NONE 0xffffffff    /* no file / no node / no name */
#define UNW_SL_MAX_ROWS 268435456
#define UNW_SL_SUBPROGRAM 1      /* node kinds */
#define UNW_SL_INLINED 2 /* rows, segments, nodes (and array bytes) of one table */

/* Error counters (unw_srcline_hdr.errors[]); names in srclines.py ERROR_NAMES, same order. */
#define UNW_SL_ERR_UNIT 0         /* bad unit header: that unit (or, for its length, the rest) */
#define UNW_SL_ERR_ABBREV 1       /* bad abbreviation table: its units skipped                */
#define UNW_SL_ERR_DIE 2          /* unreadable DIE (unknown form, bad code, too deep)        */
#define UNW_SL_ERR_LINE 3         /* bad line program header or opcode                        */
#define UNW_SL_ERR_RANGES 4       /* bad DW_AT_ranges list                                     */
#define UNW_SL_ERR_REF 5          /* origin reference out of range, cyclic or too long         */
#define UNW_SL_ERR_CAP 6          /* a size cap hit                                            */
#define UNW_SL_NERR 8

struct unw_srcline_hdr {
    uint32_t magic;
    uint16_t version;
    uint16_t pad;
    uint32_t nlines, nsegs, nnodes, nfiles, strtab_len;
    uint32_t errors[UNW_SL_NERR];
    uint32_t pad2;
};

/* The DWARF sections of one binary or its debug file, inflated (NULL/0 = absent). */
struct unw_dwarf_sections {
    const uint8_t *info; uint64_t info_len;
    const uint8_t *abbrev; uint64_t abbrev_len;
    const uint8_t *line; uint64_t line_len;
    const uint8_t *str; uint64_t str_len;
    const uint8_t *line_str; uint64_t line_str_len;
    const uint8_t *str_offsets; uint64_t str_offsets_len;
    const uint8_t *addr; uint64_t addr_len;
    const uint8_t *ranges; uint64_t ranges_len;
    const uint8_t *rnglists; uint64_t rnglists_len;
};

/* Compile the sections into a table: *out is malloc'd (unw_free), *out_len bytes. Returns 0,
 * or -1 on allocation failure (*out NULL). Bad DWARF never fails the call: it is counted in
 * the header's errors[]. Cost: O(input + R log R) for R line rows and inline ranges. */
int unw_srcline_compile(const struct unw_dwarf_sections *s, uint8_t **out, uint64_t *out_len);

/* ------------------------------------------------------------------ CPython frames (pywalk.c) */

/* Where each field the walk reads sits in one interpreter version's structs (byte offsets),
 * filled field by field from procs/pyframes.py's Layout of the same names (no offset is
 * spelled in C). ts_cframe -1: current_frame is in the thread state (3.13); frame_is_entry
 * -1: no is_entry byte (3.12+: shim frames end segments). */
struct unw_py_layout {
    uint64_t interpreters_head, interp_next, interp_threads_head;
    uint64_t ts_next, ts_native_thread_id;
    int64_t ts_cframe;
    uint64_t current_frame;
    uint64_t frame_code, frame_previous, frame_instr, frame_owner;
    int64_t frame_is_entry;
    uint64_t code_filename, code_qualname, code_firstlineno, code_linetable;
    uint64_t frame_bytes, code_bytes;
};

/* Walk results (unw_py_job.status); procs/pywalk.py maps them to pyframes.FAILURES. */
#define UNW_PY_OK 0
#define UNW_PY_GONE 1        /* ESRCH: the process exited                                */
#define UNW_PY_DENIED 2      /* EPERM                                                    */
#define UNW_PY_MOVED 3       /* an address that does not read, a cycle, a null code       */
#define UNW_PY_TOO_DEEP 4    /* more than max_frames frames, or the records ran out       */
#define UNW_PY_NO_THREAD 5   /* no thread state has that native thread id                 */

#define UNW_PY_MAX_FRAMES 4096   /* max_frames is capped to this                          */
#define UNW_PY_MAX_THREADS 4096  /* thread states visited looking for a tid               */
#define UNW_PY_SCRATCH 262144    /* bytes of the caller's scratch buffer (unw_py_walk)      */

/* unw_py_rec.flags */
#define UNW_PY_ENTRY 1       /* 3.11: this frame is_entry: its segment ends after it       */
#define UNW_PY_SHIM 2        /* 3.12+: a FRAME_OWNED_BY_CSTACK shim: a segment ends here   */

/* One interpreter frame, innermost first: its code object's address and the header fields
 * the Python side keys and decodes its cache of code objects by (pyframes.Interpreter), and
 * the raw instruction pointer. A shim record has code 0 and nothing else. */
struct unw_py_rec {
    uint64_t code, instr, qualname, filename, linetable;
    uint32_t firstlineno, flags;
};

/* One thread to walk. In: lay, pid, tid, runtime (_PyRuntime's address), tstate (a thread
 * state that had this tid, or 0), max_frames, not_before (CLOCK_MONOTONIC ns: the walk
 * sleeps until then; 0 none). Out: tstate (the one found; 0 after UNW_PY_NO_THREAD), records
 * [first, first + count) of recs, status, syscalls made, t_ns (CLOCK_MONOTONIC midpoint of
 * the walk). */
struct unw_py_job {
    const struct unw_py_layout *lay;
    uint64_t runtime, tstate, not_before;
    int32_t pid, tid;
    uint32_t max_frames;
    uint32_t first, count;
    int32_t status;
    uint32_t syscalls;
    uint64_t t_ns;
};

/* A batch's progress, shared with other threads: done, the jobs finished (stored with release
 * order after each job: their results and records are complete), and stop, set by another
 * thread (unw_py_stop) to end the batch before its next job. */
struct unw_py_sync {
    uint32_t done, stop;
};

/* Walk each job's frame chain (in order) with process_vm_readv(2), never trusting the target:
 * every address is read through the kernel, a cycle, an unreadable address or more than
 * max_frames frames end that job with a status. scratch: UNW_PY_SCRATCH bytes of the
 * caller's, 8-aligned. sync (or NULL): see struct unw_py_sync; a stopped batch leaves the jobs
 * from sync->done on untouched. Returns the records used in all, or -1 for bad arguments.
 * Cost per job: about 4 syscalls whatever the depth (thread state, cframe, a window of the
 * frame stack, the code headers in one batch) plus one per frame outside the windows; no
 * allocation. */
int64_t unw_py_walk(struct unw_py_job *jobs, uint32_t n, struct unw_py_rec *recs,
                    uint64_t cap, uint8_t *scratch, uint64_t scratch_len,
                    struct unw_py_sync *sync);
/* sync->done, loaded with acquire order: jobs [0, it) and their records are complete. */
uint32_t unw_py_progress(const struct unw_py_sync *sync);
/* Ask the batch of sync to end before its next job (release order). */
void unw_py_stop(struct unw_py_sync *sync);

/* The calling thread's fair-class slice set to slice_ns (sched_setattr(2) sched_runtime of a
 * SCHED_OTHER/SCHED_BATCH thread; the kernel clamps it to 0.1-100 ms), policy and nice kept:
 * under EEVDF (Linux >= 6.6; custom slices since 6.12) a shorter slice means an earlier
 * virtual deadline, so the thread's wakeups run sooner, with the same share of CPU. 0, or
 * -errno (a kernel without custom slices accepts and ignores it). */
int unw_py_short_slice(uint64_t slice_ns);

/* -------------------------------------------------------- stack table encoding (stackenc.c) */

#define UNW_ST_WORDS 4          /* u64 words a code slot takes (store/codeslots.py) */
#define UNW_ST_HAS_REL 1        /* slot flags (word 0 >> 32): the frame has a rel */
#define UNW_ST_NO_DELTA 255     /* stacktable.NO_DELTA: a frame keyed with its ip */
#define UNW_ST_KEYED 0x80000000 /* miss entry: a frame keyed as its slot's frame, unresolved */
#define UNW_ST_MAX_FRAMES 0x7FFFFFFF

/* A CodeStack of n frames (their code slots slots[i], in words[0, UNW_ST_WORDS * nslots), and
 * ips[i]) as stacktable._encode_at encodes it: delta index di[i] per frame, the distinct
 * deltas in deltas[0, *nd) (room for UNW_ST_NO_DELTA), fids[i] each frame's id where its slot
 * resolves it (still live: uids[fid] is the slot's serial, fid < nuids), else 0 and i (with
 * UNW_ST_KEYED where the caller may resolve the slot) in miss[]. Returns the misses, -1 for
 * a slot out of range or n past UNW_ST_MAX_FRAMES. */
int64_t unw_st_resolve(uint64_t n, const int32_t *slots, uint64_t nslots, const uint64_t *words,
                       const uint64_t *ips, const uint64_t *uids, uint64_t nuids, uint32_t *fids,
                       uint8_t *di, int64_t *deltas, uint32_t *nd, uint32_t *miss);
/* The stack's bytes (stacktable._pack) into out (room for 6 + 13 n); their length. */
uint64_t unw_st_pack(uint64_t n, const uint32_t *fids, const int64_t *deltas, uint32_t nd,
                     const uint8_t *di, uint8_t *out);
/* frefs[fid] += 1 for each frame id of the stack bytes enc[0, len); its frames, or -1 (nothing
 * changed) for bytes too short or an id past nfrefs. */
int64_t unw_st_hold(const uint8_t *enc, uint64_t len, uint32_t *frefs, uint64_t nfrefs);
