"""The stack store's query caches: the frames and renderings of a stack, and a top summary per
bucket.

Rules:
- They serve the query thread (filled under the store's lock, from snapshots) and are emptied
  by the store's thread when what they describe goes: a rendering with its stack (keyed by
  stack id: ids are never reused), a summary with its bucket. Answers do not depend on them:
  ``top_summaries`` equals ``top_functions(query(...))`` (test_query_equiv.py).
- A summary describes one frozen version of a bucket's counts (a snapshot's: the store copies a
  shared bucket before writing it); the next version's summary is the previous one plus what
  changed (counts only grow).
- Priority: a summary saves a pass over a whole bucket on every top query, a rendering, a
  rebuilt stack or a stack's function keys one stack's work: summaries (up to
  ``SUMMARY_SHARE`` of the share) displace renderings, oldest first, then the rebuilt stacks,
  then function keys, oldest first; the others only take what is free.
- Bounded: their bytes (``stats.cache_bytes``, part of the store's ``bytes_estimate``) stay
  under ``max_bytes`` (the store's share for them, which its data leaves free), are never
  filled past the store's ``max_bytes``, and are dropped whole when, with the data, they pass
  it (the store's cap lowered live).
- Cost: a cached rendering, rebuilt stack or function keys is one dict lookup; an unfiltered
  ``top_summaries`` is O(entries added since the last one + functions); dropping a stack's
  entries is O(kinds), a bucket's summary O(1).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

from .queries import FunctionCount, Key, Stack, merge_window
from .stacktable import FuncKey, Pool, StackTable

# StackTable.keys: a stack id's (leaf function, distinct functions)
Keys = tuple[FuncKey, tuple[FuncKey, ...]] | tuple[()]
KeysOf = Callable[[int], Keys]

# A rendered stack costs its characters plus ~150 (str header, dict slot, key tuple); a bucket
# summary ~100 per function key in its two Counters plus ~50 per entry of the bucket counts it
# retains (a dict slot: the key tuples are shared with the store's).
_TEXT_BYTES = 150
# A rebuilt stack costs its tuple and dict slot plus a pointer per frame; a pooled frame its
# object, ip int, pool key (with its serial int) and slot.
_STACK_TUPLE_BYTES = 120
_POOL_FRAME_BYTES = 336
# A stack's function keys: the two tuples and dict slot, and a (name, dso) tuple per function.
_KEYS_BYTES = 200
_KEY_BYTES = 72
_SUMMARY_KEY_BYTES = 100
_SUMMARY_ENTRY_BYTES = 50
# The part of the share summaries may take from renderings and rebuilt stacks: every bucket's
# summary is read by every unfiltered top query, so one that does not fit is a whole pass over
# its bucket on each of them.
SUMMARY_SHARE = 3 / 4


class CacheStats(Protocol):
    cache_bytes: int

    @property
    def bytes_estimate(self) -> int: ...


class CacheOwner(Protocol):
    """What the caches need of the store they serve (a StackStore)."""

    @property
    def caches(self) -> QueryCaches: ...

    @property
    def max_bytes(self) -> int: ...

    def holds_stack(self, sid: int) -> bool: ...

    def holds_bucket(self, idx: int) -> bool: ...


class QueryCaches:
    """(kind, stack id) -> (its rendering, bytes), and bucket idx -> the top summary of one
    (frozen) version of that bucket's counts."""

    def __init__(self, stats: CacheStats, lock: threading.Lock, max_bytes: int) -> None:
        self.stats = stats
        self.lock = lock  # the store's: it also guards the store's open-snapshot count
        self.max_bytes = max_bytes
        self.texts: dict[tuple[str, int], tuple[Any, int]] = {}
        self.text_kinds: set[str] = set()
        self.text_refused = 0  # inserts refused since the texts were last dropped (full)
        self.summaries: dict[int, Summary] = {}
        # stack id -> its frames as queries return them, sharing the frames of ``pool``:
        # rebuilt once while the stack stays hot (the store keeps only ids)
        self.stacks: dict[int, Stack] = {}
        self.pool: Pool = {}
        self.stack_bytes = 0  # of stacks and pool, in cache_bytes
        self.stack_refused = 0
        self.func_keys: dict[int, Keys] = {}  # stack id -> StackTable.keys
        self.keys_bytes = 0  # in cache_bytes

    def frames(self, owner: CacheOwner, table: StackTable, sid: int,
               scratch: Pool | None = None) -> Stack:  # fmt: skip
        """``table.frames(sid)``, cached while it fits (a query ranks its stacks by count, so
        the hot ones come first); what does not fit shares the frames of ``scratch`` (one
        query's pool, dropped with its answer)."""
        hit = self.stacks.get(sid)
        if hit is not None:
            return hit
        st = self.stats
        with self.lock:
            hit = self.stacks.get(sid)
            if hit is not None:
                return hit
            n = table.stack_len(sid)
            size = _STACK_TUPLE_BYTES + 8 * n + _POOL_FRAME_BYTES * n  # at most: pool grows
            # at most half the share: a rendering saves more per byte than the frames do
            if (self.stack_bytes + size > self.max_bytes // 2
                    or st.cache_bytes + size > self.max_bytes
                    or st.bytes_estimate + size > owner.max_bytes):  # fmt: skip
                self.stack_refused += 1
                if self.stack_refused <= 4 * len(self.stacks):
                    return table.frames(sid, scratch)
                self._drop_stacks()  # what is asked is no longer what is cached
                if (size > self.max_bytes // 2 or st.cache_bytes + size > self.max_bytes
                        or st.bytes_estimate + size > owner.max_bytes):  # fmt: skip
                    return table.frames(sid, scratch)
            before = len(self.pool)
            fr = table.frames(sid, self.pool)
            size = _POOL_FRAME_BYTES * (len(self.pool) - before)
            if owner.holds_stack(sid):
                self.stacks[sid] = fr
                size += _STACK_TUPLE_BYTES + 8 * n
            self.stack_bytes += size
            st.cache_bytes += size
        return fr

    def keys(self, owner: CacheOwner, table: StackTable, sid: int) -> Keys:
        """``table.keys(sid)``, cached while it fits (every top query ranks every stack in its
        window, and stacks stay there for many queries)."""
        hit = self.func_keys.get(sid)
        if hit is not None:
            return hit
        keys = table.keys(sid)
        size = _keys_size(keys)
        st = self.stats
        with self.lock:
            if (sid not in self.func_keys and owner.holds_stack(sid)
                    and st.cache_bytes + size <= self.max_bytes
                    and st.bytes_estimate + size <= owner.max_bytes):  # fmt: skip
                self.func_keys[sid] = keys
                self.keys_bytes += size
                st.cache_bytes += size
        return keys

    def _drop_stacks(self) -> None:
        self.stacks.clear()
        self.pool.clear()
        self.stats.cache_bytes -= self.stack_bytes
        self.stack_bytes = 0
        self.stack_refused = 0

    def render(self, owner: CacheOwner, kind: str, sid: int | None, frames: Stack,
               fn: Callable[[Stack], Any]) -> Any:  # fmt: skip
        """``fn(frames)``, cached under ``sid`` (None: ``frames`` is no stack the owner knows
        the id of: not cached)."""
        if sid is None:
            return fn(frames)
        key = (kind, sid)
        hit = self.texts.get(key)
        if hit is not None:
            return hit[0]
        out = fn(frames)
        size = _TEXT_BYTES + (len(out) if isinstance(out, str | bytes)
                              else 8 * len(out) + sum(map(len, out)))  # fmt: skip
        st = self.stats
        with self.lock:
            if st.bytes_estimate + size > owner.max_bytes:
                return out  # never past the store's bound (the data has the room)
            if st.cache_bytes + size > self.max_bytes:
                # Full: keep what is cached (a query ranks its stacks by count, so the hot ones
                # came first) unless refusals show the cached set is no longer what is asked.
                self.text_refused += 1
                if self.text_refused <= 4 * len(self.texts):
                    return out
                self.text_refused = 0
                for k in [k for k in self.texts if k[0] == kind]:
                    st.cache_bytes -= self.texts.pop(k)[1]
                if st.cache_bytes + size > self.max_bytes:
                    return out
            if not owner.holds_stack(sid):
                return out  # no longer held: nothing would drop the entry
            self.text_kinds.add(kind)
            old = self.texts.get(key)
            if old is not None:
                st.cache_bytes -= old[1]
            self.texts[key] = (out, size)
            st.cache_bytes += size
        return out

    def render_id(self, owner: CacheOwner, kind: str, sid: int,
                  frames_of: Callable[[int], Stack],
                  fn: Callable[[Stack], Any]) -> Any:  # fmt: skip
        """``render`` of stack ``sid``, whose frames are rebuilt (``frames_of``) only when its
        rendering is not cached."""
        hit = self.texts.get((kind, sid))
        if hit is not None:
            return hit[0]
        return self.render(owner, kind, sid, frames_of(sid), fn)

    def put_summary(self, owner: CacheOwner, idx: int, summ: Summary) -> None:
        """Keep ``summ``, making room for it (up to ``SUMMARY_SHARE``) by dropping renderings,
        oldest first, then the rebuilt stacks, then function keys: a summary saves a pass
        over a whole bucket on every top query while the bucket stays, each of those one
        stack's work."""
        st = self.stats
        with self.lock:
            old = self.summaries.pop(idx, None)
            if old is not None:
                st.cache_bytes -= old.nbytes
            if (owner.holds_bucket(idx) and st.cache_bytes + summ.nbytes > self.max_bytes
                    and self.summary_bytes() + summ.nbytes <= self.max_bytes * SUMMARY_SHARE):
                self._make_room(summ.nbytes)
            if (owner.holds_bucket(idx) and st.cache_bytes + summ.nbytes <= self.max_bytes
                    and st.bytes_estimate + summ.nbytes <= owner.max_bytes):  # fmt: skip
                self.summaries[idx] = summ
                st.cache_bytes += summ.nbytes

    def summary_bytes(self) -> int:
        return sum(sm.nbytes for sm in self.summaries.values())

    def _make_room(self, size: int) -> None:
        """Drop renderings, oldest first, then the rebuilt stacks, then function keys, oldest
        first, until ``size`` more bytes fit the share (under the lock). Function keys fill
        whatever is free (a filtered top walks every stack), so without this a top query
        that came first would leave the summaries no room for good."""
        st = self.stats
        if self.texts:
            for key in list(self.texts):
                if st.cache_bytes + size <= self.max_bytes:
                    return
                st.cache_bytes -= self.texts.pop(key)[1]
        if st.cache_bytes + size > self.max_bytes and self.stack_bytes:
            self._drop_stacks()
        if st.cache_bytes + size > self.max_bytes and self.func_keys:
            for sid in list(self.func_keys):
                if st.cache_bytes + size <= self.max_bytes:
                    return
                keys = self.func_keys.pop(sid)
                freed = _keys_size(keys)
                self.keys_bytes -= freed
                st.cache_bytes -= freed

    def drop_stack(self, sid: int) -> None:
        """The renderings and frames of a stack the store frees (its pooled frames stay until
        the pool is dropped whole)."""
        if sid in self.func_keys:
            with self.lock:
                keys = self.func_keys.pop(sid, None)
                if keys is not None:
                    size = _keys_size(keys)
                    self.keys_bytes -= size
                    self.stats.cache_bytes -= size
        if sid in self.stacks:
            with self.lock:
                fr = self.stacks.pop(sid, None)
                if fr is not None:
                    size = _STACK_TUPLE_BYTES + 8 * len(fr)
                    self.stack_bytes -= size
                    self.stats.cache_bytes -= size
        if not self.texts:
            return
        with self.lock:
            for kind in self.text_kinds:
                hit = self.texts.pop((kind, sid), None)
                if hit is not None:
                    self.stats.cache_bytes -= hit[1]

    def drop_bucket(self, idx: int) -> None:
        """The summary of a bucket the store evicts."""
        if not self.summaries:
            return
        with self.lock:
            old = self.summaries.pop(idx, None)
            if old is not None:
                self.stats.cache_bytes -= old.nbytes

    def clear(self) -> None:
        with self.lock:
            self.texts.clear()
            self.summaries.clear()
            self.stacks.clear()
            self.pool.clear()
            self.stack_bytes = 0
            self.func_keys.clear()
            self.keys_bytes = 0
            self.stats.cache_bytes = 0


