"""Symbolization: (binary, ELF vaddr) -> (name, offset), separate from unwinding.

Rules (perf 6.1, tools/perf/util/symbol-elf.c dso__load_sym, symbol.c), so names match
``perf script -F sym``:
- Source: the first ``.symtab`` among the separate debug file (build-id dir or
  ``.gnu_debuglink``, see elf.find_debug_file) and the binary itself; else the binary's
  ``.dynsym``. On this machine libc's local symbols (``__restore_rt``, ``hack_digit``) come
  from ``/usr/lib/debug/.build-id/xx/rest.debug``.
- Kept: STT_FUNC/STT_GNU_IFUNC with a name and a defined section (elf_sym__is_function), and
  named STT_NOTYPE labels (not ABS/UNDEF, not hidden/internal) in a section whose name
  contains "text" (elf_sym__is_label, elf_sec__is_text); the section must be SHF_ALLOC.
  The debug file's section headers are NOBITS but keep names and flags, which is all we need.
- Names are stored as perf prints them: demangled without parameters (demangle.py). glibc's
  ``.symtab`` holds versioned aliases literally (``__libc_start_main@@GLIBC_2.34``,
  ``cfree@GLIBC_2.2.5``) and perf's alias choice picks them, so perf prints ``@``-suffixes for
  some libc frames; we reproduce that rather than strip it.
- symbols__fixup_end first: a zero-size symbol extends to the next symbol's start, the last one
  to the next page boundary + 4 KiB. Then symbols__fixup_duplicate: among symbols at the same
  start, choose_best_symbol keeps (in order) the non-zero size, the non-weak, the global, the
  one with fewer leading underscores, the longer name, else the first in table order.
- PLT: ``<name>@plt`` entries synthesized from ``.rela.plt`` (dso__synthesize_plt_symbols),
  over ``.plt.sec`` if present, else ``.plt`` after its 16-byte header; x86_64 entry size 16.
  Relocations are taken in GOT-slot order (x86 puts IRELATIVE relocs last; their sym index
  is 0, hence perf's bare ``@plt``).
- Lookup: the last symbol with start <= addr, if addr < end (perf's symbols__find).

Cost: a table is built once per binary by one native pass (symtab.c: filter, sort, fixups in
O(n log n), ~20 ns per symbol), held by the ELF cache entry and shared by every pid; names stay
offsets into the string table until a lookup returns them, so only names actually printed are
decoded and demangled (once each). Lookups are one bisect. Kernel symbols: ``/proc/kallsyms``
parsed once, natively, names decoded on use.
JIT maps (``/tmp/perf-<pid>.map``) re-parsed only when their (size, mtime) changes.

Persistence (``SymbolStore``, an ElfCache ``symbol_factory``): a binary with a build-id has its
finished table (the columns of ``SymbolTable._columns``, taken before any lookup) saved as
``<dir>/<build-id hex>.sym``; a later process reads it back (a CRC pass and a few
``array.frombytes``) instead of scanning, and gets a table that answers every lookup and name
as the fresh one. A file is used only if every check in ``decode_symbol_table`` passes (size,
CRC, build-id, layout version, a stamp of the code that decides the content and of the
binary's size and debug file (``source_stamp``: stripped copies keep their build-id), in-range
name offsets); else it is counted, removed, rebuilt
and rewritten (atomically: cachefiles.write_cache_file).
"""

from __future__ import annotations

import os
import re
import struct
import threading
import zlib
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import pairwise
from typing import TypeVar

from .cachefiles import CacheFileError, discard_cache_file, read_cache_file, write_cache_file
from .demangle import demangle, demangle_full, demangle_rust_legacy
from .elf import ElfError, ElfReader
from .elfcache import ElfEntry

__all__ = [
    "Kallsyms",
    "PerfMap",
    "Symbol",
    "SymbolStore",
    "SymbolTable",
    "Symbolizer",
    "decode_symbol_table",
    "encode_symbol_table",
    "load_symbol_table",
    "load_symbol_table_reference",
    "parse_kallsyms",
    "parse_perf_map",
]

STT_NOTYPE, STT_OBJECT, STT_FUNC, STT_GNU_IFUNC = 0, 1, 2, 10
STB_LOCAL, STB_GLOBAL, STB_WEAK = 0, 1, 2
STV_INTERNAL, STV_HIDDEN = 1, 2
SHN_UNDEF, SHN_LORESERVE, SHN_ABS = 0, 0xFF00, 0xFFF1
SHF_ALLOC = 2
SHT_SYMTAB, SHT_DYNSYM, SHT_RELA = 2, 11, 4
R_X86_64_JUMP_SLOT, R_X86_64_IRELATIVE = 7, 37
EM_X86_64, EM_AARCH64 = 62, 183
# Elf64_Sym: u32 st_name; u8 st_info; u8 st_other; u16 st_shndx; u64 st_value; u64 st_size
_SYM = struct.Struct("<IBBHQQ")
# Elf64_Rela: u64 r_offset; u64 r_info (sym << 32 | type); s64 r_addend
_RELA = struct.Struct("<QQq")
MAX_SYMBOLS = 1 << 22  # 4M symbols x 24 bytes = 96 MiB of .symtab: beyond any real binary
_PAGE = 4096
SEC_ALLOC, SEC_TEXT = 1, 2  # symtab.c's per-section flags (unwcore.h UNW_SEC_*)
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Symbol:
    name: str
    start: int
    end: int

    def __repr__(self) -> str:
        return f"Symbol({self.name!r}, {self.start:#x}-{self.end:#x})"


