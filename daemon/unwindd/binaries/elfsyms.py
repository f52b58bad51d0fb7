"""A binary's symbol table from its ELF symbols by perf's rules (perf 6.1,
tools/perf/util/symbol-elf.c dso__load_sym, symbol.c), so names match ``perf script -F sym``.

Rules:
- Source: the first ``.symtab`` of the separate debug file (elf.find_debug_file), then of the
  binary; else the binary's ``.dynsym``.
- Kept: STT_FUNC/STT_GNU_IFUNC with a name and a defined section (elf_sym__is_function), and
  named STT_NOTYPE labels (not ABS/UNDEF, not hidden/internal) in a section whose name contains
  "text" (elf_sym__is_label, elf_sec__is_text); the section must be SHF_ALLOC (a debug file's
  NOBITS headers keep names and flags). Versioned aliases (``cfree@GLIBC_2.2.5``) stay literal.
- symbols__fixup_end: a zero-size symbol extends to the next start, the last to the next page
  boundary + 4 KiB. Then symbols__fixup_duplicate: at one start choose_best_symbol keeps the
  non-zero size, the non-weak, the global, fewer leading underscores, the longer name (as
  printed), else the first in table order.
- PLT (x86_64): ``<name>@plt`` per ``.rela.plt`` entry in GOT-slot order over ``.plt.sec``, else
  ``.plt`` after its 16-byte header (dso__synthesize_plt_symbols); added after the fixups,
  dropped where an ELF symbol starts. ``load_symbol_table_reference`` states it all in Python.

Cost: one native pass (symtab.c: filter, sort, fixups), O(n log n); names stay string-table
offsets but in duplicate groups only demangled names decide.
"""

from __future__ import annotations

import os
import struct
from array import array
from bisect import bisect_left
from collections.abc import Callable
from itertools import pairwise
from types import ModuleType
from typing import Protocol, TypeVar

from ..lightdc import dataclass
from .demangle import demangle, demangle_full, demangle_rust_legacy
from .elf import ElfError, ElfReader
from .symtab import NO_NAME, SymbolTable

__all__ = [
    "SymbolSource",
    "content_modules",
    "load_symbol_table",
    "load_symbol_table_reference",
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


class SymbolSource(Protocol):
    """What a table is built from (an ELF cache entry): a reader of the validated binary and
    the path of its separate debug file, if any."""

    def reader(self) -> ElfReader: ...

    def debug_path(self) -> str | None: ...


def content_modules() -> list[ModuleType]:
    """The modules whose code decides what ``load_symbol_table`` returns: this one, symtab,
    demangle, elf (the reader and the debug-file search) and the native scan (the extension
    module, not its binding ``unwcore``: its file holds the scan's code). A persisted table is
    stamped with them (symstore)."""
    import sys

    from ..unwcore import native
    from . import demangle, elf, symtab

    return [sys.modules[__name__], symtab, demangle, elf, native]


@dataclass(slots=True)
class _Sym:
    """One symbol while a table is built: [start, end), binding, name, symtab index."""

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
        from ..unwcore import ffi, lib

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
        demangling more than needed (demangling is most of a C++ library's load): members
        that lose on size, weak or global drop out on raw fields; names that
        do not start with ``_Z`` take no constructor-twin parse (Rust v0 ``_R`` names are
        demangled to be ranked); and constructor/destructor
        variants that differ only in that code (``C1``/``C2``/``C3``, ``D0``/``D1``/``D2``:
        see ``_ctor_twin``) print the same name, so one demangle stands for all of them, and
        none when they are all that is left of the group; other names with the same full
        demangled text (template classes' variants) share it without the perf-form step."""
        from ..unwcore import ffi

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
        shown = demangle(name)  # (Rust v0 ``_R`` names demangle too)
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
    dynamic-symbol names + ``@plt`` (the caller demangles them when needed). Relocations are
    taken in GOT-slot order (x86 puts IRELATIVE relocs last; their symbol index is 0, hence
    perf's bare ``@plt``)."""
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


def _debug_reader_do(entry: SymbolSource, fn: Callable[[ElfReader], _T]) -> _T | None:
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


def load_symbol_table(entry: SymbolSource) -> SymbolTable:
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
                no.append(NO_NAME)
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


def load_symbol_table_reference(entry: SymbolSource) -> SymbolTable:
    """``load_symbol_table`` in pure Python, every name demangled up front (far slower):
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
