"""Process table: overlap rules, exec/fork/exit, /proc maps parsing, replay of real perf.data."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from perfutil import build_busy, record_perf_data
from procutil import wait_mapped
from unwindd.binaries.elfcache import ElfCache
from unwindd.procs.mapping import PROT_EXEC, Identity
from unwindd.procs.procmaps import parse_proc_maps
from unwindd.procs.proctable import ProcessTable
from unwindd.source.abi import MISC_COMM_EXEC, MISC_MMAP_DATA, MISC_USER
from unwindd.source.perfdata import PerfData
from unwindd.source.records import NO_SAMPLE_ID, Comm, Exit, Fork, Mmap, Mmap2, Sample

FAKEPROC = Path(__file__).parents[1] / "support" / "fakeproc"
RX, R = 5, 1


def mmap2(pid: int, start: int, length: int, pgoff: int, name: str, prot: int = RX,
          tid: int | None = None) -> Mmap2:  # fmt: skip
    return Mmap2(0, pid, tid or pid, start, length, pgoff, 0xFE, 0, 100, 1, None, prot, 2,
                 name, NO_SAMPLE_ID)  # fmt: skip


def spans(table: ProcessTable, pid: int) -> list[tuple[int, int, int, str]]:
    return [(m.start, m.end, m.pgoff, m.filename) for m in table.space_for(pid).mappings]


# --------------------------------------------------------------------------- overlaps


def test_overlap_head_tail_and_full_replace() -> None:
    t = ProcessTable()
    t.apply(mmap2(1, 0x10000, 0x10000, 0x0, "/a"))
    # new mapping in the middle: head [0x10000,0x14000) pgoff 0, tail [0x18000,0x20000)
    # with pgoff advanced by 0x8000
    t.apply(mmap2(1, 0x14000, 0x4000, 0x0, "/b"))
    assert spans(t, 1) == [
        (0x10000, 0x14000, 0x0, "/a"),
        (0x14000, 0x18000, 0x0, "/b"),
        (0x18000, 0x20000, 0x8000, "/a"),
    ]
    # a mapping covering /b and part of the tail: /b is replaced entirely
    t.apply(mmap2(1, 0x13000, 0x6000, 0x1000, "/c"))
    assert spans(t, 1) == [
        (0x10000, 0x13000, 0x0, "/a"),
        (0x13000, 0x19000, 0x1000, "/c"),
        (0x19000, 0x20000, 0x9000, "/a"),
    ]
    # an exact replacement
    t.apply(mmap2(1, 0x13000, 0x6000, 0x0, "/d"))
    assert [s[3] for s in spans(t, 1)] == ["/a", "/d", "/a"]
    # a data mapping cuts what it covers but is not kept
    t.apply(mmap2(1, 0x10000, 0x1000, 0x0, "/data", prot=R))
    assert spans(t, 1)[0] == (0x11000, 0x13000, 0x1000, "/a")
    sp = t.space_for(1)
    assert sp.find(0x10FFF) is None
    m = sp.find(0x19000)
    assert m is not None and m.filename == "/a" and m.pgoff == 0x9000
    assert sp.find(0x20000) is None


def test_mmap_v1_data_flag_and_generation() -> None:
    t = ProcessTable()
    sp = t.space_for(7)
    g0 = sp.generation
    t.apply(Mmap(MISC_MMAP_DATA, 7, 7, 0x1000, 0x1000, 0, "/data", NO_SAMPLE_ID))
    assert len(sp) == 0 and sp.generation == g0  # nothing to cut: no change at all
    t.apply(Mmap(0, 7, 7, 0x1000, 0x1000, 0, "/code", NO_SAMPLE_ID))
    assert len(sp) == 1 and sp.mappings[0].prot & PROT_EXEC and sp.generation != g0


def test_exec_clears_fork_copies_thread_shares() -> None:
    t = ProcessTable()
    t.apply(mmap2(10, 0x1000, 0x1000, 0, "/parent"))
    # new thread of 10: same space
    t.apply(Fork(0, 10, 10, 11, 10, 0, NO_SAMPLE_ID))
    assert 11 not in t
    # new process 20 from 10: a copy, sharing state until it diverges
    t.apply(Fork(0, 20, 10, 20, 10, 0, NO_SAMPLE_ID))
    assert spans(t, 20) == spans(t, 10)
    assert t.space_for(20).generation == t.space_for(10).generation
    t.apply(mmap2(20, 0x5000, 0x1000, 0, "/child-lib"))
    assert len(t.space_for(20)) == 2 and len(t.space_for(10)) == 1
    # exec in 20 (COMM with the exec flag, pid == tid) clears, then the new image maps
    t.apply(Comm(MISC_COMM_EXEC, 20, 20, "newprog", NO_SAMPLE_ID))
    assert len(t.space_for(20)) == 0
    t.apply(mmap2(20, 0x9000, 0x1000, 0, "/newprog"))
    assert spans(t, 20) == [(0x9000, 0xA000, 0, "/newprog")]
    # a plain comm change (prctl) is not an exec
    t.apply(Comm(0, 10, 10, "renamed", NO_SAMPLE_ID))
    assert len(t.space_for(10)) == 1
    # exit of a thread does nothing; exit of the leader retires, drop forgets
    retired: list[int] = []
    t.on_retire = retired.append
    t.apply(Exit(0, 10, 10, 11, 11, 0, NO_SAMPLE_ID))
    assert retired == []
    t.apply(Exit(0, 10, 10, 10, 10, 0, NO_SAMPLE_ID))
    assert retired == [10] and t.space_for(10).retired
    assert t.space_for(10).find(0x1000) is not None  # still answers late samples
    t.drop(10)
    assert 10 not in t


@dataclass
class FakeModule:
    start: int
    end: int
    bias: int
    table: object
    key: int
    jit: bool = False


class FakeSpace:
    builds = 0

    def __init__(self, modules: list[Any]) -> None:
        FakeSpace.builds += 1
        self.modules = modules


class FakeUnwinder:
    new_module = FakeModule
    AddressSpace = FakeSpace


def test_modules_and_native_space_cached_by_generation() -> None:
    cache = ElfCache(cfi_factory=lambda p, d, b: "table")
    t = ProcessTable(cache, unwinder=FakeUnwinder)
    libc = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    text = Path("/proc/self/maps").read_text()
    sp = t.load_proc_maps(1234, text)
    n = FakeSpace.builds
    native = sp.native_space()
    assert isinstance(native, FakeSpace) and sp.native_space() is native
    assert FakeSpace.builds == n + 1
    mods = sp.modules()
    assert all(isinstance(m, FakeModule) and m.table == "table" for m in mods if not m.jit)
    libc_mod = next(m for m in mods if sp.find(m.start) and sp.find(m.start).filename == libc)
    assert libc_mod.key == sp.find(libc_mod.start).entry.uid  # type: ignore[union-attr]
    # a change rebuilds once
    t.add_mapping(1234, 0x1000, 0x2000, 0, RX, 2, "//anon")
    assert sp.native_space() is not native and FakeSpace.builds == n + 2
    # anonymous executable memory (JIT code) is a module without a table: frame pointers only
    jit = [m for m in sp.modules() if m.start == 0x1000]
    assert [(m.end, m.table, m.jit) for m in jit] == [(0x2000, None, True)]
    # refs: one per space per binary; fork adds one, exec releases
    e = sp.find(libc_mod.start).entry  # type: ignore[union-attr]
    assert e is not None and e.refcount == 1
    t.fork(4321, 1234)
    assert e.refcount == 2
    t.exec(4321)
    assert e.refcount == 1
    # splitting libc's mapping keeps one reference, with the same bias on both pieces
    m = sp.find(libc_mod.start)
    assert m is not None
    t.add_mapping(1234, m.start + 0x1000, m.start + 0x2000, 0, R, 2, "/data")
    head, tail = sp.find(m.start), sp.find(m.start + 0x2000)
    assert head is not None and tail is not None
    assert head.bias == tail.bias == m.bias and tail.pgoff == m.pgoff + 0x2000
    assert e.refcount == 1
    t.drop(1234)
    assert e.refcount == 0


def test_unwinder_not_imported_until_needed() -> None:
    import sys

    before = "unwindd.unwind.unwinder" in sys.modules
    t = ProcessTable()
    t.apply(mmap2(1, 0x1000, 0x1000, 0, "/x"))
    t.space_for(1).find(0x1000)
    assert ("unwindd.unwind.unwinder" in sys.modules) == before


# --------------------------------------------------------------------------- /proc maps


def test_parse_fake_maps() -> None:
    maps = parse_proc_maps((FAKEPROC / "4242" / "maps").read_text())
    assert len(maps) == 11  # the garbage line is skipped
    app = maps[1]
    assert (app.start, app.end, app.pgoff, app.prot) == (0x5600AA002000, 0x5600AA005000,
                                                        0x2000, RX)  # fmt: skip
    assert app.filename == "/usr/bin/fake app"  # spaces survive
    assert app.identity == Identity(None, 0xFE, 0, 1001, None)
    assert maps[3].filename == "[heap]" and maps[6].filename == ""
    assert maps[7].filename == "/tmp/gone (deleted)"
    t = ProcessTable()
    sp = t.load_proc_maps(4242, (FAKEPROC / "4242" / "maps").read_text())
    assert [m.filename for m in sp.mappings] == [
        "/usr/bin/fake app", "/usr/lib/libfake.so", "", "/tmp/gone (deleted)", "[vdso]",
        "[vsyscall]",
    ]  # fmt: skip
    assert sp.from_proc_maps


def test_fake_tree_through_cache_fails_cleanly() -> None:
    cache = ElfCache(proc_root=str(FAKEPROC))
    t = ProcessTable(cache)
    sp = t.load_proc_maps(4242, (FAKEPROC / "4242" / "maps").read_text())
    fake = sp.find(0x5600AA002000)
    assert fake is not None and fake.entry is not None and not fake.entry.usable
    assert cache.stats.errors["open_failed"] >= 2
    vdso = sp.find(0x7FFD00100000)
    assert vdso is not None and vdso.entry is not None and vdso.entry.usable


def test_real_maps_self_and_child() -> None:
    own = parse_proc_maps(Path("/proc/self/maps").read_text())
    raw = Path("/proc/self/maps").read_text().splitlines()
    assert len(own) == len(raw)
    for m, line in zip(own, raw, strict=True):
        lo, hi = line.split()[0].split("-")
        assert (m.start, m.end) == (int(lo, 16), int(hi, 16))
    p = subprocess.Popen(["sleep", "30"])
    try:
        text = wait_mapped(p.pid, "libc.so.6")
        cache = ElfCache()
        sp = ProcessTable(cache).load_proc_maps(p.pid, text)
        names = {m.filename for m in sp.mappings}
        assert "/usr/lib/x86_64-linux-gnu/libc.so.6" in names and "[vdso]" in names
        assert all(m.prot & PROT_EXEC for m in sp.mappings)
        assert all(m.entry is not None and m.entry.usable for m in sp.mappings
                   if m.filename.startswith("/"))  # fmt: skip
    finally:
        p.kill()
        p.wait()


# --------------------------------------------------------------------------- real perf.data


def time_ordered(path: Path) -> list[Any]:
    """The file's records in time order (perf's ordered-events; per-CPU buffers interleave
    in the file, so a child's samples can precede its FORK in file order)."""
    with PerfData.open(path) as pd:
        recs = [r for r in pd.records() if getattr(r, "time", None) is not None]
    recs.sort(key=lambda r: r.time)
    return recs


@pytest.fixture(scope="module")
def busy_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("busy")
    exe = build_busy(d)
    return record_perf_data(d, [str(exe), "0.3"])


def test_replay_perf_data_user_ips_are_mapped(busy_data: Path) -> None:
    cache = ElfCache()
    t = ProcessTable(cache)
    total = hit = 0
    misses: list[str] = []
    for r in time_ordered(busy_data):
        if isinstance(r, Sample):
            if r.cpumode != MISC_USER or r.pid is None or r.ip is None:
                continue
            total += 1
            sp = t.get(r.pid)
            if sp is not None and sp.find(r.ip) is not None:
                hit += 1
            else:
                misses.append(f"pid={r.pid} ip={r.ip:#x}")
        else:
            t.apply(r)
    assert total > 100
    assert hit >= 0.99 * total, f"{hit}/{total} mapped; misses: {misses[:10]}"
    assert t.stats.records["FORK"] >= 1 and t.stats.records["MMAP2"] > 0
