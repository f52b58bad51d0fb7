"""Byte-level tests of ``unwindd.source.decoder``: every record type field by field, the sample_id
trailer under every sample_type combination, format selection by id, and "decode or count an
error, never raise, never hang" under truncation, corruption and random bytes.

Records are built by ``recordbytes`` (layouts written out independently of the decoder); two
tests pin the builder itself to hand-written byte literals.
"""

from __future__ import annotations

import itertools
import struct
from collections import Counter

import pytest
import recordbytes as rb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from unwindd.source import abi
from unwindd.source.decoder import RecordDecoder
from unwindd.source.formats import EventFormat
from unwindd.source.records import (
    BadRecord,
    Comm,
    Exit,
    FinishedRound,
    Fork,
    Lost,
    LostSamples,
    Mmap,
    Mmap2,
    Record,
    Sample,
    SampleId,
    Throttle,
    Unknown,
)

# The side-band attr perf uses: TID|TIME|ID|CPU|IDENTIFIER with sample_id_all.
SB = rb.S_TID | rb.S_TIME | rb.S_ID | rb.S_CPU | rb.S_IDENTIFIER
SID = rb.Sid(pid=100, tid=101, time=123_456_789, id=7, stream_id=8, cpu=3)
REGS_MASK = abi.X86_64_REGS_MASK
NREGS = bin(REGS_MASK).count("1")
FULL = (
    rb.S_IP
    | rb.S_TID
    | rb.S_TIME
    | rb.S_CPU
    | rb.S_PERIOD
    | rb.S_CALLCHAIN
    | rb.S_REGS_USER
    | rb.S_STACK_USER
)


def decode(buf: bytes, fmt: EventFormat | None = None) -> tuple[list[Record], RecordDecoder]:
    dec = RecordDecoder([fmt or EventFormat(SB)])
    return list(dec.decode(buf)), dec


def decode_one(buf: bytes, fmt: EventFormat | None = None) -> Record:
    recs, _ = decode(buf, fmt)
    assert len(recs) == 1, recs
    return recs[0]


# --------------------------------------------------------------------------- constants


def test_builder_constants_match_abi() -> None:
    # recordbytes repeats the uapi numbers on purpose; they must agree with abi.py.
    assert (rb.MMAP, rb.LOST, rb.COMM, rb.EXIT) == (1, 2, 3, 4)
    assert rb.SAMPLE == abi.RecordType.SAMPLE and rb.MMAP2 == abi.RecordType.MMAP2
    assert rb.LOST_SAMPLES == abi.RecordType.LOST_SAMPLES
    assert rb.FINISHED_ROUND == abi.RecordType.FINISHED_ROUND
    assert rb.S_IDENTIFIER == abi.SampleType.IDENTIFIER
    assert rb.S_STACK_USER == abi.SampleType.STACK_USER
    assert rb.MISC_MMAP_BUILD_ID == abi.MISC_MMAP_BUILD_ID
    assert rb.MISC_COMM_EXEC == abi.MISC_COMM_EXEC


# --------------------------------------------------------------------------- byte literals


def test_comm_byte_literal() -> None:
    data = (
        b"\x03\x00\x00\x00"  # type = PERF_RECORD_COMM
        b"\x00\x20"  # misc = PERF_RECORD_MISC_COMM_EXEC (1 << 13)
        b"\x30\x00"  # size = 48
        b"\x2a\x00\x00\x00"  # pid = 42
        b"\x2b\x00\x00\x00"  # tid = 43
        b"bash\x00\x00\x00\x00"  # comm = "bash", NUL, padded to 8
        b"\x2a\x00\x00\x00\x2b\x00\x00\x00"  # sample_id: pid 42, tid 43
        b"\x00\x01\x00\x00\x00\x00\x00\x00"  # sample_id: time = 256
        b"\x05\x00\x00\x00\x00\x00\x00\x00"  # sample_id: id = 5
    )
    st_ = rb.S_TID | rb.S_TIME | rb.S_ID
    assert (
        rb.comm(
            pid=42,
            tid=43,
            comm="bash",
            exec=True,
            sample_type=st_,
            sid=rb.Sid(pid=42, tid=43, time=256, id=5),
        )
        == data
    )
    rec = decode_one(data, EventFormat(st_))
    assert rec == Comm(0x2000, 42, 43, "bash", SampleId(42, 43, 256, 5, None, None))
    assert isinstance(rec, Comm) and rec.exec and rec.time == 256 and rec.cpu is None


