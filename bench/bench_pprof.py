"""The cost of writing one pprof answer (store/pprof.py) on a store filled from a recorded
capture: the peak of Python allocations while it is written (tracemalloc) and its CPU, for
``encode_profile_ids`` (``/v1/stacks?format=pprof``) and ``encode_profile`` (the pull endpoint's
and the Pyroscope push's encoder, of frame tuples), optionally against another version's
pprof.py on the same store, whose bytes must be the same.

    python3 bench/bench_pprof.py [--capture FILE] [--cache DIR] [--runs 3]
        [--limit N] [--baseline OLD_PPROF_PY]

The capture is bench_mirror.py's (``(fmt, drains)`` pickled, default its FILE); it is replayed
through ``LiveProfiler`` once per run of this script as bench_mirror.py replays it (an empty
/proc, line tables from ``--cache``, counts flushed every 10 drains). ``--baseline`` loads
a pprof.py file (e.g. ``git show BASE:daemon/unwindd/store/pprof.py > /tmp/old.py``) as a
module of this tree's ``unwindd.store`` package. Printed per encoder: the traced peak (MiB,
after a collection, with the answer's own bytes), the minimum CPU of ``--runs`` answers, the
answer's size, and whether its bytes equal the baseline's.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import pickle
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))


def build_store(cap: Path, cache: str) -> Any:
    from replaylive import replay_profiler, run

    fmt, drains = pickle.loads(cap.read_bytes())
    prof = replay_profiler(fmt, drains, cache, tick_ns=100_000_000, max_bytes=28 << 20)
    prof.forget_stream_pids()
    prof.start()
    run(prof, len(drains), 10)
    prof.flush()
    del drains
    gc.collect()
    return prof.store


def load_baseline(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("unwindd.store._pprof_baseline", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def measure(fn: Callable[[], bytes], runs: int) -> tuple[float, float, bytes]:
    """(traced peak MiB, min CPU s, the answer)."""
    gc.collect()
    tracemalloc.start()
    body = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del body
    cpus = []
    for _ in range(runs):
        gc.collect()
        c0 = time.process_time()
        body = fn()
        cpus.append(time.process_time() - c0)
        del body
    return peak / 2**20, min(cpus), fn()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capture", default="/tmp/unwindd-mirror-capture.pickle")
    ap.add_argument("--cache", help="line/CFI/symbol cache dir (default FILE.pprof-cache)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--limit", type=int, default=100_000, help="entries of the answer")
    ap.add_argument("--baseline", help="another version's pprof.py, compared on the same store")
    a = ap.parse_args()
    from unwindd.store import pprof

    store = build_store(Path(a.capture), a.cache or a.capture + ".pprof-cache")
    entries, _ = store.query_ids(None, None, pids=None, tid=None, comm=None, limit=a.limit)
    stacks = store.query(None, None)[:a.limit]
    print(f"store: {store.stats.entries} entries, {store.stats.stacks} stacks; answer of "
          f"{len(entries)} entries", flush=True)  # fmt: skip
    kw: dict[str, Any] = {"period_ns": 10_101_010, "time_nanos": 1, "duration_nanos": 60 * 10**9,
                          "labels_of": store.labels_of}  # fmt: skip
    versions = [("new", pprof)] + ([("base", load_baseline(a.baseline))] if a.baseline else [])
    for name, enc in (("encode_profile_ids", lambda m: m.encode_profile_ids(entries, store.table,
                                                                            **kw)),
                      ("encode_profile", lambda m: m.encode_profile(stacks, **kw))):
        got = {}
        for label, mod in versions:
            peak, cpu, body = measure(lambda mod=mod, enc=enc: enc(mod), a.runs)  # type: ignore[misc]
            got[label] = body
            print(f"{name:20s} {label:5s} peak {peak:6.2f} MiB  cpu {cpu * 1000:7.1f} ms  "
                  f"({cpu / max(1, len(entries)) * 1e6:5.1f} us/entry)  "
                  f"{len(body) / 2**20:.2f} MiB", flush=True)  # fmt: skip
        if "base" in got:
            print(f"{name:20s} bytes equal: {got['new'] == got['base']}", flush=True)
        Path(f"/tmp/bench_pprof.{name}.pb.gz").write_bytes(got["new"])


if __name__ == "__main__":
    main()
