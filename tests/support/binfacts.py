"""What a binary itself says about one address: the function symbols that cover it (read with
pyelftools), and whether a call instruction ends just after it (decoded from the file's bytes).
The perf oracle asks this where perf has no answer of its own (a frame perf prints as
``[unknown]``, or a stack perf cut short), so that such frames are judged against the file,
not waved through; the end-to-end tests ask it of every caller frame (stacks.py).

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
- A caller frame's address is its return address - 1 (perf's too), so the byte after it in
  the file follows a ``call``: the decoder knows the x86-64 forms gcc and clang emit (``e8
  rel32``, ``ff /2``). Over every caller frame of a machine-wide recording it held for all
  14,055, and at the return address itself for 109.
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
        else:  # perf symbols__fixup_end: up to the next symbol that starts later; the last
            # one to the page after its start's, roundup(start, 4096) + 4096, as
            # elfsyms._fixup does (e.g. _fini, a zero-size FUNC of crti.o, last in .fini)
            j = bisect.bisect_right(starts, start, i + 1)
            ends.append(starts[j] if j < len(starts) else -(-start // 4096) * 4096 + 4096)
    return _Binary(segs, starts, tuple(ends), tuple(n for _, _, n in syms))


def vaddr(path: str, off: int) -> int | None:
    """File offset ``off`` of ``path`` as the virtual address its PT_LOAD segment gives it (the
    address addr2line and DWARF speak of); None outside every segment or for a non-ELF path."""
    b = _load(path)
    return None if b is None else b.vaddr(off)


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


@cache
def _file_bytes(path: str) -> bytes:
    return Path(path).read_bytes()


def _modrm_len(code: bytes, i: int) -> int:
    """Bytes of the ModRM at ``code[i]`` with its SIB and displacement (Intel SDM vol. 2,
    tables 2-2 and 2-3, 64-bit mode: mod 00 rm 101 is rip + disp32)."""
    modrm = code[i]
    mod, rm = modrm >> 6, modrm & 7
    if mod == 3:
        return 1
    n = 1
    if rm == 4:
        n += 1
        if mod == 0 and code[i + 1] & 7 == 5:  # SIB base 101 without a base: disp32
            n += 4
    elif mod == 0 and rm == 5:
        n += 4
    return n + (0, 1, 4)[mod]


def call_ends_at(code: bytes, end: int) -> bool:
    """Whether an x86-64 call instruction ends right before ``code[end]``: ``e8 rel32``, or
    ``ff /2`` (call r/m64, any ModRM form; a REX or notrack prefix before it changes nothing
    after it)."""
    if end >= 5 and code[end - 5] == 0xE8:
        return True
    for k in range(2, 8):  # ff + ModRM [+ SIB] [+ disp32]: 2 to 7 bytes
        s = end - k
        if s < 0:
            break
        if code[s] == 0xFF and code[s + 1] >> 3 & 7 == 2 and _modrm_len(code, s + 1) == k - 1:
            return True
    return False


def follows_call(path: str, off: int) -> bool:
    """Whether the instruction ending at file offset ``off + 1`` of ``path`` is a call: a
    caller frame's address is its return address - 1, so a real caller frame sits one byte
    before a call's end. A path that is no regular file (``[unknown]``, ``[vdso]``) has none."""
    if not path.startswith("/") or not Path(path).is_file():
        return False
    code = _file_bytes(path)
    return 0 < off + 1 <= len(code) and call_ends_at(code, off + 1)
