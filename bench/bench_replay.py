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
- with ``--slow``: ``tests/support/refreplay.py FILE folded``, the Python replay
  (``pipeline/streamreplay.py``, the native replay's reference) to folded stacks;
- ``--format folded --no-cache``: compiled CFI not loaded from the cache dir (a first replay);
- with ``--before DIR``: ``--format folded`` with ``PYTHONPATH=DIR`` (an older checkout's
  ``daemon/``, e.g. from ``git archive``), for a before/after measured in the same run; it
  gets a cache dir of its own (``UNWINDD_CACHE_DIR``, warmed by one untimed run), as symbol
  tables on disk are stamped with the code that wrote them. ``--before-formats
  folded,perf-script,jsonl`` times those formats of it (default folded), and adds ``--format
  jsonl`` of the tree under test when jsonl is among them.

and prints a Markdown table for BENCHMARKS.md, wall time and CPU (user + system of the child:
on a loaded machine wall time mostly measures waiting for a CPU). Every command's stdout goes
to /dev/null-like capture, so terminal speed is not measured. Times are the median of
``--repeat`` runs (the machines are shared: a best-of hides load, a median shows what a user
waits), best also shown.

With ``--rss`` it instead checks issue 3's memory target: it records (``perf record -F 999
--call-graph dwarf,8192`` of a launcher, sampling enabled through ``--control`` only while the
workers run their steady-state loop) the same total CPU work done by ONE python3 process and
by 200 python3 processes running at once, replays each file to folded stacks in a fresh child
and reports each replay's max RSS (``resource.getrusage(RUSAGE_CHILDREN)`` of a wrapper that
runs only that replay). The replay mmaps the file, so file pages it touches count in RSS too:
the file sizes are printed next to it.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import signal
import statistics
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


def timed(argv: list[str], repeat: int, env: dict[str, str] | None = None
          ) -> tuple[float, float, bytes]:  # fmt: skip
    """(median, best) wall seconds of ``repeat`` runs, and the last run's stdout; the CPU
    (user + system) of each run is appended to ``LAST_CPU``."""
    times = []
    out = b""
    for _ in range(repeat):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(argv, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env=env)  # fmt: skip
        times.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        LAST_CPU.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        out = proc.stdout
    return statistics.median(times), min(times), out


LAST_CPU: list[float] = []  # CPU seconds of every timed run, in order


