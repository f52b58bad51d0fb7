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
import time
from collections import Counter
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


def _check_stacks(samples: list[dict[str, Any]], script: Path, pid: int | None = None,
                  source: str = "/tmp/perf-", deep_share: float = 0.5) -> float:  # fmt: skip
    """The share of complete stacks; asserts the JIT frames' names and order, that every
    JS frame was named from ``source`` (its dso starts so: the perf map, or a jitdump), and
    that at least ``deep_share`` of the named stacks name two or more of the script's
    functions up to topLevel."""
    if pid is not None:
        samples = [s for s in samples if s["pid"] == pid]
    assert len(samples) > 100, len(samples)
    share = sum(map(_complete, samples)) / len(samples)
    named = [n for s in samples if (n := _script_names(s, script))]
    # the JavaScript phase is most of the run, and its frames are named from the perf map
    assert len(named) >= len(samples) / 2, (len(named), len(samples))
    assert all(f["dso"].startswith(source) for s in samples for f in s["frames"]
               if JS_NAME.match(f.get("sym") or "")), f"a JS frame not named from {source}"
    # caller order: ranks strictly increase from the leaf outward, and most stacks cross two
    # or more of the script's JIT frames up to topLevel (V8 inlines some calls: not all four)
    in_order = [n for n in named if all(RANK[a] < RANK[b] for a, b in pairwise(n))]
    assert len(in_order) >= 0.95 * len(named), [n for n in named if n not in in_order][:5]
    deep = [n for n in in_order if len(n) >= 2 and n[-1] == "topLevel"]
    assert len(deep) >= deep_share * len(named), (len(deep), len(named))
    return share


def _perf_share(path: Path) -> float:
    """perf's own share of samples whose callchain reaches a thread's first frame (the last
    line of each sample's callchain in ``perf script``: ``ADDR SYM+OFF (DSO)``)."""
    # --no-inline: inline frames never change a callchain's last line, and perf 6.1 finds
    # them by running addr2line over node's binary, which takes minutes
    out = subprocess.run([PERF, "script", "--no-inline", "-i", str(path)], capture_output=True,
                         text=True, errors="replace", check=True).stdout  # fmt: skip
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
            '{kind="anonymous"}', '{kind="perf_map"}', '{kind="jitdump"}'}
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



# -- jitdump: node --perf-prof writes jit-<pid>.dump in its working directory and maps it
# executable (so perf records the mapping); no perf map. perf reads the dump in
# ``perf inject --jit``, which needs the samples on CLOCK_MONOTONIC, the dump's clock
# (``perf record -k mono``): the same ELF-per-code-load view is the oracle for our names.

PERF_JITTED = re.compile(r"\s*[0-9a-f]+ (.+)\+0x([0-9a-f]+) \((.*/jitted-\d+-\d+\.so)\)$")


def _dump_argv(script: Path, secs: float) -> list[str]:
    """node writing a jitdump (and no perf map) in the script's directory (``env -C``: V8
    opens it in the working directory)."""
    assert NODE is not None, "node is installed on the dev machine (.ci/run installs nodejs)"
    return ["env", "-C", str(script.parent), NODE, "--perf-prof",
            "--interpreted-frames-native-stack", "--no-logfile-per-isolate",
            f"--logfile={script.parent / 'v8.log'}", str(script), str(secs)]  # fmt: skip


def _no_perf_map(pids: set[int], script: Path) -> None:
    """What the jitdump tests rest on: each node process wrote its dump and no perf map."""
    assert pids
    for pid in pids:
        assert not os.path.exists(f"/tmp/perf-{pid}.map"), pid
        assert (script.parent / f"jit-{pid}.dump").stat().st_size > 0, pid


@pytest.fixture(scope="module")
def dump_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("jitdump") / "jit.js"
    p.write_text(SCRIPT)
    return p


