"""The native replay's skips of side-band records (sideband.c ``unw_sb_unsampled``: what no
sample depends on; ``unw_sb_noop_mmaps``: data MMAP2s over nothing of their pid's space;
``filereplay._Replay._skip_unsampled``, ``_skip_noop_mmaps``) against the same replay applying
every record (``filereplay.SKIP_UNSAMPLED = False``): the same output, byte for byte, in every
format, and the same counts (decode, file errors, stream, ordering, process table records,
per-status samples and frames). And the skips drop what they should: the records the rule
in Python (``_reference_drops``) drops, and every data MMAP2 the table would find changes
nothing (``_noops_left``).

1. Hypothesis over random record streams written as perf.data files (recordbytes): FORKs of
   processes and threads (and odd ones), COMMs with and without exec, executable and data
   MMAP2s and MMAPs of real and missing binaries, EXITs, records too short to decode, a
   jitdump mapping now and then, and samples of any pid and tid at any time. Samples carry
   their ip only, so each one's output line names the mapping (dso, symbol, rel) and the comm
   it met: a record wrongly skipped shows.
2. A real recording of a churn of short-lived processes (most never sampled) with a renamed
   process and threads: the same outputs and counts, the Python replay's too, and the
   records dropped are exactly those ``_reference_drops`` (the rule in Python, over decoded
   records) drops, so the skip is shown to drop what it should, not only to do no harm.
"""

from __future__ import annotations

import io
import itertools
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import recordbytes as rb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from perfutil import record_perf_data
from refreplay import python_replay
from replaycounts import replay_counts
from unwindd.pipeline import filereplay
from unwindd.procs.mapping import PROT_EXEC
from unwindd.procs.proctable import ProcessTable
from unwindd.source.ordering import OrderStats, RoundOrderer
from unwindd.source.perfdata import PerfData
from unwindd.source.records import Comm, Exit, Fork, Mmap, Mmap2, Record, Sample
from unwindd.source.streamstats import StreamStats
from unwindd.unwind.engine import StackEngine

FORMATS = ("folded", "jsonl", "perf-script")
ST = rb.S_IP | rb.S_TID | rb.S_TIME | rb.S_CPU | rb.S_PERIOD
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
BASE = 0x7F0000000000
SPAN = 0x10000  # a mapping unit: mappings and sample ips are placed on this grid
_SEQ = itertools.count()
LAST_SPACES: dict[int, list[tuple[int, int, int, int, str]]] = {}  # (_replay)


def _replay(
    path: Path, fmt: str, skip: bool, inline: bool, cache: Path, noops: bool | None = None
) -> tuple[str, dict[str, Any], filereplay.FastResult]:
    """The native replay of ``path``: output, counts, result; ``skip``: SKIP_UNSAMPLED,
    ``noops``: SKIP_NOOP_MMAPS (default: ``skip``). The table's spaces at the end go to
    ``LAST_SPACES``."""
    was = filereplay.SKIP_UNSAMPLED, filereplay.SKIP_NOOP_MMAPS
    filereplay.SKIP_UNSAMPLED = skip
    filereplay.SKIP_NOOP_MMAPS = skip if noops is None else noops
    try:
        data = PerfData.open(path)
        out = io.StringIO()
        engine = StackEngine.create(cache_dir=str(cache), inline=inline)
        ss, os_ = StreamStats(), OrderStats()
        res = filereplay.replay(data, path, fmt, out, engine=engine, stream_stats=ss,
                                order_stats=os_)  # fmt: skip
        data.close()
    finally:
        filereplay.SKIP_UNSAMPLED, filereplay.SKIP_NOOP_MMAPS = was
    LAST_SPACES.clear()
    LAST_SPACES.update({pid: [(m.start, m.end, m.pgoff, m.prot, m.filename) for m in sp.mappings]
                        for pid, sp in engine.table.spaces.items()})  # fmt: skip
    counts = {**replay_counts(data, ss, os_, engine),
              "result": (res.samples, res.unique_stacks, res.side_band)}
    return out.getvalue(), counts, res


