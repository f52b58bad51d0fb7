"""The record decoder: whole perf records (bytes) to ``records`` values, and what it saw.

Both the live rings and perf.data files produce this one stream; ``RecordDecoder`` decodes it
for one or more ``formats.EventFormat`` and counts into ``DecodeStats``.

Invariants:
- Sans-IO: ``RecordDecoder.decode`` takes bytes and yields frozen record values; it never reads
  files, rings or clocks.
- Every record in the input becomes exactly one output value: a typed record, an ``Unknown``
  (a type we do not model), or a ``BadRecord`` (its header is sane but its body is not). Nothing
  is silently dropped, and every ``BadRecord`` and every unsplittable tail is counted in
  ``DecodeStats``.
- A header whose size is < 8 or reaches past the end of the buffer ends the buffer (there is
  no way to resynchronise a byte stream of variable-size records): the rest is counted as one
  ``truncated`` error. So decoding always terminates, after at most ``len(buf) / 8`` records.
- Cost: O(record size) per record; the only copies are the stack dump and strings.

Layouts follow ``include/uapi/linux/perf_event.h`` (Linux 6.x). Every record starts with::

    struct perf_event_header { u32 type; u16 misc; u16 size; };   // size includes the header

and, when ``attr.sample_id_all`` is set, every non-SAMPLE kernel record ends with a
``struct sample_id`` trailer (its layout: ``formats``).
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Iterator, Sequence

from ..lightdc import dataclass, field
from .abi import MISC_MMAP_BUILD_ID, RecordType, SampleType
from .formats import NONE1, EventFormat, SampleIdLayout, SampleLayout
from .records import (
    NO_SAMPLE_ID,
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
    frozen_maker,
    record_type_name,
)

_HDR = struct.Struct("<IHH")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_2U32 = struct.Struct("<II")
_3U64 = struct.Struct("<QQQ")
_MMAP_FIXED = struct.Struct("<IIQQQ")  # pid, tid, addr, len, pgoff
_MMAP2_PROT = struct.Struct("<II")  # prot, flags
# the whole fixed part of the inode form: pid, tid, addr, len, pgoff, maj, min, ino,
# ino_generation, prot, flags (64 bytes)
_MMAP2_INODE_FIXED = struct.Struct("<IIQQQIIQQII")
_FORK = struct.Struct("<IIIIQ")  # pid, ppid, tid, ptid, time

HEADER_SIZE = 8
# perf_event_header.size is a u16, so no record is larger than this: a buffer at least this big
# can always take the next record of an otherwise empty output.
MAX_RECORD_SIZE = 1 << 16
_T_SAMPLE = int(RecordType.SAMPLE)
_T_FINISHED_ROUND = int(RecordType.FINISHED_ROUND)
_T_HEADER_ATTR = int(RecordType.HEADER_ATTR)
_T_MMAP, _T_MMAP2 = int(RecordType.MMAP), int(RecordType.MMAP2)
_T_COMM, _T_FORK, _T_EXIT = int(RecordType.COMM), int(RecordType.FORK), int(RecordType.EXIT)


# ``DecodeStats.errors`` keys. The buffer: a tail shorter than a header or a record reaching
# past the end ("truncated"), a header size < 8. A record's body (``DecodeError`` reasons,
# ``BadRecord.reason``): too short for its layout, for its sample_id trailer, or for its
# registers; a count or size field past what the body holds or the kernel allows.
DECODE_ERRORS = (
    "truncated", "bad_size",
    "short_body", "short_sample_id", "short_regs", "bad_build_id_size", "bad_callchain_nr",
    "bad_raw_size", "bad_branch_nr", "bad_stack_size", "bad_dyn_size",
)  # fmt: skip


class DecodeError(Exception):
    """A record body that does not match its attr's layout."""


# The hot side-band records and trailers are built by frozen_maker's constructors in the
# decoder (process churn makes millions of them); values are those of __init__.
_new_sample_id = frozen_maker(SampleId)
_new_mmap2 = frozen_maker(Mmap2)
_new_comm = frozen_maker(Comm)
_new_fork = frozen_maker(Fork)
_new_exit = frozen_maker(Exit)


# --------------------------------------------------------------------------- decoder


