"""Bytes per frame and per stack that the store's stack table (store/stacktable.py) retains,
as tracemalloc measures them, against its own ``nbytes``; and the CPU of adding (untraced, the
last line). Run by hand, not in CI, once per tree (``PYTHONPATH`` = that tree's daemon dir):

    PYTHONPATH=daemon python3 bench/bench_stacktable.py /tmp/small.data [--copies 30]

The recording's samples come from ``bench_queries.prepare`` (unwound once, cached as plain
tuples), so every tree gets the same frames. The table is filled with ``--copies`` copies of
every stack, each under ASLR (user code loaded elsewhere: new stacks, the same frame keys),
as bench_queries.py fills the store. Then, measured one after the other under tracemalloc:
- ``--more`` more ASLR copies: new stacks only, so their bytes over their count is what a
  stack costs;
- ``--more`` copies of other binaries (each copy's binary and symbol names made its own, as
  the varied binaries of a churning machine bring): new frames and new stacks, so what is left
  after their stacks' share, over the new frames, is what a frame costs.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_queries import ASLR_STEP, prepare


def _at(f: Any, k: int, distinct: bool, moved: dict[int, Any]) -> Any:
    """Frame ``f`` in copy ``k``: its user code loaded elsewhere, in a binary of its own when
    ``distinct``."""
    from dataclasses import replace

    if f.rel is None or f.kernel:
        return f
    g = moved.get(id(f))
    if g is None:
        g = replace(f, ip=f.ip + k * ASLR_STEP)
        if distinct:
            g = replace(g, dso=f"{f.dso or ''}.{k}", sym=f"{f.sym or ''}.{k}")
        moved[id(f)] = g
    return g


def copies(rows: list[Any], first: int, n: int, distinct: bool) -> list[tuple[Any, ...]]:
    """The recording's stacks (as Frame tuples) of copies first..first+n-1."""
    from unwindd.unwind.stackfmt import Frame

    pool: dict[tuple[Any, ...], Any] = {}
    base = [tuple(pool.get(fr) or pool.setdefault(fr, Frame(*fr)) for fr in r[4]) for r in rows]
    out: list[tuple[Any, ...]] = []
    for k in range(first, first + n):
        moved: dict[int, Any] = {}
        out += [tuple(_at(f, k, distinct, moved) for f in fr) for fr in base]
    return out


def add(table: Any, stacks: list[tuple[Any, ...]], batch: int = 2000) -> None:
    """``table.add`` of each stack, in batches as the store adds them (a table that remembers
    frame objects by identity forgets them after each batch, as the store has it do)."""
    forget = getattr(table, "forget_frames", lambda: None)
    for i in range(0, len(stacks), batch):
        for fr in stacks[i:i + batch]:
            table.add(fr)
        forget()


