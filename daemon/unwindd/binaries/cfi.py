"""Compiled CFI unwind tables (``CfiTable``) and their on-disk store (``CfiStore``).

Invariants:
- A ``CfiTable`` is an immutable ``bytes`` blob built by the native compiler
  (``cffi_build/cfitable.c``; layout drawn in ``cffi_build/unwcore.h``) and checked by
  ``unw_table_validate`` before any native code trusts it (at compile, at cache load). One table
  serves every process that maps the binary: rows are keyed by ELF virtual address, and only the
  unwinder's per-mapping load bias differs.
- Bad CFI never raises: the compiler skips what it cannot read and counts it in ``errors``
  (names in ``ERROR_NAMES``). ``CfiError`` is raised only for files that are not ELF64 x86_64
  images or cannot be read at all.
- The ELF parse here reads only the ELF header and section headers, every offset/size checked
  against the file size, section count capped; section data are handed to C as offsets into one
  read-only mmap (zero copies; ``.debug_frame`` is copied only when SHF_COMPRESSED).
- ``CfiStore`` files are ``FILE_HEADER`` (64 bytes: magic, version, arch, blob size, CRC-32C)
  + blob. A table loaded from one is used in place: the file is mapped read-only and shared
  (cachefiles' ``map_cache_file``) and the native unwinder reads the mapped bytes, so the
  table is page cache (``mapped``), not private heap; a freshly compiled table is written,
  then mapped back the same way (the heap copy is dropped). Any mismatch (header, size, CRC,
  ``unw_table_validate``) discards the file (counted in ``stats["corrupt"]``) and recompiles;
  never a crash. Without a store (no usable cache dir) or without a build-id a table stays a
  heap ``bytes`` blob. Atomic writes (temporary file + ``os.replace``) are cachefiles'
  ``write_cache_file``, shared with ``symstore.SymbolStore``.

Cost: compiling is O(E log E + R) for E FDEs and R rows (bench/bench_cfi.py measures it);
``lookup`` is O(log R); ``rows`` decodes the blob in Python, O(R), for tests and debugging.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from enum import IntEnum
from typing import Any

from ..lightdc import dataclass, replace
from ..unwcore import check, ffi, lib
from .cachefiles import (
    CacheFileError,
    blob_file_head,
    discard_cache_file,
    map_blob_file,
    release_table,
    write_cache_file,
)

__all__ = [
    "CFI_STORE_RESULTS",
    "ERROR_NAMES",
    "CfaKind",
    "CfiError",
    "CfiRow",
    "CfiStore",
    "CfiTable",
    "RegKind",
]

ARCH_X86_64 = int(lib.UNW_ARCH_X86_64)
EM_X86_64 = 62  # ELF gABI e_machine

# Order = UNW_ERR_* in unwcore.h.
ERROR_NAMES: tuple[str, ...] = (
    "bad_cie", "bad_fde", "bad_op", "unsupported_expr", "state_stack", "cap", "overlap",
    "bad_encoding", "range", "bad_eh_frame_hdr", "empty_fde",
)  # fmt: skip

MAX_SECTIONS = 1 << 16
MAX_DEBUG_FRAME = 256 << 20  # decompressed .debug_frame cap: bounded memory for absurd headers


class CfiError(Exception):
    """The file is not an ELF image we can compile CFI for (or could not be read)."""


class CfaKind(IntEnum):
    NONE = int(lib.UNW_CFA_NONE)  # no FDE covers the pc: frame-pointer fallback
    REG_OFF = int(lib.UNW_CFA_REG_OFF)
    DEREF = int(lib.UNW_CFA_DEREF)
    PLT = int(lib.UNW_CFA_PLT)
    SIGFRAME = int(lib.UNW_CFA_SIGFRAME)
    UNSUPPORTED = int(lib.UNW_CFA_UNSUPPORTED)


class RegKind(IntEnum):
    SAME = int(lib.UNW_REG_SAME)
    UNDEF = int(lib.UNW_REG_UNDEF)
    AT_CFA = int(lib.UNW_REG_AT_CFA)
    VAL_CFA = int(lib.UNW_REG_VAL_CFA)
    AT_REG = int(lib.UNW_REG_AT_REG)
    VAL_REG = int(lib.UNW_REG_VAL_REG)
    REGISTER = int(lib.UNW_REG_REGISTER)
    UNSUPPORTED = int(lib.UNW_REG_UNSUPPORTED)


# DWARF columns of unw_rule.regs slots 2.. for x86_64 (cffi_build/arch.c ARCH_X86_64.saved; slot 0
# is rbp, slot 1 the return address): the other callee-saved registers, System V AMD64 ABI 3.2.1.
SAVED_X86_64: tuple[int, ...] = (3, 12, 13, 14, 15)  # rbx r12 r13 r14 r15
NSAVED = int(lib.UNW_NSAVED)

SavedRule = tuple[int, "RegKind", int, int]  # (DWARF column, kind, reg, off)


@dataclass(frozen=True, slots=True)
class CfiRow:
    """One row: valid from ``pc`` (ELF vaddr) to the next row's pc. ``cfa_reg`` is a DWARF
    register number (for ``CfaKind.PLT``, the DW_OP_lit threshold); ``frameptr``/``ra`` are the
    rules for the frame pointer (rbp) and return address columns; ``saved`` those of the other
    callee-saved columns (``SAVED_X86_64`` order), as (column, kind, reg, off)."""

    pc: int
    cfa_kind: CfaKind
    cfa_reg: int
    cfa_off: int
    frameptr_kind: RegKind
    frameptr_reg: int
    frameptr_off: int
    ra_kind: RegKind
    ra_reg: int
    ra_off: int
    signal: bool
    saved: tuple[SavedRule, ...] = ()

    def __repr__(self) -> str:
        other = "".join(
            f", r{c}={k.name}({r},{o})" for c, k, r, o in self.saved if k != RegKind.SAME
        )
        return (
            f"CfiRow(pc={self.pc:#x}, cfa={self.cfa_kind.name}({self.cfa_reg},{self.cfa_off}), "
            f"frameptr={self.frameptr_kind.name}({self.frameptr_reg},{self.frameptr_off}), "
            f"ra={self.ra_kind.name}({self.ra_reg},{self.ra_off}){other}"
            f"{', signal' if self.signal else ''})"
        )


# struct unw_rule (unwcore.h): i32 cfa_off; u8 cfa_kind, cfa_reg, flags, pad; then UNW_NSAVED
# struct unw_regrule { i16 off; u8 kind; u8 reg; }.
_RULE = struct.Struct("<iBBBB" + "hBB" * NSAVED)
# struct unw_table_hdr: magic, version, arch, idx_width, nrows, nrules, base, nfdes, npages, errors
_HDR = struct.Struct("<IHBBIIQII16I")
assert _HDR.size == int(lib.UNW_HDR_SIZE) and _RULE.size == ffi.sizeof("struct unw_rule")


def _make_row(
    pc: int, cfa_off: int, cfa_kind: int, cfa_reg: int, flags: int, regs: list[tuple[int, int, int]]
) -> CfiRow:
    """A row from a rule's fields; ``regs`` = (off, kind, reg) per slot."""
    (fo, fk, fr), (ro, rk, rr) = regs[0], regs[1]
    saved = tuple(
        (col, RegKind(k), r, o) for col, (o, k, r) in zip(SAVED_X86_64, regs[2:], strict=False)
    )
    return CfiRow(pc, CfaKind(cfa_kind), cfa_reg, cfa_off, RegKind(fk), fr, fo, RegKind(rk), rr,
                  ro, bool(flags & lib.UNW_RULE_SIGNAL), saved)  # fmt: skip


