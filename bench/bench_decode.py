#!/usr/bin/env python3
"""Decode benchmark: records/s of ``unwindd replay`` against perf on the same perf.data file.

Run by hand (not in CI; the machines are shared and noisy):

    python3 bench/bench_decode.py [--seconds 10] [--freq 2000] [--repeat 3] [--keep FILE]

It records a perf.data with the installed ``perf record -e cpu-clock --call-graph dwarf`` on
every CPU while a CPU-bound workload runs, then times, best of ``--repeat`` runs each:

- ``unwindd replay FILE --format summary``: header, attrs, every record decoded (samples with
  registers and stack copies), round ordering, counts;
- ``perf script -G -F comm,pid,tid,cpu,time,ip --ns``: perf script without its DWARF unwinding.

and prints a Markdown table of records/s and ratios, for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOAD = (
    "import os\n"
    "for _ in range(2):\n"
    "    if os.fork() == 0:\n"
    "        break\n"
    "x = 0\n"
    "while True:\n"
    "    x = (x * 31 + 7) % 1000003\n"
)


def record(path: Path, seconds: float, freq: int) -> None:
    work = subprocess.Popen([sys.executable, "-c", WORKLOAD], start_new_session=True)
    try:
        subprocess.run(
            [
                "perf",
                "record",
                "-a",
                "-e",
                "cpu-clock",
                "-F",
                str(freq),
                "--call-graph",
                "dwarf,8192",
                "-o",
                str(path),
                "--",
                "sleep",
                str(seconds),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    finally:
        import os
        import signal

        os.killpg(work.pid, signal.SIGKILL)
        work.wait()


def timed(argv: list[str], repeat: int) -> tuple[float, str]:
    best = float("inf")
    out = ""
    for _ in range(repeat):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, check=True, capture_output=True, text=True)
        best = min(best, time.perf_counter() - t0)
        out = proc.stdout
    return best, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--freq", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="reuse/keep the perf.data at this path")
    a = ap.parse_args()
    unwindd = shutil.which("unwindd")
    if unwindd is None:
        sys.exit("install unwindd first (pip install .)")
    tmp = Path(tempfile.mkdtemp(prefix="unwindd-bench-"))
    data = a.keep or tmp / "perf.data"
    if not data.exists():
        record(data, a.seconds, a.freq)
    t_u, out = timed([unwindd, "replay", str(data), "--format", "summary"], a.repeat)
    total = int(re.search(r"^TOTAL events: (\d+)", out, re.M).group(1))  # type: ignore[union-attr]
    samples = int(re.search(r"^SAMPLE events: (\d+)", out, re.M).group(1))  # type: ignore[union-attr]
    t_script, _ = timed(
        ["perf", "script", "-i", str(data), "-G", "-F", "comm,pid,tid,cpu,time,ip", "--ns"],
        a.repeat,
    )
    size = data.stat().st_size
    print(
        f"file: {size / 1e6:.1f} MB, {total} records, {samples} samples "
        f"(recorded {a.seconds:g}s at {a.freq} Hz on all CPUs, dwarf 8192)\n"
    )
    print(f"| tool | best of {a.repeat} (s) | records/s | unwindd speed vs this tool |")
    print("|---|---:|---:|---:|")
    for name, t in (
        ("unwindd replay --format summary", t_u),
        ("perf script -G -F comm,pid,tid,cpu,time,ip", t_script),
    ):
        print(f"| {name} | {t:.3f} | {total / t:,.0f} | {t / t_u:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
