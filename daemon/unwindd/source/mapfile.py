"""A perf.data file mapped for the native replay (filereplay.py): its page tables filled and
its data section indexed (fp_index) on threads of their own, while the replay imports its
modules and sets up.

Invariants:
- The whole file, mapped read-only and shared (``mmap``): filereplay reads records and stack
  copies in place, never a copy of the file.
- The background work only reads the mapping: ``prefault`` (cffi_build/mapfile.c
  ``fp_prefault``) once, then at most one ``fp_index`` of the data section; the mapping stays
  mapped while either runs (``close`` joins both threads first). An index is handed out only
  for the exact layout and section bounds asked for (``take_index``), else the caller indexes.
- ``close`` is idempotent and never raises: a view of the mapping still exported (an error
  unwinding) leaves the unmapping to the garbage collector, as ``mmap.close`` refuses.
- Light to import (os, mmap, threading and the native module through its binding ``unwcore``;
  records only when a layout is made): the CLI maps the file before it imports the replay's
  modules.

Cost: mapping O(1); the fill O(pages) of kernel time and the index O(records), both off the
calling thread (cffi releases the GIL in native calls), so they cost wall time only when no
other CPU is free; unmapping O(pages), also on a thread with ``close(background=True)``.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import TYPE_CHECKING, Any

from ..unwcore import check, ffi, lib

if TYPE_CHECKING:
    from .perfdata import PerfData

__all__ = ["MappedFile", "RecordIndex", "Unsupported", "layout_of", "native_layout"]


class Unsupported(Exception):
    """The native replay does not take this input; the Python replay (streamreplay.py) does."""


def layout_of(fmt: Any) -> Any:
    """The ``struct fp_layout`` of an ``EventFormat``: formats.SampleLayout's numbers."""
    from .formats import SampleLayout

    lay = SampleLayout.of(fmt)
    c = ffi.new("struct fp_layout *")
    c.sample_type = lay.sample_type
    c.regs_mask = lay.regs_mask % (1 << 64)
    c.nprefix = lay.prefix.size // 8
    c.i_ip, c.i_tid, c.i_time, c.i_cpu, c.i_period = (
        lay.i_ip, lay.i_tid, lay.i_time, lay.i_cpu, lay.i_period,
    )  # fmt: skip
    c.read_group = int(lay.read_group)
    c.read_times = lay.read_times
    c.read_per_value = lay.read_per_value
    c.branch_hw_index = lay.branch_hw_index
    c.branch_counters = lay.branch_counters
    c.nregs = lay.regs.size // 8
    return c


def native_layout(data: PerfData) -> Any:
    """The ``struct fp_layout`` the native path reads ``data``'s SAMPLEs with; Unsupported
    (nothing done) for what it does not take: pipe mode, attrs whose SAMPLE layouts differ,
    samples without TID/TIME."""
    if data.pipe_mode:
        raise Unsupported("pipe mode")
    dec = data.decoder
    # Several attrs (perf -a adds a dummy event) are fine when they lay SAMPLEs out alike: then
    # the event id that picks a format (decoder.RecordDecoder._format_for_sample) cannot matter.
    shapes = {(f.sample_type, f.sample_regs_user, f.read_format, f.branch_sample_type)
              for f in dec.formats}  # fmt: skip
    if len(shapes) != 1:
        raise Unsupported("event formats with different SAMPLE layouts")
    lay = layout_of(dec.formats[0])
    if lay.i_tid < 0 or lay.i_time < 0:
        raise Unsupported("samples without TID/TIME")
    return lay


def _lay_key(lay: Any) -> bytes:
    return bytes(ffi.buffer(lay))


class RecordIndex:
    """fp_index of a buffer: the records array (freed with the object) and how it ended."""

    def __init__(self, lay: Any, buf: Any, length: int) -> None:
        pp = ffi.new("struct fp_rec **")
        n, other, stop = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("uint64_t *")
        end = ffi.new("int *")
        check(lib.fp_index(lay, buf, length, pp, n, other, end, stop), "fp_index")
        self.recs = ffi.gc(pp[0], lib.unw_free)
        self.n = int(n[0])
        self.other = int(other[0])
        self.end = int(end[0])
        self.stopped_at = int(stop[0])


class MappedFile:
    """``path`` mapped whole; ``mm`` is the ``mmap`` object readers take views of."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            if self.size == 0:
                raise ValueError("empty file")  # mmap cannot map zero bytes
            self.mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._filler: threading.Thread | None = None
        self._indexer: threading.Thread | None = None
        self._index_key: tuple[bytes, int, int] | None = None
        self._index: RecordIndex | None = None
        self._closer: threading.Thread | None = None
        self._closed = False

    def prefault(self) -> None:
        """Fill the page tables now, on this thread (what MAP_POPULATE would have done)."""
        buf = ffi.from_buffer(self.mm)
        try:
            lib.fp_prefault(ffi.cast("const uint8_t *", buf), self.size)
        finally:
            ffi.release(buf)

    def start_prefault(self) -> None:
        """``prefault`` on a daemon thread; readers need not wait for it (a page it has not
        reached yet is faulted in by the reader), ``close`` does."""
        if self._filler is None and not self._closed:
            self._filler = threading.Thread(target=self.prefault, name="unwindd-prefault",
                                            daemon=True)  # fmt: skip
            self._filler.start()

    def wait(self) -> None:
        """Until the background fill is done (a reader that wants every page mapped)."""
        if self._filler is not None:
            self._filler.join()

    def start_index(self, data: PerfData) -> None:
        """Index ``data``'s data section on a daemon thread once the fill is done, for a
        replay that will ask ``take_index``; nothing if the native path will not take it."""
        if self._indexer is not None or self._closed:
            return
        try:
            lay = native_layout(data)
        except Unsupported:
            return
        start = min(data.data_offset, self.size)
        length = min(data.data_size, self.size - start)
        self._index_key = (_lay_key(lay), start, length)
        self._indexer = threading.Thread(target=self._index_in_background,
                                         args=(lay, start, length), name="unwindd-index",
                                         daemon=True)  # fmt: skip
        self._indexer.start()

    def _index_in_background(self, lay: Any, start: int, length: int) -> None:
        self.wait()
        buf = ffi.from_buffer(self.mm)
        try:
            self._index = RecordIndex(lay, ffi.cast("const uint8_t *", buf) + start, length)
        except MemoryError:
            self._index = None  # take_index then gives None: the caller indexes itself
        finally:
            ffi.release(buf)

    def take_index(self, lay: Any, start: int, length: int) -> RecordIndex | None:
        """The background index if it was made for this layout and section (waited for),
        once; else None."""
        if self._indexer is None:
            return None
        self._indexer.join()
        idx, self._index = self._index, None
        if self._index_key != (_lay_key(lay), start, length):
            return None
        return idx

    def close(self, background: bool = False) -> None:
        """Unmap (after the background work). ``background``: on a daemon thread, for a
        caller that no longer reads the mapping and has other work; a later ``close`` waits
        for it."""
        if self._closed:
            if self._closer is not None and not background:
                self._closer.join()
            return
        self._closed = True
        if background:
            self._closer = threading.Thread(target=self._unmap, name="unwindd-unmap",
                                            daemon=True)  # fmt: skip
            self._closer.start()
        else:
            self._unmap()

    def _unmap(self) -> None:
        self.wait()
        if self._indexer is not None:
            self._indexer.join()
        try:
            self.mm.close()
        except BufferError:  # a view still exported: the mmap object unmaps when collected
            pass