def _row_from_rule(pc: int, r: Any) -> CfiRow:
    regs = [(r.regs[i].off, r.regs[i].kind, r.regs[i].reg) for i in range(NSAVED)]
    return _make_row(pc, r.cfa_off, r.cfa_kind, r.cfa_reg, r.flags, regs)


# --------------------------------------------------------------------------- minimal ELF64 parse

# ELF gABI: Elf64_Ehdr fields after e_ident, and Elf64_Shdr.
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_CHDR = struct.Struct("<IIQQ")  # Elf64_Chdr: ch_type, reserved, ch_size, ch_addralign
SHT_NOBITS = 8
SHF_COMPRESSED = 0x800
ELFCOMPRESS_ZLIB = 1


@dataclass(frozen=True, slots=True)
class _Sec:
    """An ELF section's place in the file and in memory (from its section header)."""

    offset: int
    size: int
    addr: int
    flags: int


def _sections(buf: Any, size: int) -> tuple[int, dict[str, _Sec]]:
    """(e_machine, {name: section}) from an ELF64 little-endian image; CfiError if it is not."""
    if size < _EHDR.size or bytes(buf[:4]) != b"\x7fELF":
        raise CfiError("not an ELF file")
    ident, _t, machine, _v, _e, _ph, shoff, _f, _eh, _phes, _phn, shes, shnum, shstrndx = (
        _EHDR.unpack_from(buf, 0)
    )
    if ident[4] != 2 or ident[5] != 1:
        raise CfiError("only ELF64 little-endian is supported")
    if shoff == 0 or shes < _SHDR.size or shoff > size:
        return machine, {}
    if shnum == 0 or shstrndx == 0xFFFF:  # gABI extended numbering: the values live in shdr 0
        if shoff + _SHDR.size > size:
            raise CfiError("truncated section headers")
        s0 = _SHDR.unpack_from(buf, shoff)
        shnum = shnum or s0[5]
        shstrndx = s0[6] if shstrndx == 0xFFFF else shstrndx
    if shnum > MAX_SECTIONS or shoff + shnum * shes > size:
        raise CfiError("truncated or absurd section headers")
    hdrs = [_SHDR.unpack_from(buf, shoff + i * shes) for i in range(shnum)]
    if shstrndx >= shnum:
        raise CfiError("bad e_shstrndx")
    _n, _ty, _fl, _a, stroff, strsize, *_ = hdrs[shstrndx]
    if stroff + strsize > size:
        raise CfiError("truncated .shstrtab")
    strtab = bytes(buf[stroff : stroff + strsize])
    out: dict[str, _Sec] = {}
    for name_off, sh_type, flags, addr, off, sz, *_ in hdrs:
        if name_off >= len(strtab):
            continue
        name = strtab[name_off : strtab.find(b"\0", name_off)].decode("latin-1")
        if sh_type == SHT_NOBITS or off + sz > size or name in out:
            continue
        out[name] = _Sec(off, sz, addr, flags)
    return machine, out


