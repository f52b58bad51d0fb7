"""The live profiler end to end: real sampling of a real child, unwound as it arrives, stored."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from captured import Replayed
from refstep import ReferenceProfiler
from stacks import (
    CHAIN,
    all_callers_after_calls,
    check_thread_samples,
    thread_ids,
    user_addrs,
    user_syms,
)
from unwindd.binaries.elfcache import CacheConfig, ElfCache
from unwindd.pipeline.live import LiveProfiler
from unwindd.procs.livetable import LiveTable
from unwindd.procs.procscan import ProcFS
from unwindd.source.decoder import RecordDecoder
from unwindd.source.perfcore import PerfSession
from unwindd.source.records import Mmap2
from unwindd.source.sampling import SamplingConfig, Target
from unwindd.store.stackstore import StackStore
from unwindd.unwind.engine import StackEngine
from workloads.build import Workload, build_workloads


@pytest.fixture(scope="module")
def workloads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Workload]:
    return build_workloads(tmp_path_factory.mktemp("live-wl"))


def run_under_profiler(argv: tuple[str, ...]) -> tuple[int, LiveProfiler]:
    # 2 MiB rings, as _capture_runs's: other sessions' process churn filled the default 256 KiB
    # between two steps of a loaded machine, and the workers' samples went with the LOSTs.
    prof = ReferenceProfiler.open(Target(all_cpus=True),
                                  SamplingConfig(frequency=999, ring_pages=512))  # fmt: skip
    prof.start()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while child.poll() is None and time.monotonic() < deadline:
        prof.step()
        time.sleep(0.05)
    assert child.returncode == 0, "workload failed or timed out"
    prof.close()
    return child.pid, prof


def test_live_samples_unwind_to_the_known_chain(workloads: dict[str, Workload]) -> None:
    pid, prof = run_under_profiler((workloads["c_o2"].argv[0], "300"))
    stacks = prof.store.query(pids=[pid])
    total = sum(s.count for s in stacks)
    assert total >= 50, f"only {total} samples of the workload"
    # Samples whose leaf is in spin (the hot function) must unwind whole, spin to _start, with
    # every caller at its return address - 1.
    in_spin = [s for s in stacks if user_syms(s.frames)[:1] == ("spin",)]
    n_spin = sum(s.count for s in in_spin)
    whole = [s for s in in_spin if user_syms(s.frames) == CHAIN]
    good = sum(s.count for s in whole)
    assert n_spin >= total // 2, [(user_syms(s.frames), s.count) for s in stacks[:10]]
    assert good >= 0.98 * n_spin, [(user_syms(s.frames), s.count) for s in in_spin[:10]]
    assert all_callers_after_calls(user_addrs(s.frames) for s in whole) >= 7 * len(whole)
    procs = {p.pid: p for p in prof.store.processes()}
    assert procs[pid].samples == total and procs[pid].comm == Path(workloads["c_o2"].argv[0]).name
    # Every sample the pipeline decoded reached the store (nothing dropped between stages).
    assert prof.store.stats.samples == prof.pipeline.stats.by_type["SAMPLE"]
    assert prof.engine.stats.samples == prof.store.stats.samples


def test_live_threads_keep_their_tids(workloads: dict[str, Workload], tmp_path: Path) -> None:
    """Three busy pthreads, sampled live: every sample stored under the process's pid with the
    id of the thread that ran (the workload writes its gettid()s), each worker's stacks whole
    down to clone3."""
    tids_file = tmp_path / "tids"
    # 32 units: ~0.14 s of CPU per worker here, ~140 samples each at 999 Hz (20 are needed)
    pid, prof = run_under_profiler((workloads["threads"].argv[0], "32", str(tids_file)))
    tids = thread_ids(tids_file)
    stacks = prof.store.query(pids=[pid])
    check_thread_samples(((s.pid, s.tid, s.comm, user_syms(s.frames), s.count) for s in stacks),
                         pid, tids)  # fmt: skip


def test_close_is_idempotent_and_drains(workloads: dict[str, Workload]) -> None:
    _, prof = run_under_profiler(workloads["c_o3"].argv)
    assert prof.closed and prof.close() == []
    assert prof.pipeline.orderer.stats.queued == 0


def _capture_runs(argv: list[str], runs: int) -> tuple[Any, list[list[tuple[int, bytes]]]]:
    """Ring drains while ``argv`` runs ``runs`` times, one after the other. Machine-wide (the
    runs' pids are not known before they start), with 2 MiB rings: the default 256 KiB holds
    ~30 ms of one busy CPU's samples, and other sessions' busy processes overflowed it between
    two drains, losing a run's MMAP2s."""
    drains: list[list[tuple[int, bytes]]] = []
    config = SamplingConfig(frequency=999, ring_pages=512)
    with PerfSession.open(Target(all_cpus=True), config) as s:
        s.enable()
        for _ in range(runs):
            child = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
            while child.poll() is None:
                drains.append(s.drain(1 << 20))
                time.sleep(0.02)
            assert child.returncode == 0
        s.disable()
        drains.append(s.drain(1 << 20))
        return s.event_format, drains


def _replay(fmt: Any, drains: list[list[tuple[int, bytes]]], tmp: Path,
            cache: CacheConfig) -> LiveProfiler:  # fmt: skip
    engine = StackEngine.create(cache_config=cache)
    ticks = iter(range(1, 1 << 40))
    live = LiveTable(engine.table, ProcFS(str(tmp)), clock=lambda: next(ticks) * 1_000_000_000)
    prof = LiveProfiler(Replayed(fmt, drains), engine, StackStore(), live=live,  # type: ignore[arg-type]
                        bootstrap=False)  # fmt: skip
    prof.start()
    for _ in range(len(drains)):
        prof.step()
    prof.close()
    return prof


def test_binary_deleted_before_its_records_are_applied(
    workloads: dict[str, Workload], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Processes of a binary that is deleted, and gone, before their MMAP2s are processed:
    the pin and then the table look the binary up for every one of them, and only the first
    lookup tries to open it (the ELF cache's negative entry); what is stored and counted is
    exactly what the cache stores without negative entries. A binary that opens is opened by
    the first pin only: later pins and the table find that entry."""
    exe = tmp_path / "blip"
    shutil.copy(workloads["c_o2"].argv[0], exe)
    fmt, drains = _capture_runs([str(exe), "30"], 4)
    exe.unlink()
    # the runs whose executable MMAP2 was captured (all 4 unless a ring still lost records)
    dec = RecordDecoder([fmt])
    runs_seen = len({r.pid for drain in drains for _cpu, chunk in drain
                     for r in dec.decode(chunk) if isinstance(r, Mmap2)
                     and r.filename == str(exe) and r.prot & mmap.PROT_EXEC})  # fmt: skip
    assert runs_seen >= 2, runs_seen
    (tmp_path / "empty-proc").mkdir()
    opened: Counter[str] = Counter()
    real_open = os.open

    def counting(path: str, flags: int, *a: int) -> int:
        opened[os.path.basename(str(path))] += 1
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", counting)
    runs: dict[int, tuple[Counter[tuple[Any, ...]], Counter[str], Counter[str]]] = {}
    for neg in (1024, 0):
        opened.clear()
        prof = _replay(fmt, drains, tmp_path / "empty-proc", CacheConfig(negative_entries=neg))
        cache = prof.engine.table.binaries
        assert isinstance(cache, ElfCache)
        stored = Counter({(x.pid, x.comm, x.frames): x.count for x in prof.store.query()})
        runs[neg] = (stored, Counter(opened), Counter(cache.stats.errors))
        if neg:
            assert cache.stats.negative_hits >= 2 * runs_seen - 2, (runs_seen, cache.stats)
    (with_neg, opens, errors), (without, opens0, errors0) = runs[1024], runs[0]
    assert with_neg == without and errors == errors0  # same result, failures counted alike
    assert sum(c for (_pid, comm, _f), c in with_neg.items() if comm == "blip") > 0
    # its pid's root and the path itself once (then map_files); without the negative cache,
    # for the pin and the table of every process (a reused pid's live /proc may add a retry)
    assert 2 <= opens["blip"] <= 4 and opens0["blip"] >= 2 * 2 * runs_seen, (opens, opens0)
    libc = "libc.so.6"
    assert opens[libc] <= 2 and opens0[libc] <= 2, (opens, opens0)  # root (failed), the path
