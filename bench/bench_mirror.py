"""The live step's Python mirror of its native context under process churn: what the mirror
(and the stack table's share of re-interning it) holds when the context is dropped, old vs new
code alternated on one recorded capture of a churning machine.

    python3 bench/bench_mirror.py [--capture FILE] [--record-seconds 60] [--rate 200]
        [--max-spaces 1024] [--cache DIR] [--runs 3] [--trace] CODE [CODE ...]

Capture (once, reused when FILE exists; root): the default sampling of every CPU for
``--record-seconds`` while soak.py's churn starts ``--rate`` short-lived processes a second,
drained every 100 ms. Replay (per CODE, its own interpreter with ``PYTHONPATH=CODE``,
bench_sideband.code_path): ``LiveProfiler`` over the drains as bench_step_replay.py replays
(an empty /proc, line tables from the cache dir ``--cache``, default ``FILE``.mirror-cache,
the daemon's collector thresholds, counts flushed every 10 drains), the native context dropped
past ``--max-spaces`` spaces (live._NATIVE_MAX_SPACES). Printed per run: the process CPU of the
replay, its peak RSS (VmHWM), and a digest of what was stored (same capture, same digest). With
``--trace`` (tracemalloc on, so CPU and RSS are not comparable then): at each drop of the
context, the bytes its dropping frees (traced before the drop, less after it, a collection and
the store's sweep of its identity cache: the mirror, the C context's Python side and what only
they held), and the peak of traced bytes over the replay.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from bench_sideband import code_path  # noqa: E402


def record(path: Path, seconds: float, rate: float) -> None:
    import soak
    from bench_sideband_replay import capture
    from unwindd.source.sampling import SamplingConfig

    tmp = Path(tempfile.mkdtemp(prefix="unwindd-mirror-"))
    churn = soak.Churn(soak.churn_commands(tmp), rate, 64)
    churn.start()
    try:
        time.sleep(1)
        fmt, drains = capture(SamplingConfig(), seconds, 0.1)
    finally:
        churn.finish()
    path.write_bytes(pickle.dumps((fmt, drains)))


def child(cap: Path, cache: str, max_spaces: int, trace: bool, out: Path) -> None:
    import tracemalloc

    if trace:
        tracemalloc.start(1)
    import unwindd.pipeline.live as live_mod
    from replaylive import replay_profiler, run
    from unwindd.pipeline.ringstep import NativeStep

    live_mod._NATIVE_MAX_SPACES = max_spaces
    fmt, drains = pickle.loads(cap.read_bytes())
    prof = replay_profiler(fmt, drains, cache, tick_ns=100_000_000, max_bytes=28 << 20)
    store = prof.store
    drops: list[dict[str, int]] = []
    new_ctx = NativeStep._new_ctx

    def spy(step: Any) -> None:
        if not trace or not hasattr(step, "nctx"):
            new_ctx(step)
            return
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        stacks, spaces, native = step.nstacks, step.nctx.nspaces, step.nctx.native_bytes
        new_ctx(step)
        store._sweep()
        gc.collect()
        freed = before - tracemalloc.get_traced_memory()[0]
        drops.append({"freed": freed, "stacks": stacks, "spaces": spaces, "native": native})

    NativeStep._new_ctx = spy  # type: ignore[method-assign]
    prof.forget_stream_pids()
    c0 = time.process_time()
    prof.start()
    run(prof, len(drains), 10)  # ~1 s of 100 ms drains: the daemon's flush interval
    prof.flush()
    cpu = time.process_time() - c0
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status")
               if line.startswith("VmHWM:"))  # fmt: skip
    peak = tracemalloc.get_traced_memory()[1] if trace else 0
    tracemalloc.stop()
    prof.close()
    h = hashlib.sha256()
    for line in sorted(repr((x.pid, x.tid, x.comm, x.frames, x.count))
                       for x in store.query()):  # fmt: skip
        h.update(line.encode())
    out.write_text(json.dumps({"cpu_s": cpu, "hwm_kib": hwm, "peak_traced": peak,
                               "drops": drops, "contexts": prof.native_step.contexts,
                               "digest": h.hexdigest()[:16]}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("codes", nargs="*", default=["installed"])
    ap.add_argument("--capture", default="/tmp/unwindd-mirror-capture.pickle")
    ap.add_argument("--record-seconds", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=200.0, help="processes started a second")
    ap.add_argument("--max-spaces", type=int, default=1024)
    ap.add_argument("--cache", help="line/CFI/symbol cache dir (default FILE.mirror-cache)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--trace", action="store_true", help="tracemalloc: bytes freed per drop")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    cap = Path(a.capture)
    cache = a.cache or f"{cap}.mirror-cache"
    if a.child:
        child(cap, cache, a.max_spaces, a.trace, Path(a.child))
        return
    if not cap.exists():
        record(cap, a.record_seconds, a.rate)
    tmp = Path(tempfile.mkdtemp(prefix="unwindd-mirror-"))
    paths = {c: code_path(c, tmp) for c in a.codes}
    res: dict[str, list[dict[str, Any]]] = {c: [] for c in a.codes}
    for i in range(a.runs):
        for c in a.codes:
            env = dict(os.environ)
            if paths[c] is not None:
                env["PYTHONPATH"] = str(paths[c])
            out = tmp / "out.json"
            cmd = [sys.executable, __file__, "--child", str(out), "--capture", str(cap),
                   "--cache", cache, "--max-spaces", str(a.max_spaces),
                   *(["--trace"] if a.trace else [])]  # fmt: skip
            subprocess.run(cmd, env=env, check=True)
            r = json.loads(out.read_text())
            res[c].append(r)
            freed = " ".join(f"{d['freed'] / 2**20:.2f}" for d in r["drops"])
            stacks = " ".join(str(d["stacks"]) for d in r["drops"])
            native = " ".join(f"{d['native'] / 2**20:.1f}" for d in r["drops"])
            more = (f", freed per drop {freed} MiB ({stacks} stacks; C context {native} MiB), "
                    f"peak traced {r['peak_traced'] / 2**20:.1f} MiB" if a.trace else "")
            print(f"run {i + 1} {c}: {r['cpu_s']:.2f} s CPU, peak RSS "
                  f"{r['hwm_kib'] / 1024:.1f} MiB, {r['contexts']} contexts{more}, "
                  f"digest {r['digest']}", flush=True)  # fmt: skip
    for c, rs in res.items():
        print(f"median of {a.runs}, {c}: {statistics.median(r['cpu_s'] for r in rs):.2f} s CPU, "
              f"peak RSS {statistics.median(r['hwm_kib'] for r in rs) / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
