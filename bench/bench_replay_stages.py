#!/usr/bin/env python3
"""Where a native replay's CPU goes, stage by stage: ``filereplay.replay`` of one perf.data
file in this process, each stage's thread CPU time (``time.thread_time``: the worker thread's
unwinding and the kallsyms thread are not in it) summed over its calls. Run by hand:

    PYTHONPATH=daemon python3 bench/bench_replay_stages.py FILE [--format folded] [--runs 5]
                                                           [--no-skip]

One untimed replay first (caches warm: compiled CFI and symbol tables in the user cache dir,
as ``unwindd replay`` uses them), then ``--runs`` timed ones; the table gives each stage's
median in ms (a stage the code under test does not have is left out: run it with an older
checkout's ``daemon/`` on PYTHONPATH for a before/after) and what each replay dropped and
applied. Stages nest (``_runs`` holds ``_run`` and the side-band applies; ``_run`` the
snapshots and naming; ``apply`` holds ``apply_mmap2`` where MMAP2s go through it, as before
``_runs`` sent them down ``StackEngine.apply_side_band``): the rows are not to be summed.
``--no-skip`` applies every side-band record (``filereplay.SKIP_UNSAMPLED``,
``SKIP_NOOP_MMAPS`` off). Wrapping a method costs about a microsecond a call, so stages with
many calls read a little high.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from unwindd.binaries.cachefiles import user_cache_dir
from unwindd.pipeline import filereplay
from unwindd.procs.proctable import ProcessTable
from unwindd.procs.space import AddressSpace
from unwindd.source.perfdata import PerfData
from unwindd.unwind import unwinder
from unwindd.unwind.engine import StackEngine

# (owner, method, row name), outermost first
STAGES = [
    (filereplay._Replay, "_runs", "runs loop (all below it)"),
    (filereplay._Replay, "_run", "  unwind runs (fp_unwind_run, stops, naming)"),
    (StackEngine, "snapshot", "    address-space snapshots"),
    (AddressSpace, "modules", "      modules"),
    (unwinder.AddressSpace, "__init__", "      native spaces"),
    (filereplay._Replay, "_symbolize_new", "    naming new frames and stacks"),
    (ProcessTable, "apply", "  process table apply"),
    (ProcessTable, "apply_mmap2", "  process table apply_mmap2"),
    (filereplay._Replay, "_record", "  MMAP2 decode when applied"),
    (filereplay._Replay, "_raw_noop", "  data MMAP2 no-op checks (Python)"),
    (filereplay._Replay, "_decode_others", "decode other side-band records"),
    (filereplay._Replay, "_scan_data_mmaps", "unw_sb_scan"),
    (filereplay._Replay, "_lazy_mmaps", "unw_sb_lazy (+ bulk counts)"),
    (filereplay._Replay, "_lazy_exits", "unw_sb_lazy_exits (+ bulk counts)"),
    (filereplay._Replay, "_order", "fp_order"),
    (filereplay._Replay, "_skip_data_mmaps", "unw_sb_compact"),
    (filereplay._Replay, "_skip_unsampled", "unw_sb_unsampled"),
    (filereplay._Replay, "_skip_noop_mmaps", "unw_sb_noop_mmaps"),
    (filereplay._Replay, "_stream_stats", "stream counts"),
    (filereplay._Replay, "_finish", "finish (counts, folded text)"),
]


def _wrap(acc: dict[str, float], calls: dict[str, int], owner: Any, name: str, row: str) -> None:
    orig: Callable[..., Any] = getattr(owner, name)

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.thread_time()
        try:
            return orig(*a, **k)
        finally:
            acc[row] += time.thread_time() - t0
            calls[row] += 1

    setattr(owner, name, timed)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--format", default="folded")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-skip", action="store_true")
    args = ap.parse_args()
    if args.no_skip:
        filereplay.SKIP_UNSAMPLED = False  # type: ignore[attr-defined,unused-ignore]
        filereplay.SKIP_NOOP_MMAPS = False  # type: ignore[attr-defined,unused-ignore]
    acc: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    rows = [row for owner, name, row in STAGES if hasattr(owner, name)]
    for owner, name, row in STAGES:
        if hasattr(owner, name):
            _wrap(acc, calls, owner, name, row)
    cache = user_cache_dir(os.environ)

    def replay() -> tuple[float, Any]:
        data = PerfData.open(args.file)
        engine = StackEngine.create(cache_dir=cache, inline=False, kernel_store=True)
        t0 = time.thread_time()
        res = filereplay.replay(data, args.file, args.format, io.StringIO(), engine=engine)
        return time.thread_time() - t0, res

    replay()
    per: dict[str, list[float]] = defaultdict(list)
    totals = []
    res = None
    for _ in range(args.runs):
        acc.clear()
        calls.clear()
        t, res = replay()
        totals.append(t)
        for row in rows:
            per[row].append(acc.get(row, 0.0))
    print(f"{args.file} --format {args.format}: {res}")
    print(f"\n| stage (thread CPU, median of {args.runs}) | ms | calls |")
    print("|---|---:|---:|")
    for row in rows:
        name = row.strip()
        indent = ". " * ((len(row) - len(row.lstrip())) // 2)
        print(f"| {indent}{name} | {statistics.median(per[row]) * 1e3:.1f} | {calls[row]} |")
    print(f"| **whole replay** | {statistics.median(totals) * 1e3:.1f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