def test_sample_byte_literal() -> None:
    data = (
        b"\x09\x00\x00\x00"  # type = PERF_RECORD_SAMPLE
        b"\x02\x00"  # misc = PERF_RECORD_MISC_USER
        b"\x58\x00"  # size = 88
        b"\x00\x10\x40\x00\x00\x00\x00\x00"  # ip = 0x401000
        b"\x0a\x00\x00\x00\x0b\x00\x00\x00"  # pid = 10, tid = 11
        b"\xe8\x03\x00\x00\x00\x00\x00\x00"  # time = 1000
        b"\x02\x00\x00\x00\x00\x00\x00\x00"  # callchain nr = 2
        b"\x00\xfe\xff\xff\xff\xff\xff\xff"  # ips[0] = PERF_CONTEXT_USER (-512)
        b"\x00\x10\x40\x00\x00\x00\x00\x00"  # ips[1] = 0x401000
        b"\x10\x00\x00\x00\x00\x00\x00\x00"  # stack size = 16
        b"\x61\x62\x63\xee\xee\xee\xee\xee"  # stack data: "abc" copied, the rest is not
        b"\xee\xee\xee\xee\xee\xee\xee\xee"
        b"\x03\x00\x00\x00\x00\x00\x00\x00"  # dyn_size = 3
    )
    st_ = rb.S_IP | rb.S_TID | rb.S_TIME | rb.S_CALLCHAIN | rb.S_STACK_USER
    built = rb.sample(
        st_,
        ip=0x401000,
        pid=10,
        tid=11,
        time=1000,
        callchain=[abi.CONTEXT_USER, 0x401000],
        stack=b"abc",
        stack_size=16,
    )
    assert built == data
    rec = decode_one(data, EventFormat(st_))
    assert isinstance(rec, Sample)
    assert (rec.ip, rec.pid, rec.tid, rec.time) == (0x401000, 10, 11, 1000)
    assert rec.callchain == (abi.CONTEXT_USER, 0x401000)
    assert rec.stack == b"abc" and rec.stack_size == 16 and rec.dyn_size == 3


# --------------------------------------------------------------------------- each record type


def test_sample_all_fields() -> None:
    regs = tuple(range(0x1000, 0x1000 + NREGS))
    stack = bytes(range(200))
    buf = rb.sample(
        FULL,
        misc=rb.MISC_USER | abi.MISC_EXACT_IP,
        ip=0x7F00_0000_1234,
        pid=4242,
        tid=4243,
        time=9_000_000_000,
        cpu=5,
        period=100_003,
        callchain=[abi.CONTEXT_USER, 0x7F00_0000_1234, 0x7F00_0000_2000],
        regs=regs,
        stack=stack,
        stack_size=256,
    )
    rec = decode_one(buf, EventFormat(FULL, sample_regs_user=REGS_MASK))
    assert isinstance(rec, Sample)
    assert rec.misc == rb.MISC_USER | abi.MISC_EXACT_IP and rec.cpumode == abi.MISC_USER
    assert (rec.pid, rec.tid, rec.time, rec.cpu) == (4242, 4243, 9_000_000_000, 5)
    assert rec.ip == 0x7F00_0000_1234 and rec.period == 100_003
    assert rec.callchain == (abi.CONTEXT_USER, 0x7F00_0000_1234, 0x7F00_0000_2000)
    assert rec.regs_abi == abi.REGS_ABI_64 and rec.regs_mask == REGS_MASK and rec.regs == regs
    assert rec.stack == stack and rec.dyn_size == 200 and rec.stack_size == 256
    assert rec.id is None and rec.addr is None


def test_sample_identifier_addr_id_stream_raw() -> None:
    st_ = (
        rb.S_IDENTIFIER
        | rb.S_IP
        | rb.S_TID
        | rb.S_TIME
        | rb.S_ADDR
        | rb.S_ID
        | rb.S_STREAM_ID
        | rb.S_CPU
        | rb.S_RAW
        | rb.S_CALLCHAIN
    )
    buf = rb.sample(
        st_,
        id=77,
        ip=1,
        pid=2,
        tid=3,
        time=4,
        addr=0xDEAD,
        stream_id=99,
        cpu=7,
        raw=b"xyz",
        callchain=[0x10],
    )
    rec = decode_one(buf, EventFormat(st_))
    assert isinstance(rec, Sample)
    assert (rec.id, rec.ip, rec.pid, rec.tid, rec.time, rec.addr, rec.cpu) == (
        77,
        1,
        2,
        3,
        4,
        0xDEAD,
        7,
    )
    assert rec.callchain == (0x10,)  # CALLCHAIN precedes RAW; RAW is skipped, not modelled


@pytest.mark.parametrize(
    ("read_fmt", "values"),
    [
        (0, rb.read_format(value=5)),
        (0b111, rb.read_format(value=5, enabled=6, running=7, id=8)),
        (0b10111, rb.read_format(value=5, enabled=6, running=7, id=8, lost=9)),
        (0b1000, rb.read_format(group=[(1, None, None), (2, None, None)])),
        (0b11111, rb.read_format(enabled=6, running=7, group=[(1, 10, 0), (2, 11, 0)] * 3)),
    ],
)
def test_sample_read_is_skipped(read_fmt: int, values: list[int]) -> None:
    # READ sits between PERIOD and CALLCHAIN; a wrong skip shows up as a wrong callchain.
    st_ = rb.S_TIME | rb.S_PERIOD | rb.S_READ | rb.S_CALLCHAIN
    buf = rb.sample(st_, time=3, period=4, read=values, callchain=[0xAA, 0xBB])
    rec = decode_one(buf, EventFormat(st_, read_format=read_fmt))
    assert isinstance(rec, Sample) and rec.period == 4 and rec.callchain == (0xAA, 0xBB)


