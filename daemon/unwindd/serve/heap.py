"""The daemon's C heap (glibc malloc): few arenas, free pages handed back, and what it holds.

The daemon's threads (query worker, CFI compiler, Python frame reader, the native unwind
worker) each get a malloc arena of their own by default (glibc malloc/arena.c: up to
8 x cores, each a 64 MiB reserved heap); memory a thread allocated and the loop freed stays in
that thread's arena, and free chunks in the middle of an arena stay resident until
``malloc_trim`` returns their pages (malloc/malloc.c mtrim: MADV_DONTNEED on whole free pages
of every arena). Under process churn the freed-but-resident part was most of the daemon's RSS.

Invariants:
- ``limit_arenas`` runs before the daemon starts a thread (mallopt M_ARENA_MAX only bounds
  arenas created after it); ``Trimmer.maybe`` runs on the loop thread only.
- Without glibc (musl, another libc) every function here is a no-op and ``stats`` is None:
  the daemon runs the same, only without these bounds.
Cost: ``Trimmer.maybe`` O(1) except at most once per ``interval`` s, when malloc_trim walks
every arena's free chunks (O(free chunks), ~10-100 ms at a few hundred MiB); ``stats`` walks
the same (mallinfo2), so /v1/status and the metrics read it at most once per call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["ARENA_MAX", "HeapStats", "Trimmer", "limit_arenas", "stats"]

# The loop thread's main arena plus one the other threads share: enough that the query worker
# and the CFI compiler rarely wait for a lock held by the loop, without one heap per thread.
ARENA_MAX = 2
_M_ARENA_MAX = -8  # glibc malloc.h


class _Mallinfo2(ctypes.Structure):
    # glibc malloc/malloc.h struct mallinfo2 (glibc >= 2.33)
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                              "usmblks", "fsmblks", "uordblks", "fordblks",
                                              "keepcost")]  # fmt: skip


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not all(hasattr(libc, f) for f in ("mallopt", "malloc_trim", "mallinfo2")):
        return None  # not glibc, or one too old for mallinfo2
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


_LIBC = _libc()


def limit_arenas(n: int = ARENA_MAX) -> bool:
    """At most ``n`` malloc arenas from now on; False without glibc."""
    return _LIBC is not None and bool(_LIBC.mallopt(_M_ARENA_MAX, n))


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
    ``interval`` seconds. Counts trims and their total seconds (for the metrics)."""

    interval: float = 10.0
    trims: int = 0
    seconds: float = 0.0
    _last: float = 0.0

    def maybe(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if _LIBC is None or now - self._last < self.interval:
            return False
        self._last = now
        t0 = time.perf_counter()
        _LIBC.malloc_trim(0)
        self.seconds += time.perf_counter() - t0
        self.trims += 1
        return True
