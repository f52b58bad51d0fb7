"""Reading 64-bit little-endian ELF files (include/uapi/linux/elf.h layouts), and finding a
binary's separate debug file.

Rules:
- ``ElfReader`` reads an open fd with ``os.pread`` only, every offset and size checked against
  the file size and every count capped (``MAX_PHDRS``, ``MAX_SECTIONS``, ``MAX_NOTES_BYTES``):
  malformed or hostile input costs O(headers) time and memory and raises ``ElfError`` (its
  ``reason`` is a metric label), never anything else. Extended numbering (``PN_XNUM``,
  ``SHN_XINDEX``, e_shnum 0) is read from section header 0.
- The build-id is the NT_GNU_BUILD_ID note of the PT_NOTE segments, else of the SHT_NOTE
  sections (debug files have no PT_NOTE).
- ``find_debug_file``: ``<root>/.build-id/xx/rest.debug`` carrying the same build-id, else the
  ``.gnu_debuglink`` name beside the binary, in its ``.debug/`` and under ``<root>`` (gdb's
  order; perf's dso__read_binary_type_filename), accepted on a matching build-id or, without
  build-ids, on the link's CRC-32. Only regular files within a size bound are read.

Cost: a reader reads the ELF and program headers (two preads); section headers, notes and the
debug link are read on first use (a few KiB); a CRC check reads the debug file once.
"""

from __future__ import annotations

import os
import stat
import struct
import zlib
from collections.abc import Callable, Sequence

from ..lightdc import dataclass

__all__ = [
    "ElfError",
    "ElfReader",
    "Section",
    "Segment",
    "find_debug_file",
]

# include/uapi/linux/elf.h, Elf64_Ehdr (after e_ident[16]):
#   u16 e_type; u16 e_machine; u32 e_version; u64 e_entry; u64 e_phoff; u64 e_shoff;
#   u32 e_flags; u16 e_ehsize; u16 e_phentsize; u16 e_phnum; u16 e_shentsize; u16 e_shnum;
#   u16 e_shstrndx;                                                       (64 bytes in all)
_EHDR = struct.Struct("<HHIQQQIHHHHHH")
# Elf64_Phdr: u32 p_type, p_flags; u64 p_offset, p_vaddr, p_paddr, p_filesz, p_memsz, p_align
_PHDR = struct.Struct("<IIQQQQQQ")
# Elf64_Shdr: u32 sh_name, sh_type; u64 sh_flags, sh_addr, sh_offset, sh_size;
#             u32 sh_link, sh_info; u64 sh_addralign, sh_entsize
_SHDR = struct.Struct("<IIQQQQIIQQ")
# Elf64_Nhdr: u32 n_namesz, n_descsz, n_type; name and desc each padded to 4 bytes
_NHDR = struct.Struct("<III")

ET_EXEC = 2
ET_DYN = 3
PT_LOAD = 1
PT_NOTE = 4
PF_X = 1
SHT_NOBITS = 8
SHT_NOTE = 7
SHN_XINDEX = 0xFFFF
PN_XNUM = 0xFFFF
NT_GNU_BUILD_ID = 3

MAX_PHDRS = 4096  # real binaries have < 20; bounds a hostile e_phnum
MAX_SECTIONS = 1 << 16  # real binaries have < 100 (< 70k only with -ffunction-sections .o)
MAX_NOTES_BYTES = 1 << 16  # build-id notes are tiny; never read more note data than this
MAX_BUILD_ID = 64
PAGE = 4096


