"""The stack store: counts by window and filter, bounded memory with counted eviction."""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections import Counter
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st
from unwindd.store.queries import top_functions
from unwindd.store.stackstore import StackStore
from unwindd.unwind.stackfmt import Frame, UnwoundSample

S = 1_000_000_000
F = {n: Frame(0x1000 + i, "/bin/x", n, 0) for i, n in enumerate("abcdef")}


def sample(t: int, pid: int, *names: str, tid: int | None = None) -> UnwoundSample:
    frames = tuple(F[n] for n in names)
    return UnwoundSample(t, pid, tid or pid, 0, f"p{pid}", 1, "ok", frames)


def test_counts_by_window_and_filters() -> None:
    st_ = StackStore(bucket_ns=S)
    st_.add([sample(0, 1, "a", "b"), sample(1, 1, "a", "b"), sample(S + 5, 2, "c")])
    st_.add([sample(2 * S, 1, "a", "b", tid=11)])
    all_ = st_.query()
    assert sum(x.count for x in all_) == 4
    assert {(x.pid, x.tid, x.count) for x in all_} == {(1, 1, 2), (2, 2, 1), (1, 11, 1)}
    assert sum(x.count for x in st_.query(S, 2 * S)) == 1  # only bucket 1
    assert [x.count for x in st_.query(pids=[1], tid=1)] == [2]
    assert [x.pid for x in st_.query(comm="p2")] == [2]
    procs = {p.pid: p for p in st_.processes()}
    assert procs[1].samples == 3 and procs[1].comm == "p1" and procs[2].samples == 1
    assert st_.window() == (0, 3 * S)


def test_stacks_are_interned_and_freed_with_their_last_entry() -> None:
    st_ = StackStore(bucket_ns=S, max_buckets=2)
    st_.add([sample(0, 1, "a"), sample(0, 2, "a"), sample(S, 1, "b")])
    assert st_.stats.stacks == 2 and st_.stats.entries == 3
    st_.add([sample(2 * S, 1, "c")])  # evicts bucket 0: stack (a,) has no entry left
    assert st_.stats.evicted_buckets == 1 and st_.stats.evicted_samples == 2
    assert st_.stats.stacks == 2 and st_.stats.entries == 2
    assert {x.frames[0].sym for x in st_.query()} == {"b", "c"}


def test_entry_cap_evicts_oldest_first() -> None:
    st_ = StackStore(bucket_ns=S, max_entries=3)
    st_.add([sample(i * S, i, "a") for i in range(5)])
    assert st_.stats.entries <= 3
    kept = {x.pid for x in st_.query()}
    assert kept == {2, 3, 4}
    assert st_.stats.evicted_samples == 2


def test_subscribers_see_every_batch() -> None:
    st_ = StackStore()
    got: list[int] = []
    st_.subscribers.append(lambda b: got.append(len(b)))
    st_.add([sample(0, 1, "a")] * 3)
    st_.add([sample(1, 1, "a")])
    assert got == [3, 1]


def test_top_functions_self_and_total() -> None:
    st_ = StackStore()
    st_.add([sample(0, 1, "a", "b", "a"), sample(0, 1, "b", "c"), sample(0, 1, "a", "c")])
    top = {f.sym: (f.self_count, f.total_count) for f in top_functions(st_.query())}
    assert top == {"a": (2, 2), "b": (1, 2), "c": (0, 2)}


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.integers(1, 4), st.sampled_from(["a", "b", "c"])),
        max_size=200,
    ),
    st.integers(1, 8),
    st.integers(1, 50),
    st.integers(1, 20_000),
)
def test_nothing_lost_uncounted(
    events: list[tuple[int, int, str]], max_buckets: int, max_entries: int, max_bytes: int
) -> None:
    store = StackStore(bucket_ns=S, max_buckets=max_buckets, max_entries=max_entries,
                       max_bytes=max_bytes)  # fmt: skip
    rnd = random.Random(len(events))
    batch: list[UnwoundSample] = []
    for t, pid, name in events:
        batch.append(sample(t * S + rnd.randrange(S), pid, name))
        if rnd.random() < 0.3:
            store.add(batch)
            batch = []
    store.add(batch)
    held = sum(x.count for x in store.query())
    assert held + store.stats.evicted_samples == len(events) == store.stats.samples
    assert store.stats.entries <= max_entries and len(store._buckets) <= max_buckets
    assert store.stats.bytes_estimate <= max_bytes
    # Interned stacks are exactly those some entry still uses; frames are counted by object.
    used = Counter(key[3] for b in store._buckets.values() for key in b.counts)
    assert set(used) == set(store._stacks) and store.stats.stacks == len(used)
    stacks = list(store._stacks.values())
    assert store.stats.frame_slots == sum(map(len, stacks))
    assert store.stats.frames == len({id(f) for fr in stacks for f in fr})
    # The per-process summary is exactly the pids with an entry held, with their held samples.
    held_by_pid: Counter[int] = Counter()
    for x in store.query():
        held_by_pid[x.pid] += x.count
    assert {p.pid: p.samples for p in store.processes()} == dict(held_by_pid)
    assert store.stats.pids == len(store._procs) == len(held_by_pid)


