"""One spelling for what has no name, as perf spells it, through the commands users run.

- A frame without a symbol is ``[unknown]`` (stackfmt.UNKNOWN) in every output, its binary
  named only where the output has a place for it: ``unwindd replay`` (native and Python paths)
  and ``unwindd record`` in folded, perf-script and jsonl; the daemon's top, folded, pprof and
  watch through ``unwindctl``. The workload is chain.c built and then ``strip``ped: its frames
  unwind (.eh_frame stays) but have no symbols.
- Pid 0 (the idle task) is ``swapper``, as perf names it (source/comms.py): replay's
  perf-script, folded, jsonl and summary, ``unwindd record --all``, ``unwindctl ps``.
- A process older than ``unwindd record`` shows its /proc comm in the summary's per-pid table.

Oracles: perf script and perf's own stackcollapse.py (tools/perf/scripts/python) on the same
perf.data, and /proc/<pid>/comm.
"""

from __future__ import annotations

import atexit
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonutil import UNWINDCTL, DaemonProc, held, release, watch_from_exec
from perfutil import PERF, build_busy, record_perf_data
from pprofcheck import check_valid, decode
from procutil import wait_cpu_seconds, wait_perf_fds, wait_stderr_line
from refreplay import python_replay_bytes
from unwindd.source.sampling import online_cpus
from workloads.build import CFLAGS, SRC

UNWINDD = [sys.executable, "-m", "unwindd.cli"]
UNKNOWN = "[unknown]"
COMM = "chain_stripped"
# perf's stackcollapse.py, as the perf package installs it (perf script -s runs it)
STACKCOLLAPSE = next(
    (p for p in (Path("/usr/lib/perf-core/scripts/python/stackcollapse.py"),
                 Path("/usr/libexec/perf-core/scripts/python/stackcollapse.py")) if p.exists()),
    None,
)  # fmt: skip


@pytest.fixture(scope="module")
def stripped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """chain.c (a -> b -> c -> spin) built as the workloads are, then stripped of .symtab."""
    exe = tmp_path_factory.mktemp("spelling-wl") / COMM
    subprocess.run(["gcc", *CFLAGS, "-O2", "-o", str(exe), str(SRC / "chain.c")], check=True)
    subprocess.run(["strip", str(exe)], check=True)
    syms = subprocess.run(["nm", str(exe)], capture_output=True, text=True)
    assert "no symbols" in syms.stderr, syms.stdout[:200]
    return exe


def _perf_empty_cache() -> list[str]:
    """perf with an empty build-id cache (``perf --buildid-dir``): perf looks a binary up there
    by build-id before its path, and an unstripped build of the same source, cached by an
    earlier recording (strip keeps the build-id), would name the stripped one's frames."""
    empty = tempfile.mkdtemp(prefix="unwindd-buildid-")
    atexit.register(shutil.rmtree, empty, ignore_errors=True)
    return [PERF, "--buildid-dir", empty]


def _perf_script(path: Path) -> str:
    return subprocess.run([*_perf_empty_cache(), "script", "-i", str(path), "-F",
                           "comm,pid,tid,time,ip,sym,dso", "--ns"], capture_output=True,
                          text=True, check=True, errors="surrogateescape").stdout  # fmt: skip


