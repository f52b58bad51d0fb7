"""The stack table's packed frame rows against a plain dict: random frames (None and
out-of-range fields too) added in random stacks and freed in random order rebuild equal, with
the same types; equal frames share one id, ids are reused, and what the queries read of a
stack (keys, refs, frame keys) is what its frames say."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from unwindd.store.queries import func_keys
from unwindd.store.stacktable import _W, StackTable, frame_key
from unwindd.unwind.stackfmt import Frame

FIELDS = ("ip", "dso", "sym", "offset", "kernel", "inlined", "rel", "file", "line",
          "decl_file", "decl_line")  # fmt: skip
I64 = (-(1 << 63), (1 << 63) - 1)

strs = st.sampled_from([None, "", "/lib/a.so", "/bin/b", "f", "g", "a.c", "[kernel.kallsyms]"])
# ints a row holds, and now and then one it cannot (the frame then keys as its tuple)
small = st.integers(0, 1 << 20)
wide = st.integers(-(1 << 70), 1 << 70)
ints = st.one_of(small, small, small, wide)
maybe = st.one_of(st.none(), ints)
frames = st.builds(
    Frame,
    ip=st.one_of(small.map(lambda x: 0x7F00_0000_0000 + x), st.integers(0, (1 << 64) + 9)),
    dso=strs,
    sym=strs,
    offset=maybe,
    kernel=st.booleans(),
    inlined=st.booleans(),
    rel=st.one_of(st.none(), small, st.integers(0, (1 << 64) + 9)),
    file=strs,
    line=maybe,
    decl_file=strs,
    decl_line=maybe,
)


def exact(f: Frame) -> tuple[Any, ...]:
    """All eleven fields with their types: what "rebuilt equal" means here."""
    return tuple((type(getattr(f, n)), getattr(f, n)) for n in FIELDS)


def ref_key(f: Frame) -> tuple[Any, ...]:
    """The frame's key in the table: without its ip when its stack keeps a delta for it (a
    stack here has fewer distinct deltas than a delta index can name)."""
    if f.rel is not None and I64[0] <= f.ip - f.rel <= I64[1]:
        return frame_key(f)
    return (*frame_key(f), f.ip)


def ref_stack(fr: tuple[Frame, ...]) -> tuple[Any, ...]:
    """What makes two stacks one: their frames' keys and each frame's ip or delta."""
    return tuple((ref_key(f), f.ip if len(ref_key(f)) == 11 else f.ip - f.rel)  # type: ignore
                 for f in fr)  # fmt: skip


def check(t: StackTable, live: dict[int, tuple[Frame, ...]], pool: dict[Any, Frame]) -> None:
    slots: Counter[Any] = Counter()
    fid_of: dict[Any, int] = {}
    for sid, fr in live.items():
        assert [exact(f) for f in t.frames(sid)] == [exact(f) for f in fr]
        assert [exact(f) for f in t.frames(sid, pool)] == [exact(f) for f in fr]
        assert t.keys(sid) == func_keys(fr)
        memo: dict[int, Any] = {}
        ks, ips = t.refs(sid, memo)
        assert ks == [frame_key(f) for f in fr] and ips == [f.ip for f in fr]
        assert [t.frame_key(fid) for fid in t.frame_ids(sid)] == ks
        fids, ips2 = t.ips(sid)
        assert fids == t.frame_ids(sid) and ips2 == ips and max(fids, default=-1) < t.frame_bound()
        assert t.stack_len(sid) == len(fr)
        for f, fid in zip(fr, t.frame_ids(sid), strict=True):
            k = ref_key(f)
            slots[k] += 1
            assert fid_of.setdefault(k, fid) == fid  # one id per key ...
    assert len(set(fid_of.values())) == len(fid_of) == t.nframes  # ... and one key per id
    assert {fid_of[k]: n for k, n in slots.items()} == {
        fid: n for fid, n in enumerate(t._frefs) if n}  # fmt: skip
    assert t.slots == sum(map(len, live.values())) and len(t) == len(live)
    assert sorted(t._ffree) == [fid for fid, n in enumerate(t._frefs) if not n]
    # every string a row names is interned once and counted by the rows naming it
    names: Counter[Any] = Counter()
    for k in fid_of:
        names.update(s for s in (k[0], k[1], k[6], k[8]) if s is not None)
    assert {t._strs[sid]: n for sid, n in enumerate(t._srefs) if n} == dict(names)


# ops: add a stack of the picked frames ("a"), free a live stack ("f"), end a batch ("-")
ops = st.tuples(st.sampled_from("aaf-"), st.lists(st.integers(0, 39), max_size=12))


@settings(max_examples=300, deadline=None)
@given(st.lists(frames, min_size=1, max_size=40), st.lists(ops, max_size=60))
def test_frames_round_trip_against_a_dict(objs: list[Frame], ops: list[Any]) -> None:
    t = StackTable()
    pool: dict[Any, Frame] = {}  # one query cache's rebuilt frames, across reuses of ids
    live: dict[int, tuple[Frame, ...]] = {}  # stack id -> the frames added: the reference
    by_ref: dict[tuple[Any, ...], int] = {}
    high = 0  # the most frames live at once
    for op, picks in ops:
        if op == "a":
            fr = tuple(objs[i % len(objs)] for i in picks)
            sid, new = t.add(fr)
            r = ref_stack(fr)
            assert new == (r not in by_ref) and by_ref.setdefault(r, sid) == sid
            live.setdefault(sid, fr)
            high = max(high, t.nframes)
            # a frame's id comes from the free list before the rows grow
            assert len(t._frefs) <= high
        elif op == "f" and live:
            sid = list(live)[picks[0] % len(live) if picks else 0]
            t.free(sid)
            del by_ref[ref_stack(live.pop(sid))]
        else:
            t.forget_frames()
        check(t, live, pool)
    for sid in list(live):
        t.free(sid)
    assert t.nframes == 0 and t.nbytes == 0 and t._rows == bytearray()


def test_a_reused_id_is_not_the_old_frame() -> None:
    """A frame freed and its id (and row) reused by another: the table, its identity memo and a
    query's pool of rebuilt frames all answer the new frame."""
    t = StackTable()
    pool: dict[Any, Frame] = {}
    old = Frame(0xFFFF_FFFF_8100_0000, "[kernel.kallsyms]", "old", 0, kernel=True)
    new = Frame(0xFFFF_FFFF_8100_0000, "[kernel.kallsyms]", "new", 0, kernel=True)
    keep = Frame(0x7F00_0000_1000, "/lib/x.so", "x", 0, rel=0x1000)
    a, _ = t.add((keep,))
    b, _ = t.add((old,))
    assert t.frames(b, pool) == (old,)
    t.free(b)
    c, _ = t.add((new,))
    assert t.frame_ids(c)[0] == 1 and len(t._frefs) == 2  # the id and the row were reused
    assert t.frames(c, pool) == (new,) and t.frames(c) == (new,)
    t.free(c)
    c, _ = t.add((old,))  # the identity memo's frame id now names another frame's serial
    assert t.frames(c, pool) == (old,) and t.frames(a, pool) == (keep,)


