"""Inlined frames and source lines judged against perf and addr2line on the same perf.data.

Workloads (tests/support/workloads/): inline.c (two levels of always-inline helpers in two
callers, and qsort, whose inlined helpers come from libc's own DWARF in libc6-dbg),
inline_cxx.cpp (member functions, a function template and a lambda through std::accumulate
inlined into loops), built ``-O2 -g``, and rustinline.rs (core::iter's map/fold, their closures,
u64::wrapping_mul and an #[inline(always)] trait method inlined into loops), built by the rustc
tests/support/rustbuild.py finds with ``-C opt-level=2 -g`` and its default symbol mangling;
each recorded with ``perf record --call-graph dwarf``.

- Frames: every sample's user frames, inlined ones included, as ``unwindd replay --format
  perf-script`` prints them (native and Python replays), equal ``perf script -F
  comm,pid,tid,time,ip,sym,dso --ns`` (perf's default: inline frames on) on >= 99 % of the
  samples, and the run must have shown inlined frames of the workload and of libc; with
  ``--no-inline`` they equal ``perf script ... --no-inline`` likewise.
- Lines: every frame's file and line from ``--format jsonl`` equal, as basename:line, what
  ``llvm-addr2line -i`` says for its binary and address at that inline level on >= 99 % of
  frames (asked at the frame's virtual address: frames carry file offsets, as perf prints
  them). llvm's addr2line, not binutils': binutils 2.40 (Debian 12's, which perf's
  ``-F +srcline`` runs) resolves DWARF 5 line-table file numbers one entry off (it names
  csu/libc-start.c where the line table says libc_start_call_main.h), so its files would be
  the wrong oracle; lines and function names it gets right, and perf's names are compared
  above.
- Function start lines: ``unwindd replay --format pprof`` read back by a real pprof client
  (``go tool pprof -raw``); each Line's function start_line (and its filename's basename)
  equals what ``llvm-symbolizer --verbose -i`` says (DW_AT_decl_line and DW_AT_decl_file,
  followed through abstract origins as llvm's DWARFDie::getDeclLine follows them) at that
  inline level of the location's address, on >= 99 % of the levels; where llvm has no start
  line, none is written (0).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import binfacts
import oracle
import pytest
import rustbuild
from perfutil import PERF
from workloads.build import SRC

MIN_MATCH = 0.99
CLI = [sys.executable, "-m", "unwindd.cli", "replay"]
SCRIPT = [PERF, "script", "-F", "comm,pid,tid,time,ip,sym,dso", "--ns"]
KERNEL_MIN = 0xFFFF800000000000


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each workload built -O2 -g and recorded with DWARF call graphs."""
    d = tmp_path_factory.mktemp("inline")
    out = {}
    for name, cc, src in (("c", "gcc", "inline.c"), ("cxx", "g++", "inline_cxx.cpp")):
        exe = d / f"inline_{name}"
        subprocess.run([cc, "-O2", "-g", "-Wall", "-Werror", "-o", str(exe), str(SRC / src)],
                       check=True, capture_output=True)  # fmt: skip
        out[name] = oracle.record([str(exe)], d, freq=999, name=f"inline_{name}")
    rustc = rustbuild.rustc()
    assert rustc is not None, "no rustc (install Debian's rustc, as .ci/run does)"
    exe = d / "inline_rust"
    # the compiler's default symbol mangling (legacy on stable), as perf sees Rust binaries
    subprocess.run([rustc, "--edition", "2021", "-C", "opt-level=2", "-g", "--crate-name",
                    "rustinline", "-o", str(exe), str(SRC / "rustinline.rs")],
                   check=True, capture_output=True)  # fmt: skip
    out["rust"] = oracle.record([str(exe)], d, freq=999, name="inline_rust")
    return out


def _blocks(text: str) -> dict[str, str]:
    """perf-script text as {header line: its user frame lines}: kernel frames (addresses in
    the kernel half) are left out, as the unwind oracle leaves them out."""
    out: dict[str, str] = {}
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if not lines or not lines[0]:
            continue
        user = [ln for ln in lines[1:] if int(ln.split()[0], 16) < KERNEL_MIN]
        out[lines[0]] = "\n".join(user)
    return out


