"""Waiting on a real child process's /proc state.

Invariants:
- A wait either returns the state it waited for or raises naming what never came: a test
  never goes on with a half-started process (a silent fall-through compares against it).
- Polls every 10 ms, for at most 2 s on an exec's mappings (a loaded machine delays an exec
  by tens of ms), 30 s on a profiler's start (a Python CLI's imports under load) and 60 s on
  a busy process's CPU time (what a loaded machine gives it).
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import time
from pathlib import Path
from typing import IO, Any


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


def wait_stderr_line(proc: subprocess.Popen[str], pattern: str, timeout: float = 30) -> list[str]:
    """``proc``'s stderr lines (a text pipe) up to and including the first that matches
    ``pattern`` (re.match); fails at once if stderr ends (the process exited) first."""
    stream: IO[str] | None = proc.stderr
    assert stream is not None, "stderr must be a pipe"
    got: list[str] = []
    # poll, not select: a test process holding many fds (ELF cache entries keep theirs open)
    # gets pipe fds past select()'s FD_SETSIZE of 1024
    poller = select.poll()
    poller.register(stream, select.POLLIN)
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        # a whole line is in once the fd is readable: the lines waited for are flushed whole
        if not poller.poll(int(left * 1000) + 1):
            continue
        line = stream.readline()
        if not line:
            rc = proc.poll()
            raise AssertionError(f"{proc.pid} ended stderr (rc {rc}) before {pattern!r}: {got}")
        got.append(line)
        if re.match(pattern, line):
            return got
    raise AssertionError(f"no {pattern!r} from {proc.pid} on stderr: {got}")


def cpu_seconds(pid: int) -> float:
    """The CPU time ``pid`` has used (utime + stime of all its threads, /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    # after the comm: state is field 3 of proc(5), utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_cpu_seconds(pid: int, seconds: float) -> None:
    """Until busy process ``pid`` has used ``seconds`` more CPU time than now: a sampler then
    has had that much of its running to sample, however long a loaded machine took to give
    it (a wall-clock sleep gives no such bound). Up to 60 s."""
    start = cpu_seconds(pid)
    for _ in range(6000):
        if cpu_seconds(pid) - start >= seconds:
            return
        time.sleep(0.01)
    raise AssertionError(f"{pid} used {cpu_seconds(pid) - start:.2f} s of CPU, not {seconds}")
