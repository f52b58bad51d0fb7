"""Waiting on a real child process's /proc state.

Invariants:
- A wait either returns the state it waited for or raises naming what never came: a test
  never goes on with a half-started process (a silent fall-through compares against it).
- Polls every 10 ms, for at most 2 s on an exec's mappings (a loaded machine delays an exec
  by tens of ms) and 30 s on a profiler's start (a Python CLI's imports under load).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any


def wait_mapped(pid: int, needle: str) -> str:
    """The maps text once an *executable* mapping naming ``needle`` is in it. Waiting for the
    name alone raced ld.so: it maps a library's first (read-only) segment, then the text
    segment, so the name shows up before the mapping the process table keeps (CI saw a libc
    refcount of 2 for 3 processes)."""
    for _ in range(200):
        maps = Path(f"/proc/{pid}/maps").read_text()
        if any(needle in line and "x" in line.split(maxsplit=2)[1] for line in maps.splitlines()):
            return maps
        time.sleep(0.01)
    raise AssertionError(f"{needle} never mapped in {pid}")


def wait_perf_fds(pid: int, n: int, proc: subprocess.Popen[Any] | None = None) -> None:
    """Until process ``pid`` holds ``n`` perf event fds (``anon_inode:[perf_event]``): a
    profiler that opens one event per CPU has its session open then. Up to 30 s (a Python
    CLI's imports under load take seconds); fails at once if ``proc`` exits first."""
    for _ in range(3000):
        fds = Path(f"/proc/{pid}/fd")
        have = 0
        for fd in fds.iterdir():
            try:
                have += os.readlink(fd) == "anon_inode:[perf_event]"
            except FileNotFoundError:  # closed while listed
                pass
        if have >= n:
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{pid} exited ({proc.returncode}) before opening {n} perf fds")
        time.sleep(0.01)
    raise AssertionError(f"{pid} never held {n} perf event fds")
