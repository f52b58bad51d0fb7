"""Daemon CPU per sample and per side-band record under process churn, old vs new code
alternated in one run (issue 5: the per-process cost).

    python3 bench/bench_sideband.py [--freq 99] [--warmup 5] [--seconds 10] [--runs 3]
        [--spawn-rate 200] [--profile FILE] CODE [CODE ...]

Each CODE is a directory put first on PYTHONPATH (a ``daemon`` tree, e.g. from ``git archive
<commit> daemon | tar -x -C /tmp/before``; the compiled ``_unwcore``/``_perfcore`` of the
installed package are copied in when missing), ``installed`` (the pip-installed package) or
``perf`` (``perf record -a -F FREQ -e cpu-clock --call-graph dwarf,8192`` over the same window
and load, as bench_daemon.py runs it: the CPU to beat). A CODE ending in ``+q`` runs with
bench_daemon.py's query load during the window (from another process).
The load is started once and shared by every run: one shell per CPU re-executing the
``chain_o2`` workload (``c_o2 100``, a new ~0.5 s process each time: FORK/COMM/MMAP2/EXIT
churn), plus whatever else the machine runs (system-wide sampling sees other sessions'
processes too, which is the point: their side-band records cost the daemon as well). So that
runs compare at a known churn whatever else runs, a spawner starts ``--spawn-rate`` short-lived
``/bin/true`` processes per second (FORK, exec COMM, ~4 MMAP2, EXIT each).

A run is a child process running the real daemon in-process (``service.run_daemon``, metrics
off, no queries); after ``--warmup`` s (cold ELF parsing excluded) it takes the process CPU
time (every thread: ``time.process_time``) and the record counts by type at a step boundary,
and again ``--seconds`` later, then stops the daemon. It reports CPU, samples, side-band
records (everything but SAMPLE) and CPU per sample and per side-band record. Runs alternate
over CODEs (A B A B ...), so slow drifts of the machine's load hit every CODE alike; the
summary gives medians. ``--profile FILE`` writes a cProfile of the window (one run, the first
CODE) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Starts argv[1] /bin/true per second, paced against the clock (a slow spawn is caught up).
_SPAWNER = """
import os, sys, time
rate = float(sys.argv[1]); t = time.monotonic(); n = 0
while True:
    pid = os.posix_spawn("/bin/true", ["true"], os.environ)
    os.waitpid(pid, 0)
    n += 1
    d = t + n / rate - time.monotonic()
    if d > 0:
        time.sleep(d)
"""


# bench_daemon.py's query load, from its own process (its CPU is not the daemon's): every
# 200 ms /v1/stacks?since=10&limit=1000 then /v1/top?since=10&limit=1000, for argv[2] s.
_QUERIER = """
import socket, sys, time
sock, secs = sys.argv[1], float(sys.argv[2]); t0 = time.monotonic()
while time.monotonic() - t0 < secs:
    for name in ("stacks", "top"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30); s.connect(sock)
            s.sendall(f"GET /v1/{name}?since=10&limit=1000 HTTP/1.1\\r\\nHost: x\\r\\n"
                      "Connection: close\\r\\n\\r\\n".encode())
            while s.recv(1 << 16):
                pass
    time.sleep(0.2)
