"""A binary's symbol table: sorted, non-overlapping [start, end) ranges in ELF vaddr space,
one name each, built once per binary and shared by every pid that maps it.

Rules:
- Lookup is perf's symbols__find: the last symbol with start <= addr, if addr < end (or addr is
  its start: a zero-size symbol); else None (perf's [unknown]).
- A name is printed as perf prints it: demangled without parameters (demangle.py), PLT entries
  as ``<name>@plt``. It is kept as an offset into the binary's string table (``NO_NAME``: the
  name is in ``_named``, or raw in ``_plt``) until a lookup returns it, then decoded and
  demangled once.
- ``starts``/``ends`` are u64 columns native code reads too (stacks.c's fp_sym_region):
  ``array("Q")`` for a table built here, or read-only views of a mapped cache file
  (symstore.SymbolStore) used in place, as is its string table; they never change once
  built, only the cache of decoded names grows.
- A table read from a cache file keeps the names its string table lacks (``_extras``: names
  given as printed, PLT entries' raw names) in the file too: a sorted index column and an
  offset column (``EXTRA_RAW`` marks a raw PLT name) into the file's names blob, each decoded
  on its first lookup like the others. A system library has thousands of such names (its
  PLT): as a str and a dict slot each they would stay on the heap for the table's life; the
  columns cost 8 B a name, and the blob stays in the mapping.
- ``nbytes`` estimates the memory held: 20 B a symbol, the string table, the names kept;
  ``mapped_bytes`` is the part of it that lies in a file mapping (shared, reclaimable page
  cache) rather than on the heap.

Cost: a lookup is one bisect, O(log n), through a heap directory for a mapped table
(strided.py: one or two pages of its starts read, not one per level); names cost O(names
used), decoded and demangled once (a name among the extras one more bisect, O(log extras)).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from typing import TypeAlias

from ..lightdc import dataclass
from .demangle import demangle
from .strided import directory, find

__all__ = ["EXTRA_RAW", "NO_NAME", "Column", "Extras", "StrTab", "Symbol", "SymbolTable",
           "c_string"]


@dataclass(frozen=True, slots=True)
class Symbol:
    """One symbol of a table: its printed name and [start, end) in ELF vaddrs."""

    name: str
    start: int
    end: int

    def __repr__(self) -> str:
        return f"Symbol({self.name!r}, {self.start:#x}-{self.end:#x})"


NO_NAME = 0xFFFFFFFF  # offs[] entry of a symbol named in _named, _plt or _extras
EXTRA_RAW = 1 << 31  # an extra name's offset flag: a PLT entry's raw name (demangled + "@plt")

# A u64 or u32 column: an array of its own, or a view cast from a mapped file.
Column: TypeAlias = "array[int] | memoryview"
StrTab: TypeAlias = "bytes | memoryview"
# a table's names outside its string table: (symbol indexes, ascending; their names' offsets
# in the blob, | EXTRA_RAW for a raw PLT name; the blob of NUL-terminated names)
Extras: TypeAlias = "tuple[Column, Column, StrTab]"
_NO_EXTRAS: Extras = (array("I"), array("I"), b"")


def c_string(st: StrTab, off: int) -> bytes:
    """The NUL-terminated string at ``off`` (to the end if unterminated). A mapped table has
    no ``find``: it is read in growing pieces, so a name costs O(its length)."""
    if isinstance(st, bytes):
        end = st.find(b"\0", off)
        return st[off : end if end >= 0 else len(st)]
    want = 256
    while True:
        piece = bytes(st[off : off + want])
        end = piece.find(b"\0")
        if end >= 0:
            return piece[:end]
        if off + want >= len(st):
            return piece
        want *= 16


class SymbolTable:
    """Sorted, non-duplicated symbols of one binary, in ELF vaddr space.

    Names are kept as offsets into the binary's string table and decoded + demangled on first
    lookup (a profile names few of a binary's symbols, and demangling is costly).
    ``_named`` caches decoded names by index: O(names used).
    ``_plt`` holds the raw names of PLT entries whose demangling waits for a lookup too;
    ``_extras`` the names a cache file holds outside the string table, undecoded."""

    __slots__ = ("_dir", "_extras", "_named", "_offs", "_plt", "_strtab", "ends",
                 "mapped_bytes", "nbytes", "starts")  # fmt: skip

    starts: Column
    ends: Column
    _offs: Column
    _strtab: StrTab

    def __init__(self, symbols: Iterable[tuple[int, int, str]]) -> None:
        syms = sorted(symbols)
        self.starts = array("Q", (s for s, _, _ in syms))
        self.ends = array("Q", (e for _, e, _ in syms))
        self._offs = array("I", bytes(4 * len(syms)))
        self._strtab = b""
        self._named = {i: n for i, (_, _, n) in enumerate(syms)}
        self._plt: dict[int, str] = {}
        self._extras = _NO_EXTRAS
        self.nbytes = 20 * len(syms) + sum(49 + len(n) for _, _, n in syms)
        self.mapped_bytes = 0
        self._dir: array[int] | None = None

    @classmethod
    def _columns(
        cls, starts: Column, ends: Column, offs: Column, strtab: StrTab,
        named: dict[int, str], plt: dict[int, str] | None = None, *, mapped_bytes: int = 0,
        extras: Extras = _NO_EXTRAS,
    ) -> SymbolTable:  # fmt: skip
        """A table over given columns; ``mapped_bytes``: the size of the file mapping they
        are views of (then ``nbytes`` is that plus the names held on the heap); ``extras``:
        names outside the string table, left undecoded (``Extras``)."""
        t = cls.__new__(cls)
        t.starts, t.ends, t._offs, t._strtab, t._named = starts, ends, offs, strtab, named
        t._plt = plt or {}
        t._extras = extras
        # names decoded later are not counted: bounded by the string table we count whole
        names = sum(49 * len(d) + sum(map(len, d.values())) for d in (named, t._plt))
        xidx, _, xblob = extras
        names += 8 * len(xidx) + (0 if isinstance(xblob, memoryview) else len(xblob))
        t.nbytes = (mapped_bytes or 20 * len(starts) + len(strtab)) + names
        t.mapped_bytes = mapped_bytes
        # a mapped column is bisected through a heap directory (strided.py); a heap one whole
        t._dir = directory(starts) if mapped_bytes else None
        if t._dir is not None:
            t.nbytes += 8 * len(t._dir)
        return t

    @classmethod
    def empty(cls) -> SymbolTable:
        return cls(())

    def __len__(self) -> int:
        return len(self.starts)

    def name(self, i: int) -> str:
        """Symbol ``i``'s name as perf prints it (decoded and demangled once)."""
        n = self._named.get(i)
        if n is None:
            st = self._strtab
            off = self._offs[i]
            if off == NO_NAME:
                raw_plt = self._plt.get(i)
                if raw_plt is None:
                    n = self._named[i] = self._extra(i)
                else:
                    n = self._named[i] = f"{demangle(raw_plt)}@plt"
                return n
            raw = c_string(st, off).decode("utf-8", "surrogateescape")
            n = self._named[i] = demangle(raw)
        return n

    def _extra(self, i: int) -> str:
        idx, offs, blob = self._extras
        k = bisect_left(idx, i)
        if k == len(idx) or idx[k] != i:
            raise KeyError(i)  # (a NO_NAME slot without a name: decode_symbol_table refuses it)
        off = offs[k]
        name = c_string(blob, off & ~EXTRA_RAW).decode("utf-8", "surrogateescape")
        return f"{demangle(name)}@plt" if off & EXTRA_RAW else name

    @property
    def names(self) -> list[str]:
        return [self.name(i) for i in range(len(self.starts))]

    def lookup(self, addr: int) -> tuple[str, int] | None:
        dirs = self._dir
        i = bisect_right(self.starts, addr) - 1 if dirs is None else find(self.starts, dirs, addr)
        if i < 0:
            return None
        start, end = self.starts[i], self.ends[i]
        if addr < end or addr == start:
            return self.name(i), addr - start
        return None

    def symbols(self) -> list[Symbol]:
        return [Symbol(self.name(i), s, e)
                for i, (s, e) in enumerate(zip(self.starts, self.ends, strict=True))]  # fmt: skip