def test_new_frames_while_a_reader_holds_the_rows() -> None:
    """A query thread reads rows with struct.unpack_from, which exports the rows' buffer while
    it makes the values (and a collection run then may let the owner in): new frames must
    not resize a buffer a reader holds (BufferError, a failed add), and the rows the reader
    can read (its stacks' frames) stay what they were."""
    t = StackTable()
    first = tuple(Frame(0x1000 + 16 * i, "/lib/a.so", f"f{i}", 0, rel=16 * i) for i in range(3))
    sid, _ = t.add(first)
    held = memoryview(t._rows)  # a reader's export
    before = bytes(held[: 3 * _W])
    for k in range(200):
        fr = tuple(Frame(0x2000 + 16 * i, "/lib/b.so", f"g{k}_{i}", 0, rel=16 * i)
                   for i in range(4))  # fmt: skip
        t.add(fr)
    assert bytes(held[: 3 * _W]) == before
    assert t.frames(sid) == first
    held.release()


# a CodeStack's frames: base frames picked from the pool, each at its own ip, at its ip moved
# (another process's ASLR base) or at any ip (a delta out of range: the ip keys the frame)
moves = st.one_of(st.just(0), st.just(0x1000), st.just(-0x2000), st.integers(-(1 << 70), 1 << 70))
code_ops = st.tuples(st.sampled_from("aacf-s"),
                     st.lists(st.tuples(st.integers(0, 39), moves), max_size=12))


@settings(max_examples=300, deadline=None)
@given(st.lists(frames, min_size=1, max_size=40), st.lists(code_ops, max_size=60))
def test_code_stacks_intern_as_their_frames(objs: list[Frame], ops: list[Any]) -> None:
    """``add(base, ips)`` (a CodeStack, stackfmt.py) is ``add`` of the frames it stands for,
    ``at_ip(base[i], ips[i])``: the same stack ids, bytes and rebuilt frames as a table that
    is given those frames, whatever the batches and sweeps of the identity memos between."""
    from unwindd.unwind.stackfmt import CodeStack, at_ip

    code, plain = StackTable(), StackTable()
    pool: dict[Any, Frame] = {}
    live: dict[int, tuple[Frame, ...]] = {}
    held: list[CodeStack] = []  # the caller's stacks: their base frames stay remembered
    for op, picks in ops:
        base = tuple(objs[i % len(objs)] for i, _ in picks)
        ips = [max(0, f.ip + m) for f, (_, m) in zip(base, picks, strict=True)]
        fr = tuple(f if f.ip == ip else at_ip(f, ip) for f, ip in zip(base, ips, strict=True))
        if op in "ac":
            got = code.add(base, ips) if op == "a" else code.add(fr)  # (both kinds mixed)
            assert got == plain.add(fr)
            assert code.encoded(got[0]) == plain.encoded(got[0])
            live.setdefault(got[0], fr)
            if op == "a" and len(held) < 8:
                held.append(CodeStack(base, ips))  # type: ignore[arg-type]
        elif op == "f" and live:
            sid = list(live)[picks[0][0] % len(live) if picks else 0]
            code.free(sid)
            plain.free(sid)
            del live[sid]
        elif op == "s":
            held.clear()
            code.sweep_code_frames()
        else:
            code.forget_frames()
            plain.forget_frames()
        check(code, live, pool)