def test_sample_dyn_size_smaller_than_size() -> None:
    buf = rb.sample(FULL, regs=[0] * NREGS, stack=b"\x11" * 24, stack_size=8192)
    rec = decode_one(buf, EventFormat(FULL, sample_regs_user=REGS_MASK))
    assert isinstance(rec, Sample)
    assert rec.stack == b"\x11" * 24  # never the PAD_BYTE filler after dyn_size
    assert rec.stack_size == 8192 and rec.dyn_size == 24


def test_sample_dyn_size_zero() -> None:
    buf = rb.sample(FULL, regs=[0] * NREGS, stack=b"", stack_size=64)
    rec = decode_one(buf, EventFormat(FULL, sample_regs_user=REGS_MASK))
    assert isinstance(rec, Sample) and rec.stack == b"" and rec.stack_size == 64


def test_sample_stack_size_zero_has_no_dyn_size() -> None:
    # Kernel thread: u64 size = 0 and nothing else (perf_output_sample_ustack).
    st_ = rb.S_TID | rb.S_TIME | rb.S_REGS_USER | rb.S_STACK_USER
    buf = rb.sample(st_, pid=0, tid=0, time=5, regs_abi=0, stack_size=0)
    assert len(buf) == 8 + 8 + 8 + 8 + 8  # header, tid, time, abi, size
    rec = decode_one(buf, EventFormat(st_, sample_regs_user=REGS_MASK))
    assert isinstance(rec, Sample)
    assert rec.regs_abi == 0 and rec.regs == () and rec.stack == b"" and rec.stack_size == 0


def test_sample_regs_abi_none_then_stack() -> None:
    # abi 0: no registers follow even though the attr asks for some; the stack comes next.
    st_ = rb.S_REGS_USER | rb.S_STACK_USER | rb.S_PERIOD
    buf = rb.sample(st_, period=1, regs_abi=0, stack=b"\x01" * 8, stack_size=8)
    rec = decode_one(buf, EventFormat(st_, sample_regs_user=REGS_MASK))
    assert isinstance(rec, Sample) and rec.regs == () and rec.stack == b"\x01" * 8


def test_sample_regs_abi_32() -> None:
    st_ = rb.S_REGS_USER
    mask = 0b1011
    buf = rb.sample(st_, regs_abi=abi.REGS_ABI_32, regs=[1, 2, 3])
    rec = decode_one(buf, EventFormat(st_, sample_regs_user=mask))
    assert isinstance(rec, Sample) and rec.regs_abi == 1 and rec.regs == (1, 2, 3)
    assert abi.regs_in_mask(mask) == (0, 1, 3)


def test_mmap() -> None:
    buf = rb.mmap(
        pid=1,
        tid=2,
        addr=0x400000,
        length=0x1000,
        pgoff=0,
        filename="/bin/true",
        sample_type=SB,
        sid=SID,
    )
    rec = decode_one(buf)
    assert rec == Mmap(
        rb.MISC_USER,
        1,
        2,
        0x400000,
        0x1000,
        0,
        "/bin/true",
        SampleId(100, 101, 123_456_789, 7, None, 3),
    )
    assert isinstance(rec, Mmap) and rec.time == 123_456_789 and rec.cpu == 3


def test_mmap2_inode() -> None:
    buf = rb.mmap2_inode(
        pid=1,
        tid=1,
        addr=0x7F0000000000,
        length=0x21000,
        pgoff=0x3000,
        maj=8,
        min=1,
        ino=123456,
        ino_generation=9,
        prot=5,
        flags=2,
        filename="/usr/lib/libc.so.6",
        sample_type=SB,
        sid=SID,
    )
    rec = decode_one(buf)
    assert isinstance(rec, Mmap2)
    assert (rec.pid, rec.tid, rec.start, rec.length, rec.pgoff) == (
        1,
        1,
        0x7F0000000000,
        0x21000,
        0x3000,
    )
    assert (rec.maj, rec.min, rec.ino, rec.ino_generation) == (8, 1, 123456, 9)
    assert rec.build_id is None and (rec.prot, rec.flags) == (5, 2)
    assert rec.filename == "/usr/lib/libc.so.6" and rec.time == SID.time and rec.cpu == 3


@pytest.mark.parametrize("bid", [bytes(range(1, 21)), bytes(range(1, 17)), b"\xab" * 8, b""])
def test_mmap2_build_id(bid: bytes) -> None:
    buf = rb.mmap2_build_id(
        pid=9,
        tid=9,
        addr=0x1000,
        length=0x2000,
        pgoff=0,
        build_id=bid,
        prot=5,
        flags=2,
        filename="/x",
        sample_type=SB,
        sid=SID,
    )
    rec = decode_one(buf, EventFormat(SB, build_id_mmap=True))
    assert isinstance(rec, Mmap2)
    assert rec.build_id == bid  # exactly build_id_size bytes, not the 20-byte array
    assert rec.maj is None and rec.ino is None and rec.misc & abi.MISC_MMAP_BUILD_ID
    assert (rec.prot, rec.flags, rec.filename) == (5, 2, "/x")


