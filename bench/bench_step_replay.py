"""The live step's CPU per sample on a recorded 999 Hz capture of a steady load, old vs new
code alternated, as the daemon configures the step (inline frames on, counts flushed about
once a second): deterministic, beside bench_daemon.py's live numbers on a noisy machine.

    python3 bench/bench_step_replay.py [--capture FILE] [--record-seconds 8] [--steady]
        [--warm 80] [--only-comm chain_o2] [--idle] [--runs 3] [--steps N] [--merge N]
        [--callgrind]
        CODE [CODE ...]

Capture (once, reused when FILE exists; root): every CPU at 999 Hz, 8 KiB stacks, 256-page
rings, one ``chain_o2 100`` re-exec loop per CPU, drained every 25 ms (about the daemon's
watermark wakeups at that rate); the workload binaries stay in ``FILE``.wl so that replays
name their frames. ``--steady``: one long-lived ``chain_o2`` per CPU instead, started once the
rings are on (so that the replay learns them from their own side-band records): few new
processes, the round's fixed cost in view (replay it with ``--only-comm chain_o2``).
``--only-comm NAME``: only the samples of processes that took that comm in the capture
(and the idle task's) are replayed, every side-band record kept: other processes of the
machine (present before the capture: unknown to the replay's empty /proc) would only measure
their placement failures. ``--idle``: every sample replaced by a kernel-only idle-task sample
of the capture (pid 0, same time and cpu): an idle machine at 999 Hz. ``--steps N``: at most
N timed drains. ``--merge N``: every N consecutive drains replayed as one round (each ring's
chunks joined in drain order; warm-up and flushes scaled to the same drains): the same
records in fewer, larger rounds, as if the rings' wakeups shared rounds (each CPU's ring
wakes at its own watermark crossings, so each wakeup starts a round of its own today).
``--callgrind``: each replay under valgrind's callgrind, collection on only
around the timed drains (``callgrind_control -i``): the instructions the main thread took in
them (the step's; the CFI and line-table workers run beside it, as scheduled), nearly
deterministic on a shared machine, beside the CPU time.
Replay (per CODE, its own interpreter with ``PYTHONPATH=CODE``, bench_sideband.code_path):
``LiveProfiler`` over the drains (an empty /proc, line tables from a persistent cache dir
``FILE``.cache, as a daemon that ran before; the daemon's garbage collector thresholds), the
first ``--warm`` drains untimed; then the process CPU of the rest per sample, and a digest of
what was stored (same capture, same digest: the codes agree on every stack and count).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import signal
import statistics
import struct
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
from bench_sideband_replay import capture  # noqa: E402

_SAMPLE, _COMM = 9, 3  # PERF_RECORD_* (include/uapi/linux/perf_event.h)


def record(path: Path, seconds: float, steady: bool = False) -> None:
    from unwindd.source.sampling import SamplingConfig
    from workloads.build import build_workloads

    wl = build_workloads(Path(f"{path}.wl"))["c_o2"]
    if steady:
        record_steady(path, seconds, wl.argv[0])
        return
    loop = f'while :; do "{wl.argv[0]}" 100 >/dev/null; done'
    load = [subprocess.Popen(["sh", "-c", loop], start_new_session=True)
            for _ in range(os.cpu_count() or 1)]  # fmt: skip
    try:
        cfg = SamplingConfig(frequency=999, stack_size=8192, ring_pages=256)
        fmt, drains = capture(cfg, seconds, 0.025)
    finally:
        for pr in load:
            os.killpg(pr.pid, signal.SIGKILL)
            pr.wait()
    path.write_bytes(pickle.dumps((fmt, drains)))


def record_steady(path: Path, seconds: float, exe: str) -> None:
    """``record`` with one long-lived ``exe`` per CPU, started after the rings are enabled."""
    from unwindd.source.perfcore import PerfSession
    from unwindd.source.sampling import SamplingConfig, Target

    cfg = SamplingConfig(frequency=999, stack_size=8192, ring_pages=256)
    drains: list[list[tuple[int, bytes]]] = []
    load: list[subprocess.Popen[bytes]] = []
    try:
        with PerfSession.open(Target(all_cpus=True), cfg) as s:
            s.enable()
            load = [subprocess.Popen([exe, "100000"], stdout=subprocess.DEVNULL,
                                     start_new_session=True)
                    for _ in range(os.cpu_count() or 1)]  # fmt: skip
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                drains.append(s.drain(4 << 20))
                time.sleep(0.025)
            s.disable()
            drains.append(s.drain(4 << 20))
            fmt = s.event_format
    finally:
        for pr in load:
            os.killpg(pr.pid, signal.SIGKILL)
            pr.wait()
    path.write_bytes(pickle.dumps((fmt, drains)))


def _records(b: bytes) -> Any:
    pos = 0
    while pos + 8 <= len(b):
        typ, _misc, size = struct.unpack_from("<IHH", b, pos)
        yield typ, pos, size
        pos += size


def only_comm(fmt: Any, drains: list[list[tuple[int, bytes]]], comm: str) -> list[Any]:
    from unwindd.source.mapfile import layout_of

    i_tid = layout_of(fmt).i_tid
    pids = {0}
    for d in drains:
        for _, b in d:
            for typ, pos, size in _records(b):
                if typ == _COMM and b[pos + 16 : pos + size].split(b"\0")[0] == comm.encode():
                    pids.add(struct.unpack_from("<I", b, pos + 8)[0])
    out = []
    for d in drains:
        out.append([(cpu, b"".join(
            b[pos : pos + size] for typ, pos, size in _records(b)
            if typ != _SAMPLE or struct.unpack_from("<I", b, pos + 8 + 8 * i_tid)[0] in pids))
            for cpu, b in d])  # fmt: skip
    return out


def idle(fmt: Any, drains: list[list[tuple[int, bytes]]]) -> list[Any]:
    from unwindd.source.capture import StreamPipeline
    from unwindd.source.mapfile import layout_of

    lay, dec = layout_of(fmt), StreamPipeline.for_format(fmt).decoder
    kernel_only = [b[pos : pos + size] for d in drains for _, b in d
                   for typ, pos, size in _records(b)
                   if typ == _SAMPLE and (s := dec.decode_sample(
                       struct.unpack_from("<H", b, pos + 4)[0], memoryview(b)[pos + 8 : pos + size]
                   )).regs_abi == 0 and s.callchain]  # fmt: skip
    if not kernel_only:
        raise SystemExit("no kernel-only sample in the capture to make idle samples of")
    k = 0
    out = []
    for d in drains:
        nd = []
        for cpu, b in d:
            parts = []
            for typ, pos, _ in _records(b):
                if typ != _SAMPLE:
                    continue
                r = bytearray(kernel_only[k % len(kernel_only)])
                k += 1
                struct.pack_into("<II", r, 8 + 8 * lay.i_tid, 0, 0)
                for i, fmt_ in ((lay.i_time, "<Q"), (lay.i_cpu, "<I")):
                    struct.pack_into(fmt_, r, 8 + 8 * i,
                                     struct.unpack_from(fmt_, b, pos + 8 + 8 * i)[0])  # fmt: skip
                parts.append(bytes(r))
            nd.append((cpu, b"".join(parts)))
        out.append(nd)
    return out


def _collect(on: bool) -> None:
    """Callgrind's collection on or off for this process (no-op outside valgrind)."""
    if os.environ.get("UNWINDD_BENCH_CALLGRIND"):
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip


