"""What the stack store answers, and how: the answer types and the queries over bucket counts.

Rules:
- A query sees a list of (bucket index, counts) and the interned stacks by id; it never
  writes them, so the same code serves the store (on its thread) and its snapshots (on the
  query thread).
- A window [since_ns, until_ns) is resolved to buckets: an edge inside a bucket includes the
  whole bucket. ``covered`` says which window an answer's counts then come from.
- ``query_top(..., limit)`` equals ``query(...)[:limit]``; ranks are by count, descending, ties in
  insertion order (``Counter.most_common``'s order).
- ``top_functions``: self (leaf frame) and total (anywhere in the stack, once per sample) counts
  per function; frames without a symbol are grouped as ``[dso]``.
- Cost: a query is O(entries in the window) (C-level merges when unfiltered); ``query_top``
  builds only ``limit`` results; ``top_functions`` is O(distinct stacks * frames) the first
  time a stack is ranked, O(distinct stacks) after (``func_keys`` is cached per stack object,
  bounded at ``_KEYS_CACHE_MAX``).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from ..procs.cgroups import NO_LABELS, Labels
from ..unwind.stackfmt import Frame, frame_name

Stack = tuple[Frame, ...]
Key = tuple[int, int, str, int]  # pid, tid, comm, stack id


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
    labels: Labels = NO_LABELS


@dataclass(frozen=True, slots=True)
class FunctionCount:
    sym: str
    dso: str | None
    self_count: int
    total_count: int


class Queries:
    """``query``, ``query_top``, ``processes`` and the label lookups of a StackStore and of its
    snapshots, over the bucket counts and per-pid records each one sees."""

    bucket_ns: int
    _stacks: dict[int, Stack]
    _procs: dict[int, tuple[str, int, int]]  # pid -> (comm, samples held, last ns)
    _labels: dict[int, Labels | None]  # pid -> its labels (None: unreadable)

    def _bucket_counts(self) -> list[tuple[int, Counter[Key]]]:
        raise NotImplementedError

    def window(self) -> tuple[int, int] | None:
        raise NotImplementedError

    def processes(self) -> list[ProcessInfo]:
        """The processes with samples still held (in some bucket), by pid: the last comm seen,
        the samples held (evicted ones no longer count) and the newest sample's time. A pid
        whose last sample is evicted is no longer listed."""
        return process_list(self._procs, self._labels)

    def labels_of(self, pid: int) -> dict[str, str]:
        """The labels known for ``pid`` (``cgroup``, ``unit``, ``container_id``; those not
        known are left out), as held with its samples: for a pusher splitting series."""
        got = self._labels.get(pid)
        return got.as_dict() if got is not None else {}

    def label_pids(
        self, unit: str | None = None, container: str | None = None, cgroup: str | None = None,
    ) -> frozenset[int]:
        """The pids held whose labels match every filter given (``label_pids``)."""
        return label_pids(self._labels, unit, container, cgroup)

    def covered(self, since_ns: int | None, until_ns: int | None, now_ns: int) -> tuple[int, int]:
        """[from, to) ns a query of [since_ns, until_ns) at ``now_ns`` counts samples from."""
        return covered_window(self.bucket_ns, self.window(), since_ns, until_ns, now_ns)

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
        return self.query_top(since_ns, until_ns, pids=pids, tid=tid, comm=comm)[0]

    def query_top(
        self,
        since_ns: int | None = None,
        until_ns: int | None = None,
        *,
        pids: Iterable[int] | None = None,
        tid: int | None = None,
        comm: str | None = None,
        limit: int | None = None,
    ) -> tuple[list[StackCount], int]:
        """``query(...)[:limit]`` and ``len(query(...))``, without building the rest."""
        return rank_stacks(self._bucket_counts(), self._stacks, self.bucket_ns, since_ns,
                           until_ns, pids, tid, comm, limit)  # fmt: skip


def rank_stacks(
    buckets: Iterable[tuple[int, Counter[Key]]],
    stacks: dict[int, Stack],
    bucket_ns: int,
    since_ns: int | None,
    until_ns: int | None,
    pids: Iterable[int] | None,
    tid: int | None,
    comm: str | None,
    limit: int | None,
) -> tuple[list[StackCount], int]:
    total = merge_window(buckets, bucket_ns, since_ns, until_ns, pids, tid, comm)
    # most_common(): sorted by count, descending, stable; nlargest is the same order (ties
    # keep insertion order) without sorting what the limit drops.
    ranked = (total.most_common() if limit is None or limit >= len(total)
              else heapq.nlargest(limit, total.items(), key=itemgetter(1)))  # fmt: skip
    return [
        StackCount(pid, ktid, kcomm, stacks[sid], n) for (pid, ktid, kcomm, sid), n in ranked
    ], len(total)


def covered_window(
    bucket_ns: int,
    held: tuple[int, int] | None,
    since_ns: int | None,
    until_ns: int | None,
    now_ns: int,
) -> tuple[int, int]:
    """The window [since_ns, until_ns) widened to whole buckets (as ``merge_window`` counts
    them), then narrowed to the buckets ``held`` ([oldest start, newest end), None: none) and to
    ``now_ns`` (no sample is newer). Without a start, what is held; nothing held: empty, at
    the requested end."""
    start = None if since_ns is None else since_ns // bucket_ns * bucket_ns
    end = now_ns if until_ns is None else min(now_ns, ((until_ns - 1) // bucket_ns + 1) * bucket_ns)
    if held is not None:
        start = held[0] if start is None else max(start, held[0])
    if start is None or start > end:
        start = end
    return start, end


def merge_window(
    buckets: Iterable[tuple[int, Counter[Key]]],
    bucket_ns: int,
    since_ns: int | None,
    until_ns: int | None,
    pids: Iterable[int] | None,
    tid: int | None,
    comm: str | None,
) -> Counter[Key]:
    lo = None if since_ns is None else since_ns // bucket_ns
    hi = None if until_ns is None else (until_ns - 1) // bucket_ns
    want = None if pids is None else set(pids)
    total: Counter[Key] = Counter()
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
    return total


def process_list(
    procs: dict[int, tuple[str, int, int]], labels: dict[int, Labels | None] | None = None,
) -> list[ProcessInfo]:
    lab = labels or {}
    return [
        ProcessInfo(pid, comm, n, last, lab.get(pid) or NO_LABELS)
        for pid, (comm, n, last) in sorted(procs.items())
        if pid >= 0
    ]


def label_pids(
    labels: dict[int, Labels | None],
    unit: str | None,
    container: str | None,
    cgroup: str | None,
) -> frozenset[int]:
    """The pids whose labels match every filter given: ``unit`` exactly; ``container`` a
    prefix of the container id (``docker ps`` shows 12 digits); ``cgroup`` the cgroup or an
    ancestor of it (``/system.slice`` selects every service's processes). O(pids held)."""
    anc = None if cgroup is None else cgroup.rstrip("/") + "/"
    out = []
    for pid, lab in labels.items():
        if lab is None:
            continue
        if unit is not None and lab.unit != unit:
            continue
        if container is not None and (lab.container_id is None
                                      or not lab.container_id.startswith(container)):
            continue
        if cgroup is not None and (lab.cgroup is None or (
                lab.cgroup != cgroup and not lab.cgroup.startswith(anc or "/"))):
            continue
        out.append(pid)
    return frozenset(out)


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
        keys = func_keys(frames)
        if keys:
            self_c[keys[0]] += count
            for key in keys[1]:
                total_c[key] += count
    ranked = sorted(total_c, key=lambda k: (-self_c[k], -total_c[k], k[0]))
    return [FunctionCount(k[0], k[1], self_c[k], total_c[k]) for k in ranked[:limit]]


FuncKey = tuple[str, str | None]
_Keys = tuple[FuncKey, tuple[FuncKey, ...]]
# id(stack) -> (stack, keys): the entry holds the stack, so its id cannot be reused while cached
_KEYS_CACHE: dict[int, tuple[Stack, _Keys]] = {}
_KEYS_CACHE_MAX = 1 << 16


def func_keys(frames: Stack) -> _Keys | tuple[()]:
    """(self key, distinct keys) of a stack; cached (bounded, by identity: the store interns
    stacks, so hashing 20 frames per lookup is avoided) because a stack is ranked by every top
    query while it stays in the window."""
    if not frames:
        return ()
    hit = _KEYS_CACHE.get(id(frames))
    if hit is not None and hit[0] is frames:
        return hit[1]
    # a frame without a symbol is UNKNOWN, kept apart per binary by the key's dso
    keys = [(frame_name(f), f.dso) for f in frames]
    out = (keys[0], tuple(dict.fromkeys(keys)))
    if len(_KEYS_CACHE) >= _KEYS_CACHE_MAX:
        _KEYS_CACHE.clear()
    _KEYS_CACHE[id(frames)] = (frames, out)
    return out
