"""On-disk cache files: one flat directory per store (``cfi.CfiStore``, ``symstore.SymbolStore``,
``srclines.SrcLineStore``), one file per build-id, under the daemon's cache dir or
``user_cache_dir``; beside them the debuginfod downloads (debuginfod.py, ``.build-id/xx/``).

Rules:
- A binary without a build-id (many Rust toolchains' libraries, Go binaries, custom builds)
  is stored under ``identity_key``, a stand-in made from its file's identity (device, inode,
  size, mtime and ctime): a file written in place gets a new ctime, so a new key, and a
  deleted one's inode reused gets a new ctime too. The stand-in is 24 bytes, a length no
  GNU build-id note has (8, 16 or 20), and is never shown as a build-id.
- A file is read whole only if it is a regular file (opened O_NOFOLLOW | O_NONBLOCK) within its
  store's size bound, checked on the open fd; else ``CacheFileError``. What a file holds is
  checked by its store before anything trusts it.
- ``map_cache_file`` maps a file read-only and shared instead (cffi_build/cfilookup.c
  ``unw_map_file``, same open checks; the fd is closed once mapped) and hands out a cffi buffer
  that owns the mapping, never a memoryview (a memoryview kept with an export, e.g. under
  ``ffi.from_buffer``, cannot be cleared by the cyclic GC; at interpreter exit that crashed
  the collector once the mapping went first): the stores use a table in
  place from it, so its bytes are the file's page cache (shared, reclaimable), not private
  heap. Files are only ever replaced whole (below), never rewritten in place, so a mapping
  keeps the inode it was checked on; only a file truncated by hand under a running process
  could fault its reader (SIGBUS), as with any mapped file.
- ``release_mapped`` drops the pages of the mapped tables from the process's page tables
  (cfilookup.c ``unw_mapped_release``, MADV_DONTNEED): the page cache keeps them and the next
  lookup maps what it reads again with a minor fault. A table's load checks (checksum,
  validation) read all of it, while lookups read a small part: without this the whole table
  stayed in the process's RSS. It changes what RSS counts, not what the machine holds: the
  pages stay in the page cache (shared, reclaimable) either way. ``release_table`` does the
  same for one table, which its store calls right after the load checks. A table mapped
  ``hot`` (CFI: the unwind reads it at every sample) is dropped only when the caller asks for
  hot tables too, so that the frequent release of the others does not make every sample
  fault its rows back.
- A read fault on a file mapping maps the whole page-cache folio it hits, so a table cached in
  large folios is all in the RSS after a few lookups: files are written ``WRITE_CHUNK`` at a
  time (small folios), and a file's clean pages are dropped from the page cache before its
  first mapping in the process (``_small_folios``), so that its faults read it back small.
  A short-lived command (``unwindd replay``) skips the drop (``keep_page_cache``): its RSS
  ends with it, and a table's load checks would read the dropped file back from the disk.
- A file is written to a temporary name (pid and thread in it; O_EXCL | O_NOFOLLOW: never
  through a symlink or into a planted file) then ``os.replace``d, so a reader sees a whole old
  file, a whole new one, or none, never half of one. Writers of one build-id write the same
  bytes; the last replace wins.
- ``prune_cache_dirs`` bounds a cache dir's stores together, one policy and one bound for all
  of them (``CACHE_STORES``: CFI, symbol and line tables, debuginfod downloads, the kernel
  image's symbols):
  temporaries a dead writer left (``*.tmp``), then the least recently used files of all the
  stores, until the total fits. A file removed while a process uses it keeps working for that
  process (its mapping or open fd holds the inode); the next to want it rebuilds or fetches
  it. ``bound_cache_dir`` applies it to a cache dir: the daemon at start, ``unwindd replay``
  after its output is written and at most once per ``REPLAY_PRUNE_SECONDS`` (the stamp file
  ``.pruned`` in the cache dir: a replay costs one stat, not a walk). Writes, discards and
  prunes never raise: they return False or skip the file.

Cost: a read is one open, fstat and read; a map one open, fstat, mmap and close; a write one
open, write and rename; a prune one scandir and a sort of the directory's entries, O(n log n),
run at start; ``release_mapped`` one madvise per mapped table (the kernel's work: O(resident
pages)), ``release_table`` one; a file's first mapping in the process one fadvise.
"""