def _replay(path: Path, fmt: str) -> bytes:
    """``unwindd replay FILE --format fmt`` (the native path for folded/jsonl/perf-script)."""
    res = subprocess.run([*UNWINDD, "replay", str(path), "--format", fmt], capture_output=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout


def _folded(text: str) -> Counter[tuple[str, ...]]:
    out: Counter[tuple[str, ...]] = Counter()
    for line in text.splitlines():
        key, _, n = line.rpartition(" ")
        out[tuple(key.split(";"))] += int(n)
    return out


def _bracketed(folded: Counter[tuple[str, ...]]) -> set[str]:
    """Frame names spelled like a made-up name (``[...]``): only [unknown] may be one."""
    return {n for k in folded for n in k[1:] if n.startswith("[")}


def _hottest_unknown_mask(folded: Counter[tuple[str, ...]], comm: str) -> tuple[bool, ...]:
    """Which frames of ``comm``'s hottest stack are unknown, outermost first (the names
    themselves may differ from perf's python binding, which names some libc symbols
    differently from perf script: only where the unknown frames are is compared)."""
    masks: Counter[tuple[bool, ...]] = Counter()
    for k, n in folded.items():
        if k[0] == comm:
            masks[tuple(x in (UNKNOWN, UNKNOWN + "_[k]") for x in k[1:])] += n
    assert masks, f"no stacks of {comm}"
    return masks.most_common(1)[0][0]


def _heads(text: str, pid: int) -> list[str]:
    """perf script's sample header lines (comm pid/tid time:) of ``pid``, in order."""
    pat = re.compile(rf"^.*\s{pid}/\d+\s+\d+\.\d{{9}}: $")
    return [ln for ln in text.splitlines() if pat.match(ln)]


# ---------------------------------------------------------------- replay: unknown frames


@pytest.fixture(scope="module")
def stripped_data(stripped: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_perf_data(tmp_path_factory.mktemp("spelling-rec"), [str(stripped), "60"],
                            name="stripped.data")  # fmt: skip


def test_replay_unknown_frames_as_perf(stripped: Path, stripped_data: Path) -> None:
    path = stripped_data
    for fmt in ("folded", "jsonl", "perf-script"):  # native and Python replay agree
        assert _replay(path, fmt) == python_replay_bytes(path, fmt), fmt
    ours = _folded(_replay(path, "folded").decode())
    assert _bracketed(ours) <= {UNKNOWN, UNKNOWN + "_[k]"}, _bracketed(ours)
    mask = _hottest_unknown_mask(ours, COMM)
    assert sum(mask) >= 4, mask  # _start, main, a, b, c, spin are all in the stripped binary
    # perf's own folding of the same file (perf script -s stackcollapse.py --kernel)
    assert STACKCOLLAPSE is not None, "perf's scripts/python/stackcollapse.py is not installed"
    res = subprocess.run([*_perf_empty_cache(), "script", "-i", str(path), "-s",
                          str(STACKCOLLAPSE), "--", "--kernel"], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    theirs = _folded(res.stdout)
    assert _hottest_unknown_mask(theirs, COMM) == mask
    # perf script: the same "[unknown] (binary)" lines as perf's for the stripped binary
    tail = f" ({stripped})"
    want = {ln.split(None, 1)[1] for ln in _perf_script(path).splitlines() if ln.endswith(tail)}
    got = {ln.split(None, 1)[1] for ln in _replay(path, "perf-script").decode().splitlines()
           if ln.endswith(tail)}  # fmt: skip
    assert want == got == {f"{UNKNOWN}{tail}"}
    # jsonl keeps the fields: no sym, the binary in dso
    frames = [f for ln in _replay(path, "jsonl").splitlines() for f in json.loads(ln)["frames"]
              if f["dso"] == str(stripped)]  # fmt: skip
    assert frames and all(f["sym"] is None for f in frames)


# ---------------------------------------------------------------- replay: the idle task


@pytest.fixture(scope="module")
def system_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A machine-wide recording with idle samples (retried: a fully busy second has none)."""
    tmp = tmp_path_factory.mktemp("spelling-sys")
    for i in range(5):
        path = record_perf_data(tmp, ["sleep", "1"], extra=("-a",), name=f"system{i}.data")
        text = _perf_script(path)
        if _heads(text, 0):
            return path, text
    raise AssertionError("no idle (pid 0) samples in 5 machine-wide seconds")


def test_replay_idle_task_is_swapper(system_data: tuple[Path, str]) -> None:
    path, perf_text = system_data
    perf_heads = _heads(perf_text, 0)
    assert all(h.startswith("swapper ") for h in perf_heads)  # what perf calls it
    assert _heads(_replay(path, "perf-script").decode(), 0) == perf_heads
    assert _heads(python_replay_bytes(path, "perf-script").decode(), 0) == perf_heads
    for folded in (_replay(path, "folded"), python_replay_bytes(path, "folded")):
        f = _folded(folded.decode())
        assert sum(n for k, n in f.items() if k[0] == "swapper") == len(perf_heads)
    samples = [json.loads(ln) for ln in _replay(path, "jsonl").splitlines()]
    assert {s["comm"] for s in samples if s["pid"] == 0} == {"swapper"}
    res = subprocess.run([*UNWINDD, "replay", str(path), "--top", "0"], capture_output=True,
                         text=True, timeout=300)  # fmt: skip  (summary: the Python path)
    assert res.returncode == 0, res.stderr
    assert _pid_rows(res.stdout)[0] == (len(perf_heads), "swapper"), res.stdout


# ---------------------------------------------------------------- unwindd record


def _record(*args: str) -> str:
    res = subprocess.run([*UNWINDD, "record", *args], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout


def _pid_rows(summary: str) -> dict[int, tuple[int, str]]:
    """The summary's per-pid table: pid -> (samples, comm)."""
    lines = summary.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.split() == ["pid", "samples", "comm"])
    rows = {}
    for ln in lines[start + 1 :]:
        parts = ln.split(None, 2)
        if len(parts) != 3 or not parts[0].isdigit():
            break
        rows[int(parts[0])] = (int(parts[1]), parts[2])
    return rows


@pytest.fixture
def running(stripped: Path) -> Iterator[int]:
    """The stripped workload, started before the recording and running through it."""
    p = subprocess.Popen([str(stripped), "1000000"], stdout=subprocess.DEVNULL)
    try:
        wait_cpu_seconds(p.pid, 0.1)  # past its exec: /proc names it
        assert Path(f"/proc/{p.pid}/comm").read_text().strip() == COMM
        yield p.pid
    finally:
        p.kill()
        p.wait()


def test_record_names(running: int, stripped_data: Path) -> None:
    pid = running
    folded = _folded(_record("--pid", str(pid), "--duration", "1", "-F", "499",
                             "--format", "folded"))  # fmt: skip
    assert {k[0] for k in folded} == {COMM}
    assert _bracketed(folded) <= {UNKNOWN, UNKNOWN + "_[k]"}, _bracketed(folded)
    # live names the stripped binary's frames as the replay (and perf) does
    replayed = _folded(_replay(stripped_data, "folded").decode())
    assert _hottest_unknown_mask(folded, COMM) == _hottest_unknown_mask(replayed, COMM)
    # the process older than the recording, by its /proc name
    rows = _pid_rows(_record("--pid", str(pid), "--duration", "1", "-F", "499"))
    assert rows[pid][1] == COMM, rows


def test_record_names_forked_child(tmp_path: Path) -> None:
    """A child that never execs is named as its parent in the summary, as in its samples (and
    as perf's thread__fork names it): busy.c forks once and both spin."""
    busy = build_busy(tmp_path)
    child = held([str(busy), "0.5"])
    rec = subprocess.Popen([*UNWINDD, "record", "--pid", str(child.pid), "-F", "499",
                            "--status-interval", "0.2"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_perf_fds(rec.pid, len(online_cpus()), rec)
        wait_stderr_line(rec, r"unwindd: \d+s samples=\d+ ")  # sampling: the loop runs
        release(child)
        assert child.wait(60) == 0
        out, err = rec.communicate(timeout=60)  # (it ends by itself: its one pid has exited)
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.communicate()
    assert rec.returncode == 0, err
    rows = _pid_rows(out)
    assert len(rows) == 2 and child.pid in rows, rows  # the parent and its forked child
    assert {comm for _, comm in rows.values()} == {"busy"}, rows


def test_record_idle_task_is_swapper() -> None:
    """Machine-wide, the idle task by perf's name (retried: a fully busy machine has none)."""
    for _ in range(10):
        rows = _pid_rows(_record("--all", "--duration", "1", "-F", "999", "--top", "0"))
        if 0 in rows:
            break
    assert 0 in rows, f"no idle (pid 0) samples in 10 machine-wide seconds: {rows}"
    assert rows[0][1] == "swapper", rows[0]
    assert "?" not in {comm for _, comm in rows.values()}, rows


# ---------------------------------------------------------------- the daemon, via unwindctl


@pytest.fixture(scope="module")
def daemon(
    stripped: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[DaemonProc, int]]:
    d = DaemonProc(tmp_path_factory.mktemp("spelling-d"))
    try:
        d.wait_message("READY=1")
        proc = subprocess.Popen([str(stripped), "100"], stdout=subprocess.DEVNULL)
        assert proc.wait(60) == 0
        d.wait_settled(proc.pid)
        yield d, proc.pid
    finally:
        assert d.stop() == 0


def _ctl(d: DaemonProc, *args: str) -> str:
    res = subprocess.run([*UNWINDCTL, "--socket", str(d.sock), *args], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_daemon_unknown_frames(daemon: tuple[DaemonProc, int], stripped: Path,
                               tmp_path: Path) -> None:  # fmt: skip
    d, pid = daemon
    # top: spin (hottest, in the stripped binary) is [unknown], its binary in the DSO column
    lines = _ctl(d, "top", "--pid", str(pid), "--since", "300").splitlines()
    assert lines[0].startswith("window: ") and lines[1].split()[4:] == ["FUNCTION", "DSO"]
    assert lines[2].split()[4:] == [UNKNOWN, stripped.name], lines  # basenames by default
    top = json.loads(_ctl(d, "--json", "top", "--pid", str(pid), "--since", "300"))
    assert (top["functions"][0]["sym"], top["functions"][0]["dso"]) == (UNKNOWN, str(stripped))
    folded = _folded(_ctl(d, "folded", "--pid", str(pid)))
    # the pid's samples before its exec (the test's fork of itself) carry the forking comm
    pre_exec = Path("/proc/self/comm").read_text().strip()
    assert COMM in {k[0] for k in folded} <= {COMM, pre_exec}
    assert _bracketed(folded) <= {UNKNOWN, UNKNOWN + "_[k]"}, _bracketed(folded)
    assert sum(_hottest_unknown_mask(folded, COMM)) >= 4
    out = tmp_path / "p.pb.gz"
    _ctl(d, "pprof", "--pid", str(pid), "-o", str(out))
    p = decode(out.read_bytes())
    check_valid(p)
    in_binary = {(name, fname) for name, _, fname in p.functions.values()
                 if fname == str(stripped)}  # fmt: skip
    assert in_binary == {(UNKNOWN, str(stripped))}, in_binary
    assert not any(name.startswith("[/") for name, _, _ in p.functions.values())


def test_daemon_watch_and_idle(daemon: tuple[DaemonProc, int], stripped: Path) -> None:
    d, _ = daemon
    _, out, rc = watch_from_exec(d, [str(stripped), "100"], 20)
    assert rc == 0
    chains = [ln.split(None, 3)[3].split(" <- ") for ln in out.splitlines()
              if f" {COMM} " in ln]  # fmt: skip
    assert chains, out
    assert any(UNKNOWN in c for c in chains) and not any("?" in c for c in chains), out
    # the idle task: sampled machine-wide by default, named as perf names it
    for _ in range(60):
        procs = json.loads(_ctl(d, "--json", "ps", "--limit", "100000"))["processes"]
        idle = [p for p in procs if p["pid"] == 0]
        if idle:
            break
        subprocess.run(["sleep", "0.5"], check=True)
    assert idle and idle[0]["comm"] == "swapper", idle
    row = next(ln.split() for ln in _ctl(d, "ps", "--limit", "100000").splitlines()[1:]
               if ln.split()[0] == "0")  # fmt: skip
    assert row[2] == "swapper", row

