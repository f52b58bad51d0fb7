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
- ``SrcLineCache`` with a worker (the daemon's) never reads or compiles on its caller's
  thread: a table not held yet answers None until the worker has it (``collect``), so a frame
  named meanwhile has no inline levels; ``collect`` says when such frames exist.

Cost: a compile is O(DWARF bytes + rows log rows) in C (libc's debug file: well under a second);
a load from disk is one mmap (the table used in place: page cache, not heap) and one CRC; a
lookup two bisects through heap directories (strided.py: one or two pages of each mapped
column read, not one per level of a whole-column bisect) and a walk of at most
``MAX_LEVELS`` parents; names decoded once per string, file names once per file index (a
table holds at most one decoded name per string and per file it has: every level naming a
file shares one str).
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import TYPE_CHECKING, Any, NamedTuple

from .cachefiles import (
    CacheFileError,
    blob_file_head,
    discard_cache_file,
    map_blob_file,
    release_table,
    write_cache_file,
)
from .demangle import demangle
from .elf import ElfError, ElfReader
from .strided import directory, find

if TYPE_CHECKING:
    from concurrent.futures import Future

    from .cfiprefetch import KeyedWorker

__all__ = [
    "DWARF_SECTIONS",
    "ERROR_NAMES",
    "MAX_LEVELS",
    "PENDING_STATS",
    "SRC_STORE_RESULTS",
    "DeclLevel",
    "Level",
    "Source",
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

    __slots__ = ("__weakref__", "_files", "_fnames", "_kind", "_laddr", "_ldir", "_lfile",
                 "_lno", "_names", "_ndfile", "_ndline", "_nfile", "_nline", "_nname",
                 "_nparent", "_saddr", "_sdir", "_snode", "_strbase", "_strp", "_strtab", "blob",
                 "errors", "mapped", "nbytes")  # fmt: skip

    def __init__(self, blob: bytes | Any, mapped: bool = False) -> None:
        # ``blob``: bytes, or a read-only mapping of a stored table (cachefiles.map_cache_file,
        # ``mapped``); the columns are views of it either way, never copies, so a stored table
        # costs page cache, not heap
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
        cols: list[memoryview] = []
        o = _HDR.size
        mv = memoryview(blob)
        # casts of unaligned offsets are fine: memoryview reads items with memcpy
        for size, code in zip(sizes[:-1], ("Q", "I", "I", "Q", *"IIIIIIIII"), strict=True):
            cols.append(mv[o : o + size].cast(code))
            o += size
        self.blob = blob
        self._strtab = mv[o:]
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
        self._fnames: dict[int, str | None] = {NONE: None}  # file index -> its name, decoded
        self.errors = {n: e for n, e in zip(ERROR_NAMES, errs, strict=True) if e}
        from ..unwcore import ffi

        # every string ends in a NUL inside the table (the check above): ffi.string stops there.
        # The pointer is into the blob's own export, not a memoryview's: on Python 3.11 a
        # memoryview with an export that the cyclic GC clears frees its buffer under the
        # exporter (CPython gh-77894), a crash at interpreter exit.
        self._strbase: Any = ffi.from_buffer(blob) if strlen else ffi.NULL
        self._strp: Any = self._strbase + o if strlen else ffi.NULL
        self.mapped = mapped
        self._ldir, self._sdir = directory(self._laddr), directory(self._saddr)
        self.nbytes = len(blob) + 64 + 8 * (len(self._ldir) + len(self._sdir))

    @property
    def nlines(self) -> int:
        return len(self._laddr)

    @property
    def nnodes(self) -> int:
        return len(self._nname)

    def _str(self, off: int) -> str:
        from ..unwcore import ffi

        raw: bytes = ffi.string(self._strp + off)  # (no table strings: no offsets to read)
        return raw.decode("utf-8", "surrogateescape")

    def _name(self, off: int) -> str | None:
        hit = self._names.get(off, "")
        if hit == "":
            hit = self._names[off] = demangle(self._str(off))
        return hit

    def _file(self, fid: int) -> str | None:
        hit = self._fnames.get(fid, "")
        if hit == "":
            hit = self._fnames[fid] = self._str(self._files[fid])
        return hit

    def lookup(self, vaddr: int) -> tuple[Level, ...]:
        """The levels at ``vaddr``, innermost first; () when nothing covers it."""
        return tuple(lv[:3] for lv in self.chain(vaddr))

    def chain(self, vaddr: int) -> tuple[DeclLevel, ...]:
        """``lookup``'s levels, each with its function's decl file and line."""
        i = find(self._laddr, self._ldir, vaddr)
        fid, line = (self._lfile[i], self._lno[i]) if i >= 0 else (NONE, 0)
        j = find(self._saddr, self._sdir, vaddr)
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


def _out_of(col: memoryview, n: int) -> bool:
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
# length, CRC-32C of the blob (cachefiles.checksum), then the blob.
FILE_MAGIC = b"UWSRCL\x00\x00"
# 2: nodes carry their function's decl file and line; 3: the checksum is CRC-32C
# (cachefiles.checksum), not zlib's CRC-32
FILE_VERSION = 3
_FILE = struct.Struct("<8sIQQI4x")
MAX_FILE = 1 << 31
# ``SrcLineStore.stats`` keys
SRC_STORE_RESULTS = ("hits", "compiled", "corrupt", "no_build_id", "write_errors", "errors")


class Source(NamedTuple):
    """What a table is read or compiled from: the binary (a path, ``/proc/self/fd/N`` of an
    fd the reader owns), its debug file, its build-id and the store's stamp for it."""

    path: str
    debug: str | None
    build_id: bytes | None
    stamp: int


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
        src = self.source_of(entry)
        return None if src is None else self.fetch(src)

    def source_of(self, entry: Any) -> Source | None:
        """What ``fetch`` reads for ``entry`` (owner's thread: it touches the entry); None if
        the entry is not usable."""
        from .symstore import _stamp_of, source_stamp

        if not entry.usable:
            return None
        bid = entry.store_key  # (the build-id, else cachefiles.identity_key)
        stamp = _stamp_of(source_stamp(entry)) if bid and self.cache_dir is not None else 0
        return Source(entry.fd_path, entry.debug_path(), bid, stamp)

    def fetch(self, src: Source) -> SrcLineTable | None:
        """The table ``src`` names: read from disk when stored, else compiled (and stored).
        Pure but for the store's files and ``stats``: one caller at a time (the worker, or the
        owner without one)."""
        path = None
        if src.build_id and self.cache_dir is not None:
            path = os.path.join(self.cache_dir, src.build_id.hex() + ".srcl")
            table = self._load(path, src.stamp)
            if table is not None:
                self.stats["hits"] += 1
                return table
        elif not src.build_id:
            self.stats["no_build_id"] += 1
        try:
            table = compile_srclines(src.path, src.debug)
        except (ElfError, _BadTable, MemoryError, RuntimeError):
            self.stats["errors"] += 1
            return None
        self.stats["compiled"] += 1
        if path is not None:
            blob = table.blob
            head = blob_file_head(_FILE, (FILE_MAGIC, FILE_VERSION, src.stamp), blob)
            if not write_cache_file(path, (head, blob)):
                self.stats["write_errors"] += 1
            else:
                # mapped back: the heap copy lives only as long as the compile
                table = self._load(path, src.stamp) or table
        return table

    def _load(self, path: str, stamp: int) -> SrcLineTable | None:
        try:
            got = map_blob_file(path, _FILE, MAX_FILE)
            if got is None:
                return None
            (magic, version, st), blob = got
            if magic != FILE_MAGIC or version != FILE_VERSION or st != stamp:
                raise _BadTable("magic/version/stamp")
            table = SrcLineTable(blob, mapped=True)
            release_table(blob)  # the checks read all of it; lookups read a few pages
            return table
        except (_BadTable, CacheFileError):
            self.stats["corrupt"] += 1
            discard_cache_file(path)
            return None


class SrcLineCache:
    """The tables of the binaries being named, by ``ElfEntry.uid``: each compiled or read
    once (``SrcLineStore``), at most ``max_tables`` kept (least recently used dropped: a
    process churn of many binaries must not hold every table).

    With a ``worker`` (the daemon's: cfiprefetch.KeyedWorker), ``table`` never compiles or
    reads a file on the caller's thread: a table not held yet is fetched in the worker from
    an fd of the binary opened for it (the worker reads that very file whatever becomes of
    the entry's), and ``table`` answers None (``pending``) until ``collect`` has picked it
    up. ``collect`` (owner, once per step) moves finished tables in and says which of them
    were asked for while pending: frames named meanwhile have no inline levels, and their
    namer re-names them (live.py). Without a worker, ``table`` fetches at once (replay,
    record)."""

    def __init__(self, store: SrcLineStore, max_tables: int = 256,
                 worker: KeyedWorker[int, SrcLineTable | None] | None = None) -> None:  # fmt: skip
        self.store = store
        self.max_tables = max_tables
        self.worker = worker
        self._tables: dict[int, SrcLineTable | None] = {}
        self._fds: dict[int, int] = {}  # uid -> the fd its job reads (closed when it ends)
        self._missed: set[int] = set()  # uids asked for while pending
        # counts: tables asked for while pending, tables that arrived, answers without a table
        # because it was pending (frames named without inline levels), jobs that failed
        self.stats: dict[str, int] = dict.fromkeys(PENDING_STATS, 0)

    def table(self, entry: Any) -> SrcLineTable | None:
        uid = entry.uid
        tables = self._tables
        if uid in tables:
            t = tables.pop(uid)
            tables[uid] = t  # most recently used last
            return t
        if self.worker is not None:
            self._ask(entry)
            self.stats["pending_answers"] += 1
            if len(self._missed) >= 4 * self.max_tables:
                self._missed.clear()  # (uids whose job the worker's bound dropped, unasked)
            self._missed.add(uid)
            return None
        self._put(uid, self.store.get(entry))
        return tables[uid]

    @property
    def pending(self) -> int:
        """Tables being fetched in the worker."""
        return len(self._fds)

    def _put(self, uid: int, t: SrcLineTable | None) -> None:
        tables = self._tables
        if len(tables) >= self.max_tables:
            del tables[next(iter(tables))]
        tables[uid] = t

    def _ask(self, entry: Any) -> None:
        worker = self.worker
        assert worker is not None
        uid = entry.uid
        if worker.get(uid) is not None:
            return
        src = self.store.source_of(entry)
        if src is None:
            self._put(uid, None)
            return
        try:
            fd = os.open(src.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._put(uid, None)
            self.stats["failed"] += 1
            return
        self._fds[uid] = fd  # (a job the worker's bound dropped closes its own fd)
        self.stats["asked"] += 1
        worker.submit(uid, _fetch_fd, self.store, src._replace(path=f"/proc/self/fd/{fd}"), fd)

    def collect(self) -> set[int]:
        """Move the tables the worker finished in; the uids of those that were asked for while
        pending (frames were named without them). Owner's thread; O(jobs held)."""
        worker = self.worker
        missed: set[int] = set()
        if worker is None or not self._fds:
            return missed
        done = [(uid, f) for uid, f in worker.futures.items() if f.done()]
        for uid, f in done:
            worker.pop(uid)
            self._fds.pop(uid, None)
            self._put(uid, _result(f, self.stats))
            self.stats["arrived"] += 1
            if uid in self._missed:
                self._missed.discard(uid)
                missed.add(uid)
        # jobs the worker's bound dropped: their fds are closed by the jobs themselves
        for uid in [u for u in self._fds if worker.get(u) is None]:
            del self._fds[uid]
        return missed

    def close(self) -> None:
        """Stop the worker; fds of jobs it never started are closed here."""
        if self.worker is None:
            return
        pending = list(self.worker.futures.items())
        self.worker.close()
        for uid, f in pending:
            fd = self._fds.pop(uid, None)
            if f.cancelled() and fd is not None:
                os.close(fd)
        self._fds.clear()


# SrcLineCache.stats keys
PENDING_STATS = ("asked", "arrived", "pending_answers", "failed")


def _fetch_fd(store: SrcLineStore, src: Source, fd: int) -> SrcLineTable | None:
    """The worker's job: ``store.fetch(src)``, then the fd it read closed."""
    try:
        return store.fetch(src)
    finally:
        os.close(fd)


def _result(f: Future[SrcLineTable | None], stats: dict[str, int]) -> SrcLineTable | None:
    try:
        return f.result()
    except Exception:  # any failure of the job (an OSError, a bug) costs only this table
        stats["failed"] += 1
        return None
