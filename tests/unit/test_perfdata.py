"""perf.data reader: differential tests against the real perf, byte-literal units, fuzzing.

Layers:
- Real recordings (file mode, pipe mode into a file, and a live ``perf record -o - |`` pipe),
  one of each per module, checked against ``perf script``, ``perf report --stats``,
  ``perf buildid-list`` and ``perf report --header-only`` on the same bytes.
- Byte-literal headers and streams with commented fields for the paths perf never writes
  (absurd offsets, AUXTRACE payloads, compressed records, size-0 records).
- Truncation at many cut points and Hypothesis properties: any bytes give ``PerfDataError`` or
  records plus counted errors; never another exception, never a hang. The properties check
  the records against perf's framing written out here (``_frames``): one value per whole
  record, from its own bytes, and the end of the records counted exactly (one truncation for
  a cut inside a record, none on a boundary).
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from perfutil import (
    build_busy,
    live_perf_pipe,
    perf_buildids,
    perf_header,
    perf_script_pid_tid_time,
    perf_script_samples,
    perf_stats,
    record_perf_data,
)
from unwindd.source import perfdata, perfheader, records
from unwindd.source.abi import RecordType
from unwindd.source.decoder import RecordDecoder
from unwindd.source.perfdata import PerfData
from unwindd.source.perfheader import AttrInfo, Feature, PerfDataError

STACK = 8192
WORKLOAD_SECS = "0.25"

# --------------------------------------------------------------------------- fixtures


@dataclass
class Reading:
    mode: str
    path: Path  # the exact bytes the reader saw
    pd: PerfData
    recs: list[records.Record]

    @property
    def samples(self) -> list[records.Sample]:
        return [r for r in self.recs if isinstance(r, records.Sample)]


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_busy(tmp_path_factory.mktemp("busy"))


def _read_all(pd: PerfData) -> list[records.Record]:
    return list(pd.records())


def _make_reading(mode: str, busy: Path, tmp: Path) -> Reading:
    argv = [str(busy), WORKLOAD_SECS]
    if mode == "live":
        path = tmp / "live.data"
        with live_perf_pipe(path, argv, stack=STACK) as stream:
            pd = PerfData.open(stream)
            recs = _read_all(pd)
    else:
        path = record_perf_data(tmp, argv, pipe=mode == "pipe", stack=STACK)
        pd = PerfData.open(path)
        recs = _read_all(pd)
    return Reading(mode, path, pd, recs)


@pytest.fixture(scope="module")
def file_rec(busy: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reading]:
    r = _make_reading("file", busy, tmp_path_factory.mktemp("file"))
    yield r
    r.pd.close()


@pytest.fixture(scope="module")
def pipe_rec(busy: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reading]:
    r = _make_reading("pipe", busy, tmp_path_factory.mktemp("pipe"))
    yield r
    r.pd.close()


@pytest.fixture(scope="module")
def live_rec(busy: Path, tmp_path_factory: pytest.TempPathFactory) -> Reading:
    return _make_reading("live", busy, tmp_path_factory.mktemp("live"))


@pytest.fixture(scope="module", params=["file", "pipe", "live"])
def reading(request: pytest.FixtureRequest) -> Reading:
    """One recording per mode and module: file (-o F), pipe (-o - > F), live (-o - |)."""
    r: Reading = request.getfixturevalue(f"{request.param}_rec")
    return r


@pytest.fixture(scope="module", params=["file", "pipe"])
def stored(request: pytest.FixtureRequest) -> Reading:
    r: Reading = request.getfixturevalue(f"{request.param}_rec")
    return r


# --------------------------------------------------------------------------- vs perf


def test_mode_detected(reading: Reading) -> None:
    assert reading.pd.pipe_mode == (reading.mode != "file")
    assert not reading.pd.errors, reading.pd.errors
    assert not reading.pd.decoder.stats.errors, reading.pd.decoder.stats.errors
    assert not any(isinstance(r, records.BadRecord) for r in reading.recs)


def test_samples_per_pid_match_perf_script(reading: Reading) -> None:
    ours = Counter(s.pid for s in reading.samples)
    theirs = perf_script_samples(reading.path)
    assert ours == theirs
    assert len(theirs) >= 2, "the workload forks: expected samples from two pids at least"


def test_sample_pid_tid_time_match_perf_script(reading: Reading) -> None:
    ours = Counter((s.pid, s.tid, s.time) for s in reading.samples)
    assert ours == perf_script_pid_tid_time(reading.path)


def _perf_name(rec: records.Record) -> str:
    # perf_event__name() drops the HEADER_ prefix of perf's user types (ATTR, FEATURE, ...)
    return records.record_type_name(rec).removeprefix("HEADER_")


def test_record_counts_match_perf_report_stats(reading: Reading) -> None:
    ours = Counter(_perf_name(r) for r in reading.recs)
    theirs = perf_stats(reading.path)
    for name in ("SAMPLE", "MMAP", "MMAP2", "COMM", "FORK", "EXIT", "FINISHED_ROUND", "LOST"):
        assert ours.get(name, 0) == theirs.get(name, 0), name
    # and every other type perf counts, user types included (ATTR, FEATURE, ID_INDEX ...)
    assert {k: v for k, v in theirs.items() if k != "TOTAL"} == dict(ours)
    assert theirs["TOTAL"] == len(reading.recs)
    assert reading.pd.decoder.stats.records == Counter(
        records.record_type_name(r) for r in reading.recs
    )


def test_samples_carry_regs_and_stack(reading: Reading) -> None:
    (attr,) = reading.pd.attrs
    nregs = bin(attr.fmt.sample_regs_user).count("1")
    assert nregs > 0 and attr.sample_stack_user == STACK
    samples = reading.samples
    assert samples
    for s in samples:
        assert s.regs_abi == 2  # PERF_SAMPLE_REGS_ABI_64
        assert len(s.regs) == nregs
        assert s.stack_size == STACK
        assert 0 <= s.dyn_size <= STACK
    # user code was running for nearly all of them: the stack copies are real
    assert sum(s.dyn_size > 0 for s in samples) > 0.9 * len(samples)


def test_attrs_match_header(reading: Reading) -> None:
    hdr = perf_header(reading.path)
    (attr,) = reading.pd.attrs
    assert isinstance(attr, AttrInfo)
    # "# event : name = cpu-clock, , id = { 19, 20 }, type = 1, size = 128, ..."
    event = hdr["event"]
    assert event.startswith(f"name = {attr.name},")
    assert attr.name == attr.fmt.name == "cpu-clock"
    ids = event.split("id = {", 1)[1].split("}", 1)[0]
    assert attr.ids == tuple(int(x) for x in ids.split(","))
    assert f"type = {attr.type}," in event
    assert "sample_id_all = 1" in event and attr.fmt.sample_id_all
    assert f"sample_regs_user = {attr.fmt.sample_regs_user:#x}" in event
    assert f"sample_stack_user = {attr.sample_stack_user}" in event


def test_header_strings_match_header(reading: Reading) -> None:
    hdr = perf_header(reading.path)
    pd = reading.pd
    assert pd.arch == hdr["arch"] == os.uname().machine
    assert pd.hostname == hdr["hostname"]
    assert pd.osrelease == hdr["os release"]
    assert pd.perf_version == hdr["perf version"]
    assert pd.nr_cpus_online == int(hdr["nrcpus online"])
    assert pd.nr_cpus_avail == int(hdr["nrcpus avail"])
    assert pd.cmdline is not None and " ".join(pd.cmdline) == hdr["cmdline"]
    assert Feature.ARCH in pd.features and Feature.EVENT_DESC in pd.features


def test_build_ids_match_buildid_list(reading: Reading) -> None:
    ours = {(b.build_id.hex(), b.filename) for b in reading.pd.build_ids}
    theirs = perf_buildids(reading.path)
    # pipe mode: perf record writes no build-ids into a pipe, and buildid-list prints the hit
    # DSOs with an empty id; the ones it does know must be exactly ours.
    assert ours == {(h, f) for h, f in theirs if h}
    if reading.mode == "file":
        assert any(f.endswith("/busy") for _, f in ours)
        assert all(len(b.build_id) == 20 for b in reading.pd.build_ids)


def test_file_mode_rereads_and_small_chunks(
    reading: Reading, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk boundaries fall inside records (odd chunk size), and a reader that returns
    one byte at a time (a raw pipe) gives the same records."""
    want = reading.recs
    monkeypatch.setattr(perfdata, "CHUNK", 4099)
    with PerfData.open(reading.path) as pd:
        assert list(pd.records()) == want
        if not pd.pipe_mode:
            assert list(pd.records()) == want  # file mode can read again
        else:
            with pytest.raises(PerfDataError):
                list(pd.records())
    if reading.mode == "pipe":
        data = reading.path.read_bytes()
        with PerfData.open(cast(IO[bytes], _Trickle(data[:100_000]))) as pd:
            got = list(pd.records())
        assert got == want[: len(got)] and len(got) > 10
        assert pd.decoder.stats.errors["truncated"] == 1


