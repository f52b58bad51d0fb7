"""CPython's own frames in the daemon's stacks ([python] frames): real interpreters sampled by
the real daemon, each sample's Python functions compared with the workload's own
``sys._current_frames()`` for the phase the sample falls in; a process that exits while its
samples are read, and an interpreter without a known layout, end counted, never wrong."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonutil import DaemonProc, dechunk, held, metric_values, release

WORKLOAD = Path(__file__).parent.parent / "support" / "workloads" / "pyphases.py"
PYENV = Path("/root/.pyenv/versions")
# CPython 3.11+ interpreters on this machine: the one running the tests, Debian's (static,
# non-PIE, stripped: _PyRuntime from .dynsym) and pyenv's 3.12 and 3.13 (libpython; 3.13 by
# its _Py_DebugOffsets).
INTERPRETERS = [sys.executable, "/usr/bin/python3.11",
                *sorted(str(p) for p in PYENV.glob("3.1[23].*/bin/python3"))]  # fmt: skip
PY310 = sorted(PYENV.glob("3.10.*/bin/python3"))
SPIN_SECONDS = 0.4  # CPU seconds per phase: ~200 samples at the daemon's 499 Hz


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path_factory.mktemp("pyframes"))
    try:
        d.wait_message("READY=1")
        warm(d)
        yield d
    finally:
        d.stop()


def stream_run(d: DaemonProc, argv: list[str], seconds: float) -> tuple[int, list[Any]]:
    """Run ``argv`` held until ``/v1/stream?pid=`` of it has subscribed; its streamed samples
    (JSON) once the daemon has stored all of its samples (``wait_settled``)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(seconds + 60)
    s.connect(str(d.sock))
    child = held(argv)
    s.sendall(f"GET /v1/stream?pid={child.pid}&seconds={seconds} HTTP/1.1\r\nHost: x\r\n\r\n"
              .encode())  # fmt: skip
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, buf
        buf += chunk
    parts = [buf]

    def drain() -> None:  # the stream is read all along: a slow client would be dropped
        with contextlib.suppress(OSError):
            while chunk := s.recv(1 << 20):
                parts.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    release(child)
    assert child.wait(60) == 0
    d.wait_settled(child.pid, timeout=60)  # stored, so streamed: a round streams, then stores
    s.shutdown(socket.SHUT_RDWR)
    reader.join(10)
    s.close()
    body = b"".join(parts).partition(b"\r\n\r\n")[2]
    if not body.endswith(b"\r\n0\r\n\r\n"):
        body += b"0\r\n\r\n"
    return child.pid, [json.loads(ln) for ln in dechunk(body).splitlines()]


