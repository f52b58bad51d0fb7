"""Finished symbol tables persisted by build-id: ``SymbolStore`` (an ElfCache
``symbol_factory``) keeps ``<dir>/<build-id hex>.sym`` and reads it back instead of scanning.

Rules:
- A table read back answers every lookup and name exactly as the one it was saved from: the
  file holds the columns of ``SymbolTable._columns`` as ``load_symbol_table`` returned them,
  before any lookup.
- A file is used only if every check of ``decode_symbol_table`` passes: size, CRC-32C, build-id,
  layout version, a stamp of the code that decides the content (``_code_stamp``) and of the
  binary's size and debug file (``source_stamp``: stripped copies keep their build-id), name
  offsets in range. Else it is counted, removed, rebuilt and rewritten.
- Binaries without a build-id are never persisted: nothing else identifies the content.
- A table read back is used in place: the file is mapped read-only and shared (cachefiles'
  ``map_cache_file``), and its starts, ends, name offsets and string table are views of the
  mapping (u64 columns 8-byte aligned in the file), so they are page cache, not private heap
  (``SymbolTable.mapped_bytes``); only the few PLT and pre-decoded names are copied. A table
  just built is written, then mapped back the same way. Writes are cachefiles' atomic ones; a
  table over the bounds is not written and stays on the heap, as does every table when no
  cache dir is usable (no store).

Cost: a hit is one open, fstat, mmap (~20 B a symbol plus the string table), one checksum pass,
one native pass over the name offsets (symtab.c): O(n), and the extra names' two columns
sorted by symbol index, O(m log m) (8 B a name held; the names stay in the file); a write is
O(n) bulk copies + O(PLT).
"""

from __future__ import annotations

import os
import struct
import zlib
from array import array
from collections.abc import Iterable

from ..unwcore import ffi, lib
from .cachefiles import (
    CacheFileError,
    checksum,
    discard_cache_file,
    map_cache_file,
    modules_stamp,
    release_table,
    write_cache_file,
)
from .elfentry import ElfEntry
from .elfsyms import content_modules, load_symbol_table
from .symtab import EXTRA_RAW, NO_NAME, Column, StrTab, SymbolTable

__all__ = [
    "MAX_SYM_FILE",
    "SYM_FILE_MAGIC",
    "SYM_FILE_VERSION",
    "SYM_STORE_RESULTS",
    "SymbolStore",
    "decode_symbol_table",
    "encode_symbol_table",
    "source_stamp",
]

# A ".sym" file, little-endian: _SYM_FILE, then the build-id, zeros to an 8-byte boundary,
# starts (u64 x n), ends (u64 x n), name offsets (u32 x n), extras (u32 x m: symbol index |
# _EXTRA_RAW if the name is a PLT entry's raw name, demangled on lookup, else the name as
# printed), the m extras' names (each UTF-8 with surrogateescape, NUL-terminated), the string
# table.
SYM_FILE_MAGIC = b"UWSYM\x00\x00\x00"
# Bump when the file layout changes. Table content (elfsyms' rules, demangle.py's choices,
# symtab.c) is covered by _code_stamp instead, so a code change never serves an old table.
SYM_FILE_VERSION = 4  # 4: the checksum is CRC-32C (cachefiles.checksum), not CRC-32
# magic, version, flags (0), stamp (u64: _code_stamp() << 32 | source_stamp(entry)), build-id
# length, n, m,
# names length, string table length, CRC-32C (cachefiles.checksum) of everything after the
# header, pad
_SYM_FILE = struct.Struct("<8sIIQIIIIQI4x")
_EXTRA_RAW = EXTRA_RAW
MAX_SYM_FILE = 1 << 30  # > any real table (4M symbols x 20 B + string table); < 2**32 offsets
# ``SymbolStore.stats`` keys: read back, built (file missing or unusable), file discarded as
# corrupt or stale, not persisted (no build-id, or over the bounds), write failed.
SYM_STORE_RESULTS = ("hits", "misses", "corrupt", "stale", "no_build_id", "write_errors",
                     "unsaved")  # fmt: skip


