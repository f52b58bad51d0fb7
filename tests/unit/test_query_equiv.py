"""The query API's cached paths (rendered stacks, per-bucket top summaries, nlargest) answer the
same bytes as the straightforward computation (``stack_json`` / ``top_functions`` over
``StackStore.query``), on random store contents with eviction and late samples, queried
directly and through snapshots while the store keeps changing. JSON stacks answers are
rendered in small chunks here (``CHUNKS``), so most are written as they are rendered
(``ChunkedResponse``): their chunks joined are those bytes too."""

from __future__ import annotations

import json
import queue
import random
import threading
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pprofref import encode_profile as reference_profile
from unwindd.serve import api as api_module
from unwindd.serve.api import Api, Peer, rank_without_inline, stack_json, window_json
from unwindd.serve.httpapi import ChunkedResponse, Request, Response
from unwindd.store.queries import top_functions, top_lines
from unwindd.store.querycache import top_summaries
from unwindd.store.stackstore import StackStore
from unwindd.unwind import stackfmt
from unwindd.unwind.stackfmt import Frame, UnwoundSample

SEC = 1_000_000_000
# The JSON stacks answers' chunk here: a few stacks each (the daemon's is 256 KiB)
CHUNKS = 1000


class Source:
    def __init__(self, store: Any, now: int) -> None:
        self.store = store
        self.period_ns = 1_000_000
        self.max_stacks = 50
        self.now = now

    def status(self) -> dict[str, Any]:
        return {}

    def now_ns(self) -> int:
        return self.now

    def uid_of(self, pid: int) -> int | None:
        return 1000 if pid % 2 else 0

    def exe_of(self, pid: int) -> str | None:
        return None


