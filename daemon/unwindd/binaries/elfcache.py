"""The shared ELF cache (``ElfCache``): one ``elfentry.ElfEntry`` per binary, shared by every
pid that maps it (docs/architecture.md, "Binaries are shared").

Invariants:
- Keyed by build-id (``("b", id)``), else by file identity ``("i", st_dev, st_ino, st_size,
  st_mtime_ns)``; per pid only the load bias differs (``ElfEntry.bias_for``).
- An entry is usable only if the file opened (``_candidate_paths``: O_NONBLOCK, last component
  not followed, a regular file up to ``max_file_size``) is the file mapped: the record's
  build-id, or (dev, ino), must match. A mismatch or any error (never raised) gives an unusable
  entry under no shared key, counted in ``stats.errors``; a later good open still works.
- References are per address space (``proctable``). Above ``max_bytes`` unreferenced entries
  are evicted, least recently released first; referenced ones never (the cap is then exceeded,
  visibly). ``malloc_trim(0)`` after every ``trim_bytes`` loaded or dropped keeps RSS near the
  cached bytes. Files no path opens are remembered, bounded, for ``negative_ttl_ns`` (``_Failed``).
- Not thread-safe: one owner (the daemon's event loop) calls it.

Cost: a hit by build-id or by a known (maj, min, ino, generation) is one dict lookup and no
syscall; a miss is open + fstat + the ELF/program headers and notes (a few KiB); a negative hit
no syscall, or one ``stat`` for a pid other than the one that failed.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from ..lightdc import dataclass, field
from .cachefiles import identity_key
from .elf import ElfError, ElfReader, find_debug_file
from .elfentry import CfiFactory, ElfEntry, SymbolFactory

__all__ = ["CacheConfig", "CacheStats", "ElfCache"]


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The ELF cache's bounds (bytes, file sizes, negative entries) and debug roots."""

    max_bytes: int = 512 << 20
    # malloc_trim(0) after this many bytes of entries loaded or dropped (0: never): parsing a
    # big binary leaves about as much freed heap as it caches, which glibc keeps unless asked
    trim_bytes: int = 4 << 20
    max_file_size: int = 2 << 30
    max_debug_file_size: int = 2 << 30
    debug_roots: tuple[str, ...] = ("/usr/lib/debug",)
    # negative cache of files no candidate path opened (see the module invariants): bounded,
    # and an entry expires so that a path that appears again is opened again
    negative_entries: int = 1024
    negative_ttl_ns: int = 1_000_000_000


@dataclass
class CacheStats:
    """What the ELF cache holds and did: entries, bytes, hits, misses, evictions, errors."""

    entries: int = 0
    bytes: int = 0
    # of ``bytes``, the tables used in place from read-only mappings of the disk cache's files
    # (cfi.CfiStore, symstore.SymbolStore): shared page cache the kernel can reclaim; the rest
    # is private heap. Both count toward ``max_bytes``.
    mapped_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    trims: int = 0  # malloc_trim calls (see CacheConfig.trim_bytes)
    negative_hits: int = 0  # lookups answered by the negative cache (no open tried)
    errors: Counter[str] = field(default_factory=Counter)


# Every reason ``errors`` counts a binary the cache could not open or read under: the open
# (``lookup``), the vDSO copy, and ``ElfReader``'s header checks (``elf.ElfError``). Later
# failures of a usable binary are counted by elfentry.py as ``symbols_``/``debug_``/``cfi_``
# plus the reader's reason. The metrics export each of these at 0 from the start.
ERROR_KINDS = (
    "not_a_file", "open_failed", "symlink", "stat_failed", "not_regular", "too_large",
    "inode_mismatch", "build_id_mismatch", "no_vdso", "vdso_read_failed",
    "bad_magic", "unsupported_class", "unsupported_data", "bad_phentsize", "out_of_bounds",
    "read_failed", "short_read", "too_many_phdrs", "bad_segment", "bad_shentsize",
    "too_many_sections", "bad_section",
)  # fmt: skip


