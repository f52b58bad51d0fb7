"""What a binary itself says about one address, read with pyelftools: the function symbols
that cover it, and whether a call instruction ends just after it. The perf oracle asks this
where perf has no answer of its own (a frame perf prints as ``[unknown]``, or a stack perf cut
short), so that such frames are judged against the file, not waved through.

Invariants:
- Addresses are file offsets, the form perf prints for user frames of a DWARF callchain
  (``ip - map.start + map.pgoff``, oracle.py); they become virtual addresses through the
  PT_LOAD segment holding them, as the ELF spec (gABI, "Program Header") lays segments out.
- A file's symbols are its ``.symtab`` and ``.dynsym`` plus the ``.symtab`` of its separate
  debug file (``/usr/lib/debug/.build-id/xx/rest.debug``), which is where perf also finds
  libc's local symbols. Functions (STT_FUNC, STT_GNU_IFUNC) and named STT_NOTYPE labels in
  executable sections count, as perf's symbol-elf.c ``elf_sym__is_function`` / ``is_label``
  take them; a zero-sized symbol reaches to the next symbol's start, as perf's
  ``symbols__fixup_end`` makes it.
- Every file is parsed once per process (``functools.cache``); a path that is not a readable
  ELF file (``[unknown]``, ``[vdso]``, a vanished file) has no symbols and no call sites.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import NoteSection, SymbolTableSection

DEBUG_ROOT = Path("/usr/lib/debug/.build-id")
_FUNC_TYPES = {"STT_FUNC", "STT_GNU_IFUNC"}
SHF_EXECINSTR = 0x4


@dataclass(frozen=True, slots=True)
class _Segment:
    offset: int
    vaddr: int
    filesz: int


@dataclass(frozen=True, slots=True)
class _Binary:
    segments: tuple[_Segment, ...]
    starts: tuple[int, ...]  # sorted symbol starts
    ends: tuple[int, ...]  # each symbol's end, after the zero-size fixup
    names: tuple[str, ...]
    text: bytes  # the executable PT_LOAD bytes, for call-site checks
    text_offset: int  # the file offset of text[0]

    def vaddr(self, off: int) -> int | None:
        for s in self.segments:
            if s.offset <= off < s.offset + s.filesz:
                return off - s.offset + s.vaddr
        return None


def _symbols(elf: ELFFile) -> list[tuple[int, int, str]]:
    out: list[tuple[int, int, str]] = []
    for sec in elf.iter_sections():
        if not isinstance(sec, SymbolTableSection):
            continue
        for sym in sec.iter_symbols():
            typ = sym["st_info"]["type"]
            shndx = sym["st_shndx"]
            if not sym.name or shndx == "SHN_UNDEF" or sym["st_value"] == 0:
                continue
            if typ not in _FUNC_TYPES:
                if typ != "STT_NOTYPE" or not isinstance(shndx, int) or sym.name.startswith("."):
                    continue
                if not elf.get_section(shndx)["sh_flags"] & SHF_EXECINSTR:
                    continue
            out.append((sym["st_value"], sym["st_size"], sym.name))
    return out


def _build_id(elf: ELFFile) -> str | None:
    for sec in elf.iter_sections():
        if isinstance(sec, NoteSection):
            for note in sec.iter_notes():
                if note["n_type"] == "NT_GNU_BUILD_ID":
                    return str(note["n_desc"])
    return None


@cache
def _load(path: str) -> _Binary | None:
    p = Path(path)
    if not path.startswith("/") or not p.is_file():
        return None
    try:
        with p.open("rb") as f:
            elf = ELFFile(f)
            segs = tuple(
                _Segment(s["p_offset"], s["p_vaddr"], s["p_filesz"])
                for s in elf.iter_segments()
                if s["p_type"] == "PT_LOAD"
            )
            syms = _symbols(elf)
            bid = _build_id(elf)
            x = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD" and s["p_flags"] & 1]
            text, text_off = (x[0].data(), x[0]["p_offset"]) if x else (b"", 0)
    except (OSError, ELFError):
        return None
    if bid is not None:
        dbg = DEBUG_ROOT / bid[:2] / f"{bid[2:]}.debug"
        if dbg.is_file():
            try:
                with dbg.open("rb") as f:
                    syms += _symbols(ELFFile(f))
            except (OSError, ELFError):
                pass
    syms.sort()
    starts = tuple(s for s, _, _ in syms)
    ends: list[int] = []
    for i, (start, size, _) in enumerate(syms):
        if size:
            ends.append(start + size)
        else:  # perf symbols__fixup_end: up to the next symbol that starts later
            j = bisect.bisect_right(starts, start, i + 1)
            ends.append(starts[j] if j < len(starts) else start + 1)
    return _Binary(segs, starts, tuple(ends), tuple(n for _, _, n in syms), text, text_off)


def names_at(path: str, off: int) -> frozenset[str]:
    """Every function symbol of ``path`` (or its debug file) covering file offset ``off``."""
    b = _load(path)
    if b is None:
        return frozenset()
    va = b.vaddr(off)
    if va is None:
        return frozenset()
    hi = bisect.bisect_right(b.starts, va)
    return frozenset(b.names[i] for i in range(hi) if b.ends[i] > va)


def _modrm_len(code: bytes, i: int) -> int | None:
    """Bytes taken by a ModRM byte at ``code[i]`` and what it implies (SIB, displacement), per
    the Intel SDM vol. 2 "ModR/M and SIB Bytes" tables for 64-bit mode."""
    if i >= len(code):
        return None
    modrm = code[i]
    mod, rm = modrm >> 6, modrm & 7
    n = 1
    if mod != 3 and rm == 4:
        if i + 1 >= len(code):
            return None
        n += 1
        if mod == 0 and code[i + 1] & 7 == 5:
            n += 4
    if mod == 1:
        n += 1
    elif mod == 2 or (mod == 0 and rm == 5):
        n += 4
    return n


def follows_call(path: str, off: int) -> bool:
    """Whether the instruction ending at ``off + 1`` in ``path`` is a call: a caller frame's
    address is its return address - 1, so a real caller frame sits one byte before a call's
    end. Recognises ``e8 rel32`` and ``ff /2`` (indirect, with optional REX and ``notrack``
    prefixes), the forms gcc and clang emit for x86_64."""
    b = _load(path)
    if b is None:
        return False
    end = off + 1 - b.text_offset
    code = b.text
    if not 0 < end <= len(code):
        return False
    if end >= 5 and code[end - 5] == 0xE8:
        return True
    for n in range(2, 10):
        i = end - n
        if i < 0:
            break
        j = i
        while j < end and (code[j] == 0x3E or 0x40 <= code[j] <= 0x4F):
            j += 1
        if j + 1 < end and code[j] == 0xFF and (code[j + 1] >> 3) & 7 == 2:
            if j + 1 + (_modrm_len(code, j + 1) or 99) == end:
                return True
    return False
