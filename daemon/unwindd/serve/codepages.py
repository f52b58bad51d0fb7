"""The daemon's own code pages (the interpreter, its shared libraries and extension modules)
dropped from its page tables at each heap trim: what stays in the RSS is the code run since.

A read fault on a file mapping maps the page-cache pages around it too (mm/memory.c
do_fault_around, or a whole large folio), and loading a library runs its initialisers, so the
daemon's RSS held the pages of every library it loaded, many never run again (OpenSSL's
libcrypto, loaded and initialised by ``ssl``, which uvloop imports, then unused). Dropping
them changes what RSS counts, not what the machine holds: the pages stay in the page cache,
and the code the daemon runs maps back what it runs at the next minor fault.

Invariants:
- Only private file mappings without write permission whose pages are all the file's own
  (smaps ``Anonymous: 0``) are advised. MADV_DONTNEED on a private file mapping discards the
  private copies it holds (mm/madvise.c, madvise(2)): a RELRO segment relocated then made
  read-only (ld.so's _dl_protect_relro), or any mapping ever written, keeps its copies, so
  it is never advised. Such a mapping cannot become one of those later without an mprotect
  to writable, which only the dynamic linker does, while it loads a library, before the
  mapping reads as read-only; its class is decided once per mapping (``procmaps`` value:
  range, offset, permissions, file).
- Nothing the daemon runs unmaps a library (CPython never unloads an extension module,
  ctypes never dlcloses), so a range read from /proc/self/maps is still that mapping when it
  is advised; a failed madvise is skipped.
Cost: one read and parse of /proc/self/maps (a few hundred lines) and one madvise per clean
mapping (~100) per release; /proc/self/smaps is read only when a mapping is new (start-up, a module
imported late); the faults that map back the hot code, a few dozen per release.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ..procs.mapping import MAP_PRIVATE, PROT_READ, PROT_WRITE, Mapping
from ..procs.procmaps import parse_maps_line, parse_proc_maps

__all__ = ["CodePages"]

_MADV_DONTNEED = 4  # asm-generic/mman-common.h


def _madvise() -> Any:
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def _candidates(maps_text: str) -> list[Mapping]:
    """The private, read-only file mappings of a /proc/PID/maps text."""
    return [m for m in parse_proc_maps(maps_text)
            if m.prot & PROT_READ and not m.prot & PROT_WRITE and m.flags == MAP_PRIVATE
            and m.filename.startswith("/") and not m.filename.endswith(" (deleted)")]  # fmt: skip


def _anonymous_kb(smaps_text: str) -> dict[Mapping, int]:
    """``Anonymous`` (kB: private copies) of every mapping in a /proc/PID/smaps text (its
    header lines are maps lines)."""
    out: dict[Mapping, int] = {}
    cur: Mapping | None = None
    for line in smaps_text.splitlines():
        if line.startswith("Anonymous:"):
            if cur is not None:
                out[cur] = int(line.split()[1])
        elif (m := parse_maps_line(line)) is not None:
            cur = m
    return out


class CodePages:
    """Drops the clean code and read-only data pages of the daemon's own mappings (module
    doc); ``mappings`` and ``nbytes``: what the last ``release`` advised."""

    def __init__(self, proc: str = "/proc/self") -> None:
        self._proc = proc
        self._clean: dict[Mapping, bool] = {}
        self._madvise = _madvise()
        self.mappings = 0
        self.nbytes = 0

    def _read(self, name: str) -> str:
        with open(f"{self._proc}/{name}") as f:
            return f.read()

    def release(self) -> tuple[int, int]:
        """Advise every clean read-only private file mapping; (mappings, bytes) advised.
        Never raises: without /proc or madvise it advises nothing."""
        if self._madvise is None:
            return 0, 0
        try:
            keys = _candidates(self._read("maps"))
            if any(k not in self._clean for k in keys):
                anon = _anonymous_kb(self._read("smaps"))
                # a mapping smaps did not list (gone meanwhile) is left alone
                self._clean = {k: self._clean.get(k, anon.get(k, 1) == 0) for k in keys}
        except (OSError, ValueError):
            return 0, 0
        n = nbytes = 0
        for m in keys:
            if self._clean[m] and self._madvise(m.start, m.end - m.start, _MADV_DONTNEED) == 0:
                n += 1
                nbytes += m.end - m.start
        self.mappings, self.nbytes = n, nbytes
        return n, nbytes
