"""/proc as a source of process facts: who exists, what it is called, when it started, which
executable mappings it has. The bootstrap of the process table and every rescan read it here.

Invariants:
- Parsing is sans-IO (``parse_stat``, ``exec_mappings``): text in, frozen values out, never
  raising on malformed input (a bad line or file gives ``None`` / is skipped).
- ``ProcFS`` is the only thing that touches the file system, under an injectable ``proc_root``
  (tests use a committed fake /proc tree and the real /proc). A process may exit
  or its pid be reused between any two reads; every read tolerates that (``None``), and
  ``ProcFS.info`` reads ``stat`` before and after ``maps`` and discards the pair when the start
  time changed in between, so a snapshot never mixes two processes.
- Identity of a process = (pid, start time): ``stat`` field 22, ``starttime``, in clock ticks
  (USER_HZ) since boot (fs/proc/array.c do_task_stat: ``nsec_to_clock_t(task->start_boottime)``).
  A pid with another start time is another process (pid reuse).
- Kernel threads (PF_KTHREAD in ``stat`` field 9) have no user mappings: their ``maps`` is not
  read at all.

Cost: per process, two small ``stat`` reads and one ``maps`` read (a line per mapping;
``max_maps_bytes`` bounds it); a full scan is O(processes + their mappings), kernel threads
only their ``stat`` (test_procscan.py measures it on the real machine).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from ..lightdc import dataclass
from .mapping import PROT_EXEC, Mapping
from .procmaps import parse_proc_maps

__all__ = [
    "PF_KTHREAD",
    "ProcFS",
    "ProcInfo",
    "ProcStat",
    "exec_mappings",
    "parse_stat",
]

PF_KTHREAD = 0x00200000  # include/linux/sched.h
MAX_MAPS_BYTES = 16 << 20  # a JVM with 64k mappings is ~6 MiB of maps text


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` we use (proc(5) numbering in comments)."""

    pid: int  # (1)
    comm: str  # (2), without the parentheses, at most 15 bytes
    state: str  # (3)
    ppid: int  # (4)
    flags: int  # (9) PF_* flags
    start_time: int  # (22) clock ticks since boot

    @property
    def kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)


def parse_stat(text: str) -> ProcStat | None:
    """``pid (comm) state ppid pgrp session tty_nr tpgid flags ... starttime ...``.

    comm may contain spaces and parentheses (it is any 15 bytes the task chose), so it spans
    from the first ``(`` to the *last* ``)``; the fields after it are space separated."""
    lo = text.find("(")
    hi = text.rfind(")")
    if lo < 0 or hi < lo:
        return None
    rest = text[hi + 1 :].split()
    # rest[0] is field 3 (state), so field n is rest[n - 3]
    if len(rest) < 20:
        return None
    try:
        return ProcStat(
            pid=int(text[:lo]),
            comm=text[lo + 1 : hi],
            state=rest[0],
            ppid=int(rest[1]),
            flags=int(rest[6]),
            start_time=int(rest[19]),
        )
    except ValueError:
        return None


def exec_mappings(maps_text: str) -> tuple[Mapping, ...]:
    """The executable mappings of a maps text (data mappings are no use to an unwinder)."""
    return tuple(m for m in parse_proc_maps(maps_text) if m.prot & PROT_EXEC)


@dataclass(frozen=True, slots=True)
class ProcInfo:
    """One process as /proc showed it at one moment."""

    pid: int
    comm: str
    start_time: int
    kernel_thread: bool
    maps: tuple[Mapping, ...]  # executable only, sorted by start

    def __repr__(self) -> str:
        kind = " kthread" if self.kernel_thread else ""
        n = len(self.maps)
        return f"ProcInfo({self.pid} {self.comm!r} start={self.start_time}{kind}, {n} maps)"


class ProcFS:
    """Thin IO over ``<proc_root>``. Not thread-safe; cheap to create."""

    def __init__(self, proc_root: str = "/proc", *, max_maps_bytes: int = MAX_MAPS_BYTES) -> None:
        self.proc_root = proc_root
        self.max_maps_bytes = max_maps_bytes
        self.clk_tck = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def pids(self) -> list[int]:
        """Process ids (thread-group leaders) present now, ascending."""
        try:
            names = os.listdir(self.proc_root)
        except OSError:
            return []
        return sorted(int(n) for n in names if n.isdigit())

    def read(self, pid: int, name: str, limit: int = 1 << 16) -> str | None:
        """``<proc_root>/<pid>/<name>`` as text, at most ``limit`` bytes; None if the process
        is gone or the file unreadable."""
        try:
            fd = os.open(f"{self.proc_root}/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            chunks = []
            n = 0
            while n < limit:
                b = os.read(fd, min(1 << 16, limit - n))
                if not b:
                    break
                chunks.append(b)
                n += len(b)
        except OSError:  # ESRCH: the task died while we read
            return None
        finally:
            os.close(fd)
        return b"".join(chunks).decode("utf-8", "surrogateescape")

    def stat(self, pid: int) -> ProcStat | None:
        text = self.read(pid, "stat", 4096)
        return parse_stat(text) if text is not None else None

    def info(self, pid: int) -> ProcInfo | None:
        """A consistent snapshot of one process, or None if it is gone (or was replaced by a
        new process with the same pid while we read: two start times)."""
        st = self.stat(pid)
        if st is None:
            return None
        if st.kernel_thread:
            return ProcInfo(pid, st.comm, st.start_time, True, ())
        text = self.read(pid, "maps", self.max_maps_bytes)
        if text is None:
            return None
        again = self.stat(pid)
        if again is None or again.start_time != st.start_time:
            return None
        # /proc/<pid>/comm and stat's comm are the same task->comm (fs/proc/array.c)
        return ProcInfo(pid, again.comm, st.start_time, False, exec_mappings(text))

    def scan(self, max_processes: int | None = None) -> Iterator[ProcInfo]:
        """Every process present now (at most ``max_processes``, lowest pids first)."""
        pids = self.pids()
        if max_processes is not None:
            pids = pids[:max_processes]
        for pid in pids:
            info = self.info(pid)
            if info is not None:
                yield info

    # -- clocks

    def boot_offset_ns(self) -> int:
        """CLOCK_BOOTTIME - CLOCK_MONOTONIC now: converts perf record times (MONOTONIC) to the
        boot-time clock ``starttime`` is counted on (they differ by time spent suspended)."""
        return time.clock_gettime_ns(time.CLOCK_BOOTTIME) - time.monotonic_ns()


def ticks_from_monotonic(t_ns: int, boot_offset_ns: int, clk_tck: int) -> int:
    """The ``starttime`` (ticks since boot) of a task created at CLOCK_MONOTONIC ``t_ns``."""
    return (t_ns + boot_offset_ns) * clk_tck // 1_000_000_000