@pytest.mark.parametrize("exec_", [False, True])
def test_comm(exec_: bool) -> None:
    buf = rb.comm(pid=5, tid=6, comm="a-fifteen-chars", exec=exec_, sample_type=SB, sid=SID)
    rec = decode_one(buf)
    assert isinstance(rec, Comm)
    assert (rec.pid, rec.tid, rec.comm, rec.exec) == (5, 6, "a-fifteen-chars", exec_)
    assert rec.sample_id.cpu == 3


@pytest.mark.parametrize("cls", [Fork, Exit])
def test_fork_exit(cls: type[Fork] | type[Exit]) -> None:
    build = rb.fork if cls is Fork else rb.exit
    buf = build(pid=20, ppid=10, tid=21, ptid=11, time=555, sample_type=SB, sid=SID)
    rec = decode_one(buf)
    assert type(rec) is cls
    assert (rec.pid, rec.ppid, rec.tid, rec.ptid, rec.time) == (20, 10, 21, 11, 555)
    assert rec.cpu == 3 and rec.sample_id.time == SID.time


def test_lost_and_lost_samples() -> None:
    recs, dec = decode(
        rb.lost(id=7, lost=1234, sample_type=SB, sid=SID)
        + rb.lost_samples(lost=55, sample_type=SB, sid=SID)
    )
    assert recs == [
        Lost(0, 7, 1234, SampleId(100, 101, SID.time, 7, None, 3)),
        LostSamples(0, 55, SampleId(100, 101, SID.time, 7, None, 3)),
    ]
    assert dec.stats.records == {"LOST": 1, "LOST_SAMPLES": 1}


@pytest.mark.parametrize("un", [False, True])
def test_throttle(un: bool) -> None:
    rec = decode_one(
        rb.throttle(time=77, id=7, stream_id=8, unthrottle=un, sample_type=SB, sid=SID)
    )
    assert isinstance(rec, Throttle)
    assert (rec.unthrottle, rec.time, rec.id, rec.stream_id, rec.cpu) == (un, 77, 7, 8, 3)


def test_finished_round_and_unknown() -> None:
    ks = rb.raw_record(rb.KSYMBOL, 0, b"\x01" * 16 + rb.sample_id(SB, SID))
    recs, dec = decode(rb.finished_round() + ks + rb.raw_record(200, 1, b"\x02" * 8))
    assert recs[0] == FinishedRound(0) and recs[0].time is None
    assert isinstance(recs[1], Unknown) and recs[1].payload == b"\x01" * 16
    assert recs[1].time == SID.time
    assert isinstance(recs[2], Unknown) and recs[2].type == 200 and recs[2].payload == b"\x02" * 8
    assert dec.stats.records == {"FINISHED_ROUND": 1, "KSYMBOL": 1, "TYPE_200": 1}
    assert dec.stats.error_count == 0


def test_no_sample_id_all() -> None:
    fmt = EventFormat(SB, sample_id_all=False)
    rec = decode_one(rb.comm(pid=1, tid=1, comm="x"), fmt)
    assert isinstance(rec, Comm) and rec.sample_id == SampleId() and rec.time is None


# --------------------------------------------------------------------------- sample_id trailer

_SID_BITS = (rb.S_TID, rb.S_TIME, rb.S_ID, rb.S_STREAM_ID, rb.S_CPU, rb.S_IDENTIFIER)


@pytest.mark.parametrize(
    "st_",
    [sum(c) for n in range(len(_SID_BITS) + 1) for c in itertools.combinations(_SID_BITS, n)],
)
def test_sample_id_trailer_combinations(st_: int) -> None:
    sid = rb.Sid(pid=11, tid=12, time=13, id=14, stream_id=15, cpu=16)
    fmt = EventFormat(st_ | rb.S_IP)  # IP only affects SAMPLE bodies, not the trailer
    assert fmt.sample_id_size == len(rb.sample_id(st_, sid))
    rec = decode_one(rb.comm(pid=1, tid=2, comm="c", sample_type=st_, sid=sid), fmt)
    assert isinstance(rec, Comm) and (rec.pid, rec.tid, rec.comm) == (1, 2, "c")
    s = rec.sample_id
    assert (s.pid, s.tid) == ((11, 12) if st_ & rb.S_TID else (None, None))
    assert s.time == (13 if st_ & rb.S_TIME else None)
    assert s.id == (14 if st_ & (rb.S_ID | rb.S_IDENTIFIER) else None)
    assert s.stream_id == (15 if st_ & rb.S_STREAM_ID else None)
    assert s.cpu == (16 if st_ & rb.S_CPU else None)


# --------------------------------------------------------------------------- several formats


def _two_formats(extra: int) -> tuple[EventFormat, EventFormat]:
    # Same id position (perf requires it), different layouts after it.
    a = EventFormat(extra | rb.S_IP | rb.S_TID | rb.S_TIME | rb.S_CPU | rb.S_PERIOD, name="a")
    b = EventFormat(
        extra
        | rb.S_IP
        | rb.S_TID
        | rb.S_TIME
        | rb.S_CPU
        | rb.S_CALLCHAIN
        | rb.S_REGS_USER
        | rb.S_STACK_USER,
        sample_regs_user=0b111,
        name="b",
    )
    return a, b