@pytest.fixture(scope="module")
def dump_recording(dump_script: Path) -> Path:
    path = record_perf_data(dump_script.parent, _dump_argv(dump_script, 1.5), name="node.data",
                            extra=["-k", "mono"])  # fmt: skip
    _no_perf_map(set(perf_script_samples(path)) - {0}, dump_script)
    return path


def _perf_jitted(path: Path, prefix: str = "JS:"
                 ) -> list[tuple[int, float, list[tuple[str, int] | None]]]:  # fmt: skip
    """``perf inject --jit`` of ``path``, then ``perf script``: per sample (tid, time in s,
    its frames: (symbol, offset) of a frame in a jitted ELF named ``prefix``..., else None)."""
    injected = path.with_suffix(".jit.data")
    subprocess.run([PERF, "inject", "--jit", "-i", str(path), "-o", str(injected)],
                   check=True, capture_output=True)  # fmt: skip
    # --no-inline: the jitted ELFs perf inject writes hold no inline entries, so no JS frame
    # changes; perf 6.1 would look for node's by running addr2line over its binary (minutes)
    out = subprocess.run([PERF, "script", "--no-inline", "-F", "tid,time,ip,sym,symoff,dso",
                          "-i", str(injected)], capture_output=True, text=True,
                         errors="replace", check=True).stdout  # fmt: skip
    samples = []
    for block in out.split("\n\n"):
        lines = block.strip("\n").splitlines()
        if not lines:
            continue
        tid, t = lines[0].split()[:2]
        frames: list[tuple[str, int] | None] = []
        for line in lines[1:]:
            m = PERF_JITTED.match(line)
            frames.append((m[1], int(m[2], 16)) if m and m[1].startswith(prefix) else None)
        samples.append((int(tid), float(t.rstrip(":")), frames))
    return samples


