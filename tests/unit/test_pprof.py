"""pprof encoding, checked by an independent decoder (tests/support/pprofcheck.py) for the
invariants ``go tool pprof`` enforces: ids defined, string table consistent, values per sample
type."""

from __future__ import annotations

import dataclasses
import gzip

from hypothesis import given, settings
from hypothesis import strategies as st
from pprofcheck import check_valid, decode, fields_of, read_varint
from unwindd.store.pprof import encode_profile, encode_profile_ids, varint
from unwindd.store.queries import StackCount
from unwindd.store.stacktable import StackTable
from unwindd.unwind.stackfmt import Frame

SPIN = Frame(0x401136, "/w/chain_o2", "spin", 6, rel=0x1136)
C = Frame(0x401150, "/w/chain_o2", "c", 4, rel=0x1150)
LIBC = Frame(0x7F0000029D90, "/usr/lib/x86_64-linux-gnu/libc.so.6", None, None)
KERN = Frame(0xFFFFFFFF81000000, "[kernel.kallsyms]", "asm_sysvec", 0, kernel=True)


def test_varint_wire_format() -> None:
    # developers.google.com/protocol-buffers/docs/encoding: 150 -> 96 01; 1 -> 01; -1 -> 10 bytes.
    assert varint(150) == b"\x96\x01" and varint(1) == b"\x01" and varint(0) == b"\x00"
    assert varint(-1) == b"\xff" * 9 + b"\x01"
    assert read_varint(varint(1 << 63), 0) == (1 << 63, 10)
    for v in (127, 128, 0x3FFF, 0x4000, 0x1FFFFF, 0x200000, (1 << 64) - 1):
        assert read_varint(varint(v), 0) == (v, (v.bit_length() + 6) // 7)


def test_profile_round_trips() -> None:
    stacks = [
        StackCount(42, 43, "chain_o2", (KERN, SPIN, C, LIBC), 7),
        StackCount(42, 42, "chain_o2", (SPIN, C), 3),
        StackCount(-1, -1, "", (), 1),
    ]
    data = encode_profile(stacks, period_ns=10_101_010, duration_nanos=5_000_000_000)
    assert data[:2] == b"\x1f\x8b"
    p = decode(data)
    check_valid(p)
    assert p.sample_types == [("samples", "count"), ("cpu", "nanoseconds")]
    assert p.period_type == ("cpu", "nanoseconds") and p.period == 10_101_010
    assert [s[1] for s in p.samples] == [[7, 70_707_070], [3, 30_303_030], [1, 10_101_010]]
    assert p.stack_names(0) == ["asm_sysvec", "spin", "c", "[unknown]"]
    # the unknown frame's binary is its function's file name (and its location's mapping)
    libc = p.functions[p.locations[p.samples[0][0][3]][2][0]]
    assert libc == ("[unknown]", "[unknown]", "/usr/lib/x86_64-linux-gnu/libc.so.6")
    assert p.stack_names(1) == ["spin", "c"]
    assert p.samples[0][2] == {"comm": "chain_o2", "pid": 42, "tid": 43}
    assert p.samples[2][2] == {}
    # Shared frames are one location and one function; each dso is one mapping.
    assert len(p.locations) == 4 and len(p.functions) == 4
    assert sorted(p.mappings.values()) == ["/usr/lib/x86_64-linux-gnu/libc.so.6", "/w/chain_o2",
                                           "[kernel.kallsyms]"]
    assert p.locations[p.samples[0][0][1]][1] == SPIN.ip
    assert len(set(p.strings)) == len(p.strings), "string table has duplicates"
    top = fields_of(gzip.decompress(data))
    assert top[10] == [5_000_000_000]


frames = st.builds(
    Frame,
    ip=st.integers(0, (1 << 64) - 1),
    dso=st.none() | st.sampled_from(["/bin/a", "/lib/b.so", "[vdso]"]),
    sym=st.none() | st.text(max_size=8),
    offset=st.none() | st.integers(0, 1 << 20),
    kernel=st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.builds(StackCount, pid=st.integers(-1, 1 << 22), tid=st.integers(-1, 1 << 22),
                          comm=st.text(max_size=16), frames=st.lists(frames, max_size=6).map(tuple),
                          count=st.integers(1, 1 << 40)), max_size=8))
