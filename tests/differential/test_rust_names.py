"""``unwindd replay`` names Rust frames exactly as ``perf script`` does, for both manglings.

The Rust workload (tests/support/workloads/rustnames.rs: nested modules, a generic struct's
trait impl instantiated twice, a generic function taking a closure, the closure) is built with
v0 and with legacy symbol mangling (tests/support/rustbuild.py) and recorded with ``perf record
--call-graph dwarf``. For every sample, the frames in the workload binary that perf prints
(address and name, perf's text verbatim: no normalisation) must be the frames unwindd's replay
of the same file gives, in the same order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
import pytest
import rustbuild


@pytest.fixture(scope="module")
def recorded(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, oracle.PerfScript, list[dict[str, Any]]]]:
    dest = tmp_path_factory.mktemp("rustnames")
    out = {}
    for m in rustbuild.MANGLINGS:
        exe = rustbuild.build(dest, m)
        data = oracle.record([str(exe), "100"], dest, name=f"rust_{m}")
        out[m] = (exe, oracle.perf_script(data), oracle.unwindd_stacks(data))
    return out


@pytest.mark.parametrize("mangling", rustbuild.MANGLINGS)
def test_replay_names_equal_perf_script(
    recorded: dict[str, tuple[Path, oracle.PerfScript, list[dict[str, Any]]]], mangling: str
) -> None:
    exe, script, ours = recorded[mangling]
    by_key = {(int(s["pid"]), int(s["tid"]), int(s["time_ns"])): s for s in ours}
    frames = 0
    names: set[str] = set()
    bad = []
    for ps in script.samples:
        want = [(f.ip, f.sym) for f in ps.user_frames if f.dso == str(exe)]
        if not want:
            continue
        got_sample = by_key.get(ps.key)
        assert got_sample is not None, f"no replayed sample {ps.key}"
        got = [(script.spaces.to_perf_ip(ps.pid, ps.time_ns, int(f["ip"], 16)), f["sym"])
               for f in got_sample["frames"]
               if f.get("dso") == str(exe) and not f.get("inlined")]  # fmt: skip
        if got != want:
            bad.append((ps.key, want, got))
        frames += len(want)
        names.update(s for _, s in want if s)
    # every frame of the first differing samples, one per line (a repr of the list is cut)
    assert not bad, f"{len(bad)} of {len(script.samples)} samples differ:\n" + "\n".join(
        f"{key}:\n  perf:    {want}\n  unwindd: {got}" for key, want, got in bad[:3])
    assert frames >= 100, frames
    # the samples cover the workload's shapes, named by perf (so the comparison is not trivial)
    assert any(" as rustnames::outer::inner::Spin>::spin" in n for n in names), names
    assert any("closure" in n for n in names), names
    assert any(n.startswith("rustnames::outer::inner::churn") for n in names), names
    assert not any(n.startswith(("_R", "_ZN")) for n in names), names
