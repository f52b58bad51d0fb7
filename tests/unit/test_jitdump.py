"""The jitdump reader (binaries/jitdump.py) on bytes laid out as perf's jitdump.h says: both byte
orders, files cut anywhere (a JIT still writing), long records read by their head, garbage,
the time rule of the code table, and the file shell on a file that grows and is replaced."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from unwindd.binaries import jitdump as jd
from unwindd.binaries.jitdump import (
    CodeLoad,
    CodeMove,
    JitCodeTable,
    Jitdump,
    JitdumpParser,
    is_jitdump_path,
)

# -- a writer, field by field from tools/perf/util/jitdump.h (struct jitheader, jr_prefix,
# jr_code_load, jr_code_move, jr_code_debug_info, jr_code_unwinding_info)


def header(e: str = "<", *, version: int = 1, total: int = 40, flags: int = 0,
           pid: int = 4242, extra: bytes = b"") -> bytes:  # fmt: skip
    return struct.pack(e + "IIIIIIQQ", 0x4A695444, version, total + len(extra), 62, 0, pid,
                       123, flags) + extra  # fmt: skip


def rec(e: str, rid: int, ts: int, body: bytes) -> bytes:
    return struct.pack(e + "IIQ", rid, 16 + len(body), ts) + body


def load(e: str, ts: int, addr: int, size: int, index: int, name: str,
         code: bytes | None = None) -> bytes:  # fmt: skip
    code = b"\xcc" * size if code is None else code
    body = struct.pack(e + "IIQQQQ", 4242, 4243, addr, addr, size, index)
    return rec(e, 0, ts, body + name.encode() + b"\0" + code)


def move(e: str, ts: int, old: int, new: int, size: int, index: int) -> bytes:
    return rec(e, 1, ts, struct.pack(e + "IIQQQQQ", 4242, 4243, 0, old, new, size, index))


def debug_info(e: str, ts: int, addr: int) -> bytes:
    entry = struct.pack(e + "QiI", addr + 4, 7, 0) + b"/x.js\0"
    return rec(e, 2, ts, struct.pack(e + "QQ", addr, 1) + entry)


def unwinding(e: str, ts: int) -> bytes:
    return rec(e, 4, ts, struct.pack(e + "QQQ", 8, 0, 8) + b"\0" * 8)


def close(e: str, ts: int) -> bytes:
    return rec(e, 3, ts, b"")


def sample_dump(e: str = "<") -> bytes:
    return (header(e) + debug_info(e, 5, 0x1000) + unwinding(e, 6)
            + load(e, 10, 0x1000, 0x40, 1, "JS:*leaf /x.js:1:1")
            + load(e, 11, 0x2000, 0x100, 2, "JS:~top /x.js:9:1")
            + rec(e, 77, 12, b"future record")  # an id perf does not know: skipped
            + move(e, 13, 0x1000, 0x3000, 0x40, 1)
            + close(e, 14))  # fmt: skip


EXPECTED = [
    CodeLoad(10, 4242, 4243, 0x1000, 0x1000, 0x40, 1, "JS:*leaf /x.js:1:1"),
    CodeLoad(11, 4242, 4243, 0x2000, 0x2000, 0x100, 2, "JS:~top /x.js:9:1"),
    CodeMove(13, 4242, 4243, 0, 0x1000, 0x3000, 0x40, 1),
]


def parse_all(data: bytes, splits: list[int] | None = None) -> JitdumpParser:
    """Feed ``data`` as a file growing to each split in turn, reading as the shell does
    (from ``offset``, at least ``need`` bytes); the parser's events go to ``.events``."""
    p = JitdumpParser()
    events: list[object] = []
    for end in [*(splits or []), len(data)]:
        while not p.done and p.offset < end:
            before = p.offset
            events += p.feed(data[p.offset : p.offset + max(jd.CHUNK, p.need)][: end - p.offset],
                             end)  # fmt: skip
            if p.offset == before:
                break
    p.events = events  # type: ignore[attr-defined]
    return p


@pytest.mark.parametrize("e", ["<", ">"])
def test_both_byte_orders(e: str) -> None:
    p = parse_all(sample_dump(e))
    assert p.events == EXPECTED  # type: ignore[attr-defined]
    assert p.order == e and p.pid == 4242 and p.closed and not p.errors
    assert p.records == {"debug_info": 1, "unwinding_info": 1, "code_load": 2, "unknown": 1,
                         "code_move": 1, "code_close": 1}  # fmt: skip
    assert p.offset == len(sample_dump(e))


def test_cut_anywhere_resumes() -> None:
    """A file read while the JIT writes it, cut at every byte: the same events, each once,
    and the offset never past the last complete record."""
    data = sample_dump()
    for cut in range(len(data) + 1):
        p = JitdumpParser()
        first = p.feed(data[:cut], cut)
        assert p.offset <= cut and not p.errors
        rest = parse_all(data)
        p2 = parse_all(data, [cut])
        assert p2.events == EXPECTED, cut  # type: ignore[attr-defined]
        assert first == EXPECTED[: len(first)] and rest.events == EXPECTED  # type: ignore[attr-defined]


