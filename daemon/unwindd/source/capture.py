"""The record stream, live or replayed: decode, count, order.

Invariants:
- ``StreamPipeline`` is sans-IO: it takes ring chunks (live) or records in file order (replay)
  and returns time-ordered records; the live loop ``run_live`` is the only part that reads
  clocks or touches signals, and with ``record``'s own loop the only ones that poll fds
  (``poll_rings``).
- One live *round* is one pass that drains every ring until it is empty or ``max_passes`` is
  reached (perf record's rule: it writes FINISHED_ROUND only after a full pass over all mmaps,
  tools/perf/builtin-record.c record__mmap_read_evlist). Only then is ``end_round`` called, so
  the orderer's "flush up to the previous round's max time" rule holds.
- Every record is counted in ``stats`` before ordering, so a record stuck in the orderer's queue
  is still visible in the counts; the queue is emptied by ``finish``.
- Cost: decoding O(bytes); ordering O(log queued) per record; one native call per drain pass.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from ..lightdc import dataclass, field
from .decoder import MAX_RECORD_SIZE, RecordDecoder
from .formats import EventFormat
from .ordering import RoundOrderer
from .records import Record
from .streamstats import StreamStats


@dataclass
class StreamPipeline:
    decoder: RecordDecoder
    orderer: RoundOrderer = field(default_factory=RoundOrderer)
    stats: StreamStats = field(default_factory=StreamStats)

    @classmethod
    def for_format(cls, fmt: EventFormat) -> StreamPipeline:
        return cls(RecordDecoder([fmt]))

    def push_chunks(
        self,
        chunks: Iterable[tuple[int, bytes]],
        on_record: Callable[[Record], None] | None = None,
    ) -> None:
        """Decode and queue whole-record chunks drained from the ring of each CPU; each record,
        once counted, goes to ``on_record`` before it is queued."""
        for cpu, data in chunks:
            for rec in self.decoder.decode(data):
                self.stats.observe(rec, cpu)
                if on_record is not None:
                    on_record(rec)
                self.orderer.push(rec)

    def end_round(self) -> list[Record]:
        return self.orderer.end_round()

    def finish(self) -> list[Record]:
        return self.orderer.flush_all()

    def replay(self, recs: Iterable[Record]) -> Iterator[Record]:
        """Order records read from a file, whose FINISHED_ROUND records delimit the rounds."""

        def counted() -> Iterator[Record]:
            for rec in recs:
                self.stats.observe(rec)
                yield rec

        yield from self.orderer.feed_file_order(counted())


class Drainable(Protocol):
    """What ``run_live`` needs of a perf session (``perfcore.PerfSession`` provides it)."""

    @property
    def fds(self) -> list[int]: ...

    def drain(self, max_bytes: int = ...) -> list[tuple[int, bytes]]: ...


def run_live(
    session: Drainable,
    pipeline: StreamPipeline,
    sink: Callable[[list[Record]], None],
    *,
    duration: float | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    tick: float = 0.1,
    max_bytes: int = 4 << 20,
    max_passes: int = 8,
    clock: Callable[[], float] = time.monotonic,
    on_tick: Callable[[], None] | None = None,
) -> None:
    """Drain rings until ``duration`` elapses or ``should_stop()``; hand each round's ordered
    records to ``sink``. Drains at least every ``tick`` seconds even when no ring reached its
    wakeup watermark, so records are never held back longer than that. The last drain and the
    final flush happen after stopping, so nothing already in the rings is lost."""
    poller = select.poll()
    for fd in session.fds:
        poller.register(fd, select.POLLIN)
    deadline = None if duration is None else clock() + duration
    while True:
        timeout = tick
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - clock()))
        try:
            poll_rings(poller, timeout)
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            pass
        out = drain_round(session, pipeline, max_bytes, max_passes)
        if out:
            sink(out)
        if on_tick is not None:
            on_tick()
        if should_stop() or (deadline is not None and clock() >= deadline):
            break
    out = drain_round(session, pipeline, max_bytes, max_passes) + pipeline.finish()
    if out:
        sink(out)


_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL


def poll_rings(poller: select.poll, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for a ring to be readable. A ring whose task has exited
    (a ``--pid`` target) hangs up and would be ready at every poll from then on, a busy loop:
    it leaves the poller (its records are read from its mapping, not its fd; builtin-record.c
    drops such fds too, evlist__filter_pollfd)."""
    for fd, ev in poller.poll(int(timeout * 1000)):
        if ev & _GONE:
            poller.unregister(fd)


def drain_round(
    session: Drainable,
    pipeline: StreamPipeline,
    max_bytes: int = 4 << 20,
    max_passes: int = 8,
    on_record: Callable[[Record], None] | None = None,
) -> list[Record]:
    """One live round: drain every ring (until empty, at most ``max_passes`` passes), then
    return what the round rule says is safe to deliver, in time order. ``on_record`` sees each
    record as it leaves the ring, before ordering (the whole-stream Python step of the tests,
    tests/support/refstep.py, pins binaries there, as ``LiveProfiler._pin`` does)."""
    for _ in range(max_passes):
        chunks = session.drain(max_bytes)
        pipeline.push_chunks(chunks, on_record)
        if round_drained(sum(len(b) for _, b in chunks), max_bytes):
            break
    return pipeline.end_round()


def round_drained(drained: int, room: int) -> bool:
    """The drain rule both live loops (``drain_round``, the native step's) end a round on: a
    pass that drained ``drained`` bytes into ``room`` emptied every ring. The drain stops a
    ring only when its next record would not fit; records are at most 64 KiB
    (perf_event_header.size is a u16), so a pass that left that much room emptied every ring
    up to the head it read."""
    return drained <= room - MAX_RECORD_SIZE
