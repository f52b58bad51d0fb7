"""StreamStats on records decoded from byte literals (recordbytes): what was lost, throttled or
bad is counted per CPU from the records themselves, the CPU of the record's sample_id when it
has one, else the ring's."""

from __future__ import annotations

import recordbytes as rb
from unwindd.source.decoder import RecordDecoder
from unwindd.source.formats import EventFormat
from unwindd.source.streamstats import StreamStats

SB = rb.S_TID | rb.S_TIME | rb.S_ID | rb.S_CPU | rb.S_IDENTIFIER


def sid(cpu: int) -> rb.Sid:
    return rb.Sid(pid=100, tid=101, time=1_000 + cpu, id=7, stream_id=8, cpu=cpu)


def observe(stats: StreamStats, chunks: list[tuple[bytes, int | None]]) -> None:
    dec = RecordDecoder([EventFormat(SB)])
    for buf, ring_cpu in chunks:
        recs = list(dec.decode(buf))
        assert len(recs) == 1, recs
        stats.observe(recs[0], ring_cpu)


def test_loss_and_throttling_counted_per_cpu() -> None:
    s = StreamStats()
    observe(s, [
        (rb.lost(id=7, lost=1234, sample_type=SB, sid=sid(3)), 0),  # the record's cpu wins
        (rb.lost(id=7, lost=6, sample_type=SB, sid=sid(1)), None),
        (rb.lost(id=7, lost=10, sample_type=SB, sid=sid(3)), 3),
        (rb.lost_samples(lost=5, sample_type=SB, sid=sid(2)), 2),
        (rb.throttle(time=1, id=7, stream_id=8, sample_type=SB, sid=sid(0)), 0),
        (rb.throttle(time=2, id=7, stream_id=8, unthrottle=True, sample_type=SB, sid=sid(0)), 0),
        (rb.throttle(time=3, id=7, stream_id=8, sample_type=SB, sid=sid(1)), 1),
    ])  # fmt: skip
    assert dict(s.lost_by_cpu) == {3: 1244, 1: 6} and s.lost == 1250
    assert dict(s.lost_samples_by_cpu) == {2: 5} and s.lost_samples == 5
    assert dict(s.throttled_by_cpu) == {0: 1, 1: 1} and s.throttled == 2
    assert dict(s.unthrottled_by_cpu) == {0: 1}
    assert s.by_type["LOST"] == 3 and s.by_type["LOST_SAMPLES"] == 1
    assert s.by_type["THROTTLE"] == 2 and s.by_type["UNTHROTTLE"] == 1
    assert s.by_cpu_type[3]["LOST"] == 2 and s.by_cpu_type[1]["THROTTLE"] == 1


def test_ring_cpu_stands_in_for_a_record_without_one() -> None:
    s = StreamStats()
    dec = RecordDecoder([EventFormat(0)])  # no sample_id_all: records carry no cpu
    for buf, ring in ((rb.lost(id=1, lost=3), 2), (rb.lost(id=1, lost=4), None)):
        (rec,) = dec.decode(buf)
        s.observe(rec, ring)
    assert dict(s.lost_by_cpu) == {2: 3, None: 4} and s.lost == 7
