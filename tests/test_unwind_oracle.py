"""unwindd's DWARF unwinding judged against perf's on the same perf.data (DESIGN.md "Oracle").

For each workload in tests/workloads/: record it with ``perf record --call-graph dwarf``, take
perf's unwind (``perf script``, with the mappings it saw, so our absolute ips can be put in
perf's mapping-relative form) and ours (``unwindd replay --format jsonl``), and require the
same user frames for at least 99% of samples. ``pytest -s`` prints one summary line per
workload; a failure message shows the worst differing stacks side by side.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import oracle
import pytest
from oracle import Workload

MIN_MATCH = 0.99

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
    assert rep.match_ratio >= MIN_MATCH, f"[{name}] {path}\n{rep.render(8)}"
