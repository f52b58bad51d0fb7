"""The record values: one frozen slots dataclass per perf record type the daemon models.

Invariants:
- Values only: no decoding, no I/O. ``decoder.RecordDecoder`` builds them from bytes; the
  ordering, process-table, unwind and output stages read them.
- Every value is immutable and hashable (``frozen=True, slots=True``); field order is the
  positional constructor order (``frozen_maker`` relies on it, and on fields == slots).
- Every type answers ``time`` and ``cpu`` (None when the record or its attr has none), so the
  orderer and the stream stats treat all records alike; ``Record`` is their union.
- ``Sample.stack`` holds only the bytes the kernel really copied (``dyn_size``), never the
  padding; ``Sample.callchain`` keeps perf's context markers (``abi.CONTEXT_*``).
- Cost: O(fields) to build a value; ``frozen_maker``'s constructors skip ``__init__``'s
  per-field ``object.__setattr__`` and are checked against the class layout at import.
  ``record_type_name`` is one dict lookup for every type but THROTTLE/UNTHROTTLE and UNKNOWN.

Field meanings follow ``include/uapi/linux/perf_event.h`` (Linux 6.x), ``enum perf_event_type``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..lightdc import dataclass, field_names
from .abi import MISC_COMM_EXEC, MISC_CPUMODE_MASK, RecordType

_T = TypeVar("_T")


def frozen_maker(cls: type[_T]) -> Callable[..., _T]:
    """A positional constructor for the frozen slots dataclass ``cls``, cheaper than its
    ``__init__`` (which sets each field with an ``object.__setattr__`` call): it fills an
    instance of a mutable twin with the same ``__slots__`` by plain attribute stores, then
    sets ``__class__`` to ``cls``. The result is an ordinary ``cls`` instance (type, fields,
    equality, hash and immutability are its own); CPython refuses the ``__class__``
    assignment unless the two layouts are identical, so a mismatch fails loudly here, at
    import. Every field is a required positional argument (no defaults applied)."""
    names = list(field_names(cls))
    if tuple(names) != tuple(getattr(cls, "__slots__", ())):
        raise TypeError(f"{cls.__name__}: fields and slots differ")
    twin = type(f"_{cls.__name__}Fill", (), {"__slots__": tuple(names)})
    args = ", ".join(names)
    body = "".join(f"    o.{n} = {n}\n" for n in names)
    src = f"def make({args}):\n    o = _new(_twin)\n{body}    o.__class__ = _cls\n    return o\n"
    ns: dict[str, Any] = {"_new": object.__new__, "_twin": twin, "_cls": cls}
    exec(src, ns)  # the technique dataclasses itself uses for __init__
    make: Callable[..., _T] = ns["make"]
    make(*([None] * len(names)))  # the layout check, now rather than on the first record
    return make


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class SampleId:
    """The ``sample_id`` trailer; fields absent from the attr are None."""

    pid: int | None = None
    tid: int | None = None
    time: int | None = None
    id: int | None = None
    stream_id: int | None = None
    cpu: int | None = None

    def __repr__(self) -> str:
        return f"SampleId(pid={self.pid}, tid={self.tid}, time={self.time}, cpu={self.cpu})"


NO_SAMPLE_ID = SampleId()


@dataclass(frozen=True, slots=True)
class Sample:
    """PERF_RECORD_SAMPLE. ``callchain`` holds the kernel's ips including context markers
    (``abi.CONTEXT_*``); ``regs`` are in ascending perf register order for ``regs_mask``;
    ``stack`` is only the ``dyn_size`` bytes the kernel really copied (never the padding)."""

    misc: int
    pid: int | None
    tid: int | None
    time: int | None
    cpu: int | None
    ip: int | None
    id: int | None
    period: int | None
    callchain: tuple[int, ...]
    regs_abi: int
    regs_mask: int
    regs: tuple[int, ...]
    stack: bytes
    stack_size: int  # requested copy size (sample_stack_user); 0 if none
    addr: int | None = None

    @property
    def cpumode(self) -> int:
        return self.misc & MISC_CPUMODE_MASK

    @property
    def dyn_size(self) -> int:
        return len(self.stack)

    def __repr__(self) -> str:
        ip = f"{self.ip:#x}" if self.ip is not None else None
        return (
            f"Sample(pid={self.pid}, tid={self.tid}, time={self.time}, cpu={self.cpu}, ip={ip}, "
            f"callchain={len(self.callchain)}, regs={len(self.regs)}, stack={len(self.stack)})"
        )


@dataclass(frozen=True, slots=True)
class Mmap:
    """PERF_RECORD_MMAP (32-bit fields only; no file identity)."""

    misc: int
    pid: int
    tid: int
    start: int
    length: int
    pgoff: int
    filename: str
    sample_id: SampleId

    @property
    def time(self) -> int | None:
        return self.sample_id.time

    @property
    def cpu(self) -> int | None:
        return self.sample_id.cpu

    def __repr__(self) -> str:
        return (
            f"Mmap(pid={self.pid}, {self.start:#x}+{self.length:#x} pgoff={self.pgoff:#x} "
            f"{self.filename!r})"
        )


@dataclass(frozen=True, slots=True)
class Mmap2:
    """PERF_RECORD_MMAP2. Carries either inode identity (maj/min/ino/ino_generation) or, when
    ``misc & PERF_RECORD_MISC_MMAP_BUILD_ID``, a build-id; the other form's fields are None."""

    misc: int
    pid: int
    tid: int
    start: int
    length: int
    pgoff: int
    maj: int | None
    min: int | None
    ino: int | None
    ino_generation: int | None
    build_id: bytes | None
    prot: int
    flags: int
    filename: str
    sample_id: SampleId

    @property
    def time(self) -> int | None:
        return self.sample_id.time

    @property
    def cpu(self) -> int | None:
        return self.sample_id.cpu

    def __repr__(self) -> str:
        ident = self.build_id.hex() if self.build_id is not None else f"ino={self.ino}"
        return (
            f"Mmap2(pid={self.pid}, {self.start:#x}+{self.length:#x} pgoff={self.pgoff:#x} "
            f"prot={self.prot} {ident} {self.filename!r})"
        )


