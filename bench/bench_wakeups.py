"""The daemon's fixed costs: how often it steps on a steady load, and what it spends with
nothing to sample once a Python process was sampled; old vs new code alternated.

    PYTHONPATH=daemon python3 bench/bench_wakeups.py [--seconds 10] [--freq 999] [--runs 3]
                                                     [--before DIR]

Busy: one ``chain_o2`` re-exec loop per CPU (bench_daemon.py's load), the daemon at ``--freq``
Hz with its defaults otherwise; after a 4 s warm-up, over ``--seconds``: its CPU (every
thread's on-CPU time, /proc/<pid>/task/*/schedstat, in ns), per second and per sample
(``/v1/status``), and its steps per second (``unwindd_step_seconds_count`` from /metrics).
Idle after Python: the daemon sampling one CPython process only (``target = "pids"``, 99 Hz)
that spins 6 s (sampled, its frames read by the Python frame reader) and then sleeps; from
12 s on, over 15 s: the daemon's CPU per second, with nothing left to sample (its loop's
ticks and its threads' wakeups). "unwindd" is the package the bench's own PYTHONPATH finds;
``--before DIR``: the same for ``PYTHONPATH=DIR``, runs alternated; medians printed last.
Root is needed (system-wide sampling).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from bench_daemon import http  # noqa: E402
from workloads.build import PYTHON, build_workloads  # noqa: E402


def cpu_ns(pid: int) -> int:
    total = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((t / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that just ended
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def steps(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    m = re.search(r"^unwindd_step_seconds_count(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(m[1]) if m else 0.0


def start(tmp: Path, pythonpath: str | None, sampling: str
          ) -> tuple[subprocess.Popen[bytes], str, int]:  # fmt: skip
    sock, port = str(tmp / "d.sock"), free_port()
    cfg = tmp / "d.toml"
    cfg.write_text(f'[sampling]\n{sampling}[api]\nsocket = "{sock}"\n'
                   f'[metrics]\nlisten = "127.0.0.1:{port}"\n')  # fmt: skip
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    d = subprocess.Popen([sys.executable, "-m", "unwindd.cli", "run", "--config", str(cfg)],
                         stderr=subprocess.DEVNULL, env=env)  # fmt: skip
    while not os.path.exists(sock):
        if d.poll() is not None:
            raise SystemExit(f"the daemon exited ({d.returncode})")
        time.sleep(0.05)
    return d, sock, port


def busy(tmp: Path, pythonpath: str | None, freq: int, seconds: float) -> dict[str, float]:
    d, sock, port = start(tmp, pythonpath, f"frequency = {freq}\n")
    try:
        time.sleep(4.0)
        s0, n0, c0, t0 = json.loads(http(sock, "/v1/status")), steps(port), cpu_ns(d.pid), \
            time.monotonic()  # fmt: skip
        time.sleep(seconds)
        s1, n1, c1, t1 = json.loads(http(sock, "/v1/status")), steps(port), cpu_ns(d.pid), \
            time.monotonic()  # fmt: skip
    finally:
        d.terminate()
        d.wait(30)
    wall, samples = t1 - t0, s1["samples"] - s0["samples"]
    return {"cpu_ms_per_s": (c1 - c0) / 1e6 / wall, "steps_per_s": (n1 - n0) / wall,
            "samples": samples, "us_per_sample": (c1 - c0) / 1e3 / max(samples, 1),
            "lost": s1["lost"] - s0["lost"] + s1["lost_samples"] - s0["lost_samples"]}  # fmt: skip


def idle_after_python(tmp: Path, pythonpath: str | None) -> dict[str, float]:
    spin = ("import time\nt = time.time()\nwhile time.time() - t < 6: sum(range(1000))\n"
            "time.sleep(1e6)")
    p = subprocess.Popen([PYTHON, "-c", spin])
    try:
        d, _, port = start(tmp, pythonpath, f'target = "pids"\npids = [{p.pid}]\nfrequency = 99\n')
        try:
            time.sleep(12.0)  # the process spun (sampled, read) and sleeps since
            n0, c0, t0 = steps(port), cpu_ns(d.pid), time.monotonic()
            time.sleep(15.0)
            n1, c1, t1 = steps(port), cpu_ns(d.pid), time.monotonic()
        finally:
            d.terminate()
            d.wait(30)
    finally:
        p.kill()
        p.wait()
    wall = t1 - t0
    return {"idle_cpu_ms_per_s": (c1 - c0) / 1e6 / wall, "idle_steps_per_s": (n1 - n0) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--freq", type=int, default=999)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--before", type=Path, help="PYTHONPATH of an older unwindd, also timed")
    args = ap.parse_args()
    codes: dict[str, str | None] = {"unwindd": None}
    if args.before:
        codes["before"] = str(args.before)
    per: dict[str, dict[str, list[float]]] = {c: {} for c in codes}
    tmp = Path(tempfile.mkdtemp(prefix="unwindd-wakeups-"))
    os.chmod(tmp, 0o755)
    wl = build_workloads(tmp / "wl")["c_o2"]
    loop = f'while :; do "{wl.argv[0]}" 100 >/dev/null; done'
    try:
        for i in range(args.runs):
            for name, pp in codes.items():
                load = [subprocess.Popen(["sh", "-c", loop], start_new_session=True)
                        for _ in range(os.cpu_count() or 1)]  # fmt: skip
                try:
                    r = busy(tmp, pp, args.freq, args.seconds)
                finally:
                    for q in load:
                        os.killpg(q.pid, signal.SIGKILL)
                        q.wait()
                r.update(idle_after_python(tmp, pp))
                r["load1"] = float(Path("/proc/loadavg").read_text().split()[0])
                for k, v in r.items():
                    per[name].setdefault(k, []).append(float(v))
                print(f"run {i + 1} {name}: {json.dumps({k: round(v, 2) for k, v in r.items()})}",
                      flush=True)  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, xs in per.items():
        med = {k: round(statistics.median(v), 2) for k, v in xs.items()}
        print(f"medians of {args.runs}, {name}: {json.dumps(med)}")


if __name__ == "__main__":
    main()