def _malloc_trim() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)`` (malloc_trim(3): since 2.8 it releases the free pages of
    every arena, not just the top of the main heap; the CFI worker's too), or None without
    glibc. Called through the native module (cffi_build/libcall.c), not ctypes, whose import
    every replay would pay."""
    from ..unwcore import lib

    if lib.unw_malloc_trim(1) != 0:  # (dry: is there one)
        return None

    def trim() -> None:
        lib.unw_malloc_trim(0)

    return trim


_MAX_GONE = 4096  # pids remembered gone per negative entry


@dataclass(slots=True)
class _Failed:
    """A negative cache entry, keyed by the record's path and identity (build-id, maj, min,
    ino, generation): every candidate path of ``pid``'s mapping [start, end) failed to open;
    ``path`` and ``reason`` are the last one's, counted again on a hit (``errors``,
    ``misses``, plus ``negative_hits``). ``gone``: pids found gone since (a pid's pin, then the
    table's lookup of the same record: one ``stat`` for both)."""

    expires_ns: int
    pid: int | None
    start: int
    end: int
    path: str
    reason: str
    gone: set[int] = field(default_factory=set)


class ElfCache:
    """The shared cache. ``acquire`` returns an entry (usable or not) with one more reference;
    ``release`` drops it. See the module invariants."""

    def __init__(
        self,
        config: CacheConfig | None = None,
        *,
        proc_root: str = "/proc",
        cfi_factory: CfiFactory | None = None,
        symbol_factory: SymbolFactory | None = None,
        cfi_lookup: Callable[[bytes], object | None] | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.config = config or CacheConfig()
        self.proc_root = proc_root
        self.cfi_factory = cfi_factory
        self.symbol_factory = symbol_factory
        self.cfi_lookup = cfi_lookup
        self.clock = clock
        self.stats = CacheStats()
        # (filename, build-id, maj, min, ino, generation) -> the failure (see _Failed)
        self._negative: OrderedDict[tuple[object, ...], _Failed] = OrderedDict()
        self._by_key: dict[tuple[object, ...], ElfEntry] = {}
        self._alias: dict[tuple[object, ...], ElfEntry] = {}
        self._lru: OrderedDict[int, ElfEntry] = OrderedDict()  # unreferenced, oldest first
        # why ``[vdso]`` could not be read, once it could not (no [vdso] mapping in this
        # process, as under valgrind): that answer is this process's for its life, so every
        # other process's [vdso] mapping gets it without reading /proc/self/maps again
        self._no_vdso: str | None = None
        self._trim = _malloc_trim() if self.config.trim_bytes > 0 else None
        self._churned = 0  # entry bytes loaded or dropped since the last trim
        # told of each binary's first symbol table load (debuginfod.Debuginfod.offer): the
        # binaries whose frames are being named; must not raise
        self.on_symbols: Callable[[ElfEntry], None] | None = None

    def __len__(self) -> int:
        return len(self._by_key)

    def entries(self) -> list[ElfEntry]:
        return list(self._by_key.values())

    def lookup_build_id(self, build_id: bytes) -> ElfEntry | None:
        return self._by_key.get(("b", bytes(build_id)))

    # -- acquire / release

    def acquire(
        self,
        pid: int | None,
        filename: str,
        start: int = 0,
        end: int = 0,
        *,
        build_id: bytes | None = None,
        maj: int | None = None,
        min: int | None = None,
        ino: int | None = None,
        ino_generation: int | None = None,
    ) -> ElfEntry:
        """The entry for the file mapped by ``pid`` at [start, end) as ``filename``, with one
        more reference. Identity from the record (build-id, or maj/min/ino) is checked
        against the opened file. Never raises."""
        entry = self._lookup(build_id, maj, min, ino, ino_generation)
        if entry is not None:
            self.stats.hits += 1
        else:
            entry = self._open(pid, filename, start, end, build_id, maj, min, ino,
                               ino_generation)  # fmt: skip
            if entry.key is not None and ino is not None and entry.usable:
                self._alias[("m", maj, min, ino, ino_generation)] = entry
        self._ref(entry)
        return entry

    def retain(self, entry: ElfEntry) -> None:
        """One more reference to an entry the caller already holds (a FORK copy)."""
        if entry.refcount <= 0:
            raise ValueError(f"retain of unreferenced {entry!r}")
        self._ref(entry)

    def release(self, entry: ElfEntry) -> None:
        if entry.refcount <= 0:
            raise ValueError(f"release of unreferenced {entry!r}")
        entry.refcount -= 1
        if entry.refcount == 0:
            if entry.key is None or self._by_key.get(entry.key) is not entry:
                entry._close()  # a private (unusable) entry: nobody else can reach it
                return
            self._lru[entry.uid] = entry
            self._evict()

    def retain_all(self, entries: Iterable[ElfEntry]) -> None:
        """``retain`` of each entry (a FORK copies its parent's binaries): one call, not two
        per binary."""
        for entry in entries:
            if entry.refcount <= 0:
                raise ValueError(f"retain of unreferenced {entry!r}")
            entry.refcount += 1  # (> 0 already: not in the LRU, as _ref would check)

    def release_all(self, entries: Iterable[ElfEntry]) -> None:
        """``release`` of each entry (an exec or a drop gives back all of a space's)."""
        for entry in entries:
            if entry.refcount <= 1:
                self.release(entry)  # the last reference (or a bad one): release's path
            else:
                entry.refcount -= 1

    def _ref(self, entry: ElfEntry) -> None:
        if entry.refcount == 0:
            self._lru.pop(entry.uid, None)
        entry.refcount += 1

    def _lookup(
        self,
        build_id: bytes | None,
        maj: int | None,
        mnr: int | None,
        ino: int | None,
        gen: int | None,
    ) -> ElfEntry | None:
        if build_id:
            return self._by_key.get(("b", bytes(build_id)))
        if ino is not None:
            # The kernel's identity of the mapped inode. An inode number reused after a delete
            # gets a new i_generation on ext4/xfs/tmpfs, so a stale alias cannot match there;
            # /proc/<pid>/maps carries no generation (None), a documented small risk.
            return self._alias.get(("m", maj, mnr, ino, gen))
        return None

    def _grew(self, entry: ElfEntry, n: int, mapped: int = 0) -> None:
        """``entry`` now holds ``n`` bytes more, ``mapped`` of them in file mappings."""
        if entry.key is not None and self._by_key.get(entry.key) is entry:
            self.stats.bytes += n
            self.stats.mapped_bytes += mapped
            self._evict()
        self._churned += n - mapped  # only heap is malloc_trim's business
        self._maybe_trim()

    def _maybe_trim(self) -> None:
        if self._trim is not None and self._churned >= self.config.trim_bytes:
            self._churned = 0
            self.stats.trims += 1
            self._trim()

    def _evict(self) -> None:
        while self.stats.bytes > self.config.max_bytes and self._lru:
            # no local name for the victim: its tables must be freed before the trim
            self._drop(self._lru.popitem(last=False)[1])
            self.stats.evictions += 1
        self._maybe_trim()

    def _drop(self, entry: ElfEntry) -> None:
        if entry.key is not None and self._by_key.get(entry.key) is entry:
            del self._by_key[entry.key]
            self.stats.bytes -= entry.nbytes
            self.stats.mapped_bytes -= entry.mapped
            self.stats.entries = len(self._by_key)
        for k in [k for k, v in self._alias.items() if v is entry]:
            del self._alias[k]
        entry._close()
        self._churned += entry.nbytes - entry.mapped  # trimmed by the caller, once it let go

    def clear(self) -> None:
        """Drop every entry (referenced ones too: their fds close; for shutdown)."""
        for key in list(self._by_key):
            self._drop(self._by_key[key])
        self._lru.clear()
        self._maybe_trim()

    # -- opening

    def _candidate_paths(self, pid: int | None, filename: str, start: int, end: int
                         ) -> list[tuple[str, bool]]:  # fmt: skip
        """(path, follow_last_symlink) to try, in order: ``<proc_root>/<pid>/root/<path>``
        (the pid's mount namespace), the path itself, then the mapping's
        ``<proc_root>/<pid>/map_files/<start>-<end>`` (the only one for `` (deleted)`` paths).
        Opened O_NONBLOCK (a FIFO must never block us); the last component is not followed
        but in ``map_files``: the kernel reports d_path names, which hold no symlinks, so one
        appearing there means the path changed."""
        out: list[tuple[str, bool]] = []
        if filename.endswith(" (deleted)"):
            if pid is not None and end > start:
                # The magic link of the mapping itself: the only way to the deleted inode.
                out.append((f"{self.proc_root}/{pid}/map_files/{start:x}-{end:x}", True))
            return out
        if pid is not None and pid > 0:
            out.append((f"{self.proc_root}/{pid}/root{filename}", False))
        out.append((filename, False))
        if pid is not None and pid > 0 and end > start:
            # Unlinked after it was mapped (the record still names the path): the mapping's
            # own link is the last way to it while the process lives.
            out.append((f"{self.proc_root}/{pid}/map_files/{start:x}-{end:x}", True))
        return out

    def _open(
        self,
        pid: int | None,
        filename: str,
        start: int,
        end: int,
        build_id: bytes | None,
        maj: int | None,
        mnr: int | None,
        ino: int | None,
        gen: int | None = None,
    ) -> ElfEntry:
        if not filename.startswith("/"):
            return self._unusable(filename, "", "not_a_file")
        nkey = (filename, bytes(build_id) if build_id else None, maj, mnr, ino, gen)
        cands = self._candidate_paths(pid, filename, start, end)
        failed = self._negative.get(nkey)
        if failed is not None:
            if self.clock() >= failed.expires_ns:
                del self._negative[nkey]
            elif self._still_fails(failed, pid, start, end, cands):
                self.stats.negative_hits += 1
                return self._unusable(filename, failed.path, failed.reason)
        fd = -1
        path = ""
        last_err = "open_failed"
        for path, follow in cands:
            flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
            try:
                fd = os.open(path, flags)
                break
            except OSError as e:
                last_err = "symlink" if e.errno == errno.ELOOP else "open_failed"
        if fd < 0:
            self._remember_failure(nkey, _Failed(self.clock() + self.config.negative_ttl_ns,
                                                 pid, start, end, path, last_err))  # fmt: skip
            return self._unusable(filename, path, last_err)
        if failed is not None:
            self._negative.pop(nkey, None)  # it opens now (a live pid's own path)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ElfError("not_regular")
            if st.st_size > self.config.max_file_size:
                raise ElfError("too_large")
            if ino is not None and (
                st.st_ino != ino
                or (maj is not None and mnr is not None
                    and (os.major(st.st_dev), os.minor(st.st_dev)) != (maj, mnr))
            ):  # fmt: skip
                raise ElfError("inode_mismatch")
            reader = ElfReader(fd, st.st_size)
            file_bid = reader.build_id()
            if build_id and file_bid != bytes(build_id):
                raise ElfError("build_id_mismatch")
            segments = reader.load_segments()
            etype = reader.type
        except ElfError as e:
            os.close(fd)
            return self._unusable(filename, path, e.reason)
        except OSError:
            os.close(fd)
            return self._unusable(filename, path, "stat_failed")
        key: tuple[object, ...] = (
            ("b", file_bid) if file_bid else ("i", st.st_dev, st.st_ino, st.st_size,
                                               st.st_mtime_ns)
        )  # fmt: skip
        known = self._by_key.get(key)
        if known is not None:
            os.close(fd)
            self.stats.hits += 1
            return known
        self.stats.misses += 1
        entry = ElfEntry(
            key=key, filename=filename, path=path, fd=fd, build_id=file_bid, etype=etype,
            segments=segments, dev=st.st_dev, ino=st.st_ino, size=st.st_size,
            mtime_ns=st.st_mtime_ns, cache=self, store_key=None if file_bid else identity_key(st),
        )  # fmt: skip
        self._by_key[key] = entry
        self.stats.entries = len(self._by_key)
        self.stats.bytes += entry.nbytes
        return entry

    def _still_fails(self, failed: _Failed, pid: int | None, start: int, end: int,
                     cands: list[tuple[str, bool]]) -> bool:  # fmt: skip
        """Whether ``cands`` must fail as ``failed``'s did (the path itself failed then and has
        not expired): no per-pid path, the same pid's same mapping (a pin, then the table), or
        a pid whose ``<proc_root>/<pid>`` is gone (one ``stat`` instead of up to three
        ``open``s). A live pid still tries its own ``root``/``map_files``, so a process of
        another namespace is still found; a path that appears again with the same identity
        is found once the entry expires (or at once by a live pid)."""
        if (pid, start, end) == (failed.pid, failed.start, failed.end):
            return True
        proc = f"{self.proc_root}/"
        if not any(p.startswith(proc) for p, _ in cands):
            return True
        if pid in failed.gone:
            return True
        try:
            os.stat(f"{self.proc_root}/{pid}")
        except FileNotFoundError:
            # its root and map_files are gone with it (a pid is reused only after the kernel
            # cycled through pid_max others, far longer than the entry lives)
            if pid is not None and len(failed.gone) < _MAX_GONE:
                failed.gone.add(pid)
            return True
        except OSError:
            return False
        return False

    def _remember_failure(self, nkey: tuple[object, ...], failed: _Failed) -> None:
        neg = self._negative
        neg[nkey] = failed
        neg.move_to_end(nkey)
        while len(neg) > self.config.negative_entries:
            neg.popitem(last=False)

    def acquire_vdso(self) -> ElfEntry:
        """The ``[vdso]`` image, with one more reference. Every 64-bit process on this kernel
        maps the same image, so ours (read from ``/proc/self/mem`` into a memfd) stands for all
        of them, as perf's vdso__dso_findnew does with its own."""
        entry = self._by_key.get(("vdso",))
        if entry is None and self._no_vdso is not None:  # this process has none to read
            self.stats.misses += 1
            entry = ElfEntry(key=None, filename="[vdso]", path="", error=self._no_vdso,
                             cache=self)  # fmt: skip
        elif entry is None:
            entry = self._load_vdso()
            self._no_vdso = entry.error
        self._ref(entry)
        return entry

    def _load_vdso(self) -> ElfEntry:
        try:
            with open("/proc/self/maps") as f:
                line = next((ln for ln in f if ln.rstrip().endswith("[vdso]")), None)
            if line is None:
                return self._unusable("[vdso]", "", "no_vdso")
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            with open("/proc/self/mem", "rb", buffering=0) as mem:
                mem.seek(lo)
                image = mem.read(hi - lo)
            fd = os.memfd_create("vdso", os.MFD_CLOEXEC)
            os.write(fd, image)
        except OSError:
            return self._unusable("[vdso]", "", "vdso_read_failed")
        try:
            reader = ElfReader(fd, len(image))
            entry = ElfEntry(
                key=("vdso",), filename="[vdso]", path="[vdso]", fd=fd,
                build_id=reader.build_id(), etype=reader.type,
                segments=reader.load_segments(), size=len(image), cache=self,
            )  # fmt: skip
        except ElfError as e:
            os.close(fd)
            return self._unusable("[vdso]", "", e.reason)
        self.stats.misses += 1
        self._by_key[("vdso",)] = entry
        self.stats.entries = len(self._by_key)
        self.stats.bytes += entry.nbytes
        return entry

    def _unusable(self, filename: str, path: str, reason: str) -> ElfEntry:
        self.stats.errors[reason] += 1
        self.stats.misses += 1
        return ElfEntry(key=None, filename=filename, path=path, error=reason, cache=self)

    # -- debug files

    def find_debug_file(self, entry: ElfEntry) -> str | None:
        """``entry``'s separate debug file under ``config.debug_roots`` (elf.find_debug_file)."""
        cfg = self.config
        return find_debug_file(entry.filename, entry.build_id, entry.reader, cfg.debug_roots,
                               cfg.max_debug_file_size)  # fmt: skip