from __future__ import annotations

import os
import stat
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "CACHE_STORES",
    "DIR_MAX_BYTES",
    "REPLAY_PRUNE_SECONDS",
    "STALE_TMP_SECONDS",
    "CacheFileError",
    "blob_file_head",
    "bound_cache_dir",
    "checksum",
    "discard_cache_file",
    "identity_key",
    "keep_page_cache",
    "map_blob_file",
    "map_cache_file",
    "prune_cache_dirs",
    "read_cache_file",
    "release_mapped",
    "release_table",
    "user_cache_dir",
    "write_cache_file",
]


class CacheFileError(Exception):
    """A cache file that exists but cannot be used as one (unreadable, not a regular file, or
    over its store's size bound)."""


def read_cache_file(path: str, limit: int) -> bytes | None:
    """The whole file at ``path``; None if there is none. CacheFileError if it cannot be read
    or is not a regular file of at most ``limit`` bytes (checked on the open fd before reading,
    so a huge or special file costs one fstat). Cost: one open, fstat, read."""
    opened = _open_checked(path, limit)
    if opened is None:
        return None
    fd, size = opened
    try:
        chunks: list[bytes] = []
        want = size + 1  # +1: a file that grew since the fstat reads long (refused)
        while want > 0 and (chunk := os.read(fd, want)):
            chunks.append(chunk)
            want -= len(chunk)
        data = b"".join(chunks)  # one chunk (the usual case): no copy
        if len(data) > limit:
            raise CacheFileError("grew past its bound")
        return data
    except OSError as e:
        raise CacheFileError(f"read: {e}") from None
    finally:
        os.close(fd)


