"""What the stack store answers, and how: the answer types and the queries over bucket counts.

Rules:
- A query sees a list of (bucket index, counts) and the stack table (stacktable.py); it never
  writes them, so the same code serves the store (on its thread) and its snapshots (on the
  query thread).
- A window [since_ns, until_ns) is resolved to buckets: an edge inside a bucket includes the
  whole bucket. ``covered`` says which window an answer's counts then come from.
- ``query_top(..., limit)`` equals ``query(...)[:limit]``; ranks are by count, descending, ties in
  insertion order (``Counter.most_common``'s order).
- ``top_functions``: self (leaf frame) and total (anywhere in the stack, once per sample) counts
  per function; frames without a symbol are grouped as ``[dso]``. ``top_lines``: the same per
  source line.
- Stacks are held compactly and rebuilt as frames for the answers that return them: once per
  stack per query (the same tuple for every entry of that stack in one answer), equal to the
  frames added; the same objects across queries only while the store's query cache holds
  them (compare stacks across answers by value). The view remembers the last answer's
  (``_last``) so ``render`` can key its cache by stack id.
- Cost: a query is O(entries in the window) (C-level merges when unfiltered) plus O(frames) per
  distinct stack returned; ``query_top`` builds only ``limit`` results; ``top_functions`` is
  O(distinct stacks * frames); a filtered ``top`` ranks stack ids by their frame ids without
  building frames.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import Any

from ..lightdc import dataclass
from ..procs.cgroups import NO_LABELS, Labels
from ..unwind.stackfmt import UNKNOWN, Frame, frame_name
from .stacktable import FuncKey, StackTable

Stack = tuple[Frame, ...]
Key = tuple[int, int, str, int]  # pid, tid, comm, stack id
_Keys = tuple[FuncKey, tuple[FuncKey, ...]]


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


@dataclass(frozen=True, slots=True)
class LineCount:
    file: str | None  # None: no line info for the frames counted here
    line: int | None
    sym: str
    dso: str | None
    self_count: int
    total_count: int


class Queries:
    """``query``, ``query_top``, ``processes`` and the label lookups of a StackStore and of its
    snapshots, over the bucket counts and per-pid records each one sees."""

    bucket_ns: int
    _table: StackTable
    # id(frames) -> (frames, stack id) of the stacks the last query returned: ``render`` keys
    # its cache by stack id
    _last: dict[int, tuple[Stack, int]]
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
        ranked, n = self.query_ids(since_ns, until_ns, pids=pids, tid=tid, comm=comm, limit=limit)
        out, built = stack_counts(ranked, self._frames_of())
        self._last = {id(fr): (fr, sid) for sid, fr in built.items()}
        return out, n

    def query_ids(
        self,
        since_ns: int | None = None,
        until_ns: int | None = None,
        *,
        pids: Iterable[int] | None = None,
        tid: int | None = None,
        comm: str | None = None,
        limit: int | None = None,
    ) -> tuple[list[tuple[Key, int]], int]:
        """``query_top``'s answer as ((pid, tid, comm, stack id), count) entries, for answers
        written from the stack table (``table``) without frames."""
        total = merge_window(self._bucket_counts(), self.bucket_ns, since_ns, until_ns, pids,
                             tid, comm)  # fmt: skip
        return rank_counts(total, limit), len(total)

    @property
    def table(self) -> StackTable:
        """The stack table the stack ids of ``query_ids`` name (read-only: it is the store's)."""
        return self._table

    def _frames_of(self) -> Callable[[int], Stack]:
        """A stack id's frames, as this view rebuilds them (cached by the store)."""
        return self._table.frames

    def stack_id(self, frames: Stack) -> int | None:
        """The stack id of ``frames`` if the last query returned this very tuple."""
        hit = self._last.get(id(frames))
        return hit[1] if hit is not None and hit[0] is frames else None


def stack_counts(ranked: list[tuple[Key, int]], frames_of: Callable[[int], Stack]
                 ) -> tuple[list[StackCount], dict[int, Stack]]:  # fmt: skip
    """The ranked entries ((pid, tid, comm, stack id), count) with their frames, and the frames
    built per stack id (once each)."""
    built: dict[int, Stack] = {}
    out = []
    for (pid, ktid, kcomm, sid), n in ranked:
        fr = built.get(sid)
        if fr is None:
            fr = built[sid] = frames_of(sid)
        out.append(StackCount(pid, ktid, kcomm, fr, n))
    return out, built


def rank_counts(total: Counter[Key], limit: int | None) -> list[tuple[Key, int]]:
    # most_common(): sorted by count, descending, stable; nlargest is the same order (ties
    # keep insertion order) without sorting what the limit drops.
    return (total.most_common() if limit is None or limit >= len(total)
            else heapq.nlargest(limit, total.items(), key=itemgetter(1)))  # fmt: skip


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
    return rank_functions(((func_keys(fr), n) for fr, n in _by_stack(stacks)), limit)


def _by_stack(stacks: Iterable[StackCount]) -> list[list[Any]]:
    """[frames, count] per distinct stack, first seen first. Entries differ by pid/tid/comm
    and stacks repeat; a query's stacks are the same tuple object per stack, so this is an
    identity lookup per entry."""
    by_stack: dict[int, list[Any]] = {}
    for sc in stacks:
        hit = by_stack.get(id(sc.frames))
        if hit is None:
            by_stack[id(sc.frames)] = [sc.frames, sc.count]
        else:
            hit[1] += sc.count
    return list(by_stack.values())


def top_of_counts(
    total: Counter[Key], keys_of: Callable[[int], _Keys | tuple[()]], limit: int
) -> tuple[int, list[FunctionCount]]:
    """(samples, ``top_functions`` of the ranked stacks of ``total``), from stack ids
    (``keys_of``: ``StackTable.keys``) without building frames."""
    by_sid: dict[int, int] = {}
    get = by_sid.get
    samples = 0
    for key, n in rank_counts(total, None):
        sid = key[3]
        by_sid[sid] = get(sid, 0) + n
        samples += n
    return samples, rank_functions(((keys_of(sid), n) for sid, n in by_sid.items()), limit)


def rank_functions(
    stacks: Iterable[tuple[_Keys | tuple[()], int]], limit: int
) -> list[FunctionCount]:
    """The functions of (``func_keys``, count) per distinct stack, in first-seen order, ranked
    by self then total count then name (ties: first seen first)."""
    self_c: Counter[FuncKey] = Counter()
    total_c: Counter[FuncKey] = Counter()
    for keys, count in stacks:
        if keys:
            self_c[keys[0]] += count
            for key in keys[1]:
                total_c[key] += count
    ranked = sorted(total_c, key=lambda k: (-self_c[k], -total_c[k], k[0]))
    return [FunctionCount(k[0], k[1], self_c[k], total_c[k]) for k in ranked[:limit]]


LineKey = tuple[str | None, int | None, str, str | None]  # file, line, function, dso


def top_lines(stacks: Iterable[StackCount], limit: int = 50) -> list[LineCount]:
    """``top_functions`` by source line: self (the leaf frame's) and total (anywhere in the
    stack, once per sample) counts per (file, line, function, dso), the frame's own file and
    line (an inlined frame's: the code inlined there; the frame an inline chain sits in: the
    call site); frames without line info count per function with no file. Ranked by self,
    then total, then function name (ties: first seen first). O(distinct stacks * frames)."""
    self_c: Counter[LineKey] = Counter()
    total_c: Counter[LineKey] = Counter()
    for frames, count in _by_stack(stacks):
        if not frames:
            continue
        keys = [(f.file, f.line, frame_name(f), f.dso) for f in frames]
        self_c[keys[0]] += count
        for key in dict.fromkeys(keys):
            total_c[key] += count
    ranked = sorted(total_c, key=lambda k: (-self_c[k], -total_c[k], k[2]))
    return [LineCount(*k, self_c[k], total_c[k]) for k in ranked[:limit]]


def top_lines_ids(entries: Iterable[tuple[Key, int]], table: StackTable, limit: int = 50
                  ) -> list[LineCount]:  # fmt: skip
    """``top_lines`` of a query's ranked entries ((pid, tid, comm, stack id), count), the same
    answer, from ``table``'s frame keys: a line key holds no ip, so each distinct frame key
    makes its key once and each stack is walked once (a query's entries have one frames
    tuple per stack id: ``_by_stack``'s stacks are its stack ids, in the same order)."""
    by_sid: dict[int, int] = {}
    get = by_sid.get
    for key, n in entries:
        by_sid[key[3]] = get(key[3], 0) + n
    # frame id -> its line key (the entries' stacks, so their frames, stay while it runs)
    line_of: dict[int, LineKey] = {}
    self_c: Counter[LineKey] = Counter()
    total_c: Counter[LineKey] = Counter()
    for sid, count in by_sid.items():
        fids = table.frame_ids(sid)
        if not fids:
            continue
        keys = []
        for fid in fids:
            lk = line_of.get(fid)
            if lk is None:  # frame_name: the symbol, else UNKNOWN
                k = table.frame_key(fid)
                lk = line_of[fid] = (k[6], k[7], k[1] or UNKNOWN, k[0])
            keys.append(lk)
        self_c[keys[0]] += count
        for lk in dict.fromkeys(keys):
            total_c[lk] += count
    ranked = sorted(total_c, key=lambda k: (-self_c[k], -total_c[k], k[2]))
    return [LineCount(*k, self_c[k], total_c[k]) for k in ranked[:limit]]


def func_keys(frames: Stack) -> _Keys | tuple[()]:
    """(self key, distinct keys) of a stack (``StackTable.keys`` answers the same from ids)."""
    if not frames:
        return ()
    # a frame without a symbol is UNKNOWN, kept apart per binary by the key's dso
    keys = [(frame_name(f), f.dso) for f in frames]
    return keys[0], tuple(dict.fromkeys(keys))