@pytest.mark.parametrize("idbit", [rb.S_IDENTIFIER, rb.S_ID])
def test_format_selected_by_id(idbit: int) -> None:
    a, b = _two_formats(idbit)
    assert a.id_pos == b.id_pos and a.is_pos == b.is_pos
    assert a.id_pos == (0 if idbit == rb.S_IDENTIFIER else 3)  # after IP, TID, TIME
    assert a.is_pos == (1 if idbit == rb.S_IDENTIFIER else 2)  # CPU follows ID
    dec = RecordDecoder([a, b], ids={100: 0, 200: 1})
    buf = (
        rb.sample(a.sample_type, id=100, ip=1, pid=2, tid=2, time=10, cpu=1, period=99)
        + rb.sample(
            b.sample_type,
            id=200,
            ip=3,
            pid=4,
            tid=4,
            time=11,
            cpu=0,
            callchain=[5, 6],
            regs=[7, 8, 9],
            stack=b"s" * 16,
        )
        + rb.comm(
            pid=4,
            tid=4,
            comm="b",
            sample_type=b.sample_type,
            sid=rb.Sid(pid=4, tid=4, time=12, id=200, cpu=2),
        )
    )
    ra, rb_, rc = list(dec.decode(buf))
    assert isinstance(ra, Sample) and ra.id == 100 and ra.period == 99 and ra.callchain == ()
    assert isinstance(rb_, Sample) and rb_.id == 200 and rb_.period is None
    assert rb_.callchain == (5, 6) and rb_.regs == (7, 8, 9) and rb_.stack == b"s" * 16
    assert isinstance(rc, Comm) and rc.sample_id.id == 200 and rc.sample_id.cpu == 2
    assert rc.time == 12
    assert dec.stats.error_count == 0


def test_unknown_id_falls_back_to_first_format() -> None:
    a, b = _two_formats(rb.S_IDENTIFIER)
    dec = RecordDecoder([a, b], ids={100: 0, 200: 1})
    rec = next(dec.decode(rb.sample(a.sample_type, id=999, period=5)))
    assert isinstance(rec, Sample) and rec.id == 999 and rec.period == 5


def test_no_formats_is_a_usage_error() -> None:
    with pytest.raises(ValueError):
        RecordDecoder([])


# --------------------------------------------------------------------------- errors


def _valid_stream() -> tuple[bytes, EventFormat]:
    fmt = EventFormat(FULL | rb.S_ID, sample_regs_user=0b111, build_id_mmap=True)
    st_ = fmt.sample_type
    sid = rb.Sid(pid=1, tid=1, time=50, id=3, cpu=1)
    parts = [
        rb.comm(pid=1, tid=1, comm="prog", exec=True, sample_type=st_, sid=sid),
        rb.mmap2_build_id(
            pid=1,
            tid=1,
            addr=0x1000,
            length=0x1000,
            pgoff=0,
            build_id=b"\x01" * 20,
            prot=5,
            flags=2,
            filename="/p",
            sample_type=st_,
            sid=sid,
        ),
        rb.sample(
            st_,
            ip=0x1010,
            pid=1,
            tid=1,
            time=60,
            cpu=1,
            id=3,
            period=1,
            callchain=[abi.CONTEXT_USER, 0x1010],
            regs=[1, 2, 3],
            stack=b"\x55" * 40,
            stack_size=64,
        ),
        rb.finished_round(),
        rb.fork(pid=2, ppid=1, tid=2, ptid=1, time=70, sample_type=st_, sid=sid),
        rb.lost(id=3, lost=9, sample_type=st_, sid=sid),
        rb.exit(pid=2, ppid=1, tid=2, ptid=1, time=80, sample_type=st_, sid=sid),
    ]
    return b"".join(parts), fmt


def _boundaries(buf: bytes) -> list[int]:
    out, off = [0], 0
    while off < len(buf):
        off += struct.unpack_from("<H", buf, off + 6)[0]
        out.append(off)
    return out


def test_every_truncation_is_counted_never_raises() -> None:
    buf, fmt = _valid_stream()
    full, dec = decode(buf, fmt)
    assert dec.stats.error_count == 0 and len(full) == 7
    bounds = _boundaries(buf)
    for cut in range(len(buf)):
        dec = RecordDecoder([fmt])
        recs = list(dec.decode(buf[:cut]))
        whole = sum(1 for b in bounds[1:] if b <= cut)
        assert recs == full[:whole], cut  # records before the cut are intact
        if cut in bounds:
            assert dec.stats.error_count == 0
        else:
            assert dec.stats.error_count == 1 and dec.stats.errors["truncated"] == 1


def test_size_zero_header_stops_without_hanging() -> None:
    good = rb.lost_samples(lost=1)
    recs, dec = decode(good + rb.header(rb.SAMPLE, 0, 0) + good, EventFormat(0))
    assert recs == [LostSamples(0, 1, SampleId())]
    assert dec.stats.errors == {"bad_size": 1}