def _keys_size(keys: Keys) -> int:
    """What a stack's function keys cost the share (``keys_bytes``)."""
    return _KEYS_BYTES + _KEY_BYTES * len(keys[1]) if keys else _KEYS_BYTES


class Summary(NamedTuple):
    """What ``top`` needs of one bucket: computed from one frozen version of its counts (a
    snapshot's: the store copies a shared bucket before writing it), so it stays valid for that
    version; the next version's summary adds only what changed (counts only grow)."""

    counts: Counter[Key]
    samples: int
    self_c: Counter[FuncKey]
    total_c: Counter[FuncKey]
    nbytes: int


def summarize(counts: Counter[Key], keys_of: KeysOf, base: Summary | None) -> Summary:
    by_sid: dict[int, int] = {}
    get = by_sid.get
    if base is not None:
        old = base.counts
        oget = old.get
        seen = 0
        for key, n in counts.items():
            o = oget(key)
            if o is not None:
                seen += 1
                if n == o:
                    continue
                if n < o:
                    seen = -1
                    break
                n -= o
            sid = key[3]
            by_sid[sid] = get(sid, 0) + n
        if seen == len(old):
            samples = base.samples
            self_c = Counter(base.self_c)
            total_c = Counter(base.total_c)
        else:  # not a later version of the same bucket (evicted, then a late sample)
            base = None
            by_sid = {}
            get = by_sid.get
    if base is None:
        for key, n in counts.items():
            sid = key[3]
            by_sid[sid] = get(sid, 0) + n
        samples = 0
        self_c = Counter()
        total_c = Counter()
    for sid, n in by_sid.items():
        samples += n
        keys = keys_of(sid)
        if keys:
            self_c[keys[0]] += n
            for k in keys[1]:
                total_c[k] += n
    nbytes = (len(self_c) + len(total_c)) * _SUMMARY_KEY_BYTES + len(counts) * _SUMMARY_ENTRY_BYTES
    return Summary(counts, samples, self_c, total_c, nbytes)


