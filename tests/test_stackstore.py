"""The stack store: counts by window and filter, bounded memory with counted eviction."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from unwindd.stackfmt import Frame, UnwoundSample
from unwindd.stackstore import StackStore, top_functions

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
)
def test_nothing_lost_uncounted(
    events: list[tuple[int, int, str]], max_buckets: int, max_entries: int
) -> None:
    store = StackStore(bucket_ns=S, max_buckets=max_buckets, max_entries=max_entries)
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
    # Interned stacks are exactly those some entry still uses.
    used = Counter(key[3] for b in store._buckets.values() for key in b.counts)
    assert set(used) == set(store._stacks) and store.stats.stacks == len(used)
