"""The stack store: counts by window and filter, bounded memory with counted eviction."""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections import Counter
from collections.abc import Callable
from typing import Any

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


def check_table(store: StackStore) -> None:
    """The table's frames are exactly those its stacks hold, counted per slot, and the stats
    say so (``bytes_estimate``'s parts are the table's own counts)."""
    t = store._table
    stacks = [t.frames(sid) for sid in t._enc]
    assert store.stats.frame_slots == t.slots == sum(map(len, stacks))
    slots: Counter[int] = Counter()
    for sid in t._enc:
        slots.update(t.frame_ids(sid))
    assert {fid: t._frefs[fid] for fid in slots} == dict(slots)
    live = {fid for fid, n in enumerate(t._frefs) if n}
    assert live == set(slots) and store.stats.frames == t.nframes == len(slots)
    assert not live & set(t._ffree) and len(live) + len(t._ffree) == len(t._frefs)
    assert all(t._uids[fid] == 0 for fid in t._ffree)


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
    # Interned stacks are exactly those some entry still uses; frames are those they hold.
    used = Counter(key[3] for b in store._buckets.values() for key in b.counts)
    assert set(used) == set(store._table._enc) and store.stats.stacks == len(used)
    check_table(store)
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
    # evicts only what it must (one bucket at a time), and leaves the query caches their share
    data = st_.bytes_estimate - st_.cache_bytes
    assert cap * 3 / 4 * 0.9 < data <= cap * 3 / 4
    assert len(store._procs) == st_.pids == len({x.pid for x in store.query()})
    assert len(store._table) == st_.stacks and len(store._by_obj) <= 2048
    check_table(store)


