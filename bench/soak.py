"""Soak: the daemon at its defaults and at 999 Hz for a long run on a machine kept busy with
churn, watched for memory growth, CPU per sample, lost samples, errors and crashes.

    python3 bench/soak.py [--minutes 30] [--freqs default,999] [--warmup-minutes 5]
                          [--rate 200] [--every 10] [--query-every 3]

For each frequency ("default": the daemon's own configuration, only the socket, the metrics
port and the cache directory set) one ``unwindd run`` is started and, for ``--minutes``:
- churn: ``--rate`` short-lived processes per second of varied installed binaries (gzip, xz,
  bzip2, perl, sqlite3, git, sort, awk, sha256sum; python3, node and ``gcc -c`` of a small C
  file less often: their start-up costs tens of ms), spawned on an absolute schedule with at
  most ``--inflight`` alive at once (the rate achieved is reported);
- a dlopen/dlclose loop (python ctypes, the system's shared libraries in turn: mappings come
  and go in one long-lived pid) and a Python process recursing ~2,000 frames deep, forever;
- every ``--query-every`` s one query in turn over the socket (/v1/top, /v1/stacks as json,
  folded and pprof, /v1/processes, /v1/status) and a /metrics scrape; every 10th round
  ``unwindctl top`` as a user runs it;
- every ``--every`` s the daemon's RSS (VmRSS) and its anonymous and file-backed parts
  (statm), CPU (utime + stime) and counters, and the bytes of its two capped structures (ELF
  cache, store: /v1/status), which grow to their caps ([cache] max_bytes, [store] max_bytes)
  by design.
Reported per run: RSS slope after the warm-up (least squares, MiB/min) and that of RSS minus
the capped structures (what a leak would show as), RSS at the warm-up's end and peak, RSS and
its anonymous and file-backed parts at the end, peak and median after the warm-up (one
query's temporaries make single samples jumpy), the machine's load average, CPU per
sample (whole run and after warm-up), samples, lost records and samples (unwindd_lost_*;
lost records after the warm-up, and in how many of its trace intervals), the records the ring
spill kept and the times it was full (unwindd_ring_spill*),
throttled, query latency p50/p99, errors (5xx, failed queries, unwindctl exit != 0) and
whether the daemon exited. A markdown table for BENCHMARKS.md is printed last, and the RSS
trace with ``--trace``. The daemon runs at niceness ``--daemon-nice`` (0, as systemd starts
it), the churn and the queries at soak.py's own (both reported). Root is needed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_daemon import ROOT, cpu_seconds  # also puts tests/support on sys.path
from daemonutil import UNWINDCTL, UNWINDD, free_port, metric_values, raw_http

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
_MP = multiprocessing.get_context("fork")

SMALL_C = "int sq(int x) { return x * x; }\nint main(void) { return sq(3) - 9; }\n"

# A few hundred frames of Python recursion, recomputed forever: deep interpreter stacks.
DEEP_PY = """
import sys
sys.setrecursionlimit(10000)
def down(n):
    return sum(i * i for i in range(50)) if n == 0 else down(n - 1) + 1
while True:
    down(2000)
"""

# dlopen/dlclose of the system's shared libraries in turn, forever (ctypes.CDLL is dlopen;
# _ctypes.dlclose the matching close), so mappings come and go in one pid.
DLOPEN_PY = """
import _ctypes, ctypes, sys, time
libs = sys.argv[1:]
while True:
    for lib in libs:
        try:
            h = ctypes.CDLL(lib, mode=ctypes.RTLD_LOCAL)
        except OSError:
            continue
        _ctypes.dlclose(h._handle)
        time.sleep(0.01)
