"""What a replay counted, as one comparable value: the decoder's records and errors, the
file's errors, the stream and order stats, the process table's records and the engine's
sample and frame counts. Two replays of one file that must agree (native vs Python, with
and without a skip) compare these whole (tests/differential)."""

from __future__ import annotations

from typing import Any

from unwindd.source.ordering import OrderStats
from unwindd.source.perfdata import PerfData
from unwindd.source.streamstats import StreamStats
from unwindd.unwind.engine import StackEngine


def replay_counts(data: PerfData, ss: StreamStats, os_: OrderStats,
                  engine: StackEngine) -> dict[str, Any]:  # fmt: skip
    e = engine.stats
    return {
        "decode_records": dict(data.decoder.stats.records),
        "decode_errors": dict(data.decoder.stats.errors),
        "file_errors": dict(data.errors),
        "stream": ss,
        "order": os_,
        "table": dict(engine.table.stats.records),
        "engine": (e.samples, dict(e.by_status), e.frames, e.user_frames, e.kernel_frames,
                   e.unsymbolized),
    }