def frame_pool(rng: random.Random, n: int) -> list[Any]:
    syms = ["main", "f", "g", "ñame", None, "x;y", "_start"]
    dsos = ["/bin/a", "/lib/libc.so.6", None, "[kernel.kallsyms]"]
    out = []
    for _ in range(n):
        ip = rng.randrange(1 << 48)
        user = rng.random() < 0.6  # a mapped user frame: it has a rel (the store keeps a delta)
        out.append(Frame(ip, rng.choice(dsos), rng.choice(syms),
                         rng.choice([None, 0, rng.randrange(4096)]), rng.random() < 0.2,
                         rel=ip & 0xFFFFF if user else None,
                         file=rng.choice([None, "/s/a.c", "/s/b.h"]), line=rng.randrange(50),
                         decl_file=rng.choice([None, "/s/b.h"]),
                         decl_line=rng.choice([None, 3])))  # fmt: skip
    for _ in range(n // 8):  # inline chains: inlined frames at the pc of the frame after them
        at = rng.choice(out[:n])
        chain = [Frame(at.ip, at.dso, rng.choice(syms), None, at.kernel, True, at.rel,
                       "/s/b.h", rng.randrange(50)) for _ in range(rng.randrange(1, 3))]
        out.append(tuple([*chain, at]))
    return out


def new_stack(rng: random.Random, pool: list[Any], stacks: list[tuple[Frame, ...]]
              ) -> tuple[Frame, ...]:  # fmt: skip
    """A stack of the pool's frames (an entry of it may be an inline chain); or one already
    held, its user frames loaded elsewhere (a process of the same binary under ASLR: the same
    frame keys, other ips)."""
    if rng.random() < 0.3 and len(stacks) > 1:
        shift = rng.randrange(1, 64) << 12
        return tuple(replace(f, ip=f.ip + shift) if f.rel is not None else f
                     for f in rng.choice(stacks))  # fmt: skip
    out: list[Frame] = []
    for _ in range(rng.randrange(0, 7)):
        got = rng.choice(pool)
        out.extend(got if isinstance(got, tuple) else (got,))
    return tuple(out)


def random_groups(rng: random.Random, pool: list[Any], stacks: list[tuple[Frame, ...]],
                  newest: int, n: int, wide: bool) -> list[Any]:  # fmt: skip
    out = []
    for _ in range(n):
        if rng.random() < 0.1:
            stacks.append(new_stack(rng, pool, stacks))
        t: int | None = (newest - rng.randrange(0, 4)) * SEC + rng.randrange(SEC)
        if rng.random() < 0.03:
            t = None
        elif rng.random() < 0.05:
            t = (newest - rng.randrange(4, 12)) * SEC  # late: maybe an evicted bucket
        count = rng.randrange(1, 1000) if wide else rng.randrange(1, 3)
        out.append((t, rng.randrange(1, 6), rng.randrange(1, 4), rng.choice(["a", "b", "çx"]),
                    rng.choice(stacks), count))  # fmt: skip
    return out


def reference_window(store: Any, now: int, since: int | None) -> dict[str, Any]:
    """The window the answer reports (the API's clock offset is 0 here)."""
    return window_json(*store.covered(since, None, now), 0)


def reference_stacks(store: Any, now: int, since: int | None, limit: int,
                     pids: Any = None) -> bytes:  # fmt: skip
    stacks = store.query(since, None, pids=pids)
    obj = {"samples": sum(s.count for s in stacks[:limit]), "truncated": len(stacks) > limit,
           "stacks": [stack_json(s) for s in stacks[:limit]],
           "window": reference_window(store, now, since)}  # fmt: skip
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def reference_top(store: Any, now: int, since: int | None, limit: int,
                  pids: Any = None) -> bytes:  # fmt: skip
    stacks = store.query(since, None, pids=pids)
    funcs = top_functions(stacks, limit)
    obj = {"samples": sum(s.count for s in stacks),
           "functions": [{"sym": fc.sym, "dso": fc.dso, "self": fc.self_count,
                          "total": fc.total_count} for fc in funcs],
           "window": reference_window(store, now, since)}  # fmt: skip
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def reference_lines(store: Any, now: int, since: int | None, limit: int,
                    pids: Any = None) -> bytes:  # fmt: skip
    stacks = store.query(since, None, pids=pids)
    obj = {"samples": sum(s.count for s in stacks),
           "lines": [{"file": lc.file, "line": lc.line, "sym": lc.sym, "dso": lc.dso,
                      "self": lc.self_count, "total": lc.total_count}
                     for lc in top_lines(stacks, limit)],
           "window": reference_window(store, now, since)}  # fmt: skip
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def reference_folded(store: Any, since: int | None, limit: int) -> bytes:
    folded: Counter[tuple[str, ...]] = Counter()
    for s in store.query(since, None)[:limit]:
        u = UnwoundSample(None, s.pid, s.tid, None, s.comm, None, "", s.frames)
        folded[stackfmt.folded_key(u)] += s.count
    return stackfmt.render_folded(folded).encode()


def api_of(src: Source, chunk_bytes: int = CHUNKS) -> Api:
    return Api(src, clock_offset=lambda: 0, chunk_bytes=chunk_bytes)


def reference_plain(store: Any, now: int, since: int | None, limit: int) -> bytes:
    """``reference_stacks`` of ``inline=0``: the stacks without inline frames, merged."""
    stacks, n = rank_without_inline(store.query(since, None), limit)
    obj = {"samples": sum(s.count for s in stacks), "truncated": n > limit,
           "stacks": [stack_json(s) for s in stacks],
           "window": reference_window(store, now, since)}  # fmt: skip
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 1 << 20), chunk=st.integers(1, 6000), snapshot=st.booleans(),
       inline=st.booleans(), limit=st.sampled_from([1, 5, 50]))  # fmt: skip