def _instructions(path: Path) -> int:
    """The Ir total of a callgrind output file (its ``totals:`` line: ``summary:`` stays 0
    when collection starts off)."""
    for line in path.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise SystemExit(f"{path}: no callgrind totals")


def merged(drains: list[Any], n: int) -> list[Any]:
    """Every ``n`` consecutive drains as one: each ring's chunks joined in drain order, the
    rings in the order they first appear (a round drains every ring, capture.py)."""
    out = []
    for g in range(0, len(drains), n):
        by_cpu: dict[int, list[bytes]] = {}
        for d in drains[g : g + n]:
            for cpu, b in d:
                by_cpu.setdefault(cpu, []).append(b)
        out.append([(cpu, b"".join(bs)) for cpu, bs in by_cpu.items()])
    return out


def child(cap: Path, warm: int, comm: str | None, idle_: bool, out: Path,
          steps: int | None = None, merge: int = 1) -> None:  # fmt: skip
    from replaylive import replay_profiler, run

    fmt, drains = pickle.loads(cap.read_bytes())
    if comm:
        drains = only_comm(fmt, drains, comm)
    if idle_:
        drains = idle(fmt, drains)
    flush_every = 40  # ~1 s of 25 ms drains: the daemon's flush interval
    if merge > 1:
        drains, warm, flush_every = merged(drains, merge), warm // merge, flush_every // merge
        steps = None if steps is None else steps // merge
    prof = replay_profiler(fmt, drains, f"{cap}.cache", tick_ns=1_000_000_000)
    prof.start()
    by_type = prof.pipeline.stats.by_type
    run(prof, warm, flush_every)
    timed = len(drains) - warm if steps is None else min(steps, len(drains) - warm)
    _collect(True)
    n0, c0 = by_type["SAMPLE"], time.process_time()
    run(prof, timed, flush_every)
    prof.flush()
    cpu, n = time.process_time() - c0, by_type["SAMPLE"] - n0
    _collect(False)
    prof.close()
    h = hashlib.sha256()
    for line in sorted(repr((x.pid, x.tid, x.comm, x.frames, x.count))
                       for x in prof.store.query()):  # fmt: skip
        h.update(line.encode())
    out.write_text(json.dumps({"cpu_s": cpu, "samples": n, "us_per_sample": 1e6 * cpu / max(n, 1),
                               "steps": timed, "digest": h.hexdigest()[:16]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("codes", nargs="*", default=["installed"])
    ap.add_argument("--capture", default="/tmp/unwindd-step-capture.pickle")
    ap.add_argument("--record-seconds", type=float, default=8.0)
    ap.add_argument("--steady", action="store_true",
                    help="record long-lived workloads, not a re-exec loop")  # fmt: skip
    ap.add_argument("--warm", type=int, default=80, help="drains replayed before timing")
    ap.add_argument("--only-comm", help="replay only the samples of processes of this comm")
    ap.add_argument("--idle", action="store_true", help="idle-task samples in place of all")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, help="at most this many timed drains")
    ap.add_argument("--merge", type=int, default=1,
                    help="replay every N consecutive drains as one round")  # fmt: skip
    ap.add_argument("--callgrind", action="store_true",
                    help="count the timed drains' instructions under callgrind")  # fmt: skip
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    cap = Path(a.capture)
    if a.child:
        child(cap, a.warm, a.only_comm, a.idle, Path(a.child), a.steps, a.merge)
        return
    if not cap.exists():
        record(cap, a.record_seconds, a.steady)
    tmp = Path(tempfile.mkdtemp(prefix="unwindd-step-"))
    paths = {c: code_path(c, tmp) for c in a.codes}
    res: dict[str, list[float]] = {c: [] for c in a.codes}
    irs: dict[str, list[int]] = {c: [] for c in a.codes}
    for i in range(a.runs):
        for c in a.codes:
            env = dict(os.environ)
            if paths[c] is not None:
                env["PYTHONPATH"] = str(paths[c])
            out = tmp / "out.json"
            cmd = [sys.executable, __file__, "--child", str(out), "--capture", str(cap),
                   "--warm", str(a.warm), *(["--only-comm", a.only_comm] if a.only_comm else []),
                   *(["--idle"] if a.idle else []), "--merge", str(a.merge),
                   *(["--steps", str(a.steps)] if a.steps is not None else [])]  # fmt: skip
            cg = tmp / "callgrind.out"
            if a.callgrind:
                env["UNWINDD_BENCH_CALLGRIND"] = "1"
                cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                       "--separate-threads=yes", f"--callgrind-out-file={cg}",
                       *cmd]  # fmt: skip
            subprocess.run(cmd, env=env, check=True,
                           stderr=subprocess.DEVNULL if a.callgrind else None)  # fmt: skip
            r = json.loads(out.read_text())
            res[c].append(r["us_per_sample"])
            ir = ""
            if a.callgrind:
                irs[c].append(_instructions(Path(f"{cg}-01")))  # the main thread's
                ir = f", {irs[c][-1] / 1e6:.1f} M instructions"
            print(f"run {i + 1} {c}: {r['cpu_s']:.3f} s CPU, {r['samples']} samples in "
                  f"{r['steps']} steps, {r['us_per_sample']:.2f} us per sample{ir}, "
                  f"digest {r['digest']}", flush=True)  # fmt: skip
    for c, xs in res.items():
        ir = f", {statistics.median(irs[c]) / 1e6:.1f} M instructions" if irs[c] else ""
        print(f"median of {a.runs}, {c}: {statistics.median(xs):.2f} us CPU per sample{ir}")


if __name__ == "__main__":
    main()
