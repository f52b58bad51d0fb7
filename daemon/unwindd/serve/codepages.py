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
  mapping reads as read-only; its class is decided once per (range, permissions, inode).
- Nothing the daemon runs unmaps a library (CPython never unloads an extension module,
  ctypes never dlcloses), so a range read from /proc/self/maps is still that mapping when it
  is advised; a failed madvise is skipped.
Cost: one read of /proc/self/maps (a few hundred lines) and one madvise per clean mapping
(~100) per release; /proc/self/smaps is read only when a mapping is new (start-up, a module
imported late); the faults that map back the hot code, a few dozen per release.
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["CodePages"]

_MADV_DONTNEED = 4  # asm-generic/mman-common.h

_Key = tuple[int, int, str, int]  # (start, end, permissions, inode)


def _madvise() -> Any:
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def _candidates(maps_text: str) -> list[_Key]:
    """The private, read-only file mappings of a /proc/PID/maps text (fs/proc/task_mmu.c
    show_map_vma: ``start-end perms offset dev inode path``)."""
    out = []
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue  # anonymous, [heap], [stack], [vdso], ...
        perms = parts[1]
        if perms[0] != "r" or perms[1] != "-" or perms[3] != "p" or parts[5].endswith(" (deleted)"):
            continue  # a gap, writable, or shared (the cache tables: cachefiles.release_mapped)
        lo, _, hi = parts[0].partition("-")
        out.append((int(lo, 16), int(hi, 16), perms, int(parts[4])))
    return out


def _anonymous_kb(smaps_text: str) -> dict[_Key, int]:
    """``Anonymous`` (kB: private copies) of every file mapping in a /proc/PID/smaps text."""
    out: dict[_Key, int] = {}
    key: _Key | None = None
    for line in smaps_text.splitlines():
        parts = line.split(None, 5)
        if not parts:
            continue
        if "-" in parts[0] and not parts[0].endswith(":") and len(parts) >= 5:
            lo, _, hi = parts[0].partition("-")
            key = (int(lo, 16), int(hi, 16), parts[1], int(parts[4]))
        elif parts[0] == "Anonymous:" and key is not None:
            out[key] = int(parts[1])
    return out


class CodePages:
    """Drops the clean code and read-only data pages of the daemon's own mappings (module
    doc); ``mappings`` and ``nbytes``: what the last ``release`` advised."""

    def __init__(self, proc: str = "/proc/self") -> None:
        self._proc = proc
        self._clean: dict[_Key, bool] = {}
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
        for (lo, hi, _, _), clean in zip(keys, map(self._clean.__getitem__, keys), strict=True):
            if clean and self._madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
                n += 1
                nbytes += hi - lo
        self.mappings, self.nbytes = n, nbytes
        return n, nbytes