def _section_bytes(buf: Any, sec: _Sec) -> bytes | None:
    """Section contents, decompressed if SHF_COMPRESSED (zlib only; zstd: None)."""
    raw = buf[sec.offset : sec.offset + sec.size]
    if not sec.flags & SHF_COMPRESSED:
        return bytes(raw)
    if sec.size < _CHDR.size:
        return None
    ch_type, _r, ch_size, _al = _CHDR.unpack_from(raw, 0)
    if ch_type != ELFCOMPRESS_ZLIB or ch_size > MAX_DEBUG_FRAME:
        return None
    d = zlib.decompressobj()
    try:
        data = d.decompress(bytes(raw[_CHDR.size :]), ch_size)
    except zlib.error:
        return None
    return data if len(data) == ch_size else None


class _Mapped:
    """A read-only mmap of a file (or an empty buffer for an empty file); a context manager."""

    def __init__(self, path: str) -> None:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.mm: mmap.mmap | None = (
                    mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
                )
        except (OSError, ValueError) as e:
            raise CfiError(f"cannot read {path}: {e}") from e
        self.buf: Any = self.mm if self.mm is not None else b""
        self.size = size

    def __enter__(self) -> _Mapped:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.mm is not None:
            self.mm.close()


# --------------------------------------------------------------------------- the table


