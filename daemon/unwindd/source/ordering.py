"""Round-based merge of per-CPU record streams into one time-ordered stream.

The rule (perf's, ``tools/perf/util/ordered-events.c`` and ``session.c``
``process_finished_round``): records are queued by time; at the end of each *round* (one full
pass that drains every ring buffer completely; in a perf.data file, a PERF_RECORD_FINISHED_ROUND
record), flush every queued record whose time is <= ``next_flush``, the largest time that had
been seen at the end of the *previous* round, then set ``next_flush`` to the largest time seen so
far. Why that is safe: each ring is time-ordered and is drained to its head in every round, so a
record that shows up in round N+1 was written after every ring's round N-1 contents had been
read; it is therefore newer than anything seen by the end of round N-1 (session.c: "if a buffer
still has events with timestamps below t, they will be all available and then read in the pass
n + 1. Hence when we start to read the pass n + 2, we can safely flush every events with
timestamps below t"). At end of stream everything is flushed.

Invariants:
- Nothing is lost: every record pushed (other than FINISHED_ROUND markers) is returned exactly
  once by ``end_round``, ``flush_all``, ``take_ready`` or ``feed_file_order``; at any time
  ``stats.pushed == stats.delivered + stats.queued``.
- Output is in (time, arrival) order within each flush, and across flushes unless a record
  arrives *late* (older than the last time already delivered, perf's ``last_flush``). Late
  records are counted (``late``, ``max_lateness_ns``, ``late_buckets``) and delivered at the next
  flush anyway, never dropped: lateness is data, not a reason to lose a sample.
- Stable: equal times keep arrival order (a sequence number breaks ties, so the heap never
  compares records).
- Untimed records (FinishedRound pushed by hand, BadRecord, Unknown without sample_id, records of
  an attr without PERF_SAMPLE_TIME) are not lost and not counted late: each takes the time of the
  last timed record seen on its CPU if it has one, else of the last timed record pushed (its
  arrival predecessor, which in a per-ring drain is its ring neighbour), else the last delivered
  time. Its sequence number puts it right after that record, so it rides along with it.
- FINISHED_ROUND records are consumed, not re-emitted: ``feed_file_order`` turns them into
  ``end_round``; a marker given to ``push`` is only counted in ``stats.markers``.
- Bounded memory: when more than ``max_queued`` records are queued, the oldest half is forced
  out (perf's OE_FLUSH__HALF when over its allocation limit; perf halves the *time* span, we
  halve the *count*, which always frees memory even when times are skewed) into the ready list,
  which the next ``end_round``/``flush_all``/``take_ready`` returns first; ``feed_file_order``
  yields it immediately. Counted in ``forced_flushes``.
- Sans-IO: values in, values out; no clocks, no rings.
- Cost: O(log n) per record (one heappush, one heappop), n = queued records.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ..lightdc import dataclass, field
from . import records


@dataclass
class OrderStats:
    """Counters for metrics. ``queued`` is a gauge (records held now, ready list included);
    the rest are cumulative."""

    queued: int = 0
    delivered: int = 0
    late: int = 0
    max_lateness_ns: int = 0
    rounds: int = 0
    forced_flushes: int = 0
    untimed: int = 0
    pushed: int = 0
    markers: int = 0
    # Late records by lateness, keyed by the smallest power of two (ns) >= the lateness, so the
    # keys are ready-made histogram bucket bounds (le=1, 2, 4, ... ns).
    late_buckets: Counter[int] = field(default_factory=Counter)

    def add_native(self, st: Any, lateness_ns: Sequence[int]) -> None:
        """Add one call's counts of the native orderer (``struct fp_order_stats``, fastpath.h:
        filereplay's whole file, or one live round) and its late records' lateness; ``queued``
        is the gauge, so it is taken, not added."""
        self.pushed += st.pushed
        self.delivered += st.delivered
        self.queued = st.queued
        self.late += st.late
        self.max_lateness_ns = max(self.max_lateness_ns, st.max_lateness_ns)
        self.rounds += st.rounds
        self.forced_flushes += st.forced_flushes
        self.untimed += st.untimed
        if lateness_ns:  # (most live rounds have no late record: no generator, no update call)
            self.late_buckets.update(lateness_bucket(x) for x in lateness_ns)


def lateness_bucket(lateness_ns: int) -> int:
    """Smallest power of two >= ``lateness_ns`` (>= 1): the histogram bucket for a late record."""
    return 1 << max(lateness_ns - 1, 0).bit_length()


_Entry = tuple[int, int, records.Record]  # (effective time, arrival seq, record)


class RoundOrderer:
    """Merges records from several time-ordered sources, one round at a time (see module doc)."""

    def __init__(self, max_queued: int = 1_000_000) -> None:
        if max_queued < 1:
            raise ValueError("max_queued must be >= 1")
        self.max_queued = max_queued
        self.stats = OrderStats()
        self._heap: list[_Entry] = []
        self._ready: list[records.Record] = []  # forced out by the cap, already in order
        self._seq = 0
        # perf starts next_flush at 0; nothing real is older than time 0, so flushing <= 0 in
        # the first round is safe and lets time-0 records out early.
        self._next_flush = 0
        self._last_flush = 0  # time of the newest record delivered (perf's last_flush)
        self._max_time = 0  # newest time seen (perf's max_timestamp)
        self._last_time: int | None = None  # time of the last timed record pushed
        self._cpu_time: dict[int, int] = {}  # last time seen per CPU, for untimed records

    # -- input

    def push(self, rec: records.Record) -> None:
        """Queue one record, keyed by ``rec.time``; O(log n)."""
        if isinstance(rec, records.FinishedRound):
            self.stats.markers += 1
            return
        t = rec.time
        cpu = rec.cpu
        if t is None:
            self.stats.untimed += 1
            if cpu is not None and cpu in self._cpu_time:
                t = self._cpu_time[cpu]
            elif self._last_time is not None:
                t = self._last_time
            else:
                t = self._last_flush
        else:
            if t < self._last_flush:
                lateness = self._last_flush - t
                self.stats.late += 1
                self.stats.late_buckets[lateness_bucket(lateness)] += 1
                if lateness > self.stats.max_lateness_ns:
                    self.stats.max_lateness_ns = lateness
            if t > self._max_time:
                self._max_time = t
            self._last_time = t
            if cpu is not None:
                self._cpu_time[cpu] = t
        heapq.heappush(self._heap, (t, self._seq, rec))
        self._seq += 1
        self.stats.pushed += 1
        self.stats.queued += 1
        if len(self._heap) > self.max_queued:
            self._force_half()

    def push_many(self, recs: Iterable[records.Record]) -> None:
        for rec in recs:
            self.push(rec)

    # -- output

    def end_round(self) -> list[records.Record]:
        """Close a round (a full drain of every ring): return, in time order, every record
        that is now safe, then remember the newest time seen as the next round's bound."""
        self.stats.rounds += 1
        # Anything <= last_flush is already behind the output (late, or tied with delivered
        # records and arrived after them), so holding it longer cannot improve the order; this
        # also bounds how long a late record waits after a forced flush raised last_flush.
        out = self._take_ready()
        self._pop_until(max(self._next_flush, self._last_flush), out)
        self._next_flush = self._max_time
        self._account(out)
        return out

    def flush_all(self) -> list[records.Record]:
        """End of stream: everything queued, in time order. The orderer stays usable."""
        out = self._take_ready()
        heap = self._heap
        while heap:
            t, _, rec = heapq.heappop(heap)
            out.append(rec)
            self._last_flush = max(self._last_flush, t)
        self._next_flush = self._max_time
        self._account(out)
        return out

    def take_ready(self) -> list[records.Record]:
        """Records already forced out by the memory cap, in order (empty most of the time)."""
        out = self._take_ready()
        self._account(out)
        return out

    def feed_file_order(self, recs: Iterable[records.Record]) -> Iterator[records.Record]:
        """Order a perf.data record stream: FINISHED_ROUND ends a round (and is consumed);
        records forced out by the cap are yielded as soon as they are; ends with ``flush_all``."""
        for rec in recs:
            if isinstance(rec, records.FinishedRound):
                yield from self.end_round()
                continue
            self.push(rec)
            if self._ready:
                yield from self.take_ready()
        yield from self.flush_all()

    # -- internals

    def _take_ready(self) -> list[records.Record]:
        out, self._ready = self._ready, []
        return out

    def _pop_until(self, limit: int, out: list[records.Record]) -> None:
        heap = self._heap
        while heap and heap[0][0] <= limit:
            t, _, rec = heapq.heappop(heap)
            out.append(rec)
            # max(): an untimed record or a late one may sit below last_flush; it must not
            # pull the bound back (perf's last_flush only moves forward in practice).
            if t > self._last_flush:
                self._last_flush = t

    def _force_half(self) -> None:
        heap = self._heap
        n = max(len(heap) // 2, 1)
        for _ in range(n):
            t, _, rec = heapq.heappop(heap)
            self._ready.append(rec)
            if t > self._last_flush:
                self._last_flush = t
        self.stats.forced_flushes += 1

    def _account(self, out: list[records.Record]) -> None:
        self.stats.delivered += len(out)
        self.stats.queued -= len(out)
