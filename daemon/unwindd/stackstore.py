"""In-memory store of unwound samples, aggregated by stack in time buckets, with bounded memory.

Invariants:
- Sans-IO: the caller passes samples and the current time; the store never reads a clock.
- Time is the samples' own clock (CLOCK_MONOTONIC ns, what perf_event_open was told to use), so
  queries name windows on the same clock. Samples without a time go to the newest bucket.
- A sample is stored as one count in the bucket ``time // bucket_ns`` under the key
  (pid, tid, comm, stack). Stacks (tuples of frames) are interned and reference-counted by the
  bucket entries that use them, so a stack seen a million times is stored once, and dropped
  with its last bucket entry.
- Bounded: at most ``max_buckets`` buckets (retention = max_buckets * bucket_ns) and at most
  ``max_entries`` bucket entries in all. Past either bound the OLDEST bucket is evicted whole,
  and what it held is counted in ``stats.evicted_samples`` — old data goes first, never silently.
- Subscribers (the live stream) get every added batch through a callback; they must not block.
- Snapshots (``snapshot()``) are immutable views a worker thread may query while the owner keeps
  adding: O(buckets) to take. Buckets are copy-on-write (the first write to a bucket a snapshot
  shares copies that bucket's dict, O(its entries), once per snapshot), stacks released while a
  snapshot is open are freed when the last one closes, and the per-process summary is copied.
- Cost: ``add`` is O(frames) per new stack, O(1) dict work per sample otherwise; ``add_counts``
  is the same per (pid, tid, comm, bucket, stack) group, whatever the samples in it; releasing
  stacks is O(stacks whose count dropped), not O(stacks); a query is O(entries in the window).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .stackfmt import Frame, UnwoundSample

Stack = tuple[Frame, ...]
_Key = tuple[int, int, str, int]  # pid, tid, comm, stack id
_ENTRY_BYTES = 200  # dict slot + key tuple + count: a coarse per-entry cost for the gauge
_FRAME_BYTES = 120


@dataclass(frozen=True, slots=True)
class StackCount:
    pid: int
    tid: int
    comm: str
    frames: Stack
    count: int


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    pid: int
    comm: str
    samples: int
    last_seen_ns: int


@dataclass(frozen=True, slots=True)
class FunctionCount:
    sym: str
    dso: str | None
    self_count: int
    total_count: int


@dataclass
class StoreStats:
    samples: int = 0
    evicted_samples: int = 0
    evicted_buckets: int = 0
    stacks: int = 0
    entries: int = 0

    @property
    def bytes_estimate(self) -> int:
        return self.entries * _ENTRY_BYTES + self.stacks * 4 * _FRAME_BYTES


@dataclass
class _Bucket:
    counts: Counter[_Key] = field(default_factory=Counter)
    shared: bool = False  # a snapshot holds ``counts``: copy before writing


# (time ns, pid, tid, comm, frames, count): what ``add_counts`` takes, one per group of samples
CountGroup = tuple[int | None, int | None, int | None, str, Stack, int]


class StackStore:
    def __init__(
        self,
        *,
        bucket_ns: int = 10_000_000_000,
        max_buckets: int = 360,
        max_entries: int = 1_000_000,
    ) -> None:
        if bucket_ns <= 0 or max_buckets <= 0 or max_entries <= 0:
            raise ValueError("bucket_ns, max_buckets and max_entries must be > 0")
        self.bucket_ns = bucket_ns
        self.max_buckets = max_buckets
        self.max_entries = max_entries
        self.stats = StoreStats()
        self._buckets: dict[int, _Bucket] = {}  # insertion order == time order (see _bucket)
        self._stack_ids: dict[Stack, int] = {}
        self._stacks: dict[int, Stack] = {}
        self._stack_refs: Counter[int] = Counter()
        self._next_stack = 0
        self._procs: dict[int, tuple[str, int, int]] = {}  # pid -> (comm, samples, last ns)
        self._newest = 0
        self.subscribers: list[Callable[[Sequence[UnwoundSample]], None]] = []
        self._by_obj: dict[int, tuple[Stack, int]] = {}  # id(tuple) -> (it, stack id)
        self._dirty: set[int] = set()  # stack ids whose refcount dropped since the last release
        self._lock = threading.Lock()  # guards _readers/_deferred (snapshots close off-thread)
        self._readers = 0  # open snapshots
        self._deferred: list[int] = []  # stack ids released while a snapshot was open

    # -- writing

    def add(self, samples: Sequence[UnwoundSample]) -> None:
        for s in samples:
            self._count(s.time_ns, s.pid, s.tid, s.comm, s.frames, 1)
        self._release_unreferenced()
        self._enforce_bounds()
        for cb in list(self.subscribers):
            cb(samples)

    def add_counts(self, groups: Iterable[CountGroup]) -> None:
        """Aggregated samples: each group is ``count`` samples with the same bucket (any time
        in it), pid, tid, comm and frames. Same result as ``add`` of those samples, without a
        Python object per sample; subscribers are not called (they need samples)."""
        for t, pid, tid, comm, frames, n in groups:
            self._count(t, pid, tid, comm, frames, n)
        self._release_unreferenced()
        self._enforce_bounds()

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
        self.stats.samples += n
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
            return sid
        known = self._stack_ids.get(frames)
        if len(self._by_obj) > 2 * len(self._stacks) + 1024:
            self._by_obj.clear()  # bounded: stale ids only cost a hashed lookup
        if known is not None:
            sid = known
        else:
            sid = self._next_stack
            self._next_stack += 1
            self._stack_ids[frames] = sid
            self._stacks[sid] = frames
            self.stats.stacks += 1
        self._by_obj[id(frames)] = (frames, sid)
        self._stack_refs[sid] += 1
        return sid

    def _release_unreferenced(self) -> None:
        refs = self._stack_refs
        dead = [sid for sid in self._dirty if refs.get(sid, 1) <= 0]
        self._dirty.clear()
        with self._lock:
            if self._readers:
                self._deferred += dead  # a snapshot may still look these up
                dead = []
            elif self._deferred:
                dead += self._deferred
                self._deferred = []
        for sid in dead:
            if sid not in refs or refs[sid] > 0:
                continue  # deferred, then referenced again (interned anew)
            del refs[sid]
            frames = self._stacks.pop(sid)
            del self._stack_ids[frames]
            self.stats.stacks -= 1

    def _enforce_bounds(self) -> None:
        while self._buckets and (
            len(self._buckets) > self.max_buckets or self.stats.entries > self.max_entries
        ):
            idx = next(iter(self._buckets))
            b = self._buckets.pop(idx)
            self.stats.evicted_buckets += 1
            for (_, _, _, sid), n in b.counts.items():
                self.stats.evicted_samples += n
                self._stack_refs[sid] -= 1
                self._dirty.add(sid)
            self.stats.entries -= len(b.counts)
        self._release_unreferenced()

    def forget_process(self, pid: int) -> None:
        """Drop the per-process summary (its samples stay in their buckets until evicted)."""
        self._procs.pop(pid, None)

    # -- reading

    def window(self) -> tuple[int, int] | None:
        """[oldest, newest] ns covered by the buckets held, or None when empty."""
        if not self._buckets:
            return None
        return next(iter(self._buckets)) * self.bucket_ns, (self._newest + 1) * self.bucket_ns

    def query(
        self,
        since_ns: int | None = None,
        until_ns: int | None = None,
        *,
        pids: Iterable[int] | None = None,
        tid: int | None = None,
        comm: str | None = None,
    ) -> list[StackCount]:
        """Stacks with counts over the buckets overlapping [since_ns, until_ns), filtered.
        Resolution is one bucket: a window edge inside a bucket includes the whole bucket."""
        items = [(idx, b.counts) for idx, b in self._buckets.items()]
        return _query(items, self._stacks, self.bucket_ns, since_ns, until_ns, pids, tid, comm)

    def processes(self) -> list[ProcessInfo]:
        return _processes(self._procs)

    def snapshot(self) -> StoreSnapshot:
        """An immutable view for a query on another thread; ``close()`` it when done."""
        for b in self._buckets.values():
            b.shared = True
        with self._lock:
            self._readers += 1
        return StoreSnapshot(self, [(idx, b.counts) for idx, b in self._buckets.items()],
                             dict(self._procs), self.window())  # fmt: skip

    def _close_snapshot(self) -> None:
        with self._lock:
            self._readers -= 1


class StoreSnapshot:
    """What ``StackStore.snapshot`` returns: ``query``/``processes``/``window`` of one moment."""

    def __init__(
        self,
        store: StackStore,
        buckets: list[tuple[int, Counter[_Key]]],
        procs: dict[int, tuple[str, int, int]],
        window: tuple[int, int] | None,
    ) -> None:
        self._store: StackStore | None = store
        self._buckets = buckets
        self._stacks = store._stacks  # entries we can see are not freed while we are open
        self._procs = procs
        self._window = window
        self.bucket_ns = store.bucket_ns
        self.stats = store.stats

    def query(
        self,
        since_ns: int | None = None,
        until_ns: int | None = None,
        *,
        pids: Iterable[int] | None = None,
        tid: int | None = None,
        comm: str | None = None,
    ) -> list[StackCount]:
        return _query(self._buckets, self._stacks, self.bucket_ns, since_ns, until_ns, pids,
                      tid, comm)  # fmt: skip

    def processes(self) -> list[ProcessInfo]:
        return _processes(self._procs)

    def window(self) -> tuple[int, int] | None:
        return self._window

    def close(self) -> None:
        if self._store is not None:
            self._store._close_snapshot()
            self._store = None


def _query(
    buckets: Iterable[tuple[int, Counter[_Key]]],
    stacks: dict[int, Stack],
    bucket_ns: int,
    since_ns: int | None,
    until_ns: int | None,
    pids: Iterable[int] | None,
    tid: int | None,
    comm: str | None,
) -> list[StackCount]:
    lo = None if since_ns is None else since_ns // bucket_ns
    hi = None if until_ns is None else (until_ns - 1) // bucket_ns
    want = None if pids is None else set(pids)
    total: Counter[_Key] = Counter()
    for idx, counts in buckets:
        if (lo is not None and idx < lo) or (hi is not None and idx > hi):
            continue
        if want is None and tid is None and comm is None:
            total.update(counts)  # C loop: the common unfiltered query
            continue
        for key, n in counts.items():
            pid, ktid, kcomm, _ = key
            if want is not None and pid not in want:
                continue
            if (tid is not None and ktid != tid) or (comm is not None and kcomm != comm):
                continue
            total[key] += n
    return [
        StackCount(pid, ktid, kcomm, stacks[sid], n)
        for (pid, ktid, kcomm, sid), n in total.most_common()
    ]


def _processes(procs: dict[int, tuple[str, int, int]]) -> list[ProcessInfo]:
    return [
        ProcessInfo(pid, comm, n, last)
        for pid, (comm, n, last) in sorted(procs.items())
        if pid >= 0
    ]


def top_functions(stacks: Iterable[StackCount], limit: int = 50) -> list[FunctionCount]:
    """Self (leaf frame) and total (anywhere in the stack, once per sample) counts per function;
    frames without a symbol are grouped as ``[dso]``."""
    self_c: Counter[tuple[str, str | None]] = Counter()
    total_c: Counter[tuple[str, str | None]] = Counter()
    # Aggregate by stack first (entries differ by pid/tid/comm, stacks repeat); interned stacks
    # are the same tuple object, so the first level is an identity lookup.
    by_stack: dict[int, list[Any]] = {}
    for sc in stacks:
        hit = by_stack.get(id(sc.frames))
        if hit is None:
            by_stack[id(sc.frames)] = [sc.frames, sc.count]
        else:
            hit[1] += sc.count
    for frames, count in by_stack.values():
        keys = _func_keys(frames)
        if keys:
            self_c[keys[0]] += count
            for key in keys[1]:
                total_c[key] += count
    ranked = sorted(total_c, key=lambda k: (-self_c[k], -total_c[k], k[0]))
    return [FunctionCount(k[0], k[1], self_c[k], total_c[k]) for k in ranked[:limit]]


_FuncKey = tuple[str, str | None]
_Keys = tuple[_FuncKey, tuple[_FuncKey, ...]]
# id(stack) -> (stack, keys): the entry holds the stack, so its id cannot be reused while cached
_KEYS_CACHE: dict[int, tuple[Stack, _Keys]] = {}
_KEYS_CACHE_MAX = 1 << 16


def _func_keys(frames: Stack) -> _Keys | tuple[()]:
    """(self key, distinct keys) of a stack; cached (bounded, by identity: the store interns
    stacks, so hashing 20 frames per lookup is avoided) because a stack is ranked by every top
    query while it stays in the window."""
    if not frames:
        return ()
    hit = _KEYS_CACHE.get(id(frames))
    if hit is not None and hit[0] is frames:
        return hit[1]
    keys = [(f.sym or f"[{f.dso or 'unknown'}]", f.dso) for f in frames]
    out = (keys[0], tuple(dict.fromkeys(keys)))
    if len(_KEYS_CACHE) >= _KEYS_CACHE_MAX:
        _KEYS_CACHE.clear()
    _KEYS_CACHE[id(frames)] = (frames, out)
    return out