"""

# Libraries without side effects at load (no threads, no daemons started by constructors).
DLOPEN_LIBS = ("libz.so.1", "libbz2.so.1.0", "liblzma.so.5", "libsqlite3.so.0", "libexpat.so.1",
               "libffi.so.8", "libgmp.so.10", "libmpfr.so.6", "libreadline.so.8",
               "libncursesw.so.6", "libcrypto.so.3", "libssl.so.3", "libxml2.so.2",
               "libzstd.so.1", "libpcre2-8.so.0", "libuuid.so.1", "libsqlite3.so.0")

QUERIES = ("/v1/top?since=60&limit=50", "/v1/stacks?since=60&limit=200",
           "/v1/stacks?since=60&format=folded", "/v1/stacks?since=60&format=pprof",
           "/v1/processes?limit=200", "/v1/status")  # fmt: skip


def churn_commands(tmp: Path) -> list[tuple[int, list[str]]]:
    """(weight, argv) of what is installed; the costly start-ups weigh less."""
    data = tmp / "data.txt"
    data.write_text("".join(f"line {i} {i * 7919 % 1000}\n" for i in range(2000)))
    (tmp / "small.c").write_text(SMALL_C)
    d = str(data)
    cands: list[tuple[int, list[str]]] = [
        (6, ["gzip", "-c", d]), (3, ["xz", "-0", "-c", d]), (3, ["bzip2", "-c", d]),
        (6, ["sha256sum", d]), (6, ["sort", "-k3n", d]), (6, ["awk", "{s+=$3} END {print s}", d]),
        (4, ["perl", "-ne", "$s += (split)[2]; END { print $s }", d]),
        (4, ["sqlite3", ":memory:", "with recursive c(x) as (select 1 union all select x+1 "
             "from c where x < 5000) select sum(x) from c;"]),
        (3, ["git", "--version"]), (3, ["git", "hash-object", d]),
        (1, [sys.executable, "-c", "import json; json.dumps(list(range(1000)))"]),
        (1, ["node", "-e", "let s = 0; for (let i = 0; i < 1e5; i++) s += i"]),
        (1, ["gcc", "-c", "-O1", "-o", str(tmp / "small.o"), str(tmp / "small.c")]),
    ]  # fmt: skip
    return [(w, argv) for w, argv in cands if shutil.which(argv[0])]


@dataclass
class Churn:
    """Spawns ``rate`` processes per second from ``commands`` until ``stop`` is set, and reaps
    them. Runs in a process of its own (``start``): its ``waitpid(-1)`` must not reap the
    daemon or the queries' processes. ``counts``: started, failed to spawn, schedule slots
    skipped because ``inflight`` were alive."""

    commands: list[tuple[int, list[str]]]
    rate: float
    inflight: int
    stop: Any = field(default_factory=lambda: _MP.Event())
    counts: Any = field(default_factory=lambda: _MP.Array("q", 3))
    proc: Any = None

    def start(self) -> None:
        self.proc = _MP.Process(target=self.run, daemon=True)
        self.proc.start()

    def finish(self) -> tuple[int, int, int]:
        self.stop.set()
        if self.proc is not None:
            self.proc.join(60)
        return self.counts[0], self.counts[1], self.counts[2]

    def run(self) -> None:
        rng = random.Random(1)
        argvs = [argv for _, argv in self.commands]
        weights = [w for w, _ in self.commands]
        alive = 0
        devnull = os.open(os.devnull, os.O_RDWR)
        actions = [(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, devnull, 1),
                   (os.POSIX_SPAWN_DUP2, devnull, 2)]  # fmt: skip
        t0, n = time.monotonic(), 0
        while not self.stop.is_set():
            while alive:  # reap whatever ended
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
                alive -= 1
            n += 1
            if (late := time.monotonic() - (t0 + n / self.rate)) < 0:
                time.sleep(-late)
            if alive >= self.inflight:
                self.counts[2] += 1
                continue
            argv = rng.choices(argvs, weights)[0]
            try:
                os.posix_spawnp(argv[0], argv, os.environ, file_actions=actions)
                alive += 1
                self.counts[0] += 1
            except OSError:
                self.counts[1] += 1
        while alive:
            os.waitpid(-1, 0)
            alive -= 1


def lib_paths() -> list[str]:
    dirs = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")
    return [f"{d}/{n}" for n in DLOPEN_LIBS for d in dirs if os.path.exists(f"{d}/{n}")][:16]


def rss_bytes(pid: int) -> tuple[int, int]:
    """(RSS, its anonymous part): statm's resident and resident - shared (file-backed pages:
    libraries and the cache dir's mapped tables, which the kernel can share and reclaim)."""
    f = Path(f"/proc/{pid}/statm").read_text().split()
    return int(f[1]) * PAGE, (int(f[1]) - int(f[2])) * PAGE


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return str(r.read().decode())


