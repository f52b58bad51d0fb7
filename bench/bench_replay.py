#!/usr/bin/env python3
"""Replay benchmark: ``unwindd replay`` (native fast path) against ``perf script`` on one file.

Run by hand (not in CI; the machines are shared and noisy):

    python3 bench/bench_replay.py [--seconds 10] [--freq 4000] [--repeat 3] [--keep FILE]
                                  [--slow]

It records (unless ``--keep`` names an existing file) a system-wide
``perf record -a -e cpu-clock -F FREQ --call-graph dwarf,8192`` while one CPU-bound Python
process per CPU recurses (so stacks vary), then times, best of ``--repeat`` runs each, on the
same file:

- ``unwindd replay FILE --format folded`` and ``--format perf-script`` (native path);
- ``perf script -F comm,pid,tid,time,ip,sym,dso --ns --no-inline`` (perf's own DWARF unwind and
  symbolization through libunwind/libdw, the oracle's command);
- with ``--slow``: ``unwindd replay FILE --format folded --slow-path`` (the Python reference).

and prints a Markdown table for BENCHMARKS.md. Every command's stdout goes to /dev/null-like
capture, so terminal speed is not measured.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOAD = (
    "import os, sys\n"
    "sys.setrecursionlimit(10000)\n"
    "for _ in range(os.cpu_count() - 1):\n"
    "    if os.fork() == 0:\n"
    "        break\n"
    "def f(n):\n"
    "    return 0 if n == 0 else (f(n - 1) + n * 7) % 1000003\n"
    "i = 0\n"
    "while True:\n"
    "    f(10 + i % 50)  # < 1 frame chunk deep: deeper recursion mmaps chunks (MMAP2 storm)\n"
    "    i += 1\n"
)


def record(path: Path, seconds: float, freq: int) -> None:
    work = subprocess.Popen([sys.executable, "-c", WORKLOAD], start_new_session=True)
    try:
        time.sleep(0.3)  # let the children fork and get busy
        subprocess.run(
            ["perf", "record", "-a", "-e", "cpu-clock", "-F", str(freq), "--call-graph",
             "dwarf,8192", "-o", str(path), "--", "sleep", str(seconds)],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        os.killpg(work.pid, signal.SIGKILL)
        work.wait()


def timed(argv: list[str], repeat: int) -> tuple[float, bytes]:
    best = float("inf")
    out = b""
    for _ in range(repeat):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - t0)
        out = proc.stdout
    return best, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--freq", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="reuse/keep the perf.data at this path")
    ap.add_argument("--slow", action="store_true", help="also time the Python reference path")
    args = ap.parse_args()
    if not shutil.which("perf"):
        print("perf is not installed", file=sys.stderr)
        return 2
    tmp = None
    if args.keep is not None:
        path = args.keep
    else:
        tmp = tempfile.TemporaryDirectory()
        path = Path(tmp.name) / "bench.data"
    if not path.exists():
        record(path, args.seconds, args.freq)
    unwindd = [sys.executable, "-m", "unwindd.cli", "replay", str(path)]
    perf = ["perf", "script", "-i", str(path), "-F", "comm,pid,tid,time,ip,sym,dso", "--ns",
            "--no-inline"]  # fmt: skip
    rows = [
        ("unwindd replay --format folded", [*unwindd, "--format", "folded"]),
        ("unwindd replay --format perf-script", [*unwindd, "--format", "perf-script"]),
        ("perf script -F comm,pid,tid,time,ip,sym,dso --ns --no-inline", perf),
    ]
    if args.slow:
        rows.append(("unwindd replay --format folded --slow-path",
                     [*unwindd, "--format", "folded", "--slow-path"]))  # fmt: skip
    times: dict[str, float] = {}
    outs: dict[str, bytes] = {}
    for name, argv in rows:
        times[name], outs[name] = timed(argv, args.repeat)
    summary = subprocess.run([*unwindd, "--format", "summary"], check=True, capture_output=True,
                             text=True).stdout  # fmt: skip
    m = re.search(r"SAMPLE events:\s+(\d+)", summary)
    samples = int(m.group(1)) if m else -1
    size_mb = path.stat().st_size / 1e6
    perf_t = times[rows[2][0]]
    folded_lines = outs[rows[0][0]].count(b"\n")
    ver = subprocess.run(["perf", "--version"], capture_output=True, text=True).stdout.strip()
    print(f"file: {size_mb:.1f} MB, {samples} samples, {folded_lines} folded stacks; {ver}")
    print()
    print(f"| command | best of {args.repeat} (s) | samples/s | speed-up vs perf script |")
    print("|---|---:|---:|---:|")
    for name, _ in rows:
        t = times[name]
        print(f"| `{name}` | {t:.3f} | {samples / t:,.0f} | {perf_t / t:.2f}x |")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