# NPROC python3 processes (each a fresh exec: its own ASLR layout, MMAP2s, COMM, FORK, EXIT)
# run the same steady-state code, PER_PROC s of CPU each; then ONE process burns as much CPU as
# gave the first file its samples, so both files hold about the same number of samples and
# differ only in how many processes ran that code. Sampling is enabled only while they burn
# (`perf record -D -1 --control fifo:...`; side-band records are tracked throughout): 200
# interpreter start-ups and tear-downs are 200x the start-up code, a different workload, not
# the same work spread over more processes.
NPROC = 200
PER_PROC = 0.05
WORK = (
    "import os, sys, time\n"
    "def f(n):\n"
    "    return 0 if n == 0 else (f(n - 1) + n) % 1000003\n"
    "ready, go, done, quit_ = (int(x) for x in sys.argv[2:6])\n"
    "os.write(ready, b'r')\n"
    "os.read(go, 1)\n"
    "i, until = 0, time.process_time() + float(sys.argv[1])\n"
    "while time.process_time() < until:\n"
    "    f(10 + i % 40)\n"
    "    i += 1\n"
    "os.write(done, b'd')\n"
    "os.read(quit_, 1)\n"
)
LAUNCH = (
    "import os, subprocess, sys\n"
    "n, work, secs, ctl, ack = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], "
    "sys.argv[5]\n"
    "pipes = [os.pipe() for _ in range(4)]\n"
    "fds = [pipes[0][1], pipes[1][0], pipes[2][1], pipes[3][0]]\n"
    "ps = [subprocess.Popen([sys.executable, '-c', work, secs, *map(str, fds)], pass_fds=fds)\n"
    "      for _ in range(n)]\n"
    "cf, af = open(ctl, 'w'), open(ack)\n"
    "def perf(cmd):\n"
    "    cf.write(cmd + '\\n'); cf.flush(); af.readline()\n"
    "def gather(fd):\n"
    "    got = 0\n"
    "    while got < n:\n"
    "        got += len(os.read(fd, n - got))\n"
    "gather(pipes[0][0])\n"
    "perf('enable')\n"
    "os.write(pipes[1][1], b'g' * n)\n"
    "gather(pipes[2][0])\n"
    "perf('disable')\n"
    "os.close(pipes[3][1])\n"
    "for p in ps:\n"
    "    p.wait()\n"
)
MAXRSS = (
    "import resource, subprocess, sys\n"
    "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


def rss_bench(tmpdir: Path, repeat: int) -> int:
    rows = []
    secs = PER_PROC
    for nproc in (NPROC, 1):
        path = tmpdir / f"rss{nproc}.data"
        if not path.exists():
            ctl, ack = tmpdir / "perf.ctl", tmpdir / "perf.ack"
            for fifo in (ctl, ack):
                fifo.unlink(missing_ok=True)
                os.mkfifo(fifo)
            subprocess.run(
                ["perf", "record", "-e", "cpu-clock", "-F", "999", "--call-graph", "dwarf,8192",
                 "-D", "-1", "--control", f"fifo:{ctl},{ack}", "-o", str(path), "--",
                 sys.executable, "-c", LAUNCH, str(nproc), WORK, str(secs), str(ctl), str(ack)],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        argv = [sys.executable, "-m", "unwindd.cli", "replay", str(path), "--format", "folded"]
        rss = [int(subprocess.run([sys.executable, "-c", MAXRSS, *argv], check=True,
                                  capture_output=True, text=True).stdout) for _ in range(repeat)]
        summary = subprocess.run([*argv[:-2], "--format", "summary"], check=True,
                                 capture_output=True, text=True).stdout  # fmt: skip
        m = re.search(r"SAMPLE events:\s+(\d+)", summary)
        pids = re.search(r"FORK events:\s+(\d+)", summary)
        rows.append((nproc, path.stat().st_size / 2**20, int(m[1]) if m else -1,
                     int(pids[1]) if pids else 0, statistics.median(rss) / 1024))  # fmt: skip
        secs = rows[0][2] / 999  # the one process: as much CPU as the NPROC file sampled
    rows.reverse()
    print(f"| processes | file MiB | samples | FORK records | replay max RSS MiB (median of "
          f"{repeat}) |")
    print("|---:|---:|---:|---:|---:|")
    for nproc, mib, samples, forks, rss_mib in rows:
        print(f"| {nproc} | {mib:.1f} | {samples} | {forks} | {rss_mib:.1f} |")
    d = rows[1][4] - rows[0][4]
    print(f"\nRSS difference ({NPROC} processes - 1): {d:+.1f} MiB "
          f"(file size difference {rows[1][1] - rows[0][1]:+.1f} MiB)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--freq", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="reuse/keep the perf.data at this path")
    ap.add_argument("--slow", action="store_true",
                    help="also time the Python replay (the reference)")
    ap.add_argument("--rss", action="store_true",
                    help="the 1 vs 200 processes replay RSS check instead")
    ap.add_argument("--rss-dir", type=Path, help="where --rss keeps its recordings")
    ap.add_argument("--before", type=Path, help="PYTHONPATH of an older unwindd, also timed")
    ap.add_argument("--before-formats", default="folded",
                    help="the formats --before times, comma-separated (default folded)")
    args = ap.parse_args()
    if not shutil.which("perf"):
        print("perf is not installed", file=sys.stderr)
        return 2
    if args.rss:
        if args.rss_dir is not None:
            args.rss_dir.mkdir(parents=True, exist_ok=True)
            return rss_bench(args.rss_dir, args.repeat)
        with tempfile.TemporaryDirectory() as d:
            return rss_bench(Path(d), args.repeat)
    tmp = None
    if args.keep is not None:
        path = args.keep
    else:
        tmp = tempfile.TemporaryDirectory()
        path = Path(tmp.name) / "bench.data"
    if not path.exists():
        record(path, args.seconds, args.freq)
    # --no-inline on both sides (perf's inline pass runs addr2line per address); the inline
    # rows below compare the two with it on
    unwindd = [sys.executable, "-m", "unwindd.cli", "replay", str(path), "--no-inline"]
    perf = ["perf", "script", "-i", str(path), "-F", "comm,pid,tid,time,ip,sym,dso", "--ns",
            "--no-inline"]  # fmt: skip
    rows = [
        ("unwindd replay --format folded", [*unwindd, "--format", "folded"]),
        ("unwindd replay --format perf-script", [*unwindd, "--format", "perf-script"]),
        ("perf script -F comm,pid,tid,time,ip,sym,dso --ns --no-inline", perf),
        ("unwindd replay --format perf-script (inline frames)",
         [*unwindd[:-1], "--format", "perf-script"]),
        ("perf script -F comm,pid,tid,time,ip,sym,dso --ns (inline frames)", perf[:-1]),
        ("unwindd replay --format folded --no-cache", [*unwindd, "--format", "folded",
                                                       "--no-cache"]),
    ]  # fmt: skip
    envs: dict[str, dict[str, str]] = {}
    if args.before is not None:
        # A cache dir of its own, warmed by one untimed run: symbol-table files are stamped
        # with the code that wrote them (symstore._code_stamp), so two builds sharing one dir
        # discard and rebuild each other's tables at every alternation (~0.1 s each).
        before_cache = tempfile.mkdtemp(prefix="unwindd-before-cache-")
        fmts = args.before_formats.split(",")
        if "jsonl" in fmts:
            rows.append(("unwindd replay --format jsonl", [*unwindd, "--format", "jsonl"]))
        for fmt in fmts:
            name = f"unwindd replay --format {fmt} (before: PYTHONPATH={args.before})"
            rows.append((name, [*unwindd, "--format", fmt]))
            envs[name] = {**os.environ, "PYTHONPATH": str(args.before),
                          "UNWINDD_CACHE_DIR": before_cache}  # fmt: skip
        timed([*unwindd, "--format", "folded"], 1, envs[rows[-1][0]])
    if args.slow:
        refreplay = str(Path(__file__).resolve().parents[1] / "tests/support/refreplay.py")
        rows.append(("Python replay to folded (tests/support/refreplay.py)",
                     [sys.executable, refreplay, str(path), "folded"]))  # fmt: skip
    # Round-robin (every command once per round), so load changes on the shared machine hit
    # all commands alike.
    runs: dict[str, list[float]] = {name: [] for name, _ in rows}
    cpus: dict[str, list[float]] = {name: [] for name, _ in rows}
    outs: dict[str, bytes] = {}
    for _ in range(args.repeat):
        for name, argv in rows:
            _med, t, outs[name] = timed(argv, 1, envs.get(name))
            runs[name].append(t)
            cpus[name].append(LAST_CPU[-1])
    cpu = {name: statistics.median(ts) for name, ts in cpus.items()}
    times = {name: statistics.median(ts) for name, ts in runs.items()}
    bests = {name: min(ts) for name, ts in runs.items()}
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
    perf_cpu = cpu[rows[2][0]]
    print(f"| command | median of {args.repeat} (s) | best (s) | samples/s | speed-up vs perf "
          "script (medians) | CPU s, user+sys (median) | CPU speed-up vs perf script |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, _ in rows:
        t = times[name]
        print(f"| `{name}` | {t:.3f} | {bests[name]:.3f} | {samples / t:,.0f} | "
              f"{perf_t / t:.2f}x | {cpu[name]:.3f} | {perf_cpu / cpu[name]:.2f}x |")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
