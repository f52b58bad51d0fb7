"""Reading perf.data, in file mode (seekable, sections) and pipe mode (a plain record stream).

Invariants:
- Sans-IO apart from the stream the caller hands in (or the one ``PerfData.open`` opens for a
  path): no other files, no /proc, no clocks. Every parser below the ``PerfData`` class takes
  bytes and returns values.
- Only a broken *main* header (bad magic, wrong header size, attrs section unreadable) raises,
  and it raises ``PerfDataError`` with a message. Everything after that - a corrupt feature
  section, ids out of bounds, a truncated data section, a record whose size field is garbage -
  becomes a count in ``PerfData.errors`` (section level) or ``decoder.stats.errors`` (record
  level, the same keys ``RecordDecoder.decode`` uses: ``truncated``, ``bad_size``) and reading
  goes on with what is left. Any other exception escaping this module is a bug.
- Every record in the data section (file mode) or stream (pipe mode) becomes exactly one value
  from ``records()``, in stream order, including perf's own user records (HEADER_ATTR,
  HEADER_FEATURE, FINISHED_ROUND, ID_INDEX, ...) as ``records.Unknown``/``FinishedRound``.
- Termination: each step of the record loop consumes >= 8 bytes (a size field < 8 ends the
  stream, counted as ``bad_size``), so a read ends after at most ``data_size / 8`` records.
- Memory: the data section is streamed in chunks of ``CHUNK`` bytes; at most one chunk plus one
  record (a u16 size, so < 64 KiB) is held. Payloads that follow a record outside its size
  (AUXTRACE, TRACING_DATA) are skipped chunk by chunk, never buffered. Header-side sections are
  read whole but capped (``MAX_SECTION``), so an absurd size is an error, not an allocation.
- Cost: O(file size) for ``records()``; O(header + feature sections) for ``open``.

Only little-endian files are read: perf writes host byte order, and the daemon runs on the host
that recorded. A byte-swapped magic is a ``PerfDataError`` that says so.
"""

from __future__ import annotations

import dataclasses
import io
import os
import struct
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from types import TracebackType
from typing import IO, cast

from . import records
from .abi import MISC_BUILD_ID_SIZE, RecordType

__all__ = [
    "CHUNK",
    "ERROR_HELP",
    "MAX_ATTRS",
    "AttrInfo",
    "BuildIdEntry",
    "Feature",
    "PerfData",
    "PerfDataError",
    "parse_attr",
    "parse_build_ids",
    "parse_event_desc",
    "parse_perf_string",
]

CHUNK = 1 << 20  # data-section read size; bounds memory, see module invariants
MAX_SECTION = 64 << 20  # cap on any header-side section (attrs, ids, one feature) we read whole
MAX_ATTRS = 4096  # perf's own evlists are far smaller; bounds pipe-mode decoder rebuilds

# --------------------------------------------------------------------------- layouts