def test_any_stacks_encode_to_a_valid_profile(stacks: list[StackCount]) -> None:
    p = decode(encode_profile(stacks, period_ns=1_000_000, compress=False))
    check_valid(p)
    assert len(p.samples) == len(stacks)
    for (lids, values, labels), sc in zip(p.samples, stacks, strict=True):
        assert values == [sc.count, sc.count * 1_000_000]
        assert labels.get("comm", "") == sc.comm
        assert [p.locations[lid][1] for lid in lids] == [f.ip for f in sc.frames]


def test_inline_chain_is_one_location_with_lines() -> None:
    """Frames of one pc (inlined ones, then the frame they sit in) are one Location with a Line
    per level, innermost first (pprof's inline model); functions carry the source file."""
    leaf = Frame(0x1010, "/bin/w", "leaf", None, inlined=True, rel=0x10, file="/s/w.h", line=3)
    mid = Frame(0x1010, "/bin/w", "mid", None, inlined=True, rel=0x10, file="/s/w.h", line=9)
    outer = Frame(0x1010, "/bin/w", "outer", 0x10, rel=0x10, file="/s/w.c", line=20)
    main = Frame(0x2000, "/bin/w", "main", 0x5, rel=0x1000, file="/s/w.c", line=30)
    p = decode(encode_profile([StackCount(1, 1, "w", (leaf, mid, outer, main), 2)],
                              period_ns=1000))  # fmt: skip
    check_valid(p)
    lids = p.samples[0][0]
    assert len(lids) == 2
    assert p.stack_names(0) == ["leaf", "mid", "outer", "main"]
    fids = p.locations[lids[0]][2]
    assert [p.functions[f][0] for f in fids] == ["leaf", "mid", "outer"]
    assert [p.functions[f][2] for f in fids] == ["/s/w.h", "/s/w.h", "/s/w.c"]
    raw = gzip.decompress(encode_profile([StackCount(1, 1, "w", (leaf, mid, outer), 1)],
                                         period_ns=1))  # fmt: skip
    loc = fields_of(fields_of(raw)[4][0])
    assert [fields_of(ln)[2][0] for ln in loc[4]] == [3, 9, 20]  # Line.line per level


def test_functions_carry_their_declaration() -> None:
    """A Function's filename is the file DWARF declares it in and its start_line the line
    (Frame.decl_file/decl_line); without them the frame's own file, and no start line. Two
    functions of one name declared apart are two Functions."""
    leaf = Frame(0x1010, "/bin/w", "leaf", None, inlined=True, rel=0x10, file="/s/w.c",
                 line=3, decl_file="/s/w.h", decl_line=2)  # fmt: skip
    outer = Frame(0x1010, "/bin/w", "outer", 0x10, rel=0x10, file="/s/w.c", line=20,
                  decl_file="/s/w.c", decl_line=17)  # fmt: skip
    other = Frame(0x2010, "/bin/w", "leaf", None, inlined=True, rel=0x1010, file="/s/v.c",
                  line=8, decl_file="/s/v.c", decl_line=6)  # fmt: skip
    bare = Frame(0x2010, "/bin/w", "main", 0x10, rel=0x1010, file="/s/v.c", line=30)
    p = decode(encode_profile([StackCount(1, 1, "w", (leaf, outer), 1),
                               StackCount(1, 1, "w", (other, bare), 1)], period_ns=1))
    check_valid(p)
    got = sorted((name, file, p.starts[fid]) for fid, (name, _, file) in p.functions.items())
    assert got == [("leaf", "/s/v.c", 6), ("leaf", "/s/w.h", 2), ("main", "/s/v.c", 0),
                   ("outer", "/s/w.c", 17)]  # fmt: skip


# Frames from a small pool, so stacks share frame objects and equal frames come as distinct
# objects too; inline chains at one pc; labels for some pids.
_pool = st.builds(
    Frame,
    ip=st.sampled_from([0x1010, 0x2000, 0x7F0000029D90, 0xFFFFFFFF81000000, 1 << 63]),
    dso=st.none() | st.sampled_from(["/bin/w", "/lib/b.so"]),
    sym=st.none() | st.sampled_from(["leaf", "mid", "main", ""]),
    offset=st.none() | st.integers(0, 300),
    kernel=st.booleans(),
    inlined=st.booleans(),
    file=st.none() | st.sampled_from(["/s/w.c", "/s/w.h"]),
    line=st.none() | st.integers(0, 200),
    decl_file=st.none() | st.just("/s/w.h"),
    decl_line=st.none() | st.integers(0, 200),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_pool, min_size=1, max_size=8), st.data())