def test_size_below_header_size() -> None:
    recs, dec = decode(rb.header(rb.COMM, 0, 4) + b"\0" * 8)
    assert recs == [] and dec.stats.errors == {"bad_size": 1}


def test_size_past_end() -> None:
    body = rb.comm(pid=1, tid=1, comm="x", sample_type=SB, sid=SID)[8:]
    recs, dec = decode(rb.raw_record(rb.COMM, 0, body, size=8 + len(body) + 8))
    assert recs == [] and dec.stats.errors == {"truncated": 1}


def _bad(buf: bytes, fmt: EventFormat, reason: str) -> None:
    recs, dec = decode(buf + rb.finished_round(), fmt)
    assert len(recs) == 2 and recs[1] == FinishedRound(0), recs  # decoding goes on
    bad = recs[0]
    assert isinstance(bad, BadRecord) and bad.reason == reason and bad.size == len(buf)
    assert bad.time is None and bad.cpu is None
    assert dec.stats.errors == {reason: 1}


def test_bad_dyn_size() -> None:
    fmt = EventFormat(FULL, sample_regs_user=REGS_MASK)
    _bad(
        rb.sample(FULL, regs=[0] * NREGS, stack=b"\0" * 16, stack_size=16, dyn_size=17),
        fmt,
        "bad_dyn_size",
    )


def test_bad_stack_size() -> None:
    fmt = EventFormat(FULL, sample_regs_user=REGS_MASK)
    buf = rb.sample(FULL, regs=[0] * NREGS, stack=b"\0" * 16, stack_size=16)
    # Claim a 1 MiB dump in a 16-byte record: the size field is 16 bytes before the end.
    buf = buf[:-32] + rb.u64(1 << 20) + buf[-24:]
    _bad(buf, fmt, "bad_stack_size")


@pytest.mark.parametrize("nr", [3, 1 << 20, (1 << 64) - 1])
def test_bad_callchain_nr(nr: int) -> None:
    fmt = EventFormat(rb.S_TIME | rb.S_CALLCHAIN)
    _bad(
        rb.sample(fmt.sample_type, time=1, callchain=[1, 2], callchain_nr=nr),
        fmt,
        "bad_callchain_nr",
    )


def test_build_id_size_over_20_is_inode_data_under_a_leaked_flag() -> None:
    # No build-id is longer than 20 bytes (BUILD_ID_SIZE_MAX): a "size" of 21 under the flag is
    # the low byte of an inode-form maj, even for an event that asked for build-ids.
    buf = rb.mmap2_build_id(
        pid=1,
        tid=1,
        addr=0,
        length=1,
        pgoff=0,
        build_id=b"\1" * 20,
        build_id_size=21,
        prot=0,
        flags=0,
        filename="f",
        sample_type=SB,
        sid=SID,
    )
    recs, dec = decode(buf, EventFormat(SB, build_id_mmap=True))
    (rec,) = recs
    assert isinstance(rec, Mmap2) and rec.build_id is None and rec.maj == 21
    assert dec.stats.repairs["mmap2_leaked_build_id_flag"] == 1 and not dec.stats.errors


@pytest.mark.parametrize("build_id_mmap", [False, True])
def test_mmap2_leaked_build_id_flag_is_read_as_inode(build_id_mmap: bool) -> None:
    # What this machine's kernel really wrote for `perf record` (no attr.build_id) while
    # another tool held a build-id event: misc 0x4002 over inode data (maj 0xfe).
    buf = rb.mmap2_inode(
        pid=4694,
        tid=4694,
        addr=0x56080B509000,
        length=0x1000,
        pgoff=0x2000,
        maj=0xFE,
        min=0,
        ino=0x3F808,
        ino_generation=0,
        prot=5,
        flags=2,
        filename="/usr/bin/bash",
        misc=rb.MISC_USER | abi.MISC_MMAP_BUILD_ID,
        sample_type=SB,
        sid=SID,
    )
    recs, dec = decode(buf, EventFormat(SB, build_id_mmap=build_id_mmap))
    (rec,) = recs
    assert isinstance(rec, Mmap2) and not rec.misc & abi.MISC_MMAP_BUILD_ID
    assert (rec.maj, rec.min, rec.ino, rec.build_id) == (0xFE, 0, 0x3F808, None)
    assert rec.filename == "/usr/bin/bash"
    assert dec.stats.repairs == {"mmap2_leaked_build_id_flag": 1} and not dec.stats.errors


def test_short_bodies() -> None:
    fmt = EventFormat(SB)
    trailer = rb.sample_id(SB, SID)
    for rtype in (
        rb.MMAP,
        rb.MMAP2,
        rb.COMM,
        rb.FORK,
        rb.EXIT,
        rb.LOST,
        rb.LOST_SAMPLES,
        rb.THROTTLE,
        rb.UNTHROTTLE,
    ):
        _bad(rb.raw_record(rtype, 0, trailer), fmt, "short_body")
    _bad(rb.raw_record(rb.COMM, 0, b"\0" * 8), fmt, "short_sample_id")
    _bad(rb.raw_record(rb.SAMPLE, 0, b"\0" * 8), EventFormat(rb.S_IP | rb.S_TIME), "short_body")