# tools/perf/util/header.h (perf 6.1):
#
#   struct perf_file_section { u64 offset; u64 size; };          // offset from file start
#
#   struct perf_file_header {                     // byte offset
#       u64 magic;                                //   0  "PERFILE2"
#       u64 size;                                 //   8  sizeof(struct perf_file_header) = 104
#       u64 attr_size;                            //  16  sizeof(struct perf_file_attr)
#       struct perf_file_section attrs;           //  24
#       struct perf_file_section data;            //  40
#       struct perf_file_section event_types;     //  56  unused since 2012
#       DECLARE_BITMAP(adds_features, 256);       //  72  32 bytes, bit n = feature n
#   };                                            // 104
#
#   struct perf_pipe_file_header { u64 magic; u64 size; };       // size = 16
#
# perf_file_header__read accepts size 72 too (files older than the feature bitmap).
FILE_MAGIC = b"PERFILE2"
_SWAPPED_MAGIC = FILE_MAGIC[::-1]  # "2ELIFREP": written on a host of the other endianness
_V1_MAGIC = b"PERFFILE"  # perf before 2.6.37; no longer written by anyone
_FILE_HEADER = struct.Struct("<8sQQQQQQQQ32s")
FILE_HEADER_SIZE = _FILE_HEADER.size  # 104
_OLD_FILE_HEADER_SIZE = 72
PIPE_HEADER_SIZE = 16
_SECTION = struct.Struct("<QQ")
_HDR = struct.Struct("<IHH")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# include/uapi/linux/perf_event.h, struct perf_event_attr (Linux 6.x):
#
#     0  u32 type;                 4  u32 size;            // size = this struct's size
#     8  u64 config;
#    16  u64 sample_period | sample_freq;
#    24  u64 sample_type;
#    32  u64 read_format;
#    40  u64 disabled:1 (bit 0), inherit:1, pinned:1, exclusive:1, exclude_user:1,
#            exclude_kernel:1, exclude_hv:1, exclude_idle:1, mmap:1 (8), comm:1, freq:1 (10),
#            inherit_stat:1, enable_on_exec:1, task:1 (13), watermark:1, precise_ip:2 (15-16),
#            mmap_data:1 (17), sample_id_all:1 (18), exclude_host:1, exclude_guest:1,
#            exclude_callchain_kernel:1 (21), exclude_callchain_user:1 (22), mmap2:1 (23),
#            comm_exec, use_clockid, context_switch, write_backward, namespaces, ksymbol,
#            bpf_event, aux_output, cgroup, text_poke (33), build_id:1 (34), ...
#    48  u32 wakeup_events;       52  u32 bp_type;
#    56  u64 bp_addr | config1;                             // PERF_ATTR_SIZE_VER0 = 64
#    64  u64 bp_len | config2;                              // VER1 = 72
#    72  u64 branch_sample_type;                            // VER2 = 80
#    80  u64 sample_regs_user;
#    88  u32 sample_stack_user;   92  s32 clockid;          // VER3 = 96
#    96  u64 sample_regs_intr;                              // VER4 = 104
#   104  u32 aux_watermark; 108 u16 sample_max_stack; ...   // VER5 = 112 ... VER8 = 136
#
# Fields past ``size`` are absent and read as zero, like perf's read_attr (header.c) does.
ATTR_SIZE_VER0 = 64
_ATTR_HEAD = struct.Struct("<IIQQQQQ")  # type, size, config, period, sample_type, read_fmt, flags
_ATTR_FLAG_SAMPLE_ID_ALL = 1 << 18
_ATTR_FLAG_BUILD_ID = 1 << 34
_ATTR_OFF_BRANCH_SAMPLE_TYPE = 72
_ATTR_OFF_REGS_USER = 80
_ATTR_OFF_STACK_USER = 88
_ATTR_OFF_REGS_INTR = 96
_MAX_ATTR_SIZE = 4096  # the kernel's own limit is a page


class Feature(IntEnum):
    """``enum`` of feature bits in tools/perf/util/header.h (perf 6.1)."""

    RESERVED = 0
    TRACING_DATA = 1
    BUILD_ID = 2
    HOSTNAME = 3
    OSRELEASE = 4
    VERSION = 5
    ARCH = 6
    NRCPUS = 7
    CPUDESC = 8
    CPUID = 9
    TOTAL_MEM = 10
    CMDLINE = 11
    EVENT_DESC = 12
    CPU_TOPOLOGY = 13
    NUMA_TOPOLOGY = 14
    BRANCH_STACK = 15
    PMU_MAPPINGS = 16
    GROUP_DESC = 17
    AUXTRACE = 18
    STAT = 19
    CACHE = 20
    SAMPLE_TIME = 21
    MEM_TOPOLOGY = 22
    CLOCKID = 23
    DIR_FORMAT = 24
    BPF_PROG_INFO = 25
    BPF_BTF = 26
    COMPRESSED = 27
    CPU_PMU_CAPS = 28
    CLOCK_DATA = 29
    HYBRID_TOPOLOGY = 30
    PMU_CAPS = 31
    # perf 6.1's HEADER_LAST_FEATURE. In pipe mode perf_event__synthesize_features ends the
    # feature records with one carrying this id and no data: an end marker, not a section.
    LAST_FEATURE_6_1 = 32


def _feature_name(n: int) -> str:
    try:
        return Feature(n).name.lower()
    except ValueError:
        return f"feature{n}"


# Explanations for ``PerfData.errors`` keys that need more than their name.
ERROR_HELP: dict[str, str] = {
    "compressed_unsupported": (
        "PERF_RECORD_COMPRESSED(2) records hold zstd-compressed records, which this reader "
        "does not decompress; they are yielded as records.Unknown. Re-record without -z/"
        "--compression-level, or run `perf inject -i in -o out` to decompress."
    ),
    "data_section_truncated": "the header's data section runs past the end of the file",
    "feature_table_truncated": "the feature section table after the data section is cut off",
    "attr_ids_bad": "an attr's ids section is out of bounds or not a multiple of 8",
    "attr_size_mismatch": "an attr's own size field disagrees with the header's attr_size",
    "event_desc_unmatched": "an EVENT_DESC entry names no attr we know",
    "payload_truncated": "an AUXTRACE/TRACING_DATA payload after its record is cut off",
}