def test_header_of_newer_writer_and_long_record_skipped_unread() -> None:
    """Header bytes beyond struct jitheader are skipped; a code load far longer than one read
    is named from its head and its code bytes are never read."""
    e = "<"
    big = load(e, 10, 0x1000, 3 * jd.CHUNK, 1, "JS:*big /x.js:1:1")
    data = header(e, extra=b"\xee" * 24) + big + load(e, 11, 0x9000, 8, 2, "JS:*next /x.js:2:1")
    p = JitdumpParser()
    reads = []
    events: list[object] = []
    while p.offset < len(data):
        n = max(4096, p.need)  # small reads: the big record is never held whole
        reads.append(n)
        events += p.feed(data[p.offset : p.offset + n], len(data))
    assert [ev.name for ev in events] == ["JS:*big /x.js:1:1", "JS:*next /x.js:2:1"]  # type: ignore[attr-defined]
    assert max(reads) <= jd.HEAD_MAX and not p.errors


@pytest.mark.parametrize(("data", "error"), [
    (b"ELF\x7f" + bytes(60), "bad_magic"),
    (header(version=2), "bad_version"),
    (header(flags=2), "bad_flags"),
    (header(total=20), "bad_header_size"),
    (header() + struct.pack("<IIQ", 0, 8, 1) + load("<", 2, 0x10, 4, 1, "f"), "bad_record_size"),
])  # fmt: skip
def test_fatal_garbage(data: bytes, error: str) -> None:
    p = parse_all(data)
    assert p.dead and p.errors == {error: 1} and p.events == []  # type: ignore[attr-defined]
    assert p.feed(data, len(data)) == []  # nothing after a fatal error


def test_bad_records_are_skipped_and_counted() -> None:
    e = "<"
    short = rec(e, 0, 3, b"\0" * 20)  # shorter than jr_code_load's fixed part
    short_move = rec(e, 1, 4, b"\0" * 8)
    no_nul = rec(e, 0, 5, struct.pack(e + "IIQQQQ", 1, 1, 0, 0x10, 0, 9) + b"abc")
    data = header(e) + short + short_move + no_nul + load(e, 6, 0x100, 4, 1, "ok")
    p = parse_all(data)
    assert [ev.name for ev in p.events] == ["ok"]  # type: ignore[attr-defined]
    assert p.errors == {"short_record": 2, "bad_name": 1} and not p.dead


def test_table_time_rule() -> None:
    """Code replaced at one address: a lookup names what was there at the sample's time;
    before any load, the oldest; time unknown, the newest. Moves take the load's name."""
    t = JitCodeTable()
    t.add(CodeLoad(100, 1, 1, 0, 0x1000, 0x100, 1, "old"))
    t.add(CodeLoad(200, 1, 1, 0, 0x1000, 0x80, 2, "new"))
    t.add(CodeLoad(150, 1, 1, 0, 0x8000, 0x10000, 3, "huge"))  # covers much above it
    t.add(CodeLoad(160, 1, 1, 0, 0x9000, 0x10, 4, "inside"))
    t.add(CodeMove(300, 1, 1, 0, 0x1000, 0x5000, 0x80, 2))
    t.add(CodeMove(300, 1, 1, 0, 0x1, 0x6000, 0x80, 99))  # never loaded: dropped
    assert t.lookup(0x1010, 150) == ("old", 0x10)
    assert t.lookup(0x1010, 200) == ("new", 0x10)
    assert t.lookup(0x1010, 50) == ("old", 0x10)  # the sample's clock is not the dump's
    assert t.lookup(0x1010, None) == ("new", 0x10)
    assert t.lookup(0x10C0, 250) == ("old", 0xC0)  # beyond "new"'s end: only old covers it
    assert t.lookup(0x5004, 400) == ("new", 4) and t.lookup(0x5004, 299) == ("new", 4)
    assert t.lookup(0x9008, 170) == ("inside", 8) and t.lookup(0x9020, 170) == ("huge", 0x1020)
    assert t.lookup(0x17FFF, None) == ("huge", 0xFFFF) and t.lookup(0x18000, None) is None
    assert t.lookup(0x800, None) is None and t.dropped == 1
    # where a name can change: "new" over "old" at 200, "inside" over "huge" at 160
    assert t.boundaries() == [160, 200]
    small = JitCodeTable(max_entries=1)
    small.add(EXPECTED[0])
    small.add(EXPECTED[1])
    assert len(small) == 1 and small.dropped == 1