# --------------------------------------------------------------------------- properties


def _frames(buf: bytes) -> tuple[list[tuple[int, int]], str]:
    """(offset, size) of every whole record of ``buf``, framed by ``header.size`` alone, and how
    the buffer ends: "" on a record boundary, "truncated" when a header or the body its size
    announces is cut off, "bad_size" at a size below the 8-byte header (decoder.py: no way to
    resynchronise after either). The framing of perf_event.h written out here, so the
    decoder's framing is checked against it rather than against itself."""
    out: list[tuple[int, int]] = []
    off = 0
    while off < len(buf):
        if len(buf) - off < 8:
            return out, "truncated"
        (size,) = struct.unpack_from("<H", buf, off + 6)  # perf_event_header.size
        if size < 8:
            return out, "bad_size"
        if off + size > len(buf):
            return out, "truncated"
        out.append((off, size))
        off += size
    return out, ""


def _check_decodes(
    buf: bytes,
    fmts: list[EventFormat],
    ids: dict[int, int],
    framing: tuple[list[tuple[int, int]], str] | None = None,
) -> None:
    """Decode ``buf`` and check it against ``framing`` (the whole records and how the buffer
    ends: the caller's when it built the records, else ``_frames``)."""
    frames, end = framing or _frames(buf)
    dec = RecordDecoder(fmts, ids)
    recs = list(dec.decode(buf))  # must not raise
    # One value per whole record, each the decoding of exactly its own bytes [off, off + size)
    # of the input: a decoder that yields a cut record, drops one, or reads past a record's end
    # gives a different list. (decode_one is the body decoder under test elsewhere; here it only
    # pins which bytes each value came from.)
    ref = RecordDecoder(fmts, ids)
    mv = memoryview(buf)
    want = []
    for off, size in frames:
        rtype, misc = struct.unpack_from("<IH", buf, off)  # perf_event_header.type, .misc
        want.append(ref.decode_one(rtype, misc, mv[off + 8 : off + size]))
    assert recs == want
    # The bodies' own errors, plus exactly one for a cut or broken tail, none on a boundary.
    tail: Counter[str] = Counter({end: 1} if end else {})
    assert dec.stats.errors == ref.stats.errors + tail, (frames, end)
    assert dec.stats.records == ref.stats.records
    assert dec.stats.repairs == ref.stats.repairs
    # decode_quiet (the file replay's one decode of a MMAP2 whose counts it took in bulk) gives
    # decode_one's value for any record, and counts nothing
    quiet = RecordDecoder(fmts, ids)
    for (off, size), rec in zip(frames, want, strict=True):
        rtype, misc = struct.unpack_from("<IH", buf, off)
        assert quiet.decode_quiet(rtype, misc, mv[off + 8 : off + size]) == rec
    assert not quiet.stats.records and not quiet.stats.errors and not quiet.stats.repairs


_FMTS = [
    EventFormat(SB),
    EventFormat(FULL | rb.S_ID, sample_regs_user=0b111),
    EventFormat(FULL | rb.S_IDENTIFIER | rb.S_RAW | rb.S_ADDR, sample_regs_user=REGS_MASK),
]


@settings(max_examples=300, deadline=None)
@given(buf=st.binary(max_size=512), fi=st.integers(0, len(_FMTS) - 1))
def test_any_bytes_decode_or_count(buf: bytes, fi: int) -> None:
    _check_decodes(buf, [_FMTS[fi]], {})


@st.composite
def _headed_records(draw: st.DrawFn) -> tuple[bytes, list[tuple[int, int]], str]:
    """Random bodies behind plausible headers, so decoding reaches the per-type code; half the
    time cut at a random byte. Returns the bytes, the whole records (offset, size) before the
    cut and the tail error the cut must count, both from where the cut falls among the records
    built here."""
    out = b""
    bounds = [0]
    for _ in range(draw(st.integers(1, 6))):
        rtype = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 9, 10, 13, 17, 68, 70]))
        misc = draw(st.sampled_from([0, 2, rb.MISC_MMAP_BUILD_ID, rb.MISC_COMM_EXEC, 0xFFFF]))
        body = draw(st.binary(max_size=160))
        body += b"\0" * (-len(body) % 8)
        out += rb.raw_record(rtype, misc, body)
        bounds.append(len(out))
    cut = draw(st.one_of(st.just(len(out)), st.integers(0, len(out))))
    whole = [(a, b - a) for a, b in itertools.pairwise(bounds) if b <= cut]
    # inside a record (its header or its body): one truncation; on a boundary: none
    return out[:cut], whole, "" if cut in bounds else "truncated"


@settings(max_examples=300, deadline=None)
@given(built=_headed_records(), fi=st.integers(0, len(_FMTS) - 1))
def test_headed_random_bodies_decode_or_count(
    built: tuple[bytes, list[tuple[int, int]], str], fi: int
) -> None:
    buf, whole, end = built
    assert _frames(buf) == (whole, end)  # the oracle the other two properties use agrees
    _check_decodes(buf, [_FMTS[fi]], {}, (whole, end))


