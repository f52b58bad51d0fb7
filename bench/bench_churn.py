"""Memory under process churn (issue 4: "Memory stays within the configured caps with 500
short-lived processes per second for a minute"): short-lived processes at a fixed rate while
a LiveProfiler set up like the daemon's samples every CPU under explicit caps.

    python bench/bench_churn.py [--rate 500] [--seconds 60] [--cap 256] [--cache-mib 32]
        [--store-mib 8] [--store-entries 100000] [--work 200000] [--follow-spawner] [--breakdown]

``tests/support/workloads/churn.c`` posix_spawns ``blip`` (main -> a -> b -> c -> spin, ~0.4 ms of
work, ~1-2 ms of life with exec) on an absolute schedule and reports the rate it achieved and
each child's lifetime (spawn to reap). Prints the spawner's numbers, every cap's peak and
violations (checked after every step), the blips' unwinding grade, the RSS budget derived
from the caps (tests/integration/test_live_procs.py: rss_budget) and an RSS trace. The test
``tests/integration/test_live_procs.py::test_state_stays_within_caps_under_churn`` runs 6 s of it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

# test_live_procs, and the helpers it imports
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))

from test_live_procs import build_churn, rss_budget, run_churn

MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=int, default=500)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--cap", type=int, default=256, help="LiveTableConfig.max_processes")
    ap.add_argument("--cache-mib", type=int, default=32, help="ELF cache max_bytes")
    ap.add_argument("--store-mib", type=int, default=8, help="store max_bytes")
    ap.add_argument("--store-entries", type=int, default=100_000, help="store max_entries")
    ap.add_argument("--work", type=int, default=200_000, help="blip's spin iterations")
    ap.add_argument("--frequency", type=int, default=99)
    ap.add_argument("--trace-every", type=float, default=5.0)
    ap.add_argument("--warm", type=float, default=5.0, help="seconds before the budget's W")
    ap.add_argument("--follow-spawner", action="store_true",
                    help="sample only the spawner's tree (default: every CPU)")  # fmt: skip
    ap.add_argument("--breakdown", action="store_true",
                    help="trace what the ELF cache and the store hold: the cache's bytes in "
                         "unreferenced (LRU) entries, the store's entries, stacks and frames, "
                         "and the stacks the native step's mirror holds")  # fmt: skip
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        r = run_churn(build_churn(Path(d)), args.rate, args.seconds, cap_processes=args.cap,
                      cache_bytes=args.cache_mib * MIB, store_bytes=args.store_mib * MIB,
                      store_entries=args.store_entries, work=args.work,
                      frequency=args.frequency, follow_spawner=args.follow_spawner,
                      trace_every=args.trace_every,
                      probe=breakdown if args.breakdown else None)  # fmt: skip
    budget, warm = rss_budget(r, args.warm)
    trace = r.pop("trace")
    print(json.dumps({"args": vars(args)}))
    for k, v in r.items():
        print(f"{k}: {json.dumps(v)}")
    top = max(t["rss"] for t in trace if t["t"] >= warm["t"])
    w = warm["rss"] - warm["cache"] - warm["store"]
    print(f"RSS budget: W {w / MIB:.1f} MiB (at {warm['t']:.1f} s) + caps -> "
          f"{budget / MIB:.1f} MiB; max RSS after warm-up {top / MIB:.1f} MiB: "
          f"{'within' if top <= budget else 'OVER'}")
    print("trace: t s, RSS / ELF cache / store / malloc used / malloc free MiB, live pids"
          + (" | cache unreferenced MiB, store entries / stacks / frames / B per entry, "
             "native mirror stacks" if args.breakdown else ""))  # fmt: skip
    for t in trace:
        more = ""
        if args.breakdown:
            more = (f" | {t['cache_unref'] / MIB:5.1f} {t['entries']:7.0f} {t['stacks']:7.0f} "
                    f"{t['frames']:6.0f} {t['store'] / max(1, t['entries']):5.0f} "
                    f"{t['mirror_stacks']:6.0f}")  # fmt: skip
        print(f"  {t['t']:5.1f} {t['rss'] / MIB:6.1f} {t['cache'] / MIB:5.1f} "
              f"{t['store'] / MIB:5.1f} {t['malloc_used'] / MIB:5.1f} "
              f"{t['malloc_free'] / MIB:5.1f} {t['live_pids']}{more}")  # fmt: skip


def breakdown(prof: Any) -> dict[str, float]:
    cache = prof.engine.table.binaries
    st = prof.store.stats
    step = prof.native_step
    return {"cache_unref": sum(e.nbytes for e in cache._lru.values()),
            "entries": st.entries, "stacks": st.stacks, "frames": st.frames,
            "mirror_stacks": len(step._stacks) if step is not None else 0}  # fmt: skip


if __name__ == "__main__":
    main()
