"""CPU and peak allocation per query answer (``/v1/stacks`` as json, folded and pprof,
``/v1/top``) on a store filled the way the daemon fills it under process churn, and the same
in an older checkout, alternated in one run. Run by hand, not in CI.

    python3 bench/bench_queries.py /tmp/small.data [--before /tmp/base-query/daemon]
        [--copies 30] [--rounds 15] [--max-bytes N] [--json out.json]

The recording is replayed once (the Python replay: perf.data -> StackEngine.feed, as
``unwindd replay`` does for what the native replay does not take) and its samples kept as
plain tuples (``/tmp/bench_queries.<name>.pickle``), so every version unwinds nothing and
gets the same frames. Each version runs in a worker process of its own (``PYTHONPATH`` = its
daemon dir) that fills a ``StackStore`` with ``--copies`` copies of the samples, each under
new pids and tids (short-lived processes running the same code: what ``bench/soak.py``'s
churn makes), their user code loaded elsewhere (ASLR: each copy's stacks are new stacks), and
spread over the last 60 s. A round adds one more copy 60 s / copies later
(the window slides, the store moves on between queries as in the daemon), then answers
each query once through ``Api.handle`` on a snapshot, as the daemon's query thread does,
timing its thread CPU. An answer written as it is rendered (``ChunkedResponse``: a JSON stacks
answer past one chunk) is consumed whole inside the measure, each chunk dropped once hashed,
as the socket would take it: its CPU and peak are those of the whole answer. Workers take
rounds in turn (before, after, before, ...); the last round runs again under tracemalloc for
each query's peak above what was allocated before it. Every answer's sha256 is compared
between the versions: a difference is reported and the exit status is 1. ``chunks`` is how
many pieces the answer came in (1: a whole body).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from apisource import QuerySource  # (the bench dir is sys.path[0]: scripts run as files)

QUERIES = ("/v1/stacks?since=60&limit=200", "/v1/stacks?since=60",
           "/v1/stacks?since=60&inline=0", "/v1/stacks?since=60&format=folded",
           "/v1/stacks?since=60&format=pprof",
           "/v1/top?since=60&limit=50", "/v1/top?since=60&limit=50&by=line",
           "/v1/stacks?since=60&format=pprof&inline=0")  # fmt: skip
WINDOW_NS = 60_000_000_000
PID_STRIDE = 1 << 22  # above pid_max: copies never share a pid
ASLR_STEP = 0x7F3000  # page-aligned load address shift per copy


def prepare(recording: str) -> str:
    """The recording's samples as (time_ns, pid, tid, comm, frames as field tuples), cached."""
    out = f"/tmp/bench_queries.{Path(recording).name}.pickle"
    if os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(recording):
        return out
    from dataclasses import astuple

    from unwindd.source.capture import StreamPipeline
    from unwindd.source.perfdata import PerfData
    from unwindd.unwind.engine import StackEngine

    engine = StackEngine.create()
    rows: list[tuple[Any, ...]] = []
    with PerfData.open(recording) as data:
        pipe = StreamPipeline(data.decoder)
        batch: list[Any] = []

        def flush() -> None:
            for s in engine.feed(batch):
                if s.time_ns is None or s.pid is None or s.tid is None:
                    continue
                rows.append((s.time_ns, s.pid, s.tid, s.comm,
                             tuple(astuple(f)[:11] for f in s.frames)))  # fmt: skip
            batch.clear()

        for rec in pipe.replay(data.records()):
            batch.append(rec)
            if len(batch) >= 4096:
                flush()
        flush()
    with open(out, "wb") as f:
        pickle.dump(rows, f)
    return out


# -- the worker (runs with PYTHONPATH = one version's daemon dir)


