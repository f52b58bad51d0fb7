"""Tests of ``unwindd.source.ordering``: perf's round rule, stability, lateness accounting, untimed
records, the memory cap, and "nothing lost" under any push order.

The live model used by the merge property: each CPU's ring is time-ordered; a round drains the
rings one after the other, ring c at instant d[k][c], taking every record written up to then;
instants only move forward. That is exactly the guarantee perf's FINISHED_ROUND rule needs
(``tools/perf/util/session.c``, ``process_finished_round``), so no record may come out late.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence

import recordbytes as rb
from hypothesis import given, settings
from hypothesis import strategies as st
from unwindd.source.decoder import RecordDecoder
from unwindd.source.formats import EventFormat
from unwindd.source.ordering import OrderStats, RoundOrderer, lateness_bucket
from unwindd.source.records import BadRecord, FinishedRound, Record, Sample, Unknown

_tags = itertools.count(1)


def smp(time: int | None, cpu: int | None = 0, tag: int | None = None) -> Sample:
    """A Sample whose ``ip`` is a unique tag, so equal-time records stay distinguishable."""
    t = next(_tags) if tag is None else tag
    return Sample(0, 1, 1, time, cpu, t, None, None, (), 0, 0, (), b"", 0)


def times(recs: Iterable[Record]) -> list[int | None]:
    return [r.time for r in recs]


def ips(recs: Iterable[Record]) -> list[int | None]:
    return [r.ip if isinstance(r, Sample) else None for r in recs]


def check_accounting(o: RoundOrderer) -> None:
    s = o.stats
    assert s.pushed == s.delivered + s.queued
    assert s.late == sum(s.late_buckets.values())


def out_of_order(out: Sequence[Record]) -> int:
    """Timed records delivered after a newer one (what ``stats.late`` must cover)."""
    n, hi = 0, -1
    for r in out:
        if r.time is None:
            continue
        if r.time < hi:
            n += 1
        hi = max(hi, r.time)
    return n


# --------------------------------------------------------------------------- the rule


def test_session_c_worked_example() -> None:
    # The three passes drawn in perf's session.c comment above process_finished_round.
    o = RoundOrderer()
    passes = [
        ([1, 2], [2, 3, 4]),
        ([3, 4, 5], [5, 6, 7]),
        ([6, 7], [8, 9, 10]),
    ]
    flushed = []
    for cpu0, cpu1 in passes:
        o.push_many(smp(t, 0) for t in cpu0)
        o.push_many(smp(t, 1) for t in cpu1)
        flushed.append(times(o.end_round()))
    assert flushed[0] == []  # nothing is known to be safe after one pass
    # "Flush every events below timestamp 4": do_flush stops at timestamp > limit, so "below"
    # means <= 4, and records of the current pass that are <= 4 go too.
    assert flushed[1] == [1, 2, 2, 3, 3, 4, 4]
    assert flushed[2] == [5, 5, 6, 6, 7, 7]  # "... below timestamp 7"
    assert times(o.flush_all()) == [8, 9, 10]
    assert o.stats == OrderStats(
        queued=0, delivered=16, late=0, max_lateness_ns=0, rounds=3, forced_flushes=0,
        untimed=0, pushed=16, markers=0,
    )  # fmt: skip


def test_equal_times_keep_arrival_order() -> None:
    o = RoundOrderer()
    a, b, c, d = smp(5, 1), smp(5, 0), smp(3, 2), smp(5, 2)
    o.push_many([a, b, c, d])
    o.end_round()
    assert o.end_round() == [c, a, b, d]


def test_time_zero_flushes_in_first_round() -> None:
    # perf starts next_flush at 0: nothing can be older than 0, so time-0 records are safe.
    o = RoundOrderer()
    z, one = smp(0), smp(1)
    o.push_many([one, z])
    assert o.end_round() == [z]
    assert o.end_round() == [one]


def test_late_record_counted_and_still_delivered() -> None:
    o = RoundOrderer()
    o.push_many([smp(100), smp(1000)])
    o.end_round()
    assert times(o.end_round()) == [100, 1000]
    late = smp(40)
    o.push(late)  # 960 ns older than the newest delivered record
    o.push(smp(1000))  # equal to last_flush: not late
    assert o.stats.late == 1 and o.stats.max_lateness_ns == 960
    assert o.stats.late_buckets == Counter({1024: 1})
    out = o.end_round()  # delivered at the next flush, ahead of its time-order peers
    assert out == [late, *out[1:]] and times(out) == [40, 1000]
    check_accounting(o)


def test_late_delivered_at_next_flush_exactly() -> None:
    o = RoundOrderer()
    o.push(smp(500))
    o.end_round()
    o.end_round()
    late = smp(10)
    o.push(late)
    o.push(smp(600))
    out = o.end_round()
    assert out == [late]  # the 600 waits for the next round, the late record does not
    assert o.stats.late == 1 and o.stats.max_lateness_ns == 490


def test_lateness_bucket() -> None:
    assert [lateness_bucket(n) for n in (1, 2, 3, 4, 5, 1000, 1024, 1025)] == [
        1, 2, 4, 4, 8, 1024, 1024, 2048,
    ]  # fmt: skip


def test_untimed_records_ride_with_their_predecessor() -> None:
    o = RoundOrderer()
    bad = BadRecord(9, 0, 16, "short_body")
    unk = Unknown(17, 0, b"")  # KSYMBOL without sample_id
    notime = smp(None, cpu=1)  # attr without PERF_SAMPLE_TIME, but with CPU
    first = smp(None, cpu=None)  # before any time is known
    a0, a1, b0 = smp(10, 0), smp(20, 1), smp(15, 0)
    o.push_many([first, a0, bad, a1, unk, notime, b0])
    assert o.stats.untimed == 4
    out = o.end_round() + o.flush_all()
    assert out == [first, a0, bad, b0, a1, unk, notime]
    assert o.stats.late == 0
    check_accounting(o)


def test_untimed_uses_last_time_of_its_cpu() -> None:
    o = RoundOrderer()
    c0, c1 = smp(100, 0), smp(50, 1)
    notime0 = smp(None, cpu=0)
    o.push_many([c0, c1, notime0])  # arrival predecessor is c1 (cpu 1); cpu 0 says 100
    assert o.flush_all() == [c1, c0, notime0]


def test_finished_round_pushed_by_hand_is_consumed() -> None:
    o = RoundOrderer()
    o.push(FinishedRound())
    o.push(smp(1))
    assert times(o.flush_all()) == [1]
    assert o.stats.markers == 1 and o.stats.pushed == 1 and o.stats.delivered == 1


def test_memory_cap_forces_oldest_half() -> None:
    o = RoundOrderer(max_queued=10)
    recs = [smp(t) for t in (50, 40, 30, 20, 10, 60, 70, 80, 90, 100, 110)]
    o.push_many(recs)
    assert o.stats.forced_flushes == 1 and o.stats.queued == 11
    ready = o.take_ready()
    assert times(ready) == [10, 20, 30, 40, 50]
    o.push(smp(45))  # older than what the forced flush delivered: late
    assert o.stats.late == 1 and o.stats.max_lateness_ns == 5
    rest = o.end_round()  # limit is max(next_flush=0, last_flush=50): the late one comes out
    assert times(rest) == [45]
    assert times(o.flush_all()) == [60, 70, 80, 90, 100, 110]
    check_accounting(o)


def test_memory_cap_bounds_the_heap() -> None:
    o = RoundOrderer(max_queued=100)
    rng = random.Random(7)
    total = 0
    for t in range(5000):
        o.push(smp(t + rng.randrange(50)))
        assert len(o._heap) <= 100
        total += len(o.take_ready())
    total += len(o.flush_all())
    assert total == 5000 and o.stats.forced_flushes > 0
    check_accounting(o)


def test_invalid_cap() -> None:
    try:
        RoundOrderer(max_queued=0)
    except ValueError:
        return
    raise AssertionError("max_queued=0 accepted")


# --------------------------------------------------------------------------- file order


def test_feed_file_order_from_decoded_bytes() -> None:
    # A perf.data-style stream: each pass writes ring 0 then ring 1, then FINISHED_ROUND.
    st_ = rb.S_TID | rb.S_TIME | rb.S_CPU | rb.S_IP

    def s(t: int, cpu: int) -> bytes:
        return rb.sample(st_, ip=t, pid=1, tid=1, time=t, cpu=cpu)

    buf = (
        s(1, 0) + s(2, 0) + rb.comm(pid=1, tid=1, comm="x", sample_type=st_,
                                    sid=rb.Sid(pid=1, tid=1, time=3, cpu=0))
        + s(2, 1) + s(4, 1) + rb.finished_round()
        + s(5, 0) + s(3, 1) + s(6, 1) + rb.finished_round()
        + s(7, 0) + rb.raw_record(rb.SAMPLE, 0, b"\0" * 4)  # a broken record, no time
    )  # fmt: skip
    dec = RecordDecoder([EventFormat(st_)])
    o = RoundOrderer()
    out = list(o.feed_file_order(dec.decode(buf)))
    assert [r.time for r in out] == [1, 2, 2, 3, 3, 4, 5, 6, 7, None]
    assert isinstance(out[-1], BadRecord)
    assert not any(isinstance(r, FinishedRound) for r in out)
    assert o.stats.rounds == 2 and o.stats.late == 0 and o.stats.untimed == 1
    check_accounting(o)


def test_feed_file_order_yields_forced_records_early() -> None:
    o = RoundOrderer(max_queued=4)
    it = o.feed_file_order(smp(t) for t in range(100))
    first = list(itertools.islice(it, 2))
    assert times(first) == [0, 1]  # before the input is exhausted
    assert times(first + list(it)) == list(range(100))


# --------------------------------------------------------------------------- properties


@st.composite
def live_drains(draw: st.DrawFn) -> tuple[list[list[Record]], list[Record]]:
    """Rounds of drained records obeying the per-ring guarantee, plus all records in."""
    ncpu = draw(st.integers(1, 5))
    n = draw(st.integers(0, 120))
    horizon = draw(st.integers(1, 400))  # small horizons force many equal times
    written = sorted(
        (draw(st.integers(0, horizon)), draw(st.integers(0, ncpu - 1))) for _ in range(n)
    )
    nrounds = draw(st.integers(1, 12))
    instants = sorted(draw(st.integers(0, horizon)) for _ in range(nrounds * ncpu))
    untimed_every = draw(st.sampled_from([0, 3, 7]))
    rings: list[list[Record]] = [[] for _ in range(ncpu)]
    for i, (t, cpu) in enumerate(written):
        rings[cpu].append(smp(t, cpu))
        if untimed_every and i % untimed_every == 0:
            rings[cpu].append(smp(None, cpu))  # e.g. a sample of an attr without TIME
    pos = [0] * ncpu
    rounds: list[list[Record]] = []
    for k in range(nrounds):
        batch: list[Record] = []
        for cpu in range(ncpu):
            d = instants[k * ncpu + cpu]
            ring = rings[cpu]
            # Drain ring `cpu` at instant d: everything written up to d. An untimed record
            # travels with the timed record written just before it.
            while pos[cpu] < len(ring):
                rt = ring[pos[cpu]].time
                if rt is not None and rt > d:
                    break
                batch.append(ring[pos[cpu]])
                pos[cpu] += 1
        rounds.append(batch)
    rounds.append([r for cpu in range(ncpu) for r in rings[cpu][pos[cpu] :]])  # final drain
    everything = [r for ring in rings for r in ring]
    return rounds, everything


@settings(max_examples=300, deadline=None)
@given(live_drains())
def test_live_rounds_merge_in_global_time_order(
    case: tuple[list[list[Record]], list[Record]],
) -> None:
    rounds, everything = case
    o = RoundOrderer()
    out: list[Record] = []
    arrival: dict[int, int] = {}
    for batch in rounds:
        for r in batch:
            assert isinstance(r, Sample) and r.ip is not None
            arrival[r.ip] = len(arrival)
        o.push_many(batch)
        out += o.end_round()
    out += o.flush_all()
    assert Counter(out) == Counter(everything)  # nothing lost, nothing duplicated
    timed = [r for r in out if r.time is not None]
    ts = [r.time or 0 for r in timed]
    assert ts == sorted(ts)  # global time order
    assert o.stats.late == 0 and o.stats.forced_flushes == 0
    for a, b in itertools.pairwise(timed):  # stable: equal times keep arrival order
        if a.time == b.time:
            assert isinstance(a, Sample) and isinstance(b, Sample)
            assert arrival[a.ip or 0] < arrival[b.ip or 0]
    # An untimed record comes right after the record it was drained behind.
    pos = {id(r): i for i, r in enumerate(out)}
    for batch in rounds:
        for prev, r in itertools.pairwise(batch):
            if r.time is None and prev.cpu == r.cpu and prev.time is not None:
                assert pos[id(r)] == pos[id(prev)] + 1
    check_accounting(o)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.integers(0, 1000).map(lambda t: ("push", t)),
            st.just(("push", None)),
            st.just(("round", 0)),
            st.just(("ready", 0)),
        ),
        max_size=200,
    ),
    cap=st.integers(1, 40),
)
def test_any_order_loses_nothing_and_counts_lateness(
    ops: list[tuple[str, int | None]], cap: int
) -> None:
    o = RoundOrderer(max_queued=cap)
    pushed: list[Record] = []
    out: list[Record] = []
    for op, t in ops:
        if op == "push":
            r = smp(t, cpu=t % 4 if t is not None else None)
            pushed.append(r)
            o.push(r)
            assert len(o._heap) <= cap
        elif op == "round":
            out += o.end_round()
        else:
            out += o.take_ready()
        check_accounting(o)
    out += o.flush_all()
    assert Counter(out) == Counter(pushed)
    assert o.stats.queued == 0 and o.stats.delivered == len(pushed)
    assert out_of_order(out) <= o.stats.late  # every inversion was counted
    assert o.stats.max_lateness_ns <= 1000


class _CountedTime(int):
    """A record time that counts every comparison made on it: the heap's (through its
    (time, seq, record) entries: == first, then <) and the orderer's own."""

    calls = 0

    def __eq__(self, other: object) -> bool:
        _CountedTime.calls += 1
        return int.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        _CountedTime.calls += 1
        return int.__ne__(self, other)

    def __lt__(self, other: int) -> bool:
        _CountedTime.calls += 1
        return int.__lt__(self, other)

    def __le__(self, other: int) -> bool:
        _CountedTime.calls += 1
        return int.__le__(self, other)

    def __gt__(self, other: int) -> bool:
        _CountedTime.calls += 1
        return int.__gt__(self, other)

    def __ge__(self, other: int) -> bool:
        _CountedTime.calls += 1
        return int.__ge__(self, other)

    __hash__ = int.__hash__


