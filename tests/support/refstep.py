"""The whole-stream Python live step: the oracle the native step (pipeline/ringstep.py) is held
to. ``ReferenceProfiler`` is ``LiveProfiler`` with this step in place of the native one, on the
same parts (session, stream pipeline, engine and live table, store, drain pins) and with the
same ``start`` and ``close``: each round every record drained is decoded to a Python object,
counted and pinned as it leaves the ring (``capture.drain_round``, the raw record capture's
pass), ordered by ``RoundOrderer``, given to ``StackEngine.feed`` and stored one
``UnwoundSample`` at a time (``StackStore.add``).

Invariants:
- Every sample delivered by the orderer becomes exactly one stored ``UnwoundSample``, and the
  step that stored it returns it (``step``, ``start``, ``close``); held samples included.
- Nothing is held between steps: ``flush`` has nothing to store, a bootstrap slice nothing to
  forget, and ``native_step`` is None.
"""

from __future__ import annotations

from unwindd.pipeline.live import LiveProfiler
from unwindd.pipeline.ringstep import StepInfo
from unwindd.procs.livetable import LiveTable
from unwindd.source.capture import drain_round
from unwindd.source.perfcore import PerfSession
from unwindd.source.records import Record
from unwindd.store.stackstore import StackStore
from unwindd.unwind.engine import StackEngine
from unwindd.unwind.stackfmt import UnwoundSample


class ReferenceProfiler(LiveProfiler):
    def __init__(
        self,
        session: PerfSession,
        engine: StackEngine,
        store: StackStore,
        *,
        live: LiveTable | None = None,
        bootstrap: bool = True,
        flush_interval: float = 0.0,
        python_frames: str = "off",
    ) -> None:
        # flush_interval and python_frames are LiveProfiler.open's: this step stores every
        # sample in its round, with the native frames the oracle compares (no Python frames)
        self._join(session, engine, store, live, bootstrap)
        self.native_step = None  # type: ignore[assignment]

    def _scanned(self) -> None:
        pass  # feed takes every space and comm from the table and the engine as they are

    def step(self) -> list[UnwoundSample]:
        return self._process(drain_round(self.session, self.pipeline, on_record=self._pin))

    def flush(self) -> StepInfo:
        return StepInfo()

    def _last_round(self) -> list[UnwoundSample]:
        recs = drain_round(self.session, self.pipeline, on_record=self._pin)
        return self._process(recs + self.pipeline.finish(), final=True)

    def _process(self, recs: list[Record], final: bool = False) -> list[UnwoundSample]:
        samples = self.engine.feed(recs) if recs or self.live.stats.held_now else []
        if final:  # the end of the stream: every sample still held for a rescan
            held = self.live.flush_held()
            if held:
                samples += self.engine.unwind_held(held)
        self._unpin(recs)
        if samples:
            self.store.add(samples)
        info = self.last_step = StepInfo()
        info.samples = len(samples)
        info.depths.update(len(s.frames) for s in samples)
        info.pids.update(s.pid for s in samples if s.pid is not None)
        return samples
