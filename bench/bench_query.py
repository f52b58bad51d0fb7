"""In-process cost of the query API (``/v1/stacks`` and ``/v1/top``) on a store filled from real
samples, without the daemon's sockets or sampling.

    python3 bench/bench_query.py --capture /tmp/q.pickle [--seconds 12] [--freq 1000]
    python3 bench/bench_query.py --load /tmp/q.pickle [--repeat 20] [--store-mib N]

``--capture`` (root) samples the whole machine with the live profiler for the given seconds
while one ``chain_o2 100`` re-exec loop per CPU runs (the load of bench_daemon.py) and pickles
what reached the store: the groups of ``add_counts`` and the samples of ``add``, with their
order. ``--load`` replays them into a fresh store, then times, per query target, the first
answer and the median of the next ``--repeat`` answers on a snapshot taken after each further
small addition (so answer caches keyed by the store's contents see a store that moved on, as in
the daemon). It prints the sha256 of each answer body too, to compare code versions: run it
with ``PYTHONPATH=/tmp/old/daemon`` for the other version, alternating.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

from apisource import QuerySource  # noqa: E402
from unwindd.serve.api import Api, Peer  # noqa: E402
from unwindd.serve.httpapi import Request  # noqa: E402
from unwindd.store.stackstore import StackStore  # noqa: E402

TARGETS = ["/v1/stacks?since=10&limit=1000", "/v1/top?since=10", "/v1/stacks?since=30",
           "/v1/stacks?since=10&format=folded", "/v1/top?since=30&limit=1000"]  # fmt: skip


class _Recorder(StackStore):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.log: list[tuple[str, Any]] = []

    def add_counts(self, groups: Any) -> None:
        groups = list(groups)
        self.log.append(("c", groups))
        super().add_counts(groups)

    def add(self, samples: Any) -> None:
        self.log.append(("s", [(s.time_ns, s.pid, s.tid, s.comm, s.frames, 1) for s in samples]))
        super().add(samples)


def capture(path: str, seconds: float, freq: int) -> None:
    from unwindd.pipeline.live import LiveProfiler
    from workloads.build import build_workloads

    with tempfile.TemporaryDirectory() as td:
        os.chmod(td, 0o755)
        wl = build_workloads(Path(td) / "wl")["c_o2"]
        loop = f'while :; do "{wl.argv[0]}" 100 >/dev/null; done'
        load = [subprocess.Popen(["sh", "-c", loop], start_new_session=True)
                for _ in range(os.cpu_count() or 1)]  # fmt: skip
        try:
            from unwindd.binaries.elfcache import CacheConfig
            from unwindd.source.sampling import SamplingConfig, Target
            from unwindd.unwind.engine import StackEngine

            engine = StackEngine.create(cache_config=CacheConfig(), prefetch_cfi=True)
            rec = _Recorder()
            sampling = SamplingConfig(frequency=freq, stack_size=8192, ring_pages=256)
            prof = LiveProfiler.open(Target(all_cpus=True), sampling, engine=engine, store=rec)
            prof.start()
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                prof.step()
                time.sleep(0.01)
            prof.close()
        finally:
            for p in load:
                os.killpg(p.pid, 9)
                p.wait()
    with open(path, "wb") as f:
        pickle.dump({"bucket_ns": rec.bucket_ns, "log": rec.log}, f)
    n = sum(g[5] for _, gs in rec.log for g in gs)
    print(f"captured {n} samples, {rec.stats.entries} entries, {rec.stats.stacks} stacks")


def run(path: str, repeat: int, store_mib: int | None) -> None:
    with open(path, "rb") as f:
        data = pickle.load(f)
    log = data["log"]
    caps = {} if store_mib is None else {"max_bytes": store_mib << 20}
    store = StackStore(bucket_ns=data["bucket_ns"], **caps)
    # Keep the last few batches back: added one per repeat, so the store moves between queries.
    head, tail = log[:-repeat], log[-repeat:]
    for _, groups in head:
        store.add_counts(groups)
    times = [g[0] for _, gs in log for g in gs if g[0] is not None]
    now = max(times)
    st = store.stats
    print(f"store: {st.samples} samples, {st.entries} entries, {st.stacks} stacks, "
          f"{st.frames} frames, {st.bytes_estimate / 1e6:.1f} MB est")  # fmt: skip
    root = Peer(0)
    results: dict[str, list[float]] = {t: [] for t in TARGETS}
    first: dict[str, float] = {}
    digests: dict[str, str] = {}
    for i in range(repeat + 1):
        if i:
            store.add_counts(tail[i - 1][1])
        for target in TARGETS:
            snap = store.snapshot()
            api = Api(QuerySource(snap, now))
            path_, _, query = target.partition("?")
            req = Request("GET", target, path_, _parse(query), ())
            t0 = time.perf_counter()
            res = api.handle(req, root)
            dt = time.perf_counter() - t0
            snap.close()
            if i == 0:
                first[target] = dt
            else:
                results[target].append(dt)
            if i == repeat:
                digests[target] = hashlib.sha256(res.body).hexdigest()[:16]  # type: ignore[union-attr]
    for target in TARGETS:
        med = statistics.median(results[target]) * 1e3
        print(f"{target:40s} first {first[target] * 1e3:7.2f} ms  median {med:7.2f} ms  "
              f"sha {digests[target]}")  # fmt: skip


def _parse(query: str) -> dict[str, list[str]]:
    from urllib.parse import parse_qs

    return parse_qs(query, keep_blank_values=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capture")
    ap.add_argument("--load")
    ap.add_argument("--seconds", type=float, default=12)
    ap.add_argument("--freq", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--store-mib", type=int,
                    help="the store's max_bytes (default: StackStore's); its query caches get 1/8")
    args = ap.parse_args()
    if args.capture:
        capture(args.capture, args.seconds, args.freq)
    if args.load:
        run(args.load, args.repeat, args.store_mib)


if __name__ == "__main__":
    main()