def test_code_stacks_past_the_delta_index() -> None:
    """More distinct deltas than a stack's delta index names: the frames past it key with
    their ip, at the CodeStack's ip (not their base frame's), as ``add`` of the frames does."""
    from unwindd.unwind.stackfmt import at_ip

    base = tuple(Frame(0x5500_0000_0000 + 16 * i, "/bin/app", f"f{i}", 0, rel=16 * i)
                 for i in range(300))  # fmt: skip
    ips = [f.ip + (i << 20) for i, f in enumerate(base)]  # one delta per frame
    fr = tuple(at_ip(f, ip) for f, ip in zip(base, ips, strict=True))
    code, plain = StackTable(), StackTable()
    sid, _ = code.add(base, ips)
    assert (sid, True) == plain.add(fr) and code.encoded(sid) == plain.encoded(sid)
    assert code.frames(sid) == fr


def test_code_frames_are_remembered_while_the_caller_holds_them() -> None:
    """A CodeStack's base frames stay in the table's identity memo across batches while the
    caller holds them (a new process's stack of them looks none up again) and go at the first
    sweep after the caller let go of them: the table keeps no frame alive by itself."""
    t = StackTable()
    kept = [Frame(0x5500_0000_0000 + 16 * i, "/bin/app", f"f{i}", 0, rel=16 * i)
            for i in range(4)]  # fmt: skip
    gone = [Frame(0x5600_0000_0000 + 16 * i, "/bin/other", f"g{i}", 0, rel=16 * i)
            for i in range(4)]  # fmt: skip
    t.add(tuple(kept), [f.ip + 0x1000 for f in kept])
    t.add(tuple(gone), [f.ip + 0x1000 for f in gone])
    t.forget_frames()  # a batch ends: the base frames stay remembered
    looked = 0
    lookup = t._lookup

    def counting(*a: Any) -> int:
        nonlocal looked
        looked += 1
        return lookup(*a)

    t._lookup = counting  # type: ignore[method-assign]
    t.add(tuple(kept), [f.ip + 0x2000 for f in kept])  # another process of the binary
    assert looked == 0 and len(t) == 3
    del gone
    t.sweep_code_frames()
    assert sorted(f.sym for f in t._cslots._frames) == ["f0", "f1", "f2", "f3"]
    # the frames kept under new slots keep what they resolved to: no look-up either
    t.add(tuple(kept), [f.ip + 0x3000 for f in kept])
    assert looked == 0 and len(t) == 4


def test_code_slots_are_bounded(monkeypatch: Any) -> None:
    """Past MAX_SLOTS base frames the slots start over (a frame not remembered is looked up
    again), also in the middle of a stack whose other frames had slots: the same stacks as a
    table given the frames."""
    from unwindd.store import codeslots
    from unwindd.unwind.stackfmt import at_ip

    monkeypatch.setattr(codeslots, "MAX_SLOTS", 8)
    code, plain = StackTable(), StackTable()
    shared = Frame(0x5500_0000_9000, "/bin/app", "main", 0, rel=0x9000)  # in every stack
    held = []
    for k in range(6):
        base = (*(Frame(0x5500_0000_0000 + 16 * i, "/bin/app", f"f{k % 3}_{i}", 0, rel=16 * i)
                  for i in range(2)), shared)  # fmt: skip
        held.append(base)
        for move in (0x1000, 0x2000):
            ips = [f.ip + move for f in base]
            got = code.add(base, ips)
            assert got == plain.add(tuple(at_ip(f, ip) for f, ip in zip(base, ips, strict=True)))
            assert code.encoded(got[0]) == plain.encoded(got[0])
            assert len(code._cslots) <= 8
    assert len(code._cslots) == 7  # (cleared once, at the fourth stack: 7 slots, 3 frames)


def test_code_stack_needs_an_ip_per_frame() -> None:
    """A CodeStack with more frames than ips (or fewer) is refused, as ``zip(strict=True)``
    refuses it: C never reads past the ips."""
    base = tuple(Frame(0x5500_0000_0000 + 16 * i, "/bin/app", f"f{i}", 0, rel=16 * i)
                 for i in range(3))  # fmt: skip
    t = StackTable()
    for ips in ([f.ip for f in base[:2]], [*(f.ip for f in base), 0]):
        with pytest.raises(ValueError):
            t.add(base, ips)
    assert len(t) == 0 and t.nframes == 0