def test_stdin_dash_reads_pipe_mode(pipe_rec: Reading) -> None:
    reading = pipe_rec
    code = (
        "from collections import Counter\n"
        "from unwindd.source.perfdata import PerfData\n"
        "pd = PerfData.open('-')\n"
        "print(pd.pipe_mode, sum(1 for r in pd.records() if type(r).__name__ == 'Sample'))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(perfdata.__file__).parents[2]))
    with reading.path.open("rb") as f:
        out = subprocess.run(
            [sys.executable, "-c", code], stdin=f, capture_output=True, text=True, env=env,
            check=True,
        )  # fmt: skip
    assert out.stdout.split() == ["True", str(len(reading.samples))]


# --------------------------------------------------------------------------- streams


class _Trickle(io.RawIOBase):
    """A non-seekable raw stream that returns at most 1 byte per read (no read1)."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        if self._pos >= len(self._data) or len(b) == 0:
            return 0
        b[0] = self._data[self._pos]
        self._pos += 1
        return 1


class _NoSeek(io.BytesIO):
    def seekable(self) -> bool:
        return False


def _drain(data: bytes) -> tuple[PerfData | None, list[records.Record]]:
    """Open and read everything; (None, []) if the header was refused with PerfDataError.
    Checks the termination bound: at most one record per 8 bytes of input."""
    try:
        pd = PerfData.open(io.BytesIO(data))
    except PerfDataError as e:
        assert str(e)
        return None, []
    recs = list(pd.records())
    assert len(recs) <= len(data) // 8
    return pd, recs


def _boundaries(data: bytes, start: int, end: int) -> set[int]:
    """Record start offsets of a known-good stream, walked by header sizes."""
    out = set()
    off = start
    while off < end:
        out.add(off)
        off += struct.unpack_from("<IHH", data, off)[2]
    out.add(off)
    return out


def _reading_bytes(reading: Reading) -> bytes:
    return reading.path.read_bytes()


# --------------------------------------------------------------------------- byte literals


def _attr(sample_type: int, *, regs: int = 0, flags: int = 1 << 18, size: int = 136) -> bytes:
    """perf_event_attr, VER8 (136 bytes): type, size, config, period, sample_type,
    read_format, flags (bit 18 = sample_id_all), ..., sample_regs_user at 80."""
    b = bytearray(size)
    struct.pack_into("<IIQQQQQ", b, 0, 1, size, 0, 999, sample_type, 0, flags)
    struct.pack_into("<Q", b, 80, regs)
    return bytes(b)


def _file(
    *,
    attr_size: int = 136 + 16,
    attrs: tuple[int, int] | None = None,
    data: tuple[int, int] | None = None,
    features: int = 0,
    body: bytes = b"",
) -> bytes:
    """A perf_file_header (104 bytes) + one attr entry + ``body`` as data section.

    Layout: [0,104) header | [104,112) ids: u64 7 | [112,264) attr + its ids section |
    [264, 264+len(body)) data | feature table."""
    attr_entry = _attr(0x7) + struct.pack("<QQ", 104, 8)  # ids section -> one id at 104
    attrs = attrs or (112, len(attr_entry))
    data = data or (112 + len(attr_entry), len(body))
    hdr = struct.pack(
        "<8sQQQQQQQQ",
        b"PERFILE2",   # magic
        104,           # size of this header
        attr_size,     # sizeof(struct perf_file_attr)
        *attrs,        # attrs section
        *data,         # data section
        0, 0,          # event_types (unused)
    ) + features.to_bytes(32, "little")  # fmt: skip
    return hdr + struct.pack("<Q", 7) + attr_entry + body


def _rec(rtype: int, body: bytes, misc: int = 0) -> bytes:
    return struct.pack("<IHH", rtype, misc, 8 + len(body)) + body


def test_minimal_file_literal() -> None:
    # SAMPLE with IP|TID|TIME: ip, pid/tid, time
    sample = _rec(9, struct.pack("<QIIQ", 0x401000, 10, 11, 12345), misc=2)
    pd, recs = _drain(_file(body=sample + _rec(68, b"")))
    assert pd is not None and not pd.pipe_mode
    assert pd.attrs[0].ids == (7,) and pd.attrs[0].fmt.sample_type == 0x7
    assert [type(r) for r in recs] == [records.Sample, records.FinishedRound]
    s = recs[0]
    assert isinstance(s, records.Sample) and (s.ip, s.pid, s.tid, s.time) == (0x401000, 10, 11,
                                                                             12345)  # fmt: skip
    assert not pd.errors and not pd.decoder.stats.errors


def test_feature_sections_literal() -> None:
    arch = struct.pack("<I", 8) + b"x86_64\0\0"  # perf string: u32 len, NUL-padded chars
    bid = (
        struct.pack("<IHH", 0, 2 | 1 << 15, 36 + 8)  # type 0, misc user|BUILD_ID_SIZE, size
        + struct.pack("<i", -1)  # pid
        + bytes(range(1, 21)) + bytes([20, 0, 0, 0])  # data[20], size = 20, reserved
        + b"/bin/x\0\0"  # filename, padded
    )  # fmt: skip
    # bits: BUILD_ID (2), ARCH (6), 100 (unknown); sections in bit order after the data
    feats = 1 << 2 | 1 << 6 | 1 << 100
    base = _file(features=feats)
    table_end = len(base) + 3 * 16
    table = struct.pack(
        "<QQQQQQ",
        table_end, len(bid),
        table_end + len(bid), len(arch),
        table_end + len(bid) + len(arch), 3,
    )  # fmt: skip
    pd, _ = _drain(base + table + bid + arch + b"abc")
    assert pd is not None and not pd.errors
    assert pd.arch == "x86_64"
    assert pd.build_ids == [perfheader.BuildIdEntry(-1, bytes(range(1, 21)), "/bin/x", 2 | 1 << 15)]
    assert pd.features[100] == b"abc"
    # a corrupt build-id section (size field past its end) is counted, the rest still parses
    bad = bytearray(bid)
    bad[6:8] = struct.pack("<H", 200)
    pd, _ = _drain(base + table + bytes(bad) + arch + b"abc")
    assert pd is not None and pd.errors == Counter({"feature_build_id_corrupt": 1})
    assert pd.arch == "x86_64" and pd.build_ids == []


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "only 0 bytes"),
        (b"PERFILE2", "only 8 bytes"),
        (b"2ELIFREP" + struct.pack(">Q", 104) + bytes(88), "byte order"),
        (b"PERFFILE" + bytes(96), "version 1"),
        (b"NOTPERF!" + bytes(96), "magic"),
        (b"PERFILE2" + struct.pack("<Q", 12345) + bytes(88), "header size"),
        (b"PERFILE2" + struct.pack("<Q", 104) + bytes(40), "header truncated"),
    ],
)
def test_bad_main_header_raises(data: bytes, message: str) -> None:
    with pytest.raises(PerfDataError, match=message):
        PerfData.open(io.BytesIO(data))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"attr_size": 1 << 40}, "attr_size"),
        ({"attr_size": 8}, "attr_size"),
        ({"attrs": (1 << 63, 152)}, "attrs section"),
        ({"attrs": (112, 1 << 62)}, "attrs section"),
        ({"attrs": (112, 0)}, "no event attrs"),
    ],
)
def test_absurd_attrs_raise(kw: dict[str, object], message: str) -> None:
    with pytest.raises(PerfDataError, match=message):
        PerfData.open(io.BytesIO(_file(**kw)))  # type: ignore[arg-type]


def test_absurd_data_and_features_are_counted() -> None:
    body = _rec(68, b"")
    pd, _ = _drain(_file(data=(264, 1 << 62), features=(1 << 256) - 1, body=body))
    assert pd is not None
    assert pd.errors["data_section_truncated"] == 1
    assert pd.errors["feature_table_truncated"] == 1
    pd, recs = _drain(_file(data=(1 << 62, 1 << 62), body=body))
    assert pd is not None and pd.errors["data_section_truncated"] == 1
    assert recs == []


def test_file_mode_needs_seekable_stream() -> None:
    with pytest.raises(PerfDataError, match="seekable"):
        PerfData.open(_NoSeek(_file(body=_rec(68, b""))))


_PIPE = b"PERFILE2" + struct.pack("<Q", 16)


def test_pipe_literal_attr_feature_auxtrace_compressed() -> None:
    attr = _rec(64, _attr(0x7 | 0x40) + struct.pack("<QQ", 5, 6))  # HEADER_ATTR + ids 5, 6
    feat = _rec(80, struct.pack("<Q", 6) + struct.pack("<I", 8) + b"aarch64\0")  # ARCH
    end = _rec(80, struct.pack("<Q", 32))  # HEADER_LAST_FEATURE marker, no data
    # AUXTRACE: header; u64 size = 13; offset, reference; u32 idx, tid, cpu, reserved;
    # then 13 payload bytes outside header.size
    aux = _rec(71, struct.pack("<QQQIIII", 13, 0, 0, 0, 0, 0, 0)) + b"P" * 13
    comp = _rec(81, b"\x28\xb5\x2f\xfd" + bytes(4))  # zstd frame magic
    sample = _rec(9, struct.pack("<QIIQQ", 0x1000, 1, 2, 3, 6))  # IP, TID, TIME, ID=6
    stream = _PIPE + attr + feat + end + aux + comp + sample + _rec(68, b"")
    pd = PerfData.open(_NoSeek(stream))
    assert pd.pipe_mode and pd.attrs == []  # attrs arrive with the records
    recs = list(pd.records())
    assert [records.record_type_name(r) for r in recs] == [
        "HEADER_ATTR", "HEADER_FEATURE", "HEADER_FEATURE", "AUXTRACE", "COMPRESSED", "SAMPLE",
        "FINISHED_ROUND",
    ]  # fmt: skip
    assert pd.attrs[0].ids == (5, 6) and pd.arch == "aarch64"
    assert set(pd.features) == {Feature.ARCH}
    assert pd.errors == Counter({"compressed_unsupported": 1})
    assert "zstd" in perfdata.ERROR_HELP["compressed_unsupported"]
    s = recs[5]
    assert isinstance(s, records.Sample) and (s.ip, s.id) == (0x1000, 6)
    assert not pd.decoder.stats.errors


def test_size_zero_record_stops() -> None:
    stream = _PIPE + _rec(68, b"") + struct.pack("<IHH", 9, 0, 0) + bytes(64)
    pd = PerfData.open(io.BytesIO(stream))
    assert len(list(pd.records())) == 1
    assert pd.decoder.stats.errors == Counter({"bad_size": 1})


def test_truncated_auxtrace_payload_counted() -> None:
    aux = _rec(71, struct.pack("<QQQIIII", 1 << 60, 0, 0, 0, 0, 0, 0)) + b"x" * 100
    pd = PerfData.open(io.BytesIO(_PIPE + aux))
    assert len(list(pd.records())) == 1
    assert pd.errors == Counter({"payload_truncated": 1})


# --------------------------------------------------------------------------- truncation


def _cut_points(data: bytes, start: int, end: int) -> list[int]:
    head = list(range(0, min(len(data), 4096), 97))
    step = max(1, (end - start) // 12)
    mid = list(range(start + 13, end, step))
    return sorted({*head, *mid, end - 1, end, len(data) - 1})


def test_truncated_everywhere(stored: Reading) -> None:
    reading = stored
    data = _reading_bytes(reading)
    if reading.pd.pipe_mode:
        start, end = perfheader.PIPE_HEADER_SIZE, len(data)
    else:
        start = reading.pd.data_offset
        end = start + reading.pd.data_size
    bounds = _boundaries(data, start, end)
    full = len(reading.recs)
    for cut in _cut_points(data, start, end):
        pd, got = _drain(data[:cut])
        if pd is None:
            assert cut < start, cut  # only a cut before the data loses the header
            continue
        assert len(got) <= full
        assert got == reading.recs[: len(got)]
        if start <= cut < end:
            # a cut inside a record is one counted truncation; on a boundary it is none
            assert (pd.decoder.stats.errors["truncated"] > 0) == (cut not in bounds), cut
            if not reading.pd.pipe_mode:
                assert pd.errors["data_section_truncated"] == 1, cut
        elif cut >= end and not reading.pd.pipe_mode and cut < len(data):
            # the features after the data are cut: counted, records all there
            assert sum(pd.errors.values()) >= 1 and len(got) == full, cut


# --------------------------------------------------------------------------- properties


def _section(data: bytes) -> tuple[int, int]:
    """[start, stop) of the records of a perf.data that PerfData.open accepted: after the
    16-byte pipe header, or the file header's data section, cut at the end of a cut file
    (perf_file_header: u64 magic, size, attr_size; then {u64 offset, size} of the attrs at 24,
    the data at 40 and the event types at 56, in the 72- and the 104-byte form alike)."""
    (hsize,) = struct.unpack_from("<Q", data, 8)
    if hsize == perfheader.PIPE_HEADER_SIZE:
        return hsize, len(data)
    off, size = struct.unpack_from("<QQ", data, 40)
    if off + size > len(data):  # read what is there, counted as data_section_truncated
        return min(off, len(data)), len(data)
    return off, off + size


_T_HEADER_ATTR, _T_TRACING_DATA, _T_AUXTRACE = 64, 66, 71


def _frames(data: bytes, start: int, stop: int) -> tuple[list[tuple[int, int, int, int]], str]:
    """(offset, type, misc, size) of every whole record of data[start:stop] and how the records
    end: "", "truncated" (a header or a body cut off), "bad_size" (size < 8) or
    "payload_truncated". perf's framing (session.c), written out here, not taken from
    perfdata: header.size, plus the payload an AUXTRACE ({header; u64 size; ...} then size
    bytes) or a HEADER_TRACING_DATA ({header; u32 size;} then size bytes padded to 8) carries
    after its header.size."""
    out: list[tuple[int, int, int, int]] = []
    off = start
    while off < stop:
        if stop - off < 8:
            return out, "truncated"
        rtype, misc, size = struct.unpack_from("<IHH", data, off)  # perf_event_header
        if size < 8:
            return out, "bad_size"
        if size > stop - off:
            return out, "truncated"
        out.append((off, rtype, misc, size))
        extra = 0
        if rtype == _T_AUXTRACE and size >= 16:
            extra = struct.unpack_from("<Q", data, off + 8)[0]
        elif rtype == _T_TRACING_DATA and size >= 12:
            extra = (struct.unpack_from("<I", data, off + 8)[0] + 7) & ~7
        off += size
        if extra > stop - off:
            return out, "payload_truncated"
        off += extra
    return out, ""


_ENDS = ("truncated", "bad_size", "payload_truncated")


def _check_records(data: bytes, pd: PerfData, recs: list[records.Record]) -> str:
    """``recs`` (all of ``pd``'s records) against ``_frames`` of ``data``: one value per whole
    record, each from that record's own bytes, and the end counted exactly once (nothing on a
    boundary). Returns how the records end."""
    start, stop = _section(data)
    if not pd.pipe_mode:
        assert (pd.data_offset, pd.data_offset + pd.data_size) == (start, stop)
    frames, end = _frames(data, start, stop)
    assert len(recs) == len(frames), (frames, end)
    for rec, (off, rtype, misc, size) in zip(recs, frames, strict=True):
        if isinstance(rec, records.BadRecord):
            assert (rec.type, rec.misc, rec.size) == (rtype, misc, size), off
        elif isinstance(rec, records.Unknown):
            assert (rec.type, rec.misc) == (rtype, misc), off
            if rtype >= _T_HEADER_ATTR:  # perf's own records: the body, byte for byte
                assert rec.payload == data[off + 8 : off + size], off
        else:
            assert records.record_type_name(rec) == RecordType(rtype).name, off
    if not any(f[1] == _T_HEADER_ATTR for f in frames):
        # No attr arrived with the records, so one decoder's formats held throughout: each
        # value is exactly the decoding of its record's bytes [off + 8, off + size).
        ref = RecordDecoder(pd.decoder.formats, pd.decoder.ids)
        mv = memoryview(data)
        assert recs == [ref.decode_one(t, m, mv[o + 8 : o + n]) for o, t, m, n in frames]
    errors = pd.decoder.stats.errors
    counted = (errors["truncated"], errors["bad_size"], pd.errors["payload_truncated"])
    assert counted == tuple(int(end == e) for e in _ENDS), (frames, end)
    return end


_u64s = st.one_of(st.integers(0, 600), st.integers(0, (1 << 64) - 1))
# Well-framed records of any type with random bodies: they get past the framing into the
# decoder and the user-record handlers (HEADER_ATTR, HEADER_FEATURE, AUXTRACE ...).
_framed = st.lists(
    st.builds(
        lambda t, misc, body: _rec(t, body, misc),
        st.one_of(st.integers(1, 21), st.integers(64, 83)),
        st.integers(0, 0xFFFF),
        st.binary(max_size=160),
    ),
    max_size=8,
).map(b"".join)
_bodies = st.one_of(st.binary(max_size=512), _framed)
_plausible_files = st.builds(
    lambda attr_size, attrs, data, feats, body: _file(
        attr_size=attr_size, attrs=attrs, data=data, features=feats, body=body
    ),
    st.one_of(st.just(152), st.just(152), _u64s),
    st.one_of(st.none(), st.none(), st.tuples(_u64s, _u64s)),
    st.one_of(st.none(), st.none(), st.tuples(_u64s, _u64s)),
    st.one_of(st.just(0), st.integers(0, (1 << 256) - 1)),
    _bodies,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=2048),
        st.binary(max_size=2048).map(lambda b: _PIPE + b),
        _framed.map(lambda b: _PIPE + b),
        st.binary(max_size=2048).map(lambda b: b"PERFILE2" + struct.pack("<Q", 104) + b),
        _plausible_files,
    )
)
def test_any_bytes_clean_error_or_records(data: bytes) -> None:
    pd, recs = _drain(data)
    if pd is not None:
        _check_records(data, pd, recs)


_kinds = st.sampled_from([t for t in (*range(1, 22), *range(64, 84))
                          if t not in (_T_TRACING_DATA, _T_AUXTRACE)])  # fmt: skip


@st.composite
def _cut_records(draw: st.DrawFn) -> tuple[bytes, list[tuple[int, int, int, int]], int]:
    """Records built here: any type with a random body, or an AUXTRACE / HEADER_TRACING_DATA
    with its payload behind it; and a cut (half the time none). Returns the records' bytes,
    each record's (type, start, end of header.size, end of its payload) and the cut offset."""
    out = b""
    spans = []
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["any", "any", "any", "aux", "tracing"]))
        if kind == "aux":
            payload = draw(st.binary(max_size=40))
            # u64 size (of the payload), offset, reference; u32 idx, tid, cpu, reserved
            rec = _rec(_T_AUXTRACE, struct.pack("<QQQIIII", len(payload), 0, 0, 0, 0, 0, 0))
        elif kind == "tracing":
            n = draw(st.integers(0, 40))
            payload = bytes(n + (-n % 8))  # perf pads the tracing data to 8
            rec = _rec(_T_TRACING_DATA, struct.pack("<II", n, 0))  # u32 size; (padding)
        else:
            payload = b""
            rec = _rec(draw(_kinds), draw(st.binary(max_size=160)), draw(st.integers(0, 0xFFFF)))
        rtype = struct.unpack_from("<I", rec)[0]
        spans.append((rtype, len(out), len(out) + len(rec), len(out) + len(rec) + len(payload)))
        out += rec + payload
    cut = draw(st.one_of(st.just(len(out)), st.integers(0, len(out))))
    return out, spans, cut


