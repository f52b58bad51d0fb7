"""Source lines and inline chains of a binary: its DWARF compiled once (``dwarfline.c``
``unw_srcline_compile``) into a ``SrcLineTable``, looked up by ELF vaddr with two bisects.

Invariants:
- A table is one position-independent blob (layout at the top of cffi_build/dwarfline.c):
  line rows, inline segments, nodes (subprograms and inlined subroutines), files, strings.
  ``SrcLineTable`` checks every index in it once (``_BadTable``) before any lookup trusts it,
  so a lookup never raises on a table it accepted, and follows at most ``MAX_LEVELS`` parents.
- ``lookup(vaddr)`` is the addr2line -i view (binutils dwarf2.c): levels innermost first, each
  (function name or None, file or None, line); the first is the code at the pc, each next the
  call site of the one before, the last the function the chain sits in (its DWARF name; the
  frame's symbol comes from the symbol table). Empty when neither a line nor a function
  covers the pc. Names are demangled as ``demangle.py`` demangles symbols. ``chain(vaddr)``
  is the same with each level's function's DW_AT_decl_file and DW_AT_decl_line (where its
  source starts: pprof's Function.filename and start_line; None and 0 when DWARF says not).
- The DWARF is the separate debug file's when it has ``.debug_info``, else the binary's own
  (perf and addr2line read the same); SHF_COMPRESSED sections are inflated here (zlib; other
  types, or sizes past ``MAX_SECTION``, count ``compressed`` and read as absent).
- ``SrcLineStore`` persists tables by build-id like ``symstore.SymbolStore`` (stamped with
  the code and the binary/debug-file sizes, CRC-checked, atomic writes through cachefiles).

Cost: a compile is O(DWARF bytes + rows log rows) in C (libc's debug file: well under a second);
a load from disk is one read, one CRC and a few ``array.frombytes``; a lookup two bisects and a
walk of at most ``MAX_LEVELS`` parents; names decoded once per string.
"""

from __future__ import annotations

import os
import struct
import zlib
from array import array
from bisect import bisect_right
from typing import Any

from .cachefiles import CacheFileError, discard_cache_file, read_cache_file, write_cache_file
from .demangle import demangle
from .elf import ElfError, ElfReader

__all__ = [
    "DWARF_SECTIONS",
    "ERROR_NAMES",
    "MAX_LEVELS",
    "SRC_STORE_RESULTS",
    "DeclLevel",
    "Level",
    "SrcLineCache",
    "SrcLineStore",
    "SrcLineTable",
    "compile_sections",
    "compile_srclines",
    "read_dwarf_sections",
]

# unw_dwarf_sections' fields, by section name
DWARF_SECTIONS = {".debug_info": "info", ".debug_abbrev": "abbrev", ".debug_line": "line",
                  ".debug_str": "str", ".debug_line_str": "line_str",
                  ".debug_str_offsets": "str_offsets", ".debug_addr": "addr",
                  ".debug_ranges": "ranges", ".debug_rnglists": "rnglists"}  # fmt: skip
# UNW_SL_ERR_* names, same order (unwcore.h)
ERROR_NAMES = ("bad_unit", "bad_abbrev", "bad_die", "bad_line_program", "bad_ranges",
               "bad_origin", "cap", "reserved")  # fmt: skip
MAX_LEVELS = 64  # inline depth followed by a lookup (real code: < 20)
MAX_SECTION = 1 << 30  # an inflated section past this is refused (bounded memory)
SHF_COMPRESSED = 0x800
ELFCOMPRESS_ZLIB = 1
_CHDR = struct.Struct("<IIQQ")  # Elf64_Chdr
NONE = 0xFFFFFFFF
SUBPROGRAM = 1

# (function name or None, file or None, line); line 0: unknown
Level = tuple[str | None, str | None, int]
# ... and the level's function's decl file (or None) and decl line (0: unknown)
DeclLevel = tuple[str | None, str | None, int, str | None, int]


class _BadTable(Exception):
    pass