def test_chunked_json_answer_is_the_whole_answer(seed: int, chunk: int, snapshot: bool,
                                                 inline: bool, limit: int) -> None:  # fmt: skip
    """A JSON stacks answer in chunks of any size: past one chunk a ChunkedResponse, whose
    chunks joined are the whole answer's bytes (stack_json over query), each chunk at least
    the size but the last and at most the size plus one stack; rendered only as the chunks
    are taken (a stack's frames are rendered when its chunk is); one chunk: a Response."""
    rng = random.Random(seed)
    store = StackStore(bucket_ns=SEC, max_buckets=6)
    pool = frame_pool(rng, 30)
    stacks: list[tuple[Frame, ...]] = [()]
    for newest in range(100, 100 + rng.randrange(1, 5)):
        store.add_counts(random_groups(rng, pool, stacks, newest, rng.randrange(1, 80), True))
    now = 105 * SEC
    view = store.snapshot() if snapshot else store
    target = f"/v1/stacks?limit={limit}" + ("" if inline else "&inline=0")
    want = (reference_stacks(view, now, None, limit) if inline
            else reference_plain(view, now, None, limit))  # fmt: skip
    rendered: list[int] = []
    real = api_module.frames_json_bytes

    def counted(frames: Any) -> bytes:
        rendered.append(len(frames))
        return real(frames)

    api_module.frames_json_bytes = counted  # type: ignore[assignment]
    try:
        store.drop_caches()  # every stack's frames rendered by this answer
        res = api_of(Source(view, now), chunk).handle(
            Request("GET", target, "/v1/stacks", {"limit": [str(limit)]} |
                    ({} if inline else {"inline": ["0"]})), Peer(0))  # fmt: skip
        tail = len(want) - want.rindex(b'],"window":')
        rows = json.loads(want)["stacks"]
        # one chunk: the head and every stack (but the last's "}") under the size
        if not rows or len(want) - tail - 1 < chunk:
            assert isinstance(res, Response) and res.body == want
            return
        assert isinstance(res, ChunkedResponse)
        chunks = []
        biggest = max(len(json.dumps(s, separators=(",", ":"))) for s in rows)
        for c in res.chunks:
            chunks.append(c)
            # nothing rendered ahead: only the stacks of the chunks taken so far
            assert len(rendered) <= b"".join(chunks).count(b'{"pid":')
            # a chunk ends with the stack that reaches the size; the last has the tail too
            assert len(c) <= chunk + biggest + 1 + tail
        res.close()
        assert b"".join(chunks) == want
        assert all(len(c) >= chunk for c in chunks[:-1])
    finally:
        api_module.frames_json_bytes = real  # type: ignore[assignment]
        if snapshot:
            view.close()


def cache_sum(store: StackStore) -> int:
    c = store.caches
    rebuilt = sum(120 + 8 * len(fr) for fr in c.stacks.values()) + 336 * len(c.pool)
    assert c.stack_bytes == rebuilt
    keys = sum(200 + 72 * len(k[1]) if k else 200 for k in c.func_keys.values())
    assert c.keys_bytes == keys
    return (sum(size for _, size in c.texts.values()) + c.stack_bytes + c.keys_bytes
            + sum(sm.nbytes for sm in c.summaries.values()))  # fmt: skip


def get(api: Api, target: str, peer: Peer) -> bytes:
    from urllib.parse import parse_qs

    path, _, q = target.partition("?")
    res = api.handle(Request("GET", target, path, parse_qs(q, keep_blank_values=True)), peer)
    if isinstance(res, ChunkedResponse):
        try:
            return b"".join(res.chunks)
        finally:
            res.close()
    assert isinstance(res, Response) and res.status == 200, res
    return res.body