@dataclass
class DecodeStats:
    """What a decoder has seen: records by type name, errors by reason, repairs by defect."""

    records: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    # Records decoded after undoing a known kernel defect (nothing lost), by defect.
    repairs: Counter[str] = field(default_factory=Counter)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


def _cstr(buf: bytes | memoryview, start: int, end: int) -> str:
    return bytes(buf[start:end]).partition(b"\0")[0].decode("utf-8", "surrogateescape")


class RecordDecoder:
    """Turns a buffer of whole perf records into record values, for one or more event formats.

    With several formats (a perf.data file with several attrs), each record's event id picks
    the format, located the way perf does it (``id_pos``/``is_pos``, which must agree across
    formats); ``ids`` maps every id to its format's index.
    """

    def __init__(
        self,
        formats: Sequence[EventFormat],
        ids: dict[int, int] | None = None,
    ) -> None:
        if not formats:
            raise ValueError("at least one event format is needed")
        self.formats = tuple(formats)
        self.ids = dict(ids or {})
        self.stats = DecodeStats()
        self._default = self.formats[0]
        self._layouts = [SampleLayout.of(f) for f in self.formats]
        self._sid_layouts = [SampleIdLayout.of(f) for f in self.formats]
        # perf refuses mixed id positions (evlist__valid_sample_type); we do the same by
        # falling back to the first format when they disagree.
        self._id_pos = self._default.id_pos
        self._is_pos = self._default.is_pos
        if len(self.formats) > 1 and any(
            f.id_pos != self._id_pos or f.is_pos != self._is_pos for f in self.formats
        ):
            self._id_pos = self._is_pos = -1
        self._multi = len(self.formats) > 1  # else every record has format 0
        # every format lays the sample_id trailer out alike (perf -a's dummy event does): which
        # format a non-SAMPLE record's id picks cannot change its decoding (decode_quiet)
        self._sid_alike = len({(lay.struct.format, lay.i_pid, lay.i_time, lay.i_id,
                                lay.i_stream, lay.i_cpu) for lay in self._sid_layouts}) == 1
        # MMAP2 file names by their raw bytes (``decode_side_band``): churn maps the same few
        # files over and over (bounded: cleared past 4096 names)
        self._names: dict[bytes, str] = {}

    # -- format selection

    def _format_for_sample(self, body: memoryview) -> int:
        if len(self.formats) == 1 or self._id_pos < 0:
            return 0
        off = self._id_pos * 8
        if off + 8 > len(body):
            return 0
        (eid,) = _U64.unpack_from(body, off)
        return self.ids.get(eid, 0)

    def _format_for_other(self, body: memoryview) -> int:
        if len(self.formats) == 1 or self._is_pos < 0:
            return 0
        off = len(body) - self._is_pos * 8
        if off < 0:
            return 0
        (eid,) = _U64.unpack_from(body, off)
        return self.ids.get(eid, 0)

    def sample_id_trailer(self) -> tuple[int, int, int] | None:
        """(size, byte offset of time, byte offset of cpu; -1 if absent) of the sample_id
        trailer every non-SAMPLE record carries, when all formats lay it out alike (so the
        event id that picks a format cannot matter); else None. For native side-band scans."""
        lays = {(lay.struct.format, lay.i_time, lay.i_cpu) for lay in self._sid_layouts}
        if len(lays) != 1:
            return None
        fmt, i_time, i_cpu = lays.pop()

        def off(i: int) -> int:
            return struct.calcsize(fmt[: 1 + i]) if i >= 0 else -1

        return struct.calcsize(fmt), off(i_time), off(i_cpu)

    # -- entry points

    def decode(self, buf: bytes | bytearray | memoryview) -> Iterator[Record]:
        """Yield one value per record in ``buf`` (whole records, back to back)."""
        mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf.cast("B")
        n = len(mv)
        off = 0
        while off < n:
            if n - off < HEADER_SIZE:
                self.stats.errors["truncated"] += 1
                return
            rtype, misc, size = _HDR.unpack_from(mv, off)
            if size < HEADER_SIZE or off + size > n:
                self.stats.errors["truncated" if size >= HEADER_SIZE else "bad_size"] += 1
                return
            yield self.decode_one(rtype, misc, mv[off + HEADER_SIZE : off + size])
            off += size

    def decode_one(self, rtype: int, misc: int, body: memoryview) -> Record:
        """Decode one record's body (the bytes after its header)."""
        try:
            rec = self._decode(rtype, misc, body)
        except (DecodeError, struct.error, IndexError, UnicodeError, ValueError) as e:
            reason = str(e) if isinstance(e, DecodeError) else "short_body"
            self.stats.errors[reason] += 1
            return BadRecord(rtype, misc, len(body) + HEADER_SIZE, reason)
        self.stats.records[record_type_name(rec)] += 1
        return rec

    def decode_side_band(self, mv: memoryview, rows: list[int]
                         ) -> tuple[list[Record], list[int | None], list[int | None]]:  # fmt: skip
        """``decode_one`` of each record ``rows`` lists (flat: type, misc, offset of its header
        in ``mv``, size), in order: (the records, their times, their cpus), the same values
        and counts. One call for a round's side-band records: the common MMAP2 (inode form),
        FORK, EXIT and COMM of a single-format stream are unpacked here, their counts taken in
        bulk, their file names decoded once per distinct name (``_names``); anything else,
        or any body that does not fit its layout, is ``decode_one``'s."""
        out: list[Record] = []
        times: list[int | None] = []
        cpus: list[int | None] = []
        it = iter(rows)
        lay = self._sid_layouts[0]
        if self._multi or not lay.struct.size:  # (no trailer: decode_one's NO_SAMPLE_ID)
            for typ, misc, off, size in zip(it, it, it, it, strict=True):
                rec = self.decode_one(typ, misc, mv[off + HEADER_SIZE : off + size])
                out.append(rec)
                times.append(rec.time)
                cpus.append(rec.cpu)
            return out, times, cpus
        sid_size, sid_unpack, pick = lay.struct.size, lay.struct.unpack_from, lay.pick
        i_time, i_cpu = lay.i_time, lay.i_cpu
        mm2, fork, two = _MMAP2_INODE_FIXED.unpack_from, _FORK.unpack_from, _2U32.unpack_from
        names = self._names
        n_mmap2 = n_fork = n_exit = n_comm = 0
        for typ, misc, off, size in zip(it, it, it, it, strict=True):
            b = off + HEADER_SIZE
            end = size - HEADER_SIZE - sid_size  # the fixed part and strings: [b, b + end)
            try:
                if typ == _T_MMAP2 and end >= 64 and not misc & MISC_MMAP_BUILD_ID:
                    v = sid_unpack(mv, b + end)
                    pid, tid, addr, length, pgoff, maj, mnr, ino, gen, prot, flags = mm2(mv, b)
                    raw = mv[b + 64 : b + end].tobytes()
                    name = names.get(raw)
                    if name is None:
                        name = raw.partition(b"\0")[0].decode("utf-8", "surrogateescape")
                        if len(names) >= 4096:
                            names.clear()
                        names[raw] = name
                    rec = _new_mmap2(misc, pid, tid, addr, length, pgoff, maj, mnr, ino, gen,
                                     None, prot, flags, name,
                                     _new_sample_id(*pick(v + NONE1)))  # fmt: skip
                    n_mmap2 += 1
                elif (typ == _T_FORK or typ == _T_EXIT) and end >= 24:
                    v = sid_unpack(mv, b + end)
                    pid, ppid, tid, ptid, time = fork(mv, b)
                    make = _new_fork if typ == _T_FORK else _new_exit
                    rec = make(misc, pid, ppid, tid, ptid, time, _new_sample_id(*pick(v + NONE1)))
                    if typ == _T_FORK:
                        n_fork += 1
                    else:
                        n_exit += 1
                elif typ == _T_COMM and end >= 8:
                    v = sid_unpack(mv, b + end)
                    pid, tid = two(mv, b)
                    comm = _cstr(mv, b + 8, b + end)
                    rec = _new_comm(misc, pid, tid, comm, _new_sample_id(*pick(v + NONE1)))
                    n_comm += 1
                else:
                    rec = self.decode_one(typ, misc, mv[b : off + size])
                    out.append(rec)
                    times.append(rec.time)
                    cpus.append(rec.cpu)
                    continue
            except (struct.error, UnicodeError, ValueError):
                rec = self.decode_one(typ, misc, mv[b : off + size])  # its error, counted
                out.append(rec)
                times.append(rec.time)
                cpus.append(rec.cpu)
                continue
            out.append(rec)
            times.append(rec.time if typ == _T_FORK or typ == _T_EXIT  # (its body's time)
                         else v[i_time] if i_time >= 0 else None)  # fmt: skip
            cpus.append(v[i_cpu] if i_cpu >= 0 else None)
        counts = self.stats.records
        for name, k in (("MMAP2", n_mmap2), ("FORK", n_fork), ("EXIT", n_exit), ("COMM", n_comm)):
            if k:
                counts[name] += k
        return out, times, cpus

    def redecode(self, rtype: int, misc: int, body: memoryview) -> Record:
        """``decode_one`` again for a record already decoded (and counted) once: the same
        value, nothing counted. Lets a caller drop decoded records it will need later
        (filereplay holds raw bytes, not thousands of objects)."""
        stats = self.stats
        self.stats = DecodeStats()
        try:
            return self.decode_one(rtype, misc, body)
        finally:
            self.stats = stats

    def decode_quiet(self, rtype: int, misc: int, body: memoryview) -> Record:
        """The value ``decode_one`` gives, nothing counted: for a record whose counts were
        taken in bulk and that decodes without error or repair (a MMAP2 ``unw_sb_lazy`` of
        sideband.c listed); any other record is decoded by ``redecode``. One decode, no
        stats swapped in and out."""
        if rtype == _T_MMAP2 and not misc & MISC_MMAP_BUILD_ID:
            lay = self._sid_layouts[0]
            end = len(body) - lay.struct.size
            if self._sid_alike and end >= 64:
                # (decode_side_band's MMAP2: one unpack each, the name decoded once per name)
                pid, tid, addr, length, pgoff, maj, mnr, ino, gen, prot, flags = (
                    _MMAP2_INODE_FIXED.unpack_from(body, 0))  # fmt: skip
                sid = _new_sample_id(*lay.pick(lay.struct.unpack_from(body, end) + NONE1)
                                     ) if lay.struct.size else NO_SAMPLE_ID  # fmt: skip
                raw = body[64:end].tobytes()
                names = self._names
                name = names.get(raw)
                if name is None:
                    name = raw.partition(b"\0")[0].decode("utf-8", "surrogateescape")
                    if len(names) >= 4096:
                        names.clear()
                    names[raw] = name
                return _new_mmap2(misc, pid, tid, addr, length, pgoff, maj, mnr, ino, gen, None,
                                  prot, flags, name, sid)  # fmt: skip
            try:
                return self._decode(rtype, misc, body)
            except (DecodeError, struct.error, IndexError, UnicodeError, ValueError):
                pass  # not one it was meant for: redecode's answer
        return self.redecode(rtype, misc, body)

    # -- per type

    def _decode(self, rtype: int, misc: int, body: memoryview) -> Record:
        # Plain-int type constants (_T_*): an IntEnum member lookup per comparison costs more
        # than the comparison; side-band types are tested in order of frequency under churn.
        if rtype == _T_SAMPLE:
            return self.decode_sample(misc, body)
        if rtype == _T_FINISHED_ROUND:
            return FinishedRound(misc)
        if rtype >= _T_HEADER_ATTR:
            # perf's own synthesized records never carry a sample_id trailer.
            return Unknown(rtype, misc, bytes(body))
        fmt_idx = self._format_for_other(body) if self._multi else 0
        lay = self._sid_layouts[fmt_idx]
        sid_size = lay.struct.size
        n = len(body)
        if sid_size > n:
            raise DecodeError("short_sample_id")
        end = n - sid_size
        sid = (_new_sample_id(*lay.pick(lay.struct.unpack_from(body, end) + NONE1)) if sid_size
               else NO_SAMPLE_ID)  # fmt: skip
        if rtype == _T_MMAP2:
            if misc & MISC_MMAP_BUILD_ID and not self._mmap2_build_id_form(
                self.formats[fmt_idx], body, end
            ):
                self.stats.repairs["mmap2_leaked_build_id_flag"] += 1
                misc &= ~MISC_MMAP_BUILD_ID
            return self._mmap2(misc, body, end, sid)
        if rtype == _T_FORK or rtype == _T_EXIT:
            if end < _FORK.size:
                raise DecodeError("short_body")
            pid, ppid, tid, ptid, time = _FORK.unpack_from(body, 0)
            make = _new_fork if rtype == _T_FORK else _new_exit
            return make(misc, pid, ppid, tid, ptid, time, sid)
        if rtype == _T_COMM:
            if end < 8:
                raise DecodeError("short_body")
            pid, tid = _2U32.unpack_from(body, 0)
            return _new_comm(misc, pid, tid, _cstr(body, 8, end), sid)
        if rtype == _T_MMAP:
            if end < _MMAP_FIXED.size:
                raise DecodeError("short_body")
            pid, tid, addr, length, pgoff = _MMAP_FIXED.unpack_from(body, 0)
            return Mmap(misc, pid, tid, addr, length, pgoff, _cstr(body, 32, end), sid)
        if rtype == RecordType.LOST:
            if end < 16:
                raise DecodeError("short_body")
            eid, lost = struct.unpack_from("<QQ", body, 0)
            return Lost(misc, eid, lost, sid)
        if rtype == RecordType.LOST_SAMPLES:
            if end < 8:
                raise DecodeError("short_body")
            (lost,) = _U64.unpack_from(body, 0)
            return LostSamples(misc, lost, sid)
        if rtype in (RecordType.THROTTLE, RecordType.UNTHROTTLE):
            if end < 24:
                raise DecodeError("short_body")
            time, eid, stream = _3U64.unpack_from(body, 0)
            return Throttle(misc, rtype == RecordType.UNTHROTTLE, time, eid, stream, sid)
        return Unknown(rtype, misc, bytes(body[:end]), sid)

    def _sample_id(self, fmt_idx: int, body: memoryview, off: int) -> SampleId:
        lay = self._sid_layouts[fmt_idx]
        return _new_sample_id(*lay.pick(lay.struct.unpack_from(body, off) + NONE1))

    @staticmethod
    def _mmap2_build_id_form(fmt: EventFormat, body: memoryview, end: int) -> bool:
        """Whether a MMAP2 flagged PERF_RECORD_MISC_MMAP_BUILD_ID really holds a build-id: only
        an event that asked for build-ids gets one, and a real one is at most 20 bytes with
        zeroed reserved bytes (``u8 build_id_size, __reserved_1; u16 __reserved_2``) — inode
        data leaked under the flag (see ``EventFormat.build_id_mmap``) fails one of these."""
        if not fmt.build_id_mmap or end < 64:
            return False
        return body[32] <= 20 and body[33] == body[34] == body[35] == 0

    @staticmethod
    def _mmap2(misc: int, body: memoryview, end: int, sid: SampleId) -> Mmap2:
        #   u32 pid, tid; u64 addr, len, pgoff;                         (32 bytes)
        #   union { struct { u32 maj, min; u64 ino, ino_generation; };
        #           struct { u8 build_id_size, __reserved_1; u16 __reserved_2;
        #                    u8 build_id[20]; }; }                      (24 bytes)
        #   u32 prot, flags; char filename[];
        if end < 64:
            raise DecodeError("short_body")
        if not misc & MISC_MMAP_BUILD_ID:  # the common form: one unpack
            pid, tid, addr, length, pgoff, maj, mnr, ino, gen, prot, flags = (
                _MMAP2_INODE_FIXED.unpack_from(body, 0))  # fmt: skip
            name = bytes(body[64:end]).partition(b"\0")[0].decode("utf-8", "surrogateescape")
            return _new_mmap2(misc, pid, tid, addr, length, pgoff, maj, mnr, ino, gen, None,
                              prot, flags, name, sid)  # fmt: skip
        pid, tid, addr, length, pgoff = _MMAP_FIXED.unpack_from(body, 0)
        bsize = body[32]
        if bsize > 20:
            raise DecodeError("bad_build_id_size")
        build_id = bytes(body[36 : 36 + bsize])
        prot, flags = _MMAP2_PROT.unpack_from(body, 56)
        return _new_mmap2(misc, pid, tid, addr, length, pgoff, None, None, None, None, build_id,
                          prot, flags, _cstr(body, 64, end), sid)  # fmt: skip

    def decode_sample(self, misc: int, body: memoryview) -> Sample:
        lay = self._layouts[self._format_for_sample(body)]
        st = lay.sample_type
        n = len(body)
        # The fixed-size prefix (IDENTIFIER .. PERIOD, all u64 slots) in one unpack.
        off = lay.prefix.size
        if off > n:
            raise DecodeError("short_body")
        fixed = lay.prefix.unpack_from(body, 0)
        ip = fixed[lay.i_ip] if lay.i_ip >= 0 else None
        pid = tid = None
        if lay.i_tid >= 0:
            v = fixed[lay.i_tid]
            pid, tid = v & 0xFFFFFFFF, v >> 32
        time = fixed[lay.i_time] if lay.i_time >= 0 else None
        addr = fixed[lay.i_addr] if lay.i_addr >= 0 else None
        eid = fixed[lay.i_id] if lay.i_id >= 0 else None
        cpu = fixed[lay.i_cpu] & 0xFFFFFFFF if lay.i_cpu >= 0 else None
        period = fixed[lay.i_period] if lay.i_period >= 0 else None
        if st & _S_READ:
            if lay.read_group:
                # { u64 nr; {u64 time_enabled;} {u64 time_running;} {value, id, lost}[nr] }
                if off + 8 > n:
                    raise DecodeError("short_body")
                (nr,) = _U64.unpack_from(body, off)
                off += 8 + 8 * (lay.read_times + nr * lay.read_per_value)
            else:
                # { u64 value; {u64 time_enabled;} {u64 time_running;} {u64 id;} {u64 lost;} }
                off += 8 * (lay.read_times + lay.read_per_value)
            if off > n:
                raise DecodeError("short_body")
        callchain: tuple[int, ...] = ()
        if st & _S_CALLCHAIN:
            if off + 8 > n:
                raise DecodeError("short_body")
            (nr,) = _U64.unpack_from(body, off)
            off += 8
            if off + 8 * nr > n:
                raise DecodeError("bad_callchain_nr")
            callchain = struct.unpack_from(f"<{nr}Q", body, off)
            off += 8 * nr
        if st & _S_RAW:
            if off + 4 > n:
                raise DecodeError("short_body")
            (rsize,) = _U32.unpack_from(body, off)
            off += 4 + rsize  # u32 size + data, padded by the kernel to keep u64 alignment
            if off > n:
                raise DecodeError("bad_raw_size")
        if st & _S_BRANCH_STACK:
            # { u64 nr; {u64 hw_idx;} { u64 from, to, flags; } lbr[nr]; {u64 cntr[nr];} }
            if off + 8 > n:
                raise DecodeError("short_body")
            (nr,) = _U64.unpack_from(body, off)
            off += 8 + 8 * lay.branch_hw_index + (24 + 8 * lay.branch_counters) * nr
            if off > n:
                raise DecodeError("bad_branch_nr")
        regs_abi = 0
        regs: tuple[int, ...] = ()
        if st & _S_REGS_USER:
            # { u64 abi; u64 regs[hweight(sample_regs_user)]; } (regs only when abi != 0)
            if off + 8 > n:
                raise DecodeError("short_body")
            (regs_abi,) = _U64.unpack_from(body, off)
            off += 8
            if regs_abi:
                if off + lay.regs.size > n:
                    raise DecodeError("short_regs")
                regs = lay.regs.unpack_from(body, off)
                off += lay.regs.size
        stack = b""
        stack_size = 0
        if st & _S_STACK_USER:
            # { u64 size; char data[size]; u64 dyn_size; } (dyn_size only when size != 0)
            if off + 8 > n:
                raise DecodeError("short_body")
            (stack_size,) = _U64.unpack_from(body, off)
            off += 8
            if stack_size:
                if off + stack_size + 8 > n:
                    raise DecodeError("bad_stack_size")
                (dyn,) = _U64.unpack_from(body, off + stack_size)
                if dyn > stack_size:
                    raise DecodeError("bad_dyn_size")
                stack = bytes(body[off : off + dyn])
                off += stack_size + 8
        # WEIGHT, DATA_SRC, TRANSACTION, REGS_INTR, ... follow; we do not use them.
        return Sample(misc, pid, tid, time, cpu, ip, eid, period, callchain, regs_abi,
                      lay.regs_mask, regs, stack, stack_size, addr)  # fmt: skip


_S_READ = int(SampleType.READ)
_S_CALLCHAIN = int(SampleType.CALLCHAIN)
_S_RAW = int(SampleType.RAW)
_S_BRANCH_STACK = int(SampleType.BRANCH_STACK)
_S_REGS_USER = int(SampleType.REGS_USER)
_S_STACK_USER = int(SampleType.STACK_USER)