class _BadFile(Exception):
    """A cache file not to use; ``reason`` is a ``SymbolStore.stats`` key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


_stamp: list[int] = []


def _code_stamp() -> int:
    """``modules_stamp`` of the code a table's content depends on (this module and
    ``elfsyms.content_modules``: the rules, demangle, elf's reader and debug-file search, the
    native scan). Once per process."""
    if not _stamp:
        import sys

        _stamp.append(modules_stamp((sys.modules[__name__], *content_modules())))
    return _stamp[0]


def _pad8(n: int) -> int:
    """Zero bytes that take offset ``n`` to the next multiple of 8."""
    return -n % 8


def _names_in_range(offs: array[int], plt: Iterable[int], strtab_len: int) -> bool:
    """Whether every offset in ``offs`` but those at the distinct indices ``plt`` (the
    ``NO_NAME`` slots, set to 0 for the pass and restored) is inside a string table of
    ``strtab_len`` bytes. One ``max``: O(n)."""
    idx = list(plt)
    for i in idx:
        offs[i] = 0
    top = max(offs, default=0)
    for i in idx:
        offs[i] = NO_NAME
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
            if not 0 <= i < min(n, _EXTRA_RAW) or offs[i] != NO_NAME:
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
    pad = bytes(_pad8(_SYM_FILE.size + len(build_id)))
    body = [build_id, pad, table.starts.tobytes(), table.ends.tobytes(), offs.tobytes(),
            extras.tobytes(), blob, bytes(strtab)]  # fmt: skip
    if _SYM_FILE.size + sum(map(len, body)) > MAX_SYM_FILE or len(strtab) >= NO_NAME:
        return None
    # what decode_symbol_table will check, so that no file is written only to be refused
    if not _names_in_range(array("I", offs.tobytes()), (x & ~_EXTRA_RAW for x in extras),
                           len(strtab)):  # fmt: skip
        return None
    crc = 0
    for part in body:
        crc = checksum(part, crc)
    head = _SYM_FILE.pack(SYM_FILE_MAGIC, SYM_FILE_VERSION, 0, _stamp_of(source),
                          len(build_id), n, len(names), len(blob), len(strtab), crc)  # fmt: skip
    return [head, *body]


def decode_symbol_table(data: bytes | memoryview, build_id: bytes, source: int) -> SymbolTable:
    """The table a ``.sym`` file holds, after checking everything a lookup relies on; raises
    ``_BadFile`` ("corrupt": truncated, damaged, another binary's, inconsistent; "stale":
    another layout version, other code, another ``source_stamp``). Checked: header, exact total
    size, CRC-32, build-id, stamps; that each extra names a distinct PLT slot (offset
    ``NO_NAME``) and every other offset is inside the string table, so ``name`` has a name
    for every index. Not re-checked: the order of starts (a Python pass as costly as the
    load), since a misordered table can only misname (bisect and stacks.c's fp_sym_region
    stay in bounds on any order) and damage is what the CRC catches. ``data`` a memoryview
    (a mapped file): the table's columns and string table are views of it, used in place;
    ``bytes``: copies. Cost: one CRC pass, one native pass over the offsets, O(n), and O(PLT)
    dict inserts."""
    if len(data) < _SYM_FILE.size:
        raise _BadFile("corrupt", "short header")
    (magic, version, _flags, stamp, bid_len, n, m, names_len, strtab_len,
     crc) = _SYM_FILE.unpack_from(data, 0)  # fmt: skip
    if magic != SYM_FILE_MAGIC:
        raise _BadFile("corrupt", "magic")
    if version != SYM_FILE_VERSION:
        raise _BadFile("stale", f"version {version}")
    o_bid = _SYM_FILE.size
    o_starts = o_bid + bid_len + _pad8(o_bid + bid_len)
    o_ends = o_starts + 8 * n
    o_offs = o_ends + 8 * n
    o_extras = o_offs + 4 * n
    o_names = o_extras + 4 * m
    o_strtab = o_names + names_len
    if o_strtab + strtab_len != len(data):
        raise _BadFile("corrupt", "size")
    mv = memoryview(data)
    if checksum(mv[o_bid:]) != crc:
        raise _BadFile("corrupt", "checksum")
    if data[o_bid : o_bid + bid_len] != build_id:
        raise _BadFile("corrupt", "build-id")
    if stamp != _stamp_of(source):
        raise _BadFile("stale", "code, binary or debug file")
    if strtab_len >= NO_NAME:
        raise _BadFile("corrupt", "string table size")
    mapped = isinstance(data, memoryview)
    starts: Column
    ends: Column
    offs: Column
    if mapped:
        starts, ends = mv[o_starts:o_ends].cast("Q"), mv[o_ends:o_offs].cast("Q")
        offs = mv[o_offs:o_extras].cast("I")
    else:
        starts, ends, offs = array("Q"), array("Q"), array("I")
        starts.frombytes(mv[o_starts:o_ends])
        ends.frombytes(mv[o_ends:o_offs])
        offs.frombytes(mv[o_offs:o_extras])
    extras = array("I")
    extras.frombytes(mv[o_extras:o_names])
    blob = bytes(mv[o_names:o_strtab])
    if blob.count(0) != m or (blob and blob[-1]):
        raise _BadFile("corrupt", "extra names")
    # the extras by symbol index, each with its name's offset in the blob (EXTRA_RAW kept):
    # columns, the names left in the file until looked up (symtab.py, Extras)
    starts_at = [0] * m
    at = 0
    for k in range(m):
        starts_at[k] = at
        at = blob.index(0, at) + 1
    order = sorted(range(m), key=lambda k: extras[k] & ~_EXTRA_RAW)
    xidx = array("I", (extras[k] & ~_EXTRA_RAW for k in order))
    xoff = array("I", (starts_at[k] | extras[k] & _EXTRA_RAW for k in order))
    del starts_at, order
    prev = -1
    for i in xidx:
        if i >= n or offs[i] != NO_NAME:
            raise _BadFile("corrupt", "extra index")
        if i == prev:
            raise _BadFile("corrupt", "duplicate extra")
        prev = i
    # any other offset >= strtab_len would be a name outside the string table, or a
    # NO_NAME slot without a name
    # every extra's slot holds NO_NAME (checked above), so no other may, and every other
    # offset must be inside the string table: one native pass, the columns read in place
    nskip = ffi.new("uint64_t *")
    top = lib.unw_symtab_max_offset(ffi.from_buffer(mv[o_offs:o_extras]), n, NO_NAME, nskip)
    if nskip[0] != m or (n > m and top >= strtab_len):
        raise _BadFile("corrupt", "name offset")
    strtab: StrTab = mv[o_strtab:] if mapped else bytes(mv[o_strtab:])
    names: StrTab = mv[o_names:o_strtab] if mapped else blob
    return SymbolTable._columns(starts, ends, offs, strtab, {}, None,
                                mapped_bytes=len(data) if mapped else 0,
                                extras=(xidx, xoff, names))  # fmt: skip


class SymbolStore:
    """Finished symbol tables on disk, one file per build-id: ``<cache_dir>/<hex>.sym``; an
    ``ElfCache`` ``symbol_factory``. A table read back answers every lookup and name exactly
    as the ``load_symbol_table`` it was saved from (test_symcache.py).

    ``stats``: ``hits`` (read from disk), ``misses`` (built, then written), ``corrupt`` and
    ``stale`` (a file not used, removed, rebuilt and rewritten; see ``decode_symbol_table``),
    ``no_build_id`` (built, not persisted), ``write_errors``, ``unsaved`` (a table over the
    bounds). Binaries without a build-id are never persisted: nothing else identifies the
    content. Not thread-safe (the ElfCache's owner calls it).

    Cost of a hit: open + fstat + read of ~20 B per symbol + the string table, one CRC, a few
    ``array.frombytes``, one ``max``: O(n), against a scan's O(n log n) and its demangling."""

    def __init__(self, cache_dir: str | os.PathLike[str], *,
                 max_file_bytes: int = MAX_SYM_FILE) -> None:  # fmt: skip
        self.cache_dir = os.fspath(cache_dir)
        os.makedirs(self.cache_dir, exist_ok=True)
        self.max_file_bytes = min(max_file_bytes, MAX_SYM_FILE)
        self.stats: dict[str, int] = dict.fromkeys(SYM_STORE_RESULTS, 0)

    def path_for(self, build_id: bytes) -> str:
        return os.path.join(self.cache_dir, build_id.hex() + ".sym")

    def __call__(self, entry: ElfEntry) -> SymbolTable:
        """``entry``'s table: from its file if that is valid, else built (ElfError raised as by
        ``load_symbol_table``, nothing written) and written."""
        build_id = entry.store_key  # (the build-id, else cachefiles.identity_key)
        if not build_id:
            self.stats["no_build_id"] += 1
            return load_symbol_table(entry)
        source = source_stamp(entry)
        path = self.path_for(build_id)
        table = self._load(path, build_id, source)
        if table is not None:
            self.stats["hits"] += 1
            return table
        table = load_symbol_table(entry)
        self.stats["misses"] += 1
        parts = encode_symbol_table(table, build_id, source)
        if parts is None or sum(map(len, parts)) > self.max_file_bytes:
            self.stats["unsaved"] += 1
        elif not write_cache_file(path, parts):
            self.stats["write_errors"] += 1
        else:
            # use the written file in place; the built heap columns go with this frame
            return self._load(path, build_id, source) or table
        return table

    def _load(self, path: str, build_id: bytes, source: int) -> SymbolTable | None:
        """The table in the file at ``path``, mapped and used in place; None if there is no
        file or it was refused (counted by reason, removed)."""
        try:
            got = map_cache_file(path, self.max_file_bytes)
            if got is None:
                return None
            table = decode_symbol_table(memoryview(got[1]).toreadonly(), build_id, source)
            release_table(got[1])  # the checks read all of it; lookups read a few pages
            return table
        except (CacheFileError, _BadFile) as e:
            self.stats[e.reason if isinstance(e, _BadFile) else "corrupt"] += 1
            discard_cache_file(path)
            return None
