/* mapfile.c: fill the page tables of a read-only file mapping before its first reads
 * (daemon/unwindd/source/mapfile.py: the perf.data file a replay reads in place).
 *
 * Why a function of its own: a replay reads every page of the file (fp_index the record
 * headers, the unwinder the stack copies), and one batch of page-table fills costs less than
 * taking the faults one by one. MAP_POPULATE does the batch inside mmap(2), on the calling
 * thread and, in CPython's mmap module, with the GIL held, O(pages) of kernel time; called
 * from a Python thread through cffi (which releases the GIL) it runs while the replay imports
 * its modules and parses the file header.
 *
 * Invariants: reads [p, p + len) only, writes nothing; p must be the start of a mapping of at
 * least len bytes that stays mapped for the whole call (mapfile.py joins this call's thread
 * before unmapping).
 * Cost: one madvise(MADV_POPULATE_READ) (Linux >= 5.14); where that fails (older kernels),
 * one read per page, each fault also mapping its cached neighbours (fault-around).
 */
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include "unwcore.h"
#include "fastpath.h"

int fp_prefault(const uint8_t *p, uint64_t len)
{
    long pg = sysconf(_SC_PAGESIZE);
    if (!p || !len || pg <= 0)
        return -1;
#ifdef MADV_POPULATE_READ
    if (((uintptr_t)p & (uintptr_t)(pg - 1)) == 0 &&
        madvise((void *)(uintptr_t)p, (size_t)len, MADV_POPULATE_READ) == 0)
        return 0;
#endif
    for (uint64_t o = 0; o < len; o += (uint64_t)pg)
        (void)*(const volatile uint8_t *)(p + o); /* volatile: the load is kept */
    return 1;
}