class PerfDataError(Exception):
    """The input is not a perf.data stream we can read at all (bad main header)."""


class _Corrupt(Exception):
    """A section or record body that does not parse; becomes a count, never escapes."""


_PARSE_ERRORS = (_Corrupt, struct.error, IndexError, ValueError, UnicodeError, OverflowError)


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class AttrInfo:
    """One event of the recording: its record layout, identity, ids and (if known) name.

    ``name`` comes from HEADER_EVENT_DESC; it is "" when the file has none."""

    fmt: records.EventFormat
    type: int
    config: int
    ids: tuple[int, ...]
    name: str = ""
    sample_stack_user: int = 0
    flags: int = 0  # the attr's bitfield word (offset 40), e.g. bit 18 = sample_id_all

    def __repr__(self) -> str:
        return (
            f"AttrInfo({self.name!r}, type={self.type}, config={self.config:#x}, "
            f"ids={list(self.ids)}, {self.fmt!r})"
        )


@dataclass(frozen=True, slots=True)
class BuildIdEntry:
    """One ``struct perf_record_header_build_id`` (HEADER_BUILD_ID feature or record 67).

    ``misc & abi.MISC_CPUMODE_MASK`` says kernel/user/guest; ``pid`` is -1 for the host kernel
    (perf's HOST_KERNEL_ID)."""

    pid: int
    build_id: bytes
    filename: str
    misc: int

    def __repr__(self) -> str:
        return f"BuildIdEntry({self.build_id.hex()} {self.filename!r} pid={self.pid})"


# --------------------------------------------------------------------------- parsers


def _cstr(raw: bytes | memoryview) -> str:
    b = bytes(raw)
    nul = b.find(b"\0")
    return (b if nul < 0 else b[:nul]).decode("utf-8", "surrogateescape")


def parse_perf_string(data: bytes | memoryview, off: int) -> tuple[str, int]:
    """A header.c ``do_write_string`` string at ``off``; returns (text, offset after it).

    ::

        struct perf_header_string { u32 len; char string[len]; };  // NUL-terminated, then
                                                                   // NUL-padded to 64 bytes
    """
    if off + 4 > len(data):
        raise _Corrupt("short string length")
    (n,) = _U32.unpack_from(data, off)
    end = off + 4 + n
    if end > len(data):
        raise _Corrupt("string past section end")
    return _cstr(data[off + 4 : end]), end


def parse_attr(raw: bytes | memoryview) -> tuple[records.EventFormat, int, int, int, int, int]:
    """Parse a ``perf_event_attr`` (layout above) from the start of ``raw``.

    Returns (format, type, config, attr size, sample_stack_user, flags). The attr's own
    ``size`` decides how much of ``raw`` is the attr (0 means PERF_ATTR_SIZE_VER0, as in perf's
    read_attr); fields past it are zero."""
    if len(raw) < ATTR_SIZE_VER0:
        raise _Corrupt("attr shorter than PERF_ATTR_SIZE_VER0")
    size = _U32.unpack_from(raw, 4)[0] or ATTR_SIZE_VER0
    if size < ATTR_SIZE_VER0 or size > min(len(raw), _MAX_ATTR_SIZE):
        raise _Corrupt("bad attr size")
    body = bytes(raw[:size]).ljust(136, b"\0")
    atype, _, config, _, sample_type, read_format, flags = _ATTR_HEAD.unpack_from(body, 0)

    def u64(off: int) -> int:
        return int(_U64.unpack_from(body, off)[0])

    fmt = records.EventFormat(
        sample_type=sample_type,
        sample_regs_user=u64(_ATTR_OFF_REGS_USER),
        read_format=read_format,
        branch_sample_type=u64(_ATTR_OFF_BRANCH_SAMPLE_TYPE),
        sample_regs_intr=u64(_ATTR_OFF_REGS_INTR),
        sample_id_all=bool(flags & _ATTR_FLAG_SAMPLE_ID_ALL),
        build_id_mmap=bool(flags & _ATTR_FLAG_BUILD_ID),
    )
    stack_user = int(_U32.unpack_from(body, _ATTR_OFF_STACK_USER)[0])
    return fmt, int(atype), int(config), size, stack_user, int(flags)


