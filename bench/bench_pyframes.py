"""Daemon CPU per sample with Python frame reading on vs off, on a Python-heavy load, in the
same run.

    python3 bench/bench_pyframes.py [--seconds 10] [--freq 99] [--procs 2] [--threads 4]
                                    [--repeat 3] [--baseline OTHER_TREE/daemon]

The load: ``--procs`` CPython processes (the interpreter running this script), each with
``--threads`` threads spinning in nested Python functions. For each mode (``[python] frames =
"replace"`` then ``"off"``, alternated ``--repeat`` times) the daemon is started from a temp
config, warmed up 3 s, then measured over a window of ``--seconds``: its CPU (utime + stime)
per sample, and for "replace" the share of the load's samples named by Python frames and the
reads and reasons from /v1/status. ``--baseline``: a third mode, "replace" run from another
tree's ``daemon/`` (PYTHONPATH; e.g. ``git archive`` of an older commit with this tree's built
``*.so`` copied in), alternated with the others. Medians of the runs are printed last. Root is
needed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_daemon import cpu_seconds, http

LOAD = """
import sys, threading
def leaf(n):
    x = 0
    for i in range(n):
        x += i * i
    return x
def middle(n):
    return leaf(n) + leaf(n // 2)
def outer():
    while True:
        middle(2000)
for _ in range(int(sys.argv[1]) - 1):
    threading.Thread(target=outer, daemon=True).start()
outer()
"""


def run(label: str, freq: int, seconds: float, tmp: Path, path: str | None = None
        ) -> dict[str, float]:  # fmt: skip
    mode = label.partition("@")[0]
    sock = str(tmp / f"{label.replace('@', '-')}.sock")
    cfg = tmp / f"{label.replace('@', '-')}.toml"
    env = dict(os.environ, PYTHONPATH=path) if path else None
    cfg.write_text(f'[sampling]\nfrequency = {freq}\n[api]\nsocket = "{sock}"\n'
                   f'[metrics]\nenabled = false\n[python]\nframes = "{mode}"\n')  # fmt: skip
    d = subprocess.Popen([sys.executable, "-m", "unwindd.cli", "run", "--config", str(cfg)],
                         stderr=subprocess.DEVNULL, env=env)  # fmt: skip
    try:
        while not os.path.exists(sock):
            time.sleep(0.05)
        time.sleep(3.0)
        s0 = json.loads(http(sock, "/v1/status"))
        c0 = cpu_seconds(d.pid)
        time.sleep(seconds)
        c1 = cpu_seconds(d.pid)
        s1 = json.loads(http(sock, "/v1/status"))
    finally:
        d.terminate()
        d.wait(30)
    samples = s1["samples"] - s0["samples"]
    out = {"cpu_s": c1 - c0, "samples": samples,
           "us_per_sample": (c1 - c0) / max(samples, 1) * 1e6}  # fmt: skip
    p0, p1 = s0["runtimes"]["python"], s1["runtimes"]["python"]
    if p1 is not None:
        out["named"] = p1["named"] - p0["named"]
        out["reads"] = p1["reads"] - p0["reads"]
        out["failed"] = sum(p1["failures"].values()) - sum(p0["failures"].values())
        out["late"] = p1["failures"]["late"] - p0["failures"]["late"]
        out["named_pct"] = 100 * out["named"] / max(out["named"] + out["failed"], 1)
        out["syscalls_per_read"] = (p1["syscalls"] - p0["syscalls"]) / max(out["reads"], 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--freq", type=int, default=99)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", help="another tree's daemon/ directory, run as a third mode")
    args = ap.parse_args()
    load = [subprocess.Popen([sys.executable, "-c", LOAD, str(args.threads)])
            for _ in range(args.procs)]  # fmt: skip
    results: dict[str, list[dict[str, float]]] = {"replace": [], "off": []}
    if args.baseline:
        results["replace@baseline"] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeat):
                for mode in results:
                    r = run(mode, args.freq, args.seconds, Path(tmp),
                            args.baseline if mode.endswith("@baseline") else None)
                    results[mode].append(r)
                    print(mode, json.dumps({k: round(v, 2) for k, v in r.items()}), flush=True)
    finally:
        for p in load:
            p.kill()
            p.wait()
    for mode, rs in results.items():
        med = {k: round(statistics.median(r.get(k, 0) for r in rs), 2) for k in rs[0]}
        print("median", mode, json.dumps(med))


if __name__ == "__main__":
    main()
