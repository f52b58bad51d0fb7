"""Inlined frames and source lines in the live daemon, judged against perf and llvm-addr2line.

The workload is test_inline_oracle.py's inline.c (always-inline helpers two levels deep in
walk and stroll, and libc's qsort, whose helpers libc6-dbg's DWARF shows inlined), built
``-O2 -g`` under a name of this test's own (other sessions run the same workloads: queries
select it by that comm) and run in a loop, once under ``perf record --call-graph dwarf`` (the
oracle: ``perf script``, inline frames on and ``--no-inline``) and once while a fresh daemon
samples the machine (cold caches: the line/inline tables compile in its worker while the
workload runs, so some samples are named before they arrive).

- Frames: every stack of the oracle holding an inlined frame and >= 2 % of its samples begins
  a stack of the daemon's (user frames by name, inlined marks included; perf's unwinder stops
  early in places where ours goes on), and >= 85 % of the daemon's samples have a leaf pc
  whose frames (its inlined ones, then its own) the oracle shows (the rest: named before the
  tables came).
- ``inline=0``: no inlined frame is left; the workload binary's own frames are exactly those
  of ``inline=1`` without the inlined ones, sample for sample; the leaf frames are perf
  script ``--no-inline``'s (>= 85 % of samples); each frame's file:line is llvm-addr2line's for its
  address without ``-i``, and with inline on each pc's chain is ``llvm-addr2line -i``'s.
- ``/v1/top?by=line``: every line's self count is what the stacks' leaf frames say, and its
  function and file:line are llvm-addr2line's at those frames' addresses.
- unwindctl ``--no-inline`` and ``top --by line``; ``[symbols] inline = false`` turns it off.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonutil import UNWINDCTL, DaemonProc, metric_values
from perfutil import PERF, record_perf_data
from workloads.build import SRC

KERNEL_MIN = 0xFFFF800000000000
RUNS = 12  # loop iterations (each run of inline.c: ~0.2 s of CPU)
# (name, inlined) per user frame, leaf first, after a (count, False) head: how many of them
# are the leaf pc's (``_keyed``)
NameStack = tuple[tuple[str, bool], ...]


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dinl")
    path = d / f"inl{os.getpid() % 100000}"  # the comm queries select (< 16 bytes)
    subprocess.run(["gcc", "-O2", "-g", "-Wall", "-Werror", "-o", str(path),
                    str(SRC / "inline.c")], check=True, capture_output=True)  # fmt: skip
    return path


def _loop(exe: Path, runs: int = RUNS) -> list[str]:
    return ["sh", "-c", f'for i in $(seq {runs}); do "{exe}" >/dev/null; done']


@pytest.fixture(scope="module")
def oracle(exe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Counter[NameStack]]:
    """perf script's user stacks of the workload (by comm), inline on and off, counted."""
    data = record_perf_data(tmp_path_factory.mktemp("dinl_rec"), _loop(exe), freq=999)
    out = {}
    for mode, extra in (("inline", ()), ("no-inline", ("--no-inline",))):
        text = subprocess.run([PERF, "script", "-F", "comm,pid,tid,time,ip,sym,dso", "--ns",
                               "-i", str(data), *extra], check=True, capture_output=True,
                              text=True, timeout=300).stdout  # fmt: skip
        out[mode] = _perf_stacks(text, exe.name)
    return out


def _perf_stacks(text: str, comm: str) -> Counter[NameStack]:
    got: Counter[NameStack] = Counter()
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if not lines or not lines[0].split() or lines[0].split()[0] != comm:
            continue
        frames = []
        for ln in lines[1:]:
            addr, _, rest = ln.strip().partition(" ")
            if int(addr, 16) >= KERNEL_MIN:
                continue
            if rest.endswith(" (inlined)"):
                frames.append((rest[: -len(" (inlined)")], True, addr))
            else:
                frames.append((rest.rpartition(" (")[0], False, addr))
        got[_keyed(frames)] += 1
    return got


def _keyed(frames: list[tuple[str, bool, str]]) -> NameStack:
    """(name, inlined) per frame, the leaf pc's frames (the first address's) marked by a
    leading count: ``_leaf_chain`` takes them."""
    n = sum(1 for _ in itertools.takewhile(lambda f: f[2] == frames[0][2], frames))
    return ((str(n), False), *((name, inl) for name, inl, _ in frames))


