"""Event formats and the record layouts compiled from them, once per format.

Invariants:
- ``EventFormat`` holds only the ``perf_event_attr`` fields that decide how that event's
  records are laid out (sample_type, read_format, branch_sample_type, regs masks,
  sample_id_all, build_id); nothing here reads bytes of a record.
- ``SampleLayout`` and ``SampleIdLayout`` are pure functions of one ``EventFormat``: the
  SAMPLE body's fixed u64 prefix (slot indices, -1 when absent) and the ``sample_id`` trailer
  as one ``struct``, so the decoder does no IntFlag arithmetic per record. ``mapfile`` hands
  the same ``SampleLayout`` numbers to the native indexer, so both paths read one layout.
- Cost: O(sample_type bits) to compile a format, paid once per format per decoder; none per
  record.

Layouts follow ``include/uapi/linux/perf_event.h`` (Linux 6.x). When ``attr.sample_id_all`` is
set, every non-SAMPLE kernel record ends with::

    struct sample_id {
        { u32 pid, tid; }  && PERF_SAMPLE_TID
        { u64 time;     }  && PERF_SAMPLE_TIME
        { u64 id;       }  && PERF_SAMPLE_ID
        { u64 stream_id;}  && PERF_SAMPLE_STREAM_ID
        { u32 cpu, res; }  && PERF_SAMPLE_CPU
        { u64 id;       }  && PERF_SAMPLE_IDENTIFIER
    };
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from operator import itemgetter
from typing import Any

from ..lightdc import dataclass, field
from .abi import BRANCH_COUNTERS, BRANCH_HW_INDEX, ReadFormat, SampleType


@dataclass(frozen=True, slots=True)
class EventFormat:
    """The parts of a ``perf_event_attr`` that decide how its records are laid out."""

    sample_type: int
    sample_regs_user: int = 0
    read_format: int = 0
    branch_sample_type: int = 0
    sample_regs_intr: int = 0
    sample_id_all: bool = True
    name: str = ""
    # attr.build_id: whether this event asked for build-id MMAP2 records. When it did not, a
    # MMAP2 carrying PERF_RECORD_MISC_MMAP_BUILD_ID still holds inode data: the kernel sets
    # that bit on the mmap event it shares between all events (kernel/events/core.c
    # perf_event_mmap_output: ``header.misc |= PERF_RECORD_MISC_MMAP_BUILD_ID`` for a
    # build-id event, never cleared for the events iterated after it), so it leaks into the
    # records of every other event while any build-id event is open on the machine.
    build_id_mmap: bool = False

    def __repr__(self) -> str:
        return (
            f"EventFormat({self.name!r}, sample_type={SampleType(self.sample_type)!r}, "
            f"regs_user={self.sample_regs_user:#x})"
        )

    @property
    def sample_id_size(self) -> int:
        st = self.sample_type
        if not self.sample_id_all:
            return 0
        n = 0
        for bit in (
            SampleType.TID,
            SampleType.TIME,
            SampleType.ID,
            SampleType.STREAM_ID,
            SampleType.CPU,
            SampleType.IDENTIFIER,
        ):
            if st & bit:
                n += 8
        return n

    @property
    def id_pos(self) -> int:
        """u64 index of the event id in a SAMPLE body, or -1 (perf's ``evsel->id_pos``)."""
        st = self.sample_type
        if st & SampleType.IDENTIFIER:
            return 0
        if not st & SampleType.ID:
            return -1
        idx = 0
        for bit in (SampleType.IP, SampleType.TID, SampleType.TIME, SampleType.ADDR):
            if st & bit:
                idx += 1
        return idx

    @property
    def is_pos(self) -> int:
        """u64 index, counted from the record's end (1 = last), of the id in a sample_id
        trailer, or -1 (perf's ``evsel->is_pos``)."""
        st = self.sample_type
        if st & SampleType.IDENTIFIER:
            return 1
        if not st & SampleType.ID:
            return -1
        idx = 1
        if st & SampleType.CPU:
            idx += 1
        if st & SampleType.STREAM_ID:
            idx += 1
        return idx


# The u64 slots that open a SAMPLE body, in order (perf_event.h, PERF_RECORD_SAMPLE).
_PREFIX_SLOTS = (
    SampleType.IDENTIFIER,
    SampleType.IP,
    SampleType.TID,
    SampleType.TIME,
    SampleType.ADDR,
    SampleType.ID,
    SampleType.STREAM_ID,
    SampleType.CPU,
    SampleType.PERIOD,
)


@dataclass(frozen=True, slots=True)
class SampleLayout:
    """A format's SAMPLE layout compiled once, so decoding a sample does no flag arithmetic on
    IntFlag values (each operation a Python-level call) and unpacks its fixed prefix in one
    call."""

    sample_type: int
    prefix: struct.Struct
    i_ip: int
    i_tid: int
    i_time: int
    i_addr: int
    i_id: int
    i_cpu: int
    i_period: int
    read_group: bool
    read_times: int
    read_per_value: int
    branch_hw_index: int
    branch_counters: int
    regs: struct.Struct
    regs_mask: int

    @classmethod
    def of(cls, fmt: EventFormat) -> SampleLayout:
        st = int(fmt.sample_type)
        slots = [bit for bit in _PREFIX_SLOTS if st & bit]

        def idx(bit: SampleType) -> int:
            return slots.index(bit) if bit in slots else -1

        # PERF_SAMPLE_ID wins over IDENTIFIER when both are set (same value; perf reads ID).
        i_id = idx(SampleType.ID) if st & SampleType.ID else idx(SampleType.IDENTIFIER)
        rf = fmt.read_format
        return cls(
            sample_type=st,
            prefix=struct.Struct(f"<{len(slots)}Q"),
            i_ip=idx(SampleType.IP),
            i_tid=idx(SampleType.TID),
            i_time=idx(SampleType.TIME),
            i_addr=idx(SampleType.ADDR),
            i_id=i_id,
            i_cpu=idx(SampleType.CPU),
            i_period=idx(SampleType.PERIOD),
            read_group=bool(rf & ReadFormat.GROUP),
            read_times=bool(rf & ReadFormat.TOTAL_TIME_ENABLED)
            + bool(rf & ReadFormat.TOTAL_TIME_RUNNING),
            read_per_value=1 + bool(rf & ReadFormat.ID) + bool(rf & ReadFormat.LOST),
            branch_hw_index=int(bool(fmt.branch_sample_type & BRANCH_HW_INDEX)),
            branch_counters=int(bool(fmt.branch_sample_type & BRANCH_COUNTERS)),
            regs=struct.Struct(f"<{bin(fmt.sample_regs_user).count('1')}Q"),
            regs_mask=fmt.sample_regs_user,
        )


NONE1 = (None,)  # appended to an unpacked trailer: index len(v) picks an absent field


@dataclass(frozen=True, slots=True)
class SampleIdLayout:
    """A format's ``sample_id`` trailer compiled once into one struct (see the module doc for
    the layout): side-band-heavy streams (mmap churn) decode millions of trailers."""

    struct: struct.Struct
    i_pid: int  # tid follows at i_pid + 1
    i_time: int
    i_id: int
    i_stream: int
    i_cpu: int
    # SampleId's six fields from the unpacked values + (None,), in one C call
    pick: Callable[[tuple[Any, ...]], tuple[Any, ...]] = field(
        default=lambda v: (None,) * 6, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        absent = len(self.struct.format.lstrip("<"))  # one value per code: the None's index
        i_tid = self.i_pid + 1 if self.i_pid >= 0 else -1
        idx = [
            i if i >= 0 else absent
            for i in (self.i_pid, i_tid, self.i_time, self.i_id, self.i_stream, self.i_cpu)
        ]
        object.__setattr__(self, "pick", itemgetter(*idx))

    @classmethod
    def of(cls, fmt: EventFormat) -> SampleIdLayout:
        st = int(fmt.sample_type) if fmt.sample_id_all else 0
        codes = ""
        idx = {"pid": -1, "time": -1, "id": -1, "stream": -1, "cpu": -1}
        n = 0
        for bit, name, code in (
            (SampleType.TID, "pid", "II"),
            (SampleType.TIME, "time", "Q"),
            (SampleType.ID, "id", "Q"),
            (SampleType.STREAM_ID, "stream", "Q"),
            (SampleType.CPU, "cpu", "II"),  # u32 cpu, res
            (SampleType.IDENTIFIER, "id", "Q"),  # same id as PERF_SAMPLE_ID; last one wins
        ):
            if st & bit:
                idx[name] = n
                codes += code
                n += len(code)
        return cls(struct.Struct("<" + codes), idx["pid"], idx["time"], idx["id"],
                   idx["stream"], idx["cpu"])  # fmt: skip