def fill(table: Any, stacks: list[tuple[Any, ...]]) -> tuple[int, int, int, float]:
    """(bytes retained, new stacks, new frames, add CPU s) of adding ``stacks``."""
    gc.collect()
    s0, f0 = len(table), table.nframes
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    c0 = time.process_time()
    add(table, stacks)
    cpu = time.process_time() - c0
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used, len(table) - s0, table.nframes - f0, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("recording")
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--more", type=int, default=10)
    args = ap.parse_args()
    from unwindd.store.stacktable import StackTable

    with open(prepare(args.recording), "rb") as f:
        rows = pickle.load(f)
    table = StackTable()
    base = copies(rows, 0, args.copies, False)
    used, ns, nf, cpu = fill(table, base)
    slots = sum(map(len, base))
    print(f"{args.recording}: {args.copies} ASLR copies: {ns} stacks ({table.slots} frames), "
          f"{nf} frames; tracemalloc {used / 2**20:.2f} MiB, nbytes {table.nbytes / 2**20:.2f}"
          f" MiB; add {cpu * 1e6 / slots:.2f} us per frame slot")  # fmt: skip
    more = copies(rows, args.copies, args.more, False)
    slots0 = table.slots
    used, ns, nf, cpu = fill(table, more)
    per_stack = used / ns
    print(f"+{args.more} ASLR copies: {ns} stacks, {nf} frames: {per_stack:.0f} B per stack "
          f"(frames per new stack {(table.slots - slots0) / ns:.1f}); add "
          f"{cpu * 1e6 / sum(map(len, more)):.2f} us per frame slot")  # fmt: skip
    other = copies(rows, args.copies + args.more, args.more, True)
    used2, ns, nf, cpu = fill(table, other)
    per_frame = (used2 - ns * per_stack) / nf
    print(f"+{args.more} copies of other binaries: {ns} stacks, {nf} frames: "
          f"{per_frame:.0f} B per frame; add {cpu * 1e6 / sum(map(len, other)):.2f} us per "
          f"frame slot")  # fmt: skip
    everything = base + more + other
    gc.collect()
    c0 = time.process_time()
    t2 = StackTable()
    add(t2, everything)
    cpu = time.process_time() - c0
    slots = sum(map(len, everything))
    del t2
    gc.collect()
    tracemalloc.start()
    b0 = tracemalloc.get_traced_memory()[0]
    t2 = StackTable()
    add(t2, everything)
    gc.collect()
    whole = tracemalloc.get_traced_memory()[0] - b0
    tracemalloc.stop()
    print(f"all of it in one table: {len(t2)} stacks, {t2.nframes} frames: tracemalloc "
          f"{whole / 2**20:.2f} MiB, nbytes {t2.nbytes / 2**20:.2f} MiB "
          f"(nbytes / tracemalloc {t2.nbytes / whole:.3f}); add (untraced) "
          f"{cpu * 1e6 / slots:.2f} us per frame slot, {cpu * 1e6 / len(everything):.1f} us "
          f"per stack")  # fmt: skip
    if hasattr(StackTable, "sweep_code_frames"):
        code_stacks(rows, args.copies, args.more)


def code_stacks(rows: list[Any], n: int, more: int) -> None:
    """New processes of known binaries as the live step hands them to the store: ``more`` ASLR
    copies after ``n``, each stack as new frames (``at_ip`` once per frame and copy, then
    ``add``: the step's mirror before CodeStacks) or as a CodeStack (``add(base, ips)``), into
    a table holding the first ``n`` copies; the CPU of making and adding them."""
    from unwindd.store.stacktable import StackTable
    from unwindd.unwind.stackfmt import Frame, at_ip

    pool: dict[tuple[Any, ...], Any] = {}
    base = [tuple(pool.get(fr) or pool.setdefault(fr, Frame(*fr)) for fr in r[4]) for r in rows]

    def ips(fr: tuple[Any, ...], k: int) -> list[int]:
        return [f.ip + k * ASLR_STEP if f.rel is not None and not f.kernel else f.ip
                for f in fr]  # fmt: skip

    out = []
    for how in ("frames", "code"):
        t = StackTable()
        for k in range(n + more):
            if k == n:
                gc.collect()
                c0 = time.process_time()
            if how == "code":
                for fr in base:
                    t.add(fr, ips(fr, k))
                t.forget_frames()
                t.sweep_code_frames()
            else:
                moved: dict[tuple[int, int], Any] = {}
                for fr in base:
                    t.add(tuple([moved.get((id(f), ip)) or moved.setdefault((id(f), ip),
                                 f if ip == f.ip else at_ip(f, ip))
                                 for f, ip in zip(fr, ips(fr, k), strict=True)]))  # fmt: skip
                t.forget_frames()
        out.append((time.process_time() - c0) * 1e6 / (more * sum(map(len, base))))
    print(f"+{more} ASLR copies as the live step hands them: as new frames {out[0]:.2f} us, "
          f"as CodeStacks {out[1]:.2f} us per frame slot")  # fmt: skip


if __name__ == "__main__":
    main()
