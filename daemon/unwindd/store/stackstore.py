"""In-memory store of unwound samples, aggregated by stack in time buckets, with bounded memory.

Invariants:
- Sans-IO: the caller passes samples and their times (CLOCK_MONOTONIC ns, the samples' own
  clock, so queries name windows on it); the store never reads a clock. Samples without a time
  go to the newest bucket.
- A sample is one count in bucket ``time // bucket_ns`` under (pid, tid, comm, stack). Stacks
  are interned and reference-counted by the entries that use them: stored once, dropped with
  their last entry.
- Bounded: at most ``max_buckets`` buckets, ``max_entries`` entries and ``max_bytes`` of
  estimated memory (``stats.bytes_estimate``, see ``_ENTRY_BYTES``; what holds under process
  churn, where every process brings new stacks). Past a bound the query caches go first, then
  the OLDEST bucket whole, counted in ``stats.evicted_samples``: never silently.
- ``processes()`` covers exactly the pids with samples still held.
- Labels (procs/cgroups.py: cgroup, unit, container id) belong to a process, not to its
  entries: ``_labels`` holds them per pid while the pid has a summary, resolved once when the
  pid's first entry arrives (``label_source``, set by ``attach_labels``) and replaced when the
  label table re-reads or forgets the pid (exec, FORK); queries join them via the pid
  (``labels_of``, ``label_pids``). A pid whose labels could not be read has none.
- Subscribers get every added batch through a callback; they must not block.
- Snapshots are immutable views a worker thread may query while the owner keeps adding:
  buckets are copy-on-write, stacks released while one is open are freed when the last closes.
- Cost: ``add`` is O(frames) per new stack, O(1) per sample otherwise (``add_counts``: per
  group); evicting is O(entries evicted); releasing is O(stacks whose count dropped); a snapshot
  is O(buckets), its first write to a shared bucket O(its entries). Queries: queries.py; the
  caches behind ``render`` and ``top``: querycache.py.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..procs.cgroups import CgroupLabels, Labels
from ..unwind.stackfmt import UnwoundSample
from .queries import (
    FunctionCount,
    Key,
    Queries,
    Stack,
    top_functions,
)
from .querycache import QueryCaches, top_summaries

# Bytes per unit for ``stats.bytes_estimate`` and the ``max_bytes`` bound: what tracemalloc
# shows the store retaining per unit (CPython 3, 64-bit; after the samples are dropped):
# - entry: a bucket Counter slot, a key tuple of 4 and its ints; a pid's summary adds its
#   _procs tuple and slot and its _pid_entries slot.
# - stack: fixed (tuple header, _stack_ids/_stacks/_stack_refs/_by_obj slots, the id int)
#   plus one pointer per frame slot.
# - frame: per distinct Frame object (the object, its ip/offset/rel ints, the _frame_refs
#   slot; symbol and dso strings are shared with the ELF cache, so not counted).
_ENTRY_BYTES = 160
_PID_BYTES = 200
_STACK_BYTES = 340
_SLOT_BYTES = 8
_FRAME_BYTES = 235


@dataclass
class StoreStats:
    samples: int = 0
    evicted_samples: int = 0
    evicted_buckets: int = 0
    stacks: int = 0  # interned stacks some entry uses
    entries: int = 0
    pids: int = 0  # processes with an entry (the per-process summaries)
    frame_slots: int = 0  # sum of the interned stacks' lengths
    frames: int = 0  # distinct Frame objects in them (by identity)
    cache_bytes: int = 0  # query caches: rendered stacks, per-bucket top summaries

    @property
    def bytes_estimate(self) -> int:
        """Estimated bytes held by what the counts above count (see ``_ENTRY_BYTES``). Stacks
        that only an open snapshot still holds are not in it: they go when it closes."""
        return (self.entries * _ENTRY_BYTES + self.pids * _PID_BYTES
                + self.stacks * _STACK_BYTES + self.frame_slots * _SLOT_BYTES
                + self.frames * _FRAME_BYTES + self.cache_bytes)  # fmt: skip


@dataclass
class _Bucket:
    counts: Counter[Key] = field(default_factory=Counter)
    shared: bool = False  # a snapshot holds ``counts``: copy before writing


# (time ns, pid, tid, comm, frames, count): what ``add_counts`` takes, one per group of samples
CountGroup = tuple[int | None, int | None, int | None, str, Stack, int]


class StackStore(Queries):
    def __init__(
        self,
        *,
        bucket_ns: int = 10_000_000_000,
        max_buckets: int = 360,
        max_entries: int = 1_000_000,
        max_bytes: int = 256 << 20,
    ) -> None:
        if bucket_ns <= 0 or max_buckets <= 0 or max_entries <= 0 or max_bytes <= 0:
            raise ValueError("bucket_ns, max_buckets, max_entries and max_bytes must be > 0")
        self.bucket_ns = bucket_ns
        self.max_buckets = max_buckets
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.stats = StoreStats()
        self._buckets: dict[int, _Bucket] = {}  # insertion order == time order (see _bucket)
        self._stack_ids: dict[Stack, int] = {}
        self._stacks: dict[int, Stack] = {}
        self._stack_refs: Counter[int] = Counter()
        self._next_stack = 0
        self._procs: dict[int, tuple[str, int, int]] = {}  # pid -> (comm, samples held, last ns)
        self._pid_entries: dict[int, int] = {}  # pid -> its bucket entries: prunes _procs
        # pid -> its labels (None: unreadable), for pids in _procs once resolved
        self._labels: dict[int, Labels | None] = {}
        self.label_source: Callable[[int], Labels | None] | None = None
        self._newest = 0
        self.subscribers: list[Callable[[Sequence[UnwoundSample]], None]] = []
        # called with each add_counts' groups: a consumer of every count that needs no sample
        # objects (unwindd record's folded output)
        self.count_subscribers: list[Callable[[Sequence[CountGroup]], None]] = []
        self._by_obj: dict[int, tuple[Stack, int]] = {}  # id(tuple) -> (it, stack id)
        self._dirty: set[int] = set()  # stack ids whose refcount dropped since the last release
        self._lock = threading.Lock()  # guards _readers/_deferred (snapshots close off-thread)
        self._readers = 0  # open snapshots
        # Stack ids released while a snapshot was open: already out of the stats (evicting
        # more could not free them sooner), freed when the last snapshot closes.
        self._deferred: set[int] = set()
        self._frame_refs: Counter[int] = Counter()  # id(frame) -> slots of accounted stacks
        # Read and filled by the query thread (under _lock), emptied here when what they
        # describe goes.
        self.caches = QueryCaches(self.stats, self._lock, max_bytes // 8)

    # -- writing

    def attach_labels(self, table: CgroupLabels) -> None:
        """Take each process's labels from ``table`` (the live table's): read when the pid's
        first sample is stored, updated when the table re-reads or forgets the pid."""
        self.label_source = table.labels_for
        table.listeners.append(self._relabel)

    def _relabel(self, pid: int, labels: Labels | None) -> None:
        if pid in self._procs:
            if labels is None:
                self._labels.pop(pid, None)  # resolved again at the pid's next sample
            else:
                self._labels[pid] = labels

    def add(self, samples: Sequence[UnwoundSample]) -> None:
        for s in samples:
            self._count(s.time_ns, s.pid, s.tid, s.comm, s.frames, 1)
        self._release_unreferenced()
        self._enforce_bounds()
        for cb in list(self.subscribers):
            cb(samples)

    def add_counts(self, groups: Sequence[CountGroup]) -> None:
        """Aggregated samples: each group is ``count`` samples with the same bucket (any time
        in it), pid, tid, comm and frames. Same result as ``add`` of those samples, without a
        Python object per sample; subscribers are not called (they need samples), count
        subscribers are."""
        for t, pid, tid, comm, frames, n in groups:
            self._count(t, pid, tid, comm, frames, n)
        self._release_unreferenced()
        self._enforce_bounds()
        for cb in list(self.count_subscribers):
            cb(groups)

    def _count(
        self, time_ns: int | None, pid_: int | None, tid: int | None, comm: str, frames: Stack,
        n: int,
    ) -> None:  # fmt: skip
        t = time_ns if time_ns is not None else self._newest * self.bucket_ns
        b = self._bucket(t // self.bucket_ns)
        if b.shared:
            b.counts = Counter(b.counts)
            b.shared = False
        sid = self._intern(frames)
        pid = -1 if pid_ is None else pid_
        key = (pid, -1 if tid is None else tid, comm, sid)
        counts = b.counts
        if key in counts:
            counts[key] += n
            self._stack_refs[sid] -= 1  # only the first entry holds the stack
            self._dirty.add(sid)
        else:
            counts[key] = n
            self.stats.entries += 1
            pe = self._pid_entries.get(pid)
            if pe is None:
                self._pid_entries[pid] = 1
                self.stats.pids += 1
            else:
                self._pid_entries[pid] = pe + 1
        self.stats.samples += n
        if self.label_source is not None and pid not in self._labels and pid > 0:
            self._labels[pid] = self.label_source(pid)
        _, m, last = self._procs.get(pid, ("", 0, 0))
        self._procs[pid] = (comm, m + n, max(last, t))

    def _bucket(self, idx: int) -> _Bucket:
        b = self._buckets.get(idx)
        if b is None:
            b = _Bucket()
            if idx >= self._newest or not self._buckets:
                self._buckets[idx] = b
                self._newest = max(self._newest, idx)
            else:
                # A late sample's bucket: rebuild the dict in time order (rare, O(buckets)).
                self._buckets[idx] = b
                self._buckets = dict(sorted(self._buckets.items()))
        return b

    def _intern(self, frames: Stack) -> int:
        # The engine hands the same tuple object for a stack it has cached: an identity hit
        # skips hashing every frame (a Python __hash__ per frame).
        hit = self._by_obj.get(id(frames))
        if hit is not None and hit[0] is frames and self._stacks.get(hit[1]) is not None:
            sid = hit[1]
            self._stack_refs[sid] += 1
            if self._deferred and sid in self._deferred:
                self._undefer(sid)
            return sid
        if len(self._by_obj) > 2 * len(self._stacks) + 1024:
            self._by_obj.clear()  # bounded: stale ids only cost a hashed lookup
        # One hash of the tuple (a Python __hash__ call per frame) for lookup and insert.
        sid = self._stack_ids.setdefault(frames, self._next_stack)
        if sid == self._next_stack:
            self._next_stack += 1
            self._stacks[sid] = frames
            self._account(frames)
        self._by_obj[id(frames)] = (frames, sid)
        self._stack_refs[sid] += 1
        if self._deferred and sid in self._deferred:
            self._undefer(sid)
        return sid

    def _undefer(self, sid: int) -> None:
        """A stack waiting for snapshots to close is used again: it is counted again (and
        stays interned: the deferred release finds it referenced)."""
        self._deferred.discard(sid)
        self._account(self._stacks[sid])

    def _account(self, frames: Stack) -> None:
        st = self.stats
        st.stacks += 1
        st.frame_slots += len(frames)
        refs = self._frame_refs
        # the stack holds its frames, so their ids are not reused while counted; Counter's
        # update of an iterable counts in C (a new stack of a new process is ~all new frames)
        before = len(refs)
        refs.update(map(id, frames))
        st.frames += len(refs) - before

    def _unaccount(self, frames: Stack) -> None:
        st = self.stats
        st.stacks -= 1
        st.frame_slots -= len(frames)
        refs = self._frame_refs
        for f in frames:
            i = id(f)
            n = refs[i] - 1
            if n:
                refs[i] = n
            else:
                del refs[i]
                st.frames -= 1

    def _release_unreferenced(self) -> None:
        refs = self._stack_refs
        dead = [sid for sid in self._dirty if refs.get(sid, 1) <= 0]
        self._dirty.clear()
        with self._lock:
            readers = self._readers
        if readers:
            for sid in dead:  # a snapshot may still look these up: free them later
                if sid not in self._deferred:
                    self._deferred.add(sid)
                    self._unaccount(self._stacks[sid])
            return
        for sid in dead:
            if sid not in self._deferred:
                self._unaccount(self._stacks[sid])
        if self._deferred:
            dead += self._deferred  # already unaccounted
            self._deferred = set()
        for sid in dead:
            if sid not in refs or refs[sid] > 0:
                continue  # deferred, then referenced again (accounted again by _undefer)
            del refs[sid]
            frames = self._stacks.pop(sid)
            del self._stack_ids[frames]
            hit = self._by_obj.get(id(frames))
            if hit is not None and hit[0] is frames:
                del self._by_obj[id(frames)]  # or it would keep the stack and its frames alive
            self.caches.drop_stack(frames)

    def drop_caches(self) -> None:
        """Empty the query caches (they refill on the next queries)."""
        self.caches.clear()

    def _enforce_bounds(self) -> None:
        st = self.stats
        if st.cache_bytes and st.bytes_estimate > self.max_bytes:
            self.drop_caches()  # caches go before data does
        while self._buckets and (
            len(self._buckets) > self.max_buckets
            or st.entries > self.max_entries
            or st.bytes_estimate > self.max_bytes
        ):
            idx = next(iter(self._buckets))
            b = self._buckets.pop(idx)
            st.evicted_buckets += 1
            self.caches.drop_bucket(idx)
            procs, pid_entries, refs, dirty = (self._procs, self._pid_entries, self._stack_refs,
                                               self._dirty)  # fmt: skip
            for (pid, _, _, sid), n in b.counts.items():
                st.evicted_samples += n
                refs[sid] -= 1
                dirty.add(sid)
                left = pid_entries[pid] - 1
                if left:
                    pid_entries[pid] = left
                    p = procs.get(pid)
                    if p is not None:
                        procs[pid] = (p[0], max(0, p[1] - n), p[2])
                else:  # the pid's last entry: its summary goes too
                    del pid_entries[pid]
                    procs.pop(pid, None)
                    self._labels.pop(pid, None)
                    st.pids -= 1
            st.entries -= len(b.counts)
            self._release_unreferenced()  # frees the stacks, so the byte estimate drops
        self._release_unreferenced()

    def forget_process(self, pid: int) -> None:
        """Drop the per-process summary now (its samples stay in their buckets until evicted;
        eviction drops the summary of a pid with no entry left by itself)."""
        self._procs.pop(pid, None)
        self._labels.pop(pid, None)

    # -- reading

    def window(self) -> tuple[int, int] | None:
        """[oldest, newest] ns covered by the buckets held, or None when empty."""
        if not self._buckets:
            return None
        return next(iter(self._buckets)) * self.bucket_ns, (self._newest + 1) * self.bucket_ns

    def top(
        self,
        since_ns: int | None = None,
        until_ns: int | None = None,
        *,
        pids: Iterable[int] | None = None,
        tid: int | None = None,
        comm: str | None = None,
        limit: int = 50,
    ) -> tuple[int, list[FunctionCount]]:
        """(samples, ``top_functions(query(...), limit)``), from per-bucket summaries."""
        snap = self.snapshot()  # freezes the buckets: a summary describes one version
        try:
            return snap.top(since_ns, until_ns, pids=pids, tid=tid, comm=comm, limit=limit)
        finally:
            snap.close()

    def render(self, kind: str, frames: Stack, fn: Callable[[Stack], Any]) -> Any:
        """``fn(frames)``, cached per interned stack (``kind`` names ``fn``): a stack is
        immutable, and its entry goes when the stack does. ``fn`` must return a str or a tuple
        of str."""
        return self.caches.render(self, kind, frames, fn)

    def holds_stack(self, frames: Stack) -> bool:
        """``frames`` is (this very object) an interned stack: the caches may key on it."""
        interned = self._by_obj.get(id(frames))
        return (interned is not None and interned[0] is frames) or self._stacks.get(
            self._stack_ids.get(frames, -1)) is frames  # fmt: skip

    def holds_bucket(self, idx: int) -> bool:
        return idx in self._buckets

    def _bucket_counts(self) -> list[tuple[int, Counter[Key]]]:
        return [(idx, b.counts) for idx, b in self._buckets.items()]

    def snapshot(self) -> StoreSnapshot:
        """An immutable view for a query on another thread; ``close()`` it when done."""
        for b in self._buckets.values():
            b.shared = True
        with self._lock:
            self._readers += 1
        return StoreSnapshot(self, self._bucket_counts(), dict(self._procs),
                             self.window(), dict(self._labels))  # fmt: skip

    def _close_snapshot(self) -> None:
        with self._lock:
            self._readers -= 1


class StoreSnapshot(Queries):
    """What ``StackStore.snapshot`` returns: ``query``/``processes``/``window`` of one moment."""

    def __init__(
        self,
        store: StackStore,
        buckets: list[tuple[int, Counter[Key]]],
        procs: dict[int, tuple[str, int, int]],
        window: tuple[int, int] | None,
        labels: dict[int, Labels | None] | None = None,
    ) -> None:
        self._store: StackStore | None = store
        self._labels = labels if labels is not None else {}
        self._buckets = buckets
        self._stacks = store._stacks  # entries we can see are not freed while we are open
        self._procs = procs
        self._window = window
        self.bucket_ns = store.bucket_ns
        self.stats = store.stats

    def top(
        self,
        since_ns: int | None = None,
        until_ns: int | None = None,
        *,
        pids: Iterable[int] | None = None,
        tid: int | None = None,
        comm: str | None = None,
        limit: int = 50,
    ) -> tuple[int, list[FunctionCount]]:
        if pids is None and tid is None and comm is None:
            return top_summaries(self._store, self._buckets, self._stacks, self.bucket_ns,
                                 since_ns, until_ns, limit)  # fmt: skip
        stacks = self.query(since_ns, until_ns, pids=pids, tid=tid, comm=comm)
        return sum(s.count for s in stacks), top_functions(stacks, limit)

    def _bucket_counts(self) -> list[tuple[int, Counter[Key]]]:
        return self._buckets

    def render(self, kind: str, frames: Stack, fn: Callable[[Stack], Any]) -> Any:
        store = self._store
        return fn(frames) if store is None else store.caches.render(store, kind, frames, fn)

    def window(self) -> tuple[int, int] | None:
        return self._window

    def close(self) -> None:
        if self._store is not None:
            self._store._close_snapshot()
            self._store = None