class ElfError(Exception):
    """A file that is not an ELF we can read; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Segment:
    """One PT_LOAD program header."""

    vaddr: int
    offset: int
    filesz: int
    memsz: int
    flags: int

    def __repr__(self) -> str:
        return (
            f"Segment(vaddr={self.vaddr:#x}, offset={self.offset:#x}, filesz={self.filesz:#x}, "
            f"memsz={self.memsz:#x}, flags={self.flags:#x})"
        )


@dataclass(frozen=True, slots=True)
class Section:
    """One ELF section header (Elf64_Shdr), its name resolved."""

    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int
    info: int
    entsize: int

    def __repr__(self) -> str:
        return (
            f"Section({self.name!r}, type={self.type}, addr={self.addr:#x}, "
            f"offset={self.offset:#x}, size={self.size:#x})"
        )


class ElfReader:
    """Bounds-checked reader of a 64-bit little-endian ELF on an open fd.

    Every read is ``os.pread`` of a range checked against ``size``; counts are capped. Sections
    are read on first use. Raises only ``ElfError``."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        ident = self.read(0, 64)
        if ident[:4] != b"\x7fELF":
            raise ElfError("bad_magic")
        if ident[4] != 2:
            raise ElfError("unsupported_class", f"EI_CLASS={ident[4]}")
        if ident[5] != 1:
            raise ElfError("unsupported_data", f"EI_DATA={ident[5]}")
        (self.type, self.machine, _ver, self.entry, phoff, shoff, _flags, _ehsize, phentsize,
         phnum, shentsize, shnum, shstrndx) = _EHDR.unpack_from(ident, 16)  # fmt: skip
        self._phoff, self._phentsize, self._phnum = phoff, phentsize, phnum
        self._shoff, self._shentsize = shoff, shentsize
        self._shnum, self._shstrndx = shnum, shstrndx
        self._sections: tuple[Section, ...] | None = None
        self._by_name: dict[str, Section] | None = None
        if phnum and phentsize < _PHDR.size:
            raise ElfError("bad_phentsize")
        self.segments_all = self._read_phdrs()

    def read(self, off: int, n: int) -> bytes:
        if off < 0 or n < 0 or off + n > self.size:
            raise ElfError("out_of_bounds", f"{off:#x}+{n:#x} > {self.size:#x}")
        try:
            data = os.pread(self.fd, n, off)
        except OSError as e:
            raise ElfError("read_failed", str(e)) from None
        if len(data) != n:
            raise ElfError("short_read")
        return data

    def _first_shdr(self) -> tuple[int, ...] | None:
        if not self._shoff or self._shentsize < _SHDR.size:
            return None
        return _SHDR.unpack(self.read(self._shoff, _SHDR.size))

    def _read_phdrs(self) -> tuple[tuple[int, int, int, int, int, int, int], ...]:
        phnum = self._phnum
        if phnum == PN_XNUM:  # extended numbering: real count in shdr[0].sh_info
            first = self._first_shdr()
            phnum = first[7] if first else 0
        if phnum > MAX_PHDRS:
            raise ElfError("too_many_phdrs", str(phnum))
        if phnum == 0:
            return ()
        raw = self.read(self._phoff, phnum * self._phentsize)
        out = []
        for i in range(phnum):
            p_type, p_flags, off, vaddr, _paddr, filesz, memsz, _align = _PHDR.unpack_from(
                raw, i * self._phentsize
            )
            out.append((p_type, p_flags, off, vaddr, filesz, memsz, _align))
        return tuple(out)

    def load_segments(self) -> tuple[Segment, ...]:
        segs = []
        for p_type, flags, off, vaddr, filesz, memsz, _ in self.segments_all:
            if p_type != PT_LOAD:
                continue
            if filesz > memsz or off + filesz > self.size:
                raise ElfError("bad_segment", f"offset={off:#x} filesz={filesz:#x}")
            segs.append(Segment(vaddr, off, filesz, memsz, flags))
        return tuple(segs)

    # -- sections

    @property
    def sections(self) -> tuple[Section, ...]:
        if self._sections is None:
            self._sections = self._read_sections()
        return self._sections

    def _read_sections(self) -> tuple[Section, ...]:
        if not self._shoff:
            return ()
        if self._shentsize < _SHDR.size:
            raise ElfError("bad_shentsize")
        shnum, strndx = self._shnum, self._shstrndx
        if shnum == 0 or strndx == SHN_XINDEX:
            first = self._first_shdr()
            if first is None:
                return ()
            if shnum == 0:
                shnum = first[5]  # sh_size holds the real count
            if strndx == SHN_XINDEX:
                strndx = first[6]  # sh_link holds the real index
        if shnum > MAX_SECTIONS:
            raise ElfError("too_many_sections", str(shnum))
        raw = self.read(self._shoff, shnum * self._shentsize)
        hdrs = [_SHDR.unpack_from(raw, i * self._shentsize) for i in range(shnum)]
        names = b""
        if 0 < strndx < shnum:
            s = hdrs[strndx]
            if s[1] != SHT_NOBITS:
                names = self.read(s[4], s[5])
        out = []
        for sh_name, sh_type, flags, addr, off, size, link, info, _al, entsize in hdrs:
            if sh_type != SHT_NOBITS and off + size > self.size:
                raise ElfError("bad_section", f"offset={off:#x} size={size:#x}")
            name = _cstr(names, sh_name) if sh_name < len(names) else ""
            out.append(Section(name, sh_type, flags, addr, off, size, link, info, entsize))
        return tuple(out)

    def section(self, name: str) -> Section | None:
        if self._by_name is None:
            by: dict[str, Section] = {}
            for s in self.sections:
                by.setdefault(s.name, s)
            self._by_name = by
        return self._by_name.get(name)

    def section_data(self, sec: Section) -> bytes:
        if sec.type == SHT_NOBITS:
            return b""
        return self.read(sec.offset, sec.size)

    # -- notes

    def build_id(self) -> bytes | None:
        """NT_GNU_BUILD_ID from PT_NOTE segments, else SHT_NOTE sections (debug files)."""
        ranges = [(off, filesz) for t, _f, off, _v, filesz, _m, _a in self.segments_all
                  if t == PT_NOTE]  # fmt: skip
        if not ranges:
            ranges = [(s.offset, s.size) for s in self.sections if s.type == SHT_NOTE]
        budget = MAX_NOTES_BYTES
        for off, size in ranges:
            size = min(size, budget)
            budget -= size
            if size <= 0:
                break
            bid = _find_build_id(self.read(off, size))
            if bid is not None:
                return bid
        return None

    def debuglink(self) -> tuple[str, int] | None:
        """``.gnu_debuglink``: (file name, CRC32 of the debug file)."""
        sec = self.section(".gnu_debuglink")
        if sec is None or sec.size > 4096:
            return None
        data = self.section_data(sec)
        nul = data.find(b"\0")
        if nul <= 0:
            return None
        crc_off = (nul + 4) & ~3
        if crc_off + 4 > len(data):
            return None
        name = data[:nul].decode("utf-8", "surrogateescape")
        if "/" in name:
            return None
        return name, struct.unpack_from("<I", data, crc_off)[0]