def total(text: str, name: str) -> float:
    return sum(metric_values(text, name + "_total").values())


def slope_mib_per_min(points: list[tuple[float, int]]) -> float:
    """Least-squares slope of (seconds, bytes) in MiB per minute."""
    if len(points) < 2:
        return 0.0
    return float(statistics.linear_regression([t for t, _ in points],
                                              [b for _, b in points]).slope) * 60 / MIB


def soak(freq: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    sock, port = tmp / f"soak-{freq}.sock", free_port()
    cfg = tmp / f"soak-{freq}.toml"
    sampling = "" if freq == "default" else f"[sampling]\nfrequency = {int(freq)}\n"
    cfg.write_text(f'{sampling}[api]\nsocket = "{sock}"\n[metrics]\nlisten = "127.0.0.1:{port}"\n'
                   f'[cache]\ndir = "{tmp / "cache"}"\n')  # fmt: skip
    log = open(tmp / f"soak-{freq}.log", "wb")
    nice = args.daemon_nice

    def renice() -> None:  # the daemon's own niceness, as a unit would give it
        if nice is not None:
            os.setpriority(os.PRIO_PROCESS, 0, nice)

    d = subprocess.Popen([*UNWINDD, "run", "--config", str(cfg)], stderr=log,
                         stdout=subprocess.DEVNULL, preexec_fn=renice)  # fmt: skip
    churn = Churn(churn_commands(tmp), args.rate, args.inflight)
    side = [subprocess.Popen([sys.executable, "-c", DEEP_PY]),
            subprocess.Popen([sys.executable, "-c", DLOPEN_PY, *lib_paths()])]
    lat: list[float] = []
    errors: list[str] = []
    # t, RSS, CPU s, samples, ELF cache bytes + store bytes (the capped structures), anon RSS,
    # lost records so far
    trace: list[tuple[float, int, float, int, int, int, int]] = []
    done = threading.Event()

    def queries() -> None:
        """One query in turn and a /metrics scrape every ``--query-every`` s; every 10th
        round ``unwindctl top`` too. On a thread of its own: a slow answer delays only the
        next query, not the RSS trace."""
        rounds = 0
        while not done.wait(args.query_every):
            target = QUERIES[rounds % len(QUERIES)]
            q0 = time.perf_counter()
            try:
                status, _, body = raw_http(sock, target, timeout=120)
                lat.append(time.perf_counter() - q0)
                if status != 200:
                    errors.append(f"{target}: {status} {body[:200]!r}")
                scrape(port)
            except OSError as e:
                errors.append(f"{target}: {e!r}")
            if rounds % 10 == 0:
                r = subprocess.run([*UNWINDCTL, "--socket", str(sock), "top", "--since", "60"],
                                   capture_output=True, text=True)  # fmt: skip
                if r.returncode != 0:
                    errors.append(f"unwindctl top: {r.returncode} {r.stderr[-200:]}")
            rounds += 1

    asker = threading.Thread(target=queries, daemon=True)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert d.poll() is None and time.monotonic() < deadline, "daemon did not start"
            time.sleep(0.05)
        churn.start()
        asker.start()
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        next_trace = t0
        while (now := time.monotonic()) < end and d.poll() is None:
            if now >= next_trace:
                next_trace = now + args.every  # after a late read: no burst to catch up
                try:
                    st = json.loads(raw_http(sock, "/v1/status", timeout=120)[2])
                except OSError as e:
                    errors.append(f"/v1/status: {e!r}")
                    continue
                capped = st["cache"]["bytes"] + st["store"]["bytes"]
                rss, anon = rss_bytes(d.pid)
                trace.append((now - t0, rss, cpu_seconds(d.pid), st["samples"], capped, anon,
                              st["lost"]))
            time.sleep(0.1)
        exited = d.poll()
        wall = time.monotonic() - t0
        text = scrape(port) if exited is None else ""
    finally:
        done.set()
        if asker.is_alive():  # (not started when the daemon did not start)
            asker.join(130)
        started, failed, skipped = churn.finish()
        for p in side:
            p.kill()
            p.wait()
        if d.poll() is None:
            d.send_signal(signal.SIGTERM)
            try:
                d.wait(60)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait()
        log.close()
    warm = args.warmup_minutes * 60
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])  # 1, 5, 15 min
    after = [x for x in trace if x[0] >= warm] or [trace[-1]]
    first = next((x for x in trace if x[0] >= warm), trace[-1])
    last = trace[-1]
    lat.sort()
    return {
        "freq": freq, "minutes": round(wall / 60, 1), "exited": exited,
        "exit_code_after_sigterm": d.returncode,
        "churn_per_s": round(started / wall, 1), "churn_failed": failed,
        "churn_skipped": skipped,
        "samples": last[3],
        "rss_warm_mib": round(first[1] / MIB, 1), "rss_end_mib": round(last[1] / MIB, 1),
        "rss_peak_mib": round(max(x[1] for x in trace) / MIB, 1),
        "anon_warm_mib": round(first[5] / MIB, 1), "anon_end_mib": round(last[5] / MIB, 1),
        "anon_peak_mib": round(max(x[5] for x in trace) / MIB, 1),
        "file_warm_mib": round((first[1] - first[5]) / MIB, 1),
        "file_end_mib": round((last[1] - last[5]) / MIB, 1),
        "file_peak_mib": round(max(x[1] - x[5] for x in trace) / MIB, 1),
        "rss_median_mib": round(statistics.median(x[1] for x in after) / MIB, 1),
        "anon_median_mib": round(statistics.median(x[5] for x in after) / MIB, 1),
        "file_median_mib": round(statistics.median(x[1] - x[5] for x in after) / MIB, 1),
        "loadavg": load,
        "rss_slope_mib_min": round(slope_mib_per_min([(x[0], x[1]) for x in after]), 2),
        "uncapped_slope_mib_min":
            round(slope_mib_per_min([(x[0], x[1] - x[4]) for x in after]), 2),
        "capped_end_mib": round(last[4] / MIB, 1),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "daemon_nice": nice,
        "us_per_sample": round(last[2] / max(last[3], 1) * 1e6, 1),
        "us_per_sample_after_warmup":
            round((last[2] - first[2]) / max(last[3] - first[3], 1) * 1e6, 1),
        "cpu_pct": round(last[2] / wall * 100, 1),
        "lost_records": total(text, "unwindd_lost_records"),
        "lost_records_after_warmup": last[6] - first[6],
        "lost_intervals_after_warmup": sum(b[6] > a[6] for a, b in itertools.pairwise(after)),
        "intervals_after_warmup": len(after) - 1,
        "lost_samples": total(text, "unwindd_lost_samples"),
        "spilled_records": total(text, "unwindd_ring_spilled_records"),
        "spill_full": total(text, "unwindd_ring_spill_full"),
        "throttled": total(text, "unwindd_throttled"),
        "process_drops": total(text, "unwindd_process_drops"),
        "query_p50_ms": round(statistics.median(lat) * 1e3, 1) if lat else None,
        "query_p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, 1)
        if lat else None,
        "queries": len(lat), "errors": len(errors), "first_errors": errors[:5],
        "trace": [(round(x[0]), round(x[1] / MIB, 1), round(x[5] / MIB, 1),
                   round((x[1] - x[5]) / MIB, 1), round(x[4] / MIB, 1), x[6]) for x in trace],
    }  # fmt: skip