class CfiTable:
    """A compiled unwind table for one binary (immutable; share it)."""

    __slots__ = ("_blob", "_cbuf", "errors", "mapped", "nbytes", "nfdes", "nrows")

    _blob: Any  # bytes, or the cffi buffer over a mapped cache file's table
    mapped: bool
    nbytes: int
    nrows: int
    nfdes: int
    errors: dict[str, int]

    def __init__(self, blob: Any, *, mapped: bool = False) -> None:
        """Wrap a blob (from the compiler or a cache file); CfiError if it is not a valid table.
        ``mapped``: ``blob`` is the cffi buffer over a cache file's mapping
        (``cachefiles.map_cache_file``), used in place; else it is copied into a ``bytes``."""
        rc = lib.unw_table_validate(ffi.from_buffer(blob), len(blob)) if len(blob) else -1
        if rc != 0:
            raise CfiError(f"invalid CFI table blob (check {rc})")
        self.mapped = mapped and not isinstance(blob, (bytes, bytearray, memoryview))
        self._blob = blob if self.mapped else bytes(blob)
        h = _HDR.unpack_from(self._blob, 0)
        self.nbytes = len(self._blob)
        self.nrows = h[4]
        self.nfdes = h[7]
        self.errors = {n: c for n, c in zip(ERROR_NAMES, h[9:], strict=False) if c}
        self._cbuf: Any = None

    @property
    def blob(self) -> bytes:
        """The table's bytes (a copy, for a mapped table)."""
        return self._blob if isinstance(self._blob, bytes) else bytes(self._blob)

    @property
    def cbuf(self) -> Any:
        """The blob as one ``uint8_t[]`` cdata, made once and shared by every native address
        space that maps this binary, so a new mapping generation of a process adds no copy
        of it."""
        if self._cbuf is None:
            self._cbuf = ffi.from_buffer("uint8_t[]", self._blob)
        return self._cbuf

    # -- construction

    @classmethod
    def from_elf(cls, path: str, debug_path: str | None = None) -> CfiTable:
        """Compile ``.eh_frame`` (found through ``.eh_frame_hdr`` when present) of ``path``, then
        ``.debug_frame`` of ``path`` (or, if it has none, of ``debug_path``) for the pcs
        ``.eh_frame`` does not cover."""
        with _Mapped(path) as m:
            machine, secs = _sections(m.buf, m.size)
            if machine != EM_X86_64:
                raise CfiError(f"unsupported e_machine {machine} (x86_64 only for now)")
            dbg = secs.get(".debug_frame")
            debug_frame = _section_bytes(m.buf, dbg) if dbg else None
            if debug_frame is None and debug_path is not None:
                with _Mapped(debug_path) as dm:
                    _dmach, dsecs = _sections(dm.buf, dm.size)
                    ddbg = dsecs.get(".debug_frame")
                    debug_frame = _section_bytes(dm.buf, ddbg) if ddbg else None
            eh, hdr = secs.get(".eh_frame"), secs.get(".eh_frame_hdr")
            text, got = secs.get(".text"), secs.get(".got")
            return cls._compile(
                m.buf,
                m.size,
                eh_frame=(eh.offset, eh.size, eh.addr) if eh else None,
                eh_frame_hdr=(hdr.offset, hdr.size, hdr.addr) if hdr else None,
                debug_frame=debug_frame,
                text_addr=text.addr if text else 0,
                data_addr=got.addr if got else 0,
            )

    @classmethod
    def from_sections(
        cls,
        eh_frame: bytes = b"",
        eh_frame_addr: int = 0,
        *,
        eh_frame_hdr: bytes | None = None,
        eh_frame_hdr_addr: int = 0,
        debug_frame: bytes | None = None,
        text_addr: int = 0,
        data_addr: int = 0,
    ) -> CfiTable:
        """Compile raw section bytes (byte-level tests, and callers that parsed the ELF)."""
        img = eh_frame + (eh_frame_hdr or b"")
        return cls._compile(
            img,
            len(img),
            eh_frame=(0, len(eh_frame), eh_frame_addr) if eh_frame else None,
            eh_frame_hdr=(len(eh_frame), len(eh_frame_hdr), eh_frame_hdr_addr)
            if eh_frame_hdr
            else None,
            debug_frame=debug_frame,
            text_addr=text_addr,
            data_addr=data_addr,
        )

    @classmethod
    def _compile(
        cls,
        img: Any,
        img_len: int,
        *,
        eh_frame: tuple[int, int, int] | None,
        eh_frame_hdr: tuple[int, int, int] | None,
        debug_frame: bytes | None,
        text_addr: int,
        data_addr: int,
    ) -> CfiTable:
        sec = ffi.new("struct unw_sections *")
        if eh_frame:
            sec.eh_frame_off, sec.eh_frame_size, sec.eh_frame_addr = eh_frame
        if eh_frame_hdr:
            sec.eh_hdr_off, sec.eh_hdr_size, sec.eh_hdr_addr = eh_frame_hdr
        sec.text_addr = text_addr
        sec.data_addr = data_addr
        out = ffi.new("uint8_t **")
        out_len = ffi.new("uint64_t *")
        img_c = ffi.from_buffer(img) if img_len else ffi.NULL
        dbg_c = ffi.from_buffer(debug_frame) if debug_frame else ffi.NULL
        rc = lib.unw_cfi_compile(
            ARCH_X86_64, img_c, img_len, sec, dbg_c, len(debug_frame or b""), out, out_len
        )
        check(rc, "unw_cfi_compile")
        try:
            blob = ffi.buffer(out[0], out_len[0])[:]
        finally:
            lib.unw_free(out[0])
        return cls(blob)

    # -- queries

    def rows(self) -> list[CfiRow]:
        """Every row, decoded in Python straight from the blob (layout: unwcore.h)."""
        h = _HDR.unpack_from(self._blob, 0)
        width, nrows, nrules, base, npages = h[3], h[4], h[5], h[6], h[8]
        mv = memoryview(self._blob)
        pf_off = _HDR.size
        lo_off = pf_off + 4 * (npages + 1)
        idx_off = lo_off + 2 * nrows
        roff = (idx_off + width * nrows + 3) & ~3
        page_first = mv[pf_off:lo_off].cast("I")
        lo = mv[lo_off:idx_off].cast("H")
        idx = mv[idx_off : idx_off + width * nrows].cast("H" if width == 2 else "I")
        rules = []
        for f in _RULE.iter_unpack(self._blob[roff : roff + nrules * _RULE.size]):
            regs = [(f[5 + 3 * k], f[6 + 3 * k], f[7 + 3 * k]) for k in range(NSAVED)]
            rules.append(_make_row(0, f[0], f[1], f[2], f[3], regs))
        out: list[CfiRow] = []
        for page in range(npages):
            top = base + (page << 16)
            for i in range(page_first[page], page_first[page + 1]):
                out.append(replace(rules[idx[i]], pc=top + lo[i]))
        return out

    def lookup(self, pc: int) -> CfiRow | None:
        """The row covering ELF vaddr ``pc``; None below the first row or where no FDE covers it
        (a ``CfaKind.NONE`` row)."""
        if not 0 <= pc < 1 << 64:
            return None
        rule = ffi.new("struct unw_rule *")
        start = ffi.new("uint64_t *")
        if lib.unw_table_lookup(ffi.from_buffer(self._blob), pc, rule, start) < 0:
            return None
        if rule.cfa_kind == lib.UNW_CFA_NONE:
            return None
        return _row_from_rule(int(start[0]), rule)

    def __repr__(self) -> str:
        return (
            f"CfiTable(rows={self.nrows}, fdes={self.nfdes}, bytes={self.nbytes}, "
            f"errors={self.errors})"
        )


