"""``StackEngine.expand``'s levels per (binary, vaddr): a new process of a known binary (another
load address) gets the frames a fresh expansion gives it, without the table's chain being read
again; a different table, symbol or offset for the same (binary, vaddr) is expanded anew."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unwindd.binaries.symbolize import Symbolizer
from unwindd.procs.proctable import ProcessTable
from unwindd.unwind.engine import StackEngine, inline_frames
from unwindd.unwind.stackfmt import Frame

LEVELS = {
    0x1100: (("leaf", "/s/a.h", 3, "/s/a.h", 1), ("mid", "/s/a.h", 9, "/s/a.h", 7),
             ("outer", "/s/a.c", 20, "/s/a.c", 15)),
    0x1200: (("outer", "/s/a.c", 30, "/s/a.c", 15),),
    0x1300: (("leaf", None, 0, None, 0),),  # no level with a file: the frame unexpanded
    0x1400: (("outer_impl", "/s/a.c", 5, "/s/a.c", 2),),  # no level named as the symbol
}  # fmt: skip


class Table:
    def __init__(self, levels: dict[int, tuple[tuple[Any, ...], ...]]) -> None:
        self.levels = levels
        self.reads: list[int] = []

    def chain(self, vaddr: int) -> tuple[tuple[Any, ...], ...]:
        self.reads.append(vaddr)
        return self.levels[vaddr]


class Src:
    def __init__(self, table: Table) -> None:
        self.t = table

    def table(self, entry: object) -> Table:
        return self.t


@dataclass
class Entry:
    uid: int
    usable: bool = True


@dataclass
class Mapping:
    start: int
    entry: Entry
    bias: int

    def vaddr(self, ip: int) -> int:
        return ip - self.bias


class Snap:
    def __init__(self, m: Mapping) -> None:
        self.m = m

    def find(self, ip: int) -> Mapping:
        return self.m


def frame(base: int, vaddr: int, sym: str = "outer", off: int = 4) -> Frame:
    return Frame(base + vaddr, "/bin/x", sym, off, rel=vaddr)


def test_a_new_process_of_a_known_binary_is_expanded_from_the_memo() -> None:
    e = StackEngine(ProcessTable(None), None, Symbolizer())
    t = Table(LEVELS)
    e.srclines = Src(t)  # type: ignore[assignment]
    entry = Entry(7)
    for base in (0x5500_0000, 0x5600_0000, 0x5700_0000):  # three processes, ASLR'd
        snap = Snap(Mapping(base, entry, base))
        for vaddr in LEVELS:
            f = frame(base, vaddr)
            got = e.expand(snap, f.ip, f)  # type: ignore[arg-type]
            assert got == inline_frames(f, LEVELS[vaddr]), hex(vaddr)
            assert all(g.ip == f.ip and g.rel == f.rel and g.dso == f.dso for g in got)
    assert sorted(t.reads) == sorted(LEVELS)  # each chain read once, for the first process
    # what a chain without a level named as the symbol records, a memo hit records too
    e._plain.clear()
    f = frame(0x5800_0000, 0x1400)
    assert e.expand(Snap(Mapping(0, entry, 0x5800_0000)), f.ip, f)[0].inlined  # type: ignore[arg-type]
    assert e.plain_symbol(f.dso, f.rel) == ("outer", 4) and 0x1400 not in t.reads[len(LEVELS):]
    f = frame(0x5800_0000, 0x1100)
    # another symbol or offset at the same place (names changed), or another table for the
    # binary (its table arrived again): expanded anew
    snap = Snap(Mapping(0x5800_0000, entry, 0x5800_0000))
    g = frame(0x5800_0000, 0x1200, sym="other")
    assert e.expand(snap, g.ip, g) == inline_frames(g, LEVELS[0x1200])  # type: ignore[arg-type]
    assert e.expand(snap, f.ip, f) == inline_frames(f, LEVELS[0x1100])  # type: ignore[arg-type]
    t2 = Table({0x1100: (("outer", "/s/b.c", 99, "/s/b.c", 90),)})
    e.srclines = Src(t2)  # type: ignore[assignment]
    assert e.expand(snap, f.ip, f) == inline_frames(f, t2.levels[0x1100])  # type: ignore[arg-type]
    assert t.reads.count(0x1200) == 2 and t2.reads == [0x1100]
