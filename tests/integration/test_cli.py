"""End-to-end tests of the ``unwindd`` command: live record of real processes, replay of real
perf.data files against perf's own counts, and the error paths a user meets."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from oracle import parse_perf_script
from perfutil import perf_script_samples, perf_stats, record_perf_data
from procutil import cpu_seconds, wait_cpu_seconds, wait_mapped, wait_perf_fds, wait_stderr_line
from stacks import CHAIN, json_syms
from unwindd.source.abi import RecordType
from unwindd.source.sampling import online_cpus
from workloads.build import build_workloads

UNWINDD = [sys.executable, "-m", "unwindd.cli"]

# Busy for ~0.6 s in a parent and a forked child, so the file has two sampled pids.
WORKLOAD = [
    sys.executable,
    "-c",
    "import os, time\n"
    "pid = os.fork()\n"
    "end = time.time() + 0.6\n"
    "x = 0\n"
    "while time.time() < end:\n"
    "    x = (x * 31 + 7) % 1000003\n"
    "if pid: os.waitpid(pid, 0)\n",
]


# record's --status-interval line (record._status_printer), printed from its drain loop only
STATUS_LINE = r"unwindd: \d+s samples=\d+ "


def run_unwindd(
    *args: str, stdin: bytes | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([*UNWINDD, *args], input=stdin, capture_output=True, timeout=timeout)
    return subprocess.CompletedProcess(
        res.args, res.returncode, res.stdout.decode(), res.stderr.decode()
    )


def parse_summary(text: str) -> tuple[dict[str, int], Counter[int]]:
    """(events by type, samples by pid) from ``--format summary`` output."""
    types = {m[1]: int(m[2]) for m in re.finditer(r"^(\w+) events: (\d+)$", text, re.M)}
    pids: Counter[int] = Counter()
    in_pids = False
    for line in text.splitlines():
        cols = line.split()
        if cols[:3] == ["pid", "samples", "comm"]:
            in_pids = True
            continue
        if in_pids and len(cols) >= 2 and cols[0].isdigit():
            pids[int(cols[0])] = int(cols[1])
    return types, pids


@pytest.fixture(scope="module")
def perf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_perf_data(tmp_path_factory.mktemp("cli"), WORKLOAD, freq=499)


@pytest.fixture(scope="module")
def perf_pipe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_perf_data(tmp_path_factory.mktemp("cli-pipe"), WORKLOAD, freq=499, pipe=True)


@pytest.mark.parametrize("which", ["perf_file", "perf_pipe_file"])
def test_replay_summary_matches_perf(which: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(which)
    res = run_unwindd("replay", str(path), "--format", "summary", "--top", "0")
    assert res.returncode == 0, res.stderr
    types, pids = parse_summary(res.stdout)
    oracle_pids = perf_script_samples(path)
    assert len(oracle_pids) >= 2, oracle_pids
    assert pids == oracle_pids
    oracle = perf_stats(path)
    for name in ("SAMPLE", "MMAP", "MMAP2", "COMM", "FORK", "EXIT", "FINISHED_ROUND"):
        assert types.get(name, 0) == oracle.get(name, 0), (name, types, oracle)
    assert re.search(r"^decode errors: 0$", res.stdout, re.M), res.stdout


def test_replay_from_stdin_pipe(perf_pipe_file: Path) -> None:
    res = run_unwindd(
        "replay", "-", "--format", "summary", "--top", "0", stdin=perf_pipe_file.read_bytes()
    )
    assert res.returncode == 0, res.stderr
    _, pids = parse_summary(res.stdout)
    assert pids == perf_script_samples(perf_pipe_file)


def test_replay_records_are_time_ordered(perf_file: Path) -> None:
    res = run_unwindd("replay", str(perf_file), "--format", "records")
    assert res.returncode == 0, res.stderr
    recs = [json.loads(line) for line in res.stdout.splitlines()]
    samples = [r for r in recs if r["type"] == "SAMPLE"]
    assert sum(perf_script_samples(perf_file).values()) == len(samples)
    times = [r["time"] for r in recs if "time" in r]
    assert times == sorted(times)
    s = samples[0]
    assert s["regs_abi"] == 2 and "sp" in s["regs"] and "ip" in s["regs"]
    assert 0 < s["dyn_size"] <= s["stack_size"] == 8192


def test_record_pid_records_see_child(tmp_path: Path) -> None:
    # The child waits on a pipe until unwindd has its session open, then spins 0.4 s of its
    # own CPU time (the samples a loaded machine gives it do not thin out) and exits; record
    # ends by itself once the child is gone (its last drain keeps what the rings hold).
    r, w = os.pipe()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            "os.read(int(sys.argv[1]), 1)\n"
            "end = time.thread_time() + 0.4\n"
            "while time.thread_time() < end: pass\n",
            str(r),
        ],
        pass_fds=(r,),
    )
    os.close(r)
    out_file = (tmp_path / "records.jsonl").open("w")
    rec = subprocess.Popen(
        [
            *UNWINDD,
            "record",
            "--pid",
            str(child.pid),
            "--duration",
            "60",
            "-F",
            "499",
            "--format",
            "records",
            "--status-interval",
            "0.5",
        ],
        # a file, not a pipe: nobody reads a pipe until communicate(), and once its 64 KiB
        # were full record blocked in write() while the child's samples overflowed the rings
        # (the child's EXIT was lost)
        stdout=out_file,
        stderr=subprocess.PIPE,
        text=True,
    )
    # record has its events open once it holds one perf fd per CPU, and enabled once its drain
    # loop prints a status line (a sleep here raced a slow start under load: the child could
    # be gone before record began)
    wait_perf_fds(rec.pid, len(online_cpus()), rec)
    status = wait_stderr_line(rec, STATUS_LINE)
    os.write(w, b"x")
    os.close(w)
    # the child's samples and EXIT are in the rings once it has exited (the kernel writes its
    # EXIT before it notifies its parent and its pidfd's readers: kernel/exit.c do_exit), and
    # record's last drain, once the pidfd says so, takes them
    child.wait(timeout=60)
    _, err = rec.communicate(timeout=60)
    err = "".join(status) + err
    out_file.close()
    out = (tmp_path / "records.jsonl").read_text()
    assert rec.returncode == 0, err
    recs = [json.loads(line) for line in out.splitlines()]
    samples = [x for x in recs if x["type"] == "SAMPLE"]
    assert len(samples) >= 50, (len(samples), err)
    assert {x["pid"] for x in samples} == {child.pid}
    exits = [x for x in recs if x["type"] == "EXIT" and x["pid"] == child.pid]
    assert exits and max(x["time"] for x in samples) <= exits[-1]["time"], (recs[-3:], err)
    assert not [x for x in recs if x["type"] == "LOST"], err


def test_record_pid_ends_when_every_pid_has_exited(tmp_path: Path) -> None:
    """``record --pid A --pid B`` ends by itself once both have exited, as perf record -p does,
    long before its --duration: not at A's exit (B's samples go on after A's EXIT), and with
    what the rings held at the end (both EXIT records)."""
    r, w = os.pipe()
    spin = ("import os, sys, time\n"
            "os.read(int(sys.argv[1]), 1)\n"
            "end = time.thread_time() + float(sys.argv[2])\n"
            "while time.thread_time() < end: pass\n")  # fmt: skip
    kids = [subprocess.Popen([sys.executable, "-c", spin, str(r), t], pass_fds=(r,))
            for t in ("0.2", "0.7")]  # fmt: skip
    os.close(r)
    out_file = (tmp_path / "records.jsonl").open("w")
    rec = subprocess.Popen([*UNWINDD, "record", "--pid", str(kids[0].pid), "--pid",
                            str(kids[1].pid), "--duration", "600", "-F", "499", "--format",
                            "records", "--status-interval", "0.5"], stdout=out_file,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_perf_fds(rec.pid, 2 * len(online_cpus()), rec)
        status = wait_stderr_line(rec, STATUS_LINE)
        os.write(w, b"xx")
        os.close(w)
        for k in kids:
            assert k.wait(timeout=60) == 0
        _, err = rec.communicate(timeout=60)  # (no signal: it ends by itself)
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.communicate()
    err = "".join(status) + err
    out_file.close()
    assert rec.returncode == 0, err
    recs = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    exit_time = {x["pid"]: x["time"] for x in recs if x["type"] == "EXIT" and x["pid"] == x["tid"]}
    assert set(exit_time) == {k.pid for k in kids}, (exit_time, err)
    late = [x for x in recs if x["type"] == "SAMPLE" and x["pid"] == kids[1].pid
            and x["time"] > exit_time[kids[0].pid]]  # fmt: skip
    assert len(late) >= 20, (len(late), err)


@pytest.mark.parametrize("fmt", ["records", "summary"])
def test_record_pid_does_not_spin_on_an_exited_pid(fmt: str) -> None:
    """``record --pid A --pid B`` after A has exited, while B sleeps: A's rings hang up and
    would make every poll return at once; record drops them from its poll, so it waits as
    usual (a loop that never slept took a whole CPU: 1 s of CPU a second, here
    under 0.5 s), then ends when B exits. Both loops: the plain stream (records) and the
    unwinding one."""
    a = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE)  # fmt: skip
    b = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdin.read(); "
                          "time.sleep(2)"], stdin=subprocess.PIPE)  # fmt: skip
    argv = [*UNWINDD, "record", "--pid", str(a.pid), "--pid", str(b.pid), "--duration", "600",
            "--format", fmt, "--status-interval", "0.5"]  # fmt: skip
    rec = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_perf_fds(rec.pid, 2 * len(online_cpus()), rec)
        wait_stderr_line(rec, STATUS_LINE)
        for p in (a, b):
            assert p.stdin is not None
            p.stdin.close()
        assert a.wait(60) == 0
        time.sleep(0.3)  # (A's hangup seen)
        before = cpu_seconds(rec.pid)
        time.sleep(1.0)
        spent = cpu_seconds(rec.pid) - before
        assert b.poll() is None, "B ended too soon for the measure"
        assert spent < 0.5, spent
        assert b.wait(60) == 0
        _, err = rec.communicate(timeout=60)
        assert rec.returncode == 0, err
    finally:
        for p in (a, b, rec):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_record_all_stops_cleanly_on_sigterm() -> None:
    rec = subprocess.Popen(
        [*UNWINDD, "record", "--all", "--format", "summary", "--status-interval", "0.5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        # Sampling, with its SIGTERM handler in place, once the drain loop prints a status line
        # (a SIGTERM before the handler would kill it: rc -15); then spin is sampled for 0.2 s
        # of its own CPU time (~20 samples at 99 Hz), however long the machine takes.
        wait_perf_fds(rec.pid, len(online_cpus()), rec)
        status = wait_stderr_line(rec, STATUS_LINE)
        wait_cpu_seconds(spin.pid, 0.2)
        rec.send_signal(signal.SIGTERM)
        out, err = rec.communicate(timeout=20)
        err = "".join(status) + err
    finally:
        spin.kill()
        spin.wait()
    assert rec.returncode == 0, err
    types, pids = parse_summary(out)
    assert types["SAMPLE"] > 0
    assert pids[spin.pid] > 0
    assert re.search(r"^target: all CPUs$", out, re.M)


@pytest.mark.parametrize("fmt", ["folded", "records"])  # the unwinding loop; the plain stream
def test_record_says_what_full_rings_lost(fmt: str) -> None:
    """A ring too small for the stack copies (2 pages: no sample fits) loses records, and
    ``record`` says so on stderr at its end, as perf record does, with its output intact."""
    res = run_unwindd("record", "--format", fmt, "--ring-pages", "2", "--", *WORKLOAD)
    assert res.returncode == 0, res.stderr
    lost = re.search(r"unwindd: warning: (\d+) records and (\d+) samples lost to full rings",
                     res.stderr)  # fmt: skip
    assert lost is not None and int(lost[1]) > 0, res.stderr


# Two processes that each spin 1.5 s of CPU, then the parent makes the file argv[1]: the test
# reads record's output only after that, so record's step stays blocked on a full pipe for
# most of the samples.
HELD_WORKLOAD = (
    "import os, sys, time\n"
    "pid = os.fork()\n"
    "end = time.process_time() + 1.5\n"
    "while time.process_time() < end:\n"
    "    pass\n"
    "if pid:\n"
    "    os.waitpid(pid, 0)\n"
    "    open(sys.argv[1], 'w').close()\n"
)


def _record_held_up(tmp_path: Path, *flags: str) -> tuple[int, str]:
    """``record --format jsonl`` of HELD_WORKLOAD at the default frequency and rings, its
    stdout unread until the workload is done: (samples printed, stderr)."""
    done = tmp_path / f"done{len(list(tmp_path.iterdir()))}"
    proc = subprocess.Popen(
        [*UNWINDD, "record", "--format", "jsonl", *flags, "--",
         sys.executable, "-c", HELD_WORKLOAD, str(done)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not done.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the workload never ended"
            time.sleep(0.05)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    return len(out.splitlines()), err


def test_record_spill_keeps_what_a_held_up_output_would_lose(tmp_path: Path) -> None:
    """A reader that takes its time blocks record's step on the pipe for seconds, longer than
    the default ring holds at the default frequency (~0.3 s): without the spill the kernel
    drops records and record says so; with it (the default) nothing is lost and more samples
    reach the output."""
    plain, plain_err = _record_held_up(tmp_path, "--spill-max-bytes", "0")
    lost = re.search(r"unwindd: warning: (\d+) records and (\d+) samples lost", plain_err)
    assert lost is not None and int(lost[1]) > 0, plain_err  # the setup does hold record up
    spilled, err = _record_held_up(tmp_path)
    assert "lost to full rings" not in err, err
    assert spilled > plain, (spilled, plain)
    # ~1.5 s of CPU in each of two processes at 99 Hz
    assert spilled >= 200, spilled


def test_record_nonexistent_pid_is_a_clear_error() -> None:
    # pid_max is at most 2^22, so this pid cannot exist.
    res = run_unwindd("record", "--pid", str(1 << 23), "--duration", "0.1")
    assert res.returncode == 2
    assert res.stderr.startswith("unwindd: error:") and "Traceback" not in res.stderr
    assert str(1 << 23) in res.stderr


def test_record_bad_stack_size_is_a_clear_error() -> None:
    res = run_unwindd("record", "--all", "--duration", "0.1", "--stack-size", "100")
    assert res.returncode == 2
    assert "stack" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("content", [b"", b"garbage" * 10, b"PERFILE2" + b"\xff" * 200])
def test_replay_bad_files_are_clear_errors(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "bad.data"
    p.write_bytes(content)
    res = run_unwindd("replay", str(p))
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert res.stderr.startswith("unwindd: error:") and "Traceback" not in res.stderr


def test_replay_missing_file() -> None:
    res = run_unwindd("replay", "/nonexistent/perf.data")
    assert res.returncode == 2 and "Traceback" not in res.stderr


@pytest.mark.parametrize("where", ["inside", "boundary"])
def test_replay_truncated_file_counts_errors(perf_file: Path, tmp_path: Path, where: str) -> None:
    """A file cut two thirds into its data section, inside a record or on a boundary: the
    records before the cut are all replayed, and the summary counts exactly what the cut did."""
    data = perf_file.read_bytes()
    # perf_file_header: u64 magic, size, attr_size; {u64 offset, size} attrs at 24, data at 40
    off, size = struct.unpack_from("<QQ", data, 40)
    recs = []  # (start, type) of each record, by header.size
    pos = off
    while pos < off + size:
        rtype, _misc, n = struct.unpack_from("<IHH", data, pos)  # perf_event_header
        recs.append((pos, rtype))
        pos += n
    assert pos == off + size
    # the first record starting two thirds in with a body to cut into (24 > 16 + 8)
    i = next(i for i, ((a, _), (b, _)) in enumerate(itertools.pairwise(recs))
             if a >= off + size * 2 // 3 and b - a >= 24)  # fmt: skip
    cut = recs[i][0] + (16 if where == "inside" else 0)  # inside: 8 bytes into the body
    path = tmp_path / "cut.data"
    path.write_bytes(data[:cut])
    res = run_unwindd("replay", str(path), "--format", "summary", "--top", "0")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    types, pids = parse_summary(res.stdout)
    want = Counter(RecordType(t).name for _, t in recs[:i])  # every record before the cut
    assert types.pop("throttle") == want["THROTTLE"]  # ("throttle events: N", after the types)
    assert types == {"TOTAL": i, **want}, res.stdout
    assert want["SAMPLE"] > 0 and sum(pids.values()) == want["SAMPLE"]
    # The header promised a data section and a feature table after it that the cut took
    # away; the cut record is one truncation, a cut on a boundary none.
    counted = re.findall(r"^(?:file error \w+|decode errors|  \w+): \d+$", res.stdout, re.M)
    assert counted == [
        "file error data_section_truncated: 1",
        "file error feature_table_truncated: 1",
        *(["decode errors: 1", "  truncated: 1"] if where == "inside" else ["decode errors: 0"]),
    ], res.stdout


@pytest.fixture(scope="module")
def chain_exe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_workloads(tmp_path_factory.mktemp("workloads"))["c_o2"].argv[0]


@pytest.mark.parametrize("fmt", ["jsonl", "perf-script", "folded", "summary"])
def test_record_unwinds_whole_stacks_in_every_format(chain_exe: str, fmt: str,
                                                     tmp_path: Path) -> None:  # fmt: skip
    """``unwindd record --pid`` of a running chain (its mappings from /proc: it started first)
    prints every sample it unwound in ``fmt``; samples with the chain's leaf have its whole
    stack, leaf to _start. The chain is sampled for 0.5 s of its own CPU time, however long a
    loaded machine takes to give it that."""
    chain = subprocess.Popen([chain_exe, "1000000"])
    out_file = tmp_path / f"out.{fmt}"
    try:
        wait_mapped(chain.pid, "libc.so.6")
        with out_file.open("w") as out:
            rec = subprocess.Popen(
                [*UNWINDD, "record", "--pid", str(chain.pid), "-F", "499", "--format", fmt,
                 "--status-interval", "0.5", "--no-inline"],
                stdout=out, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            wait_perf_fds(rec.pid, len(online_cpus()), rec)
            status = wait_stderr_line(rec, STATUS_LINE)
            wait_cpu_seconds(chain.pid, 0.5)
            rec.send_signal(signal.SIGINT)
            _, err = rec.communicate(timeout=30)
    finally:
        chain.kill()
        chain.wait()
    err = "".join(status) + err
    assert rec.returncode == 0, err
    text = out_file.read_text()
    comm = Path(chain_exe).name
    if fmt == "jsonl":
        samples = [json.loads(line) for line in text.splitlines()]
        assert {s["pid"] for s in samples} == {chain.pid}, err
        assert len({(s["tid"], s["time_ns"]) for s in samples}) == len(samples)  # each once
        stacks = [json_syms(s["frames"]) for s in samples]
    elif fmt == "perf-script":
        parsed = parse_perf_script(text).samples
        assert {s.pid for s in parsed} == {chain.pid}, err
        assert len({s.key for s in parsed}) == len(parsed)  # each sample printed once
        stacks = [tuple(f.sym for f in s.user_frames) for s in parsed]
    elif fmt == "folded":
        lines = [ln.rsplit(" ", 1) for ln in text.splitlines()]
        stacks = []
        for key, n in lines:
            names = key.split(";")
            assert names[0] == comm, key
            user = tuple(x for x in reversed(names[1:]) if not x.endswith("_[k]"))
            stacks += [user] * int(n)
    else:
        m = re.search(r"^unwound samples: (\d+)$", text, re.M)
        assert m is not None and int(m[1]) >= 100, text
        assert re.search(r"^  ok: \d+ \((9[5-9]|100)\.\d%\)$", text, re.M), text
        return
    in_spin = [s for s in stacks if s[:1] == CHAIN[:1]]
    assert len(in_spin) >= 100, (len(stacks), err)
    whole = [s for s in in_spin if s == CHAIN]
    assert len(whole) >= 0.95 * len(in_spin), [s for s in in_spin if s != CHAIN][:3]
