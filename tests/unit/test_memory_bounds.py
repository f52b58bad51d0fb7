"""Bounded per-pid state under process churn (issue 4, item 5): every table keyed by pid must
be bounded by the pids that are live (or were read within a rate-limit window), never by how
many pids ever existed. Sans-IO: a fake /proc tree and a fake clock, no sampling."""

from __future__ import annotations

from pathlib import Path

from test_live_table import MS, Clock, FakeProc, line, sample
from unwindd.binaries.symbolize import Symbolizer
from unwindd.procs.livetable import LiveTable, LiveTableConfig
from unwindd.procs.procscan import ProcFS
from unwindd.procs.proctable import ProcessTable
from unwindd.source.records import NO_SAMPLE_ID, Comm, Exit, Fork
from unwindd.unwind import unwinder
from unwindd.unwind.engine import StackEngine

CFG = LiveTableConfig(rescan_interval_ns=50 * MS, churn_window_ns=1000 * MS, max_hold_ns=500 * MS,
                      exit_grace_ns=200 * MS, max_processes=64)  # fmt: skip


def _live(tmp_path: Path) -> tuple[FakeProc, Clock, StackEngine, LiveTable]:
    fake, clock = FakeProc(tmp_path), Clock()
    table = ProcessTable(None, unwinder=unwinder)
    engine = StackEngine(table, unwinder.Unwinder(16), Symbolizer(proc_root=str(tmp_path)))
    live = LiveTable(table, ProcFS(str(tmp_path)), CFG, clock=clock)
    engine.attach(live)
    return fake, clock, engine, live


def per_pid_state(engine: StackEngine, live: LiveTable) -> dict[str, set[int]]:
    """Every pid-keyed table of the engine, the live table, the process table and the
    symbolizer (the state a dropped pid must not leave behind)."""
    t = engine.table
    return {
        "spaces": set(t.spaces), "retired": set(t.retired), "comms": set(engine._comms),
        "tids": set(engine._tids), "snaps": set(engine._snaps), "stacks": set(engine._stacks),
        "frames": set(engine._frames), "perf_maps": set(engine.symbolizer._perf_maps),
        "last_read": set(live._last_read), "recent": set(live._recent), "held": set(live._held),
    }  # fmt: skip


def test_pids_gone_before_their_rescan_leave_no_rate_limit_state(tmp_path: Path) -> None:
    """Samples of pids that exited before we could read /proc (FORK lost with a ring overflow):
    the engine's snapshot gives each an (empty) space, so the cap drops it and on_drop clears
    its rate-limit entries; nothing grows with the number of pids ever seen (20,000 here)."""
    _, clock, engine, live = _live(tmp_path)
    n = 20_000
    for pid in range(1000, 1000 + n):
        engine.feed([sample(pid, 0x1000, clock.now)])
        clock.now += MS // 2
    assert live.stats.give_ups["process_gone"] == n
    state = per_pid_state(engine, live)
    assert all(len(v) <= CFG.max_processes for v in state.values()), {
        k: len(v) for k, v in state.items()}  # fmt: skip


def test_a_dropped_pid_leaves_nothing_in_any_per_pid_table(tmp_path: Path) -> None:
    fake, clock, engine, live = _live(tmp_path)
    for pid in range(100, 400):
        fake.put(pid, f"p{pid}", 1, line(0x1000, 0x2000, "/bin/none"))
        fork = Fork(0, pid, 1, pid, 1, clock.now, NO_SAMPLE_ID)
        comm = Comm(0, pid, pid, f"p{pid}", NO_SAMPLE_ID)
        thread_comm = Comm(0, pid, pid + 100_000, "worker", NO_SAMPLE_ID)
        s = sample(pid, 0x1800, clock.now)
        engine.feed([fork, comm, thread_comm, s, sample(pid, 0x9000, clock.now)])
        assert pid in engine._comms and pid in engine._snaps
        engine.feed([Exit(0, pid, 1, pid, pid, clock.now, NO_SAMPLE_ID)])
        fake.remove(pid)
        clock.now += 10 * MS
    clock.now += CFG.exit_grace_ns + CFG.churn_window_ns
    engine.feed([sample(99, 0x1000, clock.now)])  # moves record time past every grace period
    left = {k: v - {99} for k, v in per_pid_state(engine, live).items()}
    assert all(not v for v in left.values()), {k: sorted(v)[:5] for k, v in left.items() if v}
    assert engine.table.stats.drops["exit_grace"] + engine.table.stats.drops["cap_retired"] == 300


