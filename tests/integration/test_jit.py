"""Unwinding through JIT code: node --perf-basic-prof running plain JavaScript, recorded by perf
and replayed, recorded live by ``unwindd record``, and sampled by the daemon.

V8 keeps frame pointers in its compiled code and names it in /tmp/perf-<pid>.map; the code
lives in anonymous executable memory without CFI, where perf's DWARF unwinder (and ours, before
JIT code had a module) stops. The oracle is perf itself on the same file: its share of samples
whose stack reaches a thread's first frame (``_start``, ``clone``, ``clone3``), which ours must
beat and which must be at least 95 %; the script's function names must appear leaf first in
caller order (``leafWork`` < ``middleStep`` < ``outerLoop`` < ``topLevel``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from daemonutil import DaemonProc, metric_values
from perfutil import PERF, perf_script_samples, record_perf_data

NODE = shutil.which("node")
OUTERMOST = {"_start", "clone", "clone3"}
# The script's functions, callee first: each calls the next one's predecessor. CPU time, not
# wall time, bounds the loop, so a loaded machine stretches the run rather than thinning it.
# Its result goes to stderr: ``unwindd record`` shares its stdout with the workload.
SCRIPT = """\
function leafWork(n) { let s = 0; for (let i = 0; i < n; i++) s = (s + i * i) % 1000003;
                       return s; }