def test_byte_estimate_matches_measured_memory() -> None:
    """The estimate is what the store really retains (tracemalloc), within 15%, for churn
    (frames new per process), for a long-lived process (few frames, many stacks/entries), for
    groups as the live path hands them (add_counts, new ints per group, threads) and for
    processes of binaries of their own (new frames and strings)."""

    def measure(make: Callable[[], list[list[Any]]], counts: bool = False) -> tuple[int, int]:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        batches = make()
        store = StackStore(bucket_ns=S, max_buckets=10**6, max_entries=10**9, max_bytes=1 << 40)
        for b in batches:
            if counts:
                store.add_counts(b)
            else:
                store.add(b)
        del batches  # the store alone holds what it keeps now
        store._sweep()  # as the next batches do: the intern fast path lets go of the tuples
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        return used, store.stats.bytes_estimate

    used, est = measure(lambda: [churn(pid, pid * S) for pid in range(20_000, 22_000)])
    assert 0.85 < est / used < 1.15, (est, used)

    def steady() -> list[list[UnwoundSample]]:
        frames = [Frame(0x40_0000 + 16 * i, "/usr/bin/app", SYMS[i % 64], i) for i in range(64)]
        rnd = random.Random(1)
        return [[UnwoundSample(t * S + j, 7, 7 + j % 4, 0, "app", 1, "ok",
                               tuple(rnd.choice(frames) for _ in range(16))) for j in range(20)]
                for t in range(300)]  # fmt: skip

    used, est = measure(steady)
    assert 0.85 < est / used < 1.15, (est, used)

    def live() -> list[list[Any]]:
        rnd = random.Random(4)
        out = []
        for pid in range(60_000, 61_500):
            stacks = [tuple(s.frames) for s in aslr_process(pid, 0, rnd)[:3]]
            # ringstep makes every group's ints anew (int(str(...)): not the same objects)
            out.append([(int(str((pid + b) * S)), int(str(pid)), int(str(pid + th)), "app",
                         fr, 1) for b in range(3) for th in range(4) for fr in stacks])
        return out

    used, est = measure(live, counts=True)
    assert 0.85 < est / used < 1.15, (est, used)

    def binaries() -> list[list[UnwoundSample]]:
        # every process runs a binary of its own: new frames, with new strings (its path, its
        # symbols, its source files) that only the store holds once the batch is gone
        out = []
        for pid in range(70_000, 70_600):
            exe = f"/opt/app{pid}/bin/app"
            syms = [f"app{pid}_fn{i}" for i in range(20)]
            frames = [Frame(0x5500_0000_0000 + 16 * i, exe, syms[i], 4 * i, rel=16 * i,
                            file=f"/src/app{pid}/f{i % 4}.c", line=10 + i)
                      for i in range(20)]  # fmt: skip
            out.append([UnwoundSample(pid * S, pid, pid, 0, "app", 1, "ok",
                                      tuple(frames[k:k + 12])) for k in range(4)])  # fmt: skip
        return out

    used, est = measure(binaries)
    assert 0.85 < est / used < 1.15, (est, used)


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
    assert store._deferred and len(store._table) > store.stats.stacks  # held for the snapshot
    assert sum(x.count for x in snap.query()) == seen  # every stack it sees is still there
    snap.close()
    store.add(churn(pid, (pid // 10) * S))
    assert not store._deferred and len(store._table) == store.stats.stacks
    check_table(store)


def aslr_process(pid: int, t: int, rnd: random.Random) -> list[UnwoundSample]:
    """One process's samples as the engine names them: user frames of two binaries loaded at
    this process's own random bases (``rel`` the address inside the binary), inlined frames
    with source lines, a frame outside any mapping and kernel frames (absolute ips)."""
    libc = 0x7F00_0000_0000 + rnd.randrange(1 << 28) * 4096
    exe = 0x5500_0000_0000 + rnd.randrange(1 << 28) * 4096
    user = [Frame(libc + 0x2_8000 + 16 * i, "/usr/lib/libc.so.6", SYMS[i], 16 * i,
                  rel=0x2_8000 + 16 * i) for i in range(8)]  # fmt: skip
    user += [Frame(exe + 0x1000 + 8 * i, "/usr/bin/app", SYMS[8 + i % 3], 8 * i,
                   inlined=i % 2 == 1, rel=0x1000 + 8 * i, file="app.c", line=10 + i,
                   decl_file="app.h" if i % 2 else "app.c", decl_line=5 + i % 3)
             for i in range(6)]  # fmt: skip
    odd = Frame(0x1234_5678 + pid, None, None, None)  # no mapping: the ip is all there is
    kernel = [Frame(0xFFFF_FFFF_8100_0000 + 64 * i, "[kernel.kallsyms]", SYMS[20 + i], 4,
                    kernel=True) for i in range(3)]  # fmt: skip
    stacks = [tuple(kernel + user), tuple(user[3:]), (odd, *user[8:]), tuple(user[::-1] * 2)]
    return [UnwoundSample(t, pid, pid + k, 0, "app", 1, "ok", fr) for k, fr in enumerate(stacks)]


def test_stacks_round_trip_and_share_frames_across_processes() -> None:
    """Every answer's frames equal (all eleven fields) those added, whatever the process's load
    addresses; the same code in 300 processes is one set of frame entries, not 300."""
    rnd = random.Random(3)
    store = StackStore(bucket_ns=S)
    added: Counter[tuple[int, int, tuple[Frame, ...]]] = Counter()
    for pid in range(300):
        batch = aslr_process(1000 + pid, pid * S // 10, rnd)
        store.add(batch)
        added.update((s.pid, s.tid, s.frames) for s in batch)
    got = Counter({(x.pid, x.tid, x.frames): x.count for x in store.query()})
    assert got == added
    fields = ("ip", "dso", "sym", "offset", "kernel", "inlined", "rel", "file", "line",
              "decl_file", "decl_line")  # fmt: skip
    for x in store.query(pids=[1000]):
        orig = next(fr for (p, t, fr) in added if p == x.pid and t == x.tid)
        assert [[getattr(f, n) for n in fields] for f in x.frames] == [
            [getattr(f, n) for n in fields] for f in orig]  # fmt: skip
    # 8 libc + 6 app + 3 kernel frames shared by all; one unmapped frame per process
    assert store.stats.frames == 8 + 6 + 3 + 300
    check_table(store)
    # a stack with more distinct load addresses than a stack's delta index can name
    wide = tuple(Frame(0x10_0000 * (i + 1) + 5, "/lib/x.so", SYMS[i % 64], 0, rel=5)
                 for i in range(300))  # fmt: skip
    store.add([UnwoundSample(0, 1, 1, 0, "w", 1, "ok", wide)])
    assert [x.frames for x in store.query(pids=[1])] == [wide]
    check_table(store)


def test_eviction_returns_the_memory() -> None:
    """Evicting everything by bytes leaves the table empty and gives back what tracemalloc saw
    the store take (no frame or stack outlives its entries)."""
    rnd = random.Random(5)
    gc.collect()
    tracemalloc.start()
    store = StackStore(bucket_ns=S, max_buckets=10**6, max_entries=10**9, max_bytes=1 << 40)
    base = tracemalloc.get_traced_memory()[0]
    for pid in range(2000):
        store.add(aslr_process(5000 + pid, pid * S, rnd))
    store._sweep()
    gc.collect()
    full = tracemalloc.get_traced_memory()[0] - base
    est = store.stats.bytes_estimate
    store.max_bytes = 1
    store.add([UnwoundSample(10**5 * S, 1, 1, 0, "x", 1, "ok", ())])
    gc.collect()
    left = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert 0.85 < est / full < 1.15, (est, full)
    assert store.stats.stacks <= 1 and store.stats.frames == 0 and len(store._table) <= 1
    assert store.stats.table_bytes == store._table.nbytes < 200  # at most the empty stack
    assert store._table._rows == bytearray()  # no frame left: the rows go too
    assert store.stats.evicted_samples == store.stats.samples == 8001  # the last one too
    # what remains is the emptied dicts' hash tables (CPython does not shrink them; new stacks
    # reuse them) and the one entry
    assert left < full * 0.3, (left, full)


def test_intern_fast_path_lets_go_of_dropped_stacks() -> None:
    """The identity fast path keeps the caller's tuples only while the caller does (within
    _SWEEP_BATCHES batches of it letting go): the store itself holds no frame objects."""
    from unwindd.store.stackstore import _SWEEP_BATCHES

    store = StackStore(bucket_ns=S)
    kept = tuple(F[n] for n in "ab")
    dropped = (Frame(0x9000, "/bin/y", "gone", 0),)
    store.add_counts([(0, 1, 1, "p", kept, 1), (0, 1, 1, "p", dropped, 1)])
    gone = id(dropped)
    del dropped
    for _ in range(_SWEEP_BATCHES):
        store.add_counts([(0, 1, 1, "p", kept, 1)])
    assert gone not in store._by_obj and store._by_obj[id(kept)][0] is kept
    assert {x.frames[0].sym: x.count for x in store.query()} == {"a": 17, "gone": 1}


def test_table_stats_are_read_once_a_batch_and_hold_after_it() -> None:
    """The table's byte count and frames are read at the end of each batch that interned a
    stack (not per new stack), by ``add`` and ``add_counts`` alike: after a batch the stats
    are the table's."""
    store = StackStore(bucket_ns=S)
    reads = 0
    sync = store._sync_table

    def counting() -> None:
        nonlocal reads
        reads += 1
        sync()

    store._sync_table = counting  # type: ignore[method-assign]
    for batch in range(3):
        frames = [tuple(Frame(0x1000 * batch + i, "/bin/x", f"f{i}", 0) for i in range(k))
                  for k in range(1, 5)]  # fmt: skip
        if batch % 2:
            store.add([UnwoundSample(batch, 1, 1, 0, "p", 1, "ok", fr) for fr in frames])
        else:
            store.add_counts([(batch, 1, 1, "p", fr, 1) for fr in frames])
        t = store._table
        assert store.stats.table_bytes == t.nbytes and store.stats.frames == t.nframes
        check_table(store)
    assert reads == 3
