"""The daemon's always-on footprint: what its memory accounting reports, and that what it holds
per process and per context goes when the process or the context does.

- A real daemon under a churn of short-lived processes: /v1/status ``memory`` and the
  metrics report the live step's C context (``fp_ctx_bytes``) and the C heap (serve/heap.py:
  trimmed every 2 s, the mapped cache tables released from RSS every second); once the churn's
  processes have exited and their exit grace passed, the per-process state (the process
  table, the engine's per-pid snapshots and comms, the stream's per-pid counts) is back to
  what the machine's own processes need, not grown by the churn. A long-lived process that
  starts and ends thousands of threads meanwhile leaves only its live threads' names.
- The native live step over real ring chunks with a small ``max_stacks``: each context reset
  drops the old context's stacks everywhere, the JIT stats' stack cache included (it held
  the tuples, and so every frame, of a dropped context until it filled up).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from captured import Replayed, capture
from daemonutil import DaemonProc, metric_values
from unwindd.pipeline.context import NativeContext
from unwindd.pipeline.live import LiveProfiler
from unwindd.procs.livetable import LiveTable
from unwindd.procs.procscan import ProcFS
from unwindd.store.stackstore import StackStore
from unwindd.unwind.engine import StackEngine
from workloads.build import Workload, build_workloads


@pytest.fixture(scope="module")
def workloads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Workload]:
    return build_workloads(tmp_path_factory.mktemp("footprint-wl"))


def _churn(argv: list[str], seconds: float, rate: float, inflight: int) -> list[int]:
    """``rate`` processes of ``argv`` a second for ``seconds``, at most ``inflight`` alive;
    all reaped before it returns. Their pids."""
    pids: list[int] = []
    alive: list[subprocess.Popen[bytes]] = []
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < seconds:
        alive = [p for p in alive if p.poll() is None]
        if len(alive) < inflight:
            p = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
            alive.append(p)
            pids.append(p.pid)
        n += 1
        time.sleep(max(0.0, t0 + n / rate - time.monotonic()))
    for p in alive:
        p.wait()
    return pids


# A server's shape: one process for the daemon's life, a short thread per request.
_THREAD_CHURN = """
import sys, threading, time
n, t0 = 0, time.monotonic()
while time.monotonic() - t0 < float(sys.argv[1]):
    t = threading.Thread(target=sum, args=(range(20000),)); t.start(); t.join(); n += 1
    time.sleep(0.005)
