"""In-memory store of unwound samples, aggregated by stack in time buckets, with bounded memory.

Invariants:
- Sans-IO: the caller passes samples and their times (CLOCK_MONOTONIC ns, the samples' own
  clock, so queries name windows on it); the store never reads a clock. Samples without a time
  go to the newest bucket.
- A sample is one count in bucket ``time // bucket_ns`` under (pid, tid, comm, stack). Stacks
  are interned in a compact table (stacktable.py: bytes of frame ids, frames shared across
  processes) and reference-counted by the entries that use them: stored once, dropped with
  their last entry. Queries rebuild the frames they return, equal to those added.
- Bounded: at most ``max_buckets`` buckets, ``max_entries`` entries and ``max_bytes`` of
  memory (``stats.bytes_estimate``: the table's own byte count plus per-entry and per-pid
  costs, see ``_ENTRY_BYTES``; tests/unit/test_stackstore.py holds it to tracemalloc's
  measure; it bounds what grows under process churn, where every process brings new stacks).
  Data stays under ``max_bytes`` less the query caches' share (``_CACHE_SHARE``), so a store
  at its cap keeps its caches; past a bound the OLDEST bucket goes whole, counted in
  ``stats.evicted_samples``: never silently (the caches go first only if together they pass
  ``max_bytes``). The table's part of the stats is read once per batch that interned a
  stack (``_sync_table``: its byte count sums its containers), so it holds after each batch.
- ``processes()`` covers exactly the pids with samples still held.
- Labels (procs/cgroups.py: cgroup, unit, container id) belong to a process, not to its
  entries: ``_labels`` holds them per pid while the pid has a summary, resolved once when the
  pid's first entry arrives (``label_source``, set by ``attach_labels``) and replaced when the
  label table re-reads or forgets the pid (exec, FORK); queries join them via the pid
  (``labels_of``, ``label_pids``). A pid whose labels could not be read has none.
- Subscribers get every added batch through a callback; they must not block.
- Snapshots are immutable views a worker thread may query while the owner keeps adding:
  buckets are copy-on-write, stacks released while one is open are freed when the last closes.
- Cost: ``add`` is O(frames) per stack not seen as this very tuple lately, O(1) per sample
  otherwise (``add_counts``: per group); evicting is O(entries evicted); releasing is
  O(stacks whose count dropped + their frames); a snapshot is O(buckets), its first write to a
  shared bucket O(its entries). Queries: queries.py; the
  caches behind ``render`` and ``top``: querycache.py.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

from ..lightdc import dataclass, field
from ..procs.cgroups import CgroupLabels, Labels
from ..unwind.stackfmt import CodeStack, UnwoundSample, frames_of
from .queries import (
    FunctionCount,
    Key,
    Queries,
    Stack,
    merge_window,
    top_of_counts,
)
from .querycache import QueryCaches, top_summaries
from .stacktable import StackTable

# Bytes per unit for ``stats.bytes_estimate`` and the ``max_bytes`` bound: what tracemalloc
# shows the store retaining per unit (CPython 3.11+, 64-bit; after the samples are dropped):
# - entry: a bucket Counter slot and a key tuple of 4 (its pid int is the pid's, its tid too
#   for a main thread, else one more int); a pid's summary adds its _procs tuple, slot and
#   ints, its _pid_entries and _pid_obj slots and its pid int.
# - bucket: its object, its Counter's base and its _buckets slot.
# - stack: its _stack_refs slot (the table counts its own: ``StackTable.nbytes``).
_ENTRY_BYTES = 110
_PID_BYTES = 200
_BUCKET_BYTES = 400
_STACK_BYTES = 50
_INT_BYTES = 32  # an int outside CPython's small-int cache
_CACHE_SHARE = 4  # the query caches get max_bytes / this, which data leaves them
_SMALL_INT = (-5, 256)
# The identity fast path of ``_intern`` holds at most this many of the caller's stack tuples
# (it keeps them alive: a tuple whose id is a key must not be freed while it is one), and
# every ``_SWEEP_BATCHES`` batches only those the caller still holds (``_sweep``): the store
# keeps no frames for longer.
_BY_OBJ_MAX = 2048
_SWEEP_BATCHES = 16


def _probe_refs() -> int:
    """sys.getrefcount of a tuple only ``_sweep``'s entry (and its loop) refers to (CPython's
    reference counts: what tells that the caller let go of it)."""
    d = {0: ((object(),), 0)}
    for fr, _ in d.values():
        return sys.getrefcount(fr)
    raise AssertionError


_ONLY_OURS = _probe_refs()


@dataclass
class StoreStats:
    samples: int = 0
    evicted_samples: int = 0
    evicted_buckets: int = 0
    stacks: int = 0  # interned stacks some entry uses
    entries: int = 0
    pids: int = 0  # processes with an entry (the per-process summaries)
    buckets: int = 0  # time buckets held
    entry_ints: int = 0  # entries whose tid is an int object of their own (not the pid's)
    frame_slots: int = 0  # sum of the interned stacks' lengths
    frames: int = 0  # distinct frames in the table (StackTable: process-independent)
    table_bytes: int = 0  # the stack table's bytes, less stacks only a snapshot holds
    cache_bytes: int = 0  # query caches: rendered stacks, per-bucket top summaries

    @property
    def bytes_estimate(self) -> int:
        """Estimated bytes held by what the counts above count (see ``_ENTRY_BYTES``). Stacks
        that only an open snapshot still holds are not in it: they go when it closes."""
        return (self.entries * _ENTRY_BYTES + self.entry_ints * _INT_BYTES
                + self.pids * _PID_BYTES + self.buckets * _BUCKET_BYTES
                + self.stacks * _STACK_BYTES + self.table_bytes + self.cache_bytes)  # fmt: skip


@dataclass
class _Bucket:
    counts: Counter[Key] = field(default_factory=Counter)
    shared: bool = False  # a snapshot holds ``counts``: copy before writing


# (time ns, pid, tid, comm, frames, count): one group of samples, as count subscribers get it
CountGroup = tuple[int | None, int | None, int | None, str, Stack, int]
# what ``add_counts`` takes: the same, its stack as frames or as a ``CodeStack``
StoreGroup = tuple[int | None, int | None, int | None, str, Stack | CodeStack, int]


class StackStore(Queries):
    def __init__(
        self,
        *,
        bucket_ns: int = 10_000_000_000,
        max_buckets: int = 360,
        max_entries: int = 1_000_000,
        max_bytes: int = 28 << 20,
    ) -> None:
        if bucket_ns <= 0 or max_buckets <= 0 or max_entries <= 0 or max_bytes <= 0:
            raise ValueError("bucket_ns, max_buckets, max_entries and max_bytes must be > 0")
        self.bucket_ns = bucket_ns
        self.max_buckets = max_buckets
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.stats = StoreStats()
        self._buckets: dict[int, _Bucket] = {}  # insertion order == time order (see _bucket)
        self._table = StackTable()
        self._last: dict[int, tuple[Stack, int]] = {}
        self._stack_refs: Counter[int] = Counter()
        self._procs: dict[int, tuple[str, int, int]] = {}  # pid -> (comm, samples held, last ns)
        self._pid_entries: dict[int, int] = {}  # pid -> its bucket entries: prunes _procs
        self._pid_obj: dict[int, int] = {}  # pid -> the int object its entries' keys share
        # pid -> its labels (None: unreadable), for pids in _procs once resolved
        self._labels: dict[int, Labels | None] = {}
        self.label_source: Callable[[int], Labels | None] | None = None
        self._newest = 0
        self.subscribers: list[Callable[[Sequence[UnwoundSample]], None]] = []
        # called with each add_counts' groups: a consumer of every count that needs no sample
        # objects (unwindd record's folded output)
        self.count_subscribers: list[Callable[[Sequence[CountGroup]], None]] = []
        # id(stack) -> (it, stack id): tuples and CodeStacks
        self._by_obj: dict[int, tuple[Stack | CodeStack, int]] = {}
        self._batches = 0  # since the last _sweep
        self._dirty: set[int] = set()  # stack ids whose refcount dropped since the last release
        self._unsynced = False  # stacks interned since the table's stats were last read
        self._lock = threading.Lock()  # guards _readers/_deferred (snapshots close off-thread)
        self._readers = 0  # open snapshots
        # Stack ids released while a snapshot was open: already out of the stats (evicting
        # more could not free them sooner), freed when the last snapshot closes.
        self._deferred: set[int] = set()
        self._deferred_bytes = 0  # their StackTable.stack_bytes
        # Read and filled by the query thread (under _lock), emptied here when what they
        # describe goes.
        self.caches = QueryCaches(self.stats, self._lock, max_bytes // _CACHE_SHARE)

    def holds(self, pid: int) -> bool:
        """Whether the store holds samples of ``pid`` (any thread: one dict read)."""
        return pid in self._procs

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
        self._last = {}  # the last query's frames: only until the store moves on
        for s in samples:
            self._count(s.time_ns, s.pid, s.tid, s.comm, s.frames, 1)
        if self._unsynced:
            self._sync_table()
        self._release_unreferenced()
        self._enforce_bounds()
        self._batch()
        for cb in list(self.subscribers):
            cb(samples)

    def add_counts(self, groups: Sequence[StoreGroup]) -> None:
        """Aggregated samples: each group is ``count`` samples with the same bucket (any time
        in it), pid, tid, comm and frames (a ``CodeStack``: its ``frames()``, interned
        without building them). Same result as ``add`` of those samples, without a Python
        object per sample; subscribers are not called (they need samples), count subscribers
        are, with the groups' frames."""
        self._last = {}
        for t, pid, tid, comm, frames, n in groups:
            self._count(t, pid, tid, comm, frames, n)
        if self._unsynced:
            self._sync_table()
        self._release_unreferenced()
        self._enforce_bounds()
        self._batch()
        if self.count_subscribers:
            out = [(t, pid, tid, comm, frames_of(fr), n) for t, pid, tid, comm, fr, n in groups]
            for cb in list(self.count_subscribers):
                cb(out)

    def _count(
        self, time_ns: int | None, pid_: int | None, tid: int | None, comm: str,
        frames: Stack | CodeStack, n: int,
    ) -> None:  # fmt: skip
        t = time_ns if time_ns is not None else self._newest * self.bucket_ns
        b = self._bucket(t // self.bucket_ns)
        if b.shared:
            b.counts = Counter(b.counts)
            b.shared = False
        sid = self._intern(frames)
        pid = -1 if pid_ is None else pid_
        ktid = -1 if tid is None else tid
        key = (pid, ktid, comm, sid)
        counts = b.counts
        if key in counts:
            counts[key] += n
            self._stack_refs[sid] -= 1  # only the first entry holds the stack
            self._dirty.add(sid)
        else:
            # Every entry of a pid holds the same pid int (and a main thread's tid): callers
            # make a new int per group (ringstep), each would cost its own object.
            pid = self._pid_obj.setdefault(pid, pid)
            if ktid == pid:
                ktid = pid
            counts[(pid, ktid, comm, sid)] = n
            self.stats.entries += 1
            if ktid is not pid and not _SMALL_INT[0] <= ktid <= _SMALL_INT[1]:
                self.stats.entry_ints += 1
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
            self.stats.buckets += 1
            if idx >= self._newest or not self._buckets:
                self._buckets[idx] = b
                self._newest = max(self._newest, idx)
            else:
                # A late sample's bucket: rebuild the dict in time order (rare, O(buckets)).
                self._buckets[idx] = b
                self._buckets = dict(sorted(self._buckets.items()))
        return b

    def _intern(self, frames: Stack | CodeStack) -> int:
        # The engine hands the same tuple object for a stack it has cached (the live step the
        # same CodeStack): an identity hit skips encoding every frame.
        hit = self._by_obj.get(id(frames))
        if hit is not None and hit[0] is frames and hit[1] in self._table:
            sid = hit[1]
        else:
            if len(self._by_obj) >= _BY_OBJ_MAX:
                self._by_obj.clear()  # bounded: a miss only costs an encoding
            if isinstance(frames, CodeStack):
                sid, new = self._table.add(frames.base, frames.ips)
            else:
                sid, new = self._table.add(frames)
            self._by_obj[id(frames)] = (frames, sid)
            if new:
                self._account(sid, len(frames))
                self._unsynced = True  # (the table's byte count is read once per batch)
        self._stack_refs[sid] += 1
        if self._deferred and sid in self._deferred:
            self._undefer(sid, len(frames))
        return sid

    def _batch(self) -> None:
        self._table.forget_frames()  # the table's frame objects go with the batch
        self._batches += 1
        if self._batches >= _SWEEP_BATCHES:
            self._sweep()

    def _sweep(self) -> None:
        """Forget the fast path's tuples no one else holds (freed by the engine: they would
        otherwise stay alive here with their frames), and the table's frames of CodeStacks
        likewise. O(entries), at most ``_BY_OBJ_MAX`` and the table's memo."""
        self._batches = 0
        by_obj, only = self._by_obj, _ONLY_OURS
        gone = [k for k, (fr, _) in by_obj.items() if sys.getrefcount(fr) <= only]
        for k in gone:
            del by_obj[k]
        self._table.sweep_code_frames()  # the frame objects it remembers, likewise

    def _undefer(self, sid: int, n: int) -> None:
        """A stack waiting for snapshots to close is used again: it is counted again (and
        stays interned: the deferred release finds it referenced)."""
        self._deferred.discard(sid)
        self._deferred_bytes -= self._table.stack_bytes(sid)
        self._account(sid, n)
        self._sync_table()

    def _account(self, sid: int, n: int) -> None:
        self.stats.stacks += 1
        self.stats.frame_slots += n

    def _sync_table(self) -> None:
        self._unsynced = False
        t = self._table
        self.stats.table_bytes = t.nbytes - self._deferred_bytes
        self.stats.frames = t.nframes

    def _release_unreferenced(self) -> None:
        refs, table, st = self._stack_refs, self._table, self.stats
        dead = [sid for sid in self._dirty if refs.get(sid, 1) <= 0]
        self._dirty.clear()
        if not dead and not self._deferred:
            return
        with self._lock:
            readers = self._readers
        if readers:
            for sid in dead:  # a snapshot may still look these up: free them later
                if sid not in self._deferred:
                    self._deferred.add(sid)
                    self._deferred_bytes += table.stack_bytes(sid)
                    st.stacks -= 1
                    st.frame_slots -= len_of(table, sid)
            self._sync_table()
            return
        for sid in dead:
            if sid not in self._deferred:
                st.stacks -= 1
                st.frame_slots -= len_of(table, sid)
        if self._deferred:
            dead += self._deferred  # already unaccounted
            self._deferred = set()
            self._deferred_bytes = 0
        for sid in dead:
            if sid not in refs or refs[sid] > 0:
                continue  # deferred, then referenced again (accounted again by _undefer)
            del refs[sid]
            table.free(sid)
            self.caches.drop_stack(sid)
        self._sync_table()

    def drop_caches(self) -> None:
        """Empty the query caches (they refill on the next queries)."""
        self.caches.clear()

    def _enforce_bounds(self) -> None:
        st = self.stats
        # The caches' share is kept free of data: a store at its cap still answers from them
        # (the cap changes live: service reload).
        self.caches.max_bytes = share = self.max_bytes // _CACHE_SHARE
        if st.cache_bytes and st.bytes_estimate > self.max_bytes:
            self.drop_caches()  # caches go before data does
        while self._buckets and (
            len(self._buckets) > self.max_buckets
            or st.entries > self.max_entries
            or st.bytes_estimate - st.cache_bytes > self.max_bytes - share
        ):
            idx = next(iter(self._buckets))
            b = self._buckets.pop(idx)
            st.buckets -= 1
            st.evicted_buckets += 1
            self.caches.drop_bucket(idx)
            procs, pid_entries, refs, dirty = (self._procs, self._pid_entries, self._stack_refs,
                                               self._dirty)  # fmt: skip
            for (pid, tid, _, sid), n in b.counts.items():
                st.evicted_samples += n
                if tid is not pid and not _SMALL_INT[0] <= tid <= _SMALL_INT[1]:
                    st.entry_ints -= 1
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
                    del self._pid_obj[pid]
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
        """``fn(frames)``, cached per stack (``kind`` names ``fn``) when ``frames`` is a stack
        the last query returned: a stack is immutable, and its entry goes when the stack does.
        ``fn`` must return a str, bytes or a tuple of str."""
        return self.caches.render(self, kind, self.stack_id(frames), frames, fn)

    def render_id(self, kind: str, sid: int, fn: Callable[[Stack], Any]) -> Any:
        """``render`` of stack ``sid`` (a stack id a query answered, ``query_ids``): its frames
        are rebuilt only when its rendering is not cached."""
        return self.caches.render_id(self, kind, sid, self._frames_of(), fn)

    def _frames_of(self) -> Callable[[int], Stack]:
        return partial(self.caches.frames, self, self._table, scratch={})

    def holds_stack(self, sid: int) -> bool:
        """``sid`` is an interned stack: the caches may key on it."""
        return sid in self._table

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

    @property
    def snapshots(self) -> int:
        """Snapshots open: queries running, and answers still being written from theirs."""
        with self._lock:
            return self._readers

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
        self._table = store._table  # stacks we can see are not freed while we are open
        self._last = {}
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
        store = self._store
        keys_of = (self._table.keys if store is None
                   else partial(store.caches.keys, store, self._table))  # fmt: skip
        if pids is None and tid is None and comm is None:
            return top_summaries(store, self._buckets, keys_of, self.bucket_ns, since_ns,
                                 until_ns, limit)  # fmt: skip
        total = merge_window(self._buckets, self.bucket_ns, since_ns, until_ns, pids, tid, comm)
        return top_of_counts(total, keys_of, limit)

    def _bucket_counts(self) -> list[tuple[int, Counter[Key]]]:
        return self._buckets

    def _frames_of(self) -> Callable[[int], Stack]:
        store = self._store
        if store is None:
            return partial(self._table.frames, pool={})
        return partial(store.caches.frames, store, self._table, scratch={})

    def render(self, kind: str, frames: Stack, fn: Callable[[Stack], Any]) -> Any:
        store = self._store
        if store is None:
            return fn(frames)
        return store.caches.render(store, kind, self.stack_id(frames), frames, fn)

    def render_id(self, kind: str, sid: int, fn: Callable[[Stack], Any]) -> Any:
        store = self._store
        if store is None:
            return fn(self._frames_of()(sid))
        return store.caches.render_id(store, kind, sid, self._frames_of(), fn)

    def window(self) -> tuple[int, int] | None:
        return self._window

    def close(self) -> None:
        self._last = {}
        if self._store is not None:
            self._store._close_snapshot()
            self._store = None


def len_of(table: StackTable, sid: int) -> int:
    """The number of frames of stack ``sid``."""
    return int.from_bytes(table.encoded(sid)[:4], "little")
