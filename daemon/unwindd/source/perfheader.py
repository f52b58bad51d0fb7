"""The header side of perf.data: file header, attrs, feature sections and build-id records.

Invariants:
- Sans-IO: every function here takes bytes and returns values; ``perfdata.PerfData`` does the
  reading and decides what an error costs.
- A main header we cannot read at all (bad magic, a size no header has) raises
  ``PerfDataError`` with a message (``header_size``). Every other parser raises only the
  exceptions in ``PARSE_ERRORS`` on bad bytes, which the reader turns into a count.
- Every length and count read from the input is checked against the bytes at hand before it
  is used to slice or allocate (an attr against ``MAX_ATTR_SIZE``, EVENT_DESC's ``nr`` against
  the section), so an absurd field is an error, never a large allocation.
- Cost: O(section size) per section, one pass each.

Layouts follow tools/perf/util/header.{h,c} (perf 6.1), tools/lib/perf/include/perf/event.h
and include/uapi/linux/perf_event.h (Linux 6.x), written out above each parser. Only
little-endian files are read: perf writes host byte order, and the daemon runs on the host
that recorded. A byte-swapped magic is a ``PerfDataError`` that says so.
"""

from __future__ import annotations

import struct
from enum import IntEnum

from ..lightdc import dataclass
from .abi import MISC_BUILD_ID_SIZE
from .formats import EventFormat

__all__ = [
    "ATTR_SIZE_VER0",
    "FILE_HEADER",
    "FILE_HEADER_SIZE",
    "FILE_MAGIC",
    "MAX_ATTR_SIZE",
    "OLD_FILE_HEADER_SIZE",
    "PARSE_ERRORS",
    "PIPE_HEADER_SIZE",
    "SECTION",
    "AttrInfo",
    "BuildIdEntry",
    "Feature",
    "PerfDataError",
    "feature_name",
    "header_size",
    "parse_attr",
    "parse_attr_record",
    "parse_build_id_record",
    "parse_build_ids",
    "parse_event_desc",
    "parse_perf_string",
    "parse_string_list",
]

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
FILE_HEADER = struct.Struct("<8sQQQQQQQQ32s")
FILE_HEADER_SIZE = FILE_HEADER.size  # 104
OLD_FILE_HEADER_SIZE = 72
PIPE_HEADER_SIZE = 16
SECTION = struct.Struct("<QQ")
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
MAX_ATTR_SIZE = 4096  # the kernel's own limit is a page


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


def feature_name(n: int) -> str:
    try:
        return Feature(n).name.lower()
    except ValueError:
        return f"feature{n}"


class PerfDataError(Exception):
    """The input is not a perf.data stream we can read at all (bad main header)."""


class _Corrupt(Exception):
    """A section or record body that does not parse; becomes a count, never escapes."""


PARSE_ERRORS = (_Corrupt, struct.error, IndexError, ValueError, UnicodeError, OverflowError)


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class AttrInfo:
    """One event of the recording: its record layout, identity, ids and (if known) name.

    ``name`` comes from HEADER_EVENT_DESC; it is "" when the file has none."""

    fmt: EventFormat
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


def header_size(head: bytes) -> int:
    """The ``size`` field of the 16 bytes every perf.data stream opens with (``magic, size``):
    ``PIPE_HEADER_SIZE`` for pipe mode, else a file header's size. Raises ``PerfDataError`` for
    a magic we do not read or a size no header has."""
    magic, size = struct.unpack_from("<8sQ", head)
    if magic == _SWAPPED_MAGIC:
        raise PerfDataError("perf.data from a host of the other byte order: not supported")
    if magic == _V1_MAGIC:
        raise PerfDataError("perf.data version 1 (magic PERFFILE): not supported")
    if magic != FILE_MAGIC:
        raise PerfDataError(f"not perf.data: magic {magic!r}, expected {FILE_MAGIC!r}")
    if size not in (PIPE_HEADER_SIZE, FILE_HEADER_SIZE, OLD_FILE_HEADER_SIZE):
        raise PerfDataError(f"bad perf.data header size {size}")
    return int(size)


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


def parse_attr(raw: bytes | memoryview) -> tuple[EventFormat, int, int, int, int, int]:
    """Parse a ``perf_event_attr`` (layout above) from the start of ``raw``.

    Returns (format, type, config, attr size, sample_stack_user, flags). The attr's own
    ``size`` decides how much of ``raw`` is the attr (0 means PERF_ATTR_SIZE_VER0, as in perf's
    read_attr); fields past it are zero."""
    if len(raw) < ATTR_SIZE_VER0:
        raise _Corrupt("attr shorter than PERF_ATTR_SIZE_VER0")
    size = _U32.unpack_from(raw, 4)[0] or ATTR_SIZE_VER0
    if size < ATTR_SIZE_VER0 or size > min(len(raw), MAX_ATTR_SIZE):
        raise _Corrupt("bad attr size")
    body = bytes(raw[:size]).ljust(136, b"\0")
    atype, _, config, _, sample_type, read_format, flags = _ATTR_HEAD.unpack_from(body, 0)

    def u64(off: int) -> int:
        return int(_U64.unpack_from(body, off)[0])

    fmt = EventFormat(
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


def parse_build_id_record(misc: int, body: bytes | memoryview) -> BuildIdEntry:
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
        out.append(parse_build_id_record(misc, data[off + 8 : off + size]))
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
    if attr_size < ATTR_SIZE_VER0 or attr_size > MAX_ATTR_SIZE:
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


def parse_string_list(data: bytes | memoryview) -> tuple[str, ...]:
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


def parse_attr_record(body: memoryview) -> tuple[EventFormat, int, int, tuple[int, ...],
                                            int, int]:  # fmt: skip
    # PERF_RECORD_HEADER_ATTR (tools/lib/perf/include/perf/event.h):
    #   struct perf_record_header_attr { struct perf_event_header header;
    #                                    struct perf_event_attr attr;   // attr.size bytes
    #                                    u64 id[]; };                   // up to header.size
    fmt, atype, config, size, stack_user, flags = parse_attr(body)
    nids = (len(body) - size) // 8
    ids = struct.unpack_from(f"<{nids}Q", body, size)
    return fmt, atype, config, tuple(int(i) for i in ids), stack_user, flags
