"""One binary as the ELF cache holds it (``ElfEntry``): its identity and PT_LOAD segments, the
load bias of a mapping of it, and what is loaded from it lazily, once: symbols, the separate
debug file, CFI.

Rules:
- A usable entry holds an open fd of the file its cache validated (elfcache) until the cache
  closes it: every lazy load reads that very file (CFI through ``/proc/self/fd/N``), even
  after it was deleted or replaced on disk. An unusable one has no fd and loads nothing.
- ``bias_for``: runtime address = ELF vaddr + bias, from the PT_LOAD whose page-aligned file
  range holds the mapping's offset (fs/binfmt_elf.c elf_map), else the executable one, else
  vaddr == offset (perf's map__map_ip); ET_EXEC gets 0.
- Lazy loads never raise: ElfError from symbols or the debug-file search and any exception of
  a CFI factory become a count in the owning cache's ``stats.errors`` and an empty result.
- Tables come from the owner's factories (``symbol_factory``, else elfsyms.load_symbol_table;
  ``cfi_lookup``, then ``cfi_factory``), and every byte they hold is reported to it (``_grew``)
  for its memory bound, with the part that lies in read-only file mappings (``mapped``: tables
  used in place from the disk cache). Not thread-safe: the cache's owner calls it.

Cost: construction and ``bias_for`` are O(segments); each lazy load runs once per entry.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from .elf import PAGE, PF_X, ElfError, ElfReader, Segment
from .elfsyms import load_symbol_table
from .symtab import SymbolTable

__all__ = ["NOT_LOADED", "CfiFactory", "ElfEntry", "EntryOwner", "SymbolFactory"]

# (path that opens the validated file, separate debug file or None, the file's build-id or
# None): the build-id lets a factory persist compiled tables (cfi.CfiStore).
CfiFactory = Callable[[str, "str | None", "bytes | None"], object]
# An entry's symbol table instead of elfsyms.load_symbol_table (a symstore.SymbolStore).
SymbolFactory = Callable[["ElfEntry"], SymbolTable]


class _ErrorCounts(Protocol):
    errors: Counter[str]


class EntryOwner(Protocol):
    """What an entry asks of the cache that made it (``elfcache.ElfCache``)."""

    @property
    def symbol_factory(self) -> SymbolFactory | None: ...

    @property
    def cfi_factory(self) -> CfiFactory | None: ...

    @property
    def cfi_lookup(self) -> Callable[[bytes], object | None] | None: ...

    @property
    def stats(self) -> _ErrorCounts: ...

    @property
    def on_symbols(self) -> Callable[[ElfEntry], None] | None: ...

    def find_debug_file(self, entry: ElfEntry) -> str | None: ...

    def _grew(self, entry: ElfEntry, n: int, mapped: int = 0) -> None: ...


_ENTRY_BASE_BYTES = 1024  # object, dicts, path strings: a coarse per-entry overhead
NOT_LOADED = object()
_ids = itertools.count(1)


class ElfEntry:
    """One binary. Eagerly: identity and PT_LOAD segments (for the load bias). Lazily, once:
    symbols (``symbols()``), separate debug file (``debug_path()``), CFI (``cfi()``)."""

    __slots__ = (
        "_cache",
        "_cfi",
        "_debug",
        "_delta",
        "_symbols",
        "build_id",
        "dev",
        "error",
        "etype",
        "fd",
        "filename",
        "ino",
        "key",
        "mapped",
        "mtime_ns",
        "nbytes",
        "path",
        "refcount",
        "segments",
        "size",
        "store_key",
        "uid",
    )

    def __init__(
        self,
        *,
        key: tuple[object, ...] | None,
        filename: str,
        path: str,
        fd: int | None = None,
        build_id: bytes | None = None,
        etype: int = 0,
        segments: tuple[Segment, ...] = (),
        dev: int = 0,
        ino: int = 0,
        size: int = 0,
        mtime_ns: int = 0,
        error: str | None = None,
        cache: EntryOwner | None = None,
        store_key: bytes | None = None,
    ) -> None:
        self.uid = next(_ids)  # the unwinder's Module.key
        self.key = key
        self.filename = filename
        self.path = path
        self.fd = fd
        self.build_id = build_id
        # the disk stores' key (CFI, symbol and line tables): the build-id, else a stand-in
        # from the file's identity (cachefiles.identity_key)
        self.store_key = build_id or store_key
        self.etype = etype
        self.segments = segments
        self.dev, self.ino, self.size, self.mtime_ns = dev, ino, size, mtime_ns
        self.error = error
        self.refcount = 0
        self.nbytes = _ENTRY_BASE_BYTES + 64 * len(segments) + 2 * len(path)
        self.mapped = 0  # of nbytes, in read-only mappings of cache files
        self._cache = cache
        self._symbols: SymbolTable | None = None
        self._debug: object = NOT_LOADED
        self._cfi: object = NOT_LOADED
        # bias_for's segment choice depends on pgoff alone: bias - (start - pgoff) by pgoff,
        # one entry per distinct mapping offset of this file (a handful)
        self._delta: dict[int, int] = {}

    def __repr__(self) -> str:
        bid = self.build_id.hex() if self.build_id else None
        state = f"error={self.error}" if self.error else f"refs={self.refcount}"
        return f"ElfEntry(#{self.uid} {self.filename!r} build_id={bid} {state})"

    @property
    def usable(self) -> bool:
        return self.error is None and self.fd is not None

    @property
    def fd_path(self) -> str:
        """A path that opens exactly the validated file (for readers that want a path)."""
        return f"/proc/self/fd/{self.fd}"

    def reader(self) -> ElfReader:
        if self.fd is None:
            raise ElfError("unusable", self.error or "closed")
        return ElfReader(self.fd, self.size)

    def bias_for(self, start: int, pgoff: int) -> int:
        """Load bias of a mapping of this file at ``start`` from file offset ``pgoff``:
        runtime address = ELF vaddr + bias.

        File offset o of segment S is at vaddr ``S.vaddr + (o - S.offset)`` and, in a mapping
        of offset ``pgoff`` at ``start``, at runtime ``start + (o - pgoff)``; so
        ``bias = start - pgoff + S.offset - S.vaddr`` for the PT_LOAD S whose page-aligned file
        range holds ``pgoff`` (the kernel maps each PT_LOAD from ``p_offset`` rounded down to a
        page: fs/binfmt_elf.c elf_map). For ET_EXEC, start - pgoff == S.vaddr - S.offset, so the
        bias is 0. Without a matching segment we fall back to the executable one, then to
        vaddr == offset (bias = start - pgoff), as perf's map__map_ip does. The choice depends
        on ``pgoff`` alone, so it is made once per distinct ``pgoff``."""
        delta = self._delta.get(pgoff)
        if delta is None:
            delta = self._delta[pgoff] = self._segment_delta(pgoff)
        return start - pgoff + delta

    def _segment_delta(self, pgoff: int) -> int:
        """``S.offset - S.vaddr`` of the segment ``bias_for`` takes for ``pgoff``; 0 if none."""
        best: Segment | None = None
        for s in self.segments:
            lo = s.offset - s.offset % PAGE
            if lo <= pgoff < s.offset + max(s.filesz, 1):
                if best is None or (s.flags & PF_X and not best.flags & PF_X):
                    best = s
        if best is None:
            best = next((s for s in self.segments if s.flags & PF_X), None)
        if best is None:
            return 0
        return best.offset - best.vaddr

    # -- lazies

    def symbols(self) -> SymbolTable:
        """The symbol table (perf's rules, see elfsyms.py); loaded once, empty on error.
        Built by the cache's ``symbol_factory`` if it has one (a ``SymbolStore``: the same
        table, read from disk by build-id when it was built before). The cache's
        ``on_symbols`` (debuginfod.Debuginfod.offer) is told of the first load; if it fetched
        a debug file at once (``forget_debug``), the table is loaded again from it."""
        if self._symbols is None:
            self._load_symbols()
            hook = self._cache.on_symbols if self._cache is not None else None
            if hook is not None:
                hook(self)
                if self._symbols is None:
                    self._load_symbols()
        assert self._symbols is not None
        return self._symbols

    def _load_symbols(self) -> None:
        if self._symbols is None:
            table = SymbolTable.empty()
            factory = self._cache.symbol_factory if self._cache is not None else None
            if self.usable:
                try:
                    table = (factory or load_symbol_table)(self)
                except ElfError as e:
                    self._count_error(f"symbols_{e.reason}")
            self._symbols = table
            self._grow(table.nbytes, table.mapped_bytes)

    def debug_path(self) -> str | None:
        """Separate debug file: build-id dir first, then .gnu_debuglink (validated)."""
        if self._debug is NOT_LOADED:
            found: str | None = None
            if self.usable and self._cache is not None:
                try:
                    found = self._cache.find_debug_file(self)
                except ElfError as e:
                    self._count_error(f"debug_{e.reason}")
            self._debug = found
        return self._debug if isinstance(self._debug, str) else None

    def forget_debug(self) -> None:
        """Forget the symbol table and the separate debug file found (one has appeared since:
        debuginfod.py): both load again on next use. CFI stays (``.eh_frame`` survives
        strip, and native address spaces hold the table)."""
        if self._symbols is not None:
            n, mapped = self._symbols.nbytes, self._symbols.mapped_bytes
            self._symbols = None
            self._grow(-n, -mapped)
        self._debug = NOT_LOADED

    def cfi(self) -> object | None:
        """The unwind table from the injected factory (``CfiTable.from_elf``, or a
        ``CfiStore`` keyed by ``build_id``), or None. With the cache's ``cfi_lookup`` (a
        ``CfiStore``'s table by build-id alone), a table found there is taken without looking
        for the separate debug file, which only building one needs (stats and section-header
        reads of every candidate)."""
        if self._cfi is NOT_LOADED:
            table: object | None = None
            cache = self._cache
            factory = cache.cfi_factory if cache is not None else None
            if factory is not None and self.usable:
                try:
                    lookup = cache.cfi_lookup if cache is not None else None
                    if lookup is not None and self.store_key:
                        table = lookup(self.store_key)
                    if table is None:
                        table = factory(self.fd_path, self.debug_path(), self.store_key)
                except Exception as e:  # a native compiler error must not kill the daemon
                    self._count_error(f"cfi_{type(e).__name__}")
            self._cfi = table
            nbytes = getattr(table, "nbytes", 0)
            nbytes = nbytes if isinstance(nbytes, int) else 0
            self._grow(nbytes, nbytes if getattr(table, "mapped", False) is True else 0)
        return self._cfi

    def _grow(self, n: int, mapped: int = 0) -> None:
        self.nbytes += n
        self.mapped += mapped
        if self._cache is not None:
            self._cache._grew(self, n, mapped)

    def _count_error(self, reason: str) -> None:
        if self._cache is not None:
            self._cache.stats.errors[reason] += 1

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