def test_replay_names_jit_frames_from_jitdump(dump_recording: Path, dump_script: Path) -> None:
    """With only the jitdump to go by, the replay names the script's functions in caller
    order, each JS frame from the dump; and where perf, reading the same dump, names a frame
    in JIT code, we give the same symbol and offset at the same position of the stack."""
    proc = subprocess.run([sys.executable, "-m", "unwindd.cli", "replay", "--format", "jsonl",
                           "--no-cache", str(dump_recording)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ours = _jsonl(proc.stdout)
    dump = str(dump_script.parent / "jit-")
    share = _check_stacks(ours, dump_script, source=dump)
    assert share >= 0.95, share
    theirs = _perf_jitted(dump_recording)
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    # Per sample, perf's JS frames (symbol, offset) must be among ours from the dump: as
    # multisets, since the two unwinders may differ in a stack's shape (perf walks JIT code by
    # the dump's unwinding info, we by frame pointer: a sample in a prologue loses a caller)
    agree, missing = 0, []
    for s, (tid, t, frames) in zip(ours, theirs, strict=True):
        assert s["tid"] == tid and abs(s["time_ns"] - t * 1e9) < 2000, (s["time_ns"], t)
        # (a frame at an unmapped pc has no dso: perf shows it as [unknown], not the dump's)
        mine = Counter((f["sym"], f["offset"]) for f in s["frames"]
                       if (f["dso"] or "").startswith(dump))  # fmt: skip
        want = Counter(p for p in frames if p is not None)
        agree += sum((want & mine).values())
        missing += list((want - mine).elements())
    print(f"JS frames perf names from the dump: {agree} among ours, {len(missing)} not")
    assert agree >= len(ours) and len(missing) <= agree / 100, missing[:5]


def test_record_live_names_jit_frames_from_jitdump(dump_script: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "unwindd.cli", "record", "--format",
                           "jsonl", "-F", "499", "--", *_dump_argv(dump_script, 1.0)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    samples = _jsonl(proc.stdout)
    node = {s["pid"] for s in samples if s["comm"] == "node"}
    assert proc.returncode == 0, proc.stderr
    assert len(node) == 1, node
    _no_perf_map(node, dump_script)
    pid = node.pop()
    # V8 writes its jitdump through a stdio buffer: the loads of the newest (optimized) code
    # reach the file when the buffer fills or at exit, so live, a share of the frames of the
    # hottest code stays unnamed; what is named must be named right
    share = _check_stacks(samples, dump_script, pid, source=str(dump_script.parent / "jit-"),
                          deep_share=0.1)  # fmt: skip
    assert share >= 0.95, share


def test_daemon_names_jit_frames_from_jitdump(tmp_path: Path, dump_script: Path) -> None:
    """The daemon names node's JS frames from the jitdump (its stacks, in caller order) and
    counts them as kind="jitdump" in /metrics and /v1/status."""
    d = DaemonProc(tmp_path)
    try:
        d.wait_message("READY=1")
        child = subprocess.Popen(_dump_argv(dump_script, 1.0), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)  # fmt: skip
        assert child.wait(120) == 0
        _no_perf_map({child.pid}, dump_script)
        d.wait_settled(child.pid)
        status, _, body = d.get(f"/v1/stacks?pid={child.pid}&format=folded")
        assert status == 200, body
        named = []
        for line in body.decode().splitlines():
            stack, n = line.rsplit(" ", 1)
            js = [m[1] for f in reversed(stack.split(";"))
                  if (m := JS_NAME.match(f)) and m[2] == str(dump_script)]  # fmt: skip
            if js:
                named += [js] * int(n)
        assert len(named) > 100, len(named)
        in_order = [n for n in named if all(RANK[a] < RANK[b] for a, b in pairwise(n))]
        assert len(in_order) >= 0.95 * len(named), [n for n in named if n not in in_order][:5]
        # (live, V8's buffered dump writes leave part of the hottest code unnamed: see above)
        assert sum(len(n) >= 2 and n[-1] == "topLevel" for n in in_order) >= 0.1 * len(named)
        jit = d.json("/v1/status")["jit"]
        frames = metric_values(d.metrics(), "unwindd_jit_frames_total")
        assert frames['{kind="jitdump"}'] >= len(named), (frames, len(named))
        assert jit["frames"]["jitdump"] == frames['{kind="jitdump"}'], (jit, frames)
        dumps = jit["jitdumps"]  # the dumps read: their records by kind, errors by kind
        assert dumps["files"] >= 1 and dumps["record_code_load"] > 100, dumps
    finally:
        assert d.stop() == 0


# -- a JIT that replaces code: tests/support/workloads/minijit.c loads "jit_phase_a" into a
# page, runs it, then loads "jit_phase_b" at the same address and runs that. A jitdump's
# names are time-ordered: every sample in that page is named as the code it ran, by the time
# of the second load (which the JIT writes to phase-b-<pid>.ns), in replay and live.

MINIJIT_C = Path(__file__).resolve().parents[1] / "support" / "workloads" / "minijit.c"


@pytest.fixture(scope="module")
def minijit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = tmp_path_factory.mktemp("minijit") / "minijit"
    subprocess.run(["gcc", "-O1", "-g", "-fomit-frame-pointer", "-fasynchronous-unwind-tables",
                    "-Wall", "-Werror", "-o", str(exe), str(MINIJIT_C)], check=True,
                   capture_output=True)  # fmt: skip
    return exe


def _check_phases(samples: list[dict[str, Any]], pid: int, cwd: Path) -> None:
    """Each sample whose leaf is in the JIT page is named by the phase it was taken in (its
    time against the second load's), from the dump, and unwinds on through ``spin`` (DWARF)
    to ``_start``."""
    tb = int((cwd / f"phase-b-{pid}.ns").read_text())
    dump = str(cwd / f"jit-{pid}.dump")
    jit = [s for s in samples if s["pid"] == pid and s["frames"]
           and s["frames"][0]["dso"] == dump]  # fmt: skip
    assert not [s for s in samples if s["pid"] == pid and s["frames"]
                and s["frames"][0]["sym"] is None], "an unnamed leaf"  # fmt: skip
    wrong = [(s["time_ns"] - tb, s["frames"][0]["sym"]) for s in jit
             if s["frames"][0]["sym"] != ("jit_phase_b" if s["time_ns"] >= tb else "jit_phase_a")]
    assert not wrong, wrong[:5]
    a = sum(s["time_ns"] < tb for s in jit)
    assert a > 100 and len(jit) - a > 100, (a, len(jit))
    # (a sample on the function's first instruction, before it pushed rbp, loses its caller)
    deep = [s for s in jit if [f["sym"] for f in s["frames"][1:2]] == ["spin"]
            and s["frames"][-1]["sym"] == "_start"]  # fmt: skip
    assert len(deep) >= 0.95 * len(jit), [s for s in jit if s not in deep][:2]


def test_replay_names_replaced_jit_code_by_time(minijit: Path) -> None:
    """Replay (the native file path and the Python stream path) against perf inject --jit:
    the same names at the same samples."""
    cwd = minijit.parent
    path = record_perf_data(cwd, ["env", "-C", str(cwd), str(minijit), "0.7"],
                            name="minijit.data", extra=["-k", "mono"])  # fmt: skip
    pid = max(perf_script_samples(path).items(), key=lambda kv: kv[1])[0]
    for src in (str(path), "-"):
        with path.open("rb") as f:
            proc = subprocess.run([sys.executable, "-m", "unwindd.cli", "replay", "--format",
                                   "jsonl", "--no-cache", src], stdin=f, capture_output=True,
                                  text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        ours = _jsonl(proc.stdout)
        _check_phases(ours, pid, cwd)
    theirs = _perf_jitted(path, prefix="jit_phase_")
    assert len(theirs) == len(ours)
    pairs = [(s["frames"][0]["sym"], p[2][0][0]) for s, p in zip(ours, theirs, strict=True)
             if p[2] and p[2][0] is not None]  # fmt: skip
    assert len(pairs) > 200 and all(a == b for a, b in pairs), [p for p in pairs if p[0] != p[1]]


def test_record_live_names_replaced_jit_code_by_time(minijit: Path) -> None:
    cwd = minijit.parent
    proc = subprocess.run([sys.executable, "-m", "unwindd.cli", "record", "--format", "jsonl",
                           "-F", "499", "--", "env", "-C", str(cwd), str(minijit), "0.7"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    samples = _jsonl(proc.stdout)
    pids = {s["pid"] for s in samples if s["comm"] == "minijit"}
    assert len(pids) == 1, pids
    _check_phases(samples, pids.pop(), cwd)


def test_record_pid_finds_jitdump_in_proc_maps(minijit: Path) -> None:
    """A JIT started before ``unwindd record --pid`` (which ends when the JIT exits, after its
    1.6 s of CPU; --duration 15 only bounds it): its dump's mapping is found in
    /proc/<pid>/maps (no MMAP2 record of it), and its code is named by phase all the same."""
    cwd = minijit.parent
    child = subprocess.Popen([str(minijit), "0.8"], cwd=cwd)
    try:
        dump = cwd / f"jit-{child.pid}.dump"
        for _ in range(200):  # the dump exists, mapped, before the code runs
            if dump.exists() and str(dump) in Path(f"/proc/{child.pid}/maps").read_text():
                break
            time.sleep(0.01)
        proc = subprocess.run([sys.executable, "-m", "unwindd.cli", "record", "--format",
                               "jsonl", "-F", "499", "--pid", str(child.pid), "--duration",
                               "15"], capture_output=True, text=True, timeout=300)  # fmt: skip
    finally:
        assert child.wait(60) == 0
    assert proc.returncode == 0, proc.stderr
    _check_phases(_jsonl(proc.stdout), child.pid, cwd)
