"""The daemon's always-on footprint: memory by kind (private heap vs file-backed, shared) and
CPU, on a busy machine and on an idle one.

    python3 bench/bench_footprint.py [--freq 999] [--seconds 20] [--idle-seconds 60]
                                     [--cache-dir DIR] [--pythonpath DIR] [--no-load]

Busy: one C workload looping per CPU (bench_daemon.py's load; other work on the machine adds
to it), the daemon started with the default config but for the frequency, the API socket and
the cache dir (``--cache-dir``, default a temporary dir warmed by one untimed run first, so the
tables come from disk as they do for a daemon that ran before). After a 5 s warm-up, over
``--seconds``: CPU (utime + stime) per sample; at the end ``/proc/<pid>/smaps_rollup``
(RSS split into anonymous, private file-backed and shared) and the RSS of the mappings of
the cache dir's files (``/proc/<pid>/smaps``), beside the ELF cache's own accounting
(``/v1/status`` ``cache``).
Idle (``--idle-seconds`` > 0): the same daemon with no load started by this script, its CPU
over the window, per second and per sample. Root is needed (system-wide sampling).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from bench_daemon import cpu_seconds, http  # noqa: E402
from workloads.build import build_workloads  # noqa: E402


def smaps(pid: int, cache_dir: str) -> dict[str, int]:
    """KiB by kind from smaps_rollup, and the RSS of mappings of files under ``cache_dir``."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        k, _, v = line.partition(":")
        if v.strip().endswith("kB"):
            out[k] = int(v.split()[0])
    mapped_rss = mapped_size = 0
    cur = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if parts and "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
            cur = len(parts) >= 6 and parts[5].startswith(cache_dir)
        elif cur and parts[0] == "Rss:":
            mapped_rss += int(parts[1])
        elif cur and parts[0] == "Size:":
            mapped_size += int(parts[1])
    out["cache_files_rss"] = mapped_rss
    out["cache_files_size"] = mapped_size
    return out


def run_daemon(freq: int, sock: str, cache_dir: str, tmp: Path, pythonpath: str | None,
               warm: float, seconds: float) -> dict[str, object]:  # fmt: skip
    cfg = tmp / "footprint.toml"
    cfg.write_text(f'[sampling]\nfrequency = {freq}\n[cache]\ndir = "{cache_dir}"\n'
                   f'[api]\nsocket = "{sock}"\n[metrics]\nenabled = false\n')  # fmt: skip
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    if os.path.exists(sock):
        os.unlink(sock)
    d = subprocess.Popen([sys.executable, "-m", "unwindd.cli", "run", "--config", str(cfg)],
                         stderr=subprocess.DEVNULL, env=env)  # fmt: skip
    try:
        while not os.path.exists(sock):
            time.sleep(0.05)
        time.sleep(warm)
        s0 = json.loads(http(sock, "/v1/status"))
        c0, t0 = cpu_seconds(d.pid), time.monotonic()
        time.sleep(seconds)
        c1, t1 = cpu_seconds(d.pid), time.monotonic()
        s1 = json.loads(http(sock, "/v1/status"))
        mem = smaps(d.pid, cache_dir)
    finally:
        d.terminate()
        d.wait(30)
    samples = s1["samples"] - s0["samples"]
    return {"cpu_s": round(c1 - c0, 3), "wall_s": round(t1 - t0, 2), "samples": samples,
            "us_per_sample": round((c1 - c0) / max(samples, 1) * 1e6, 2),
            "cpu_pct": round(100 * (c1 - c0) / (t1 - t0), 3),
            "lost": s1["lost"] - s0["lost"], "cache": s1["cache"], "kib": mem}  # fmt: skip


def show(label: str, r: dict[str, object]) -> None:
    kib = r.pop("kib")
    assert isinstance(kib, dict)
    print(f"{label}: {json.dumps(r)}")
    keys = ("Rss", "Pss", "Anonymous", "Private_Clean", "Private_Dirty", "Shared_Clean",
            "Shared_Dirty", "cache_files_rss", "cache_files_size")  # fmt: skip
    print("  KiB " + " ".join(f"{k}={kib.get(k, 0)}" for k in keys))
    print(f"  anonymous {kib.get('Anonymous', 0) / 1024:.1f} MiB, "
          f"cache files mapped {kib.get('cache_files_rss', 0) / 1024:.1f} MiB resident of "
          f"{kib.get('cache_files_size', 0) / 1024:.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--freq", type=int, default=999)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--idle-seconds", type=float, default=0)
    ap.add_argument("--cache-dir", help="the daemon's [cache] dir (default: a warmed temp dir)")
    ap.add_argument("--pythonpath", help="PYTHONPATH of the unwindd to run")
    ap.add_argument("--no-load", action="store_true", help="busy window without our load")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        os.chmod(tmp, 0o755)
        sock = str(tmp / "fp.sock")
        cache_dir = args.cache_dir or str(tmp / "cache")
        wl = build_workloads(tmp / "wl")["c_o2"]
        loop = f'while :; do "{wl.argv[0]}" 100 >/dev/null; done'
        load = [] if args.no_load else [
            subprocess.Popen(["sh", "-c", loop], start_new_session=True)
            for _ in range(os.cpu_count() or 1)]  # fmt: skip
        try:
            if not args.cache_dir:  # warm the tables on disk, as a daemon that ran before
                run_daemon(args.freq, sock, cache_dir, tmp, args.pythonpath, 3, 2)
            show("busy", run_daemon(args.freq, sock, cache_dir, tmp, args.pythonpath, 5,
                                    args.seconds))  # fmt: skip
        finally:
            for p in load:
                os.killpg(p.pid, 15)
                p.wait()
        if args.idle_seconds > 0:
            show("idle", run_daemon(args.freq, sock, cache_dir, tmp, args.pythonpath, 5,
                                    args.idle_seconds))  # fmt: skip
        print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