def _open_checked(path: str, limit: int) -> tuple[int, int] | None:
    """(fd, size) of the regular file at ``path`` of at most ``limit`` bytes; None if there is
    none; CacheFileError if it cannot be opened or is another kind of file or too large."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CacheFileError(f"open: {e}") from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise CacheFileError(f"fstat: {e}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        os.close(fd)
        raise CacheFileError("not a regular file or too large")
    return fd, st.st_size


def checksum(data: Any, crc: int = 0) -> int:
    """The cache files' checksum of ``data`` (any buffer), continuing ``crc`` as
    ``zlib.crc32``'s second argument does: CRC-32C (cffi_build/crc32c.c; the CPU's instruction
    where it has one), which every load of a table computes over all of it. Cost: O(n), ~1
    cycle per 3 bytes on x86-64 with SSE4.2."""
    from ..unwcore import ffi, lib

    return int(lib.unw_crc32c(ffi.from_buffer(data), len(memoryview(data).cast("B")), crc))


def modules_stamp(modules: Iterable[Any]) -> int:
    """CRC-32 of (name, size, mtime) of ``modules``' files: a stamp of the code a cache file's
    content depends on, so that a reinstalled or edited package writes new files instead of
    serving ones its predecessor wrote (a module without a file stamps as such). A stat per
    module (zlib, not hashlib, whose import is slow); callers keep it for the process."""
    import zlib

    desc = []
    for mod in modules:
        try:
            st = os.stat(str(mod.__file__))
            desc.append(f"{mod.__name__}:{st.st_size}:{st.st_mtime_ns}")
        except (OSError, AttributeError):
            desc.append(f"{mod.__name__}:?")
    return zlib.crc32(";".join(desc).encode())


def blob_file_head(header: struct.Struct, fields: tuple[Any, ...], blob: Any) -> bytes:
    """The header of a file of ``header`` then ``blob``: ``fields``, then the blob's length and
    ``checksum`` (the last two fields of every such header; ``map_blob_file`` checks them)."""
    return header.pack(*fields, len(blob), checksum(blob))


def map_blob_file(path: str, header: struct.Struct, limit: int, small: bool = True,
                  hot: bool = False) -> tuple[tuple[Any, ...], Any] | None:  # fmt: skip
    """A file ``blob_file_head`` began, mapped (``map_cache_file``, ``small`` and ``hot`` as
    there): (the header's fields but the last two, the blob as a cffi buffer over the mapping); None
    if there is no file. CacheFileError as ``map_cache_file``, and for a blob whose length or
    ``checksum`` is not the header's. The caller checks the other fields. Cost: the map and
    one checksum pass."""
    got = map_cache_file(path, header.size + limit, header.size, small, hot)
    if got is None:
        return None
    head, blob = got
    *fields, size, crc = header.unpack_from(head, 0)
    if size != len(blob) or checksum(blob) != crc:
        raise CacheFileError("size/checksum")
    return tuple(fields), blob


def map_cache_file(path: str, limit: int, head: int = 0, small: bool = True,
                   hot: bool = False) -> tuple[bytes, Any] | None:  # fmt: skip
    """The file at ``path`` mapped read-only and shared (see the module rules), as (its first
    ``head`` bytes copied, a cffi buffer over the rest of the mapping); None if there is no
    file. CacheFileError as ``read_cache_file``, and for a file of ``head`` bytes or fewer
    or a failed mmap. The buffer owns the mapping (its pointer's finalizer unmaps it), and
    anything built on it (memoryviews, ``ffi.from_buffer``) keeps it alive. ``small=False``:
    the file's pages are not dropped first (``_small_folios``), for a file small enough that
    all of it in the RSS costs less than reading it back from the disk at every mapping.
    ``hot``: a table read at every sample, released only by ``release_mapped(hot=True)``.
    Cost: one open, fstat, mmap, close."""
    from ..unwcore import ffi, lib

    opened = _open_checked(path, limit)
    if opened is None:
        return None
    fd, size = opened
    try:
        if small and _drop_first:
            _small_folios(fd)
        cls = lib.UNW_MAP_HOT if hot else lib.UNW_MAP_COLD
        p = lib.unw_map_file(fd, size, cls) if size > head else ffi.NULL
    finally:
        os.close(fd)
    if p == ffi.NULL:
        raise CacheFileError("too short for its header, or mmap failed")
    # the owner is the body's own pointer: a buffer of it needs no view of the header, and no
    # memoryview holds an export that the garbage collector could not clear
    owner: Any = ffi.gc(p + head, lambda _q, base=p, n=size: lib.unw_unmap_file(base, n), size)
    return ffi.buffer(p, head)[:], ffi.buffer(owner, size - head)


# (st_dev, st_ino) of the files ``_small_folios`` dropped from the page cache or this process
# wrote (``WRITE_CHUNK`` at a time: cached small already; a drop of its dirty pages would only
# start their writeback); cleared past ``_DROPPED_MAX`` (a second drop of a file costs one
# re-read, never a wrong answer). Set operations are atomic under the GIL: any thread.
_dropped: set[tuple[int, int]] = set()
_DROPPED_MAX = 4096
# A cache file is written this much at a time (``write_cache_file``): the page cache then holds
# it in folios of at most this size (mm/filemap.c __filemap_get_folio: a buffered write's
# folio order follows its length), not in the multi-MiB folios one large write makes.
WRITE_CHUNK = 64 << 10


# Whether a file's first mapping in this process drops its pages first (``_small_folios``):
# the daemon's rule, for its RSS; cleared by ``keep_page_cache``.
_drop_first = True


def keep_page_cache() -> None:
    """From now on this process maps cache files as the page cache holds them, without
    ``_small_folios``: for a short-lived command (``unwindd replay``), whose RSS ends with
    it. A drop would only make it read each table back from the disk, since a table's load
    checks read all of it, at every run."""
    global _drop_first
    _drop_first = False


def _note_small(dev: int, ino: int) -> None:
    if len(_dropped) >= _DROPPED_MAX:
        _dropped.clear()
    _dropped.add((dev, ino))


def _small_folios(fd: int) -> None:
    """Before the first mapping of a file in this process: drop its clean, unmapped pages
    from the page cache (POSIX_FADV_DONTNEED, mm/fadvise.c), so that the mapping's faults
    read it back in small folios. On recent kernels a read fault maps the whole large folio
    it hits (mm/filemap.c filemap_map_pages), so a file cached in large folios (written in
    one large write, e.g. by an older daemon) put all of a table in the RSS at its first
    lookups. Errors are ignored: the drop only changes what a mapping's faults map, never
    what it reads."""
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in _dropped:
            return
        _note_small(st.st_dev, st.st_ino)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


def identity_key(st: os.stat_result) -> bytes:
    """The store key of a binary without a build-id whose open file ``st`` describes (module
    rules): a tag and the SHA-1 of its identity."""
    ident = struct.pack("<QQQqq", st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                        st.st_ctime_ns)  # fmt: skip
    digest: bytes = _sha1()(ident).digest()
    return b"UWid" + digest


def _sha1() -> Any:
    """SHA-1's constructor: CPython's own (``_sha1``, Modules/sha1module.c), imported when
    first needed. Not hashlib's: importing hashlib loads and initialises OpenSSL's libcrypto,
    a cost a replay paid at its start for the few binaries without a build-id. The digest is
    the same; an interpreter built without its own hashes gets hashlib's."""
    try:
        from _sha1 import sha1  # type: ignore[import-not-found]
    except ImportError:
        from hashlib import sha1
    return sha1


def release_table(buf: Any) -> int:
    """Drop the pages of the one mapping ``buf`` (a buffer ``map_cache_file`` returned, or
    a view of it) lies in from the page tables, as ``release_mapped`` does for all: a
    store calls it once its load checks have read the whole table. Returns the mapping's
    bytes (0: ``buf`` is not mapped, e.g. a heap copy)."""
    from ..unwcore import ffi, lib

    if not len(buf):
        return 0
    return int(lib.unw_mapped_release_one(ffi.cast("const uint8_t *", ffi.from_buffer(buf))))


def release_mapped(hot: bool = True) -> tuple[int, int]:
    """Drop the pages of the tables ``map_cache_file`` mapped (and not yet unmapped) from
    the process's page tables, those mapped ``hot`` only if ``hot``; they stay in the page
    cache (see the module rules). Returns (tables advised, their bytes). Safe from any
    thread: a table unmapped meanwhile waits for it."""
    from ..unwcore import ffi, lib

    nfiles = ffi.new("uint64_t *")
    classes = lib.UNW_MAP_COLD | (lib.UNW_MAP_HOT if hot else 0)
    nbytes = int(lib.unw_mapped_release(nfiles, classes))
    return int(nfiles[0]), nbytes


STALE_TMP_SECONDS = 600  # a temporary older than this was left by a writer that died
# The stores under a cache dir that ``prune_cache_dirs`` bounds together: compiled CFI
# (cfi.CfiStore), symbol tables (symstore.SymbolStore), line/inline tables
# (srclines.SrcLineStore), debuginfod downloads (debuginfod.py), the kernel image's symbols
# (kallsymstore.KernelImageStore). unwind/engine.py and serve/startup.py name their
# directories from this tuple.
CACHE_STORES = ("cfi", "sym", "srcline", "debuginfod", "kernel")
DIR_MAX_BYTES = 1 << 30  # their bound by default ([cache] dir_max_bytes; unwindd replay's)
REPLAY_PRUNE_SECONDS = 3600  # how often unwindd replay walks its cache dir to bound it
_STAMP = ".pruned"  # in the cache dir, beside the stores: when it was last bounded
_MAX_DEPTH = 3  # the deepest store: debuginfod's .build-id/xx/file


def user_cache_dir(env: Mapping[str, str]) -> str:
    """The cache dir of a user who may not write the system one: ``$XDG_CACHE_HOME/unwindd``,
    else ``~/.cache/unwindd`` (``unwindd replay``'s default; the daemon's when not root)."""
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "unwindd")


def prune_cache_dirs(paths: Iterable[str], max_bytes: int,
                     now: float | None = None) -> tuple[int, int]:  # fmt: skip
    """Bound a cache dir's stores (``paths``: each store's directory) together: remove
    temporaries a crashed writer left (``*.tmp`` older than ``STALE_TMP_SECONDS``), then,
    while the files of all of them total more than ``max_bytes``, the least recently used
    (by max(atime, mtime): a hit reads the file, and relatime still moves atime past mtime
    once a day), whichever store holds them. Only regular files are considered, in each
    directory and its subdirectories (at most ``_MAX_DEPTH`` deep, never through a symlink);
    errors skip a file. Returns (files removed, bytes removed). Cost: a scandir per directory
    and one sort of all the files, O(n log n); run at start."""
    now = time.time() if now is None else now
    files: list[tuple[float, int, str]] = []
    removed = freed = 0
    todo = [(p, 0) for p in paths]
    while todo:
        path, depth = todo.pop()
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue
        for de in entries:
            try:
                st = de.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and depth < _MAX_DEPTH:
                todo.append((de.path, depth + 1))
            if not stat.S_ISREG(st.st_mode):
                continue
            if de.name.endswith(".tmp"):
                if now - st.st_mtime > STALE_TMP_SECONDS and discard_cache_file(de.path):
                    removed, freed = removed + 1, freed + st.st_size
                continue
            files.append((max(st.st_atime, st.st_mtime), st.st_size, de.path))
    total = sum(size for _, size, _ in files)
    for _, size, p in sorted(files):
        if total <= max_bytes:
            break
        if discard_cache_file(p):
            removed, freed, total = removed + 1, freed + size, total - size
    return removed, freed


def bound_cache_dir(root: str, max_bytes: int, every: float | None = None,
                    now: float | None = None) -> tuple[int, int] | None:  # fmt: skip
    """``prune_cache_dirs`` over the stores of cache dir ``root`` (``CACHE_STORES``); with
    ``every``, only if the last such prune of ``root`` (its ``.pruned`` stamp) is at least
    that many seconds old, else None. Never raises."""
    now = time.time() if now is None else now
    stamp = os.path.join(root, _STAMP)
    if every is not None:
        try:
            if now - os.stat(stamp).st_mtime < every:
                return None
        except OSError:
            pass
    got = prune_cache_dirs([os.path.join(root, s) for s in CACHE_STORES], max_bytes, now)
    try:
        with open(stamp, "wb"):
            pass
        os.utime(stamp, (now, now))
    except OSError:
        pass
    return got


def discard_cache_file(path: str) -> bool:
    """Remove a cache file (refused, stale or past the bound); False if it could not be."""
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def write_cache_file(path: str, parts: Iterable[bytes | memoryview]) -> bool:
    """``parts`` concatenated into ``path`` through a temporary file + ``os.replace`` (atomic
    on one filesystem); False, the temporary removed, on any OSError. The temporary's name has
    the pid and thread, so concurrent writers (the CFI worker thread, another process) never
    share one; the last replace wins, and every writer of one build-id writes the same bytes."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        # O_EXCL | O_NOFOLLOW: never write through a symlink or into a file someone planted
        # under the temporary's name (a root replay may be given a cache dir others can write)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)  # fmt: skip
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                for off in range(0, len(view), WRITE_CHUNK):
                    chunk = view[off : off + WRITE_CHUNK]
                    while chunk:
                        chunk = chunk[os.write(fd, chunk) :]
            st = os.fstat(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _note_small(st.st_dev, st.st_ino)  # written in small folios: nothing to drop
        return True
    except FileExistsError:
        return False  # not ours to remove
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