# tools/perf/util/header.c write_buildid / perf_header__read_build_ids, and
# tools/lib/perf/include/perf/event.h:
#
#   struct perf_record_header_build_id {       // byte offset
#       struct perf_event_header header;       //   0  type 0 in the feature section (not MMAP:
#                                              //      perf never sets it), 67 as a pipe record;
#                                              //      misc = cpumode | MISC_BUILD_ID_SIZE(1<<15)
#       pid_t pid;                             //   8  s32; -1 for the host kernel
#       union {                                //  12
#           u8 build_id[24];                   //      old form: always 20 bytes of id
#           struct { u8 data[20];              //      with MISC_BUILD_ID_SIZE: data[0..size)
#                    u8 size;                  //  32
#                    u8 reserved1__; u16 reserved2__; };
#       };
#       char filename[];                       //  36  NUL-padded to 64 (NAME_ALIGN)
#   };                                         //      header.size covers all of it; records
#                                              //      are packed back to back (4-aligned)
_BUILD_ID_FIXED = 36
_BUILD_ID_MAX = 20  # BUILD_ID_SIZE (build-id.h)


def _build_id_entry(misc: int, body: bytes | memoryview) -> BuildIdEntry:
    """One build-id record's body (the bytes after its 8-byte header)."""
    if len(body) < _BUILD_ID_FIXED - 8:
        raise _Corrupt("short build-id record")
    (pid,) = struct.unpack_from("<i", body, 0)
    n = _BUILD_ID_MAX
    if misc & MISC_BUILD_ID_SIZE:
        n = body[4 + 20]
        if n > _BUILD_ID_MAX:
            raise _Corrupt("build-id size > 20")
    return BuildIdEntry(pid, bytes(body[4 : 4 + n]), _cstr(body[28:]), misc)


def parse_build_ids(data: bytes | memoryview) -> list[BuildIdEntry]:
    """The HEADER_BUILD_ID feature section: build-id records back to back (layout above).

    Raises ``_Corrupt`` on the first bad record; callers count it."""
    out: list[BuildIdEntry] = []
    off = 0
    n = len(data)
    while off < n:
        if off + _BUILD_ID_FIXED > n:
            raise _Corrupt("build-id section has a partial record")
        _, misc, size = _HDR.unpack_from(data, off)
        if size < _BUILD_ID_FIXED or off + size > n:
            raise _Corrupt("build-id record size out of bounds")
        out.append(_build_id_entry(misc, data[off + 8 : off + size]))
        off += size
    return out


# header.c write_event_desc / read_event_desc:
#
#   u32 nr;                          // number of events
#   u32 attr_size;                   // sizeof(struct perf_event_attr) as written
#   struct {
#       struct perf_event_attr attr; // attr_size bytes
#       u32 nr_ids;
#       struct perf_header_string name;
#       u64 ids[nr_ids];
#   } events[nr];
def parse_event_desc(data: bytes | memoryview) -> list[tuple[str, tuple[int, ...], int, int]]:
    """HEADER_EVENT_DESC: a list of (name, ids, attr.type, attr.config)."""
    if len(data) < 8:
        raise _Corrupt("short event_desc")
    nr, attr_size = struct.unpack_from("<II", data, 0)
    if attr_size < ATTR_SIZE_VER0 or attr_size > _MAX_ATTR_SIZE:
        raise _Corrupt("bad event_desc attr size")
    # each event needs attr + nr_ids + string length at least: bounds ``nr`` by the data
    if nr * (attr_size + 8) > len(data):
        raise _Corrupt("event_desc nr too large")
    out: list[tuple[str, tuple[int, ...], int, int]] = []
    off = 8
    for _ in range(nr):
        if off + attr_size + 4 > len(data):
            raise _Corrupt("event_desc entry past section end")
        atype, _, config = struct.unpack_from("<IIQ", data, off)
        off += attr_size
        (nr_ids,) = _U32.unpack_from(data, off)
        name, off = parse_perf_string(data, off + 4)
        if off + 8 * nr_ids > len(data):
            raise _Corrupt("event_desc ids past section end")
        ids = struct.unpack_from(f"<{nr_ids}Q", data, off)
        off += 8 * nr_ids
        out.append((name, tuple(int(i) for i in ids), int(atype), int(config)))
    return out


def _parse_string_list(data: bytes | memoryview) -> tuple[str, ...]:
    # header.c write_cmdline: u32 nr; struct perf_header_string strings[nr];
    if len(data) < 4:
        raise _Corrupt("short string list")
    (nr,) = _U32.unpack_from(data, 0)
    if nr * 4 > len(data):
        raise _Corrupt("string list nr too large")
    out = []
    off = 4
    for _ in range(nr):
        s, off = parse_perf_string(data, off)
        out.append(s)
    return tuple(out)