_NO_NAME = 0xFFFFFFFF  # offs[] entry of a symbol named in _named or _plt (PLT entries)


class SymbolTable:
    """Sorted, non-duplicated symbols of one binary, in ELF vaddr space.

    Names are kept as offsets into the binary's string table and decoded + demangled on first
    lookup (a profile names a few hundred of a binary's ~10k+ symbols; demangling all of them
    was half of a cold replay). ``_named`` caches decoded names by index: O(names used).
    ``_plt`` holds the raw names of PLT entries whose demangling waits for a lookup too."""

    __slots__ = ("_named", "_offs", "_plt", "_strtab", "ends", "nbytes", "starts")

    def __init__(self, symbols: Iterable[tuple[int, int, str]]) -> None:
        syms = sorted(symbols)
        self.starts = array("Q", (s for s, _, _ in syms))
        self.ends = array("Q", (e for _, e, _ in syms))
        self._offs = array("I", bytes(4 * len(syms)))
        self._strtab = b""
        self._named = {i: n for i, (_, _, n) in enumerate(syms)}
        self._plt: dict[int, str] = {}
        self.nbytes = 20 * len(syms) + sum(49 + len(n) for _, _, n in syms)

    @classmethod
    def _columns(
        cls, starts: array[int], ends: array[int], offs: array[int], strtab: bytes,
        named: dict[int, str], plt: dict[int, str] | None = None,
    ) -> SymbolTable:  # fmt: skip
        t = cls.__new__(cls)
        t.starts, t.ends, t._offs, t._strtab, t._named = starts, ends, offs, strtab, named
        t._plt = plt or {}
        # names decoded later are not counted: bounded by the string table we count whole
        t.nbytes = 20 * len(starts) + len(strtab) + sum(
            49 + len(n) for d in (named, t._plt) for n in d.values())  # fmt: skip
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
            if off == _NO_NAME:
                n = self._named[i] = f"{demangle(self._plt[i])}@plt"
                return n
            end = st.find(b"\0", off)
            raw = st[off : end if end >= 0 else len(st)].decode("utf-8", "surrogateescape")
            n = self._named[i] = demangle(raw)
        return n

    @property
    def names(self) -> list[str]:
        return [self.name(i) for i in range(len(self.starts))]

    def lookup(self, addr: int) -> tuple[str, int] | None:
        i = bisect_right(self.starts, addr) - 1
        if i < 0:
            return None
        start, end = self.starts[i], self.ends[i]
        if addr < end or addr == start:
            return self.name(i), addr - start
        return None

    def symbols(self) -> list[Symbol]:
        return [Symbol(self.name(i), s, e)
                for i, (s, e) in enumerate(zip(self.starts, self.ends, strict=True))]  # fmt: skip


# --------------------------------------------------------------------------- ELF symbols


@dataclass(slots=True)
class _Sym:
    start: int
    end: int
    bind: int
    name: str
    index: int


def _underscores(name: str) -> int:
    return len(name) - len(name.lstrip("_"))


def _a_is_best(a: _Sym, b: _Sym) -> bool:
    """perf's choose_best_symbol (symbol.c): True if ``a`` wins over ``b``."""
    za, zb = a.end == a.start, b.end == b.start
    if za != zb:
        return zb
    wa, wb = a.bind == STB_WEAK, b.bind == STB_WEAK
    if wa != wb:
        return wb
    ga, gb = a.bind == STB_GLOBAL, b.bind == STB_GLOBAL
    if ga != gb:
        return ga
    ua, ub = _underscores(a.name), _underscores(b.name)
    if ua != ub:
        return ua < ub
    if len(a.name) != len(b.name):
        return len(a.name) > len(b.name)
    return True


def _symtab_section(reader: ElfReader, sec_type: int) -> tuple[bytes, bytes] | None:
    """(symbol table bytes, its string table) of the first section of ``sec_type``."""
    symsec = next((s for s in reader.sections if s.type == sec_type), None)
    if symsec is None or symsec.size < _SYM.size:
        return None
    if symsec.size // _SYM.size > MAX_SYMBOLS:
        raise ElfError("too_many_symbols")
    secs = reader.sections
    if not 0 < symsec.link < len(secs):
        raise ElfError("bad_strtab_link")
    return reader.section_data(symsec), reader.section_data(secs[symsec.link])


# unw_sym (unwcore.h), 32 bytes: u64 start, end; u32 name, index; u8 bind, keep; u16; u32
_USYM = struct.Struct("<QQIIBBHI")