def read_dwarf_sections(path: str, errors: dict[str, int] | None = None) -> dict[str, bytes]:
    """The DWARF sections ``unw_srcline_compile`` reads, from the ELF at ``path``, inflated.
    ElfError if it is not a readable ELF."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise ElfError("open_failed", str(e)) from None
    try:
        rd = ElfReader(fd, os.fstat(fd).st_size)
        out: dict[str, bytes] = {}
        for name in DWARF_SECTIONS:
            sec = rd.section(name)
            if sec is None or not sec.size:
                continue
            data = rd.section_data(sec)
            if sec.flags & SHF_COMPRESSED:
                inflated = _inflate(data)
                if inflated is None:
                    if errors is not None:
                        errors["compressed"] = errors.get("compressed", 0) + 1
                    continue
                data = inflated
            out[name] = data
        return out
    finally:
        os.close(fd)


def _inflate(raw: bytes) -> bytes | None:
    """An SHF_COMPRESSED section's contents (gABI Elf64_Chdr + zlib stream), None if it is
    not zlib, too large or damaged."""
    if len(raw) < _CHDR.size:
        return None
    ch_type, _r, ch_size, _al = _CHDR.unpack_from(raw, 0)
    if ch_type != ELFCOMPRESS_ZLIB or ch_size > MAX_SECTION:
        return None
    d = zlib.decompressobj()
    try:
        data = d.decompress(memoryview(raw)[_CHDR.size :], ch_size)
    except zlib.error:
        return None
    return data if len(data) == ch_size else None


def compile_sections(secs: dict[str, bytes]) -> SrcLineTable:
    """The table of a set of DWARF sections (``read_dwarf_sections``' answer)."""
    from ..unwcore import check, ffi, lib

    s = ffi.new("struct unw_dwarf_sections *")
    keep = []
    for name, field in DWARF_SECTIONS.items():
        data = secs.get(name)
        if data:
            buf = ffi.from_buffer(data)
            keep.append(buf)
            setattr(s, field, buf)
            setattr(s, field + "_len", len(data))
    out = ffi.new("uint8_t **")
    out_len = ffi.new("uint64_t *")
    check(lib.unw_srcline_compile(s, out, out_len), "unw_srcline_compile")
    try:
        blob = ffi.buffer(out[0], out_len[0])[:]
    finally:
        lib.unw_free(out[0])
    return SrcLineTable(blob)


def compile_srclines(elf_path: str, debug_path: str | None = None) -> SrcLineTable:
    """The table of the binary at ``elf_path``: from ``debug_path``'s DWARF when it has
    ``.debug_info``, else from the binary's own. ElfError if the file to read is not an ELF."""
    errors: dict[str, int] = {}
    secs: dict[str, bytes] = {}
    if debug_path is not None:
        try:
            secs = read_dwarf_sections(debug_path, errors)
        except ElfError:
            secs = {}
    if ".debug_info" not in secs:
        secs = read_dwarf_sections(elf_path, errors)
    table = compile_sections(secs)
    for k, v in errors.items():
        table.errors[k] = table.errors.get(k, 0) + v
    return table


_HDR = struct.Struct("<IHHIIIII8II")


class SrcLineTable:
    """One binary's compiled line/inline table (immutable; share it). ``lookup(vaddr)``: the
    levels at an ELF vaddr, innermost first (see the module's invariants)."""

    __slots__ = ("_files", "_kind", "_laddr", "_lfile", "_lno", "_names", "_ndfile",
                 "_ndline", "_nfile", "_nline", "_nname", "_nparent", "_saddr", "_snode",
                 "_strtab", "blob", "errors", "nbytes")  # fmt: skip

    def __init__(self, blob: bytes) -> None:
        if len(blob) < _HDR.size:
            raise _BadTable("short header")
        (magic, version, _pad, nl, ns, nn, nf, strlen, *errs, _p2) = _HDR.unpack_from(blob, 0)
        from ..unwcore import lib

        if magic != lib.UNW_SL_MAGIC or version != lib.UNW_SL_VERSION:
            raise _BadTable("magic/version")
        sizes = (8 * nl, 4 * nl, 4 * nl, 8 * ns, 4 * ns, 4 * nn, 4 * nn, 4 * nn, 4 * nn,
                 4 * nn, 4 * nn, 4 * nn, 4 * nf, strlen)  # fmt: skip
        if _HDR.size + sum(sizes) != len(blob):
            raise _BadTable("size")
        cols: list[array[int]] = []
        o = _HDR.size
        mv = memoryview(blob)
        for size, code in zip(sizes[:-1], "QIIQIIIIIIIII", strict=True):
            a = array(code)
            a.frombytes(mv[o : o + size])
            cols.append(a)
            o += size
        self.blob = blob
        self._strtab = blob[o:]
        (self._laddr, self._lfile, self._lno, self._saddr, self._snode, self._nname,
         self._nfile, self._nline, self._nparent, self._kind, self._ndfile, self._ndline,
         self._files) = cols  # fmt: skip
        # every index a lookup follows is checked here once; the order of addresses is not
        # (a Python pass as costly as the load): bisect stays in bounds on any order, so a
        # misordered table can only misplace a line, and damage is what the file's CRC catches
        if _out_of(self._lfile, nf) or _out_of(self._nfile, nf) or _out_of(self._snode, nn):
            raise _BadTable("file or node index")
        if _out_of(self._ndfile, nf):
            raise _BadTable("file or node index")
        if _out_of(self._nparent, nn) or _out_of(self._nname, strlen):
            raise _BadTable("parent or name index")
        if nf and max(self._files) >= max(strlen, 1):
            raise _BadTable("file name offset")
        if strlen and self._strtab[-1] != 0:
            raise _BadTable("string table")
        self._names: dict[int, str | None] = {NONE: None}
        self.errors = {n: e for n, e in zip(ERROR_NAMES, errs, strict=True) if e}
        self.nbytes = len(blob) + 64

    @property
    def nlines(self) -> int:
        return len(self._laddr)

    @property
    def nnodes(self) -> int:
        return len(self._nname)

    def _str(self, off: int) -> str:
        end = self._strtab.find(b"\0", off)
        return self._strtab[off:end].decode("utf-8", "surrogateescape")

    def _name(self, off: int) -> str | None:
        hit = self._names.get(off, "")
        if hit == "":
            hit = self._names[off] = demangle(self._str(off))
        return hit

    def _file(self, fid: int) -> str | None:
        return None if fid == NONE else self._str(self._files[fid])

    def lookup(self, vaddr: int) -> tuple[Level, ...]:
        """The levels at ``vaddr``, innermost first; () when nothing covers it."""
        return tuple(lv[:3] for lv in self.chain(vaddr))

    def chain(self, vaddr: int) -> tuple[DeclLevel, ...]:
        """``lookup``'s levels, each with its function's decl file and line."""
        i = bisect_right(self._laddr, vaddr) - 1
        fid, line = (self._lfile[i], self._lno[i]) if i >= 0 else (NONE, 0)
        j = bisect_right(self._saddr, vaddr) - 1
        node = self._snode[j] if j >= 0 else NONE
        if fid == NONE and node == NONE:
            return ()
        file = self._file(fid)
        levels: list[DeclLevel] = []
        outer: str | None = None
        dfile: str | None = None
        dline = 0
        kind, parent, nname = self._kind, self._nparent, self._nname
        for _ in range(MAX_LEVELS):
            if node == NONE:
                break
            if kind[node] == SUBPROGRAM:
                outer = self._name(nname[node])
                dfile, dline = self._file(self._ndfile[node]), self._ndline[node]
                break
            levels.append((self._name(nname[node]), file, line, self._file(self._ndfile[node]),
                           self._ndline[node]))  # fmt: skip
            file, line = self._file(self._nfile[node]), self._nline[node]
            node = parent[node]
        levels.append((outer, file, line, dfile, dline))
        return tuple(levels)

    def __repr__(self) -> str:
        return f"SrcLineTable(lines={self.nlines}, nodes={self.nnodes}, bytes={len(self.blob)})"


def _out_of(col: array[int], n: int) -> bool:
    """Whether some value of ``col`` other than NONE is >= n: one native pass over the column
    in place (symtab.c's max-offset scan, which skips one value), as a table can hold
    millions of entries and a Python pass over them costs as much as the rest of the load."""
    if not col:
        return False
    from ..unwcore import ffi, lib

    nskip = ffi.new("uint64_t *")
    top = lib.unw_symtab_max_offset(ffi.from_buffer(col), len(col), NONE, nskip)
    return bool(nskip[0] < len(col) and top >= n)


# ---------------------------------------------------------------------------- persistence

# ".srcl" file: magic, version, stamp (symstore's code stamp << 32 | source stamp), blob
# length, CRC-32 of the blob, then the blob.
FILE_MAGIC = b"UWSRCL\x00\x00"
FILE_VERSION = 2  # 2: nodes carry their function's decl file and line
_FILE = struct.Struct("<8sIQQI4x")
MAX_FILE = 1 << 31
# ``SrcLineStore.stats`` keys
SRC_STORE_RESULTS = ("hits", "compiled", "corrupt", "no_build_id", "write_errors", "errors")


class SrcLineStore:
    """Compiled tables on disk, one file per build-id: ``<cache_dir>/<build-id hex>.srcl``.
    ``get(entry)`` answers a table (empty when the binary has no DWARF or cannot be read;
    read errors count ``errors``). Not thread-safe."""

    def __init__(self, cache_dir: str | os.PathLike[str] | None) -> None:
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        if self.cache_dir is not None:
            os.makedirs(self.cache_dir, exist_ok=True)
        self.stats: dict[str, int] = dict.fromkeys(SRC_STORE_RESULTS, 0)

    def get(self, entry: Any) -> SrcLineTable | None:
        """``entry``'s (an ElfEntry) table, from disk or compiled; None if it has none."""
        from .symstore import _stamp_of, source_stamp

        if not entry.usable:
            return None
        bid = entry.build_id
        path = None
        stamp = 0
        if bid and self.cache_dir is not None:
            path = os.path.join(self.cache_dir, bid.hex() + ".srcl")
            stamp = _stamp_of(source_stamp(entry))
            table = self._load(path, stamp)
            if table is not None:
                self.stats["hits"] += 1
                return table
        elif not bid:
            self.stats["no_build_id"] += 1
        try:
            table = compile_srclines(entry.fd_path, entry.debug_path())
        except (ElfError, _BadTable, MemoryError, RuntimeError):
            self.stats["errors"] += 1
            return None
        self.stats["compiled"] += 1
        if path is not None:
            blob = table.blob
            head = _FILE.pack(FILE_MAGIC, FILE_VERSION, stamp, len(blob), zlib.crc32(blob))
            if not write_cache_file(path, (head, blob)):
                self.stats["write_errors"] += 1
        return table

    def _load(self, path: str, stamp: int) -> SrcLineTable | None:
        try:
            data = read_cache_file(path, _FILE.size + MAX_FILE)
            if data is None:
                return None
            if len(data) < _FILE.size:
                raise _BadTable("short")
            magic, version, st, size, crc = _FILE.unpack_from(data, 0)
            blob = data[_FILE.size :]
            if magic != FILE_MAGIC or version != FILE_VERSION or st != stamp:
                raise _BadTable("magic/version/stamp")
            if size != len(blob) or zlib.crc32(blob) != crc:
                raise _BadTable("size/checksum")
            return SrcLineTable(blob)
        except (_BadTable, CacheFileError):
            self.stats["corrupt"] += 1
            discard_cache_file(path)
            return None


class SrcLineCache:
    """The tables of the binaries being named, by ``ElfEntry.uid``: each compiled or read
    once (``SrcLineStore.get``), at most ``max_tables`` kept (least recently used dropped:
    a process churn of many binaries must not hold every table)."""

    def __init__(self, store: SrcLineStore, max_tables: int = 256) -> None:
        self.store = store
        self.max_tables = max_tables
        self._tables: dict[int, SrcLineTable | None] = {}

    def table(self, entry: Any) -> SrcLineTable | None:
        uid = entry.uid
        tables = self._tables
        if uid in tables:
            t = tables.pop(uid)
            tables[uid] = t  # most recently used last
            return t
        t = self.store.get(entry)
        if len(tables) >= self.max_tables:
            del tables[next(iter(tables))]
        tables[uid] = t
        return t
