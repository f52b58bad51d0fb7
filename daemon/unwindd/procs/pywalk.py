"""The native frame-chain walk (cffi_build/pywalk.c) of pyframes.Interpreter threads: many
threads walked in one call, off the GIL, their raw frame records decoded by
``Interpreter.decode`` as the Python walk's are.

Why: a walk in Python holds the GIL for every step (one process_vm_readv per frame, its
parsing); on a loaded machine the event loop holds the GIL most of the time and the reader
thread that walks is starved. ``unw_py_walk`` is a cffi API-mode call, and cffi releases the
GIL around such calls, so the walks run while the loop runs; the caller takes the GIL back
once per batch (``walk``), not once per frame.

Invariants:
- The offsets are pyframes.Layout's, copied field by field by name into ``struct
  unw_py_layout`` (``c_layout``): the C side spells no offset.
- The C records are pyframes.RawFrame's fields in order, so ``Interpreter.decode`` takes them
  as the Python walk's (``Interpreter.raw_walk``, the reference the tests compare with).
- ``walk`` never raises on what a target does: each thread's result is its records or one
  reason from pyframes.FAILURES; a found thread state goes back into the interpreter's cache.
- One ``Walker`` is used by one thread at a time (its buffers are reused; the caller locks).
  A ``Batch`` walks its threads several times, paced by the C side (each walk's
  ``not_before``), and publishes each finished walk: another thread takes those results
  while the walking thread is still in the call.
Cost: one native call per batch (about 4 syscalls per thread whatever its depth) and O(frames)
Python to unpack the records; buffers: UNW_PY_SCRATCH bytes plus 40 bytes per record slot.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from ..unwcore import ffi, lib
from .pyframes import ENTRY, SHIM, Interpreter, Layout, ProcessMemory, RawFrame

REASONS = {lib.UNW_PY_GONE: "gone", lib.UNW_PY_DENIED: "denied", lib.UNW_PY_MOVED: "moved",
           lib.UNW_PY_TOO_DEEP: "too_deep", lib.UNW_PY_NO_THREAD: "no_thread"}  # fmt: skip
_REC = struct.Struct("<5Q2I")  # struct unw_py_rec
LAYOUT_FIELDS = [name for name, _ in ffi.typeof("struct unw_py_layout").fields]  # in C order
assert _REC.size == ffi.sizeof("struct unw_py_rec")
assert (ENTRY, SHIM) == (lib.UNW_PY_ENTRY, lib.UNW_PY_SHIM)


def short_slice(ns: int) -> bool:
    """The calling thread's scheduler slice set to ``ns`` (cffi_build/pywalk.c
    ``unw_py_short_slice``: its wakeups served sooner on a busy CPU, its share of CPU the
    same); whether the kernel took it."""
    return bool(lib.unw_py_short_slice(ns) == 0)


def c_layout(lay: Layout) -> Any:
    """``lay`` as a ``struct unw_py_layout``: each C field from the Layout field (or
    property) of the same name."""
    c = ffi.new("struct unw_py_layout *")
    for name in LAYOUT_FIELDS:
        setattr(c, name, getattr(lay, name))
    return c


class Batch:
    """Walks of many threads, ``passes`` times each, ``spacing_ns`` apart from ``start_ns``
    (CLOCK_MONOTONIC), in one native call (``run``, on the thread that walks: no GIL). Another
    thread may take the results of the walks finished so far (``ready``, ``results``) while
    ``run`` goes on, or end it early (``stop``): the C side publishes each finished walk, and
    nothing here changes the buffers ``run`` writes."""

    def __init__(self, walker: Walker, items: Sequence[tuple[Interpreter, int]], passes: int,
                 start_ns: int, spacing_ns: int, max_frames: int) -> None:  # fmt: skip
        self.items = [x for _ in range(passes) for x in items]
        n = len(self.items)
        self.max_frames = max_frames = min(max_frames, lib.UNW_PY_MAX_FRAMES)
        self._walker = walker
        self.jobs = jobs = walker.jobs(n)
        self.recs, self.nrecs = walker.records(n * max_frames)
        self.sync = ffi.new("struct unw_py_sync *")
        for i, (it, tid) in enumerate(self.items):
            mem = it.mem
            assert isinstance(mem, ProcessMemory)
            j = jobs[i]
            j.lay, j.pid, j.tid, j.runtime = walker.layout(it.lay), mem.pid, tid, it.runtime
            j.tstate, j.max_frames = it.tstates.get(tid, 0), max_frames
            j.not_before = start_ns + (i // len(items)) * spacing_ns if start_ns else 0

    def run(self) -> None:
        used = lib.unw_py_walk(self.jobs, len(self.items), self.recs, self.nrecs,
                               self._walker.scratch, lib.UNW_PY_SCRATCH, self.sync)
        if used < 0:
            raise RuntimeError("unw_py_walk: bad arguments")

    def ready(self) -> int:
        """How many walks (in ``items`` order) have finished."""
        return int(lib.unw_py_progress(self.sync))

    def stop(self) -> None:
        """End the batch before its next walk (from any thread): ``run`` returns with the
        walks after ``ready()`` not made."""
        lib.unw_py_stop(self.sync)

    def results(self, lo: int, hi: int) -> list[tuple[int, list[RawFrame] | str, int]]:
        """Finished walks ``lo`` to ``hi`` (``hi <= ready()``): for each, (CLOCK_MONOTONIC
        time of the walk, its records innermost first or why not, syscalls it made); the
        thread states found go back into their interpreter's cache."""
        out: list[tuple[int, list[RawFrame] | str, int]] = []
        size = _REC.size
        for i in range(lo, hi):
            it, tid = self.items[i]
            j = self.jobs[i]
            if j.tstate:
                it.keep_thread_state(tid, j.tstate)
            else:
                it.tstates.pop(tid, None)
            got: list[RawFrame] | str
            if j.status:
                got = REASONS.get(j.status, "moved")
            else:
                raw = ffi.buffer(self.recs + j.first, j.count * size)
                got = list(_REC.iter_unpack(raw))
            out.append((j.t_ns, got, j.syscalls))
        return out


class Walker:
    """Buffers for batches of walks, reused (one batch at a time): scratch, jobs and records,
    grown as asked, and the layouts as C structs."""

    def __init__(self) -> None:
        self.scratch = ffi.new("uint8_t[]", lib.UNW_PY_SCRATCH)
        self._layouts: dict[Layout, Any] = {}
        self._jobs = ffi.new("struct unw_py_job[]", 1)
        self._recs = ffi.new("struct unw_py_rec[]", 1)
        self._njobs = self._nrecs = 1

    def layout(self, lay: Layout) -> Any:
        got = self._layouts.get(lay)
        if got is None:
            got = self._layouts[lay] = c_layout(lay)
        return got

    def jobs(self, n: int) -> Any:
        if n > self._njobs:
            self._jobs = ffi.new("struct unw_py_job[]", n)
            self._njobs = n
        return self._jobs

    def records(self, n: int) -> tuple[Any, int]:
        if n > self._nrecs:
            self._recs = ffi.new("struct unw_py_rec[]", n)
            self._nrecs = n
        return self._recs, self._nrecs

    def walk(self, items: Sequence[tuple[Interpreter, int]], max_frames: int
             ) -> list[tuple[int, list[RawFrame] | str, int]]:  # fmt: skip
        """Each (interpreter, tid) walked once, now, in order: ``Batch.results``."""
        b = Batch(self, items, 1, 0, 0, max_frames)
        b.run()
        return b.results(0, len(items))