def _ours(path: Path, fmt: str, *extra: str, pipe: bool = False) -> str:
    if pipe:
        with path.open("rb") as f:
            return subprocess.run([*CLI, "-", "--format", fmt, *extra], stdin=f, check=True,
                                  capture_output=True, text=True, timeout=300).stdout  # fmt: skip
    return subprocess.run([*CLI, str(path), "--format", fmt, *extra], check=True,
                          capture_output=True, text=True, timeout=300).stdout  # fmt: skip


def _perf(path: Path, *extra: str) -> str:
    return subprocess.run([*SCRIPT, "-i", str(path), *extra], check=True, capture_output=True,
                          text=True, timeout=300).stdout  # fmt: skip


@pytest.mark.parametrize("pipe", [False, True], ids=["native", "python"])
@pytest.mark.parametrize("name", ["c", "cxx", "rust"])
def test_inline_frames_are_perfs(recorded: dict[str, Path], name: str, pipe: bool) -> None:
    path = recorded[name]
    theirs = _blocks(_perf(path))
    ours = _blocks(_ours(path, "perf-script", pipe=pipe))
    assert len(theirs) > 50 and set(ours) == set(theirs), (len(theirs), len(ours))
    same = [k for k in theirs if ours[k] == theirs[k]]
    bad = [(theirs[k], ours[k]) for k in theirs if ours[k] != theirs[k]]
    assert len(same) >= MIN_MATCH * len(theirs), f"{len(same)}/{len(theirs)}: {bad[:2]}"
    inl = [t for t in theirs.values() if "(inlined)" in t]
    # the workload's own inlining, and libc's (its debug file's DWARF)
    want = {"c": ("step (inlined)", "msort_with_tmp (inlined)"),
            "cxx": ("shapes::Acc::add (inlined)", "shapes::scale<double> (inlined)"),
            # core's u64 method is "<u64>::" (v0) or "core::num::<impl u64>::" (legacy std)
            "rust": ("rustinline::lcg::mix (inlined)", "::wrapping_mul (inlined)",
                     "rustinline::fold_all::{{closure}} (inlined)",
                     "<rustinline::lcg::Gen<u64> as rustinline::lcg::Step>::step (inlined)",
                     "<core::iter::adapters::map::Map<I,F> as core::iter::traits::iterator::"
                     "Iterator>::fold (inlined)")}[name]
    for w in want:
        assert sum(w in t for t in inl) > 5, (w, len(inl))


@pytest.mark.parametrize("fmt", ["folded", "jsonl"])
@pytest.mark.parametrize("name", ["c", "cxx", "rust"])
def test_native_equals_python(recorded: dict[str, Path], name: str, fmt: str) -> None:
    """The native replay's inline frames (folded: by code address, its lines re-sorted) are
    the Python replay's, byte for byte."""
    native = _ours(recorded[name], fmt)
    assert native == _ours(recorded[name], fmt, pipe=True)
    assert ("_[i]" if fmt == "folded" else '"inlined":true') in native


@pytest.mark.parametrize("name", ["c", "cxx", "rust"])
def test_no_inline_is_perfs(recorded: dict[str, Path], name: str) -> None:
    path = recorded[name]
    theirs = _blocks(_perf(path, "--no-inline"))
    ours = _blocks(_ours(path, "perf-script", "--no-inline"))
    assert set(ours) == set(theirs)
    same = sum(ours[k] == theirs[k] for k in theirs)
    assert same >= MIN_MATCH * len(theirs), f"{same}/{len(theirs)}"
    assert not any("(inlined)" in t for t in ours.values())


def _vaddrs(dso: str, rels: list[int]) -> dict[int, int]:
    """{virtual address: file offset} of ``rels``: frames carry file offsets (``rel``, as perf
    prints user frames), llvm's tools take the ELF virtual address, which differs where the
    linker does not place segments at their file offsets (lld, rustc's linker, puts the text
    segment a page above its offset)."""
    out = {}
    for rel in rels:
        va = binfacts.vaddr(dso, rel)
        assert va is not None, (dso, hex(rel))
        out[va] = rel
    return out


