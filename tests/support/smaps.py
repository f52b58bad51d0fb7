"""What this process has resident of a file it mapped, read from /proc/self/smaps: the tests
of the mapped cache tables (what their loads, lookups and releases leave in the RSS); what
the page cache holds of a file (``cached_pages``); and ``in_child``, for a test that drops
pages of its own process's mappings."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import os
from collections.abc import Callable


def resident_kb(path: str) -> int:
    """Rss (kB) of this process's mappings of ``path`` (/proc/self/smaps)."""
    kb, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = len(head) == 6 and head[5].strip() == path
            elif inside and head[0] == "Rss:":
                kb += int(head[1])
    return kb


def cached_pages(path: str) -> int:
    """Pages of ``path`` in the page cache (mincore(2) on a fresh mapping of it: a file
    mapping's vector says which pages the page cache holds, mm/mincore.c mincore_page),
    whatever any process has mapped."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = os.path.getsize(path)
    npages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        vec = ctypes.create_string_buffer(npages)
        assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        return sum(b & 1 for b in vec.raw[:npages])
    finally:
        libc.munmap(addr, size)


def in_child(body: Callable[..., None], *args: object) -> None:
    """Run ``body`` in a forked child and require it to end well: a release that discarded
    the process's own private copies (serve/codepages.py's one danger) crashes the child,
    failing the test, not the test run."""
    child = multiprocessing.get_context("fork").Process(target=body, args=args)
    child.start()
    child.join(120)
    assert child.exitcode == 0, f"the child ended with {child.exitcode}"