def churn(pid: int, t: int, n_stacks: int = 3, depth: int = 12) -> list[UnwoundSample]:
    """One short-lived process under ASLR: new Frame objects (shared by its own stacks, as the
    engine does) and stacks no other process has."""
    base = 0x7F00_0000_0000 + pid * 0x10_0000
    frames = [Frame(base + 16 * i, "/usr/lib/libc.so.6", SYMS[i], 4 * i, rel=16 * i)
              for i in range(depth + n_stacks)]  # fmt: skip
    return [UnwoundSample(t, pid, pid, 0, "storm", 1, "ok", tuple(frames[k:k + depth]))
            for k in range(n_stacks)]  # fmt: skip


SYMS = [f"fn{i}" for i in range(64)]  # shared, like the ELF cache's symbol strings


def test_processes_pruned_with_their_last_entry() -> None:
    store = StackStore(bucket_ns=S, max_buckets=2)
    store.add([sample(0, 1, "a"), sample(0, 2, "a"), sample(S, 2, "b"), sample(S, 3, "c")])
    assert {p.pid: p.samples for p in store.processes()} == {1: 1, 2: 2, 3: 1}
    store.add([sample(2 * S, 4, "a")])  # evicts bucket 0: pid 1 has nothing left, pid 2 has
    assert {p.pid: p.samples for p in store.processes()} == {2: 1, 3: 1, 4: 1}
    assert set(store._procs) == set(store._pid_entries) == {2, 3, 4}
    store.add([sample(4 * S, 5, "a")])  # evicts bucket 1 (pids 2 and 3): buckets 2 and 4 left
    assert [p.pid for p in store.processes()] == [4, 5] and store.stats.pids == 2
    # Under churn the summary stays as small as the buckets, however many pids came and went.
    store = StackStore(bucket_ns=S, max_buckets=3)
    for pid in range(1000, 3000):
        store.add(churn(pid, (pid // 10) * S, n_stacks=1, depth=2))
    assert len(store._procs) == len(store._pid_entries) == 30 == store.stats.pids


def test_byte_cap_holds_under_churn_and_evictions_are_counted() -> None:
    cap = 2 << 20
    store = StackStore(bucket_ns=S, max_buckets=1000, max_entries=10**9, max_bytes=cap)
    added = 0
    for pid in range(10_000, 14_000):  # 4,000 processes, 12,000 distinct stacks, 10 per bucket
        batch = churn(pid, (pid // 10) * S)
        store.add(batch)
        added += len(batch)
        assert store.stats.bytes_estimate <= cap
    st_ = store.stats
    assert st_.evicted_buckets > 0 and st_.evicted_samples > 0
    assert sum(x.count for x in store.query()) + st_.evicted_samples == added == st_.samples
    assert st_.bytes_estimate > cap * 0.9  # evicts only what it must (one bucket at a time)
    assert len(store._procs) == st_.pids == len({x.pid for x in store.query()})
    assert len(store._stacks) == st_.stacks and len(store._by_obj) <= 2 * st_.stacks + 1024


def test_byte_estimate_matches_measured_memory() -> None:
    """The estimate is what the store really retains (tracemalloc), within 20%, for churn
    (frames new per process) and for a long-lived process (few frames, many stacks/entries)."""

    def measure(make: Callable[[], list[list[UnwoundSample]]]) -> tuple[int, int]:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        batches = make()
        store = StackStore(bucket_ns=S, max_buckets=10**6, max_entries=10**9, max_bytes=1 << 40)
        for b in batches:
            store.add(b)
        del batches  # the store alone holds the frames now
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        return used, store.stats.bytes_estimate

    used, est = measure(lambda: [churn(pid, pid * S) for pid in range(20_000, 22_000)])
    assert 0.8 < est / used < 1.2, (est, used)

    def steady() -> list[list[UnwoundSample]]:
        frames = [Frame(0x40_0000 + 16 * i, "/usr/bin/app", SYMS[i % 64], i) for i in range(64)]
        rnd = random.Random(1)
        return [[UnwoundSample(t * S + j, 7, 7 + j % 4, 0, "app", 1, "ok",
                               tuple(rnd.choice(frames) for _ in range(16))) for j in range(20)]
                for t in range(300)]  # fmt: skip

    used, est = measure(steady)
    assert 0.8 < est / used < 1.2, (est, used)


def test_byte_cap_with_a_snapshot_open() -> None:
    """Stacks an open snapshot still holds are out of the estimate (evicting more cannot free
    them), so a query in flight does not make the store evict everything; they are freed when
    it closes, and the snapshot still answers from what it saw."""
    cap = 1 << 20
    store = StackStore(bucket_ns=S, max_buckets=1000, max_entries=10**9, max_bytes=cap)
    pid = 30_000
    while store.stats.evicted_buckets == 0:
        store.add(churn(pid, (pid // 10) * S))
        pid += 1
    snap = store.snapshot()
    seen = sum(x.count for x in snap.query())
    buckets = len(store._buckets)
    for _ in range(200):
        store.add(churn(pid, (pid // 10) * S))
        pid += 1
    assert store.stats.bytes_estimate <= cap
    assert len(store._buckets) >= buckets - 30  # ~20 buckets' worth added, ~20 evicted
    assert store._deferred and len(store._stacks) > store.stats.stacks  # held for the snapshot
    assert sum(x.count for x in snap.query()) == seen  # every stack it sees is still there
    snap.close()
    store.add(churn(pid, (pid // 10) * S))
    assert not store._deferred and len(store._stacks) == store.stats.stacks
    stacks = list(store._stacks.values())
    assert store.stats.frames == len({id(f) for fr in stacks for f in fr})