print(n, flush=True)
sys.stdin.read()  # alive, its threads gone, until the test has looked
"""


def _memory(d: DaemonProc) -> tuple[dict[str, Any], dict[str, Any]]:
    st = d.json("/v1/status")
    return st, st["memory"]


def test_daemon_reports_memory_and_drops_churned_processes(
    workloads: dict[str, Workload], tmp_path: Path
) -> None:
    d = DaemonProc(tmp_path)
    server: subprocess.Popen[str] | None = None
    try:
        d.wait_message("READY=1", timeout=60)
        # the machine's own processes once loaded: the baseline the churn must come back to
        base, mem0 = _memory(d)
        assert mem0["native_context"]["bytes"] > 0, mem0
        drops0 = sum(metric_values(d.metrics(), "unwindd_process_drops_total").values())
        # up to 400 processes of the chain workload, each running ~10-20 ms of its own code
        # (fewer when the machine is busy: at most 16 alive at once)
        argv = [*workloads["c_o2"].argv, "4"]
        server = subprocess.Popen(["python3", "-c", _THREAD_CHURN, "20"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert server.stdin is not None and server.stdout is not None
        pids = _churn(argv, seconds=20, rate=20, inflight=16)
        threads = int(server.stdout.readline())
        assert threads >= 500, threads
        assert len(pids) >= 20
        _, mem1 = _memory(d)
        # Their samples named: the churn reached the context (stacks, frames, bytes).
        nc = mem1["native_context"]
        assert nc["stacks"] > 0 and nc["frames"] > 0 and nc["bytes"] > 0, nc
        # After the exit grace (2 s of record time) and a few steps, the churned pids are gone
        # from every per-process structure: the table tracks no more processes than before
        # plus what the machine started meanwhile (other sessions' tests: a margin).
        # Per-pid comms are held for the tids of tracked processes only, and for live threads
        # only: the server, still alive, keeps not one per thread it ever ran. Its last
        # threads are within their exit grace when the churn ends: waited for too.
        # The stream's per-pid counts (samples, comms by pid) go with the pids: not one entry
        # per process that ever ran (a few pids may be between their last record and their
        # drop: not the churn's).
        deadline = time.monotonic() + 60
        while True:
            after, mem2 = _memory(d)
            sizes = mem2["per_process"]
            n = after["processes"]
            if (n <= base["processes"] + 64 and sizes["snapshots"] <= n
                    and sizes["comms"] <= 4 * n + 64 and sizes["stream_pids"] <= n + 16):
                break
            assert time.monotonic() < deadline, (base["processes"], n, sizes, threads, len(pids))
            time.sleep(1)
        assert server.poll() is None  # (the server outlived the check)
        alive = {int(p) for p in os.listdir("/proc") if p.isdigit()}
        assert not alive & set(pids)  # (they did exit)
        # ... dropped from the table one by one (exit grace), not by a cap or a reset
        drops = sum(metric_values(d.metrics(), "unwindd_process_drops_total").values())
        assert drops - drops0 >= len(pids) // 2, (drops - drops0, len(pids))
        # The heap: counted, and its free pages handed back at least once by now (every 10 s).
        heap = mem2["heap"]
        assert heap is not None and heap["in_use_bytes"] > 0, heap
        assert mem2["trims"] >= 1, mem2
        # ... and the mapped cache tables (the churn's binaries' at least) released from the
        # page tables with it (cachefiles.release_mapped; their pages stay in the page cache)
        mt = mem2["mapped_tables"]
        assert mt["tables"] >= 1 and mt["bytes"] > 0, mt
        # ... and its own code's clean pages (codepages.py): the interpreter's at least
        cp = mem2["code_pages"]
        assert cp["mappings"] >= 2 and cp["bytes"] >= 1 << 20, cp
        text = d.metrics()
        assert metric_values(text, "unwindd_heap_trims_total")[""] >= 1
        assert set(metric_values(text, "unwindd_heap_bytes")) == {
            '{state="in_use"}', '{state="free"}', '{state="mapped"}'}
        assert metric_values(text, "unwindd_native_context_bytes")[""] > 0
    finally:
        if server is not None:
            server.communicate(timeout=30)  # (stdin closed: it ends)
        assert d.stop() == 0


def test_context_reset_drops_its_stacks_everywhere(
    workloads: dict[str, Workload], tmp_path: Path
) -> None:
    cap = tmp_path / "chunks.pickle"
    (tmp_path / "empty-proc").mkdir()
    c2 = workloads["c_o2"].argv[0]
    capture(cap, [(c2, "200"), (workloads["c_o3"].argv[0],), (c2, "150")])
    fmt, drains = pickle.loads(cap.read_bytes())
    engine = StackEngine.create()
    ticks = iter(range(1, 1 << 40))
    live = LiveTable(engine.table, ProcFS(str(tmp_path / "empty-proc")),
                     clock=lambda: next(ticks) * 1_000_000_000)  # fmt: skip
    prof = LiveProfiler(Replayed(fmt, drains), engine, StackStore(bucket_ns=100_000_000),  # type: ignore[arg-type]
                        live=live, bootstrap=False)  # fmt: skip
    step = prof.native_step
    assert step is not None
    step.max_stacks = 8  # a reset every few rounds
    dropped: list[tuple[Any, ...]] = []  # the dropped contexts' stack tuples (held: ids stay)
    dropped_bytes: list[int] = []
    new_ctx = step._new_ctx

    def spy() -> None:
        # (a CodeStack's base tuple is what the JIT stats hold of it)
        dropped.extend(getattr(s[0], "base", s[0]) for s in step._stacks)
        dropped_bytes.append(step.nctx.native_bytes)
        new_ctx()

    step._new_ctx = spy  # type: ignore[method-assign]
    prof.start()
    for _ in range(len(drains)):
        prof.step()
        # whatever the JIT stats hold is a stack of the live context, never a dropped one (a
        # kernel-only stack is the engine's cached tuple: the new context may hold it again)
        held = {id(v[0]) for v in engine.jit._seen.values()}
        live_ids = {id(getattr(s[0], "base", s[0])) for s in (*step._stacks, *step._pystacks)}
        assert not held & {id(t) for t in dropped} - live_ids
    prof.close()
    assert step.contexts >= 3 and len(dropped) > 8, (step.contexts, len(dropped))
    # the C context's bytes follow what it holds: a used one holds more than a fresh one
    assert max(dropped_bytes) > NativeContext(engine).native_bytes > 0