def top_summaries(
    store: CacheOwner | None,
    buckets: Sequence[tuple[int, Counter[Key]]],
    keys_of: KeysOf,
    bucket_ns: int,
    since_ns: int | None,
    until_ns: int | None,
    limit: int,
) -> tuple[int, list[FunctionCount]]:
    """``top_functions`` of an unfiltered query, merged from per-bucket summaries (cached in
    the store, made incrementally)."""
    lo = None if since_ns is None else since_ns // bucket_ns
    hi = None if until_ns is None else (until_ns - 1) // bucket_ns
    cache = store.caches.summaries if store is not None else {}
    summs: list[Summary] = []
    for idx, counts in buckets:
        if (lo is not None and idx < lo) or (hi is not None and idx > hi):
            continue
        base = cache.get(idx)
        if base is None or base.counts is not counts:
            base = summarize(counts, keys_of, base)
            if store is not None:
                store.caches.put_summary(store, idx, base)
        summs.append(base)
    if not summs:
        return 0, []
    if len(summs) == 1:
        self_c, total_c, samples = summs[0].self_c, summs[0].total_c, summs[0].samples
    else:
        self_c, total_c = Counter(summs[0].self_c), Counter(summs[0].total_c)
        for sm in summs[1:]:
            self_c.update(sm.self_c)
            total_c.update(sm.total_c)
        samples = sum(sm.samples for sm in summs)
    ranked = sorted(total_c, key=lambda k: (-self_c[k], -total_c[k], k[0]))
    # Functions tied on (self, total, sym) (same name, other dso) keep top_functions' order:
    # the order in which its walk over the ranked entries first meets them.
    runs: list[tuple[int, int]] = []  # [start, end) of tied runs that reach into the limit
    i = 0
    while i < min(limit, len(ranked)):
        a, j = ranked[i], i + 1
        while (j < len(ranked) and ranked[j][0] == a[0] and self_c[ranked[j]] == self_c[a]
               and total_c[ranked[j]] == total_c[a]):  # fmt: skip
            j += 1
        if j - i > 1:
            runs.append((i, j))
        i = j
    if runs:
        first = first_seen({k for i, j in runs for k in ranked[i:j]}, buckets, keys_of,
                           bucket_ns, since_ns, until_ns)  # fmt: skip
        for i, j in runs:
            ranked[i:j] = sorted(ranked[i:j], key=first.__getitem__)
    return samples, [FunctionCount(k[0], k[1], self_c[k], total_c[k]) for k in ranked[:limit]]


def first_seen(
    wanted: set[FuncKey],
    buckets: Iterable[tuple[int, Counter[Key]]],
    keys_of: KeysOf,
    bucket_ns: int,
    since_ns: int | None,
    until_ns: int | None,
) -> dict[FuncKey, int]:
    """Where top_functions first counts each wanted function: its walk goes over the query's
    entries ranked by count, the distinct stacks in that order, each stack's distinct keys in
    frame order. Stops when all are found."""
    total = merge_window(buckets, bucket_ns, since_ns, until_ns, None, None, None)
    out: dict[FuncKey, int] = {}
    seen: set[int] = set()
    pos = 0
    for key, _ in total.most_common():
        sid = key[3]
        if sid in seen:
            continue
        seen.add(sid)
        keys = keys_of(sid)
        if not keys:
            continue
        for k in keys[1]:
            if k in wanted and k not in out:
                out[k] = pos
            pos += 1
        if len(out) == len(wanted):
            break
    return out
