"""The live profiler: perf rings -> ordered records -> process table -> unwound samples ->
stack store, one round at a time. The service's event loop and ``unwindd record`` both drive it.

Invariants:
- ``step()`` never blocks: it drains what the rings hold now (one round, see capture.py),
  unwinds it and adds it to the store. Whoever owns the loop decides when to call it (poll on
  ``fds`` plus a timer, so a quiet ring is still drained every tick).
- Every record drained is counted (``pipeline.stats``) before anything else happens to it;
  every sample delivered by the orderer becomes exactly one stored ``UnwoundSample``.
- ``close()`` drains and flushes what is left before closing the rings: stopping loses nothing
  that was already recorded.
"""

from __future__ import annotations

from collections.abc import Callable

from .capture import StreamPipeline, drain_round
from .engine import StackEngine
from .perfcore import PerfSession, SamplingConfig, Target
from .records import Record
from .stackfmt import UnwoundSample
from .stackstore import StackStore


class LiveProfiler:
    def __init__(
        self,
        session: PerfSession,
        engine: StackEngine,
        store: StackStore,
        *,
        on_records: Callable[[list[Record]], None] | None = None,
    ) -> None:
        self.session = session
        self.engine = engine
        self.store = store
        self.pipeline = StreamPipeline.for_format(session.event_format)
        self.on_records = on_records
        self.closed = False

    @classmethod
    def open(
        cls,
        target: Target,
        config: SamplingConfig | None = None,
        *,
        engine: StackEngine | None = None,
        store: StackStore | None = None,
    ) -> LiveProfiler:
        session = PerfSession.open(target, config or SamplingConfig())
        try:
            return cls(session, engine or StackEngine.create(), store or StackStore())
        except BaseException:
            session.close()
            raise

    @property
    def fds(self) -> list[int]:
        return self.session.fds

    def start(self) -> None:
        self.session.enable()

    def step(self) -> list[UnwoundSample]:
        """Drain one round and process it; returns the samples it stored."""
        return self._process(drain_round(self.session, self.pipeline))

    def _process(self, recs: list[Record]) -> list[UnwoundSample]:
        if not recs:
            return []
        if self.on_records is not None:
            self.on_records(recs)
        samples = self.engine.feed(recs)
        if samples:
            self.store.add(samples)
        return samples

    def close(self) -> list[UnwoundSample]:
        """Stop sampling, process everything still in the rings and the orderer, close."""
        if self.closed:
            return []
        self.session.disable()
        out = self._process(drain_round(self.session, self.pipeline) + self.pipeline.finish())
        self.session.close()
        self.closed = True
        return out