def _reference_drops(path: Path) -> Counter[str]:
    """The side-band records the skip must drop, by type: the rule of sideband.c
    ``unw_sb_unsampled`` over the decoded records in delivered order (a record is dropped iff
    it sets nothing a later sample, or a record kept for one, reads before it is set
    again)."""
    with PerfData.open(path) as data:
        recs: list[Record] = list(RoundOrderer().feed_file_order(data.records()))
    need: set[tuple[str, int]] = set()
    dropped: Counter[str] = Counter()
    for r in reversed(recs):
        if isinstance(r, Sample):
            need |= {("space", r.pid), ("comm", r.tid), ("comm", r.pid)}  # type: ignore[arg-type]
        elif isinstance(r, Mmap | Mmap2):
            if ("space", r.pid) not in need:
                dropped[type(r).__name__] += 1
        elif isinstance(r, Comm):
            ex = r.exec and r.pid == r.tid
            if ("comm", r.tid) not in need and not (ex and ("space", r.pid) in need):
                dropped["Comm"] += 1
            need.discard(("comm", r.tid))
            if ex:
                need.discard(("space", r.pid))
        elif isinstance(r, Fork):
            comm = ("comm", r.tid) in need
            space = r.pid != r.ppid and ("space", r.pid) in need
            if not comm and not space:
                dropped["Fork"] += 1
            if comm:
                need -= {("comm", r.tid)}
                need |= {("comm", r.ptid), ("comm", r.ppid)}
            if space:
                need -= {("space", r.pid)}
                need.add(("space", r.ppid))
        elif isinstance(r, Exit):
            dropped["Exit"] += 1
    return dropped


def _table_noops(path: Path) -> int:
    """The data MMAP2s of ``path`` that would change nothing where they are applied: the
    records in delivered order applied one by one to a ProcessTable (a sample creates its
    pid's space, as the replay's snapshot does), each data MMAP2 first asked whether its pid
    has a space none of whose mappings it overlaps (``_Replay._data_mmap_is_noop``'s
    question), and then not applied."""
    with PerfData.open(path) as data:
        recs: list[Record] = list(RoundOrderer().feed_file_order(data.records()))
    table = ProcessTable()
    n = 0
    for r in recs:
        if isinstance(r, Sample):
            table.space_for(r.pid)  # type: ignore[arg-type]
            continue
        if isinstance(r, Mmap2) and not r.prot & PROT_EXEC and r.length > 0:
            sp = table.get(r.pid)
            end = r.start + r.length
            if sp is not None and not any(m.start < end and r.start < m.end for m in sp.mappings):
                n += 1
                continue
        table.apply(r)
    return n


def _native_noops(path: Path, cache: Path) -> int:
    """The records ``unw_sb_noop_mmaps`` drops from ``path``'s delivered order, every record
    there (no other skip before it)."""
    was = filereplay._Replay._skip_data_mmaps
    filereplay._Replay._skip_data_mmaps = lambda self, recs, perm, m, *a: (m, 0)  # type: ignore
    try:
        return _replay(path, "folded", False, False, cache, noops=True)[2].noop_mmaps
    finally:
        filereplay._Replay._skip_data_mmaps = was  # type: ignore[method-assign]


def _native_drops(path: Path, cache: Path) -> int:
    """The records ``unw_sb_unsampled`` drops from ``path``'s delivered order, all side-band
    records there: the replay without the data MMAP2 skip that runs before it (which drops
    some of the same records first; counts are not compared here)."""
    was = filereplay._Replay._skip_data_mmaps
    filereplay._Replay._skip_data_mmaps = lambda self, recs, perm, m, *a: (m, 0)  # type: ignore
    try:
        return _replay(path, "folded", True, False, cache)[2].unsampled
    finally:
        filereplay._Replay._skip_data_mmaps = was  # type: ignore[method-assign]