"""


def child(freq: int, warm: float, secs: float, out: str, profile: str | None,
          queries: bool = False) -> None:  # fmt: skip
    import cProfile

    from unwindd.serve import service

    tmp = Path(tempfile.mkdtemp(prefix="unwindd-sb-"))
    sock = str(tmp / "d.sock")
    cfg = tmp / "d.toml"
    cfg.write_text(f'[sampling]\nfrequency = {freq}\nstack_size = 8192\nring_pages = 256\n'
                   f'[api]\nsocket = "{sock}"\n[metrics]\nenabled = false\n')  # fmt: skip
    prof = cProfile.Profile() if profile else None
    orig = service.Daemon._step
    t_start = time.monotonic()
    st: dict[str, Any] = {"on": False, "done": False}

    def counts(d: Any) -> dict[str, int]:
        return dict(d.profiler.pipeline.stats.by_type)

    def step(self: Any) -> bool:
        now = time.monotonic()
        if not st["on"] and now - t_start > warm:
            st.update(on=True, t0=now, c0=time.process_time(), n0=counts(self))
            if queries:
                st["q"] = subprocess.Popen([sys.executable, "-c", _QUERIER, sock, str(secs)])
            if prof is not None:
                prof.enable()
        r: bool = orig(self)
        if st["on"] and not st["done"] and time.monotonic() - st["t0"] > secs:
            if prof is not None:
                prof.disable()
            st.update(done=True, c1=time.process_time(), t1=time.monotonic(), n1=counts(self))
            os.kill(os.getpid(), signal.SIGTERM)
        return r

    service.Daemon._step = step  # type: ignore[method-assign]
    service.run_daemon(str(cfg))
    if "q" in st:
        st["q"].kill()
        st["q"].wait()
    shutil.rmtree(tmp, ignore_errors=True)
    if prof is not None and profile:
        prof.dump_stats(profile)
    n0, n1 = st["n0"], st["n1"]
    delta = {k: n1.get(k, 0) - n0.get(k, 0) for k in n1}
    samples = delta.get("SAMPLE", 0)
    side = sum(v for k, v in delta.items() if k != "SAMPLE")
    cpu = st["c1"] - st["c0"]
    Path(out).write_text(json.dumps({
        "cpu_s": cpu, "wall_s": st["t1"] - st["t0"], "samples": samples, "side_band": side,
        "by_type": {k: v for k, v in delta.items() if v},
        "us_per_sample": 1e6 * cpu / max(1, samples),
        "us_per_side_band": 1e6 * cpu / max(1, side),
    }))  # fmt: skip


def code_path(code: str, tmp: Path) -> str | None:
    """PYTHONPATH entry for CODE (None: the installed package, or perf)."""
    code = code.removesuffix("+q")
    if code in ("installed", "perf"):
        return None
    p = Path(code).resolve()
    if (p / "daemon" / "unwindd").is_dir():
        p = p / "daemon"
    pkg = p / "unwindd"
    if not pkg.is_dir():
        raise SystemExit(f"{code}: no unwindd package there")
    import importlib.util

    spec = importlib.util.find_spec("unwindd")
    assert spec is not None and spec.origin is not None
    inst = Path(spec.origin).parent
    if inst.resolve() != pkg.resolve():
        for so in inst.glob("_*core*.so"):
            if not (pkg / so.name).exists():
                shutil.copy2(so, pkg / so.name)
    return str(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("codes", nargs="*", default=["installed"])
    ap.add_argument("--freq", type=int, default=99)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--spawn-rate",
        type=float,
        default=200.0,
        help="short-lived /bin/true processes started per second (0: none)",
    )
    ap.add_argument("--profile", help="cProfile the window of one run of the first CODE")
    ap.add_argument("--queries", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.freq, a.warmup, a.seconds, a.child, a.profile, a.queries)
        return
    if os.geteuid() != 0:
        raise SystemExit("needs root (system-wide sampling)")
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_daemon import bench_perf
    from workloads.build import build_workloads

    tmp = Path(tempfile.mkdtemp(prefix="unwindd-sbb-"))
    os.chmod(tmp, 0o755)
    wl = build_workloads(tmp / "wl")["c_o2"]
    paths = {c: code_path(c, tmp) for c in a.codes}
    loop = f'while :; do "{wl.argv[0]}" 100 >/dev/null; done'
    load = [subprocess.Popen(["sh", "-c", loop], start_new_session=True)
            for _ in range(os.cpu_count() or 1)]  # fmt: skip
    if a.spawn_rate > 0:
        load.append(subprocess.Popen([sys.executable, "-c", _SPAWNER, str(a.spawn_rate)],
                                     start_new_session=True))  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in a.codes}
    try:
        runs = 1 if a.profile else a.runs
        codes = a.codes[:1] if a.profile else a.codes
        for i in range(runs):
            for c in codes:
                env = dict(os.environ)
                if paths[c] is not None:
                    env["PYTHONPATH"] = str(paths[c])
                out = tmp / "out.json"
                cmd = [sys.executable, __file__, "--child", str(out), "--freq", str(a.freq),
                       "--warmup", str(a.warmup), "--seconds", str(a.seconds)]  # fmt: skip
                if a.profile:
                    cmd += ["--profile", a.profile]
                if c.endswith("+q"):
                    cmd.append("--queries")
                la = os.getloadavg()[0]
                if c == "perf":
                    time.sleep(a.warmup)  # the same spacing between windows as a daemon run
                    p = bench_perf(a.freq, a.seconds, 8192, tmp)
                    r = {"cpu_s": p["cpu_s"], "wall_s": a.seconds, "samples": p["samples"],
                         "side_band": 0, "by_type": {}, "us_per_sample": p["us_per_sample"],
                         "us_per_side_band": 0.0}  # fmt: skip
                else:
                    subprocess.run(cmd, env=env, check=True, stderr=subprocess.DEVNULL)
                    r = json.loads(out.read_text())
                r["load"] = la
                results[c].append(r)
                print(f"run {i + 1} {c}: cpu {r['cpu_s']:.3f} s / {r['wall_s']:.1f} s, "
                      f"{r['samples']} samples, {r['side_band']} side-band "
                      f"({r['by_type']}), {r['us_per_sample']:.0f} us/sample, "
                      f"{r['us_per_side_band']:.0f} us/side-band record, load {la:.1f}",
                      flush=True)  # fmt: skip
    finally:
        for pr in load:
            os.killpg(pr.pid, signal.SIGKILL)
            pr.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    for c, rs in results.items():
        if not rs:
            continue
        med = {
            k: statistics.median(r[k] for r in rs)
            for k in ("cpu_s", "samples", "side_band", "us_per_sample", "us_per_side_band")
        }
        print(f"median {c} ({len(rs)} runs): cpu {med['cpu_s']:.3f} s, "
              f"{med['samples']:.0f} samples, {med['side_band']:.0f} side-band, "
              f"{med['us_per_sample']:.0f} us/sample, "
              f"{med['us_per_side_band']:.0f} us/side-band record")  # fmt: skip


if __name__ == "__main__":
    main()
