"""The live profiler end to end: real sampling of a real child, unwound as it arrives, stored."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from unwindd.live import LiveProfiler
from unwindd.perfcore import SamplingConfig, Target
from workloads.build import Workload, build_workloads

CHAIN = ["spin", "c", "b", "a", "main"]


@pytest.fixture(scope="module")
def workloads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Workload]:
    return build_workloads(tmp_path_factory.mktemp("live-wl"))


def run_under_profiler(argv: tuple[str, ...]) -> tuple[int, LiveProfiler]:
    prof = LiveProfiler.open(Target(all_cpus=True), SamplingConfig(frequency=999))
    prof.start()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while child.poll() is None and time.monotonic() < deadline:
        prof.step()
        time.sleep(0.05)
    assert child.returncode == 0, "workload failed or timed out"
    prof.close()
    return child.pid, prof


def user_syms(frames: tuple[object, ...]) -> list[str | None]:
    return [f.sym for f in frames if not f.kernel]  # type: ignore[attr-defined]


def test_live_samples_unwind_to_the_known_chain(workloads: dict[str, Workload]) -> None:
    pid, prof = run_under_profiler((workloads["c_o2"].argv[0], "300"))
    stacks = prof.store.query(pids=[pid])
    total = sum(s.count for s in stacks)
    assert total >= 50, f"only {total} samples of the workload"
    # Samples whose leaf is in spin (the hot function) must unwind through the whole chain.
    in_spin = [s for s in stacks if user_syms(s.frames)[:1] == ["spin"]]
    n_spin = sum(s.count for s in in_spin)
    good = sum(s.count for s in in_spin if user_syms(s.frames)[: len(CHAIN)] == CHAIN)
    assert n_spin >= total // 2, [(user_syms(s.frames), s.count) for s in stacks[:10]]
    assert good >= 0.98 * n_spin, [(user_syms(s.frames), s.count) for s in in_spin[:10]]
    procs = {p.pid: p for p in prof.store.processes()}
    assert procs[pid].samples == total and procs[pid].comm == Path(workloads["c_o2"].argv[0]).name
    # Every sample the pipeline decoded reached the store (nothing dropped between stages).
    assert prof.store.stats.samples == prof.pipeline.stats.by_type["SAMPLE"]
    assert prof.engine.stats.samples == prof.store.stats.samples


def test_close_is_idempotent_and_drains(workloads: dict[str, Workload]) -> None:
    _, prof = run_under_profiler(workloads["c_o3"].argv)
    assert prof.closed and prof.close() == []
    assert prof.pipeline.orderer.stats.queued == 0