def table(results: list[dict[str, Any]], warmup: float) -> str:
    rows = [
        ("daemon exited during the run", lambda r: "no" if r["exited"] is None
         else f"**yes ({r['exited']})**"),
        ("minutes run", lambda r: r["minutes"]),
        ("niceness: daemon / churn and queries", lambda r: f"{r['daemon_nice']} / {r['nice']}"),
        ("churn: processes started / s", lambda r: r["churn_per_s"]),
        ("samples", lambda r: f"{r['samples']:,}"),
        (f"RSS at {warmup:g} min (MiB)", lambda r: r["rss_warm_mib"]),
        ("RSS at the end / peak (MiB)", lambda r: f"{r['rss_end_mib']} / {r['rss_peak_mib']}"),
        (f"RSS slope after {warmup:g} min (MiB/min)", lambda r: r["rss_slope_mib_min"]),
        (f"of RSS, anonymous: at {warmup:g} min / end / peak (MiB)",
         lambda r: f"{r['anon_warm_mib']} / {r['anon_end_mib']} / {r['anon_peak_mib']}"),
        (f"of RSS, file-backed: at {warmup:g} min / end / peak (MiB)",
         lambda r: f"{r['file_warm_mib']} / {r['file_end_mib']} / {r['file_peak_mib']}"),
        (f"median after {warmup:g} min: RSS / anonymous / file-backed (MiB)",
         lambda r: f"{r['rss_median_mib']} / {r['anon_median_mib']} / {r['file_median_mib']}"),
        ("load average at the end (1 / 5 / 15 min)", lambda r: r["loadavg"].replace(" ", " / ")),
        ("ELF cache + store bytes at the end (MiB; capped)", lambda r: r["capped_end_mib"]),
        (f"slope of RSS minus those after {warmup:g} min (MiB/min)",
         lambda r: r["uncapped_slope_mib_min"]),
        ("daemon CPU per sample, whole run / after warm-up (us)",
         lambda r: f"{r['us_per_sample']} / {r['us_per_sample_after_warmup']}"),
        ("daemon CPU (% of one core)", lambda r: r["cpu_pct"]),
        ("lost records / lost samples / throttled",
         lambda r: f"{r['lost_records']:g} / {r['lost_samples']:g} / {r['throttled']:g}"),
        ("records the ring spill kept / times it was full",
         lambda r: f"{r['spilled_records']:,.0f} / {r['spill_full']:g}"),
        (f"lost records after {warmup:g} min; trace intervals that lost any",
         lambda r: f"{r['lost_records_after_warmup']:,}; {r['lost_intervals_after_warmup']} of "
                   f"{r['intervals_after_warmup']}"),
        ("query p50 / p99 (ms)", lambda r: f"{r['query_p50_ms']} / {r['query_p99_ms']}"),
        ("queries / errors (5xx, failures)", lambda r: f"{r['queries']} / {r['errors']}"),
    ]  # fmt: skip
    head = "| | " + " | ".join(f"{r['freq']} Hz" if r["freq"] != "default"
                                  else "defaults (99 Hz)" for r in results) + " |"  # fmt: skip
    lines = [head, "|---|" + "---:|" * len(results)]
    lines += [f"| {name} | " + " | ".join(str(f(r)) for r in results) + " |" for name, f in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--freqs", default="default,999",
                    help='comma list: "default" (the daemon\'s own) or Hz')
    ap.add_argument("--warmup-minutes", type=float, default=5)
    ap.add_argument("--rate", type=float, default=200, help="churn processes per second")
    ap.add_argument("--inflight", type=int, default=48, help="churn processes alive at most")
    ap.add_argument("--every", type=float, default=10, help="seconds between RSS samples")
    ap.add_argument("--query-every", type=float, default=3, help="seconds between queries")
    ap.add_argument("--trace", action="store_true", help="print the RSS trace")
    ap.add_argument("--daemon-nice", type=int, default=0,
                    help="the daemon's niceness (default 0, systemd's; the churn keeps "
                    "soak.py's own, e.g. under nice -n 5)")  # fmt: skip
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        os.chmod(tmp, 0o755)
        for freq in args.freqs.split(","):
            r = soak(freq.strip(), args, tmp)
            trace = r.pop("trace")
            print(json.dumps(r), flush=True)
            if args.trace:
                print("trace (s: RSS/anonymous/file-backed/ELF cache + store MiB/lost records "
                      "so far): " + " ".join(f"{t}:{m}/{a}/{f}/{c}/{n}"
                                             for t, m, a, f, c, n in trace))
            results.append(r)
    print(f"\ncommand: python3 bench/soak.py {' '.join(sys.argv[1:])}  (from {ROOT.name})")
    print(table(results, args.warmup_minutes))


if __name__ == "__main__":
    main()
