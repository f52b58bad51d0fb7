"""Daemon CPU per sample vs ``perf record --call-graph dwarf`` with the same settings, in the
same run, plus lost samples and /v1/stacks query latency while sampling.

    python3 bench/bench_daemon.py [--seconds 10] [--freqs 99,1000] [--stack-size 8192]
                                  [--rounds 100] [--repeat N] [--before DIR]
                                  [--ring-pages 256|0|64,0,256] [--record] [--warmup 3]
                                  [--floor]

For each frequency, with a steady load (one C workload looping per CPU, re-run every
``--rounds`` rounds: by default twice a second, so every half second brings new processes):
- unwindd: started from a temp config, warmed up (cold ELF loads happen first and are not
  what we measure; ``--warmup`` seconds, 3 by default: a young daemon, to which most stacks
  of the load are still new; a minute or more: an always-on daemon's steady state on the same
  load), then two windows of the same length: sampling only (its CPU time, utime
  + stime from /proc/<pid>/stat, per sample; samples and lost from /v1/status: the cost to
  compare with perf record, which serves no queries), then with ``/v1/stacks?since=10`` and
  ``/v1/top?since=10`` issued every 200 ms (their p50/p99 latency, and the CPU per sample
  with that query load, keys prefixed ``q_``);
- perf record -a -F F --call-graph dwarf,STACK for the same window, CPU from wait4's rusage,
  samples and lost from ``perf report --stats`` (it only writes; it does not unwind). That CPU
  includes perf's fixed start and end (~0.2 s here: a 10 s window's 20k samples look 3x dearer
  than a 30 s window's), which the daemon's windows do not: so it runs again for twice the
  window, and ``perf_marginal`` is its CPU per sample between the two runs, the cost to
  compare an always-on daemon's with.
With ``--repeat N`` each frequency is measured N times, the runs alternated (unwindd, the
``--before`` build, perf record, then again), and the medians printed last: on a shared,
noisy machine only measurements taken side by side compare. ``--before DIR``: also an older
unwindd from ``PYTHONPATH=DIR`` (e.g. ``pip install --no-deps --target DIR`` of an older
checkout), its sampling window only.
With ``--floor``, a consumer that only reads: the daemon's own rings (``PerfSession``, the same
config and ring size), woken by the same half-ring watermark or a 100 ms tick, every record
drained into an arena (``drain_into``: the live step's copy, stacks cut to what the kernel
filled) and its header read to count the samples, nothing else: what any reader of these
rings pays before it unwinds anything, the floor under the daemon's cost.
With ``--record``, ``unwindd record --all --format folded`` too (and the ``--before`` build's):
warmed up the same 3 s, its CPU over the same window per sample it counted.
Root is needed (system-wide sampling).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

from workloads.build import build_workloads  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def http(sock: str, target: str) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(sock)
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        buf = b""
        while chunk := s.recv(1 << 16):
            buf += chunk
    return buf.partition(b"\r\n\r\n")[2]


def bench_daemon(freq: int, seconds: float, stack: int, tmp: Path, pythonpath: str | None = None,
                 with_queries: bool = True, ring_pages: int = 256,
                 warmup: float = 3.0) -> dict[str, float]:  # fmt: skip
    sock = str(tmp / f"d{freq}.sock")
    cfg = tmp / f"d{freq}.toml"
    rings = f"ring_pages = {ring_pages}\n" if ring_pages else ""  # 0: the daemon's auto size
    cfg.write_text(f'[sampling]\nfrequency = {freq}\nstack_size = {stack}\n{rings}'
                   f'[api]\nsocket = "{sock}"\n[metrics]\nenabled = false\n')  # fmt: skip
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    d = subprocess.Popen([sys.executable, "-m", "unwindd.cli", "run", "--config", str(cfg)],
                         stderr=subprocess.DEVNULL, env=env)  # fmt: skip
    try:
        while not os.path.exists(sock):
            time.sleep(0.05)
        time.sleep(warmup)  # warm-up: cold binaries parsed (longer: the steady state)
        # Window 1, sampling only: the cost to compare with perf record, which serves no
        # queries. Window 2, the same length with the query load: its latencies, and what the
        # queries add on top.
        out: dict[str, float] = {}
        for label, queries in (("", False), ("q_", True))[: 2 if with_queries else 1]:
            s0 = json.loads(http(sock, "/v1/status"))
            c0, t0 = cpu_seconds(d.pid), time.monotonic()
            lat: dict[str, list[float]] = {"stacks": [], "top": []}
            while time.monotonic() - t0 < seconds:
                if queries:
                    for name in lat:
                        q0 = time.perf_counter()
                        http(sock, f"/v1/{name}?since=10&limit=1000")
                        lat[name].append(time.perf_counter() - q0)
                time.sleep(0.2)
            c1, t1 = cpu_seconds(d.pid), time.monotonic()
            s1 = json.loads(http(sock, "/v1/status"))
            samples = s1["samples"] - s0["samples"]
            out.update({
                f"{label}cpu_s": c1 - c0, f"{label}wall_s": t1 - t0, f"{label}samples": samples,
                f"{label}lost": s1["lost"] - s0["lost"] + s1["lost_samples"] - s0["lost_samples"],
                f"{label}us_per_sample": (c1 - c0) / max(samples, 1) * 1e6,
            })  # fmt: skip
            # since start, warm-up included: its cold ELF loads stall steps the most
            out["lost_since_start"] = s1["lost"] + s1["lost_samples"]
            out["ring_pages"] = s1.get("rings", {}).get("pages", 0)
            for name, xs in lat.items():
                if xs:
                    xs.sort()
                    out[f"{name}_p50_ms"] = statistics.median(xs) * 1e3
                    out[f"{name}_p99_ms"] = xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e3
    finally:
        d.terminate()
        d.wait(30)
    return out


def bench_record(freq: int, seconds: float, stack: int, ring_pages: int,
                 pythonpath: str | None = None) -> dict[str, float]:  # fmt: skip
    """``unwindd record --all --format folded`` on the same load, warmed up like the daemon
    (3 s), then its CPU over a window of ``seconds`` and the samples it counted meanwhile (its
    ``--status-interval`` lines, read as they come: the counts at the window's two ends)."""
    argv = [sys.executable, "-m", "unwindd.cli", "record", "--all", "-F", str(freq),
            "--stack-size", str(stack), "--ring-pages", str(ring_pages), "--format", "folded",
            "--status-interval", "0.25", "--duration", str(3 + seconds + 2)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=env)  # fmt: skip
    assert p.stderr is not None
    last = [0]

    def read() -> None:
        assert p.stderr is not None
        for line in p.stderr:
            if m := re.search(r" samples=(\d+) ", line):
                last[0] = int(m[1])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while not last[0]:  # sampling once it prints a count
        time.sleep(0.05)
    time.sleep(3.0)  # warm-up, as the daemon's
    c0, s0, t0 = cpu_seconds(p.pid), last[0], time.monotonic()
    time.sleep(seconds)
    c1, s1, t1 = cpu_seconds(p.pid), last[0], time.monotonic()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    reader.join(5)
    samples = s1 - s0
    return {"cpu_s": c1 - c0, "wall_s": t1 - t0, "samples": samples,
            "us_per_sample": (c1 - c0) / max(samples, 1) * 1e6,
            "total_cpu_s": ru.ru_utime + ru.ru_stime, "rc": p.returncode}  # fmt: skip


# The --floor consumer, run as its own process so its CPU is its own (argv: freq, stack size,
# ring pages (0: the daemon's auto size), seconds, warm-up seconds). Sample records are
# counted by their header's type (PERF_RECORD_SAMPLE, include/uapi/linux/perf_event.h), the
# only Python per record.
FLOOR = """
import json, resource, select, struct, sys, time
from unwindd.source.perfcore import PerfSession
from unwindd.source.sampling import SamplingConfig, Target
freq, stack, pages, seconds, warm = (float(x) for x in sys.argv[1:])
s = PerfSession.open(Target(all_cpus=True), SamplingConfig(
    frequency=int(freq), stack_size=int(stack), ring_pages=int(pages)))
arena = bytearray((s.config.ring_pages * 4096 + 65536) * len(s.fds))  # every ring, full
ep = select.epoll()
for fd in s.fds:
    ep.register(fd, select.EPOLLIN)
s.enable()
hdr = struct.Struct("<IHH").unpack_from
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
samples, nbytes, t_end, c0, n0, b0 = 0, 0, time.monotonic() + warm + seconds, None, 0, 0
t_warm = time.monotonic() + warm
while (now := time.monotonic()) < t_end:
    if c0 is None and now >= t_warm:
        c0, n0, b0 = cpu(), samples, nbytes
    ep.poll(0.1)
    mv = memoryview(arena)
    off = 0
    for _cpu, size in s.drain_into(arena):
        nbytes += size
        end = off + size
        while off < end:
            typ, _misc, rsize = hdr(mv, off)
            samples += typ == 9
            off += rsize
c1 = cpu()
n = samples - n0
print(json.dumps({"cpu_s": c1 - c0, "samples": n, "bytes_per_sample": (nbytes - b0) / max(n, 1)}))
"""


def bench_floor(freq: int, seconds: float, stack: int, ring_pages: int) -> dict[str, float]:
    """The --floor consumer's CPU per sample over a window of ``seconds`` (after 3 s)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "daemon")}
    out = subprocess.run([sys.executable, "-c", FLOOR, str(freq), str(stack),
                          str(ring_pages), str(seconds), "3"],
                         capture_output=True, text=True, env=env, check=True)  # fmt: skip
    r = json.loads(out.stdout)
    return {**r, "us_per_sample": r["cpu_s"] / max(r["samples"], 1) * 1e6}


def bench_perf(freq: int, seconds: float, stack: int, tmp: Path) -> dict[str, float]:
    data = tmp / f"perf{freq}.data"
    argv = ["perf", "record", "-q", "-a", "-F", str(freq), "-e", "cpu-clock", "--call-graph",
            f"dwarf,{stack}", "-o", str(data), "--", "sleep", str(seconds)]
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    res = subprocess.run(["perf", "report", "--stats", "-i", str(data)], capture_output=True,
                         text=True)  # fmt: skip
    stats = res.stdout
    if "SAMPLE events" not in stats:
        print(f"perf report --stats failed: {res.stderr[-500:]}", file=sys.stderr)
    samples = int(m[1]) if (m := re.search(r"SAMPLE events:\s+(\d+)", stats)) else 0
    lost = int(m[1]) if (m := re.search(r"LOST events:\s+(\d+)", stats)) else 0
    cpu = ru.ru_utime + ru.ru_stime
    size = data.stat().st_size
    data.unlink()
    return {"cpu_s": cpu, "samples": samples, "lost": lost,
            "us_per_sample": cpu / max(samples, 1) * 1e6, "file_mb": size / 1e6}  # fmt: skip


def marginal(short: dict[str, float], long: dict[str, float]) -> dict[str, float]:
    """perf record's CPU per sample between two runs of different lengths: its fixed cost (the
    start, the end's build-id pass over the file's header and maps) taken out, its per-sample
    work kept (the copy and write of each record, the end's pass over every record)."""
    dn = long["samples"] - short["samples"]
    return {"cpu_s": long["cpu_s"] - short["cpu_s"], "samples": dn,
            "us_per_sample": (long["cpu_s"] - short["cpu_s"]) / max(dn, 1) * 1e6,
            "fixed_s": short["cpu_s"] - short["samples"] * (long["cpu_s"] - short["cpu_s"])
            / max(dn, 1)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--freqs", default="99,1000")
    ap.add_argument("--stack-size", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=100,
                    help="the workload's rounds per run: 100 re-runs it about twice a second "
                    "(every run a new process, its stacks new to the daemon); a large number "
                    "keeps one process per CPU for the whole run (stacks seen before)")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--warmup", type=float, default=3.0,
                    help="seconds the daemon runs before its windows: 3 measures a young "
                    "daemon (most stacks new to it); 60 or more the steady state of an "
                    "always-on one on this load")  # fmt: skip
    ap.add_argument("--before", type=Path, help="PYTHONPATH of an older unwindd, also timed")
    ap.add_argument("--record", action="store_true",
                    help="also time unwindd record --all --format folded (and --before's)")
    ap.add_argument("--floor", action="store_true",
                    help="also time a consumer that only drains the same rings")
    ap.add_argument("--ring-pages", default="256",
                    help="the daemon's [sampling] ring_pages; 0: its auto size; a comma list "
                    "runs each (alternated), named unwindd@N")  # fmt: skip
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        os.chmod(tmp, 0o755)
        wl = build_workloads(tmp / "wl")["c_o2"]
        # One looping workload per CPU: steady, known stacks for the whole run.
        loop = f'while :; do "{wl.argv[0]}" {args.rounds} >/dev/null; done'
        load = [subprocess.Popen(["sh", "-c", loop], start_new_session=True)
                for _ in range(os.cpu_count() or 1)]
        try:
            for f in (int(x) for x in args.freqs.split(",")):
                per: dict[str, list[float]] = {}
                for _ in range(args.repeat):
                    sizes = [int(x) for x in args.ring_pages.split(",")]
                    runs = {}
                    for rp in sizes:
                        name = "unwindd" if len(sizes) == 1 else f"unwindd@{rp}"
                        runs[name] = bench_daemon(f, args.seconds, args.stack_size, tmp,
                                                  ring_pages=rp, warmup=args.warmup)  # fmt: skip
                    if args.before is not None:
                        runs["before"] = bench_daemon(f, args.seconds, args.stack_size, tmp,
                                                      str(args.before), False,
                                                      warmup=args.warmup)  # fmt: skip
                    if args.record:
                        rp = int(args.ring_pages.split(",")[0])
                        runs["record"] = bench_record(f, args.seconds, args.stack_size, rp)
                        if args.before is not None:
                            runs["record_before"] = bench_record(f, args.seconds,
                                                                 args.stack_size, rp,
                                                                 str(args.before))  # fmt: skip
                    if args.floor:
                        rp = int(args.ring_pages.split(",")[0])
                        runs["floor"] = bench_floor(f, args.seconds, args.stack_size, rp)
                    runs["perf"] = bench_perf(f, args.seconds, args.stack_size, tmp)
                    # its cost per added sample, its fixed start and end taken out (the
                    # daemon's windows have none): a second run twice as long
                    longer = bench_perf(f, 2 * args.seconds, args.stack_size, tmp)
                    runs["perf_marginal"] = marginal(runs["perf"], longer)
                    for name, r in runs.items():
                        per.setdefault(name, []).append(r["us_per_sample"])
                        shown = json.dumps({k: round(v, 2) for k, v in r.items()})
                        print(f"F={f} {name + ':':8s} {shown}")
                    sys.stdout.flush()
                if args.repeat > 1:
                    med = {k: round(statistics.median(v), 2) for k, v in per.items()}
                    print(f"F={f} medians of {args.repeat}, us CPU per sample: {json.dumps(med)}")
        finally:
            for pr in load:  # each loop is its own process group: the shell and its child
                os.killpg(pr.pid, signal.SIGKILL)
                pr.wait()


if __name__ == "__main__":
    main()
