"""The daemon's C heap (glibc malloc): few arenas, free pages handed back, and what it holds;
and the mapped cache tables' pages dropped from its page tables, at every trim and more often.

The daemon's threads (query worker, CFI compiler, Python frame reader, the native unwind
worker) each get a malloc arena of their own by default (glibc malloc/arena.c: up to
8 x cores, each a 64 MiB reserved heap); memory a thread allocated and the loop freed stays in
that thread's arena, and free chunks in the middle of an arena stay resident until
``malloc_trim`` returns their pages (malloc/malloc.c mtrim: MADV_DONTNEED on whole free pages
of every arena). Under process churn the freed-but-resident part was most of the daemon's RSS.
The mapped symbol, line and CFI tables (binaries/cachefiles.py) are file pages: each was read
whole by its load checks, and stayed in the RSS though lookups read a small part of it; each
trim, and every ``release_interval`` (0.1 s) between trims, drops them from the page tables
(``cachefiles.release_mapped``), the page cache keeps them, and lookups map back what they read.
Each lookup's first read of a page maps the cached pages around it too (mm/memory.c
do_fault_around: ``fault_around_bytes``, 64 KiB; MADV_RANDOM does not turn it off), so under
process churn the naming of new frames put most of a big line table back within a second;
one madvise per mapped table (a walk of what it has mapped) is cheap enough to run at the
drain tick's pace. The CFI tables are the exception (mapped ``hot``): the unwind of every
sample reads the same few pages of them, which a release at that pace would only make it
fault back; they are released every ``hot_release_interval`` (1 s).
glibc raises its mmap threshold each time a block it mmapped is freed (malloc.c free: up to
32 MiB, the trim threshold to twice that), so once one big answer body or temporary is freed
the next ones of that size come from the arenas, and the space they free stays resident until
a trim and is split by small blocks meanwhile; ``limit_arenas`` fixes the threshold at
glibc's default (``MMAP_THRESHOLD``; a value set with mallopt turns the adjustment off), so a
block that large is a mapping of its own, returned at its free.

Invariants:
- ``limit_arenas`` runs before the daemon starts a thread (mallopt M_ARENA_MAX only bounds
  arenas created after it; the fixed mmap threshold holds for every arena); ``Trimmer.maybe``
  runs on the loop thread only.
- Without glibc (musl, another libc) every malloc function here is a no-op and ``stats`` is
  None: the daemon runs the same, only without these bounds (the tables are still released).
Cost: ``Trimmer.maybe`` O(1) except at most once per ``interval`` s, when malloc_trim walks
every arena's free chunks (O(free chunks), ~10-100 ms at a few hundred MiB) and, with
``code``, ``CodePages.release`` runs (codepages.py: one /proc/self/maps read, one madvise per
clean mapping), and at most once per ``release_interval`` s, when one madvise per mapped
table runs (O(tables + their resident pages)); ``stats`` walks the same (mallinfo2), so
/v1/status and the metrics read it at most once per call.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

from ..binaries.cachefiles import release_mapped
from ..lightdc import dataclass
from .codepages import CodePages

__all__ = ["ARENA_MAX", "MMAP_THRESHOLD", "HeapStats", "Trimmer", "limit_arenas", "stats"]

# The loop thread's main arena plus one the other threads share: enough that the query worker
# and the CFI compiler rarely wait for a lock held by the loop, without one heap per thread.
ARENA_MAX = 2
# glibc's DEFAULT_MMAP_THRESHOLD_MIN: blocks from this size up are mmapped on their own
MMAP_THRESHOLD = 128 << 10
_M_MMAP_THRESHOLD = -3  # glibc malloc.h
_M_ARENA_MAX = -8


class _Mallinfo2(ctypes.Structure):
    # glibc malloc/malloc.h struct mallinfo2 (glibc >= 2.33)
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                              "usmblks", "fsmblks", "uordblks", "fordblks",
                                              "keepcost")]  # fmt: skip


_FUNCS = ("mallopt", "malloc_trim", "mallinfo2")


def _libc() -> Any:
    # The process's own symbols first (dlopen(NULL): the interpreter links the C library),
    # so importing this module runs nothing; find_library (which runs ldconfig -p, or gcc)
    # only when they lack these functions.
    libc = ctypes.CDLL(None)
    if not all(hasattr(libc, f) for f in _FUNCS):
        from ctypes.util import find_library

        try:
            libc = ctypes.CDLL(find_library("c") or "libc.so.6")
        except OSError:
            return None
    if not all(hasattr(libc, f) for f in _FUNCS):
        return None  # not glibc, or one too old for mallinfo2
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


_LIBC = _libc()


def limit_arenas(n: int = ARENA_MAX, mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """At most ``n`` malloc arenas from now on, and blocks of ``mmap_threshold`` bytes or more
    mmapped on their own whatever was freed before (the module doc); False without glibc."""
    if _LIBC is None:
        return False
    fixed = bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, mmap_threshold))
    return bool(_LIBC.mallopt(_M_ARENA_MAX, n)) and fixed


@dataclass
class HeapStats:
    """mallinfo2's totals over all arenas: bytes the arenas hold from the system (``arena``,
    sbrk'd and mmap'd heaps), of them in use by allocations (``in_use``) and free (``free``),
    and big allocations mmap'd on their own (``mapped``)."""

    arena: int
    in_use: int
    free: int
    mapped: int

    def to_json(self) -> dict[str, int]:
        return {"arena_bytes": self.arena, "in_use_bytes": self.in_use,
                "free_bytes": self.free, "mapped_bytes": self.mapped}  # fmt: skip


