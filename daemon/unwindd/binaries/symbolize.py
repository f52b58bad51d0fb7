"""Names for frames (``Symbolizer``): user frames through their binary's symbol table, kernel
frames through kallsyms, JIT frames through the pid's perf map or its jitdump.

Rules:
- A user frame is named by (ELF cache entry, ELF vaddr): the entry's table, built once per
  binary (elfsyms, or read back by symstore) and shared by every pid that maps it.
- Kernel symbols are loaded once: on first use, or ahead of it in a thread
  (``preload_kernel``) that the first use waits for; a failed preload is retried there, where
  any error surfaces. Unreadable kallsyms name nothing. With a ``kernel_store``, the kernel
  image's symbols stored for this boot (kallsymstore.py) answer the addresses between two of
  them without /proc/kallsyms, which is read (and the store written) only for an address
  they cannot answer, and then kept only for the symbols outside the image
  (``kallsymstore.outside_lines``); every answer is the one the full table gives.
- A pid's perf map and jitdumps are kept until ``forget_pid``; a jitdump's counts (records,
  errors, files) outlive it (``jitdump_counts``).
- Not thread-safe apart from that preload: one owner calls it.

Cost: a user lookup is one bisect; a JIT lookup one stat and one bisect (a jitdump's: one open
and fstat, and the walk jitdump.JitCodeTable.lookup describes); a kernel lookup one bisect
after one kallsyms parse per Symbolizer.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

from .elfentry import ElfEntry
from .jitdump import Jitdump
from .kallsyms import Kallsyms, KernelSymbol
from .kallsymstore import KernelImageStore, outside_lines
from .perfmaps import PerfMap
from .symtab import SymbolTable

__all__ = ["Symbolizer"]


class Symbolizer:
    """Names for frames: binaries through their cache entries, kernel through kallsyms, JIT
    through perf maps. ``tmp_dir`` and ``proc_root`` are injectable for tests."""

    def __init__(self, *, proc_root: str = "/proc", tmp_dir: str = "/tmp",
                 kernel_store: KernelImageStore | None = None) -> None:  # fmt: skip
        self.proc_root = proc_root
        self.tmp_dir = tmp_dir
        self.kernel_store = kernel_store
        self._kimage: Kallsyms | None = None  # the store's table, once asked (``_image``)
        self._kimage_asked = False
        self._kallsyms: Kallsyms | None = None
        self._kallsyms_loading: threading.Thread | None = None
        self._kallsyms_loaded: list[Kallsyms] = []
        self._perf_maps: dict[int, PerfMap] = {}
        self._jitdumps: dict[int, dict[str, Jitdump]] = {}  # pid -> path -> its dump
        self._jitdump_retired: Counter[str] = Counter()  # counts of dumps forgotten
        self._bounds_key: tuple[tuple[int, str, int], ...] = ()
        self._bounds: list[tuple[int, int]] = []
        self.jit_boundary_pids: frozenset[int] = frozenset()  # the pids in all_jit_boundaries

    def preload_kernel(self) -> None:
        """Start reading and parsing kallsyms in a thread, for a caller that will name kernel
        frames soon and has other work meanwhile (a replay: the kernel generating
        /proc/kallsyms and the native parse both run without the GIL). ``kernel`` waits for
        it. Idempotent. Nothing to do when the store has this boot's image symbols: they are
        mapped, not read (an address they cannot answer loads /proc/kallsyms then)."""
        if self._kallsyms is not None or self._kallsyms_loading is not None:
            return
        if self._image() is not None:
            return
        t = threading.Thread(target=self._preload, name="unwindd-kallsyms", daemon=True)
        self._kallsyms_loading = t
        t.start()

    def _image(self) -> Kallsyms | None:
        """The store's image symbols for this boot, asked once."""
        if not self._kimage_asked:
            self._kimage_asked = True
            if self.kernel_store is not None:
                self._kimage = self.kernel_store.load()
        return self._kimage

    def _load_kallsyms(self) -> Kallsyms:
        """The table ``kernel`` asks after the store's image: with an image (stored before,
        or by this load), only what lies outside it (``outside_lines``); else the whole
        text's. The image is set here before the table is returned (``kernel`` reads it
        after its join)."""
        try:
            with open(f"{self.proc_root}/kallsyms", "rb") as f:
                text = f.read()
        except OSError:
            return Kallsyms("")
        image, store = self._kimage, self.kernel_store
        # (save never raises: False when nothing usable was written, e.g. addresses hidden)
        if image is None and store is not None and store.save(text):
            image = self._kimage = store.load()
        if image is None:
            return Kallsyms(text)
        return Kallsyms(outside_lines(text, (image.start(0), image.start(len(image) - 1))))

    def _preload(self) -> None:
        """The preload thread: its result, or nothing (``kernel`` then loads on its own
        thread, where any error surfaces as it would without a preload)."""
        try:
            self._kallsyms_loaded.append(self._load_kallsyms())
        except Exception:  # reported by kernel()'s own load
            pass

    def symbolize(self, entry: ElfEntry, vaddr: int) -> tuple[str, int] | None:
        return self.table(entry).lookup(vaddr)

    def table(self, entry: ElfEntry) -> SymbolTable:
        """The table ``symbolize`` searches for ``entry`` (filereplay hands its arrays to C)."""
        return entry.symbols()

    def kernel(self, addr: int) -> KernelSymbol | None:
        image = self._image()
        if image is not None:
            ks = image.lookup_between(addr)
            if ks is not None:
                return ks
        if self._kallsyms is None:
            t = self._kallsyms_loading
            if t is not None:
                t.join()
                self._kallsyms_loading = None
            # the thread's result, or (no thread, or it died) a load here
            self._kallsyms = (self._kallsyms_loaded.pop() if self._kallsyms_loaded
                              else self._load_kallsyms())  # fmt: skip
            if image is None and self._kimage is not None:
                return self.kernel(addr)  # the load stored the image: its table is the rest
        return self._kallsyms.lookup(addr)

    def jit(self, pid: int, addr: int) -> tuple[str, int] | None:
        pm = self._perf_maps.get(pid)
        if pm is None:
            pm = self._perf_maps[pid] = PerfMap(f"{self.tmp_dir}/perf-{pid}.map")
        return pm.lookup(addr)

    def open_jitdump(self, pid: int, path: str) -> Jitdump:
        """The jitdump ``path`` that ``pid`` maps (opened and read on first use). The path is
        the mapping's: read as it is, else through ``<proc_root>/<pid>/root`` (the process's
        own mount namespace)."""
        per = self._jitdumps.get(pid)
        if per is None:
            per = self._jitdumps[pid] = {}
        jd = per.get(path)
        if jd is None:
            local = path
            if not os.path.exists(path):
                local = f"{self.proc_root}/{pid}/root{path}"
            jd = per[path] = Jitdump(local)
            jd.refresh()
        return jd

    def jitdump(self, pid: int, path: str, addr: int, time: int | None
                ) -> tuple[str, int] | None:  # fmt: skip
        """``addr`` named from the jitdump ``path`` that ``pid`` maps, as of sample time
        ``time`` (jitdump.JitCodeTable.lookup)."""
        return self.open_jitdump(pid, path).lookup(addr, time)

    def has_jitdump(self, pid: int | None) -> bool:
        return pid in self._jitdumps

    def jit_boundaries(self, pid: int) -> list[int]:
        """The replacement times of ``pid``'s jitdumps (JitCodeTable.boundaries), sorted."""
        per = self._jitdumps.get(pid)
        if not per:
            return []
        if len(per) == 1:
            return next(iter(per.values())).table.boundaries()
        return sorted(t for jd in per.values() for t in jd.table.boundaries())

    def all_jit_boundaries(self) -> list[tuple[int, int]]:
        """(time, pid) of every replacement in every jitdump open, sorted; cached until a
        dump changes."""
        key = tuple((pid, path, jd.version) for pid, per in self._jitdumps.items()
                    for path, jd in per.items())  # fmt: skip
        if key != self._bounds_key:
            self._bounds_key = key
            self._bounds = sorted((t, pid) for pid in self._jitdumps
                                  for t in self.jit_boundaries(pid))  # fmt: skip
            self.jit_boundary_pids = frozenset(pid for _, pid in self._bounds)
        return self._bounds

    def refresh_jitdumps(self) -> list[int]:
        """Read on every jitdump open; the pids whose dump changed since the last call (here
        or in a lookup)."""
        out = []
        for pid, per in self._jitdumps.items():
            grew = False
            for jd in per.values():
                jd.refresh()
                grew |= jd.changed
                jd.changed = False
            if grew:
                out.append(pid)
        return out

    def jitdump_counts(self) -> dict[str, int]:
        """Jitdump files opened, their records by kind ("record_<kind>") and their errors
        by kind ("error_<kind>"), over every dump read so far."""
        c = Counter(self._jitdump_retired)
        for per in list(self._jitdumps.values()):
            for jd in list(per.values()):
                c.update(_dump_counts(jd))
        return dict(c)

    def forget_pid(self, pid: int) -> None:
        self._perf_maps.pop(pid, None)
        for jd in self._jitdumps.pop(pid, {}).values():
            self._jitdump_retired.update(_dump_counts(jd))


def _dump_counts(jd: Jitdump) -> Counter[str]:
    c: Counter[str] = Counter(files=1, dropped=jd.table.dropped)
    c.update({f"record_{k}": n for k, n in jd.parser.records.items()})
    c.update({f"error_{k}": n for k, n in jd.parser.errors.items()})
    return c