def test_file_grows_and_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "jit-4242.dump"
    data = sample_dump()
    cut = len(header()) + len(debug_info("<", 5, 0x1000)) + 30  # inside the unwinding record
    path.write_bytes(data[:cut])
    d = Jitdump(str(path))
    assert d.lookup(0x1010, 20) is None
    with path.open("ab") as f:
        f.write(data[cut:])
    assert d.lookup(0x1010, 20) == ("JS:*leaf /x.js:1:1", 0x10)
    assert d.lookup(0x3010, 20) == ("JS:*leaf /x.js:1:1", 0x10)  # the move, seen at 13
    os.unlink(path)
    path.write_bytes(header() + load("<", 50, 0x1000, 0x40, 1, "JS:*other /y.js:1:1"))
    assert d.lookup(0x1010, 60) == ("JS:*other /y.js:1:1", 0x10)  # another inode: read anew
    assert Jitdump(str(tmp_path / "missing.dump")).lookup(0x1010) is None


def test_arch_timestamps_are_not_compared(tmp_path: Path) -> None:
    path = tmp_path / "jit-1.dump"
    path.write_bytes(header(flags=1) + load("<", 10, 0x1000, 0x40, 1, "a")
                     + load("<", 20, 0x1000, 0x40, 2, "b"))  # fmt: skip
    assert Jitdump(str(path)).lookup(0x1000, 15) == ("b", 0)  # TSC vs ns: the newest


def test_dump_names() -> None:
    assert is_jitdump_path("/srv/app/jit-123.dump") and is_jitdump_path("jit-1.dump")
    for p in ("/srv/jit-.dump", "/srv/jit-12.dump.bak", "/tmp/perf-12.map", "/srv/xjit-1.dump"):
        assert not is_jitdump_path(p), p


# -- fuzz: any bytes, fed in any pieces, never raise, never go back, never read past the end,
# and a valid dump gives the same events however it is cut

@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.lists(st.integers(0, 600), max_size=6))
def test_fuzz_garbage(data: bytes, cuts: list[int]) -> None:
    for prefix in (b"", header(), header(">")):
        blob = prefix + data
        splits = sorted(c for c in cuts if c <= len(blob))
        p = JitdumpParser()
        last = 0
        for end in [*splits, len(blob)]:
            for _ in range(len(blob) + 2):  # bounded: every feed that returns makes progress
                before = p.offset
                p.feed(blob[p.offset : p.offset + max(64, p.need)], end)
                assert p.offset >= last
                last = p.offset
                if p.done or p.offset == before or p.offset >= end:
                    break
        assert p.done or p.offset <= len(blob)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["<", ">"]), st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 40),
       st.integers(0, 300), st.text(max_size=20).filter(lambda s: "\0" not in s)), max_size=8),
       st.lists(st.integers(0, 4000), max_size=5))  # fmt: skip
def test_fuzz_valid_dumps_any_cut(e: str, recs: list[tuple[int, int, int, str]],
                                  cuts: list[int]) -> None:  # fmt: skip
    data = header(e)
    want: list[object] = []
    for i, (kind, addr, size, name) in enumerate(recs):
        if kind == 0:
            data += load(e, i, addr, size, i, name)
            want.append(CodeLoad(i, 4242, 4243, addr, addr, size, i, name))
        elif kind == 1:
            data += move(e, i, addr, addr + 8, size, i)
            want.append(CodeMove(i, 4242, 4243, 0, addr, addr + 8, size, i))
        else:
            data += unwinding(e, i)
    p = parse_all(data, sorted(c for c in cuts if c <= len(data)))
    assert p.events == want and not p.errors and p.offset == len(data)  # type: ignore[attr-defined]


def test_symbolizer_reads_dumps_through_proc_root_and_keeps_counts(tmp_path: Path) -> None:
    """A dump path the daemon cannot see as is (another mount namespace) is read through
    <proc_root>/<pid>/root; a forgotten pid's dump still counts in ``jitdump_counts``."""
    from unwindd.binaries.symbolize import Symbolizer

    inside = tmp_path / "proc" / "77" / "root" / "app"
    inside.mkdir(parents=True)
    (inside / "jit-1.dump").write_bytes(sample_dump() + b"\x01\x00")  # and 2 bytes of a record
    sym = Symbolizer(proc_root=str(tmp_path / "proc"))
    assert sym.jitdump(77, "/app/jit-1.dump", 0x2008, 12) == ("JS:~top /x.js:9:1", 8)
    assert sym.has_jitdump(77) and not sym.has_jitdump(78)
    want = {"files": 1, "dropped": 0, "record_debug_info": 1, "record_unwinding_info": 1,
            "record_code_load": 2, "record_unknown": 1, "record_code_move": 1,
            "record_code_close": 1}  # fmt: skip
    assert sym.jitdump_counts() == want
    sym.forget_pid(77)
    assert not sym.has_jitdump(77) and sym.jitdump_counts() == want
    garbage = tmp_path / "jit-2.dump"
    garbage.write_bytes(b"\x7fELF" + bytes(100))
    assert sym.jitdump(2, str(garbage), 0x1000, None) is None
    assert sym.jitdump_counts()["error_bad_magic"] == 1
