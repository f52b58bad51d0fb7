"""``unwindd replay`` of perf.data files without user stack copies, judged against ``perf
script`` on the same file (perf is the oracle): ``perf record -g`` (frame-pointer callchains:
PERF_SAMPLE_CALLCHAIN with its user part, no REGS_USER/STACK_USER) and no call graph at all.

The workload (tests/support/workloads/fpchain.c) is built with ``gcc -O2
-fno-omit-frame-pointer``, so the kernel's frame-pointer walk finds its frames, and spends
part of its time in a read syscall, so callchains have a kernel part as well as a user part.
Each file is replayed by the native file driver (the CLI on the file) and by the Python
replay (the CLI on the same records as a pipe stream, ``perf inject -o -``); both must print
what perf prints: every frame of a sample, kernel and user, at the address perf prints and
with its name (``--format perf-script`` text parsed by oracle.parse_perf_script, and the
jsonl frames through ``oracle.compare``). The byte-for-byte comparison of the two replays
with every count is test_filereplay.py's (its "fp" and "nocg" files).
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import oracle
import pytest
from perfutil import PERF, record_perf_data
from unwindd.pipeline import filereplay
from unwindd.source.perfdata import PerfData
from unwindd.unwind.engine import StackEngine

SRC = Path(__file__).resolve().parents[1] / "support" / "workloads" / "fpchain.c"
CLI = (sys.executable, "-m", "unwindd.cli", "replay")
# at least this share of perf's samples must have exactly perf's frames
MIN_MATCH = 0.99
STATUS = {"fp": "callchain", "nocg": "ip_only"}
SOURCE = {"fp": "the recorded callchain (frame pointers)",
          "nocg": "the sample ip alone (no call graph recorded)"}  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fp, nocg and dwarf recordings of fpchain, and fp_pipe / nocg_pipe: the fp and nocg
    files' records as the byte stream ``perf record -o -`` writes (``perf inject -o -``)."""
    tmp = tmp_path_factory.mktemp("callchain")
    exe = tmp / "fpchain"
    subprocess.run(["gcc", "-O2", "-fno-omit-frame-pointer", "-Wall", "-Werror", "-o", str(exe),
                    str(SRC)], check=True, capture_output=True)  # fmt: skip
    out = {
        "fp": record_perf_data(tmp, [str(exe), "80"], call_graph="fp", name="fp.data"),
        "nocg": record_perf_data(tmp, [str(exe), "80"], call_graph=None, name="nocg.data"),
        "dwarf": record_perf_data(tmp, [str(exe), "10"], name="dwarf.data"),
    }
    for name in ("fp", "nocg"):
        pipe = tmp / f"{name}_pipe.data"
        with pipe.open("wb") as f:
            subprocess.run([PERF, "inject", "-i", str(out[name]), "-o", "-"], stdout=f,
                           stderr=subprocess.PIPE, check=True)  # fmt: skip
        assert pipe.read_bytes()[:8] == b"PERFILE2" and pipe.stat().st_size > 1000
        out[f"{name}_pipe"] = pipe
    return out


def replay(path: Path, fmt: str, *, pipe: bool = False) -> subprocess.CompletedProcess[str]:
    """``unwindd replay FILE`` (the native driver), or ``unwindd replay -`` with the file on
    stdin (the Python replay)."""
    if pipe:
        with path.open("rb") as f:
            return subprocess.run([*CLI, "-", "--format", fmt], stdin=f, capture_output=True,
                                  text=True, check=True, timeout=300)  # fmt: skip
    return subprocess.run([*CLI, str(path), "--format", fmt], capture_output=True, text=True,
                          check=True, timeout=300)  # fmt: skip


def perf_samples(path: Path) -> list[oracle.OracleSample]:
    """perf script's samples, parsed (no --no-inline: unwindd's perf-script text is compared
    whole, and the workload has no inlined frames to hide)."""
    text = subprocess.run([PERF, "script", "-i", str(path), "-F", "comm,pid,tid,time,ip,sym,dso",
                           "--ns"], capture_output=True, text=True, check=True).stdout  # fmt: skip
    return oracle.parse_perf_script(text).samples