@pytest.fixture(scope="module")
def daemon(exe: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """A fresh daemon (empty cache dir) that sampled the workload loop, settled."""
    # a store big enough that the whole machine's samples (other sessions' too) evict none of
    # the workload's while the tests read them
    d = DaemonProc(tmp_path_factory.mktemp("dinl_d"), "[store]\nmax_bytes = 536870912\n",
                   frequency=999)  # fmt: skip
    try:
        d.wait_message("READY=1", timeout=60)
        subprocess.run(_loop(exe), check=True, timeout=600)
        _settle(d, exe.name)
        yield d
        assert d.json("/v1/status")["store"]["evicted_samples"] == 0
    finally:
        d.stop()


def _settle(d: DaemonProc, comm: str) -> None:
    """Until two reads 0.6 s apart (past the answer cache) count the same samples."""
    import time

    last = -1
    for _ in range(60):
        n = d.json(f"/v1/top?comm={comm}&limit=1")["samples"]
        if n and n == last:
            return
        last = n
        time.sleep(0.6)
    raise AssertionError(f"{comm}'s samples never settled")


def _stacks(d: DaemonProc, comm: str, inline: int) -> list[dict[str, Any]]:
    """The workload's stacks, a query per process (one answer for them all runs to
    megabytes: kernel frames of every sample)."""
    procs = d.json("/v1/processes?limit=100000")["processes"]
    out = []
    for pid in sorted(p["pid"] for p in procs if p["comm"] == comm):
        res = d.json(f"/v1/stacks?comm={comm}&pid={pid}&inline={inline}")
        assert not res["truncated"]
        out += res["stacks"]
    for st in out:  # keys only some frames carry (api.frame_json), as absent
        for f in st["frames"]:
            for k in ("rel", "inlined", "file", "line"):
                f.setdefault(k, False if k == "inlined" else None)
    return out


def _names(frames: list[dict[str, Any]]) -> NameStack:
    return _keyed([(f["sym"] or "[unknown]", f["inlined"], f["ip"]) for f in frames
                   if not f["kernel"]])  # fmt: skip


def _leaf_chain(k: NameStack) -> NameStack:
    """The leaf pc's frames: its inlined ones and its own."""
    return k[1 : 1 + int(k[0][0])] if k else k


def _matched(ours: list[dict[str, Any]], theirs: Counter[NameStack]) -> float:
    """The share of our samples whose leaf chain perf shows for some sample. (Whole stacks
    differ in length: perf's unwinder stops early in places, such as at
    __libc_start_call_main and in msort's recursion, where ours goes on to _start.)"""
    chains = {_leaf_chain(k) for k in theirs}
    total = sum(s["count"] for s in ours)
    same = sum(s["count"] for s in ours if _leaf_chain(_names(s["frames"])) in chains)
    return same / max(total, 1)


def _shown(k: NameStack, mine: set[NameStack]) -> bool:
    """Whether one of our stacks begins with perf's stack ``k`` (see ``_matched``)."""
    return any(m[1 : len(k)] == k[1:] for m in mine)


def test_daemon_shows_perfs_inlined_frames(
    daemon: DaemonProc, exe: Path, oracle: dict[str, Counter[NameStack]]
) -> None:
    ours = _stacks(daemon, exe.name, 1)
    theirs = oracle["inline"]
    mine = {_names(s["frames"]) for s in ours}
    n = sum(theirs.values())
    hot = [k for k, c in theirs.items() if c >= 0.02 * n and any(inl for _, inl in k[1:])]
    assert hot and len(hot) >= 3, theirs.most_common(5)
    missing = [k for k in hot if not _shown(k, mine)]
    assert not missing, missing[:2]
    inl = {name for k in mine for name, i in k[1:] if i}
    assert {"mix", "step", "msort_with_tmp"} <= inl, inl  # the workload's and libc's
    share = _matched(ours, theirs)
    print(f"\ndaemon samples with a stack perf shows: {share:.3f}")
    assert share >= 0.85
    # Tables compiled off the loop: a cold daemon sampling the whole machine names frames
    # before their tables arrive, and names them again when they do.
    st = daemon.json("/v1/status")["inline"]
    assert st["arrived"] >= 2 and st["failed"] == 0 and st["renames"] >= 1, st
    assert st["retired"] >= 1, st  # frames by code named without a table, named again
    m = daemon.metrics()
    assert metric_values(m, "unwindd_inline_pending_frames_total")[""] > 0
    assert metric_values(m, "unwindd_inline_renames_total")[""] >= 1


def test_inline_0_drops_exactly_the_inlined_frames(daemon: DaemonProc, exe: Path,
                                                   oracle: dict[str, Counter[NameStack]]
                                                   ) -> None:  # fmt: skip
    on, off = _stacks(daemon, exe.name, 1), _stacks(daemon, exe.name, 0)
    per_pid: dict[int, list[int]] = {}
    for i, stacks in enumerate((on, off)):
        for s in stacks:
            per_pid.setdefault(s["pid"], [0, 0])[i] += s["count"]
    assert all(a == b for a, b in per_pid.values()), per_pid
    assert sum(s["count"] for s in on) > 500
    assert not any(f["inlined"] for s in off for f in s["frames"])
    assert any(f["inlined"] for s in on for f in s["frames"])

    def own(s: dict[str, Any], drop: bool) -> tuple[Any, ...]:
        fr = tuple((f["ip"], f["sym"]) for f in s["frames"]
                   if f["dso"] == str(exe) and not (drop and f["inlined"]))  # fmt: skip
        return (s["pid"], s["tid"], fr)

    want: Counter[tuple[Any, ...]] = Counter()
    got: Counter[tuple[Any, ...]] = Counter()
    for s in on:
        want[own(s, True)] += s["count"]
    for s in off:
        got[own(s, False)] += s["count"]
    assert got == want
    share = _matched(off, oracle["no-inline"])
    print(f"\ninline=0 samples with a stack perf --no-inline shows: {share:.3f}")
    assert share >= 0.85


def _addr2line(dso: str, rels: list[int], inline: bool) -> dict[int, list[tuple[str, str]]]:
    """llvm-addr2line's (function, basename:line) per address, innermost first (-i)."""
    argv = ["llvm-addr2line", "-a", "-f", "-C", "-e", dso, *(["-i"] if inline else [])]
    out = subprocess.run([*argv, *map(hex, rels)], check=True, capture_output=True,
                         text=True).stdout  # fmt: skip
    got: dict[int, list[tuple[str, str]]] = {}
    cur: list[tuple[str, str]] = []
    lines = out.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("0x"):
            cur = got.setdefault(int(lines[i], 16), [])
            i += 1
            continue
        if not lines[i]:
            i += 1
            continue
        func, loc = lines[i], lines[i + 1]
        file, _, num = loc.rpartition(":")
        cur.append((func, f"{os.path.basename(file)}:{num.split()[0] if num else '0'}"))
        i += 2
    return got


def _chains(stacks: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[list[str], int]]:
    """Per (dso, rel) of a user frame with a file: its frames' basename:line, innermost
    first (a pc's inlined frames, then its own), and how many samples show it."""
    out: dict[tuple[str, int], tuple[list[str], int]] = {}
    for s in stacks:
        run: list[dict[str, Any]] = []
        for f in [*s["frames"], None]:
            if run and (f is None or f["rel"] != run[0]["rel"] or f["dso"] != run[0]["dso"]):
                key = (run[0]["dso"], int(run[0]["rel"], 16))
                locs = [f"{os.path.basename(g['file'])}:{g['line']}" for g in run]
                out[key] = (locs, out.get(key, ([], 0))[1] + s["count"])
                run = []
            if f is not None and not f["kernel"] and f["file"] and f["dso"].startswith("/"):
                run.append(f)
                if not f["inlined"]:
                    key = (f["dso"], int(f["rel"], 16))
                    locs = [f"{os.path.basename(g['file'])}:{g['line']}" for g in run]
                    out[key] = (locs, out.get(key, ([], 0))[1] + s["count"])
                    run = []
    return out


@pytest.mark.parametrize("inline", [1, 0])
def test_lines_are_addr2lines(daemon: DaemonProc, exe: Path, inline: int) -> None:
    chains = _chains(_stacks(daemon, exe.name, inline))
    by_dso: dict[str, list[int]] = {}
    for dso, rel in chains:
        by_dso.setdefault(dso, []).append(rel)
    total = good = 0
    bad = []
    for dso, rels in by_dso.items():
        want = _addr2line(dso, rels, bool(inline))
        for rel in rels:
            locs, n = chains[(dso, rel)]
            theirs = [loc for _, loc in want.get(rel, []) if not loc.startswith("?")]
            total += n
            # a recursive call at one pc whose levels are all inlined-named repeats its chain
            reps = len(locs) // len(theirs) if theirs else 1
            if locs == theirs * reps:
                good += n
            else:
                bad.append((dso, hex(rel), locs, theirs))
    print(f"\n[inline={inline}] samples' frames with addr2line's lines: {good}/{total}")
    assert total > 500 and good >= 0.99 * total, bad[:4]


def test_top_by_line(daemon: DaemonProc, exe: Path) -> None:
    res = daemon.json(f"/v1/top?comm={exe.name}&by=line&limit=1000")
    lines = res["lines"]
    stacks = _stacks(daemon, exe.name, 1)
    assert res["samples"] == sum(s["count"] for s in stacks)
    # self: the leaf frames' counts, per (file, line, function, dso)
    leaf: Counter[tuple[Any, ...]] = Counter()
    rels: dict[tuple[Any, ...], set[int]] = {}
    for s in stacks:
        f = s["frames"][0]
        key = (f["file"], f["line"], f["sym"] or "[unknown]", f["dso"])
        leaf[key] += s["count"]
        if f["rel"] is not None:
            rels.setdefault(key, set()).add(int(f["rel"], 16))
    assert {(x["file"], x["line"], x["sym"], x["dso"]): x["self"] for x in lines
            if x["self"]} == +leaf  # fmt: skip
    assert lines == sorted(lines, key=lambda x: (-x["self"], -x["total"]))  # ranked
    # (frames named before their table arrived have no file: counted per function)
    ours = [x for x in lines if x["dso"] == str(exe) and x["self"] and x["file"]]
    assert any(x["sym"] == "mix" for x in ours) and any(x["sym"] == "cmp" for x in ours)
    for x in ours:
        key = (x["file"], x["line"], x["sym"], x["dso"])
        want = _addr2line(x["dso"], sorted(rels[key]), True)
        for rel in rels[key]:
            func, loc = want[rel][0]  # the innermost level: the code at the pc
            assert (func.split("(")[0], loc) == (x["sym"],
                                                 f"{os.path.basename(x['file'])}:{x['line']}")


def test_unwindctl_no_inline_and_by_line(daemon: DaemonProc, exe: Path) -> None:
    def ctl(*args: str) -> str:
        return subprocess.run([*UNWINDCTL, "--socket", str(daemon.sock), *args], check=True,
                              capture_output=True, text=True, timeout=60).stdout  # fmt: skip

    on = ctl("folded", "--comm", exe.name)
    off = ctl("folded", "--comm", exe.name, "--no-inline")
    assert "mix_[i]" in on and "_[i]" not in off and "walk" in off
    top = ctl("top", "--comm", exe.name, "--by", "line", "--wide")
    assert "inline.c:" in top and "LINE" in top.splitlines()[1]
    got = json.loads(ctl("--json", "top", "--comm", exe.name, "--no-inline"))
    names = {f["sym"] for f in got["functions"]}
    assert "walk" in names and "mix" not in names and "step" not in names


def test_inline_off_by_config(exe: Path, tmp_path: Path) -> None:
    d = DaemonProc(tmp_path, "[symbols]\ninline = false\n", frequency=999)
    try:
        d.wait_message("READY=1", timeout=60)
        subprocess.run(_loop(exe, 3), check=True, timeout=300)
        _settle(d, exe.name)
        stacks = _stacks(d, exe.name, 1)
        assert sum(s["count"] for s in stacks) > 50
        assert not any(f["inlined"] or f["file"] for s in stacks for f in s["frames"])
        assert d.json("/v1/status")["inline"] is None
    finally:
        d.stop()
