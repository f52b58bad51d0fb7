"""A perf.data file mapped for the native replay (fastreplay.py), its page tables filled on a
thread of their own.

Invariants:
- The whole file, mapped read-only and shared (``mmap``): fastreplay reads records and stack
  copies in place, never a copy of the file.
- ``prefault`` (cffi_build/mapfile.c ``fp_prefault``) only reads the mapping and runs at most
  once; the mapping stays mapped while it runs (``close`` joins its thread first).
- ``close`` is idempotent and never raises: a view of the mapping still exported (an error
  unwinding) leaves the unmapping to the garbage collector, as ``mmap.close`` refuses.
- Light to import (os, mmap, threading and the native module only): the CLI maps the file
  before it imports the replay's modules, so the page-table fill overlaps those imports.

Cost: mapping O(1); the fill O(pages) of kernel time (~0.03-0.05 s for 673 MB on a VM), off
the calling thread when ``start_prefault`` is used (cffi releases the GIL in native calls);
unmapping O(pages) (~0.015 s), also on a thread with ``close(background=True)``.
"""

from __future__ import annotations

import mmap
import os
import threading

from ._unwcore import ffi, lib

__all__ = ["MappedFile"]


class MappedFile:
    """``path`` mapped whole; ``mm`` is the ``mmap`` object readers take views of."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            if self.size == 0:
                raise ValueError("empty file")  # mmap cannot map zero bytes
            self.mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._filler: threading.Thread | None = None
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

    def close(self, background: bool = False) -> None:
        """Unmap (after the fill). ``background``: on a daemon thread, for a caller that no
        longer reads the mapping and has other work; a later ``close`` waits for it."""
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
        try:
            self.mm.close()
        except BufferError:  # a view still exported: the mmap object unmaps when collected
            pass