def test_many_records_logarithmic_comparisons() -> None:
    """The cost the module promises, O(log n) per record for n queued, counted in comparisons
    of record times (not in seconds, which the machine's load sets): 200k records over 8 CPUs,
    ~2000 queued at a round's end. One heappush is at most log2(n) entry comparisons and one
    heappop at most 2 log2(n), each at most two on the time (== then <); the orderer's own
    bookkeeping adds a few per record. An orderer that kept a sorted list or searched for the
    minimum would make ~n per record."""
    rng = random.Random(1)
    o = RoundOrderer()
    clock = 0
    n = comparisons = peak = 0

    def within_bound() -> bool:  # so far (checked every round: a quadratic orderer fails fast)
        return comparisons <= o.stats.pushed * (6 * math.log2(peak) + 8)

    for _ in range(200):
        batch = []
        for cpu in range(8):
            for _ in range(125):
                clock += rng.randrange(3)
                batch.append(smp(_CountedTime(clock + rng.randrange(20)), cpu))
        batch.sort(key=lambda r: (r.cpu, r.time))  # each CPU's in time order, as a ring's
        before = _CountedTime.calls
        o.push_many(batch)
        peak = max(peak, o.stats.queued)
        n += len(o.end_round())
        comparisons += _CountedTime.calls - before
        assert within_bound(), (comparisons / o.stats.pushed, peak)
    before = _CountedTime.calls
    n += len(o.flush_all())
    comparisons += _CountedTime.calls - before
    assert n == o.stats.pushed == 200_000 and 1000 <= peak <= 4000, peak
    assert within_bound(), (comparisons / n, peak)


def test_add_native_counts_a_rounds_late_records() -> None:
    """One native call's counts add up (the queue gauge is taken); its late records go to the
    lateness histogram, a round without any leaves it as it was."""
    from types import SimpleNamespace

    s = OrderStats()
    one = dict(pushed=3, delivered=2, queued=1, late=2, max_lateness_ns=960, rounds=1,
               forced_flushes=0, untimed=0)  # fmt: skip
    s.add_native(SimpleNamespace(**one), [960, 5])
    s.add_native(SimpleNamespace(**{**one, "late": 0, "max_lateness_ns": 0, "queued": 0}), [])
    assert (s.pushed, s.delivered, s.queued, s.late, s.max_lateness_ns, s.rounds) == (
        6, 4, 0, 2, 960, 2)  # fmt: skip
    assert s.late_buckets == Counter({1024: 1, 8: 1})