@pytest.mark.parametrize("pipe", [False, True], ids=["native", "python"])
@pytest.mark.parametrize("name", ["fp", "nocg"])
def test_frames_are_perfs(files: dict[str, Path], name: str, pipe: bool) -> None:
    """Every sample's frames, kernel and user, are the ones perf script prints for it (ip as
    printed, name, dso), for all but 1 % of samples; the jsonl frames agree with perf under
    the oracle's rules too; every sample says where its frames came from."""
    path = files[f"{name}_pipe"] if pipe else files[name]
    theirs = perf_samples(files[name])
    ours = {s.key: s for s in oracle.parse_perf_script(replay(path, "perf-script",
                                                              pipe=pipe).stdout).samples}
    assert len(theirs) > 80 and len(ours) == len(theirs), (len(theirs), len(ours))
    same = [s for s in theirs if s.key in ours and ours[s.key] == s]
    both = [s for s in same if any(f.kernel for f in s.frames) and any(not f.kernel
                                                                      for f in s.frames)]
    bad = [(s, ours.get(s.key)) for s in theirs if s not in same]
    assert len(same) >= MIN_MATCH * len(theirs), f"{len(same)}/{len(theirs)}: {bad[:3]}"
    if name == "fp":  # a callchain: kernel and user entries; the read syscall's samples have both
        assert len(both) >= 3, Counter(len(s.frames) for s in same)
        assert sum(len(s.frames) >= 4 for s in same) >= len(theirs) // 2
    else:  # one frame each: perf prints it on the sample's line
        assert all(len(s.frames) == 1 for s in same)
    jsonl = [json.loads(line) for line in replay(path, "jsonl", pipe=pipe).stdout.splitlines()]
    assert Counter(s["unwind_status"] for s in jsonl) == {STATUS[name]: len(theirs)}
    script = oracle.perf_script(files[name])
    # perf prints callchain entries mapping-relative, a sample ip without a call graph absolute
    rep = oracle.compare(script.samples, jsonl, script.spaces if name == "fp" else None)
    assert not rep.extra and rep.match_ratio >= MIN_MATCH, rep.render(5)


@pytest.mark.parametrize("fmt", ["jsonl", "perf-script", "folded"])
@pytest.mark.parametrize("name", ["fp", "nocg"])
def test_pipe_replay_equals_native(files: dict[str, Path], name: str, fmt: str) -> None:
    """The Python replay of the pipe stream writes what the native driver writes for the
    file, and the native driver does take such files (no hand-over to Python)."""
    native = replay(files[name], fmt).stdout
    # not empty: folded without a call graph has a line per leaf only (spin, a few kernel ones)
    assert native.count("\n") >= (2 if fmt == "folded" else 4)
    assert replay(files[f"{name}_pipe"], fmt, pipe=True).stdout == native
    data = PerfData.open(files[name])
    out = io.StringIO()
    filereplay.replay(data, files[name], fmt, out, engine=StackEngine.create())  # no Unsupported
    data.close()
    assert out.getvalue() == native


def test_stderr_says_where_frames_come_from(files: dict[str, Path]) -> None:
    """One line on stderr, once, from either replay, in every format with frames; none for
    a file with stack copies."""
    for name in ("fp", "nocg"):
        for fmt in ("folded", "summary"):
            for pipe in (False, True):
                path = files[f"{name}_pipe"] if pipe else files[name]
                err = replay(path, fmt, pipe=pipe).stderr
                shown = "-" if pipe else str(path)
                assert err == f"unwindd: {shown}: no user stack copies; frames from " \
                              f"{SOURCE[name]}\n", (name, fmt, pipe, err)  # fmt: skip
    assert replay(files["dwarf"], "folded").stderr == ""
    assert replay(files["fp"], "records").stderr == ""  # records carry no frames


def _unwind_section(text: str) -> str:
    """The summary from its ``unwound samples:`` line on."""
    at = text.find("\nunwound samples: ")
    assert at >= 0, text
    return text[at + 1 :]


@pytest.mark.parametrize("name", ["fp", "nocg"])
def test_summary_reports_the_unwind(files: dict[str, Path], name: str) -> None:
    """``--format summary`` ends with record's unwind section (source/output.py
    render_unwind_summary): samples by status, the frames (what jsonl prints), and where
    they came from; the Python replay of the pipe stream says the same."""
    text = replay(files[name], "summary").stdout
    nsamples = int(re.search(r"^SAMPLE events: (\d+)$", text, re.M)[1])  # type: ignore[index]
    jsonl = [json.loads(line) for line in replay(files[name], "jsonl").stdout.splitlines()]
    assert len(jsonl) == nsamples > 80
    kernel = sum(f["kernel"] for s in jsonl for f in s["frames"])
    user = sum(len(s["frames"]) for s in jsonl) - kernel
    section = _unwind_section(text)
    head = (f"unwound samples: {nsamples}\n  {STATUS[name]}: {nsamples} (100.0%)\n"
            f"frames: user={user} kernel={kernel} unsymbolized=")  # fmt: skip
    assert section.startswith(head), section
    assert section.endswith(f"\nframes from: {SOURCE[name]}\n"), section
    if name == "nocg":  # one frame a sample, a kernel one for a sample taken in the kernel
        assert user + kernel == nsamples and kernel > 0
    assert _unwind_section(replay(files[f"{name}_pipe"], "summary", pipe=True).stdout) == section


def test_summary_of_stack_copies_says_dwarf(files: dict[str, Path]) -> None:
    section = _unwind_section(replay(files["dwarf"], "summary").stdout)
    assert re.match(r"unwound samples: \d+\n  ok: ", section), section
    assert section.endswith("\nframes from: user stack copies (DWARF unwind)\n"), section