def _cstr(buf: bytes, off: int) -> str:
    end = buf.find(b"\0", off)
    if end < 0:
        end = len(buf)
    return buf[off:end].decode("utf-8", "surrogateescape")


def _find_build_id(notes: bytes) -> bytes | None:
    off = 0
    n = len(notes)
    while off + _NHDR.size <= n:
        namesz, descsz, ntype = _NHDR.unpack_from(notes, off)
        name_off = off + _NHDR.size
        desc_off = name_off + ((namesz + 3) & ~3)
        end = desc_off + ((descsz + 3) & ~3)
        if end > n or end <= off:
            return None
        if ntype == NT_GNU_BUILD_ID and notes[name_off : name_off + namesz] == b"GNU\0":
            if 0 < descsz <= MAX_BUILD_ID:
                return notes[desc_off : desc_off + descsz]
            return None
        off = end
    return None


def find_debug_file(filename: str, build_id: bytes | None, reader: Callable[[], ElfReader],
                    roots: Sequence[str], max_size: int) -> str | None:  # fmt: skip
    """The separate debug file of the binary mapped as ``filename`` (see the module rules), or
    None. ``reader`` opens the binary; it is called (and may raise ``ElfError``) only when no
    build-id file matched. Candidates over ``max_size`` bytes are refused."""
    bid = build_id
    if bid:
        h = bid.hex()
        for root in roots:
            cand = f"{root}/.build-id/{h[:2]}/{h[2:]}.debug"
            if _debug_matches(cand, bid, None, max_size):
                return cand
    link = reader().debuglink()
    if link is None:
        return None
    name, crc = link
    d = os.path.dirname(filename.removesuffix(" (deleted)"))
    cands = [f"{d}/{name}", f"{d}/.debug/{name}"] + [f"{r}{d}/{name}" for r in roots]
    for cand in cands:
        if _debug_matches(cand, bid, crc, max_size):
            return cand
    return None


def _debug_matches(path: str, bid: bytes | None, crc: int | None, max_size: int) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_size:
            return False
        if bid:
            return ElfReader(fd, st.st_size).build_id() == bid
        if crc is None:
            return False
        c = 0
        off = 0
        while chunk := os.pread(fd, 1 << 20, off):
            c = zlib.crc32(chunk, c)
            off += len(chunk)
        return c == crc
    except (ElfError, OSError):
        return False
    finally:
        os.close(fd)
