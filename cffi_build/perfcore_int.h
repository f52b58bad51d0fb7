/* What perfcore.c shares with ringspill.c and nothing else: the one copy of whole records out
 * of a ring, and the ring's control-page loads. Not part of the cffi interface. */
#ifndef UNWINDD_PERFCORE_INT_H
#define UNWINDD_PERFCORE_INT_H

/* perfcore.h first: it has no include guard (cffi's cdef parser takes it verbatim) */

/* Copy whole records from ring r into out[0, cap), SAMPLEs cut as pc_drain_trim says unless
 * nregs is PC_NO_TRIM; advances the ring's tail past them. Returns bytes written. The caller
 * is the ring's only consumer while it runs. */
size_t pc__drain_ring(pc_ring *r, unsigned char *out, size_t cap, uint32_t nregs);
/* A ring pc_drain may read: mapped (or synthetic) with a power-of-two data area. */
int pc__ring_usable(const pc_ring *r);
/* The kernel's data_head (acquire) and our data_tail. */
uint64_t pc__ring_head(const pc_ring *r);
uint64_t pc__ring_tail(const pc_ring *r);

#endif