def _llvm_levels(dso: str, rels: list[int]) -> dict[int, list[str]]:
    """llvm-addr2line -i's locations (basename:line, innermost first) at each file offset."""
    rel_of = _vaddrs(dso, rels)
    out = subprocess.run(["llvm-addr2line", "-a", "-i", "-e", dso, *map(hex, rel_of)],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    got: dict[int, list[str]] = {}
    cur: list[str] = []
    for line in out.splitlines():
        if line.startswith("0x"):
            cur = got.setdefault(rel_of[int(line, 16)], [])
        elif line:
            file, _, num = line.rpartition(":")
            cur.append(f"{os.path.basename(file)}:{num.split()[0] if num else '0'}")
    return got


@pytest.mark.parametrize("name", ["c", "cxx", "rust"])
def test_source_lines_are_addr2lines(recorded: dict[str, Path], name: str) -> None:
    """Each user frame's file:line is llvm-addr2line -i's at that inline level."""
    import json

    samples = [json.loads(x) for x in _ours(recorded[name], "jsonl").splitlines() if x]
    # per (dso, rel): the frames of one pc, innermost first, as one sample shows them
    chains: dict[tuple[str, int], list[dict[str, Any]]] = {}
    count: defaultdict[tuple[str, int], int] = defaultdict(int)
    def close(run: list[dict[str, Any]]) -> None:
        if run:
            k0 = (run[0]["dso"], int(run[0]["rel"], 16))
            chains.setdefault(k0, run)
            count[k0] += len(run)

    for s in samples:
        # one pc's frames: its inlined ones, then the frame itself (perf's rule: a level not
        # named as the symbol stays inlined, so a chain may also end where the pc changes)
        run: list[dict[str, Any]] = []
        for f in s["frames"]:
            if f["kernel"] or not f["dso"] or not f["dso"].startswith("/"):
                continue
            key = (f["dso"], int(f["rel"], 16))
            if run and (run[0]["dso"], int(run[0]["rel"], 16)) != key:
                close(run)
                run = []
            run.append(f)
            if not f["inlined"]:
                close(run)
                run = []
        close(run)
    by_dso: defaultdict[str, list[int]] = defaultdict(list)
    for dso, rel in chains:
        by_dso[dso].append(rel)
    total = good = with_line = 0
    bad = []
    for dso, rels in by_dso.items():
        want = _llvm_levels(dso, rels)
        for rel in rels:
            chain = chains[(dso, rel)]
            theirs = [w for w in want.get(rel, []) if not w.startswith("??:")]
            mine = [f"{os.path.basename(f['file'])}:{f['line']}" if f["file"] else None
                    for f in chain]  # fmt: skip
            n = count[(dso, rel)]
            total += n
            with_line += n * any(mine)
            # a recursive call at one pc whose levels are all inlined-named repeats its chain
            reps = len(mine) // len(theirs) if theirs else 1
            ok = mine == theirs * reps if any(mine) else not theirs
            good += n * ok
            if not ok:
                bad.append((dso, hex(rel), mine, theirs))
    print(f"\n[{name}] frames with the oracle's lines: {good}/{total}")
    assert total > 500 and with_line > 0.5 * total, (total, with_line)
    assert good >= MIN_MATCH * total, f"{good}/{total}: {bad[:4]}"


GO = shutil.which("go") or "/usr/bin/go"
# a Line of ``go tool pprof -raw``'s Locations (profile.go Location.string): "name file:line
# s=start", the first after "id: 0xaddr M=mapping", a full name in parentheses when it differs
_RAW_LOC = re.compile(r"^\s+(\d+): 0x([0-9a-f]+) M=\d+ (.*)$")
_RAW_LINE = re.compile(r"^(.*) (\S*):(\d+) s=(\d+)(?:\(.*\))?$")


def _pprof_lines(raw: str) -> dict[int, list[tuple[str, int]]]:
    """-raw's locations: {address: [(function filename, start_line) per Line, innermost
    first]}."""
    out: dict[int, list[tuple[str, int]]] = {}
    cur: list[tuple[str, int]] | None = None
    inside = False
    for ln in raw.splitlines():
        if ln.startswith("Locations"):
            inside = True
            continue
        if inside and ln and not ln[0].isspace():
            break
        if not inside:
            continue
        m = _RAW_LOC.match(ln)
        text = ln.strip()
        if m:
            cur = out.setdefault(int(m.group(2), 16), [])
            text = m.group(3)
        line = _RAW_LINE.match(text)
        if cur is not None and line:
            cur.append((line.group(2), int(line.group(4))))
    return out


def _llvm_starts(dso: str, rels: list[int]) -> dict[int, list[tuple[str, int]]]:
    """llvm-symbolizer --verbose -i's (function start filename, start line) per inline level
    (innermost first; ("", 0) where it has none), at each file offset."""
    rel_of = _vaddrs(dso, rels)
    out = subprocess.run(["llvm-symbolizer", "--verbose", "-a", "-i", "-e", dso,
                          *map(hex, rel_of)], check=True, capture_output=True,
                         text=True).stdout  # fmt: skip
    got: dict[int, list[tuple[str, int]]] = {}
    levels: list[list[str | int]] = []
    for ln in out.splitlines():
        if ln.startswith("0x"):
            levels = got.setdefault(rel_of[int(ln, 16)], [])  # type: ignore[arg-type]
        elif ln and not ln[0].isspace():
            levels.append(["", 0, ""])  # a level: start file, start line, file
        elif ln.startswith("  Function start filename: ") and levels:
            levels[-1][0] = ln.split(": ", 1)[1]
        elif ln.startswith("  Function start line: ") and levels:
            levels[-1][1] = int(ln.split(": ", 1)[1])
        elif ln.startswith("  Filename: ") and levels:
            levels[-1][2] = ln.split(": ", 1)[1]
    return {a: [(str(f), int(n)) for f, n, file in lv if file != "??"]
            for a, lv in got.items()}  # type: ignore[misc]


@pytest.mark.parametrize("name", ["c", "cxx", "rust"])
def test_pprof_start_lines_are_llvms(recorded: dict[str, Path], name: str,
                                     tmp_path: Path) -> None:  # fmt: skip
    import json

    prof = tmp_path / f"{name}.pb.gz"
    prof.write_bytes(subprocess.run([*CLI, str(recorded[name]), "--format", "pprof"],
                                    check=True, capture_output=True, timeout=300).stdout)
    env = {**os.environ, "HOME": str(tmp_path), "PPROF_TMPDIR": str(tmp_path)}
    raw = subprocess.run([GO, "tool", "pprof", "-raw", str(prof)], check=True, env=env,
                         capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    locs = _pprof_lines(raw)
    # each location's address (the frames' ip) as its binary and file address, from the
    # same replay's jsonl
    where: dict[int, tuple[str, int]] = {}
    for x in _ours(recorded[name], "jsonl").splitlines():
        for f in json.loads(x)["frames"] if x else ():
            if not f["kernel"] and f["dso"] and f["dso"].startswith("/"):
                where[int(f["ip"], 16)] = (f["dso"], int(f["rel"], 16))
    by_dso: defaultdict[str, list[int]] = defaultdict(list)
    for ip in locs:
        if ip in where:
            by_dso[where[ip][0]].append(where[ip][1])
    total = good = started = 0
    bad = []
    for dso, rels in by_dso.items():
        want = _llvm_starts(dso, rels)
        for ip, lines in locs.items():
            if ip not in where or where[ip][0] != dso:
                continue
            theirs = want.get(where[ip][1], [])
            if not theirs:
                continue
            # a recursive call at one pc whose levels are all inlined-named is one location
            # (store/pprof.py joins an inlined frame to the next at its pc): its chain repeats
            theirs = theirs * max(1, len(lines) // len(theirs))
            for i, (file, start) in enumerate(lines):
                total += 1
                tf, ts = theirs[i] if i < len(theirs) else ("", -1)
                ok = start == ts and (not tf or os.path.basename(file) == os.path.basename(tf))
                good += ok
                started += start > 0 and ok
                if not ok:
                    bad.append((dso, hex(where[ip][1]), i, (file, start), (tf, ts)))
    print(f"\n[{name}] pprof start lines equal llvm-symbolizer's: {good}/{total}")
    assert total > 20 and started > 0.5 * total, (total, started)
    assert good >= MIN_MATCH * total, f"{good}/{total}: {bad[:4]}"
    if name == "c":  # pprof -list shows walk from its definition's line in the source on
        src = (SRC / "inline.c").read_text().splitlines()
        want = next(i for i, ln in enumerate(src, 1) if "double walk(int n)" in ln)
        listed = subprocess.run([GO, "tool", "pprof", "-list", "^walk$", str(prof)], env=env,
                                check=True, capture_output=True, text=True,
                                timeout=120).stdout  # fmt: skip
        nums = [int(m.group(1)) for m in re.finditer(r"^\s+\S+\s+\S+\s+(\d+):", listed, re.M)]
        assert nums and nums[0] == want, (want, listed[:400])
