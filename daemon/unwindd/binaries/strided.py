"""A bisect of an ascending column read in place from a mapped cache table (the line tables'
addresses, the symbol tables' starts), through a directory of every ``STRIDE``-th value kept
on the heap.

A whole-column bisect reads one page of the column per level until its range fits in a page,
and each first read of a page maps the cached pages around it too (mm/memory.c
do_fault_around: 64 KiB), so a lookup in a table released from the RSS (cachefiles.py) put
about a dozen such windows of each big column back. Through the directory it reads one
stride, one or two pages.

Invariants:
- ``find(col, directory(col), v) == bisect_right(col, v) - 1`` for an ascending column
  (equal values included): the directory's bisect names the one stride whose first value is
  <= v while the next stride's first is > v.
- On a misordered column (damage a table's CRC missed) the answer stays in [-1, len(col)).
Cost: ``directory`` O(len / STRIDE) reads and 8 bytes per stride on the heap, once per
table; ``find`` O(log(len / STRIDE) + log STRIDE).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence

__all__ = ["STRIDE", "directory", "find"]

STRIDE = 512  # 8-byte values: one 4 KiB page (two where the column's offset splits them)


def directory(col: Sequence[int]) -> array[int]:
    """Every ``STRIDE``-th value of ``col``, on the heap."""
    return array("Q", col[::STRIDE])


def find(col: Sequence[int], dirs: array[int], v: int) -> int:
    """``bisect_right(col, v) - 1`` through ``dirs = directory(col)`` (module invariants)."""
    k = bisect_right(dirs, v)
    if k == 0:
        return -1
    lo = (k - 1) * STRIDE
    return bisect_right(col, v, lo, min(lo + STRIDE, len(col))) - 1
