"""The live step's bulk side-band helpers (cffi_build/sideband.c), each against the Python it
stands for in ringstep.py: ``unw_sb_rows`` against ``fp_select_other`` plus one cffi
attribute read per field, ``unw_sb_marks`` against ``context.mark_record`` entry by entry,
``unw_sb_slots`` against a dict from record index to its place in the carry,
``unw_sb_trailer_marks`` against ``context.record_marks`` of the decoded record (the entries it
leaves marked from Python as the step does); and ``RecordDecoder.decode_side_band`` against
``decode_one`` record by record. Inputs are real record streams (``recordbytes``: samples,
MMAP2s good and cut, COMM, FORK, EXIT, LOST, THROTTLE, random bodies) indexed by ``fp_index``,
so the entries carry every flag the step's index gives them.
"""

from __future__ import annotations

from typing import Any

import recordbytes as rb
from hypothesis import given, settings
from hypothesis import strategies as st
from unwindd.pipeline.context import mark_record, record_marks
from unwindd.source.decoder import RecordDecoder
from unwindd.source.formats import EventFormat
from unwindd.source.mapfile import RecordIndex, layout_of
from unwindd.unwcore import ffi, lib

# the daemon's sample format (TID|TIME|CPU|PERIOD, user regs and stack) with sample_id_all
_FMT = EventFormat(rb.S_IP | rb.S_TID | rb.S_TIME | rb.S_CPU | rb.S_PERIOD | rb.S_REGS_USER
                   | rb.S_STACK_USER | rb.S_ID, sample_regs_user=0b111)  # fmt: skip
_FIELDS = ("off", "time", "period", "pid", "tid", "cpu", "size", "misc", "type", "flags", "err")


@st.composite
def _stream(draw: st.DrawFn) -> bytes:
    """Samples among side-band records, well formed or not."""
    st_ = _FMT.sample_type
    out = b""
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["sample", "mmap2", "mmap2_bid", "comm", "task", "lost",
                                     "throttle", "random", "cut"]))  # fmt: skip
        sid = rb.Sid(pid=draw(st.integers(0, 9)), tid=1, time=draw(st.integers(0, 1 << 40)),
                     id=3, cpu=draw(st.integers(0, 3)))  # fmt: skip
        if kind == "sample":
            out += rb.sample(st_, ip=0x1000, pid=sid.pid, tid=1, time=sid.time, cpu=sid.cpu,
                             period=1, id=3, regs_abi=2, regs=(1, 2, 3),
                             stack=b"\0" * 16)  # fmt: skip
        elif kind == "mmap2":
            out += rb.mmap2_inode(pid=sid.pid or 0, tid=1, addr=draw(st.integers(0, 1 << 47)),
                                  length=draw(st.integers(0, 1 << 20)), pgoff=0, maj=8, min=1,
                                  ino=9, ino_generation=0, prot=draw(st.integers(0, 7)), flags=2,
                                  filename=draw(st.text(max_size=12)), sample_type=st_,
                                  sid=sid)  # fmt: skip
        elif kind == "comm":
            out += rb.comm(pid=sid.pid or 0, tid=1, comm="x", exec=draw(st.booleans()),
                           sample_type=st_, sid=sid)  # fmt: skip
        elif kind == "mmap2_bid":
            out += rb.mmap2_build_id(pid=sid.pid or 0, tid=1, addr=0x1000, length=0x1000,
                                     pgoff=0, build_id=draw(st.binary(max_size=20)), prot=5,
                                     flags=2, filename="/b", sample_type=st_,
                                     sid=sid)  # fmt: skip
        elif kind == "task":
            make = draw(st.sampled_from([rb.fork, rb.exit]))
            out += make(pid=sid.pid or 0, ppid=1, tid=2, ptid=1,
                        time=draw(st.integers(0, (1 << 64) - 1)), sample_type=st_,
                        sid=sid)  # fmt: skip
        elif kind == "lost":
            out += rb.lost(id=3, lost=draw(st.integers(0, 99)), sample_type=st_, sid=sid)
        elif kind == "throttle":
            out += rb.throttle(time=draw(st.integers(0, 1 << 40)), id=3, stream_id=3,
                               unthrottle=draw(st.booleans()), sample_type=st_,
                               sid=sid)  # fmt: skip
        elif kind == "cut":  # a good side-band record's body cut short (8-byte aligned)
            rec = draw(st.sampled_from([
                rb.comm(pid=1, tid=1, comm="abcdefghijk", sample_type=st_, sid=sid),
                rb.fork(pid=1, ppid=1, tid=1, ptid=1, time=5, sample_type=st_, sid=sid),
                rb.mmap2_inode(pid=1, tid=1, addr=0, length=1, pgoff=0, maj=8, min=1, ino=9,
                               ino_generation=0, prot=5, flags=2, filename="/x",
                               sample_type=st_, sid=sid)]))  # fmt: skip
            keep = 8 + 8 * draw(st.integers(0, (len(rec) - 8) // 8))
            out += rb.raw_record(rec[0], rec[4] | rec[5] << 8, rec[8:keep])
        else:
            body = draw(st.binary(max_size=120))
            out += rb.raw_record(draw(st.sampled_from([2, 3, 4, 5, 7, 9, 10])),
                                 draw(st.integers(0, 0xFFFF)),
                                 body + b"\0" * (-len(body) % 8))  # fmt: skip
    return out


def _index(buf: bytes) -> tuple[Any, RecordIndex]:
    data = ffi.from_buffer(buf)
    return data, RecordIndex(layout_of(_FMT), data, len(buf))


def _entry(r: Any) -> tuple[int, ...]:
    return tuple(int(getattr(r, f)) for f in _FIELDS)


@settings(max_examples=300, deadline=None)
@given(buf=_stream())
def test_sb_rows_lists_every_side_band_entry_with_its_header_fields(buf: bytes) -> None:
    _, idx = _index(buf)
    n = idx.n
    sel = ffi.new("uint32_t[]", max(1, n))
    want = []
    for i in list(sel[0 : int(lib.fp_select_other(idx.recs, n, sel))]):
        r = idx.recs[i]
        want += [i, r.type, r.misc, r.off, r.size]
    rows = ffi.new("uint64_t[]", max(1, 5 * n))
    k = int(lib.unw_sb_rows(idx.recs, n, rows))
    assert list(rows[0 : 5 * k]) == want


@settings(max_examples=300, deadline=None)
@given(buf=_stream(), data=st.data())
def test_sb_marks_writes_what_mark_record_writes(buf: bytes, data: st.DataObject) -> None:
    _, ref = _index(buf)
    _, got = _index(buf)
    n = ref.n
    chosen = data.draw(st.lists(st.integers(0, max(0, n - 1)), max_size=n, unique=True)
                       if n else st.just([]))  # fmt: skip
    marks = [data.draw(st.tuples(st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 32) - 1),
                                 st.integers(0, 255)))
             for _ in chosen]  # fmt: skip
    for i, m in zip(chosen, marks, strict=True):
        mark_record(ref.recs[i], m)
    idx = ffi.new("uint32_t[]", chosen or [0])
    flat = ffi.new("uint64_t[]", [x for m in marks for x in m] or [0])
    lib.unw_sb_marks(got.recs, idx, flat, len(chosen))
    for i in range(n):
        assert _entry(got.recs[i]) == _entry(ref.recs[i])


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_sb_slots_finds_each_record_in_the_carry(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 64))
    keep = data.draw(st.permutations(range(n)).map(lambda p: p[: data.draw(st.integers(1, n))]))
    want = data.draw(st.lists(st.sampled_from(keep), unique=True))
    slot = {i: j for j, i in enumerate(keep)}
    inv, out = ffi.new("uint32_t[]", n), ffi.new("uint32_t[]", max(1, len(want)))
    lib.unw_sb_slots(ffi.new("uint32_t[]", keep), len(keep), ffi.new("uint32_t[]", want or [0]),
                     len(want), inv, out)  # fmt: skip
    assert list(out[0 : len(want)]) == [slot[i] for i in want]