def _attr_record(body: memoryview) -> tuple[records.EventFormat, int, int, tuple[int, ...],
                                            int, int]:  # fmt: skip
    # PERF_RECORD_HEADER_ATTR (tools/lib/perf/include/perf/event.h):
    #   struct perf_record_header_attr { struct perf_event_header header;
    #                                    struct perf_event_attr attr;   // attr.size bytes
    #                                    u64 id[]; };                   // up to header.size
    fmt, atype, config, size, stack_user, flags = parse_attr(body)
    nids = (len(body) - size) // 8
    ids = struct.unpack_from(f"<{nids}Q", body, size)
    return fmt, atype, config, tuple(int(i) for i in ids), stack_user, flags


# --------------------------------------------------------------------------- framing


class _Framer:
    """Splits a byte stream into (type, misc, body) frames, reading ``CHUNK``-sized pieces.

    ``limit`` is the number of bytes the stream may still supply (file mode: the rest of the
    data section); None reads to EOF (pipe mode). Uses ``read1`` when the stream has it, so a
    live pipe yields records as soon as they arrive instead of after a full chunk."""

    def __init__(
        self,
        stream: IO[bytes],
        limit: int | None,
        stats: records.DecodeStats,
        errors: Counter[str],
        chunk: int = CHUNK,
    ) -> None:
        read1 = getattr(stream, "read1", None)
        self._read = cast(Callable[[int], bytes], read1 if callable(read1) else stream.read)
        self._left = limit
        self._stats = stats
        self._errors = errors
        self._chunk = max(chunk, 8)
        self._buf = b""
        self._pos = 0

    def _fill(self, need: int) -> bool:
        """Make ``need`` bytes available at ``_pos``; False when the stream ends first."""
        avail = len(self._buf) - self._pos
        if avail >= need:
            return True
        parts = [self._buf[self._pos :]]
        while avail < need:
            want = max(need - avail, self._chunk)
            if self._left is not None:
                want = min(want, self._left)
                if want <= 0:
                    break
            data = self._read(want)
            if not data:
                break
            if self._left is not None:
                self._left -= len(data)
            parts.append(data)
            avail += len(data)
        self._buf = b"".join(parts)
        self._pos = 0
        return avail >= need

    def _skip(self, n: int) -> bool:
        """Drop ``n`` bytes of payload without holding more than one chunk of it."""
        while n > 0:
            avail = len(self._buf) - self._pos
            if avail == 0:
                if not self._fill(1):
                    return False
                continue
            take = min(n, avail)
            self._pos += take
            n -= take
        return True

    def frames(self) -> Iterator[tuple[int, int, memoryview]]:
        while True:
            if not self._fill(_HDR.size):
                if len(self._buf) > self._pos:
                    self._stats.errors["truncated"] += 1
                return
            rtype, misc, size = _HDR.unpack_from(self._buf, self._pos)
            if size < _HDR.size:
                self._stats.errors["bad_size"] += 1
                return
            if not self._fill(size):
                self._stats.errors["truncated"] += 1
                return
            body = memoryview(self._buf)[self._pos + _HDR.size : self._pos + size]
            self._pos += size
            extra = _payload_after(rtype, body)
            yield rtype, misc, body
            if extra and not self._skip(extra):
                self._errors["payload_truncated"] += 1
                return


def _payload_after(rtype: int, body: memoryview) -> int:
    """Bytes that follow a record outside its header.size (perf's session.c skips them).

    - PERF_RECORD_AUXTRACE: ``struct perf_record_auxtrace { header; u64 size; ... }`` then
      ``size`` bytes of AUX data (session.c perf_session__process_user_event).
    - PERF_RECORD_HEADER_TRACING_DATA: ``{ header; u32 size; }`` then ``size`` bytes padded
      to 8 (trace-event-read.c / perf_event__process_tracing_data)."""
    if rtype == RecordType.AUXTRACE and len(body) >= 8:
        return int(_U64.unpack_from(body, 0)[0])
    if rtype == RecordType.HEADER_TRACING_DATA and len(body) >= 4:
        n = int(_U32.unpack_from(body, 0)[0])
        return (n + 7) & ~7
    return 0


# --------------------------------------------------------------------------- reader


_PLACEHOLDER_FORMAT = records.EventFormat(sample_type=0, sample_id_all=False)

PathOrStream = str | os.PathLike[str] | IO[bytes]