def warm(d: DaemonProc) -> None:
    """Until a fresh daemon answers within a second: its first steps load the machine's cold
    binaries, which on a loaded machine can hold its loop for longer than a query waits."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        with contextlib.suppress(TimeoutError):
            d.json("/v1/status")
            if time.monotonic() - t0 < 1:
                return
        time.sleep(0.5)
    raise AssertionError("the daemon never answered within a second")


def py_frames(sample: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in sample["frames"] if f["dso"] == "[python]"]


def kind(sample: dict[str, Any], truth: list[str]) -> str:
    """How a sample shows its phase: ``right``, ``wrong:<its Python names>``, ``native``
    (interpreter frames kept: counted as not read in time) or ``no_eval:<unwind status>``."""
    syms = [f["sym"] for f in py_frames(sample)]
    if syms:
        return "right" if syms == truth else "wrong:" + ",".join(syms)
    if any(f["sym"] == "_PyEval_EvalFrameDefault" for f in sample["frames"]):
        return "native"
    return "no_eval:" + sample["unwind_status"]


@pytest.mark.parametrize("python", INTERPRETERS)
def test_python_functions_name_the_samples(daemon: DaemonProc, tmp_path: Path,
                                           python: str) -> None:  # fmt: skip
    """>= 90 % of the main thread's samples in each phase's window show the phase's Python
    functions in caller order, in place of the interpreter's C frames, with their file."""
    if not os.path.exists(python):
        pytest.skip(f"{python} is not installed")
    phases = tmp_path / "phases.jsonl"
    st0 = daemon.json("/v1/status")["runtimes"]["python"]
    before = st0["named"]
    pid, samples = stream_run(daemon, [python, str(WORKLOAD), str(phases), str(SPIN_SECONDS)],
                              120)  # fmt: skip
    got = [json.loads(ln) for ln in phases.read_text().splitlines()]
    assert [p["phase"] for p in got] == ["warmup", "grind", "steep", "pour"]
    got = got[1:]
    main = [s for s in samples if s["tid"] == pid]
    for p in got:
        kinds: Counter[str] = Counter()  # right, wrong:<names>, native, no_eval:<status>
        for s in main:
            if not p["start"] <= s["time_ns"] <= p["end"]:
                continue
            kinds[kind(s, p["truth"])] += 1
            if kind(s, p["truth"]) == "right":
                pyf = py_frames(s)
                assert {f["file"] for f in pyf} == {str(WORKLOAD)}
                assert all(f["line"] for f in pyf)
                assert not any(f["sym"] == "_PyEval_EvalFrameDefault" for f in s["frames"])
        n = kinds.total()
        assert n >= 30 and kinds["right"] >= 0.9 * n, (python, p["phase"], p["truth"], kinds)
    st = daemon.json("/v1/status")["runtimes"]["python"]
    assert st["named"] - before >= sum(1 for _ in main) * 0.5, st
    named = metric_values(daemon.metrics(), "unwindd_runtime_named_samples_total")
    assert named['{runtime="python"}'] >= st["named"], named


def test_exit_while_read_is_counted_never_wrong(daemon: DaemonProc) -> None:
    """A process that exits while its last samples wait in the rings: their frames cannot be
    read (gone), so they keep the interpreter's C frames, counted; none is named wrongly."""
    code = ("import os, time\n"
            "def busy():\n"
            "    end = time.thread_time() + 0.5\n"
            "    while time.thread_time() < end: pass\n"
            "    os._exit(0)\n"
            "busy()\n")  # fmt: skip
    before = daemon.json("/v1/status")["runtimes"]["python"]["failures"]
    _, samples = stream_run(daemon, [sys.executable, "-c", code], 120)
    after = daemon.json("/v1/status")["runtimes"]["python"]["failures"]
    # Which reason its last samples end with depends on where the exit falls against the
    # reader's 10 ms reads: ``gone`` (a read after the exit), ``moved`` or ``late`` (no read
    # near enough the sample); each is counted, none names a frame
    assert sum(after.values()) > sum(before.values()), (before, after)
    named = [s for s in samples if py_frames(s)]
    in_busy = [s for s in named if any(f["sym"] == "busy" for f in py_frames(s))]
    assert in_busy, "busy never named"
    for s in in_busy:
        assert [f["sym"] for f in py_frames(s)] == ["busy", "<module>"], s["frames"]
    # The rest is what runs before busy (the interpreter's start-up, the script's imports):
    # named so only up to a read's matching window (10 ms) after busy's first sample.
    first = min(s["time_ns"] for s in in_busy)
    for s in named:
        if s not in in_busy:
            assert s["time_ns"] <= first + 10_000_000, s["frames"]
    kept = [s for s in samples if not py_frames(s)]
    assert any(f["sym"] == "_PyEval_EvalFrameDefault" for s in kept for f in s["frames"])
    m = metric_values(daemon.metrics(), "unwindd_python_frame_failures_total")
    assert all(m[f'{{reason="{r}"}}'] >= n for r, n in after.items()), (m, after)