def _others(idx: RecordIndex) -> list[int]:
    sel = ffi.new("uint32_t[]", max(1, idx.n))
    return list(sel[0 : int(lib.fp_select_other(idx.recs, idx.n, sel))])


@settings(max_examples=400, deadline=None)
@given(buf=_stream())
def test_sb_trailer_marks_writes_what_the_decoded_record_gives(buf: bytes) -> None:
    """Every side-band entry ends as ``mark_record(record_marks(decode_one(it)))`` would leave
    it: the common ones marked in C, the ones it lists marked from Python as the step does."""
    data, ref = _index(buf)
    _, got = _index(buf)
    dec = RecordDecoder([_FMT])
    mv = memoryview(buf)
    others = _others(ref)
    for i in others:
        r = ref.recs[i]
        rec = dec.decode_one(r.type, r.misc, mv[r.off + 8 : r.off + r.size])
        mark_record(r, record_marks(rec))
    trailer = dec.sample_id_trailer()
    assert trailer is not None
    rest = ffi.new("uint32_t[]", max(1, len(others)))
    left = int(lib.unw_sb_trailer_marks(data, len(buf), got.recs,
                                        ffi.new("uint32_t[]", others or [0]), len(others),
                                        *trailer, rest))  # fmt: skip
    for i in list(rest[0:left]):
        r = got.recs[i]
        mark_record(r, record_marks(dec.decode_one(r.type, r.misc,
                                                   mv[r.off + 8 : r.off + r.size])))  # fmt: skip
    for i in range(ref.n):
        assert _entry(got.recs[i]) == _entry(ref.recs[i]), i
    # what it leaves to Python is only what it cannot read at fixed offsets
    assert all(got.recs[i].type not in (3, 4, 7) for i in list(rest[0:left]))


@settings(max_examples=400, deadline=None)
@given(buf=_stream())
def test_decode_side_band_is_decode_one_record_by_record(buf: bytes) -> None:
    """The same records, times, cpus and decoder counts as ``decode_one`` of each."""
    _, idx = _index(buf)
    mv = memoryview(buf)
    rows = []
    for i in _others(idx):
        r = idx.recs[i]
        rows += [int(r.type), int(r.misc), int(r.off), int(r.size)]
    ref, got = RecordDecoder([_FMT]), RecordDecoder([_FMT])
    it = iter(rows)
    want = [ref.decode_one(t, m, mv[o + 8 : o + z])
            for t, m, o, z in zip(it, it, it, it, strict=True)]  # fmt: skip
    recs, times, cpus = got.decode_side_band(mv, rows)
    assert recs == want
    assert [type(r) for r in recs] == [type(r) for r in want]
    assert times == [r.time for r in want] and cpus == [r.cpu for r in want]
    assert got.stats == ref.stats
    again, _, _ = got.decode_side_band(mv, rows)  # file names from the decoder's memo
    assert again == want