@settings(max_examples=200, deadline=None)
@given(built=_cut_records(), pipe=st.booleans())
def test_cut_inside_a_record_is_one_counted_truncation(
    built: tuple[bytes, list[tuple[int, int, int, int]], int], pipe: bool
) -> None:
    stream, spans, cut = built
    if pipe:
        head = _PIPE
    else:
        whole_file = _file(body=stream)  # data section: the stream, to the end of the file
        head = whole_file[: len(whole_file) - len(stream)]
    data = head + stream[:cut]
    # What the cut must do, from where it falls among the records built above: records whose
    # header.size ends by the cut are read; a cut on a record boundary counts nothing, one
    # inside a payload counts payload_truncated, one anywhere else in a record truncated.
    read = [(len(head) + a, t) for t, a, b, _ in spans if b <= cut]
    if cut in {0, *(p for *_, p in spans)}:
        end = ""
    elif any(b <= cut < p for _, _, b, p in spans):
        end = "payload_truncated"
    else:
        end = "truncated"
    pd, recs = _drain(data)
    assert pd is not None and pd.pipe_mode == pipe
    assert len(recs) == len(read)
    assert [(o, t) for o, t, _, _ in _frames(data, *_section(data))[0]] == read
    assert _check_records(data, pd, recs) == end  # each record's own bytes, the end counted
    errors = pd.decoder.stats.errors
    counted = (errors["truncated"], errors["bad_size"], pd.errors["payload_truncated"])
    assert counted == tuple(int(end == e) for e in _ENDS)  # (never bad_size: sizes are right)
    # file mode: the header promised the whole stream
    assert pd.errors["data_section_truncated"] == (not pipe and cut < len(stream))


@pytest.fixture(scope="module")
def small_recordings(busy: Path, tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    tmp = tmp_path_factory.mktemp("small")
    out = []
    for pipe in (False, True):
        p = record_perf_data(tmp, [str(busy), "0.02"], pipe=pipe, stack=512, freq=199)
        out.append(p.read_bytes())
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    which=st.integers(0, 1),
    flips=st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), max_size=8),
    where=st.sampled_from(["head", "anywhere", "tail"]),
    cut=st.one_of(st.none(), st.integers(0, 1 << 30)),
)
def test_mutated_real_file_clean_error_or_records(
    small_recordings: list[bytes], which: int, flips: list[tuple[int, int]], where: str,
    cut: int | None,
) -> None:  # fmt: skip
    data = bytearray(small_recordings[which])
    for pos, val in flips:
        if where == "head":
            pos %= min(len(data), 4096)
        elif where == "tail":
            pos = len(data) - 1 - pos % min(len(data), 8192)
        else:
            pos %= len(data)
        data[pos] = val
    if cut is not None:  # mostly inside the data section, which is most of the file
        del data[cut % len(data) :]
    pd, recs = _drain(bytes(data))
    if pd is not None:
        _check_records(bytes(data), pd, recs)