@pytest.mark.parametrize("seed", range(6))
def test_answers_equal_reference(seed: int) -> None:
    rng = random.Random(seed)
    wide = seed % 2 == 0  # narrow counts: many ties (top orders them as top_functions does)
    store = StackStore(bucket_ns=SEC, max_buckets=6, max_entries=400,
                       max_bytes=(1 << 20) if seed < 4 else 60_000)  # fmt: skip
    pool = frame_pool(rng, 40)
    stacks: list[tuple[Frame, ...]] = [()]
    newest = 100
    for step in range(40):
        newest += rng.choice([0, 0, 1, 2])
        store.add_counts(random_groups(rng, pool, stacks, newest, rng.randrange(1, 60), wide))
        now = newest * SEC + SEC // 2
        for view in ("store", "snapshot"):
            snap = store.snapshot() if view == "snapshot" else store
            api = api_of(Source(snap, now))
            for since in (None, 1, 3, 30):
                sq = "" if since is None else f"since={since}"
                s_ns = None if since is None else now - since * SEC
                for limit in (1, 7, 50):
                    body = get(api, f"/v1/stacks?{sq}&limit={limit}", Peer(0))
                    assert body == reference_stacks(snap, now, s_ns, limit), (step, since, limit)
                    body = get(api, f"/v1/top?{sq}&limit={limit}", Peer(0))
                    assert body == reference_top(snap, now, s_ns, limit), (step, since, limit)
                    body = get(api, f"/v1/stacks?{sq}&limit={limit}&format=folded", Peer(0))
                    assert body == reference_folded(snap, s_ns, limit)
                    body = get(api, f"/v1/top?{sq}&limit={limit}&by=line", Peer(0))
                    assert body == reference_lines(snap, now, s_ns, limit), (step, since, limit)
                lo, hi = snap.covered(s_ns, None, now)
                for limit in (7, 50):
                    body = get(api, f"/v1/stacks?{sq}&limit={limit}&format=pprof", Peer(0))
                    ref = reference_profile(snap.query(s_ns, None)[:limit], period_ns=1_000_000,
                                            time_nanos=lo, duration_nanos=hi - lo)  # fmt: skip
                    assert body == ref, (step, since, limit)
                body = get(api, f"/v1/stacks?{sq}&format=pprof&inline=0", Peer(0))
                plain = rank_without_inline(snap.query(s_ns, None), 50)[0]
                assert body == reference_profile(plain, period_ns=1_000_000, time_nanos=lo,
                                                 duration_nanos=hi - lo)  # fmt: skip
                # filtered: a pid, and a non-root peer (sees odd pids only)
                body = get(api, f"/v1/top?{sq}&pid=1,2", Peer(0))
                assert body == reference_top(snap, now, s_ns, 50, frozenset({1, 2}))
                odd = frozenset(p.pid for p in snap.processes() if p.pid % 2)
                body = get(api, f"/v1/stacks?{sq}", Peer(1000))
                assert body == reference_stacks(snap, now, s_ns, 50, odd)
                body = get(api, f"/v1/stacks?{sq}&format=pprof", Peer(1000))
                assert body == reference_profile(snap.query(s_ns, None, pids=odd)[:50],
                                                 period_ns=1_000_000, time_nanos=lo,
                                                 duration_nanos=hi - lo)  # fmt: skip
                body = get(api, f"/v1/top?{sq}", Peer(1000))
                assert body == reference_top(snap, now, s_ns, 50, odd)
                body = get(api, f"/v1/top?{sq}&by=line", Peer(1000))
                assert body == reference_lines(snap, now, s_ns, 50, odd)
            if view == "snapshot":
                snap.close()
        st = store.stats
        assert 0 <= st.cache_bytes <= store.caches.max_bytes
        assert st.cache_bytes == cache_sum(store)
        assert st.bytes_estimate <= store.max_bytes or not store._buckets
    assert store.stats.evicted_buckets > 0  # eviction happened along the way


def test_summary_path_answers_without_ties() -> None:
    f = [Frame(i, "/bin/a", f"fn{i}", 0) for i in range(6)]
    store = StackStore(bucket_ns=SEC)
    groups: list[Any] = [(5 * SEC, 1, 1, "a", (f[0], f[1], f[2]), 7),
                         (6 * SEC, 1, 1, "a", (f[3], f[1], f[2]), 3),
                         (6 * SEC, 2, 2, "b", (f[4], f[5]), 11)]  # fmt: skip
    store.add_counts(groups)
    snap = store.snapshot()
    fast = top_summaries(store, snap._buckets, snap._table.keys, SEC, None, None, 50)
    assert fast == (21, top_functions(snap.query(), 50))
    snap.close()
    assert store.caches.summaries and store.stats.cache_bytes > 0
    # a later version of bucket 6: the summary is brought up to date incrementally
    store.add_counts([(6 * SEC, 1, 1, "a", (f[3], f[1], f[2]), 2)])
    assert store.top() == (23, top_functions(store.query(), 50))