def _noops_left(path: Path, cache: Path) -> int:
    """Data MMAP2s the table finds it would not change (``_raw_noop``,
    ``_data_mmap_is_noop``) among those ``unw_sb_noop_mmaps`` left to apply: none if it finds
    every one (the replay, skipping, asked as if it had not run)."""
    found = 0
    orig = (filereplay._Replay._skip_noop_mmaps, filereplay._Replay._raw_noop,
            filereplay._Replay._data_mmap_is_noop)  # fmt: skip

    def skip(self: Any, *a: Any) -> tuple[int, int]:
        out = orig[0](self, *a)
        self.check_noops = True
        return out

    def asked(k: int) -> Any:
        def ask(self: Any, r: Any) -> bool:
            nonlocal found
            got = orig[k](self, r)
            found += got
            return got

        return ask

    filereplay._Replay._skip_noop_mmaps = skip  # type: ignore[method-assign]
    filereplay._Replay._raw_noop = asked(1)  # type: ignore[method-assign]
    filereplay._Replay._data_mmap_is_noop = asked(2)  # type: ignore[method-assign]
    try:
        _replay(path, "folded", True, False, cache)
    finally:
        (filereplay._Replay._skip_noop_mmaps, filereplay._Replay._raw_noop,
         filereplay._Replay._data_mmap_is_noop) = orig  # type: ignore[method-assign]
    return found


def _check(path: Path, cache: Path, *, inline: tuple[bool, ...] = (False,),
           formats: tuple[str, ...] = FORMATS) -> filereplay.FastResult:  # fmt: skip
    res = None
    for inl in inline:
        for fmt in formats:
            want, want_counts, full = _replay(path, fmt, False, inl, cache)
            got, got_counts, res = _replay(path, fmt, True, inl, cache)
            assert full.unsampled == 0
            assert got == want, f"{fmt} inline={inl}: the skipping replay's output differs"
            assert got_counts == want_counts, f"{fmt} inline={inl}"
    assert res is not None
    return res


# --------------------------------------------------------------------------- 1. Hypothesis

