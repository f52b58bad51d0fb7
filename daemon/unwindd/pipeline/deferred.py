"""Samples the ring driver has placed but cannot unwind yet: a binary of their space is still
compiling its CFI in the worker (binaries/cfiprefetch.py). They wait here instead of stalling
the step, and are unwound one by one by the engine's per-sample Python path once ready.

Invariants:
- A waiting sample keeps its space's mapping list and its comm as they were when it was
  placed (``AddressSpace.state``, ``engine.comm_of``) and is unwound against those
  (``engine.unwind_as_of``): an exec, dlopen or COMM applied meanwhile does not change its
  result, which is what unwinding it in place would have given.
- While it waits, its pid is pinned against reaping (``LiveTable.pinned``) and each binary of
  its space holds a cache reference, so neither an exit nor a full ELF cache can close what
  it will be unwound with; both are let go right after its unwind.
- At most ``max_samples`` wait; past that ``hold`` refuses and the caller unwinds the sample
  itself (its compile then runs on the step). Samples come out in the order they went in.

Cost: ``hold`` O(binaries of the space); ``take`` O(waiting x their binaries) per step.
"""

from __future__ import annotations

from typing import Any

from ..procs.livetable import LiveTable
from ..source.records import Sample
from ..unwind.engine import StackEngine
from ..unwind.stackfmt import UnwoundSample

__all__ = ["Deferred"]

# (sample, binaries still compiling, mapping state, comm, binaries it holds a reference on)
_Waiting = tuple[Sample, list[Any], object, str, list[Any]]


class Deferred:
    def __init__(self, engine: StackEngine, live: LiveTable, max_samples: int) -> None:
        self.engine = engine
        self.live = live
        self.max_samples = max_samples
        self._waiting: list[_Waiting] = []
        self.total = 0  # samples ever held

    def __len__(self) -> int:
        return len(self._waiting)

    def would_hold(self, pid: int) -> bool:
        """Whether ``hold`` would hold a sample of ``pid`` now (asking the prefetcher, which
        starts the compiles its binaries still need, as ``hold`` does)."""
        pre = self.engine.cfi_prefetch
        if pre is None or len(self._waiting) >= self.max_samples:
            return False
        sp = self.engine.table.get(pid)
        return sp is not None and not all([pre.ready(e) for e in sp.entries()])  # (each asked)

    def hold(self, s: Sample) -> bool:
        """Hold placed sample ``s`` if a binary of its space is still compiling; True if held."""
        engine = self.engine
        pre = engine.cfi_prefetch
        if pre is None or s.pid is None or len(self._waiting) >= self.max_samples:
            return False
        sp = engine.table.get(s.pid)
        if sp is None:
            return False
        entries = sp.entries()
        waiting = [e for e in entries if not pre.ready(e)]
        if not waiting:
            return False
        res = engine.table.binaries
        held: list[Any] = []
        if res is not None:
            held = entries
            for e in held:
                res.retain(e)
        self._waiting.append((s, waiting, sp.state, engine.comm_of(s.pid, s.tid), held))
        self.live.pinned[s.pid] += 1
        self.total += 1
        return True

    def take(self, everything: bool) -> list[UnwoundSample]:
        """Unwind the held samples whose binaries are ready (``everything``: all of them, at
        close; the compile factory then waits for the worker), in their order."""
        engine = self.engine
        pre = engine.cfi_prefetch
        go: list[tuple[Sample, object, str]] = []
        held: list[Any] = []
        keep: list[_Waiting] = []
        for d in self._waiting:
            if everything or pre is None or all(pre.ready(e) for e in d[1]):
                go.append((d[0], d[2], d[3]))
                held += d[4]
            else:
                keep.append(d)
        self._waiting = keep
        pins = self.live.pinned
        for s, _, _ in go:
            assert s.pid is not None
            pins[s.pid] -= 1
            if pins[s.pid] <= 0:
                del pins[s.pid]
        out = engine.unwind_as_of(go) if go else []
        res = engine.table.binaries
        if res is not None:
            for e in held:  # after the unwind: hold's references
                res.release(e)
        return out