def test_a_long_lived_process_churning_threads_keeps_only_its_live_threads_names(
    tmp_path: Path,
) -> None:
    """A server that starts and ends a thread per request lives for the daemon's life: each
    thread's name goes once its EXIT is past the grace, so what is kept is bounded by the
    threads alive, not by how many ever ran (5,000 here). A late sample of a thread within
    the grace still gets its name, and a reused tid keeps its new one, even when it came back
    within its old EXIT's grace."""
    fake, clock, engine, live = _live(tmp_path)
    pid = 500
    fake.put(pid, "server", 1, line(0x1000, 0x2000, "/bin/none"))
    engine.feed([Fork(0, pid, 1, pid, 1, clock.now, NO_SAMPLE_ID),
                 Comm(0, pid, pid, "server", NO_SAMPLE_ID)])  # fmt: skip
    for i in range(5000):
        tid = pid + 1 + i % 3000  # tids come back, as the kernel's do
        engine.feed([Fork(0, pid, pid, tid, pid, clock.now, NO_SAMPLE_ID),
                     Comm(0, pid, tid, f"req{i}", NO_SAMPLE_ID)])  # fmt: skip
        clock.now += MS
        engine.feed([Exit(0, pid, pid, tid, pid, clock.now, NO_SAMPLE_ID)])
        assert engine.comm_of(pid, tid) == f"req{i}"  # late samples, within the grace
    in_grace = CFG.exit_grace_ns // MS + 1
    assert len(engine._comms) <= in_grace + 1 and len(engine._tids[pid]) <= in_grace
    assert len(live._thread_exits) <= in_grace
    clock.now += CFG.exit_grace_ns + MS
    engine.feed([Fork(0, pid, pid, pid + 1, pid, clock.now, NO_SAMPLE_ID),  # a reused tid
                 Comm(0, pid, pid + 1, "again", NO_SAMPLE_ID)])  # fmt: skip
    assert set(engine._comms) == {pid, pid + 1} and engine._tids[pid] == {pid + 1}
    assert engine.comm_of(pid, pid + 1) == "again" and engine.comm_of(pid, pid + 2) == "server"
    # a tid that exits and comes back within the grace: the reap of its old EXIT spares it
    engine.feed([Exit(0, pid, pid, pid + 1, pid, clock.now, NO_SAMPLE_ID),
                 Fork(0, pid, pid, pid + 1, pid, clock.now + MS, NO_SAMPLE_ID),
                 Comm(0, pid, pid + 1, "back", NO_SAMPLE_ID)])  # fmt: skip
    clock.now += CFG.exit_grace_ns + 2 * MS
    engine.feed([Fork(0, pid, pid, pid + 9, pid, clock.now, NO_SAMPLE_ID)])
    assert engine.comm_of(pid, pid + 1) == "back"