def test_caches_emptied_with_their_data_and_bounded() -> None:
    f = [Frame(i, "/bin/a", f"fn{i}", 0) for i in range(50)]
    store = StackStore(bucket_ns=SEC, max_buckets=2)
    api = api_of(Source(store, 0))
    for t in range(5):
        store.add_counts([(t * SEC, 1, 1, "a", (f[t], f[t + i]), i + 1) for i in range(10)])
        get(api, "/v1/stacks", Peer(0))
        get(api, "/v1/top", Peer(0))
        assert store.stats.cache_bytes > 0
        assert len(store.caches.texts) <= store.stats.stacks
        assert set(store.caches.summaries) <= set(store._buckets)
    # the rendered stacks and summaries of evicted buckets are gone
    for _, sid in store.caches.texts:
        assert sid in store._table
    store.drop_caches()
    assert store.stats.cache_bytes == 0
    # bounded: a store whose cache share holds two renderings caches at most that much
    small = StackStore(bucket_ns=SEC, max_bytes=8 * 400)
    small.add_counts([(0, 1, 1, "a", (f[i],), 1) for i in range(10)])
    api = api_of(Source(small, 0))
    body = get(api, "/v1/stacks", Peer(0))
    assert body == reference_stacks(small, 0, None, 50)
    assert small.stats.cache_bytes <= small.caches.max_bytes


def test_queries_on_a_thread_while_adding() -> None:
    """The daemon's shape: snapshots queried on a worker thread while the owner adds, evicts
    and releases stacks; answers equal the reference on the same snapshot, accounting holds."""
    rng = random.Random(7)
    store = StackStore(bucket_ns=SEC, max_buckets=4, max_entries=300)
    pool = frame_pool(rng, 30)
    stacks: list[tuple[Frame, ...]] = [()]
    errors: list[BaseException] = []
    snaps: queue.Queue[Any] = queue.Queue()

    def worker() -> None:
        while (item := snaps.get()) is not None:
            snap, now = item
            try:
                api = api_of(Source(snap, now))
                for limit in (5, 50):
                    body = get(api, f"/v1/stacks?since=3&limit={limit}", Peer(0))
                    assert body == reference_stacks(snap, now, now - 3 * SEC, limit)
                    body = get(api, f"/v1/top?limit={limit}", Peer(0))
                    assert body == reference_top(snap, now, None, limit)
            except BaseException as e:
                errors.append(e)
            finally:
                snap.close()

    t = threading.Thread(target=worker)
    t.start()
    newest = 10
    for _ in range(200):
        newest += rng.choice([0, 1])
        store.add_counts(random_groups(rng, pool, stacks, newest, 20, True))
        if rng.random() < 0.3:
            snaps.put((store.snapshot(), newest * SEC))
    snaps.put(None)
    t.join()
    assert not errors, errors[0]
    store.add_counts([])  # the last deferred releases
    assert store.stats.cache_bytes == cache_sum(store)
    for _, sid in store.caches.texts:
        assert sid in store._table


def test_rebuilt_frames_follow_reused_frame_ids() -> None:
    """A freed frame's id is reused by another frame at the same ip: queries cache the frames
    they rebuild (QueryCaches.pool), and must answer the new frame, not the cached old one."""
    store = StackStore(bucket_ns=SEC, max_buckets=1)
    for t, sym in enumerate(["old", "mid", "new"]):
        store.add_counts([(t * SEC, 1, 1, "a", (Frame(0xFFFF_FFFF_8100_0000, "[kernel.kallsyms]",
                                                      sym, 0, kernel=True),), 1)])
        assert [s.frames[0].sym for s in store.query()] == [sym]
        snap = store.snapshot()
        assert [s.frames[0].sym for s in snap.query()] == [sym]
        snap.close()
    assert store._table._ffree or len(store._table._frefs) == 2  # the id was reused


