"""The native live step's CPU on a recorded churn capture, old vs new code alternated: a
deterministic companion to bench_sideband.py (no machine noise from what the load does, only
from the CPU the replay itself gets).

    python3 bench/bench_sideband_replay.py [--capture FILE] [--record-seconds 10]
        [--spawn-rate 200] [--frequency 99] [--warm 30] [--runs 3] [--profile FILE]
        CODE [CODE ...]

Capture (once, reused when FILE exists; root): every CPU at ``--frequency`` Hz (99) with the
daemon's sampling defaults (8 KiB stacks), one ``chain_o2 100`` re-exec loop per CPU plus
``--spawn-rate`` ``/bin/true`` per second, drained every 100 ms (the daemon's tick) into a
pickle of (format, [drain output]).

Replay (per CODE, each in its own interpreter with that CODE first on PYTHONPATH; see
bench_sideband.py for CODE): ``LiveProfiler`` with the native step over the recorded drains,
as tests/integration/test_ringstep.py does (empty /proc, a clock advancing 1 s per read). The first
``--warm`` drains run untimed (cold ELF parsing and CFI compiles, as the daemon's warm-up);
then the process CPU of the remaining steps is reported with the samples and side-band
records they carried, and a digest of everything stored (same capture, same digest: the codes
agree on every stack and count). Runs alternate over CODEs.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import pickle
import shutil
import signal
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

from bench_sideband import _SPAWNER, code_path  # noqa: E402


def record(path: Path, seconds: float, spawn_rate: float, frequency: int) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from unwindd.source.sampling import SamplingConfig
    from workloads.build import build_workloads

    tmp = Path(tempfile.mkdtemp(prefix="unwindd-sbr-"))
    os.chmod(tmp, 0o755)
    wl = build_workloads(tmp / "wl")["c_o2"]
    loop = f'while :; do "{wl.argv[0]}" 100 >/dev/null; done'
    load = [subprocess.Popen(["sh", "-c", loop], start_new_session=True)
            for _ in range(os.cpu_count() or 1)]  # fmt: skip
    if spawn_rate > 0:
        load.append(subprocess.Popen([sys.executable, "-c", _SPAWNER, str(spawn_rate)],
                                     start_new_session=True))  # fmt: skip
    try:
        fmt, drains = capture(SamplingConfig(frequency=frequency, stack_size=8192), seconds, 0.1)
    finally:
        for pr in load:
            os.killpg(pr.pid, signal.SIGKILL)
            pr.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    path.write_bytes(pickle.dumps((fmt, drains)))


def capture(cfg: Any, seconds: float, every: float) -> tuple[Any, list[list[tuple[int, bytes]]]]:
    """The machine's records for ``seconds`` (sampling ``cfg``, every CPU), as the daemon's
    rings give them: (event format, the ring chunks of each drain, one drain every ``every``
    s)."""
    from unwindd.source.perfcore import PerfSession
    from unwindd.source.sampling import Target

    drains: list[list[tuple[int, bytes]]] = []
    with PerfSession.open(Target(all_cpus=True), cfg) as s:
        s.enable()
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            drains.append(s.drain(4 << 20))
            time.sleep(every)
        s.disable()
        drains.append(s.drain(4 << 20))
        return s.event_format, drains


def child(cap: Path, warm: int, out: Path, profile: str | None) -> None:
    import cProfile
    import importlib
    import importlib.util

    from captured import Replayed

    def imp(new: str, old: str, name: str) -> Any:
        """``name`` from module ``new`` (the package in stages), else from ``old`` (a CODE from
        before the sub-packages: one flat package)."""
        try:
            return getattr(importlib.import_module(f"unwindd.{new}"), name)
        except ModuleNotFoundError:
            return getattr(importlib.import_module(f"unwindd.{old}"), name)

    if importlib.util.find_spec("unwindd.source") is None:  # the flat package: what
        # tests/support/captured.py imports from its stages is in unwindd.perfcore there, and
        # what a capture pickled from unwindd.source.formats in unwindd.records
        flat = importlib.import_module("unwindd.perfcore")
        sys.modules["unwindd.source.perfcore"] = sys.modules["unwindd.source.sampling"] = flat
        sys.modules["unwindd.source.formats"] = importlib.import_module("unwindd.records")
    LiveProfiler = imp("pipeline.live", "live", "LiveProfiler")
    LiveTable = imp("procs.livetable", "livetable", "LiveTable")
    ProcFS = imp("procs.procscan", "procscan", "ProcFS")
    StackStore = imp("store.stackstore", "stackstore", "StackStore")
    StackEngine = imp("unwind.engine", "engine", "StackEngine")

    fmt, drains = pickle.loads(cap.read_bytes())
    tmp = Path(tempfile.mkdtemp(prefix="unwindd-sbr-"))
    (tmp / "proc").mkdir()
    engine = StackEngine.create(prefetch_cfi=True)
    ticks = iter(range(1, 1 << 40))
    live = LiveTable(engine.table, ProcFS(str(tmp / "proc")),
                     clock=lambda: next(ticks) * 1_000_000_000)  # fmt: skip
    # A CODE from before the native step became LiveProfiler's only one chose it with
    # native=True and named it ``fast``: the old code is measured on the same step.
    old = "native" in inspect.signature(LiveProfiler).parameters
    kw: dict[str, Any] = {"native": True} if old else {}
    prof = LiveProfiler(Replayed(fmt, drains), engine, StackStore(), live=live,  # type: ignore[arg-type]
                        bootstrap=False, **kw)  # fmt: skip
    assert getattr(prof, "fast" if old else "native_step") is not None
    prof.start()
    by_type = prof.pipeline.stats.by_type
    for _ in range(warm):
        prof.step()
    pre = engine.cfi_prefetch
    if pre is not None and getattr(pre, "_pool", None) is not None:  # (older code)
        pre._pool.shutdown(wait=True)  # warm-up compiles done before timing
        pre._pool = None
    elif pre is not None and hasattr(pre, "_jobs"):
        from concurrent.futures import wait

        wait(list(pre._jobs.futures.values()))  # warm-up compiles done before timing
    n0 = dict(by_type)
    p = cProfile.Profile() if profile else None
    c0 = time.process_time()
    if p is not None:
        p.enable()
    for _ in range(len(drains) - warm):
        prof.step()
    if p is not None:
        p.disable()
    cpu = time.process_time() - c0
    n1 = dict(by_type)
    prof.close()
    shutil.rmtree(tmp, ignore_errors=True)
    if p is not None and profile:
        p.dump_stats(profile)
    # what was stored, as a digest: old and new code must store the same stacks and counts
    h = hashlib.sha256()
    for line in sorted(repr((x.pid, x.tid, x.comm, x.frames, x.count))
                       for x in prof.store.query()):  # fmt: skip
        h.update(line.encode())
    delta = {k: v - n0.get(k, 0) for k, v in n1.items() if v - n0.get(k, 0)}
    samples = delta.get("SAMPLE", 0)
    side = sum(v for k, v in delta.items() if k != "SAMPLE")
    out.write_text(json.dumps({"cpu_s": cpu, "samples": samples, "side_band": side,
                               "by_type": delta, "us_per_side_band": 1e6 * cpu / max(1, side),
                               "stored": prof.store.stats.samples,
                               "digest": h.hexdigest()[:16]}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("codes", nargs="*", default=["installed"])
    ap.add_argument("--capture", default="/tmp/unwindd-sideband-capture.pickle")
    ap.add_argument("--record-seconds", type=float, default=10.0)
    ap.add_argument("--spawn-rate", type=float, default=200.0)
    ap.add_argument("--frequency", type=int, default=99, help="sampling Hz of the capture")
    ap.add_argument("--warm", type=int, default=30, help="drains replayed before timing")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", help="cProfile the timed part of one run of the first CODE")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    cap = Path(a.capture)
    if a.child:
        child(cap, a.warm, Path(a.child), a.profile)
        return
    if not cap.exists():
        record(cap, a.record_seconds, a.spawn_rate, a.frequency)
    tmp = Path(tempfile.mkdtemp(prefix="unwindd-sbr-"))
    paths = {c: code_path(c, tmp) for c in a.codes}
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in a.codes}
    try:
        for i in range(1 if a.profile else a.runs):
            for c in a.codes[:1] if a.profile else a.codes:
                env = dict(os.environ)
                if paths[c] is not None:
                    env["PYTHONPATH"] = str(paths[c])
                out = tmp / "out.json"
                cmd = [sys.executable, __file__, "--child", str(out), "--capture", str(cap),
                       "--warm", str(a.warm)]  # fmt: skip
                if a.profile:
                    cmd += ["--profile", a.profile]
                subprocess.run(cmd, env=env, check=True)
                r = json.loads(out.read_text())
                results[c].append(r)
                print(f"run {i + 1} {c}: cpu {r['cpu_s']:.3f} s, {r['samples']} samples "
                      f"({r['stored']} stored in all, digest {r['digest']}), "
                      f"{r['side_band']} side-band "
                      f"{r['by_type']}, {r['us_per_side_band']:.1f} us CPU per side-band "
                      "record", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for c, rs in results.items():
        if rs:
            cpus = [r["cpu_s"] for r in rs]
            print(f"median {c} ({len(rs)} runs): cpu {statistics.median(cpus):.3f} s "
                  f"(runs {', '.join(f'{x:.3f}' for x in cpus)}), "
                  f"{statistics.median(r['us_per_side_band'] for r in rs):.1f} us per "
                  "side-band record")  # fmt: skip


if __name__ == "__main__":
    main()