def test_bytes_equal_the_straightforward_encoder(pool: list[Frame], data: st.DataObject) -> None:
    """The encoder's bytes are those of building every message from its frames one by one
    (tests/support/pprofref.py): its per-query memos (by frame, stack, count, comm, pid) change
    no byte, whether entries share one frames tuple or carry equal copies."""
    from pprofref import encode_profile as reference

    frames = st.lists(st.sampled_from(pool), max_size=7).map(tuple)
    stacks = data.draw(st.lists(frames, min_size=1, max_size=4))
    picks = data.draw(st.lists(st.tuples(
        st.integers(0, len(stacks) - 1), st.booleans(), st.integers(-1, 300),
        st.integers(-1, 300), st.sampled_from(["", "w", "sh"]), st.integers(1, 1 << 40)),
        max_size=12))  # fmt: skip
    entries = [StackCount(pid, tid, comm, stacks[i] if same else tuple(list(stacks[i])), n)
               for i, same, pid, tid, comm, n in picks]  # fmt: skip
    labels = {1: {"cgroup": "/system.slice/a.service", "unit": "a.service", "container_id": ""},
              2: {"unit": "b.service"}}  # fmt: skip

    def labels_of(pid: int) -> dict[str, str]:
        return labels.get(pid % 3, {})

    period = data.draw(st.sampled_from([0, 1, 10_101_010]))
    for kw in ({}, {"labels_of": labels_of, "time_nanos": 5, "duration_nanos": 1 << 40}):
        got = encode_profile(entries, period_ns=period, compress=False, **kw)  # type: ignore[arg-type]
        assert got == reference(entries, period_ns=period, compress=False, **kw)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(st.lists(_pool, min_size=1, max_size=8), st.data())
def test_ids_encoder_bytes_equal_the_straightforward_encoder(pool: list[Frame],
                                                             data: st.DataObject) -> None:
    """``encode_profile_ids`` of a stack table's stacks writes the bytes of building every
    message from the stacks' frames, for a few entries (a code per frame named) and for many
    (a code per row of the table), with inline chains at one pc and frames keyed by their
    ``rel`` at another address per stack."""
    from pprofref import encode_profile as reference

    pool += [dataclasses.replace(f, rel=0x10) for f in pool if f.ip == 0x1010]
    t = StackTable()
    stacks = data.draw(st.lists(st.lists(st.sampled_from(pool), max_size=7), min_size=1,
                                max_size=4))  # fmt: skip
    sids = []
    for i, fr in enumerate(stacks):
        # frames with a rel: another address in each stack (another process's mapping)
        moved = tuple(dataclasses.replace(f, ip=f.ip + (i << 20)) if f.rel is not None else f
                      for f in fr)  # fmt: skip
        sids.append(t.add(moved)[0])
    picks = data.draw(st.lists(st.tuples(
        st.integers(0, len(stacks) - 1), st.integers(-1, 300), st.integers(-1, 300),
        st.sampled_from(["", "w"]), st.integers(1, 1 << 40)), min_size=1, max_size=12))  # fmt: skip
    for few in (picks[:2], picks + picks * (t.frame_bound() // 16 // len(picks))):
        entries = [((pid, tid, comm, sids[i]), n) for i, pid, tid, comm, n in few]
        want = reference([StackCount(pid, tid, comm, t.frames(sid), n)
                          for (pid, tid, comm, sid), n in entries], period_ns=7)  # fmt: skip
        assert encode_profile_ids(entries, t, period_ns=7) == want


def test_samples_compressed_as_written_are_gzips_bytes() -> None:
    """A profile whose samples span many compressed pieces is ``gzip.compress`` of the whole
    (deflate's output does not depend on how its input was split)."""
    stacks = [StackCount(i % 97, i, f"c{i % 13}", (KERN, SPIN, C, LIBC)[i % 3:], i % 7 + 1)
              for i in range(20_000)]  # fmt: skip
    raw = encode_profile(stacks, period_ns=10_101_010, compress=False)
    assert raw.count(b"\x12") > 20_000 and len(raw) > 8 * 65536  # many pieces of samples
    assert encode_profile(stacks, period_ns=10_101_010) == gzip.compress(raw, 6, mtime=0)