def test_pull_delta_matches_stacks_by_value() -> None:
    """The pprof pull endpoint subtracts a baseline query from a later one per stack: the two
    queries rebuild each stack, as the same objects only while the query caches hold them, so
    the match is by value (here the caches are dropped in between)."""
    from unwindd.serve.pprofpull import _baseline, _delta

    f = [Frame(0x7F00_0000_1000 + 16 * i, "/lib/x.so", f"fn{i}", 0, rel=0x1000 + 16 * i)
         for i in range(4)]  # fmt: skip
    store = StackStore(bucket_ns=SEC)
    store.add_counts([(0, 1, 1, "a", (f[0], f[1]), 5), (0, 2, 2, "b", (f[2], f[3]), 3)])
    base = _baseline(store.query())
    store.drop_caches()
    store.add_counts([(0, 1, 1, "a", (f[0], f[1]), 2)])
    now = store.query()
    assert now[0].frames is not base[(1, 1, "a", (f[0], f[1]))].frames
    assert [(s.pid, s.count, s.frames) for s in _delta(base, now)] == [(1, 2, (f[0], f[1]))]


def test_a_store_at_its_cap_keeps_its_caches() -> None:
    """Data leaves the caches their share of max_bytes: a store evicting for bytes at every
    batch (process churn at the cap) still answers repeated queries from its caches."""
    store = StackStore(bucket_ns=SEC, max_bytes=1 << 20)
    api = api_of(Source(store, 10**6 * SEC))
    pid = 1000
    while store.stats.evicted_buckets < 3:
        fr = tuple(Frame(0x7F00_0000_0000 + pid * 4096 + 16 * i, "/lib/x.so", f"f{i}", 0,
                         rel=16 * i) for i in range(12))  # fmt: skip
        store.add_counts([(pid // 20 * SEC, pid, pid, "c", fr[k:], 1) for k in range(4)])
        pid += 1
        get(api, "/v1/stacks?limit=200", Peer(0))
        get(api, "/v1/top", Peer(0))
    st = store.stats
    assert st.cache_bytes > store.caches.max_bytes // 2 and st.bytes_estimate <= 1 << 20
    assert st.cache_bytes == cache_sum(store)


def _ten_buckets(seed: int, max_bytes: int) -> tuple[StackStore, Any, int]:
    """A store of ten one-second buckets of random stacks (400 groups each), its API, and
    the time just after them."""
    store = StackStore(bucket_ns=SEC, max_bytes=max_bytes)
    rng = random.Random(seed)
    pool = frame_pool(rng, 60)
    stacks: list[tuple[Frame, ...]] = [()]
    for newest in range(20, 30):
        store.add_counts(random_groups(rng, pool, stacks, newest, 400, True))
    return store, api_of(Source(store, 30 * SEC)), 30 * SEC


def test_summaries_take_most_of_the_share() -> None:
    """Summaries take up to ``SUMMARY_SHARE`` (3/4) of the caches' share from renderings: with
    every bucket's summaries at 60 % of the share and the rest full of renderings, a top query
    keeps them all (one left out is a pass over its bucket on every top query)."""
    store, api, now = _ten_buckets(11, 64 << 20)
    caches = store.caches
    assert get(api, "/v1/top", Peer(0)) == reference_top(store, now, None, 50)
    total = caches.summary_bytes()
    assert total > 0 and len(caches.summaries) == len(store._buckets)
    caches.max_bytes = int(total / 0.6)
    assert caches.max_bytes // 2 < total < caches.max_bytes * 0.65
    store.drop_caches()
    for k in range(caches.max_bytes // 20_000 + 1):
        caches.render(store, f"k{k}", next(iter(store._table._enc)), (), lambda _: "x" * 20_000)
    assert store.stats.cache_bytes > caches.max_bytes - 20_200
    assert get(api, "/v1/top", Peer(0)) == reference_top(store, now, None, 50)
    assert len(caches.summaries) == len(store._buckets)
    assert store.stats.cache_bytes <= caches.max_bytes
    assert store.stats.cache_bytes == cache_sum(store)


def test_summaries_displace_function_keys() -> None:
    """A filtered top first (it walks every entry: the stacks' function keys take the free
    share), then unfiltered ones: the summaries still take up to ``SUMMARY_SHARE``,
    displacing function keys too, so every bucket's is kept (one left out is a pass over its
    bucket on every top query)."""
    store, api, now = _ten_buckets(11, 64 << 20)
    caches = store.caches
    assert get(api, "/v1/top", Peer(0)) == reference_top(store, now, None, 50)
    total = caches.summary_bytes()
    store.drop_caches()
    caches.max_bytes = int(total / 0.7)
    get(api, "/v1/top?pid=1,2,3,4,5", Peer(0))
    assert caches.keys_bytes > caches.max_bytes * 0.3 and not caches.summaries
    for _ in range(2):
        assert get(api, "/v1/top", Peer(0)) == reference_top(store, now, None, 50)
        assert len(caches.summaries) == len(store._buckets)
        assert store.stats.cache_bytes <= caches.max_bytes
        assert store.stats.cache_bytes == cache_sum(store)


def test_summaries_displace_renderings() -> None:
    """A cache share full of renderings (a large JSON answer) still takes the per-bucket top
    summaries: they displace renderings, oldest first, so the next top query summarizes only
    what changed. Answers stay those of the straightforward computation."""
    store, api, now = _ten_buckets(7, 4 << 20)
    caches = store.caches
    for _ in range(3):
        get(api, "/v1/stacks", Peer(0))  # renders each stack (max_stacks: 50) ...
        for k in range(60):  # ... and fills the rest of the share with renderings
            caches.render(store, f"k{k}", next(iter(store._table._enc)), (),
                          lambda _: "x" * 20_000)
        assert store.stats.cache_bytes > caches.max_bytes - 20_200
        assert get(api, "/v1/top", Peer(0)) == reference_top(store, now, None, 50)
        assert len(caches.summaries) == len(store._buckets)  # every bucket's is kept
        assert store.stats.cache_bytes <= caches.max_bytes
        assert store.stats.cache_bytes == cache_sum(store)


@pytest.mark.parametrize("odd", ["", "name", "comm"])
def test_folded_orders_names_as_tuples(odd: str) -> None:
    """The folded answer's bytes path (api.folded_of_ids, stackfmt.render_folded_bytes) against
    the tuples' text, on the names whose order a join could change: prefixes, characters below
    ';' (space, digits, ':' from a ';'), non-ASCII, empty stacks and comms; a NUL in a name or
    a comm (``odd``) takes the tuples' way, with the same bytes."""
    rng = random.Random(7)
    syms = ["a", "a0", "a b", "a;b", "a:b", "ab", "ñ", "é", "\U0001f600", None]
    if odd == "name":
        syms.append("a\0b")
    comms = ["x", "x0", "x y", "çx", "", "x;y"] + (["x\0y"] if odd == "comm" else [])
    pool = [Frame(i << 12, "/bin/a", s, 0, False, False, i << 12) for i, s in enumerate(syms)]
    pool += [Frame(1 << 40, None, "a", 0, True), Frame(1 << 12, "/bin/a", "a", 0, False, True)]
    stacks = [tuple(rng.choice(pool) for _ in range(rng.randrange(0, 4))) for _ in range(300)]
    store = StackStore(bucket_ns=SEC, max_buckets=6)
    store.add_counts([(SEC, rng.randrange(1, 4), 1, rng.choice(comms), rng.choice(stacks),
                       rng.randrange(1, 9)) for _ in range(1000)])  # fmt: skip
    api = api_of(Source(store, 2 * SEC))
    api.source.max_stacks = 5000  # type: ignore[attr-defined]
    body = get(api, "/v1/stacks?limit=5000&format=folded", Peer(0))
    assert body == reference_folded(store, None, 5000)
    assert body.count(b"\n") > 300, body.count(b"\n")
    assert (b"\0" in body) == bool(odd)
