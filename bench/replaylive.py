"""A recorded capture of ring drains replayed through the live step, as the daemon runs it:
the set-up bench_step_replay.py, bench_mirror.py and bench_pprof.py share.

``replay_profiler`` builds a ``LiveProfiler`` over ``captured.Replayed(fmt, drains)`` with an
empty /proc (every process is known only from the capture's side-band records), line tables
from a persistent cache dir (as a daemon that ran before), inline frames on, the daemon's
garbage collector thresholds, a store of 10 s buckets kept for an hour, and counts flushed only
when asked (``run`` flushes every ``flush_every`` drains, as the daemon does about once a
second). Its clock advances ``tick_ns`` per read, so a replay is the same every time.

It is imported by the benchmarks' child processes, which run against other trees
(``PYTHONPATH=CODE``): it uses only what those trees have had for long (``GC_THRESHOLDS`` has
a fallback for code from before it was named).
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path
from typing import Any


def replay_profiler(fmt: Any, drains: list[Any], cache: str, *, tick_ns: int,
                    max_bytes: int | None = None) -> Any:  # fmt: skip
    """The ``LiveProfiler`` (not started) over ``drains``; ``max_bytes``: the store's cap
    (None: its own default)."""
    from captured import Replayed
    from unwindd.pipeline.live import LiveProfiler
    from unwindd.procs.livetable import LiveTable
    from unwindd.procs.procscan import ProcFS
    from unwindd.store.stackstore import StackStore
    from unwindd.unwind.engine import StackEngine

    try:
        from unwindd.serve.service import GC_THRESHOLDS
    except ImportError:  # code from before it was named: the same numbers, inline
        GC_THRESHOLDS = (20_000, 10, 10)
    gc.set_threshold(*GC_THRESHOLDS)  # the daemon's collector, not the interpreter's default
    tmp = Path(tempfile.mkdtemp(prefix="unwindd-replay-"))
    (tmp / "proc").mkdir()
    engine = StackEngine.create(inline=True, cache_dir=cache)
    ticks = iter(range(1, 1 << 40))
    live = LiveTable(engine.table, ProcFS(str(tmp / "proc")),
                     clock=lambda: next(ticks) * tick_ns)  # fmt: skip
    caps = {} if max_bytes is None else {"max_bytes": max_bytes}
    store = StackStore(bucket_ns=10_000_000_000, max_buckets=360, **caps)
    return LiveProfiler(Replayed(fmt, drains), engine, store, live=live,
                        bootstrap=False, flush_interval=1e9)  # fmt: skip


def run(prof: Any, steps: int, flush_every: int) -> None:
    """``steps`` drains, the counts flushed after every ``flush_every``-th."""
    for i in range(steps):
        prof.step()
        if i % flush_every == flush_every - 1:
            prof.flush()