function middleStep(n) { return leafWork(n) + leafWork(n >> 1); }
function outerLoop(n) { let t = 0; for (let k = 0; k < 20; k++) t += middleStep(n); return t; }
function topLevel(secs) {
  const end = process.cpuUsage().user + secs * 1e6; let t = 0;
  while (process.cpuUsage().user < end) t += outerLoop(20000);
  return t;
}
console.error(topLevel(parseFloat(process.argv[2] || "1.5")));
"""
RANK = {"leafWork": 0, "middleStep": 1, "outerLoop": 2, "topLevel": 3}
JS_NAME = re.compile(r"JS:[*^~+]?(\w+) (\S+):\d+:\d+$")

def _argv(script: Path, secs: float) -> list[str]:
    """node writing its perf map; --interpreted-frames-native-stack gives each interpreted
    function its own copy of the interpreter's entry trampoline, so the map names interpreted
    frames too (without it V8's tiering decides which callers have a name of their own). V8's
    own log, which --perf-basic-prof opens in the working directory, goes beside the script."""
    assert NODE is not None, "node is installed on the dev machine (.ci/run installs nodejs)"
    return [NODE, "--perf-basic-prof", "--interpreted-frames-native-stack",
            "--no-logfile-per-isolate", f"--logfile={script.parent / 'v8.log'}", str(script),
            str(secs)]  # fmt: skip


@contextlib.contextmanager
def _perf_maps() -> Iterator[set[int]]:
    """A set for the pids of the node processes the block runs: their /tmp/perf-<pid>.map
    files are removed at its end (theirs only: other tests on the machine write maps too)."""
    pids: set[int] = set()
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.unlink(f"/tmp/perf-{pid}.map")


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("jit") / "jit.js"
    p.write_text(SCRIPT)
    return p


@pytest.fixture(scope="module")
def recording(script: Path) -> Iterator[Path]:
    with _perf_maps() as pids:
        path = record_perf_data(script.parent, _argv(script, 1.5), name="node.data")
        pids |= set(perf_script_samples(path))
        yield path


def _script_names(sample: dict[str, Any], script: Path) -> list[str]:
    """The script's JS function names in a sample's frames, leaf first."""
    out = []
    for f in sample["frames"]:
        m = JS_NAME.match(f.get("sym") or "")
        if m and m[2] == str(script):
            out.append(m[1])
    return out


def _complete(sample: dict[str, Any]) -> bool:
    user = [f for f in sample["frames"] if not f["kernel"]]
    return bool(user) and user[-1]["sym"] in OUTERMOST


def _check_stacks(samples: list[dict[str, Any]], script: Path, pid: int | None = None) -> float:
    """The share of complete stacks; asserts the JIT frames' names and order."""
    if pid is not None:
        samples = [s for s in samples if s["pid"] == pid]
    assert len(samples) > 100, len(samples)
    share = sum(map(_complete, samples)) / len(samples)
    named = [n for s in samples if (n := _script_names(s, script))]
    # the JavaScript phase is most of the run, and its frames are named from the perf map
    assert len(named) >= len(samples) / 2, (len(named), len(samples))
    assert all(f["dso"].startswith("/tmp/perf-") for s in samples for f in s["frames"]
               if JS_NAME.match(f.get("sym") or "")), "a JS frame not named from the perf map"
    # caller order: ranks strictly increase from the leaf outward, and most stacks cross two
    # or more of the script's JIT frames up to topLevel (V8 inlines some calls: not all four)
    in_order = [n for n in named if all(RANK[a] < RANK[b] for a, b in pairwise(n))]
    assert len(in_order) >= 0.95 * len(named), [n for n in named if n not in in_order][:5]
    deep = [n for n in in_order if len(n) >= 2 and n[-1] == "topLevel"]
    assert len(deep) >= len(named) / 2, (len(deep), len(named))
    return share


def _perf_share(path: Path) -> float:
    """perf's own share of samples whose callchain reaches a thread's first frame (the last
    line of each sample's callchain in ``perf script``: ``ADDR SYM+OFF (DSO)``)."""
    out = subprocess.run([PERF, "script", "-i", str(path)], capture_output=True, text=True,
                         errors="replace", check=True).stdout  # fmt: skip
    blocks = [b.splitlines() for b in out.split("\n\n") if b.strip()]
    assert len(blocks) > 100
    done = 0
    for b in blocks:
        last = b[-1].split()
        done += len(b) > 1 and len(last) >= 2 and last[1].split("+0x")[0] in OUTERMOST
    return done / len(blocks)


def _jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_replay_unwinds_through_jit_frames(recording: Path, script: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "unwindd.cli", "replay", "--format", "jsonl",
                           "--no-cache", str(recording)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ours = _check_stacks(_jsonl(proc.stdout), script)
    perfs = _perf_share(recording)
    print(f"complete stacks: unwindd {ours:.1%}, perf {perfs:.1%}")
    assert ours >= 0.95 and ours > perfs, (ours, perfs)


def test_record_live_through_jit_frames(script: Path) -> None:
    with _perf_maps() as pids:
        proc = subprocess.run([sys.executable, "-m", "unwindd.cli", "record", "--format",
                               "jsonl", "-F", "499", "--", *_argv(script, 1.0)],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        samples = _jsonl(proc.stdout)
        node = {s["pid"] for s in samples if s["comm"] == "node"}
        pids |= node
    assert proc.returncode == 0, proc.stderr
    assert len(node) == 1, node
    share = _check_stacks(samples, script, node.pop())
    assert share >= 0.95, share


def test_daemon_counts_jit_frames(tmp_path: Path, script: Path) -> None:
    """The daemon's /v1/status says how many of node's samples crossed JIT code and how many
    of those reached a thread's first frame; /metrics counts the JIT frames by kind."""
    d = DaemonProc(tmp_path)
    try:
        d.wait_message("READY=1")
        text = d.metrics()
        assert set(metric_values(text, "unwindd_jit_frames_total")) == {
            '{kind="anonymous"}', '{kind="perf_map"}'}
        with _perf_maps() as pids:
            child = subprocess.Popen(_argv(script, 1.0), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)  # fmt: skip
            pids.add(child.pid)
            assert child.wait(120) == 0
            d.wait_settled(child.pid)
        jit = d.json("/v1/status")["jit"]
        node = jit["runtimes"]["node"]
        assert node["samples"] > 100, jit
        assert node["complete"] >= 0.95 * node["samples"], jit
        frames = metric_values(d.metrics(), "unwindd_jit_frames_total")
        assert sum(frames.values()) >= node["samples"] and frames['{kind="perf_map"}'], frames
        assert jit["frames"]["perf_map"] == frames['{kind="perf_map"}'], (jit, frames)
    finally:
        assert d.stop() == 0

