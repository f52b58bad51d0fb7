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
- Cost: ``add`` is O(frames) per new stack, O(1) dict work per sample otherwise; a query is
  O(entries in the window).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

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

    # -- writing

    def add(self, samples: Sequence[UnwoundSample]) -> None:
        for s in samples:
            t = s.time_ns if s.time_ns is not None else self._newest * self.bucket_ns
            b = self._bucket(t // self.bucket_ns)
            sid = self._intern(s.frames)
            pid = -1 if s.pid is None else s.pid
            key = (pid, -1 if s.tid is None else s.tid, s.comm, sid)
            counts = b.counts
            if key in counts:
                counts[key] += 1
                self._stack_refs[sid] -= 1  # only the first entry holds the stack
            else:
                counts[key] = 1
                self.stats.entries += 1
            self.stats.samples += 1
            _, n, last = self._procs.get(pid, ("", 0, 0))
            self._procs[pid] = (s.comm, n + 1, max(last, t))
        self._release_unreferenced()
        self._enforce_bounds()
        for cb in list(self.subscribers):
            cb(samples)

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
        sid = self._stack_ids.get(frames)
        if sid is None:
            sid = self._next_stack
            self._next_stack += 1
            self._stack_ids[frames] = sid
            self._stacks[sid] = frames
            self.stats.stacks += 1
        self._stack_refs[sid] += 1
        return sid

    def _release_unreferenced(self) -> None:
        dead = [sid for sid, n in self._stack_refs.items() if n <= 0]
        for sid in dead:
            del self._stack_refs[sid]
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
        lo = None if since_ns is None else since_ns // self.bucket_ns
        hi = None if until_ns is None else (until_ns - 1) // self.bucket_ns
        want = None if pids is None else set(pids)
        total: Counter[_Key] = Counter()
        for idx, b in self._buckets.items():
            if (lo is not None and idx < lo) or (hi is not None and idx > hi):
                continue
            for key, n in b.counts.items():
                pid, ktid, kcomm, _ = key
                if want is not None and pid not in want:
                    continue
                if (tid is not None and ktid != tid) or (comm is not None and kcomm != comm):
                    continue
                total[key] += n
        return [
            StackCount(pid, ktid, kcomm, self._stacks[sid], n)
            for (pid, ktid, kcomm, sid), n in total.most_common()
        ]

    def processes(self) -> list[ProcessInfo]:
        return [
            ProcessInfo(pid, comm, n, last)
            for pid, (comm, n, last) in sorted(self._procs.items())
            if pid >= 0
        ]


def top_functions(stacks: Iterable[StackCount], limit: int = 50) -> list[FunctionCount]:
    """Self (leaf frame) and total (anywhere in the stack, once per sample) counts per function;
    frames without a symbol are grouped as ``[dso]``."""
    self_c: Counter[tuple[str, str | None]] = Counter()
    total_c: Counter[tuple[str, str | None]] = Counter()
    for sc in stacks:
        seen: set[tuple[str, str | None]] = set()
        for i, f in enumerate(sc.frames):
            key = (f.sym or f"[{f.dso or 'unknown'}]", f.dso)
            if i == 0:
                self_c[key] += sc.count
            if key not in seen:
                seen.add(key)
                total_c[key] += sc.count
    ranked = sorted(total_c, key=lambda k: (-self_c[k], -total_c[k], k[0]))
    return [FunctionCount(k[0], k[1], self_c[k], total_c[k]) for k in ranked[:limit]]