def test_own_samples_are_not_read(daemon: DaemonProc) -> None:
    """The daemon does not read its own Python frames (each read would be more of its own
    samples to read): its samples keep ``_PyEval_EvalFrameDefault``, counted as ``self``."""
    before = daemon.json("/v1/status")["runtimes"]["python"]["failures"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # queries keep the daemon's interpreter on the CPU
        daemon.get("/v1/stacks?limit=1000")
        after = daemon.json("/v1/status")["runtimes"]["python"]["failures"]
        if after["self"] > before["self"] + 20:
            break
    assert after["self"] > before["self"] + 20, (before, after)
    own = daemon.json(f"/v1/stacks?pid={daemon.proc.pid}&limit=100000")
    frames = [f for s in own["stacks"] for f in s["frames"]]
    assert any(f["sym"] == "_PyEval_EvalFrameDefault" for f in frames), own
    assert not any(f["dso"] == "[python]" for f in frames)


@pytest.mark.skipif(not PY310, reason="no CPython 3.10 on this machine")
def test_unknown_version_keeps_native_frames(daemon: DaemonProc) -> None:
    """CPython 3.10 has ``_PyRuntime`` but no ``Py_Version`` and no known layout: its stacks
    keep ``_PyEval_EvalFrameDefault``, counted as unknown_version."""
    before = daemon.json("/v1/status")["runtimes"]["python"]["failures"]
    code = "import time\nend = time.thread_time() + 0.5\nwhile time.thread_time() < end: pass\n"
    _, samples = stream_run(daemon, [str(PY310[0]), "-c", code], 120)
    after = daemon.json("/v1/status")["runtimes"]["python"]["failures"]
    assert after["unknown_version"] > before["unknown_version"], (before, after)
    assert samples and not any(py_frames(s) for s in samples)
    assert any(f["sym"] == "_PyEval_EvalFrameDefault" for s in samples for f in s["frames"])


def test_beside_keeps_the_interpreter_frames(tmp_path: Path) -> None:
    """``[python] frames = "beside"``: each Python segment sits just inside (leaf side of) the
    C frame that runs it; ``off`` reads nothing."""
    d = DaemonProc(tmp_path, extra_toml='[python]\nframes = "beside"\n')
    try:
        d.wait_message("READY=1")
        warm(d)
        phases = tmp_path / "phases.jsonl"
        pid, samples = stream_run(d, [sys.executable, str(WORKLOAD), str(phases), "0.4"], 120)
        got = {p["phase"]: p for p in map(json.loads, phases.read_text().splitlines())}
        pour = got["pour"]
        window = [s for s in samples if s["tid"] == pid
                  and pour["start"] <= s["time_ns"] <= pour["end"]]  # fmt: skip
        right = 0
        for s in window:
            syms = [f["sym"] for f in s["frames"]]
            # spin, Kettle.drip | C frames of map() | Kettle.pour, main, <module>
            if [f["sym"] for f in py_frames(s)] != pour["truth"]:
                continue
            i, j = syms.index("Kettle.drip"), syms.index("Kettle.pour")
            assert syms[i + 1] == "_PyEval_EvalFrameDefault", syms
            assert syms[j - 1] != "_PyEval_EvalFrameDefault" and syms[-1] != "<module>", syms
            assert syms.count("_PyEval_EvalFrameDefault") == 2, syms
            right += 1
        assert right >= 0.9 * len(window) and window, (right, len(window))
    finally:
        d.stop()
    assert d.proc.returncode == 0


def test_check_config_knows_the_python_section(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[python]\nframes = "sometimes"\n')
    res = subprocess.run([sys.executable, "-m", "unwindd.cli", "check-config", str(bad)],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert res.returncode == 2 and "[python] frames: must be one of" in res.stderr, res.stderr


PY312 = sorted(PYENV.glob("3.1[23].*/bin/python3"))


@pytest.mark.skipif(not PY312, reason="no CPython 3.12+ on this machine")
def test_perf_map_names_are_kept(daemon: DaemonProc, tmp_path: Path) -> None:
    """``-X perf`` (3.12+): the interpreter's perf map already names its functions
    (``py::<qualname>:<file>`` trampolines); those stacks are left as they are."""
    phases = tmp_path / "phases.jsonl"
    pid, samples = stream_run(daemon, [str(PY312[0]), "-X", "perf", str(WORKLOAD), str(phases),
                                       str(SPIN_SECONDS)], 120)  # fmt: skip
    trampolined = [s for s in samples if s["tid"] == pid
                   and any((f["sym"] or "").startswith("py::spin:") for f in s["frames"])]
    assert len(trampolined) >= 30, len(samples)
    assert not any(py_frames(s) for s in trampolined)
