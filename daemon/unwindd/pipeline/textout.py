"""The command line's text outputs of a record stream: ``unwindd record`` and the Python replay
(streamreplay.py) write through ``TextOutput``.

Invariants:
- records: each record as one JSON line (``source/output.record_to_json``); jsonl and
  perf-script: each unwound sample; both written and flushed as each batch comes. folded:
  stacks counted, written once by ``finish`` (``stackfmt.render_folded``). pprof: stacks
  counted by (pid, tid, comm, frames), written once by ``finish`` as gzipped profile.proto
  (``store/pprof.encode_profile``) to the binary stream under ``out``; its cpu/nanoseconds
  value is each stack's count times the samples' mean period (cpu-clock counts nanoseconds).
  Memory O(distinct stacks), like folded.
- jsonl samples carry their process's labels (``cgroup``, ``unit``, ``container_id``) when
  ``labels_of`` (a live profiler's ``StackStore.labels_of``) knows them; unknown ones are left
  out. One dict lookup per sample, on a path that already builds a JSON object per sample.
- Records in, samples out only with ``unwind``: the sink's own engine (``StackEngine.feed``)
  unwinds them (the caller's ``engine``, else a default ``StackEngine.create()``); without it
  the caller hands it samples (``samples``) and per-stack counts (``counts``) from a live
  profiler.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TextIO

from ..unwind import stackfmt

UNWOUND_FORMATS = ("jsonl", "folded", "perf-script", "pprof")  # formats of unwound samples

if TYPE_CHECKING:
    from ..source.records import Record
    from ..store.stackstore import CountGroup
    from ..unwind.engine import StackEngine


class TextOutput:
    """Receives each round's time-ordered records and writes them in the chosen format;
    ``finish`` writes what can only be written at the end (folded stacks)."""

    def __init__(self, fmt: str, out: TextIO, *, unwind: bool = True,
                 engine: StackEngine | None = None) -> None:  # fmt: skip
        self.fmt = fmt
        self.out = out
        self.engine: StackEngine | None = None
        self.folded: Counter[tuple[str, ...]] = Counter()
        # pprof: (pid, tid, comm, frames) -> samples; the samples' periods summed
        self.stacks: Counter[tuple[int, int, str, tuple[stackfmt.Frame, ...]]] = Counter()
        self.periods = [0, 0]  # sum of the periods, samples with one
        self.labels_of: Callable[[int], Mapping[str, str]] | None = None
        if unwind and fmt in UNWOUND_FORMATS:
            if engine is None:
                from ..unwind.engine import StackEngine

                engine = StackEngine.create()
            self.engine = engine

    def __call__(self, recs: list[Record]) -> None:
        import json

        w = self.out.write
        if self.fmt == "records":
            from ..source.output import record_to_json

            for rec in recs:
                w(json.dumps(record_to_json(rec), separators=(",", ":")))
                w("\n")
            self.out.flush()
        elif self.engine is not None:
            self.samples(self.engine.feed(recs))

    def samples(self, samples: Sequence[stackfmt.UnwoundSample]) -> None:
        """Write unwound samples (from the engine here, or from a LiveProfiler)."""
        if not samples:
            return
        import json

        w = self.out.write
        if self.fmt == "jsonl":
            labels_of = self.labels_of
            for u in samples:
                d = stackfmt.to_json(u)
                if labels_of is not None and u.pid is not None and u.pid > 0:
                    d.update(labels_of(u.pid))
                w(json.dumps(d, separators=(",", ":")))
                w("\n")
        elif self.fmt == "perf-script":
            for u in samples:
                w(stackfmt.perf_script(u))
        elif self.fmt == "folded":
            self.folded.update(stackfmt.folded_key(u) for u in samples)
        elif self.fmt == "pprof":
            per = self.periods
            for u in samples:
                pid = -1 if u.pid is None else u.pid
                tid = -1 if u.tid is None else u.tid
                self.stacks[(pid, tid, u.comm, u.frames)] += 1
                if u.period:
                    per[0] += u.period
                    per[1] += 1
            return
        else:
            return
        self.out.flush()

    def counts(self, groups: Sequence[CountGroup]) -> None:
        """Fold aggregated samples (``StackStore.add_counts``' groups) into the folded output."""
        for _t, _pid, _tid, comm, frames, n in groups:
            self.folded[(comm or stackfmt.UNKNOWN, *stackfmt.folded_names(frames))] += n

    def finish(self) -> None:
        if self.fmt == "folded":
            self.out.write(stackfmt.render_folded(self.folded))
            self.out.flush()
        elif self.fmt == "pprof":
            from ..store.pprof import encode_profile
            from ..store.queries import StackCount

            total, n = self.periods
            counts = (StackCount(pid, tid, comm, frames, c)
                      for (pid, tid, comm, frames), c in self.stacks.items())  # fmt: skip
            blob = encode_profile(counts, period_ns=round(total / n) if n else 0)
            self.out.flush()
            self.out.buffer.write(blob)
            self.out.buffer.flush()
