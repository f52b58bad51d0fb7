"""State under process churn: short-lived processes at a fixed rate while the live profiler
samples every CPU; the process table and ELF cache must stay within their caps.

    python bench/bench_churn.py [--rate 500] [--seconds 60] [--cap 256] [--cache-mib 64]

Runs ``tests/workloads/storm.c`` (fork + exec of ``chain_o2 1``, ~5 ms each, 16 at most at
once) and samples at 99 Hz per CPU. Prints one line of numbers (the test
``tests/test_live_procs.py::test_state_stays_within_caps_under_churn`` runs 5 s at 200/s).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_live_procs import run_churn
from workloads.build import _cc, build_workloads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=int, default=500)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--cap", type=int, default=256)
    ap.add_argument("--cache-mib", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        built = build_workloads(Path(d))
        wl = {"c_o2": built["c_o2"].binaries[0],
              "storm": _cc("gcc", Path(d) / "storm", ("storm.c",), ("-O2",))}  # fmt: skip
        r = run_churn(wl, args.rate, args.seconds, args.cap, args.cache_mib << 20)
    print(f"rate={args.rate}/s seconds={args.seconds} cap={args.cap} cache_mib={args.cache_mib}")
    for k, v in r.items():
        print(f"  {k}: {v:.1f}" if isinstance(v, float) else f"  {k}: {v}")


if __name__ == "__main__":
    main()
