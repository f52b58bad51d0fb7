"""The Python replay of a perf.data stream, for what the native replay (filereplay.py) does not
take: pipe mode (stdin), a file it raises ``Unsupported`` for, and the summary and records
formats. Each record is read and decoded to a Python object (``PerfData.records``), counted and
ordered (``StreamPipeline.replay``: the file's FINISHED_ROUND records delimit the rounds), and
written by ``TextOutput``, whose engine unwinds samples one by one (``StackEngine.feed``).

Invariants:
- For a file and format both replays take, the output and every count are the same
  (tests/differential/test_filereplay.py holds the native replay to this one).
- Records reach the output in batches of at most ``BATCH`` (jsonl, perf-script and records
  output is written as it goes); the summary is written at the end, its samples unwound as for
  the other formats (its unwind section: ``render_unwind_summary``, what ``unwindd record``
  writes, with where the frames came from, ``engine.frame_sources``).
- A ``PerfDataError`` while reading propagates, after what was read before it was written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

from ..lightdc import dataclass
from ..source.capture import StreamPipeline
from ..source.output import render_summary, render_unwind_summary
from ..unwind.engine import StackEngine, frame_sources
from .textout import TextOutput

if TYPE_CHECKING:
    from ..source.perfdata import PerfData
    from ..source.records import Record

BATCH = 4096  # records handed to the output at a time


@dataclass
class StreamReplay:
    """What a replay counted: the stream pipeline (stream and ordering counts; the decode
    counts are ``data.decoder``'s) and the engine that unwound the samples (None for the
    records format)."""

    pipeline: StreamPipeline
    engine: StackEngine | None


def replay_records(
    data: PerfData, fmt: str, out: TextIO, *, name: str = "-", top_pids: int = 20,
    engine: StackEngine | None = None,
) -> StreamReplay:
    """Replay ``data`` (opened, left open) to ``out`` in ``fmt`` (cli.FORMATS); ``name`` is the
    file the summary names, ``top_pids`` how many pids it lists. ``engine``: what unwinds and
    names the samples (the CLI's, made as for the native replay: its cache dir and debuginfod
    client); a default ``StackEngine.create()`` if None."""
    sink = TextOutput(fmt, out, engine=engine)
    if fmt == "summary":  # samples unwound, for the counts only (the sink writes none)
        sink.engine = engine if engine is not None else StackEngine.create()
    pipeline = StreamPipeline(data.decoder)
    batch: list[Record] = []
    for rec in pipeline.replay(data.records()):
        batch.append(rec)
        if len(batch) >= BATCH:
            sink(batch)
            batch = []
    sink(batch)
    sink.finish()
    if fmt == "summary":
        extra: dict[str, object] = {
            "file": name,
            "mode": "pipe" if data.pipe_mode else "file",
            "arch": data.arch or "?",
            "events": ",".join(a.name or str(a.config) for a in data.attrs),
        }
        for reason, n in sorted(data.errors.items()):
            extra[f"file error {reason}"] = n
        order = pipeline.orderer.stats
        out.write(render_summary(pipeline.stats, data.decoder.stats, order, extra, top_pids))
        if sink.engine is not None:
            sources = frame_sources((a.fmt.sample_type, a.fmt.sample_regs_user)
                                    for a in data.attrs)  # fmt: skip
            out.write(render_unwind_summary(sink.engine.stats, sources))
    return StreamReplay(pipeline, sink.engine)
