"""Builders of exact perf record bytes, for tests.

Invariants:
- Independent of ``unwindd.source.decoder``: every layout is written out here, field by field, from
  ``include/uapi/linux/perf_event.h`` (Linux 6.x) and perf's ``tools/lib/perf/include/perf/
  event.h``; the numbers are repeated (not imported from ``unwindd.source.abi``) so a wrong constant
  there shows up as a test failure instead of agreeing with itself.
- Little-endian (x86_64, arm64 as run). Every record is a multiple of 8 bytes, as the kernel
  writes them (strings are NUL-terminated and padded to u64, ``perf_event_comm_event`` /
  ``perf_event_mmap_event``).
- ``header.size`` is computed, never passed, except by ``raw_record`` (for broken records).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

# enum perf_event_type (perf_event.h) and enum perf_user_event_type (perf/event.h).
MMAP = 1
LOST = 2
COMM = 3
EXIT = 4
THROTTLE = 5
UNTHROTTLE = 6
FORK = 7
SAMPLE = 9
MMAP2 = 10
LOST_SAMPLES = 13
KSYMBOL = 17
FINISHED_ROUND = 68

# enum perf_event_sample_format
S_IP = 1 << 0
S_TID = 1 << 1
S_TIME = 1 << 2
S_ADDR = 1 << 3
S_READ = 1 << 4
S_CALLCHAIN = 1 << 5
S_ID = 1 << 6
S_CPU = 1 << 7
S_PERIOD = 1 << 8
S_STREAM_ID = 1 << 9
S_RAW = 1 << 10
S_REGS_USER = 1 << 12
S_STACK_USER = 1 << 13
S_IDENTIFIER = 1 << 16

# perf_event_header.misc bits
MISC_USER = 2
MISC_COMM_EXEC = 1 << 13
MISC_MMAP_BUILD_ID = 1 << 14

PAD_BYTE = 0xEE  # filler for the part of a stack dump the kernel did not copy


def u8(v: int) -> bytes:
    return struct.pack("<B", v)


def u16(v: int) -> bytes:
    return struct.pack("<H", v)


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def cstr_padded(s: str | bytes) -> bytes:
    """NUL-terminated, zero-padded to a multiple of 8 (kernel: ``ALIGN(strlen + 1, u64)``)."""
    raw = s.encode() if isinstance(s, str) else s
    raw += b"\0"
    return raw + b"\0" * (-len(raw) % 8)


def header(rtype: int, misc: int, size: int) -> bytes:
    # struct perf_event_header { u32 type; u16 misc; u16 size; };  size counts the header
    return u32(rtype) + u16(misc) + u16(size)


def raw_record(rtype: int, misc: int, body: bytes, size: int | None = None) -> bytes:
    """Header + body; ``size`` overrides the computed size (to build broken records)."""
    return header(rtype, misc, 8 + len(body) if size is None else size) + body


@dataclass(frozen=True)
class Sid:
    """Values for a ``struct sample_id`` trailer; which ones are written is up to sample_type."""

    pid: int = 0
    tid: int = 0
    time: int = 0
    id: int = 0
    stream_id: int = 0
    cpu: int = 0


def sample_id(sample_type: int, sid: Sid | None) -> bytes:
    """The ``sample_id`` trailer of a non-SAMPLE record (``sample_id_all``); b"" if ``sid`` is
    None (attr without sample_id_all)."""
    if sid is None:
        return b""
    out = b""
    if sample_type & S_TID:
        out += u32(sid.pid) + u32(sid.tid)  # { u32 pid, tid; }
    if sample_type & S_TIME:
        out += u64(sid.time)  # { u64 time; }
    if sample_type & S_ID:
        out += u64(sid.id)  # { u64 id; }
    if sample_type & S_STREAM_ID:
        out += u64(sid.stream_id)  # { u64 stream_id; }
    if sample_type & S_CPU:
        out += u32(sid.cpu) + u32(0)  # { u32 cpu, res; }
    if sample_type & S_IDENTIFIER:
        out += u64(sid.id)  # { u64 id; }
    return out


# --------------------------------------------------------------------------- SAMPLE


def sample(
    sample_type: int,
    *,
    misc: int = MISC_USER,
    ip: int = 0,
    pid: int = 0,
    tid: int = 0,
    time: int = 0,
    addr: int = 0,
    id: int = 0,
    stream_id: int = 0,
    cpu: int = 0,
    period: int = 0,
    read: Sequence[int] = (),
    callchain: Sequence[int] = (),
    callchain_nr: int | None = None,
    raw: bytes = b"",
    regs_abi: int = 2,
    regs: Sequence[int] = (),
    stack: bytes = b"",
    stack_size: int | None = None,
    dyn_size: int | None = None,
) -> bytes:
    """PERF_RECORD_SAMPLE, fields in perf_event.h order. ``stack`` is what the kernel copied
    (``dyn_size`` bytes); the dump is padded with PAD_BYTE to ``stack_size`` (default: the
    stack length rounded up to 8). ``callchain_nr``/``dyn_size`` override the counts to build
    broken records."""
    b = b""
    if sample_type & S_IDENTIFIER:
        b += u64(id)  # { u64 id; } && PERF_SAMPLE_IDENTIFIER
    if sample_type & S_IP:
        b += u64(ip)  # { u64 ip; } && PERF_SAMPLE_IP
    if sample_type & S_TID:
        b += u32(pid) + u32(tid)  # { u32 pid, tid; } && PERF_SAMPLE_TID
    if sample_type & S_TIME:
        b += u64(time)  # { u64 time; } && PERF_SAMPLE_TIME
    if sample_type & S_ADDR:
        b += u64(addr)  # { u64 addr; } && PERF_SAMPLE_ADDR
    if sample_type & S_ID:
        b += u64(id)  # { u64 id; } && PERF_SAMPLE_ID
    if sample_type & S_STREAM_ID:
        b += u64(stream_id)  # { u64 stream_id; } && PERF_SAMPLE_STREAM_ID
    if sample_type & S_CPU:
        b += u32(cpu) + u32(0)  # { u32 cpu, res; } && PERF_SAMPLE_CPU
    if sample_type & S_PERIOD:
        b += u64(period)  # { u64 period; } && PERF_SAMPLE_PERIOD
    if sample_type & S_READ:
        # { struct read_format values; } && PERF_SAMPLE_READ: the caller lays out the u64s,
        # since their meaning depends on attr.read_format (see ``read_format`` below).
        b += b"".join(u64(v) for v in read)
    if sample_type & S_CALLCHAIN:
        # { u64 nr; u64 ips[nr]; } && PERF_SAMPLE_CALLCHAIN
        b += u64(len(callchain) if callchain_nr is None else callchain_nr)
        b += b"".join(u64(ip_) for ip_ in callchain)
    if sample_type & S_RAW:
        # { u32 size; char data[size]; } && PERF_SAMPLE_RAW; the kernel pads data so that
        # size + data keeps the u64 alignment, and size counts the padding.
        data = raw + b"\0" * (-(4 + len(raw)) % 8)
        b += u32(len(data)) + data
    if sample_type & S_REGS_USER:
        # { u64 abi; u64 regs[hweight64(mask)]; } && PERF_SAMPLE_REGS_USER; abi 0 = no regs
        b += u64(regs_abi)
        if regs_abi:
            b += b"".join(u64(r) for r in regs)
    if sample_type & S_STACK_USER:
        # { u64 size; char data[size]; u64 dyn_size; } && PERF_SAMPLE_STACK_USER;
        # size 0 (kernel thread, no regs) means neither data nor dyn_size follow.
        size = (len(stack) + 7) // 8 * 8 if stack_size is None else stack_size
        b += u64(size)
        if size:
            b += stack[:size] + bytes([PAD_BYTE]) * (size - len(stack[:size]))
            b += u64(len(stack) if dyn_size is None else dyn_size)
    return raw_record(SAMPLE, misc, b)


# --------------------------------------------------------------------------- side band


def mmap(
    *,
    pid: int,
    tid: int,
    addr: int,
    length: int,
    pgoff: int,
    filename: str,
    misc: int = MISC_USER,
    sample_type: int = 0,
    sid: Sid | None = None,
) -> bytes:
    """PERF_RECORD_MMAP."""
    body = (
        u32(pid) + u32(tid)  # u32 pid, tid;
        + u64(addr)  # u64 addr;
        + u64(length)  # u64 len;
        + u64(pgoff)  # u64 pgoff;
        + cstr_padded(filename)  # char filename[];
        + sample_id(sample_type, sid)  # struct sample_id sample_id;
    )  # fmt: skip
    return raw_record(MMAP, misc, body)


def _mmap2_head(pid: int, tid: int, addr: int, length: int, pgoff: int) -> bytes:
    return (
        u32(pid) + u32(tid)  # u32 pid, tid;
        + u64(addr)  # u64 addr;
        + u64(length)  # u64 len;
        + u64(pgoff)  # u64 pgoff;
    )  # fmt: skip


def _mmap2_tail(prot: int, flags: int, filename: str, sample_type: int, sid: Sid | None) -> bytes:
    return (
        u32(prot) + u32(flags)  # u32 prot, flags;
        + cstr_padded(filename)  # char filename[];
        + sample_id(sample_type, sid)  # struct sample_id sample_id;
    )  # fmt: skip


def mmap2_inode(
    *,
    pid: int,
    tid: int,
    addr: int,
    length: int,
    pgoff: int,
    maj: int,
    min: int,
    ino: int,
    ino_generation: int,
    prot: int,
    flags: int,
    filename: str,
    misc: int = MISC_USER,
    sample_type: int = 0,
    sid: Sid | None = None,
) -> bytes:
    """PERF_RECORD_MMAP2, inode form (misc without PERF_RECORD_MISC_MMAP_BUILD_ID)."""
    ident = (
        u32(maj) + u32(min)  # u32 maj, min;
        + u64(ino)  # u64 ino;
        + u64(ino_generation)  # u64 ino_generation;
    )  # fmt: skip
    body = _mmap2_head(pid, tid, addr, length, pgoff) + ident
    body += _mmap2_tail(prot, flags, filename, sample_type, sid)
    return raw_record(MMAP2, misc, body)


def mmap2_build_id(
    *,
    pid: int,
    tid: int,
    addr: int,
    length: int,
    pgoff: int,
    build_id: bytes,
    prot: int,
    flags: int,
    filename: str,
    build_id_size: int | None = None,
    misc: int = MISC_USER,
    sample_type: int = 0,
    sid: Sid | None = None,
) -> bytes:
    """PERF_RECORD_MMAP2, build-id form (kernel >= 5.12, misc has MISC_MMAP_BUILD_ID)."""
    assert len(build_id) <= 20
    ident = (
        u8(len(build_id) if build_id_size is None else build_id_size)  # u8 build_id_size;
        + u8(0)  # u8 __reserved_1;
        + u16(0)  # u16 __reserved_2;
        + build_id + b"\0" * (20 - len(build_id))  # u8 build_id[20];
    )  # fmt: skip
    body = _mmap2_head(pid, tid, addr, length, pgoff) + ident
    body += _mmap2_tail(prot, flags, filename, sample_type, sid)
    return raw_record(MMAP2, misc | MISC_MMAP_BUILD_ID, body)


def comm(
    *,
    pid: int,
    tid: int,
    comm: str,
    exec: bool = False,
    misc: int = 0,
    sample_type: int = 0,
    sid: Sid | None = None,
) -> bytes:
    """PERF_RECORD_COMM; ``exec`` sets PERF_RECORD_MISC_COMM_EXEC."""
    body = (
        u32(pid) + u32(tid)  # u32 pid, tid;
        + cstr_padded(comm)  # char comm[];
        + sample_id(sample_type, sid)  # struct sample_id sample_id;
    )  # fmt: skip
    return raw_record(COMM, misc | (MISC_COMM_EXEC if exec else 0), body)


def _task(
    rtype: int, pid: int, ppid: int, tid: int, ptid: int, time: int, sample_type: int,
    sid: Sid | None,
) -> bytes:  # fmt: skip
    body = (
        u32(pid) + u32(ppid)  # u32 pid, ppid;
        + u32(tid) + u32(ptid)  # u32 tid, ptid;
        + u64(time)  # u64 time;
        + sample_id(sample_type, sid)  # struct sample_id sample_id;
    )  # fmt: skip
    return raw_record(rtype, 0, body)


def fork(
    *, pid: int, ppid: int, tid: int, ptid: int, time: int, sample_type: int = 0,
    sid: Sid | None = None,
) -> bytes:  # fmt: skip
    """PERF_RECORD_FORK."""
    return _task(FORK, pid, ppid, tid, ptid, time, sample_type, sid)


def exit(
    *, pid: int, ppid: int, tid: int, ptid: int, time: int, sample_type: int = 0,
    sid: Sid | None = None,
) -> bytes:  # fmt: skip
    """PERF_RECORD_EXIT (same layout as FORK)."""
    return _task(EXIT, pid, ppid, tid, ptid, time, sample_type, sid)


def lost(*, id: int, lost: int, sample_type: int = 0, sid: Sid | None = None) -> bytes:
    """PERF_RECORD_LOST."""
    body = (
        u64(id)  # u64 id;
        + u64(lost)  # u64 lost;
        + sample_id(sample_type, sid)  # struct sample_id sample_id;
    )  # fmt: skip
    return raw_record(LOST, 0, body)


def lost_samples(*, lost: int, sample_type: int = 0, sid: Sid | None = None) -> bytes:
    """PERF_RECORD_LOST_SAMPLES."""
    body = u64(lost) + sample_id(sample_type, sid)  # u64 lost; struct sample_id sample_id;
    return raw_record(LOST_SAMPLES, 0, body)


def throttle(
    *, time: int, id: int, stream_id: int, unthrottle: bool = False, sample_type: int = 0,
    sid: Sid | None = None,
) -> bytes:  # fmt: skip
    """PERF_RECORD_THROTTLE / PERF_RECORD_UNTHROTTLE."""
    body = (
        u64(time)  # u64 time;
        + u64(id)  # u64 id;
        + u64(stream_id)  # u64 stream_id;
        + sample_id(sample_type, sid)  # struct sample_id sample_id;
    )  # fmt: skip
    return raw_record(UNTHROTTLE if unthrottle else THROTTLE, 0, body)


def finished_round() -> bytes:
    """PERF_RECORD_FINISHED_ROUND: a bare header (perf's ``perf_record_header_finished_round``)."""
    return header(FINISHED_ROUND, 0, 8)


def read_format(
    *, value: int = 0, enabled: int | None = None, running: int | None = None,
    id: int | None = None, lost: int | None = None,
    group: Sequence[tuple[int, int | None, int | None]] | None = None,
) -> list[int]:  # fmt: skip
    """The u64s of ``struct read_format`` (perf_event.h), optional fields present when given:

    not GROUP: { u64 value; {u64 time_enabled;} {u64 time_running;} {u64 id;} {u64 lost;} }
    GROUP:     { u64 nr; {u64 time_enabled;} {u64 time_running;}
                 { u64 value; {u64 id;} {u64 lost;} } cntr[nr]; }   (group = [(value, id, lost)])
    """
    times = [v for v in (enabled, running) if v is not None]
    if group is None:
        return [value, *times, *(v for v in (id, lost) if v is not None)]
    out = [len(group), *times]
    for v, gid, glost in group:
        out += [v, *(x for x in (gid, glost) if x is not None)]
    return out


# --------------------------------------------------------------------------- a whole file

SAMPLE_ID_ALL = 1 << 18  # perf_event_attr flags bit: sample_id_all


def perf_data_file(sample_type: int, data: bytes, *, flags: int = SAMPLE_ID_ALL,
                   sample_regs_user: int = 0) -> bytes:  # fmt: skip
    """A perf.data file (tools/perf/util/header.h ``perf_file_header``, 104 bytes) of one
    event (``perf_event_attr`` VER8, 136 bytes: type 1 (software), sample_period 999,
    ``sample_type``, ``flags``, ``sample_regs_user`` at 80; its ids section one id, 7) whose
    data section is ``data``; no feature sections. Layout: [0, 104) header | [104, 112) the
    id | [112, 264) attr + its ids section {offset, size} | data."""
    attr = bytearray(136)
    struct.pack_into("<IIQQQQQ", attr, 0, 1, 136, 0, 999, sample_type, 0, flags)
    struct.pack_into("<Q", attr, 80, sample_regs_user)
    entry = bytes(attr) + u64(104) + u64(8)
    hdr = (
        b"PERFILE2"  # u64 magic;
        + u64(104)  # u64 size;
        + u64(len(entry))  # u64 attr_size;
        + u64(112) + u64(len(entry))  # struct perf_file_section attrs;
        + u64(112 + len(entry)) + u64(len(data))  # struct perf_file_section data;
        + u64(0) + u64(0)  # struct perf_file_section event_types;
        + bytes(32)  # DECLARE_BITMAP(adds_features, HEADER_FEAT_BITS);
    )  # fmt: skip
    return hdr + u64(7) + entry + data