def test_a_reused_pid_takes_its_parents_name(tmp_path: Path) -> None:
    """A FORK that reuses a pid the table still holds (its old process exited within the
    grace): the old process is dropped first, then the new one is named after its parent, as
    perf's machine__process_fork_event removes the old thread before thread__fork copies the
    parent's comm. Before its exec, a sample of it is its parent's, not nameless."""
    fake, clock, engine, _ = _live(tmp_path)
    fake.put(10, "parent", 1, line(0x1000, 0x2000, "/bin/none"))
    engine.feed([Fork(0, 10, 1, 10, 1, clock.now, NO_SAMPLE_ID),
                 Comm(0, 10, 10, "parent", NO_SAMPLE_ID),
                 Fork(0, 20, 1, 20, 1, clock.now, NO_SAMPLE_ID),
                 Comm(0, 20, 20, "old", NO_SAMPLE_ID)])  # fmt: skip
    clock.now += MS
    engine.feed([Exit(0, 20, 1, 20, 1, clock.now, NO_SAMPLE_ID)])
    assert 20 in engine.table.spaces and engine.comm_of(20, 20) == "old"  # in its grace
    clock.now += MS
    engine.feed([Fork(0, 20, 10, 20, 10, clock.now, NO_SAMPLE_ID)])
    assert engine.table.stats.drops["reused"] == 1
    assert engine.comm_of(20, 20) == "parent"


def test_native_step_context_bound_follows_the_table_cap() -> None:
    """The native step keeps dead pids' snapshots until its context is dropped whole: that
    bound follows max_processes (live.py), so a small cap bounds it too."""
    from unwindd.pipeline.live import native_max_spaces

    assert native_max_spaces(64) == 128
    assert native_max_spaces(1) == 64
    assert native_max_spaces(16384) == 1024  # the daemon's default: a context of 1,024 spaces


def test_elf_cache_trims_the_heap_after_loading_and_dropping() -> None:
    """A parse's temporaries stay in glibc's heap unless trimmed (elfcache.py): the cache
    trims after trim_bytes of entries loaded or dropped, and never when told 0."""
    import os
    import sys

    from unwindd.binaries.elfcache import CacheConfig, ElfCache

    for trim_bytes, want in ((1, True), (0, False)):
        cache = ElfCache(CacheConfig(max_bytes=1, trim_bytes=trim_bytes))
        entry = cache.acquire(None, os.path.realpath(sys.executable))
        assert entry.usable
        entry.symbols()
        cache.release(entry)  # over max_bytes: evicted at once
        del entry
        assert len(cache) == 0
        assert (cache.stats.trims >= 2) is want, cache.stats


def test_kernel_frames_and_demangled_names_are_kept_by_the_thousand() -> None:
    # caches that fill with every distinct kernel ip or symbol name a long run meets: each is
    # bounded, and an entry dropped is named again the same
    from unwindd.binaries.demangle import demangle
    from unwindd.unwind import engine as engmod

    e = StackEngine(ProcessTable(None), None, Symbolizer())
    with open("/proc/kallsyms") as f:  # the kernel image's text: its first text symbol
        base = next(int(a, 16) for a, t, _ in (ln.split()[:3] for ln in f) if t in "tT")
    assert base, "needs root to read kernel addresses"
    ips = [base + 16 * i for i in range(20_000)]
    first = [e.kernel_frame(ip) for ip in ips[:50]]
    most = 0
    for ip in ips:
        e.kernel_frame(ip)
        most = max(most, len(e._kframes))
    assert most <= 10_000 and most == engmod._KFRAMES_MAX
    assert len(e._kframes) < most  # cleared whole once past the bound
    again = [e.kernel_frame(ip) for ip in ips[:50]]
    assert all(f.sym for f in first)
    assert [(f.sym, f.offset, f.dso) for f in again] == [(f.sym, f.offset, f.dso) for f in first]

    demangle.cache_clear()
    names = [f"_ZN2ns{len(f'f{i}')}f{i}Ev" for i in range(10_000)]
    shown = [demangle(n) for n in names]
    assert demangle.cache_info().currsize <= 4096
    assert shown[:3] == ["ns::f0", "ns::f1", "ns::f2"] and shown[-1] == "ns::f9999"
    assert [demangle(n) for n in names[:3]] == shown[:3]  # evicted, demangled again the same
