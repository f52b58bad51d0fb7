"""Counts over a record stream: what arrived, per type, per CPU and per pid, and what was lost.

Invariants:
- Sans-IO and order-insensitive: ``observe`` only adds to counters, so feeding the same records
  in any order gives the same totals.
- Loss is never inferred: LOST counts what the kernel said it dropped from a full ring
  (``lost`` field), LOST_SAMPLES what it dropped before the ring, THROTTLE/UNTHROTTLE how often
  the kernel throttled the event. All of them per CPU (``None`` when the record had no CPU).
- A pid's name (``comm_of``) is its main thread's latest COMM or, before one, its parent's
  name at FORK, the first COMM of its threads or the name /proc gave it (``note_comm``), else
  perf's name for an unnamed task (comms.py).
- Memory: O(types + CPUs + distinct pids). Cost per record: a few dict updates.
"""

from __future__ import annotations

from collections import Counter

from ..lightdc import dataclass, field
from .comms import default_comm
from .records import (
    BadRecord,
    Comm,
    Exit,
    Fork,
    Lost,
    LostSamples,
    Mmap,
    Mmap2,
    Record,
    Sample,
    Throttle,
    record_type_name,
)

PLAIN: frozenset[type] = frozenset({Mmap2, Exit, Mmap})  # counted by type and CPU only
# (record types are final classes: ``type(rec) in _PLAIN`` is exact)


@dataclass
class StreamStats:
    """Counts of the record stream: by type and cpu, samples and comm by pid, losses."""

    by_type: Counter[str] = field(default_factory=Counter)
    by_cpu_type: dict[int | None, Counter[str]] = field(default_factory=dict)
    samples_by_pid: Counter[int] = field(default_factory=Counter)
    comm_by_pid: dict[int, str] = field(default_factory=dict)
    lost_by_cpu: Counter[int | None] = field(default_factory=Counter)
    lost_samples_by_cpu: Counter[int | None] = field(default_factory=Counter)
    throttled_by_cpu: Counter[int | None] = field(default_factory=Counter)
    unthrottled_by_cpu: Counter[int | None] = field(default_factory=Counter)
    bad_records: Counter[str] = field(default_factory=Counter)

    def observe(self, rec: Record, cpu: int | None = None) -> None:
        """Count one record; ``cpu`` (the ring it came from) is used when the record has none."""
        name = record_type_name(rec)
        by_type = self.by_type
        by_type[name] = by_type.get(name, 0) + 1  # Counter's += goes through __missing__
        rcpu = rec.cpu
        if rcpu is None:
            rcpu = cpu
        per = self.by_cpu_type.get(rcpu)
        if per is None:
            per = self.by_cpu_type[rcpu] = Counter()
        per[name] = per.get(name, 0) + 1
        if type(rec) in PLAIN:  # most side-band records: nothing more to count
            return
        if isinstance(rec, Sample):
            if rec.pid is not None:
                self.samples_by_pid[rec.pid] += 1
        elif isinstance(rec, Comm):
            if rec.pid == rec.tid or rec.pid not in self.comm_by_pid:
                self.comm_by_pid[rec.pid] = rec.comm
        elif isinstance(rec, Fork):
            # a new process is named as its parent until it execs (perf's thread__fork copies
            # the parent's comm, tools/perf/util/thread.c), like the engine's samples
            parent = self.comm_by_pid.get(rec.ppid)
            if rec.pid != rec.ppid and parent is not None:
                self.comm_by_pid[rec.pid] = parent
        elif isinstance(rec, Lost):
            self.lost_by_cpu[rcpu] += rec.lost
        elif isinstance(rec, LostSamples):
            self.lost_samples_by_cpu[rcpu] += rec.lost
        elif isinstance(rec, Throttle):
            (self.unthrottled_by_cpu if rec.unthrottle else self.throttled_by_cpu)[rcpu] += 1
        elif isinstance(rec, BadRecord):
            self.bad_records[rec.reason] += 1

    def observe_plain(self, name: str, cpu: int | None, n: int) -> None:
        """``observe`` of ``n`` records named ``name`` of ``cpu`` that count by type and cpu
        only (MMAP2, EXIT, MMAP; ``cpu``: the record's, else its ring's): a caller counting a
        round's side-band records in bulk."""
        by_type = self.by_type
        by_type[name] = by_type.get(name, 0) + n
        per = self.by_cpu_type.get(cpu)
        if per is None:
            per = self.by_cpu_type[cpu] = Counter()
        per[name] = per.get(name, 0) + n

    def note_comm(self, pid: int, comm: str) -> None:
        """``pid`` is named ``comm`` outside the stream (/proc, for a process older than the
        recording): its name unless a COMM record of its main thread names it."""
        self.comm_by_pid.setdefault(pid, comm)

    def comm_of(self, pid: int) -> str:
        """The per-pid table's name of ``pid``: its COMM's, /proc's, else perf's
        (comms.default_comm: ``swapper`` for pid 0)."""
        comm = self.comm_by_pid.get(pid)
        return default_comm(pid, pid) if comm is None else comm

    @property
    def lost(self) -> int:
        return sum(self.lost_by_cpu.values())

    @property
    def lost_samples(self) -> int:
        return sum(self.lost_samples_by_cpu.values())

    @property
    def throttled(self) -> int:
        return sum(self.throttled_by_cpu.values())