class _Scan:
    """The native scan of one symbol table (unw_symtab_scan): kept symbols sorted, ends fixed,
    duplicates resolved (the groups C leaves undecided here, with demangled names)."""

    def __init__(self, reader: ElfReader, data: bytes, strtab: bytes) -> None:
        from .._unwcore import ffi, lib

        secs = reader.sections
        flags = bytes(
            (SEC_ALLOC if s.flags & SHF_ALLOC else 0) | (SEC_TEXT if "text" in s.name else 0)
            for s in secs
        )  # fmt: skip
        nsyms = len(data) // _SYM.size
        out = ffi.new("struct unw_sym[]", max(1, nsyms))
        nund = ffi.new("uint64_t *")
        self.nkept = n = int(lib.unw_symtab_scan(data, nsyms, strtab, len(strtab), flags,
                                                 len(secs), reader.machine == EM_AARCH64,
                                                 out, nund))  # fmt: skip
        if nund[0]:
            self._decide(out, n, strtab)
        n = int(lib.unw_symtab_compact(out, n))
        words = memoryview(ffi.buffer(out, n * _USYM.size)).cast("Q")
        self.starts = array("Q", words[0::4].tobytes())
        self.ends = array("Q", words[1::4].tobytes())
        self.offs = array("I", words.cast("B").cast("I")[4::8].tobytes())
        self.strtab = strtab

    @staticmethod
    def _decide(out: object, n: int, strtab: bytes) -> None:
        """symbols__fixup_duplicate for the groups C left undecided: the first member with the
        greatest key (non-zero size, non-weak, global, fewer leading underscores, longer name;
        names as perf prints them, i.e. demangled). That is what the left-to-right fold of
        ``_a_is_best`` over the group in table order keeps (it keeps ``a`` on a tie), without
        demangling more than needed (demangling was ~11 us a name, most of a C++ library's
        load): members that lose on size, weak or global drop out on raw fields; names that
        do not start with ``_Z`` are their own demangled form; and constructor/destructor
        variants that differ only in that code (``C1``/``C2``/``C3``, ``D0``/``D1``/``D2``:
        see ``_ctor_twin``) print the same name, so one demangle stands for all of them, and
        none when they are all that is left of the group; other names with the same full
        demangled text (template classes' variants) share it without the perf-form step."""
        from .._unwcore import ffi

        size = _USYM.size
        raw = ffi.buffer(out, n * size)
        flat = bytes(raw)
        keep, binds = flat[25::size], flat[24::size]
        q = memoryview(flat).cast("Q")  # record j: start q[4j], end q[4j + 1]
        u32 = memoryview(flat).cast("I")  # record j: name offset u32[8j + 4]
        i = keep.find(2)
        while i >= 0:
            start = q[4 * i]
            group = [i]
            i = keep.find(2, i + 1)
            while i >= 0 and q[4 * i] == start:
                group.append(i)
                i = keep.find(2, i + 1)
            # the raw steps: non-zero size, then non-weak, then global
            ranks = [(q[4 * j + 1] != start, binds[j] != STB_WEAK, binds[j] == STB_GLOBAL)
                     for j in group]  # fmt: skip
            top = max(ranks)
            cands = [j for j, r in zip(group, ranks, strict=True) if r == top]
            best = cands[0] if len(cands) == 1 else _best_by_name(cands, u32, strtab)
            for j in group:
                raw[j * size + 25] = b"\x01" if j == best else b"\x00"


# A constructor or destructor of a plain nested name: ``_ZN`` [rVK]* [RO]? [St]? <source-name>+
# then the code, then ``E`` (end of the nested name). libiberty's d_prefix reads each
# <source-name> (length, identifier) and then the code as a <ctor-dtor-name>, which prints the
# class name (``~`` + it for D*) whatever the variant: two such names that differ only in the
# variant demangle to the same text. Anything else (templates, other substitutions, local
# names) is left to demangle.
_CTOR_CODES = {"C1": "C", "C2": "C", "C3": "C", "D0": "D", "D1": "D", "D2": "D"}


def _ctor_twin(name: str) -> tuple[int, str, str] | None:
    """(position of the code, its family, ``name`` with the code masked: C1/C2/C3 -> C*,
    D0/D1/D2 -> D*) if ``name`` has the shape above, else None. Names with the same mask
    demangle alike."""
    if not name.startswith("_ZN"):
        return None
    n = len(name)
    i = 3
    while i < n and name[i] in "rVK":
        i += 1
    if i < n and name[i] in "RO":
        i += 1
    if name.startswith("St", i):
        i += 2
    names = 0
    while i < n and "0" <= name[i] <= "9":
        j = i + 1
        while j < n and "0" <= name[j] <= "9":
            j += 1
        length = int(name[i:j])
        if length <= 0:
            return None
        i = j + length
        names += 1
    if not names or i + 3 > n or name[i + 2] != "E":
        return None
    family = _CTOR_CODES.get(name[i : i + 2])
    if family is None:
        return None
    return i, family, f"{name[:i]}{family}*{name[i + 2 :]}"


def _best_by_name(cands: list[int], u32: memoryview, strtab: bytes) -> int:
    """The first of ``cands`` (records in table order, tied before the name step) with the
    fewest leading underscores, then the longest name, as perf prints it. Demangles one name
    per class of ``_ctor_twin``, none if every candidate is in one class; then joins the
    classes whose names demangle to the same text, and ranks only if more than one is left."""
    keys: list[str] = []
    classes: dict[str, str] = {}  # class key -> the name that stands for it
    twin: tuple[int, str, str] | None = None  # (code position, family, key) of the last twin
    for j in cands:
        off = u32[8 * j + 4]
        z = strtab.find(0, off)
        name = strtab[off : z if z >= 0 else len(strtab)].decode("utf-8", "surrogateescape")
        key = name
        if name.startswith("_Z"):
            # a twin of the previous one: same text around the same position (so the same
            # parse, see _ctor_twin), a code of the same family there; else parse it
            if twin is not None and _CTOR_CODES.get(name[twin[0] : twin[0] + 2]) == twin[1]:
                p, fam = twin[0], twin[1]
                masked = f"{name[:p]}{fam}*{name[p + 2 :]}"
                if masked == twin[2]:
                    key = masked
            if key is name:
                found = _ctor_twin(name)
                if found is not None:
                    twin = found
                    key = found[2]
        keys.append(key)
        classes.setdefault(key, name)
    if len(classes) == 1:
        return cands[0]
    # Classes the parse could not join (templates, other substitutions): names that are not
    # Rust's and demangle to the same full text print the same (demangle derives perf's form
    # from that text alone, see demangle.demangle), so they are one class too. The full text
    # is the costly half of demangle and cached, so ranking what is left reuses it.
    same: dict[tuple[str, bool], str] = {}  # (full text, special) -> its class key
    alias: dict[str, str] = {}
    for key, name in classes.items():
        if name.startswith("_Z") and demangle_rust_legacy(name) is None:
            full = demangle_full(name)
            if full is not None:
                alias[key] = same.setdefault((full, name[2:3] in ("T", "G")), key)
    if alias:
        keys = [alias.get(k, k) for k in keys]
        if len(set(keys)) == 1:
            return cands[0]
    rank: dict[str, tuple[int, int]] = {}
    for key in set(keys):
        name = classes[key]
        shown = demangle(name) if name.startswith("_Z") else name
        rank[key] = (-_underscores(shown), len(shown))
    best, best_rank = cands[0], rank[keys[0]]
    for j, key in zip(cands[1:], keys[1:], strict=True):
        if rank[key] > best_rank:
            best, best_rank = j, rank[key]
    return best