@st.composite
def _mutated_stream(draw: st.DrawFn) -> bytes:
    buf = bytearray(_valid_stream()[0])
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["flip", "set", "u64", "cut", "dup"]))
        pos = draw(st.integers(0, len(buf) - 1))
        if kind == "flip":
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            buf[pos] = draw(st.integers(0, 255))
        elif kind == "u64" and pos + 8 <= len(buf):
            v = draw(st.sampled_from([0, 1, 20, 21, 255, 1 << 16, (1 << 63), (1 << 64) - 1]))
            buf[pos : pos + 8] = struct.pack("<Q", v)
        elif kind == "cut":
            del buf[pos:]
        elif kind == "dup":
            end = draw(st.integers(pos, len(buf)))
            buf[pos:pos] = buf[pos:end]
        if not buf:
            break
    return bytes(buf)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(buf=_mutated_stream(), multi=st.booleans())
def test_mutated_valid_streams_decode_or_count(buf: bytes, multi: bool) -> None:
    fmt = _valid_stream()[1]
    if multi:
        other = EventFormat(fmt.sample_type, sample_regs_user=REGS_MASK)
        _check_decodes(buf, [fmt, other], {3: 0, 4: 1, 0: 1})
    else:
        _check_decodes(buf, [fmt], {})


# --------------------------------------------------------------------------- unw_sb_lazy


@st.composite
def _mmap2_heavy(draw: st.DrawFn) -> bytes:
    """MMAP2 records, well formed or not (random bodies, cut fixed parts, the build-id flag),
    among other side-band records: what sideband.c's ``unw_sb_lazy`` sorts."""
    st_ = _valid_stream()[1].sample_type
    out = b""
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["good", "random", "other"]))
        misc = draw(st.sampled_from([0, 2, rb.MISC_MMAP_BUILD_ID, 0xFFFF]))
        if kind == "good":
            sid = rb.Sid(pid=draw(st.integers(0, 9)), tid=1, time=draw(st.integers(0, 1 << 40)),
                         id=3, cpu=draw(st.integers(0, 3)))  # fmt: skip
            out += rb.mmap2_inode(pid=sid.pid or 0, tid=1, addr=draw(st.integers(0, 1 << 47)),
                                  length=draw(st.integers(0, 1 << 20)), pgoff=0, maj=8, min=1,
                                  ino=9, ino_generation=0, prot=draw(st.integers(0, 7)), flags=2,
                                  filename=draw(st.text(max_size=12)), misc=misc,
                                  sample_type=st_, sid=sid)  # fmt: skip
        else:
            rtype = 10 if kind == "random" else draw(st.sampled_from([3, 4, 7, 9]))
            body = draw(st.binary(max_size=120))
            out += rb.raw_record(rtype, misc, body + b"\0" * (-len(body) % 8))
    return out


@settings(max_examples=300, deadline=None)
@given(buf=_mmap2_heavy())
def test_sb_lazy_lists_exactly_the_mmap2s_that_decode_cleanly(buf: bytes) -> None:
    """``unw_sb_lazy`` lists a MMAP2 iff decode_one decodes it without an error or a repair
    and it is not build-id flagged, and marks its index entry as record_marks would; every
    other record stays in ``idx``, in order."""
    from unwindd.pipeline.context import HAS_CPU, TIMED, record_marks
    from unwindd.source.mapfile import RecordIndex, layout_of
    from unwindd.unwcore import ffi, lib

    fmt = _valid_stream()[1]
    data = ffi.from_buffer(buf)
    idx = RecordIndex(layout_of(fmt), data, len(buf))
    others = ffi.new("uint32_t[]", max(1, idx.n))
    nother = int(lib.fp_select_other(idx.recs, idx.n, others))
    before = list(others[0:nother])
    dec = RecordDecoder([fmt])
    trailer = dec.sample_id_trailer()
    assert trailer is not None
    lazy, nrest = ffi.new("uint32_t[]", max(1, nother)), ffi.new("uint64_t *")
    k = lib.unw_sb_lazy(data, len(buf), idx.recs, others, nother, *trailer, lazy, nrest)
    listed = list(lazy[0:k])
    assert list(others[0 : nrest[0]]) == [i for i in before if i not in set(listed)]
    assert listed == [i for i in before if i in set(listed)]  # in drain order
    mv = memoryview(buf)
    for i in before:
        r = idx.recs[i]
        one = RecordDecoder([fmt])
        rec = one.decode_one(r.type, r.misc, mv[r.off + 8 : r.off + r.size])
        clean = (type(rec) is Mmap2 and not r.misc & rb.MISC_MMAP_BUILD_ID
                 and not one.stats.errors and not one.stats.repairs)  # fmt: skip
        assert (i in listed) == clean, rec
        if clean:
            t, cpu, flags = record_marks(rec)
            assert r.flags == flags
            assert (r.time if flags & TIMED else 0) == t
            assert (r.cpu if flags & HAS_CPU else 0) == cpu
