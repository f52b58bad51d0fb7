"""binaries/strided.py: a bisect through a heap directory answers the whole-column bisect.

- On ascending columns of any length (strides cut anywhere, runs of equal values across a
  stride's edge, values before, between and after all of them), as the cast memoryviews of
  a mapped table the stores hand out.
- On a misordered column (damage a CRC missed) it stays in bounds.
- The symbol and line tables mapped from their stores answer the same lookups as their heap
  twins, through their directories.
"""

from __future__ import annotations

import os
import random
from array import array
from bisect import bisect_right
from pathlib import Path

from unwindd.binaries.strided import STRIDE, directory, find


def _column(vals: list[int]) -> memoryview:
    return memoryview(array("Q", vals).tobytes()).cast("Q")


def test_find_is_the_whole_column_bisect() -> None:
    rng = random.Random(7)
    for n in (0, 1, 2, STRIDE - 1, STRIDE, STRIDE + 1, 3 * STRIDE, 5000):
        vals = sorted(rng.randrange(1000, 1000 + 4 * n + 1) for _ in range(n))
        if n > STRIDE + 4:  # a run of equal values across the first stride's edge
            vals[STRIDE - 3 : STRIDE + 3] = [vals[STRIDE - 3]] * 6
            vals.sort()
        col = _column(vals)
        dirs = directory(col)
        assert len(dirs) == -(-n // STRIDE)
        probes = [0, 999, 1000, 10**12, *vals, *(v + 1 for v in vals), *(v - 1 for v in vals)]
        for v in probes:
            assert find(col, dirs, v) == bisect_right(col, v) - 1, (n, v)


def test_find_stays_in_bounds_on_a_misordered_column() -> None:
    shuffled = list(range(3000))
    random.Random(8).shuffle(shuffled)
    col = _column(shuffled)
    dirs = directory(col)
    assert all(-1 <= find(col, dirs, v) < len(col) for v in range(-5, 3005, 7))


def test_mapped_tables_answer_as_their_heap_twins(tmp_path: Path) -> None:
    from unwindd.binaries.elfcache import CacheConfig, ElfCache
    from unwindd.binaries.srclines import SrcLineStore, compile_srclines
    from unwindd.binaries.symstore import SymbolStore

    libc = os.path.realpath("/usr/lib/x86_64-linux-gnu/libc.so.6")
    e = ElfCache(CacheConfig()).acquire(None, libc)
    assert e.usable and e.build_id
    heap_syms = e.symbols()  # (no store: parsed onto the heap)
    SymbolStore(tmp_path / "sym")(e)  # built and written
    mapped_syms = SymbolStore(tmp_path / "sym")(e)  # read back, mapped
    assert mapped_syms.mapped_bytes and mapped_syms._dir is not None and heap_syms._dir is None
    store = SrcLineStore(tmp_path / "srcl")
    store.get(e)
    mapped_lines = store.get(e)
    heap_lines = compile_srclines(libc, e.debug_path())  # (libc6-dbg's DWARF)
    assert mapped_lines is not None and mapped_lines.mapped and not heap_lines.mapped
    rng = random.Random(9)
    lo, hi = int(heap_syms.starts[0]), int(heap_syms.ends[len(heap_syms) - 1])
    probes = [rng.randrange(lo - 64, hi + 64) for _ in range(3000)]
    probes += [int(a) for a in heap_syms.starts[::7]] + [int(a) for a in heap_lines._laddr[::97]]
    assert len(heap_syms) > STRIDE and heap_lines.nlines > 10 * STRIDE
    for a in probes:
        assert mapped_syms.lookup(a) == heap_syms.lookup(a), hex(a)
        assert mapped_lines.chain(a) == heap_lines.chain(a), hex(a)