class Worker:
    def __init__(self, data: str, copies: int, max_bytes: int | None = None) -> None:
        from unwindd.store.stackstore import StackStore
        from unwindd.unwind.stackfmt import Frame

        with open(data, "rb") as f:
            rows = pickle.load(f)
        pool: dict[tuple[Any, ...], Any] = {}  # one Frame object per distinct frame, as the
        # engine's symbol caches hand out
        t0 = min(r[0] for r in rows)
        self.step = WINDOW_NS // copies
        self.rows = [(r[0] - t0, r[1], r[2], r[3],
                      tuple(pool.get(fr) or pool.setdefault(fr, Frame(*fr)) for fr in r[4]))
                     for r in rows]  # fmt: skip
        self.span = max(r[0] for r in self.rows) + 1
        self.store = StackStore() if max_bytes is None else StackStore(max_bytes=max_bytes)
        self.copy = 0
        for _ in range(copies):
            self.add_copy()

    def add_copy(self) -> None:
        k = self.copy
        self.copy += 1
        base = 1_000_000_000_000 + k * self.step
        # the recording's time squeezed into one step: each copy is a burst of processes
        # ASLR: each copy's user code is loaded elsewhere (ip moves, rel stays), so its stacks
        # are new ones, as a new process's are in the daemon
        shift = k * ASLR_STEP
        moved: dict[int, Any] = {}

        def at(f: Any) -> Any:
            if f.rel is None or f.kernel:
                return f
            g = moved.get(id(f))
            if g is None:
                g = moved[id(f)] = replace(f, ip=f.ip + shift)
            return g

        groups = [(base + t * self.step // self.span, pid + k * PID_STRIDE,
                   tid + k * PID_STRIDE, comm, tuple(map(at, frames)), 1)
                  for t, pid, tid, comm, frames in self.rows]  # fmt: skip
        self.store.add_counts(groups)
        self.now = base + self.step

    def round(self, traced: bool) -> dict[str, Any]:
        from unwindd.serve.api import Api, Peer
        from unwindd.serve.httpapi import Request

        self.add_copy()
        out: dict[str, Any] = {}
        for q in QUERIES:
            snap = self.store.snapshot()
            api = Api(QuerySource(snap, self.now), clock_offset=lambda: 0)
            path, _, qs = q.partition("?")
            req = Request("GET", q, path, parse_qs(qs, keep_blank_values=True), ())
            if traced:
                tracemalloc.start()
                base = tracemalloc.get_traced_memory()[0]
            c0 = time.thread_time()
            res = api.handle(req, Peer(0))
            sha, size, chunks = hashlib.sha256(), 0, 0
            # a ChunkedResponse's chunks as the connection takes them (one at a time, each
            # dropped once written); a Response's body whole
            for piece in getattr(res, "chunks", None) or (res.body,):  # type: ignore[union-attr]
                sha.update(piece)
                size += len(piece)
                chunks += 1
                del piece
            if hasattr(res, "chunks"):
                res.close()
            del res
            cpu = time.thread_time() - c0
            peak = 0
            if traced:
                peak = tracemalloc.get_traced_memory()[1] - base
                tracemalloc.stop()
            snap.close()
            out[q] = {"cpu": cpu, "peak": peak, "sha": sha.hexdigest()[:16], "len": size,
                      "chunks": chunks}
        return out


def worker(data: str, copies: int, max_bytes: int | None) -> None:
    w = Worker(data, copies, max_bytes)
    st = w.store.stats
    print(json.dumps({"entries": st.entries, "stacks": st.stacks, "frames": st.frames,
                      "samples": st.samples, "evicted": st.evicted_samples,
                      "table_bytes": st.table_bytes, "bytes_estimate": st.bytes_estimate}),
          flush=True)  # fmt: skip
    for line in sys.stdin:
        print(json.dumps(w.round(line.strip() == "traced")), flush=True)


# -- the driver


class _Proc:
    def __init__(self, name: str, daemon_dir: str, data: str, copies: int,
                 max_bytes: int | None) -> None:  # fmt: skip
        self.name = name
        env = {**os.environ, "PYTHONPATH": daemon_dir}
        cap = [] if max_bytes is None else ["--max-bytes", str(max_bytes)]
        self.p = subprocess.Popen([sys.executable, __file__, "--worker", data, "--copies",
                                   str(copies), *cap], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.head = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name}: worker died")
        return dict(json.loads(line))

    def round(self, traced: bool = False) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write("traced\n" if traced else "round\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        self.p.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("recording")
    ap.add_argument("--before", help="an older checkout's daemon/ dir, compared in the same run")
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--max-bytes", type=int, help="the stores' byte cap (default: the store's "
                    "default); answers compare only between stores that hold the same samples")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the raw numbers here")
    args = ap.parse_args()
    if args.worker:
        worker(args.recording, args.copies, args.max_bytes)
        return
    here = str(Path(__file__).resolve().parent.parent / "daemon")
    sys.path.insert(0, here)
    data = prepare(args.recording)
    procs = [_Proc("after", here, data, args.copies, args.max_bytes)]
    if args.before:
        procs.insert(0, _Proc("before", args.before, data, args.copies, args.max_bytes))
    for p in procs:
        print(f"{args.recording} {p.name}: {p.head}")
    print(f"load: {os.getloadavg()[0]:.2f}")
    runs: dict[str, list[dict[str, Any]]] = {p.name: [] for p in procs}
    for _ in range(args.rounds):
        for p in procs:
            runs[p.name].append(p.round())
    for p in procs:
        runs[p.name].append(p.round(traced=True))
        p.close()
    bad = 0
    print(f"{'query':45s} " + "  ".join(f"{p.name + ' ms':>10s} {'peak KiB':>9s}" for p in procs)
          + "  bytes")  # fmt: skip
    for q in QUERIES:
        cols = []
        for p in procs:
            rs = runs[p.name]
            med = statistics.median(r[q]["cpu"] for r in rs[:-1]) * 1e3
            cols.append(f"{med:10.2f} {rs[-1][q]['peak'] / 1024:9.0f}")
        if len(procs) == 2:
            for a, b in zip(runs["before"], runs["after"], strict=True):
                if a[q]["sha"] != b[q]["sha"]:
                    bad += 1
                    print(f"DIFFERENT ANSWER: {q}", file=sys.stderr)
                    break
        last = runs["after"][-1][q]
        print(f"{q:45s} " + "  ".join(cols) + f"  {last['len']} ({last['chunks']} chunks)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)
    print(f"load after: {os.getloadavg()[0]:.2f}" + ("; answers identical" if len(procs) == 2
                                                     and not bad else ""))  # fmt: skip
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
