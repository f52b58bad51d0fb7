"""JIT symbols from perf map files, ``/tmp/perf-<pid>.map``
(tools/perf/Documentation/jit-interface.txt): ``PerfMap``, one per pid.

Rules:
- A line is ``START SIZE NAME`` (hex, optional 0x); malformed lines are skipped; on an equal
  start the later line wins (a JIT that recompiles writes the new code's entry after the old).
- Names are taken as written (a JIT writes them as it wants them printed); lookups follow
  ``symtab.SymbolTable``'s rules.
- The file is re-read only when its (size, mtime) changes; a missing file is an empty table.

Cost: a lookup is one stat and one bisect; a changed file is parsed again, O(n log n).
"""

from __future__ import annotations

import os

from .symtab import SymbolTable

__all__ = ["PerfMap", "parse_perf_map"]


def parse_perf_map(text: str) -> list[tuple[int, int, str]]:
    """``START SIZE NAME`` lines (hex, optional 0x; tools/perf/Documentation/jit-interface.txt)
    -> sorted (start, end, name); malformed lines are skipped. Later lines win on equal start
    (a JIT that recompiles writes the new code's entry after the old one)."""
    by_start: dict[int, tuple[int, str]] = {}
    for line in text.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) < 3:
            continue
        try:
            start, size = int(parts[0], 16), int(parts[1], 16)
        except ValueError:
            continue
        by_start[start] = (start + size, parts[2])
    return sorted((s, e, n) for s, (e, n) in by_start.items())


class PerfMap:
    """``/tmp/perf-<pid>.map``, re-read only when its size or mtime changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self.table = SymbolTable.empty()

    def refresh(self) -> SymbolTable:
        try:
            st = os.stat(self.path)
        except OSError:
            self._stamp = None
            self.table = SymbolTable.empty()
            return self.table
        stamp = (st.st_size, st.st_mtime_ns)
        if stamp != self._stamp:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                self.table = SymbolTable(parse_perf_map(f.read()))
            self._stamp = stamp
        return self.table

    def lookup(self, addr: int) -> tuple[str, int] | None:
        return self.refresh().lookup(addr)
