"""What a big JSON ``/v1/stacks`` answer raises a running daemon's RSS by, for a fast and a
slow reader, in this tree and in an older one. Run by hand, as root (perf and
``/proc/PID/clear_refs``), not in CI.

    python3 bench/bench_json_answer.py [--before OLD/daemon] [--runs 25] [--rounds 3]
        [--frequency 499]

Each version in turn (the older first) runs its daemon (``unwindd run``, ``PYTHONPATH`` = its
daemon dir, sampling the whole machine at ``--frequency``) alone: it waits for the socket,
runs ``tests/support/workloads/deep.c`` ``--runs`` times, one process each (stacks of many
depths, up to ~180 frames: ~140 entries of ~12 KB of JSON per run), then ``--rounds`` times a
fast and a slow read of the whole window (``/v1/stacks?since=3600``: up to ``[api]
max_stacks`` stacks): curl to /dev/null, and an HTTP/1.0 client taking 64 KiB every 5 ms.
Before each read it waits 12 s (a heap trim, every 10 s, hands back what the last one
freed) and resets the peak RSS (``echo 5 > /proc/PID/clear_refs``). Printed per read: the
answer's size, its time, the RSS before it and VmHWM minus that (what the answer raised the
RSS by); per daemon, its store and glibc heap (``/v1/status``) before each read. The
daemons sample the whole machine, so the stores (and answers) of two versions differ by what
else ran meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

from workloads.build import build_deep  # noqa: E402


def status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class Daemon:
    def __init__(self, name: str, daemon_dir: str, tmp: Path, frequency: int) -> None:
        self.name = name
        d = tmp / name
        d.mkdir()
        self.sock = d / "unwindd.sock"
        cfg = d / "config.toml"
        cfg.write_text(f'[sampling]\nfrequency = {frequency}\n'
                       f'[api]\nsocket = "{self.sock}"\nrequest_timeout = 60.0\n'
                       f'[metrics]\nenabled = false\n[cache]\ndir = "{d / "cache"}"\n')
        env = {**os.environ, "PYTHONPATH": daemon_dir}
        self.log = open(d / "log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "unwindd.cli", "run", "--config",
                                      str(cfg)], env=env, stderr=self.log,
                                     stdout=subprocess.DEVNULL)  # fmt: skip

    def get(self, target: str) -> bytes:
        return subprocess.run(["curl", "-sS", "--unix-socket", str(self.sock),
                               f"http://x{target}"], capture_output=True, check=True,
                              timeout=600).stdout  # fmt: skip

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                json.loads(self.get("/v1/status"))
                return
            except (subprocess.CalledProcessError, json.JSONDecodeError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit(f"{self.name}: the daemon did not start") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def read_fast(d: Daemon, target: str) -> int:
    out = subprocess.run(["curl", "-sS", "--unix-socket", str(d.sock), "-o", "/dev/null",
                          "-w", "%{size_download}", f"http://x{target}"], capture_output=True,
                         check=True, timeout=600, text=True).stdout  # fmt: skip
    return int(out)


def read_slow(d: Daemon, target: str) -> int:
    """HTTP/1.0 (the body ends with the connection), 64 KiB every 5 ms."""
    n = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        s.connect(str(d.sock))
        s.sendall(f"GET {target} HTTP/1.0\r\n\r\n".encode())
        while chunk := s.recv(65536):
            n += len(chunk)
            time.sleep(0.005)
    return n


def bench(d: Daemon, deep: list[str], runs: int, rounds: int) -> None:
    d.wait_ready()
    for _ in range(runs):
        subprocess.run(deep, check=True, stdout=subprocess.DEVNULL)
    time.sleep(3)  # the last records ordered and stored
    pid = d.proc.pid
    target = "/v1/stacks?since=3600"
    for _ in range(rounds):
        for reader in (read_fast, read_slow):
            time.sleep(12)
            st = json.loads(d.get("/v1/status"))
            heap = st["memory"]["heap"] or {}
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            rss = status_kb(pid, "VmRSS")
            t0 = time.monotonic()
            n = reader(d, target)
            dt = time.monotonic() - t0
            rise = status_kb(pid, "VmHWM") - rss
            print(f"{d.name:8s} {reader.__name__[5:]:6s} {n:11d} {dt:6.2f} {rss:10d} "
                  f"{rise:10d} {st['store']['entries']:8d} {st['store']['bytes'] >> 10:9d} "
                  f"{heap.get('arena_bytes', 0) >> 10:10d} {heap.get('in_use_bytes', 0) >> 10:9d}",
                  flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="an older checkout's daemon/ dir, run first")
    ap.add_argument("--runs", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--frequency", type=int, default=499)
    args = ap.parse_args()
    if not shutil.which("curl"):
        raise SystemExit("curl is needed")
    tmp = Path(tempfile.mkdtemp(prefix="bench-json-"))
    deep = list(build_deep(tmp / "wl").argv)
    versions = [("after", str(ROOT / "daemon"))]
    if args.before:
        versions.insert(0, ("before", args.before))
    print(f"load: {os.getloadavg()[0]:.2f}")
    print(f"{'daemon':8s} {'reader':6s} {'bytes':>11s} {'s':>6s} {'RSS KiB':>10s} "
          f"{'rise KiB':>10s} {'entries':>8s} {'store KiB':>9s} {'arena KiB':>10s} "
          f"{'used KiB':>9s}")  # fmt: skip
    try:
        for name, daemon_dir in versions:
            d = Daemon(name, daemon_dir, tmp, args.frequency)
            try:
                bench(d, deep, args.runs, args.rounds)
            finally:
                d.stop()
        print(f"load after: {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