# --------------------------------------------------------------------------- persistence

# "UWCFI" file header: magic[8], format version u32, arch u32, blob size u64, blob CRC-32C u32
# (cachefiles.checksum), padded to 64 bytes so that the blob, used in place from the mapped
# file, starts 64-byte aligned (a page-aligned mapping + 64) like a malloc'd one.
FILE_MAGIC = b"UWCFI\x00\x00\x00"
FILE_VERSION = 3  # 3: the checksum is CRC-32C, not zlib's CRC-32
FILE_HEADER = struct.Struct("<8sIIQI36x")
assert FILE_HEADER.size == 64
MAX_CACHE_FILE = 1 << 30


# ``CfiStore.stats`` keys: loaded from disk, compiled (and written), file discarded, compiled
# but not persisted (no build-id), write failed, compiled and written but kept on the heap
# (the file could not be mapped back).
CFI_STORE_RESULTS = ("hits", "compiled", "corrupt", "no_build_id", "write_errors", "unmapped")


class CfiStore:
    """Compiled tables on disk, one file per build-id: ``<cache_dir>/<build-id hex>.cfi``.

    ``stats`` counts each of ``CFI_STORE_RESULTS``. Not thread-safe."""

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self.cache_dir = os.fspath(cache_dir)
        os.makedirs(self.cache_dir, exist_ok=True)
        self.stats: dict[str, int] = dict.fromkeys(CFI_STORE_RESULTS, 0)

    def path_for(self, build_id: bytes) -> str:
        return os.path.join(self.cache_dir, build_id.hex() + ".cfi")

    def has(self, build_id: bytes | None) -> bool:
        """A table for build_id is on disk (one stat; whether it loads is get_or_compile's
        business): loading it is a read and a check, not a compile."""
        return build_id is not None and os.path.exists(self.path_for(build_id))

    def lookup(self, build_id: bytes) -> CfiTable | None:
        """The table stored for ``build_id`` (a hit), or None: what ``get_or_compile``
        returns without compiling, for a caller that has not found the debug file yet."""
        table = self._load(self.path_for(build_id)) if build_id else None
        if table is not None:
            self.stats["hits"] += 1
        return table

    def get_or_compile(
        self, build_id: bytes | None, elf_path: str, debug_path: str | None = None
    ) -> CfiTable:
        if not build_id:
            self.stats["no_build_id"] += 1
            return CfiTable.from_elf(elf_path, debug_path)
        path = self.path_for(build_id)
        table = self._load(path)
        if table is not None:
            self.stats["hits"] += 1
            return table
        table = CfiTable.from_elf(elf_path, debug_path)
        self.stats["compiled"] += 1
        if self._save(path, table):
            # use the written file in place; the compiled heap copy goes with this frame
            mapped = self._load(path)
            if mapped is not None and mapped._blob == table.blob:
                release_table(mapped._blob)  # the comparison read all of it
                return mapped
            self.stats["unmapped"] += 1
        return table

    def _load(self, path: str) -> CfiTable | None:
        """The table in the file at ``path``, mapped and used in place; None if there is no
        file, or it was refused (counted in ``corrupt``, removed)."""
        try:
            got = map_blob_file(path, FILE_HEADER, MAX_CACHE_FILE, hot=True)
            if got is None:
                return None
            (magic, version, arch), blob = got
            if magic != FILE_MAGIC or version != FILE_VERSION or arch != ARCH_X86_64:
                raise CfiError("magic/version/arch")
            table = CfiTable(blob, mapped=True)
            release_table(blob)  # the checks read all of it; the unwinder reads a few pages
            return table
        except (CfiError, CacheFileError):
            self.stats["corrupt"] += 1
            discard_cache_file(path)
            return None

    def _save(self, path: str, table: CfiTable) -> bool:
        blob = table.blob
        head = blob_file_head(FILE_HEADER, (FILE_MAGIC, FILE_VERSION, ARCH_X86_64), blob)
        if not write_cache_file(path, (head, blob)):
            self.stats["write_errors"] += 1
            return False
        return True
