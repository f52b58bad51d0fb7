"""Symbolization: (binary, ELF vaddr) -> (name, offset), separate from unwinding.

Rules (perf 6.1, tools/perf/util/symbol-elf.c dso__load_sym, symbol.c), so names match
``perf script -F sym``:
- Source: the first ``.symtab`` among the separate debug file (build-id dir or
  ``.gnu_debuglink``, see elfcache.find_debug_file) and the binary itself; else the binary's
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

Cost: a table is built once per binary (O(n log n), n = symbols), held by the ELF cache entry
and shared by every pid; lookups are one bisect. Kernel symbols: ``/proc/kallsyms`` parsed once.
JIT maps (``/tmp/perf-<pid>.map``) re-parsed only when their (size, mtime) changes.
"""

from __future__ import annotations

import os
import re
import struct
from array import array
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise

from .demangle import demangle
from .elfcache import ElfEntry, ElfError, ElfReader

__all__ = [
    "Kallsyms",
    "PerfMap",
    "Symbol",
    "SymbolTable",
    "Symbolizer",
    "load_symbol_table",
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


@dataclass(frozen=True, slots=True)
class Symbol:
    name: str
    start: int
    end: int

    def __repr__(self) -> str:
        return f"Symbol({self.name!r}, {self.start:#x}-{self.end:#x})"


class SymbolTable:
    """Sorted, non-duplicated symbols of one binary, in ELF vaddr space."""

    __slots__ = ("ends", "names", "nbytes", "starts")

    def __init__(self, symbols: Iterable[tuple[int, int, str]]) -> None:
        syms = sorted(symbols)
        self.starts = array("Q", (s for s, _, _ in syms))
        self.ends = array("Q", (e for _, e, _ in syms))
        self.names = [n for _, _, n in syms]
        self.nbytes = 16 * len(syms) + sum(49 + len(n) for n in self.names)

    @classmethod
    def empty(cls) -> SymbolTable:
        return cls(())

    def __len__(self) -> int:
        return len(self.names)

    def lookup(self, addr: int) -> tuple[str, int] | None:
        i = bisect_right(self.starts, addr) - 1
        if i < 0:
            return None
        start, end = self.starts[i], self.ends[i]
        if addr < end or addr == start:
            return self.names[i], addr - start
        return None

    def symbols(self) -> list[Symbol]:
        return [Symbol(n, s, e) for s, e, n in zip(self.starts, self.ends, self.names, strict=True)]


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
    symsec = next((s for s in reader.sections if s.type == sec_type), None)
    if symsec is None or symsec.size < _SYM.size:
        return None
    if symsec.size // _SYM.size > MAX_SYMBOLS:
        raise ElfError("too_many_symbols")
    secs = reader.sections
    if not 0 < symsec.link < len(secs):
        raise ElfError("bad_strtab_link")
    strtab = reader.section_data(secs[symsec.link])
    data = reader.section_data(symsec)
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


def _plt_symbols(reader: ElfReader, base_index: int) -> list[_Sym]:
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
                name = demangle(dynstr[st_name:end].decode("utf-8", "surrogateescape"))
        out.append(_Sym(addr, addr + entry, STB_GLOBAL, f"{name}@plt", base_index + 1 + i))
        addr += entry
    return out


def load_symbol_table(entry: ElfEntry) -> SymbolTable:
    """Build ``entry``'s table by the module rules. Raises ElfError on malformed input."""
    binary = entry.reader()
    syms: list[_Sym] | None = None
    dbg = entry.debug_path()
    if dbg is not None:
        try:
            fd = os.open(dbg, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                syms = _read_symbols(ElfReader(fd, os.fstat(fd).st_size), SHT_SYMTAB)
            except ElfError:
                syms = None  # a broken debug file: fall back to the binary
            finally:
                os.close(fd)
    if not syms:
        syms = _read_symbols(binary, SHT_SYMTAB)
    if not syms:
        syms = _read_symbols(binary, SHT_DYNSYM) or []
    table = _fixup(syms)
    # perf inserts PLT symbols after the fixups, so they are neither extended nor deduplicated
    plt = [(s.start, s.end, s.name) for s in _plt_symbols(binary, len(syms))]
    if plt:
        taken = {s for s, _, _ in table}
        table += [p for p in plt if p[0] not in taken]
    return SymbolTable(table)


# --------------------------------------------------------------------------- kernel


@dataclass(frozen=True, slots=True)
class KernelSymbol:
    name: str
    offset: int
    module: str | None  # None for the kernel image ("[kernel.kallsyms]")


# One kallsyms line: ``ADDR TYPE NAME`` plus ``\t[MODULE]`` for module symbols
# (kernel/kallsyms.c s_show). Matched in one regex pass: ~10x faster than splitting 100k lines.
_KALLSYMS_TEXT = re.compile(r"^([0-9a-fA-F]+) [tTwW] (\S+)(?:[ \t]+\[([^\]\s]+)\])?[ \t]*$", re.M)


def parse_kallsyms(text: str) -> list[tuple[int, str, str | None]]:
    """``ADDR TYPE NAME [MODULE]`` lines -> sorted (addr, name, module) for text symbols
    (types t/T/w/W), as perf's kallsyms__parse + symbol filtering keep them."""
    out = [(int(a, 16), n, m or None) for a, n, m in _KALLSYMS_TEXT.findall(text)]
    out.sort(key=lambda t: t[0])
    return out


class Kallsyms:
    """Kernel text symbols. Ends follow symbols__fixup_end(is_kallsyms=True): up to the next
    symbol, except across the kernel/module boundary, where a symbol gets one page."""

    def __init__(self, text: str) -> None:
        syms = parse_kallsyms(text)
        self.starts = array("Q", (a for a, _, _ in syms))
        self.names = [n for _, n, _ in syms]
        self.modules = [m for _, _, m in syms]
        ends = array("Q", self.starts)
        for i in range(len(syms) - 1):
            if (self.modules[i] is None) != (self.modules[i + 1] is None):
                ends[i] = (self.starts[i] + _PAGE) // _PAGE * _PAGE + _PAGE
            else:
                ends[i] = self.starts[i + 1]
        if syms:
            ends[-1] = (self.starts[-1] + _PAGE - 1) // _PAGE * _PAGE + _PAGE
        self.ends = ends

    @classmethod
    def load(cls, proc_root: str = "/proc") -> Kallsyms:
        with open(f"{proc_root}/kallsyms", encoding="utf-8", errors="replace") as f:
            return cls(f.read())

    def __len__(self) -> int:
        return len(self.names)

    @property
    def usable(self) -> bool:
        """False when kptr_restrict zeroed every address (not root)."""
        return bool(self.starts) and self.starts[-1] != 0

    def lookup(self, addr: int) -> KernelSymbol | None:
        i = bisect_right(self.starts, addr) - 1
        if i < 0 or addr >= self.ends[i] or self.starts[i] == 0:
            return None
        return KernelSymbol(self.names[i], addr - self.starts[i], self.modules[i])


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
        self._perf_maps: dict[int, PerfMap] = {}

    def symbolize(self, entry: ElfEntry, vaddr: int) -> tuple[str, int] | None:
        return entry.symbols().lookup(vaddr)

    def kernel(self, addr: int) -> KernelSymbol | None:
        if self._kallsyms is None:
            try:
                self._kallsyms = Kallsyms.load(self.proc_root)
            except OSError:
                self._kallsyms = Kallsyms("")
        return self._kallsyms.lookup(addr)

    def jit(self, pid: int, addr: int) -> tuple[str, int] | None:
        pm = self._perf_maps.get(pid)
        if pm is None:
            pm = self._perf_maps[pid] = PerfMap(f"{self.tmp_dir}/perf-{pid}.map")
        return pm.lookup(addr)

    def forget_pid(self, pid: int) -> None:
        self._perf_maps.pop(pid, None)