@dataclass(frozen=True, slots=True)
class Comm:
    """PERF_RECORD_COMM; ``exec`` is PERF_RECORD_MISC_COMM_EXEC (the comm changed by exec)."""

    misc: int
    pid: int
    tid: int
    comm: str
    sample_id: SampleId

    @property
    def exec(self) -> bool:
        return bool(self.misc & MISC_COMM_EXEC)

    @property
    def time(self) -> int | None:
        return self.sample_id.time

    @property
    def cpu(self) -> int | None:
        return self.sample_id.cpu


@dataclass(frozen=True, slots=True)
class Fork:
    """PERF_RECORD_FORK (a new task; pid == tid for a new process)."""

    misc: int
    pid: int
    ppid: int
    tid: int
    ptid: int
    time: int
    sample_id: SampleId

    @property
    def cpu(self) -> int | None:
        return self.sample_id.cpu


@dataclass(frozen=True, slots=True)
class Exit:
    """PERF_RECORD_EXIT (same layout as FORK)."""

    misc: int
    pid: int
    ppid: int
    tid: int
    ptid: int
    time: int
    sample_id: SampleId

    @property
    def cpu(self) -> int | None:
        return self.sample_id.cpu


@dataclass(frozen=True, slots=True)
class Lost:
    """PERF_RECORD_LOST: ``lost`` records were dropped because the ring was full."""

    misc: int
    id: int
    lost: int
    sample_id: SampleId

    @property
    def time(self) -> int | None:
        return self.sample_id.time

    @property
    def cpu(self) -> int | None:
        return self.sample_id.cpu


@dataclass(frozen=True, slots=True)
class LostSamples:
    """PERF_RECORD_LOST_SAMPLES: samples dropped before reaching the ring."""

    misc: int
    lost: int
    sample_id: SampleId

    @property
    def time(self) -> int | None:
        return self.sample_id.time

    @property
    def cpu(self) -> int | None:
        return self.sample_id.cpu


@dataclass(frozen=True, slots=True)
class Throttle:
    """PERF_RECORD_THROTTLE (``unthrottle`` False) or PERF_RECORD_UNTHROTTLE (True)."""

    misc: int
    unthrottle: bool
    time: int
    id: int
    stream_id: int
    sample_id: SampleId

    @property
    def cpu(self) -> int | None:
        return self.sample_id.cpu


@dataclass(frozen=True, slots=True)
class FinishedRound:
    """PERF_RECORD_FINISHED_ROUND: everything before it was written in an earlier round."""

    misc: int = 0

    @property
    def time(self) -> None:
        return None

    @property
    def cpu(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Unknown:
    """A well-framed record of a type not modelled here (e.g. KSYMBOL, ID_INDEX)."""

    type: int
    misc: int
    payload: bytes
    sample_id: SampleId = NO_SAMPLE_ID

    @property
    def time(self) -> int | None:
        return self.sample_id.time

    @property
    def cpu(self) -> int | None:
        return self.sample_id.cpu

    def __repr__(self) -> str:
        return f"Unknown(type={self.type}, misc={self.misc:#x}, {len(self.payload)} bytes)"


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A record with a sane header whose body did not decode: counted, then skipped."""

    type: int
    misc: int
    size: int
    reason: str

    @property
    def time(self) -> None:
        return None

    @property
    def cpu(self) -> None:
        return None


Record = (
    Sample
    | Mmap
    | Mmap2
    | Comm
    | Fork
    | Exit
    | Lost
    | LostSamples
    | Throttle
    | FinishedRound
    | Unknown
    | BadRecord
)


def record_type_name(rec: Record) -> str:
    """Upper-case perf name of a record value (``SAMPLE``, ``MMAP2``, ``UNKNOWN`` ...)."""
    name = _TYPE_NAMES.get(type(rec))  # one dict hit for every type but two
    if name is not None:
        return name
    if isinstance(rec, Throttle):
        return "UNTHROTTLE" if rec.unthrottle else "THROTTLE"
    if isinstance(rec, Unknown):
        try:
            return RecordType(rec.type).name
        except ValueError:
            return f"TYPE_{rec.type}"
    return _TYPE_NAMES[type(rec)]


_TYPE_NAMES: dict[type, str] = {
    Sample: "SAMPLE",
    Mmap: "MMAP",
    Mmap2: "MMAP2",
    Comm: "COMM",
    Fork: "FORK",
    Exit: "EXIT",
    Lost: "LOST",
    LostSamples: "LOST_SAMPLES",
    FinishedRound: "FINISHED_ROUND",
    BadRecord: "BAD_RECORD",
}
