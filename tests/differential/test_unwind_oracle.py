"""unwindd's DWARF unwinding judged against perf's on the same perf.data (perf is the oracle).

For each workload in tests/support/workloads/: record it with ``perf record --call-graph dwarf``,
take perf's unwind (``perf script``, with the mappings it saw, so our absolute ips can be put in
perf's mapping-relative form) and ours (``unwindd replay --format jsonl``), and require the same
samples, and the same user frames for every sample but at most ``MAX_MISMATCHED`` per workload,
each shown as a warning in the run's summary (on a clean tree none is seen). ``oracle.compare``
says what "the same" means: the ips exactly, the names where perf has one, the binary's own symbols
where it has none, and a longer stack only down to the stack's base. ``pytest -s`` prints one
summary line per workload; a failure message shows the worst differing stacks side by side.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import oracle
import pytest
from oracle import Workload

MAX_MISMATCHED = 2

WORKLOADS = ["c_o2", "c_o3", "cxx", "threads", "dlopen", "signal", "python", "forkexec"]


@pytest.fixture(scope="module")
def workloads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Workload]:
    return oracle.build_workloads(tmp_path_factory.mktemp("workloads"))


@pytest.mark.parametrize("name", WORKLOADS)
def test_unwind_matches_perf(workloads: dict[str, Workload], name: str, tmp_path: Path) -> None:
    path = oracle.record(workloads[name], tmp_path)
    script = oracle.perf_script(path)
    ours = oracle.unwindd_stacks(path)
    lacking = [s for s in ours if "frames" not in s or "time_ns" not in s]
    assert not lacking, (
        f"{len(lacking)}/{len(ours)} unwindd replay samples lack frames/time_ns "
        f"(keys: {sorted(lacking[0])}): is the unwinding engine in?"
    )
    rep = oracle.compare(script.samples, ours, script.spaces)
    statuses = Counter(str(s.get("unwind_status")) for s in ours)
    print(
        f"\n[{name}] perf samples {rep.total}, ours {len(ours)}, {rep.summary()}, "
        f"unwind_status {dict(statuses)}"
    )
    assert rep.total > 0
    assert not rep.extra, f"[{name}] samples perf did not print: {rep.extra[:5]}"
    assert len(rep.mismatched) <= MAX_MISMATCHED, f"[{name}] {path}\n{rep.render(8)}"
    if rep.mismatched:
        warnings.warn(f"[{name}] within the budget: {rep.render(MAX_MISMATCHED)}", stacklevel=1)
