"""LiveTable (sans-IO policy) on a fake /proc tree written per test: bootstrap, backfill that
never undoes MMAP2, rate-limited holds and retries, churn override, pid reuse, retirement grace,
caps, and the proctable merge modes it relies on."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from unwindd.procs.livetable import LiveTable, LiveTableConfig, user_pc
from unwindd.procs.procmaps import parse_proc_maps
from unwindd.procs.procscan import ProcFS
from unwindd.procs.proctable import ProcessTable
from unwindd.source import abi
from unwindd.source.records import NO_SAMPLE_ID, Exit, Fork, Lost, Mmap2, Sample, SampleId

MS = 1_000_000
REGS_MASK = abi.X86_64_REGS_MASK
IP_INDEX = 8  # ax bx cx dx si di bp sp ip: bits 0..8 are all in the mask


def sample(pid: int, pc: int, t: int = 0) -> Sample:
    regs = [0] * bin(REGS_MASK).count("1")
    regs[IP_INDEX] = pc
    return Sample(0, pid, pid, t, 0, pc, None, 1, (), abi.REGS_ABI_64, REGS_MASK, tuple(regs),
                  b"", 0)  # fmt: skip


def mmap2(pid: int, start: int, length: int, name: str, t: int = 0) -> Mmap2:
    return Mmap2(0, pid, pid, start, length, 0, 0xFE, 0, 100, 1, None, 5, 2, name,
                 SampleId(pid, pid, t))  # fmt: skip


def line(lo: int, hi: int, name: str, perms: str = "r-xp") -> str:
    return f"{lo:x}-{hi:x} {perms} 00000000 fe:00 1234     {name}\n"


class FakeProc:
    def __init__(self, root: Path) -> None:
        self.root = root

    def put(self, pid: int, comm: str, start: int, maps: str, kthread: bool = False) -> None:
        d = self.root / str(pid)
        d.mkdir(exist_ok=True)
        flags = 0x00200000 if kthread else 0x400000
        (d / "stat").write_text(f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 {flags} "
                                + "0 " * 12 + f"{start} 1 1\n")  # fmt: skip
        (d / "maps").write_text(maps)

    def remove(self, pid: int) -> None:
        d = self.root / str(pid)
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


class Clock:
    def __init__(self) -> None:
        self.now = 10_000 * MS

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def env(tmp_path: Path) -> tuple[FakeProc, Clock, ProcessTable, LiveTable, dict[int, str]]:
    fake = FakeProc(tmp_path)
    clock = Clock()
    table = ProcessTable()
    comms: dict[int, str] = {}
    cfg = LiveTableConfig(rescan_interval_ns=50 * MS, max_hold_ns=500 * MS, churn_threshold=2,
                          exit_grace_ns=1000 * MS, max_processes=8)  # fmt: skip
    live = LiveTable(table, ProcFS(str(tmp_path)), cfg, clock=clock,
                     on_comm=comms.__setitem__)  # fmt: skip
    table.on_drop = live.forget
    return fake, clock, table, live, comms


Env = tuple[FakeProc, Clock, ProcessTable, LiveTable, dict[int, str]]


def names(table: ProcessTable, pid: int) -> list[str]:
    return [m.filename for m in table.space_for(pid).mappings]


def test_user_pc_is_the_ip_register_not_the_kernel_ip() -> None:
    s = sample(1, 0x401000)
    s = Sample(0, 1, 1, 0, 0, 0xFFFFFFFF81000000, None, 1, (), s.regs_abi, s.regs_mask, s.regs,
               b"", 0)  # fmt: skip
    assert user_pc(s) == 0x401000


def test_bootstrap_loads_processes_and_comms(env: Env) -> None:
    fake, _, table, live, comms = env
    fake.put(2, "kthreadd", 2, "", kthread=True)
    fake.put(
        100,
        "app x",
        500,
        line(0x400000, 0x401000, "/bin/app") + line(0x600000, 0x601000, "/d", "rw-p"),
    )
    live.bootstrap()
    assert names(table, 100) == ["/bin/app"]
    assert 2 not in table
    assert comms == {2: "kthreadd", 100: "app x"}
    st = live.stats
    assert (st.bootstrap_processes, st.bootstrap_kernel_threads, st.bootstrap_mappings) == (1, 1, 1)
    sp = table.space_for(100)
    assert sp.start_time == 500 and sp.start_exact and sp.verified_epoch < 0
    # the first sample verifies the start time once; later ones do not
    assert live.place(sample(100, 0x400010))
    assert live.place(sample(100, 0x400020))
    assert live.stats.verifications == 1 and live.stats.pid_reuse == 0


def test_backfill_fills_holes_and_never_undoes_mmap2(env: Env) -> None:
    fake, _, table, live, _ = env
    table.apply(mmap2(7, 0x10000, 0x1000, "/lib/from-mmap2.so"))
    # /proc (read later) shows another file over the MMAP2 range and a new one elsewhere
    fake.put(
        7, "app", 1, line(0x10000, 0x11000, "/lib/other.so") + line(0x20000, 0x22000, "/lib/new.so")
    )
    assert live.place(sample(7, 0x21000))  # outside every mapping: rescan now, placed
    assert names(table, 7) == ["/lib/from-mmap2.so", "/lib/new.so"]
    assert live.stats.rescans == {"pc_unmapped": 1} and live.stats.backfilled == {"pc_unmapped": 1}


def test_rate_limited_samples_are_held_then_retried(env: Env) -> None:
    fake, clock, table, live, _ = env
    fake.put(7, "app", 1, line(0x10000, 0x11000, "/a"))
    assert live.place(sample(7, 0x10000))  # no mappings: rescan, placed
    assert live.stats.backfilled == {"no_mappings": 1}
    # dlopen'd after our read: not in the table, and the pid was read < 50 ms ago
    fake.put(7, "app", 1, line(0x10000, 0x11000, "/a") + line(0x30000, 0x31000, "/b"))
    clock.now += 10 * MS
    s1, s2 = sample(7, 0x30010, 1), sample(7, 0x30020, 2)
    assert not live.place(s1) and not live.place(s2)
    assert live.stats.held_now == 2 and live.due() == []  # still rate limited
    clock.now += 50 * MS
    assert live.due() == [s1, s2]  # rescanned once, both placed, original order
    assert names(table, 7) == ["/a", "/b"]
    assert live.stats.rescans["retry"] == 1 and live.stats.backfilled["retry"] == 2
    assert live.stats.held_now == 0 and live.stats.retried == 2


def test_held_samples_expire_overflow_and_flush(tmp_path: Path) -> None:
    fake = FakeProc(tmp_path)
    clock = Clock()
    table = ProcessTable()
    cfg = LiveTableConfig(rescan_interval_ns=10_000 * MS, max_hold_ns=100 * MS, max_held=2)
    live = LiveTable(table, ProcFS(str(tmp_path)), cfg, clock=clock)
    fake.put(7, "app", 1, line(0x10000, 0x11000, "/a"))
    assert live.place(sample(7, 0x50000))  # rescan does not cover it: give up at once
    assert live.stats.give_ups == {"not_in_proc_maps": 1}
    assert not live.place(sample(7, 0x50000)) and not live.place(sample(7, 0x50001))
    assert live.place(sample(7, 0x50002))  # third: over max_held, unwound as is
    assert live.stats.give_ups["hold_overflow"] == 1
    clock.now += 100 * MS
    assert len(live.due()) == 2 and live.stats.give_ups["hold_expired"] == 2
    assert not live.place(sample(7, 0x50003))
    assert len(live.flush_held()) == 1 and live.stats.held_now == 0


def test_process_gone_is_a_give_up_not_a_loss(env: Env) -> None:
    _, _, _, live, _ = env
    assert live.place(sample(4242, 0x1000))
    assert live.stats.give_ups == {"process_gone": 1}
    assert live.stats.rescan_failed == {"process_gone": 1}


def test_churn_past_threshold_overrides(env: Env) -> None:
    fake, clock, table, live, _ = env
    table.apply(mmap2(7, 0x10000, 0x1000, "/lib/stale.so"))
    fake.put(7, "app", 1, line(0x10000, 0x11000, "/lib/now.so"))
    for i in range(3):  # churn_threshold=2: the third rescan within a second overrides
        clock.now += 60 * MS
        live.place(sample(7, 0x90000 + i))
    assert live.stats.rescans_override == 1
    assert names(table, 7) == ["/lib/now.so"]


def test_pid_reuse_never_inherits_old_mappings(env: Env) -> None:
    fake, clock, table, live, comms = env
    fake.put(100, "old", 500, line(0x400000, 0x402000, "/bin/old"))
    live.bootstrap()
    # between the scan and the first sample, 100 exited and a new process took the pid, with
    # code at the very same addresses (no ASLR): only the start time tells them apart
    fake.put(100, "new", 900, line(0x400000, 0x402000, "/bin/new"))
    clock.now += 1 * MS
    assert live.place(sample(100, 0x400100))
    assert names(table, 100) == ["/bin/new"] and comms[100] == "new"
    assert live.stats.pid_reuse == 1 and table.stats.drops["reused"] == 1
    assert live.stats.rescans["pid_reused"] == 1


def test_fork_estimates_start_time_and_lost_forces_verification(env: Env) -> None:
    fake, clock, table, live, _ = env
    fake.put(1, "init", 1, line(0x1000, 0x2000, "/sbin/init"))
    live.bootstrap([1])
    fork_t = 5_000 * MS
    table.apply(Fork(0, 50, 1, 50, 1, fork_t, NO_SAMPLE_ID))
    live.observe(Fork(0, 50, 1, 50, 1, fork_t, NO_SAMPLE_ID))
    sp = table.space_for(50)
    assert sp.start_time is not None and not sp.start_exact and names(table, 50) == ["/sbin/init"]
    assert sp.verified_epoch == table.epoch  # the record stream covers it: no stat read
    live.place(sample(50, 0x1000))
    assert live.stats.verifications == 0
    # records lost: the next sample re-verifies; /proc now shows a process started much later
    live.observe(Lost(0, 1, 10, NO_SAMPLE_ID))
    fake.put(50, "other", sp.start_time + 1000, line(0x7000, 0x8000, "/bin/other"))
    clock.now += 100 * MS
    assert live.place(sample(50, 0x7000))
    assert live.stats.pid_reuse == 1 and names(table, 50) == ["/bin/other"]
    assert live.stats.backfilled == {}  # the reuse rescan itself placed it


def test_retirement_grace_pinning_and_cap(env: Env) -> None:
    fake, clock, table, live, _ = env
    for pid in range(10, 20):
        table.apply(mmap2(pid, 0x1000, 0x1000, f"/bin/p{pid}"))
    table.apply(Exit(0, 10, 1, 10, 10, 100 * MS, NO_SAMPLE_ID))
    live.observe(Exit(0, 10, 1, 10, 10, 100 * MS, NO_SAMPLE_ID))
    assert table.space_for(10).retired
    # pid 11 has a held sample: it is pinned
    fake.put(11, "p11", 1, line(0x1000, 0x2000, "/bin/p11"))
    live.place(sample(11, 0x5000, 100 * MS))
    assert not live.place(sample(11, 0x5001, 100 * MS))
    table.apply(Exit(0, 11, 1, 11, 11, 100 * MS, NO_SAMPLE_ID))
    live.end_batch()  # over the cap of 8 (10 spaces): the retired, unpinned 10 goes first
    assert 10 not in table and 11 in table
    assert table.stats.drops["cap_retired"] == 1 and table.stats.drops["cap_live"] == 1
    live.record_time = 2_000 * MS
    live.end_batch()
    assert 11 in table  # past the grace, but pinned by its held sample
    clock.now += 1000 * MS
    assert len(live.due()) == 1 and live.stats.give_ups["process_exited"] == 1
    live.end_batch()
    assert 11 not in table and table.stats.drops["exit_grace"] == 1
    assert len(table.spaces) <= 8


def test_merge_modes() -> None:
    t = ProcessTable()
    t.apply(mmap2(1, 0x10000, 0x4000, "/m"))
    proc = parse_proc_maps(line(0x8000, 0x12000, "/p") + line(0x13000, 0x20000, "/q"))
    t.load_mappings(1, proc, "fill")
    got = [(hex(m.start), hex(m.end), hex(m.pgoff), m.filename) for m in t.space_for(1).mappings]
    assert got == [("0x8000", "0x10000", "0x0", "/p"), ("0x10000", "0x14000", "0x0", "/m"),
                   ("0x14000", "0x20000", "0x1000", "/q")]  # fmt: skip
    t.load_mappings(1, proc, "override")
    got = [(hex(m.start), hex(m.pgoff), m.filename) for m in t.space_for(1).mappings]
    # /proc wins where it overlaps; the piece of /m between the two survives
    assert got == [("0x8000", "0x0", "/p"), ("0x12000", "0x2000", "/m"), ("0x13000", "0x0", "/q")]
    t.load_mappings(1, parse_proc_maps(line(0x1000, 0x2000, "/r")), "replace")
    assert [m.filename for m in t.space_for(1).mappings] == ["/r"]
    with pytest.raises(ValueError):
        t.load_mappings(1, proc, "merge")


def test_mapped_and_place_mapped_are_place_for_a_placeable_sample(tmp_path: Path) -> None:
    """``mapped`` answers, reading nothing, whether ``place`` takes a sample as it is (the live
    step then calls ``place_mapped`` instead of decoding it): twin tables fed the same records,
    one asked through ``place``, the other through ``mapped`` + ``place_mapped``, end alike
    (answers, record time, each space's last use, clock reads, stats)."""

    def twin(d: Path) -> tuple[LiveTable, list[int]]:
        fake = FakeProc(d)
        fake.put(30, "boot", 1, line(0x1000, 0x2000, "/boot"))  # bootstrapped: unverified
        reads: list[int] = []
        live = LiveTable(ProcessTable(), ProcFS(str(d)), clock=lambda: reads.append(1) or 0)
        live.bootstrap([30])
        live.table.apply(mmap2(10, 0x10000, 0x1000, "/lib/a.so", t=5))
        live.table.apply(mmap2(20, 0x40000, 0x1000, "/lib/b.so", t=6))
        return live, reads

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (ref, ref_reads), (got, got_reads) = twin(tmp_path / "a"), twin(tmp_path / "b")
    cases = [(10, 0x10010, 7), (10, 0x10020, 3), (20, 0x40000, 9), (10, 0x20000, 11),
             (30, 0x1000, 12), (99, 0x10010, 13)]  # fmt: skip
    for i, (pid, pc, t) in enumerate(cases):
        if i == 3:  # records lost: every space must be verified again
            for live in (ref, got):
                live.observe(Lost(0, 1, 10, NO_SAMPLE_ID))
        placeable = got.mapped(pid, pc)
        assert (placeable is not None) == (i in (0, 1, 2)), (i, placeable)
        if placeable is None:
            continue  # (the step decodes it and asks place)
        assert ref.place(sample(pid, pc, t))
        got.place_mapped(placeable, t)
        assert got.record_time == ref.record_time
        assert placeable.last_used == ref.table.spaces[pid].last_used == ref.record_time
        assert len(got_reads) == len(ref_reads)
    assert replace(got.stats, bootstrap_seconds=0) == replace(ref.stats, bootstrap_seconds=0)
    assert got.record_time == 9