class PerfData:
    """A perf.data file (file mode) or stream (pipe mode).

    File mode: ``open`` reads the header, the attrs and every feature section up front (so
    ``attrs`` have their EVENT_DESC names and ``build_ids``/``arch`` are known before the first
    record); ``records()`` then streams the data section and may be called again (it seeks
    back; the decoder's stats keep counting).

    Pipe mode (``perf record -o -``): the stream is a 16-byte header and then records only.
    ``attrs``, ``features``, ``arch``, ``build_ids`` and the other header values start empty
    and are filled *as* ``records()`` passes the HEADER_ATTR / HEADER_FEATURE /
    HEADER_BUILD_ID records that carry them (perf writes attrs and features first, build-ids,
    if any, last). Each new attr replaces ``decoder`` with one that knows every attr so far;
    all decoders share one ``DecodeStats``. ``records()`` can run only once.

    ``close()`` closes the stream only if ``open`` opened it (from a path)."""

    def __init__(self, stream: IO[bytes], *, owned: bool = False) -> None:
        self._stream = stream
        self._owned = owned
        self._consumed = False
        self.pipe_mode = False
        self.attrs: list[AttrInfo] = []
        self.build_ids: list[BuildIdEntry] = []
        self.arch: str | None = None
        self.hostname: str | None = None
        self.osrelease: str | None = None
        self.perf_version: str | None = None
        self.nr_cpus_avail: int | None = None
        self.nr_cpus_online: int | None = None
        self.cmdline: tuple[str, ...] | None = None
        self.features: dict[int, bytes] = {}
        self.errors: Counter[str] = Counter()
        self.data_offset = 0
        self.data_size = 0
        self._stats = records.DecodeStats()
        self.decoder = self._make_decoder()
        self._base = 0
        self._read_header()

    # -- opening

    @classmethod
    def open(cls, path_or_fileobj: PathOrStream) -> PerfData:
        """Open a path ("-" = stdin) or a binary stream positioned at the perf.data header.

        File mode needs a seekable stream; pipe mode works on anything with ``read``."""
        if isinstance(path_or_fileobj, str | os.PathLike):
            if os.fspath(path_or_fileobj) == "-":
                return cls(sys.stdin.buffer)
            try:
                f = open(path_or_fileobj, "rb")  # owned: closed by close()
            except OSError as e:
                raise PerfDataError(f"cannot open {os.fspath(path_or_fileobj)!r}: {e}") from e
            try:
                return cls(f, owned=True)
            except BaseException:
                f.close()
                raise
        return cls(path_or_fileobj)

    def close(self) -> None:
        if self._owned:
            self._stream.close()

    def __enter__(self) -> PerfData:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "pipe" if self.pipe_mode else "file"
        return (
            f"PerfData({mode}, attrs={len(self.attrs)}, build_ids={len(self.build_ids)}, "
            f"arch={self.arch!r}, errors={dict(self.errors)})"
        )

    # -- header

    def _read_exact(self, n: int) -> bytes:
        """Up to ``n`` bytes, fewer only at EOF (a raw stream may return short reads)."""
        parts: list[bytes] = []
        got = 0
        while got < n:
            b = self._stream.read(n - got)
            if not b:
                break
            parts.append(b)
            got += len(b)
        return b"".join(parts)

    def _read_header(self) -> None:
        head = self._read_exact(PIPE_HEADER_SIZE)
        if len(head) < PIPE_HEADER_SIZE:
            raise PerfDataError(f"not perf.data: only {len(head)} bytes")
        magic, size = struct.unpack_from("<8sQ", head)
        if magic == _SWAPPED_MAGIC:
            raise PerfDataError("perf.data from a host of the other byte order: not supported")
        if magic == _V1_MAGIC:
            raise PerfDataError("perf.data version 1 (magic PERFFILE): not supported")
        if magic != FILE_MAGIC:
            raise PerfDataError(f"not perf.data: magic {magic!r}, expected {FILE_MAGIC!r}")
        if size == PIPE_HEADER_SIZE:
            self.pipe_mode = True
            return
        if size not in (FILE_HEADER_SIZE, _OLD_FILE_HEADER_SIZE):
            raise PerfDataError(f"bad perf.data header size {size}")
        if not self._seekable():
            raise PerfDataError(
                "file-mode perf.data needs a seekable stream; use `perf record -o -` for pipes"
            )
        self._base = self._stream.tell() - PIPE_HEADER_SIZE
        rest = self._read_exact(FILE_HEADER_SIZE - PIPE_HEADER_SIZE)
        if len(rest) < size - PIPE_HEADER_SIZE:
            raise PerfDataError("perf.data header truncated")
        self._read_file_header(size, (head + rest).ljust(FILE_HEADER_SIZE, b"\0"))

    def _seekable(self) -> bool:
        try:
            return bool(self._stream.seekable())
        except (OSError, ValueError, AttributeError):
            return False

    def _file_bytes(self, off: int, size: int) -> bytes:
        self._stream.seek(self._base + off)
        return self._read_exact(size)

    def _read_file_header(self, hsize: int, raw: bytes) -> None:
        (_, _, attr_size, attrs_off, attrs_size, data_off, data_size, _, _, bitmap) = (
            _FILE_HEADER.unpack(raw)
        )
        if hsize == _OLD_FILE_HEADER_SIZE:
            bitmap = b""  # the bitmap postdates these files (perf_file_header__read)
        self._stream.seek(0, io.SEEK_END)
        file_size = self._stream.tell() - self._base

        # perf_file_attr = { perf_event_attr attr; perf_file_section ids; }, attr_size of them
        if not ATTR_SIZE_VER0 + _SECTION.size <= attr_size <= _MAX_ATTR_SIZE + _SECTION.size:
            raise PerfDataError(f"bad attr_size {attr_size} in perf.data header")
        if attrs_size > MAX_SECTION or attrs_off + attrs_size > file_size:
            raise PerfDataError(
                f"attrs section [{attrs_off}, +{attrs_size}) is outside the file ({file_size} B)"
            )
        nattrs = attrs_size // attr_size
        if nattrs == 0:
            raise PerfDataError("perf.data has no event attrs")
        attr_blob = self._file_bytes(attrs_off, nattrs * attr_size)
        attrs: list[AttrInfo] = []
        for i in range(nattrs):
            entry = attr_blob[i * attr_size : (i + 1) * attr_size]
            try:
                fmt, atype, config, asize, stack_user, flags = parse_attr(
                    entry[: attr_size - _SECTION.size]
                )
            except _PARSE_ERRORS as e:
                raise PerfDataError(f"attr {i} does not parse: {e}") from e
            if asize != attr_size - _SECTION.size:
                self.errors["attr_size_mismatch"] += 1
            ids_off, ids_size = _SECTION.unpack_from(entry, attr_size - _SECTION.size)
            ids: tuple[int, ...] = ()
            if ids_size % 8 or ids_size > MAX_SECTION or ids_off + ids_size > file_size:
                self.errors["attr_ids_bad"] += 1
            else:
                blob = self._file_bytes(ids_off, ids_size)
                ids = tuple(int(x) for x in struct.unpack(f"<{ids_size // 8}Q", blob))
            attrs.append(AttrInfo(fmt, atype, config, ids, "", stack_user, flags))
        self._set_attrs(attrs)

        self.data_offset = data_off
        self.data_size = data_size
        if data_off + data_size > file_size:
            # read what is there (perf would refuse; a cut-off recording is still worth reading)
            self.errors["data_section_truncated"] += 1
            self.data_offset = min(data_off, file_size)
            self.data_size = file_size - self.data_offset

        # header.c perf_header__process_sections: the table of perf_file_section, one per set
        # bit in ascending bit order, starts right after the data section as the header says
        # (feat_offset = data.offset + data.size), not where a truncated file ends.
        feats = [n for n in range(len(bitmap) * 8) if bitmap[n // 8] >> (n % 8) & 1]
        if not feats:
            return
        table_off = data_off + data_size
        table = b""
        if table_off + len(feats) * _SECTION.size <= file_size:
            table = self._file_bytes(table_off, len(feats) * _SECTION.size)
        if len(table) < len(feats) * _SECTION.size:
            self.errors["feature_table_truncated"] += 1
            return
        for i, feat in enumerate(feats):
            off, size = _SECTION.unpack_from(table, i * _SECTION.size)
            if size > MAX_SECTION or off + size > file_size:
                self.errors[f"feature_{_feature_name(feat)}_out_of_bounds"] += 1
                continue
            self._feature(feat, self._file_bytes(off, size))

    # -- attrs, features

    def _make_decoder(self) -> records.RecordDecoder:
        formats = [a.fmt for a in self.attrs] or [_PLACEHOLDER_FORMAT]
        ids = {i: n for n, a in enumerate(self.attrs) for i in a.ids}
        dec = records.RecordDecoder(formats, ids)
        dec.stats = self._stats  # one DecodeStats across every decoder this reader makes
        return dec

    def _set_attrs(self, attrs: list[AttrInfo]) -> None:
        self.attrs = attrs
        self.decoder = self._make_decoder()

    def _feature(self, feat: int, data: bytes) -> None:
        """Keep a feature section's raw bytes and parse the ones we use; count failures."""
        self.features[feat] = data
        try:
            if feat == Feature.BUILD_ID:
                self.build_ids.extend(parse_build_ids(data))
            elif feat == Feature.ARCH:
                self.arch = parse_perf_string(data, 0)[0]
            elif feat == Feature.HOSTNAME:
                self.hostname = parse_perf_string(data, 0)[0]
            elif feat == Feature.OSRELEASE:
                self.osrelease = parse_perf_string(data, 0)[0]
            elif feat == Feature.VERSION:
                self.perf_version = parse_perf_string(data, 0)[0]
            elif feat == Feature.NRCPUS:
                # header.c write_nrcpus: u32 nr_cpus_avail (max present cpu); u32 nr_cpus_online
                self.nr_cpus_avail, self.nr_cpus_online = struct.unpack_from("<II", data, 0)
            elif feat == Feature.CMDLINE:
                self.cmdline = _parse_string_list(data)
            elif feat == Feature.EVENT_DESC:
                self._name_attrs(parse_event_desc(data))
        except _PARSE_ERRORS:
            self.errors[f"feature_{_feature_name(feat)}_corrupt"] += 1

    def _name_attrs(self, descs: list[tuple[str, tuple[int, ...], int, int]]) -> None:
        # perf (header.c process_event_desc -> evlist__set_event_name) finds each desc's
        # evsel by its first id; an attr without ids falls back to position.
        by_id = {i: n for n, a in enumerate(self.attrs) for i in a.ids}
        attrs = list(self.attrs)
        for pos, (name, ids, _, _) in enumerate(descs):
            idx = by_id.get(ids[0]) if ids else None
            if idx is None and pos < len(attrs) and not attrs[pos].ids:
                idx = pos
            if idx is None:
                self.errors["event_desc_unmatched"] += 1
                continue
            a = attrs[idx]
            attrs[idx] = dataclasses.replace(a, fmt=dataclasses.replace(a.fmt, name=name),
                                             name=name)  # fmt: skip
        self._set_attrs(attrs)

    def _user_record(self, rtype: int, misc: int, body: memoryview) -> None:
        """Side effects of perf's synthesized records on the header view (pipe mode mostly)."""
        try:
            if rtype == RecordType.HEADER_ATTR:
                if len(self.attrs) >= MAX_ATTRS:
                    # each new attr rebuilds the decoder (O(attrs)): cap the quadratic case
                    self.errors["too_many_attrs"] += 1
                    return
                fmt, atype, config, ids, stack_user, flags = _attr_record(body)
                self._set_attrs([*self.attrs, AttrInfo(fmt, atype, config, ids, "",
                                                       stack_user, flags)])  # fmt: skip
            elif rtype == RecordType.HEADER_FEATURE:
                # struct perf_record_header_feature { header; u64 feat_id; char data[]; }
                (feat,) = _U64.unpack_from(body, 0)
                if feat != Feature.LAST_FEATURE_6_1 or len(body) > 8:
                    self._feature(int(feat), bytes(body[8:]))
            elif rtype == RecordType.HEADER_BUILD_ID:
                self.build_ids.append(_build_id_entry(misc, body))
            elif rtype in (RecordType.COMPRESSED, RecordType.COMPRESSED2):
                self.errors["compressed_unsupported"] += 1
        except _PARSE_ERRORS:
            self.errors[f"{_record_name(rtype)}_corrupt"] += 1

    # -- data

    def records(self) -> Iterator[records.Record]:
        """Every record of the data section (file mode) or stream (pipe mode), in order."""
        if self.pipe_mode:
            if self._consumed:
                raise PerfDataError("a pipe-mode stream can be read only once")
            self._consumed = True
            framer = _Framer(self._stream, None, self._stats, self.errors)
        else:
            self._stream.seek(self._base + self.data_offset)
            framer = _Framer(self._stream, self.data_size, self._stats, self.errors)
        for rtype, misc, body in framer.frames():
            if rtype >= RecordType.HEADER_ATTR:
                self._user_record(rtype, misc, body)
            yield self.decoder.decode_one(rtype, misc, body)


def _record_name(rtype: int) -> str:
    try:
        return RecordType(rtype).name.lower()
    except ValueError:
        return f"type{rtype}"
