"""Names for frames (``Symbolizer``): user frames through their binary's symbol table, kernel
frames through kallsyms, JIT frames through the pid's perf map.

Rules:
- A user frame is named by (ELF cache entry, ELF vaddr): the entry's table, built once per
  binary (elfsyms, or read back by symstore) and shared by every pid that maps it.
- Kernel symbols are loaded once: on first use, or ahead of it in a thread
  (``preload_kernel``) that the first use waits for; a failed preload is retried there, where
  any error surfaces. Unreadable kallsyms name nothing.
- A pid's perf map is kept until ``forget_pid``.
- Not thread-safe apart from that preload: one owner calls it.

Cost: a user lookup is one bisect; a JIT lookup one stat and one bisect; a kernel lookup one
bisect after one kallsyms parse per Symbolizer.
"""

from __future__ import annotations

import threading

from .elfentry import ElfEntry
from .kallsyms import Kallsyms, KernelSymbol
from .perfmaps import PerfMap
from .symtab import SymbolTable

__all__ = ["Symbolizer"]


class Symbolizer:
    """Names for frames: binaries through their cache entries, kernel through kallsyms, JIT
    through perf maps. ``tmp_dir`` and ``proc_root`` are injectable for tests."""

    def __init__(self, *, proc_root: str = "/proc", tmp_dir: str = "/tmp") -> None:
        self.proc_root = proc_root
        self.tmp_dir = tmp_dir
        self._kallsyms: Kallsyms | None = None
        self._kallsyms_loading: threading.Thread | None = None
        self._kallsyms_loaded: list[Kallsyms] = []
        self._perf_maps: dict[int, PerfMap] = {}

    def preload_kernel(self) -> None:
        """Start reading and parsing kallsyms in a thread, for a caller that will name kernel
        frames soon and has other work meanwhile (a replay: the kernel generating
        /proc/kallsyms and the native parse both run without the GIL). ``kernel`` waits for
        it. Idempotent."""
        if self._kallsyms is not None or self._kallsyms_loading is not None:
            return
        t = threading.Thread(target=self._preload, name="unwindd-kallsyms", daemon=True)
        self._kallsyms_loading = t
        t.start()

    def _load_kallsyms(self) -> Kallsyms:
        try:
            return Kallsyms.load(self.proc_root)
        except OSError:
            return Kallsyms("")

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
        if self._kallsyms is None:
            t = self._kallsyms_loading
            if t is not None:
                t.join()
                self._kallsyms_loading = None
            # the thread's result, or (no thread, or it died) a load here
            self._kallsyms = (self._kallsyms_loaded.pop() if self._kallsyms_loaded
                              else self._load_kallsyms())  # fmt: skip
        return self._kallsyms.lookup(addr)

    def jit(self, pid: int, addr: int) -> tuple[str, int] | None:
        pm = self._perf_maps.get(pid)
        if pm is None:
            pm = self._perf_maps[pid] = PerfMap(f"{self.tmp_dir}/perf-{pid}.map")
        return pm.lookup(addr)

    def forget_pid(self, pid: int) -> None:
        self._perf_maps.pop(pid, None)