def stats() -> HeapStats | None:
    if _LIBC is None:
        return None
    mi = _LIBC.mallinfo2()
    return HeapStats(int(mi.arena), int(mi.uordblks), int(mi.fordblks), int(mi.hblkhd))


@dataclass
class Trimmer:
    """Hands the arenas' free pages back to the kernel (malloc_trim(0)) at most every
    ``interval`` seconds (a query's temporaries, freed, stay resident until then), and drops
    the mapped cache tables' pages from the page tables (``cachefiles.release_mapped``) at
    most every ``release_interval`` seconds: a lookup's read fault maps the page-cache pages
    around it too (mm/memory.c do_fault_around), so the tables' share of the RSS is what the
    lookups of one such period touched; the tables mapped hot (CFI, read by every sample's
    unwind) only every ``hot_release_interval`` seconds; with ``code``, the clean pages of the
    daemon's own code at each trim (codepages.py). Counts trims and the seconds of trims and
    releases (for the metrics), and the tables (``mapped_tables``) and their bytes
    (``mapped_bytes``) the last release advised."""

    interval: float = 2.0
    release_interval: float = 0.1
    hot_release_interval: float = 1.0
    trims: int = 0
    seconds: float = 0.0
    mapped_tables: int = 0
    mapped_bytes: int = 0
    _last: float = 0.0
    _last_release: float = 0.0
    _last_hot: float = 0.0
    code: CodePages | None = None

    def due(self, now: float) -> bool:
        """Whether ``maybe(now)`` would trim or release the tables."""
        return (now - self._last >= self.interval
                or now - self._last_release >= self.release_interval)  # fmt: skip

    def maybe(self, now: float | None = None) -> bool:
        """Trim and release when each is due; True if it trimmed."""
        now = time.monotonic() if now is None else now
        trim = now - self._last >= self.interval
        release = trim or now - self._last_release >= self.release_interval
        if not release:
            return False
        t0 = time.perf_counter()
        if trim:
            self._last = now
            if _LIBC is not None:
                _LIBC.malloc_trim(0)
            if self.code is not None:
                self.code.release()
            self.trims += 1
        self._last_release = now
        hot = trim or now - self._last_hot >= self.hot_release_interval
        if hot:
            self._last_hot = now
        self.mapped_tables, self.mapped_bytes = release_mapped(hot)
        self.seconds += time.perf_counter() - t0
        return trim