_PIDS = st.integers(1, 3)
_TIDS = st.integers(1, 4)
_FILES = (LIBC, "/bin/true", "/nonexistent-unwindd/a.so")
_IPS = st.integers(0, 6 * SPAN // 0x100 - 1)  # sample ips: 0x100 apart over the mapped pages
_N = st.integers(0, 7)  # picks among the live processes, their threads, new pids
_MAP = st.tuples(st.integers(0, 5), st.integers(1, 3), st.sampled_from([5, 5, 1, 3]),
                st.sampled_from(_FILES), st.integers(0, 7))  # page, pages, prot, file, pgoff
_MMAP2 = st.tuples(st.just("mmap2"), _N, _MAP).map(lambda t: (*t[:2], *t[2]))
_MAPS = st.tuples(st.just("maps"), _N, st.lists(_MAP, min_size=2, max_size=5))  # one process
# Process lifecycles: a pick (_N) names a live process (or a thread of it) by index, so a
# stream is a tree of processes forked, exec'd, mapping, sampled or not, exiting (their pids
# reused); the raw records after them name any pid and tid, however odd.
_OPS = st.one_of(
    st.tuples(st.just("fork"), _N, _N),
    st.tuples(st.just("fork"), _N, _N),
    st.tuples(st.just("thread"), _N, _N, _N),
    st.tuples(st.just("exec"), _N, st.sampled_from(["sh", "py"])),
    st.tuples(st.just("rename"), _N, _N, st.sampled_from(["a", "bb", ""])),
    _MMAP2,
    _MAPS,
    _MAPS,
    st.tuples(st.just("sample"), _N, _N, _IPS),
    st.tuples(st.just("sample"), _N, _N, _IPS),
    st.tuples(st.just("exit"), _N),
    st.tuples(st.just("texit"), _N, _N),
    st.tuples(st.just("task"), st.sampled_from([rb.FORK, rb.EXIT]), _PIDS, _PIDS, _TIDS, _TIDS),
    st.tuples(st.just("comm"), _PIDS, _TIDS, st.booleans(), st.sampled_from(["a", "bb", ""])),
    st.tuples(st.just("mmap"), _PIDS, st.integers(0, 7), st.integers(1, 2), st.booleans()),
    st.tuples(st.just("bad"), st.sampled_from([rb.FORK, rb.COMM, rb.MMAP2]), _PIDS),
    st.tuples(st.just("round")),
)


def _lifecycles(ops: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``ops`` with their picks made: the concrete records ``_stream`` writes. Pid 1 lives
    from the start; forks take pids 2-8 (a pid in use or gone is taken again: reuse), threads
    tids 10-14."""
    live: list[int] = [1]
    threads: dict[int, list[int]] = {1: []}
    out: list[tuple[Any, ...]] = []
    for op in ops:
        kind = op[0]
        if kind not in ("fork", "thread", "exec", "rename", "mmap2", "maps", "sample", "exit",
                        "texit"):  # fmt: skip
            out.append(op)  # a raw record
            continue
        if not live:
            live, threads = [1], {1: []}
        pid = live[op[1] % len(live)]
        tasks = [pid, *threads[pid]]
        if kind == "fork":
            child = 2 + op[2] % 7
            out.append(("task", rb.FORK, child, pid, child, tasks[op[2] % len(tasks)]))
            if child not in live:
                live.append(child)
            threads[child] = []
        elif kind == "thread":
            tid = 10 + op[2] % 5
            out.append(("task", rb.FORK, pid, pid, tid, tasks[op[3] % len(tasks)]))
            threads[pid].append(tid)
        elif kind == "exec":
            out.append(("exec", pid, op[2]))
            threads[pid] = []  # (de_thread: the others are gone)
        elif kind == "rename":
            out.append(("comm", pid, tasks[op[2] % len(tasks)], False, op[3]))
        elif kind == "mmap2":
            out.append(("mmap2", pid, *op[2:]))
        elif kind == "maps":
            out += [("mmap2", pid, *m) for m in op[2]]
        elif kind == "sample":
            out.append(("sample", pid, tasks[op[2] % len(tasks)], op[3]))
        elif kind == "exit":
            out.append(("task", rb.EXIT, pid, 1, pid, 1))
            live.remove(pid)
        else:
            tid = tasks[op[2] % len(tasks)]
            out.append(("task", rb.EXIT, pid, pid, tid, pid))
            if tid != pid:
                threads[pid].remove(tid)
    return out


def _identity(name: str) -> tuple[int, int, int]:
    """The (maj, min, ino) a MMAP2 of ``name`` carries: the file's own, so the ELF cache takes
    it as the binary that was mapped (a missing file: made up)."""
    try:
        st = os.stat(name)
    except OSError:
        return 8, 1, 99
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def _stream(ops: list[tuple[Any, ...]]) -> bytes:
    """The records of ``ops``, times rising (the pid of a sample op with tid 0 is its tid)."""
    out = []
    for t, op in enumerate(ops, 1):
        kind = op[0]
        pid = op[1] if len(op) > 1 else 0
        sid = rb.Sid(pid=pid, tid=pid, time=t * 100, cpu=t % 2)
        if kind == "task":
            make = rb.fork if op[1] == rb.FORK else rb.exit
            out.append(make(pid=op[2], ppid=op[3], tid=op[4], ptid=op[5], time=t * 100,
                            sample_type=ST, sid=sid))  # fmt: skip
        elif kind == "comm":
            out.append(rb.comm(pid=pid, tid=op[2], comm=op[4], exec=op[3], sample_type=ST,
                               sid=sid))  # fmt: skip
        elif kind == "exec":
            out.append(rb.comm(pid=pid, tid=pid, comm=op[2], exec=True, sample_type=ST, sid=sid))
        elif kind == "mmap2":
            _, _, page, n, prot, name, off = op
            pgoff = 0x28000 + off * SPAN if name == LIBC else off * SPAN
            maj, mnr, ino = _identity(name)
            out.append(rb.mmap2_inode(pid=pid, tid=pid, addr=BASE + page * SPAN, length=n * SPAN,
                                      pgoff=pgoff, maj=maj, min=mnr, ino=ino, ino_generation=0,
                                      prot=prot, flags=2, filename=name, sample_type=ST,
                                      sid=sid))  # fmt: skip
        elif kind == "mmap":
            out.append(rb.mmap(pid=pid, tid=pid, addr=BASE + op[2] * SPAN, length=op[3] * SPAN,
                               pgoff=0x28000, filename=LIBC,
                               misc=rb.MISC_USER | (0x2000 if op[4] else 0), sample_type=ST,
                               sid=sid))  # fmt: skip
        elif kind == "sample":
            tid = op[2] or pid
            out.append(rb.sample(ST, ip=BASE + op[3] * 0x100, pid=pid, tid=tid, time=t * 100,
                                 cpu=t % 2, period=1))  # fmt: skip
        elif kind == "bad":  # a body too short for its fixed part and trailer: a BadRecord
            out.append(rb.raw_record(op[1], 0, rb.u32(pid) * 4))
        elif kind == "jitdump":
            out.append(rb.mmap2_inode(pid=pid, tid=pid, addr=BASE + 9 * SPAN, length=SPAN,
                                      pgoff=0, maj=8, min=1, ino=9, ino_generation=0, prot=5,
                                      flags=2, filename=f"/nonexistent-unwindd/jit-{pid}.dump",
                                      sample_type=ST, sid=sid))  # fmt: skip
        else:
            out.append(rb.finished_round())
    return b"".join(out)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache dir for every replay here (libc's symbol table read once, not per replay)."""
    return tmp_path_factory.mktemp("unsampled-cache")


@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(_OPS, min_size=10, max_size=60), jit=st.integers(0, 15), at=st.integers(0, 50))
def test_skipping_replay_equals_applying_every_record(ops: list[tuple[Any, ...]], jit: int,
                                                      at: int, cache: Path,
                                                      tmp_path: Path) -> None:  # fmt: skip
    ops = _lifecycles(ops)
    if jit == 0:  # now and then a jitdump's mapping, somewhere
        ops = [*ops[:at], ("jitdump", 1 + at % 4), *ops[at:]]
    path = tmp_path / f"random{next(_SEQ)}.data"  # (a new file: the last one may still be mapped)
    path.write_bytes(rb.perf_data_file(ST, _stream(ops)))
    res = _check(path, cache)
    if any(op[0] == "jitdump" for op in ops):
        # (runs are cut at a dump's code replacements, any pid's: none merged)
        assert res.unsampled == res.noop_mmaps == 0
    else:
        dropped = _reference_drops(path)
        assert _native_drops(path, cache) == sum(dropped.values()), dropped
        assert _noops_left(path, cache) == 0
        assert _native_noops(path, cache) == _table_noops(path)
    # the data MMAP2s dropped alone leave every space as applying them does
    _replay(path, "folded", False, False, cache)
    spaces = dict(LAST_SPACES)
    _replay(path, "folded", False, False, cache, noops=True)
    assert LAST_SPACES == spaces


def test_the_random_streams_are_replayed_natively_and_name_frames(
    cache: Path, tmp_path: Path
) -> None:
    """The Hypothesis test's files go through the native replay (no ``Unsupported``), its
    samples are named from the mappings they meet (libc's symbols), and what no sample reads
    is skipped: an unsampled process (pid 3) and a parent's mapping after its last sample and
    after its child's FORK (the child, pid 2, does not map it)."""
    ops: list[tuple[Any, ...]] = [
        ("exec", 1, "sh"), ("mmap2", 1, 0, 2, 5, LIBC, 1), ("sample", 1, 0, 5),
        ("task", rb.FORK, 2, 1, 2, 1), ("mmap2", 1, 2, 1, 5, "/bin/true", 0),
        ("task", rb.FORK, 3, 1, 3, 1), ("exec", 3, "py"), ("mmap2", 3, 2, 1, 5, "/bin/true", 0),
        ("task", rb.EXIT, 3, 1, 3, 1), ("sample", 2, 0, 0x201), ("sample", 2, 0, 0x101),
    ]  # fmt: skip
    path = tmp_path / "fixed.data"
    path.write_bytes(rb.perf_data_file(ST, _stream(ops)))
    out, _, res = _replay(path, "perf-script", True, False, cache)
    lines = out.splitlines()
    assert len(lines) == 3 and all(" sh " in f" {ln} " for ln in lines), out
    assert "(/usr/lib/x86_64-linux-gnu/libc.so.6)" in lines[0] and "[unknown]" not in lines[0]
    assert "/bin/true" not in out and "libc.so.6" in lines[2], out
    assert res.unsampled == 5 == _native_drops(path, cache) and _reference_drops(path) == Counter(
        {"Fork": 1, "Comm": 1, "Mmap2": 2, "Exit": 1})  # fmt: skip
    _check(path, cache)


# --------------------------------------------------------------------------- 2. a real churn

CHURN = (
    "import ctypes, os, subprocess, sys, threading, time\n"
    "def spin(s):\n"
    "    end = time.process_time() + s\n"
    "    while time.process_time() < end:\n"
    "        pass\n"
    "ps = []\n"
    "for i in range(60):\n"  # short-lived processes, most never sampled
    "    ps.append(subprocess.Popen(['/bin/true']))\n"
    "    ps.append(subprocess.Popen(['sh', '-c', ':']))\n"
    "    if i % 10 == 0:\n"
    "        ps.append(subprocess.Popen([sys.executable, '-c', 'pass']))\n"
    "for p in ps:\n"
    "    p.wait()\n"
    "ctypes.CDLL(None).prctl(15, b'renamed', 0, 0, 0)\n"  # PR_SET_NAME: a COMM without exec
    "spin(0.15)\n"
    "ts = [threading.Thread(target=spin, args=(0.1,)) for _ in range(2)]\n"
    "for t in ts:\n"
    "    t.start()\n"
    "for t in ts:\n"
    "    t.join()\n"
)


@pytest.fixture(scope="module")
def churn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    tmp = tmp_path_factory.mktemp("churn")
    yield record_perf_data(tmp, [sys.executable, "-c", CHURN], name="churn.data")


def test_churn_recording(churn: Path, cache: Path) -> None:
    with PerfData.open(churn) as data:
        recs = list(data.records())
    sampled = {r.pid for r in recs if isinstance(r, Sample)}
    forked = {r.pid for r in recs if isinstance(r, Fork) and r.pid != r.ppid}
    assert len(forked - sampled) >= 60, (len(forked), len(sampled))  # unsampled processes
    assert any(isinstance(r, Sample) and r.tid != r.pid for r in recs)  # threads sampled
    assert any(isinstance(r, Comm) and not r.exec and r.comm == "renamed" for r in recs)
    res = _check(churn, cache, inline=(False, True))
    dropped = _reference_drops(churn)
    assert _native_drops(churn, cache) == sum(dropped.values()) and dropped["Fork"] >= 60, dropped
    assert res.unsampled > dropped["Fork"] + dropped["Exit"], (res, dropped)
    assert res.noop_mmaps > 100 and _noops_left(churn, cache) == 0, res
    assert dropped["Mmap2"] > 100, dropped
    # and the Python replay (the native replay's reference) agrees with the skipping one
    for fmt in ("folded", "perf-script"):
        slow, _, _ = python_replay(churn, fmt)
        got, _, _ = _replay(churn, fmt, True, False, cache)
        assert got == slow, fmt
    slow_out, _, _ = python_replay(churn, "perf-script")
    assert "renamed" in slow_out