def _scan(reader: ElfReader, sec_type: int) -> _Scan | None:
    found = _symtab_section(reader, sec_type)
    if found is None:
        return None
    scan = _Scan(reader, *found)
    return scan if scan.nkept else None


def _plt_symbols(reader: ElfReader, base_index: int, demangled: bool = True) -> list[_Sym]:
    """perf's synthesized PLT symbols; with ``demangled=False`` entry names are the raw
    dynamic-symbol names + ``@plt`` (the caller demangles them when needed)."""
    if reader.machine != EM_X86_64:
        return []
    plt = reader.section(".plt")
    rela = reader.section(".rela.plt")
    if plt is None or rela is None or rela.type != SHT_RELA:
        return []
    secs = reader.sections
    if not 0 < rela.link < len(secs):
        return []
    dynsym = secs[rela.link]
    if not 0 < dynsym.link < len(secs):
        return []
    dynstr = reader.section_data(secs[dynsym.link])
    dsyms = reader.section_data(dynsym)
    relas = sorted(_RELA.iter_unpack(reader.section_data(rela)[: rela.size // 24 * 24]))
    entry = 16
    out: list[_Sym] = []
    plt_sec = reader.section(".plt.sec")
    if plt_sec is not None:
        addr = plt_sec.addr
        out.append(_Sym(plt.addr, plt.addr + plt.size, STB_GLOBAL, ".plt", base_index))
    elif len(relas) * entry == plt.size:
        addr = plt.addr
    else:
        addr = plt.addr + entry
        out.append(_Sym(plt.addr, plt.addr + entry, STB_GLOBAL, ".plt", base_index))
    for i, (_off, info, _add) in enumerate(relas):
        rtype, symidx = info & 0xFFFFFFFF, info >> 32
        if rtype not in (R_X86_64_JUMP_SLOT, R_X86_64_IRELATIVE):
            continue
        name = ""
        if symidx and (symidx + 1) * _SYM.size <= len(dsyms):
            st_name = _SYM.unpack_from(dsyms, symidx * _SYM.size)[0]
            if st_name < len(dynstr):
                end = dynstr.find(b"\0", st_name)
                name = dynstr[st_name:end].decode("utf-8", "surrogateescape")
                if demangled:
                    name = demangle(name)
        out.append(_Sym(addr, addr + entry, STB_GLOBAL, f"{name}@plt", base_index + 1 + i))
        addr += entry
    return out


def _debug_reader_do(entry: ElfEntry, fn: Callable[[ElfReader], _T]) -> _T | None:
    """``fn`` on a reader of ``entry``'s separate debug file; None if absent or broken."""
    dbg = entry.debug_path()
    if dbg is None:
        return None
    try:
        fd = os.open(dbg, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return fn(ElfReader(fd, os.fstat(fd).st_size))
    except ElfError:
        return None  # a broken debug file: fall back to the binary
    finally:
        os.close(fd)


def load_symbol_table(entry: ElfEntry) -> SymbolTable:
    """Build ``entry``'s table by the module rules. Raises ElfError on malformed input.
    Cost: one native pass over the chosen .symtab/.dynsym; no name is decoded here except
    members of duplicate groups that only demangled names decide (PLT entries' mangled
    names are demangled on lookup too)."""
    binary = entry.reader()
    scan = _debug_reader_do(entry, lambda r: _scan(r, SHT_SYMTAB))
    if scan is None:
        scan = _scan(binary, SHT_SYMTAB) or _scan(binary, SHT_DYNSYM)
    if scan is None:
        starts, ends, offs, strtab = array("Q"), array("Q"), array("I"), b""
    else:
        starts, ends, offs, strtab = scan.starts, scan.ends, scan.offs, scan.strtab
    named: dict[int, str] = {}
    plt_raw: dict[int, str] = {}
    # perf inserts PLT symbols after the fixups, so they are neither extended nor deduplicated;
    # one taking the start of an ELF symbol is dropped. Merged by slicing: O(n + plt).
    plt = sorted((s.start, s.end, s.name) for s in _plt_symbols(binary, 0, demangled=False))
    if plt:
        pieces: list[tuple[int, int | None, tuple[int, int, str] | None]] = []
        prev = 0
        for sym in plt:
            i = bisect_left(starts, sym[0])
            if i < len(starts) and starts[i] == sym[0]:
                continue
            pieces.append((prev, i, sym))
            prev = i
        pieces.append((prev, None, None))
        ns, ne, no = array("Q"), array("Q"), array("I")
        for a, b, p in pieces:
            ns += starts[a:b]
            ne += ends[a:b]
            no += offs[a:b]
            if p is not None:
                if p[2].startswith("_Z"):  # "<raw>@plt": demangled on lookup
                    plt_raw[len(ns)] = p[2][:-4]
                else:
                    named[len(ns)] = p[2]  # as printed: demangling is the identity
                ns.append(p[0])
                ne.append(p[1])
                no.append(_NO_NAME)
        starts, ends, offs = ns, ne, no
    return SymbolTable._columns(starts, ends, offs, strtab, named, plt_raw)


# -- the pure-Python reference (tests compare the native tables with it, symbol by symbol)


def _fixup(syms: list[_Sym]) -> list[tuple[int, int, str]]:
    syms.sort(key=lambda s: (s.start, s.index))
    # symbols__fixup_end
    for prev, curr in pairwise(syms):
        if prev.end == prev.start:
            prev.end = curr.start
    if syms and syms[-1].end == syms[-1].start:
        last = syms[-1]
        last.end = (last.start + _PAGE - 1) // _PAGE * _PAGE + _PAGE
    # symbols__fixup_duplicate
    out: list[_Sym] = []
    for s in syms:
        if out and out[-1].start == s.start:
            if not _a_is_best(out[-1], s):
                out[-1] = s
        else:
            out.append(s)
    return [(s.start, s.end, s.name) for s in out]


def _read_symbols(reader: ElfReader, sec_type: int) -> list[_Sym] | None:
    """Kept symbols of the first section of ``sec_type``, or None if there is none."""
    found = _symtab_section(reader, sec_type)
    if found is None:
        return None
    data, strtab = found
    secs = reader.sections
    out: list[_Sym] = []
    n = len(data) // _SYM.size
    for idx, (st_name, info, other, shndx, value, size) in enumerate(
        _SYM.iter_unpack(data[: n * _SYM.size])
    ):
        if st_name == 0 or shndx == SHN_UNDEF or shndx >= SHN_LORESERVE:
            continue
        stype = info & 0xF
        if stype not in (STT_FUNC, STT_GNU_IFUNC):
            if stype != STT_NOTYPE or (other & 3) in (STV_HIDDEN, STV_INTERNAL):
                continue
            if shndx >= len(secs) or "text" not in secs[shndx].name:
                continue
        if shndx >= len(secs) or not secs[shndx].flags & SHF_ALLOC:
            continue
        if st_name >= len(strtab):
            continue
        end = strtab.find(b"\0", st_name)
        raw = strtab[st_name : end if end >= 0 else len(strtab)]
        name = raw.decode("utf-8", "surrogateescape")
        if (
            reader.machine == EM_AARCH64
            and len(name) >= 2
            and name[0] == "$"
            and (name[1] in "adtx" and (len(name) == 2 or name[2] == "."))
        ):
            continue  # ARM mapping symbols, as perf rejects them
        out.append(_Sym(value, value + size, info >> 4, demangle(name), idx))
    return out


def load_symbol_table_reference(entry: ElfEntry) -> SymbolTable:
    """``load_symbol_table`` in pure Python, every name demangled up front (~50x slower):
    the executable statement of the rules that tests hold the native path to."""
    binary = entry.reader()
    syms = _debug_reader_do(entry, lambda r: _read_symbols(r, SHT_SYMTAB))
    if not syms:
        syms = _read_symbols(binary, SHT_SYMTAB)
    if not syms:
        syms = _read_symbols(binary, SHT_DYNSYM) or []
    table = _fixup(syms)
    plt = [(s.start, s.end, s.name) for s in _plt_symbols(binary, len(syms))]
    if plt:
        taken = {s for s, _, _ in table}
        table += [p for p in plt if p[0] not in taken]
    return SymbolTable(table)


# --------------------------------------------------------------------------- persistence

# A ".sym" file, little-endian: _SYM_FILE, then the build-id, starts (u64 x n), ends (u64 x n),
# name offsets (u32 x n), extras (u32 x m: symbol index | _EXTRA_RAW if the name is a PLT
# entry's raw name, demangled on lookup, else the name as printed), the m extras' names (each
# UTF-8 with surrogateescape, NUL-terminated), the string table.
SYM_FILE_MAGIC = b"UWSYM\x00\x00\x00"
# Bump when the file layout changes. Table content (the rules above, demangle.py's choices,
# symtab.c) is covered by _code_stamp instead, so a code change never serves an old table.
SYM_FILE_VERSION = 2
# magic, version, flags (0), stamp (u64: _code_stamp() << 32 | source_stamp(entry)), build-id
# length, n, m,
# names length, string table length, CRC-32 of everything after the header, pad
_SYM_FILE = struct.Struct("<8sIIQIIIIQI4x")
_EXTRA_RAW = 1 << 31
MAX_SYM_FILE = 1 << 30  # > any real table (4M symbols x 20 B + string table); < 2**32 offsets
_SYM_STATS = ("hits", "misses", "corrupt", "stale", "no_build_id", "write_errors", "unsaved")


class _BadFile(Exception):
    """A cache file not to use; ``reason`` is a ``SymbolStore.stats`` key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


_stamp: list[int] = []


def _code_stamp() -> int:
    """CRC-32 of (size, mtime) of the code a table's content depends on (this module,
    demangle, elf's reader and debug-file search, the native scan): a reinstalled or edited
    package writes new tables instead of serving ones its predecessor built. Once per process:
    four stats (zlib, not hashlib: importing OpenSSL's hashlib was ~3 ms of a replay)."""
    if not _stamp:
        import sys

        from .. import _unwcore
        from . import demangle, elf

        desc = []
        for mod in (sys.modules[__name__], demangle, elf, _unwcore):
            try:
                st = os.stat(str(mod.__file__))
                desc.append(f"{mod.__name__}:{st.st_size}:{st.st_mtime_ns}")
            except (OSError, AttributeError):
                desc.append(f"{mod.__name__}:?")
        _stamp.append(zlib.crc32(";".join(desc).encode()))
    return _stamp[0]


def _names_in_range(offs: array[int], plt: Iterable[int], strtab_len: int) -> bool:
    """Whether every offset in ``offs`` but those at the distinct indices ``plt`` (the
    ``_NO_NAME`` slots, set to 0 for the pass and restored) is inside a string table of
    ``strtab_len`` bytes. One ``max``: O(n), ~25 ns a symbol."""
    idx = list(plt)
    for i in idx:
        offs[i] = 0
    top = max(offs, default=0)
    for i in idx:
        offs[i] = _NO_NAME
    return len(idx) == len(offs) or top < strtab_len


def source_stamp(entry: ElfEntry) -> int:
    """CRC-32 of what ``entry``'s table is built from besides its build-id: the binary's size
    and the separate debug file found for it (path and size, or none). The build-id alone
    does not decide it: ``strip``, ``objcopy`` and ``patchelf`` keep the build-id and change
    the symbols (a stripped copy must not get its unstripped twin's table, nor the reverse),
    and a debug file may be installed, removed or repaired later; each of those changes a
    size. Cost: one stat of the debug file (its path is found once per entry anyway)."""
    dbg = entry.debug_path()
    dsize = -1
    if dbg is not None:
        try:
            dsize = os.stat(dbg).st_size
        except OSError:
            pass
    return zlib.crc32(f"{entry.size}:{dbg}:{dsize}".encode("utf-8", "surrogateescape"))


def _stamp_of(source: int) -> int:
    return _code_stamp() << 32 | (source & 0xFFFFFFFF)


def encode_symbol_table(table: SymbolTable, build_id: bytes, source: int) -> list[bytes] | None:
    """``table`` (as ``load_symbol_table`` returned it, before any lookup) as the parts of a
    ``.sym`` file, or None if it cannot be one (over the bounds, a name that cannot be
    encoded, or decoded names that are not PLT entries'). Cost: O(n) bulk copies + O(PLT)."""
    n, offs = len(table.starts), table._offs
    extras = array("I")
    names: list[str] = []
    for kind, d in ((0, table._named), (_EXTRA_RAW, table._plt)):
        for i, name in d.items():
            if not 0 <= i < min(n, _EXTRA_RAW) or offs[i] != _NO_NAME:
                return None  # a name decoded by a lookup, or not load_symbol_table's table
            extras.append(i | kind)
            names.append(name)
    if len(table._named.keys() | table._plt.keys()) != len(names):
        return None  # one slot named twice
    try:
        blob = b"".join(s.encode("utf-8", "surrogateescape") + b"\0" for s in names)
    except UnicodeEncodeError:
        return None
    if blob.count(0) != len(names):
        return None  # a name with a NUL would split in two
    strtab = table._strtab
    body = [build_id, table.starts.tobytes(), table.ends.tobytes(), offs.tobytes(),
            extras.tobytes(), blob, strtab]  # fmt: skip
    if _SYM_FILE.size + sum(map(len, body)) > MAX_SYM_FILE or len(strtab) >= _NO_NAME:
        return None
    # what decode_symbol_table will check, so that no file is written only to be refused
    if not _names_in_range(array("I", offs), (x & ~_EXTRA_RAW for x in extras), len(strtab)):
        return None
    crc = 0
    for part in body:
        crc = zlib.crc32(part, crc)
    head = _SYM_FILE.pack(SYM_FILE_MAGIC, SYM_FILE_VERSION, 0, _stamp_of(source),
                          len(build_id), n, len(names), len(blob), len(strtab), crc)  # fmt: skip
    return [head, *body]


def decode_symbol_table(data: bytes, build_id: bytes, source: int) -> SymbolTable:
    """The table a ``.sym`` file holds, after checking everything a lookup relies on; raises
    ``_BadFile`` ("corrupt": truncated, damaged, another binary's, inconsistent; "stale":
    another layout version, other code, another ``source_stamp``). Checked: header, exact total
    size, CRC-32, build-id, stamps; that each extra names a distinct PLT slot (offset
    ``_NO_NAME``) and every other offset is inside the string table, so ``name`` has a name
    for every index. Not re-checked: the order of starts (in Python ~2 ms more for cc1's 27k
    symbols, which load in ~2 ms), since a misordered table can only misname
    (bisect and fastpath.c's fp_sym_region stay in bounds on any order) and damage is what
    the CRC catches. Cost: one CRC pass, four ``array.frombytes``, one ``max`` over the
    offsets (~0.7 ms for 27k symbols) and O(PLT) dict inserts."""
    if len(data) < _SYM_FILE.size:
        raise _BadFile("corrupt", "short header")
    (magic, version, _flags, stamp, bid_len, n, m, names_len, strtab_len,
     crc) = _SYM_FILE.unpack_from(data, 0)  # fmt: skip
    if magic != SYM_FILE_MAGIC:
        raise _BadFile("corrupt", "magic")
    if version != SYM_FILE_VERSION:
        raise _BadFile("stale", f"version {version}")
    o_bid = _SYM_FILE.size
    o_starts = o_bid + bid_len
    o_ends = o_starts + 8 * n
    o_offs = o_ends + 8 * n
    o_extras = o_offs + 4 * n
    o_names = o_extras + 4 * m
    o_strtab = o_names + names_len
    if o_strtab + strtab_len != len(data):
        raise _BadFile("corrupt", "size")
    mv = memoryview(data)
    if zlib.crc32(mv[o_bid:]) != crc:
        raise _BadFile("corrupt", "checksum")
    if data[o_bid:o_starts] != build_id:
        raise _BadFile("corrupt", "build-id")
    if stamp != _stamp_of(source):
        raise _BadFile("stale", "code, binary or debug file")
    if strtab_len >= _NO_NAME:
        raise _BadFile("corrupt", "string table size")
    starts, ends, offs, extras = array("Q"), array("Q"), array("I"), array("I")
    starts.frombytes(mv[o_starts:o_ends])
    ends.frombytes(mv[o_ends:o_offs])
    offs.frombytes(mv[o_offs:o_extras])
    extras.frombytes(mv[o_extras:o_names])
    names = data[o_names:o_strtab].split(b"\0")
    if len(names) != m + 1 or names[m]:
        raise _BadFile("corrupt", "extra names")
    named: dict[int, str] = {}
    plt: dict[int, str] = {}
    for x, raw in zip(extras, names, strict=False):
        i = x & ~_EXTRA_RAW
        if i >= n or offs[i] != _NO_NAME:
            raise _BadFile("corrupt", "extra index")
        (plt if x & _EXTRA_RAW else named)[i] = raw.decode("utf-8", "surrogateescape")
    slots = named.keys() | plt.keys()
    if len(slots) != m:
        raise _BadFile("corrupt", "duplicate extra")
    # any other offset >= strtab_len would be a name outside the string table, or a
    # _NO_NAME slot without a name
    if not _names_in_range(offs, slots, strtab_len):
        raise _BadFile("corrupt", "name offset")
    return SymbolTable._columns(starts, ends, offs, data[o_strtab:], named, plt)


class SymbolStore:
    """Finished symbol tables on disk, one file per build-id: ``<cache_dir>/<hex>.sym``; an
    ``ElfCache`` ``symbol_factory``. A table read back answers every lookup and name exactly
    as the ``load_symbol_table`` it was saved from (tests/test_symcache.py).

    ``stats``: ``hits`` (read from disk), ``misses`` (built, then written), ``corrupt`` and
    ``stale`` (a file not used, removed, rebuilt and rewritten; see ``decode_symbol_table``),
    ``no_build_id`` (built, not persisted), ``write_errors``, ``unsaved`` (a table over the
    bounds). Binaries without a build-id are never persisted: nothing else identifies the
    content. Not thread-safe (the ElfCache's owner calls it).

    Cost of a hit: open + fstat + read of ~20 B per symbol + the string table, one CRC, a few
    ``array.frombytes``, one ``max`` (measured: libc with its debug file ~0.5 ms against ~5 ms
    to build, cc1 ~2-9 ms against ~20 ms)."""

    def __init__(self, cache_dir: str | os.PathLike[str], *,
                 max_file_bytes: int = MAX_SYM_FILE) -> None:  # fmt: skip
        self.cache_dir = os.fspath(cache_dir)
        os.makedirs(self.cache_dir, exist_ok=True)
        self.max_file_bytes = min(max_file_bytes, MAX_SYM_FILE)
        self.stats: dict[str, int] = dict.fromkeys(_SYM_STATS, 0)

    def path_for(self, build_id: bytes) -> str:
        return os.path.join(self.cache_dir, build_id.hex() + ".sym")

    def __call__(self, entry: ElfEntry) -> SymbolTable:
        """``entry``'s table: from its file if that is valid, else built (ElfError raised as by
        ``load_symbol_table``, nothing written) and written."""
        build_id = entry.build_id
        if not build_id:
            self.stats["no_build_id"] += 1
            return load_symbol_table(entry)
        source = source_stamp(entry)
        path = self.path_for(build_id)
        try:
            data = read_cache_file(path, self.max_file_bytes)
            if data is not None:
                table = decode_symbol_table(data, build_id, source)
                self.stats["hits"] += 1
                return table
        except (CacheFileError, _BadFile) as e:
            self.stats[e.reason if isinstance(e, _BadFile) else "corrupt"] += 1
            discard_cache_file(path)
        table = load_symbol_table(entry)
        self.stats["misses"] += 1
        parts = encode_symbol_table(table, build_id, source)
        if parts is None or sum(map(len, parts)) > self.max_file_bytes:
            self.stats["unsaved"] += 1
        elif not write_cache_file(path, parts):
            self.stats["write_errors"] += 1
        return table


# --------------------------------------------------------------------------- kernel


@dataclass(frozen=True, slots=True)
class KernelSymbol:
    name: str
    offset: int
    module: str | None  # None for the kernel image ("[kernel.kallsyms]")


# One kallsyms line: ``ADDR TYPE NAME`` plus ``\t[MODULE]`` for module symbols
# (kernel/kallsyms.c s_show). The reference parser; Kallsyms uses the native one
# (symtab.c unw_kallsyms_parse, same grammar), ~20x faster on the ~200k lines of a real kernel.
_KALLSYMS_TEXT = re.compile(r"^([0-9a-fA-F]+) [tTwW] (\S+)(?:[ \t]+\[([^\]\s]+)\])?[ \t]*$", re.M)


def parse_kallsyms(text: str) -> list[tuple[int, str, str | None]]:
    """``ADDR TYPE NAME [MODULE]`` lines -> sorted (addr, name, module) for text symbols
    (types t/T/w/W), as perf's kallsyms__parse + symbol filtering keep them."""
    out = [(int(a, 16), n, m or None) for a, n, m in _KALLSYMS_TEXT.findall(text)]
    out.sort(key=lambda t: t[0])
    return out


# unw_ksym (unwcore.h), 32 bytes: u64 addr, end; u32 name_off, mod_off; u16 name_len, mod_len;
# u32 line
_KSYM = 32


class Kallsyms:
    """Kernel text symbols. Ends follow symbols__fixup_end(is_kallsyms=True): up to the next
    symbol, except across the kernel/module boundary, where a symbol gets one page. Parsed
    natively into address columns; a name is decoded from the kept text on first lookup."""

    def __init__(self, text: str | bytes) -> None:
        from .._unwcore import ffi, lib

        raw = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
        cap = raw.count(b"\n") + 1
        out = ffi.new("struct unw_ksym[]", cap)
        n = int(lib.unw_kallsyms_parse(raw, len(raw), out, cap))
        words = memoryview(ffi.buffer(out, n * _KSYM)).cast("Q")
        self.starts = array("Q", words[0::4].tobytes())
        self.ends = array("Q", words[1::4].tobytes())
        u32 = words.cast("B").cast("I")
        self._name_off = array("I", u32[4::8].tobytes())
        self._mod_off = array("I", u32[5::8].tobytes())
        self._lens = array("I", u32[6::8].tobytes())  # name_len | mod_len << 16
        self._text = raw
        self._names: dict[int, KernelSymbol] = {}

    @classmethod
    def load(cls, proc_root: str = "/proc") -> Kallsyms:
        with open(f"{proc_root}/kallsyms", "rb") as f:
            return cls(f.read())

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def usable(self) -> bool:
        """False when kptr_restrict zeroed every address (not root)."""
        return bool(self.starts) and self.starts[-1] != 0

    def _symbol(self, i: int) -> KernelSymbol:
        """Symbol ``i`` at offset 0, decoded once."""
        ks = self._names.get(i)
        if ks is None:
            t = self._text
            name_off, mod_off, lens = self._name_off[i], self._mod_off[i], self._lens[i]
            name_len, mod_len = lens & 0xFFFF, lens >> 16
            name = t[name_off : name_off + name_len].decode("utf-8", "replace")
            mod = t[mod_off : mod_off + mod_len].decode("utf-8", "replace") if mod_len else None
            ks = self._names[i] = KernelSymbol(name, 0, mod)
        return ks

    def lookup(self, addr: int) -> KernelSymbol | None:
        i = bisect_right(self.starts, addr) - 1
        if i < 0 or addr >= self.ends[i] or self.starts[i] == 0:
            return None
        ks = self._symbol(i)
        return KernelSymbol(ks.name, addr - self.starts[i], ks.module)


# --------------------------------------------------------------------------- JIT maps


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


# --------------------------------------------------------------------------- facade


class Symbolizer:
    """Names for frames: binaries through their cache entries, kernel through kallsyms, JIT
    through perf maps. ``tmp_dir`` and ``proc_root`` are injectable for tests."""

    def __init__(self, *, proc_root: str = "/proc", tmp_dir: str = "/tmp") -> None:
        self.proc_root = proc_root
        self.tmp_dir = tmp_dir
        self._kallsyms: Kallsyms | None = None
        self._kallsyms_loading: threading.Thread | None = None
        self._kallsyms_loaded: list[Kallsyms] = []
        self._perf_maps: dict[int, PerfMap] = {}

    def preload_kernel(self) -> None:
        """Start reading and parsing kallsyms in a thread, for a caller that will name kernel
        frames soon and has other work meanwhile (a replay: ~0.05 s of /proc/kallsyms reads,
        which the kernel generates, and a native parse, both without the GIL). ``kernel``
        waits for it. Idempotent."""
        if self._kallsyms is not None or self._kallsyms_loading is not None:
            return
        t = threading.Thread(target=self._preload, name="unwindd-kallsyms", daemon=True)
        self._kallsyms_loading = t
        t.start()

    def _load_kallsyms(self) -> Kallsyms:
        try:
            return Kallsyms.load(self.proc_root)
        except OSError:
            return Kallsyms("")

    def _preload(self) -> None:
        """The preload thread: its result, or nothing (``kernel`` then loads on its own
        thread, where any error surfaces as it would without a preload)."""
        try:
            self._kallsyms_loaded.append(self._load_kallsyms())
        except Exception:  # reported by kernel()'s own load
            pass

    def symbolize(self, entry: ElfEntry, vaddr: int) -> tuple[str, int] | None:
        return self.table(entry).lookup(vaddr)

    def table(self, entry: ElfEntry) -> SymbolTable:
        """The table ``symbolize`` searches for ``entry`` (fastreplay hands its arrays to C)."""
        return entry.symbols()

    def kernel(self, addr: int) -> KernelSymbol | None:
        if self._kallsyms is None:
            t = self._kallsyms_loading
            if t is not None:
                t.join()
                self._kallsyms_loading = None
            # the thread's result, or (no thread, or it died) a load here
            self._kallsyms = (self._kallsyms_loaded.pop() if self._kallsyms_loaded
                              else self._load_kallsyms())  # fmt: skip
        return self._kallsyms.lookup(addr)

    def jit(self, pid: int, addr: int) -> tuple[str, int] | None:
        pm = self._perf_maps.get(pid)
        if pm is None:
            pm = self._perf_maps[pid] = PerfMap(f"{self.tmp_dir}/perf-{pid}.map")
        return pm.lookup(addr)

    def forget_pid(self, pid: int) -> None:
        self._perf_maps.pop(pid, None)
