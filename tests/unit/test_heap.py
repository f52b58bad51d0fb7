"""serve/heap.py on the real glibc, each case in a fresh interpreter (mallopt settings are
process-wide and stay):

- ``limit_arenas`` fixes the mmap threshold: after a big block is freed, a block of a
  quarter of its size is still mmapped on its own (mallinfo2 ``hblkhd``) and its pages go
  back at its free, where glibc's own adjustment would have raised the threshold past it
  and served it from an arena.
- ``Trimmer.maybe`` trims at most once per interval and releases the mapped cache tables
  with the heap (their count and bytes kept for /v1/status), and between trims releases the
  tables alone every ``release_interval``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from smaps import in_child, resident_kb
from unwindd.serve import heap

pytestmark = pytest.mark.skipif(heap.stats() is None, reason="needs glibc >= 2.33")

# After a 16 MiB block is mmapped and freed: mallinfo2's mapped bytes while a 4 MiB block is
# held, and the process's RSS (statm) while it is held, written to, and after its free.
_PROBE = """
import json, os, sys
from unwindd.serve import heap
if sys.argv[1] == "limit":
    assert heap.limit_arenas()
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * page
big = bytearray(16 << 20)
del big
block = bytearray(4 << 20)
block[::4096] = b"x" * len(block[::4096])
held, rss_held = heap.stats().mapped, rss()
del block
print(json.dumps({"mapped": held, "rss_held": rss_held, "rss_freed": rss()}))
"""


def _probe(mode: str) -> dict[str, int]:
    root = Path(heap.__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                       env=env, check=True)  # fmt: skip
    return dict(json.loads(r.stdout))


def test_limit_arenas_keeps_big_blocks_mmapped_after_a_bigger_free() -> None:
    fixed = _probe("limit")
    assert fixed["mapped"] >= 4 << 20, fixed
    # its pages went back at its free: no trim needed
    assert fixed["rss_held"] - fixed["rss_freed"] >= 3 << 20, fixed
    # glibc's own adjustment (no limit_arenas): the 16 MiB free raised the threshold past
    # 4 MiB, so the block came from the heap (what the fixed threshold is for)
    dynamic = _probe("default")
    assert dynamic["mapped"] < 4 << 20, dynamic


def test_trimmer_trims_once_per_interval_and_releases_mapped_tables(tmp_path: Path) -> None:
    from unwindd.binaries.cachefiles import map_cache_file

    p = tmp_path / "t"
    p.write_bytes(b"y" * (256 << 10))
    got = map_cache_file(str(p), 1 << 20)
    assert got is not None
    t = heap.Trimmer(interval=10.0)
    assert t.maybe(now=100.0) and t.trims == 1
    assert t.mapped_tables >= 1 and t.mapped_bytes >= 256 << 10
    assert not t.maybe(now=105.0) and t.trims == 1
    assert t.maybe(now=110.0) and t.trims == 2
    del got


def test_trimmer_releases_the_tables_between_trims(tmp_path: Path) -> None:
    from unwindd.binaries.cachefiles import checksum, map_cache_file

    p = tmp_path / "t"
    p.write_bytes(b"z" * (1 << 20))
    got = map_cache_file(str(p), 2 << 20)
    assert got is not None
    t = heap.Trimmer(interval=10.0, release_interval=1.0)
    assert t.maybe(now=100.0) and t.trims == 1
    checksum(got[1])  # every page read: mapped again
    assert resident_kb(str(p)) >= 1000
    assert not t.due(100.5) and not t.maybe(now=100.5)
    assert resident_kb(str(p)) >= 1000
    assert t.due(101.0)
    assert not t.maybe(now=101.0) and t.trims == 1  # released, not trimmed
    assert resident_kb(str(p)) < 100 and t.mapped_tables >= 1
    assert t.maybe(now=110.0) and t.trims == 2
    del got



def test_trimmer_releases_hot_tables_at_their_own_pace(tmp_path: Path) -> None:
    from unwindd.binaries.cachefiles import checksum, map_cache_file

    cold, hot = tmp_path / "cold", tmp_path / "hot"
    for p in (cold, hot):
        p.write_bytes(b"c" * (1 << 20))
    gc_, gh = map_cache_file(str(cold), 2 << 20), map_cache_file(str(hot), 2 << 20, hot=True)
    assert gc_ is not None and gh is not None
    t = heap.Trimmer(interval=10.0, release_interval=0.1, hot_release_interval=1.0)
    assert t.maybe(now=100.0)
    checksum(gc_[1]), checksum(gh[1])
    assert resident_kb(str(cold)) >= 1000 and resident_kb(str(hot)) >= 1000
    assert not t.maybe(now=100.5)  # the cold tables only
    assert resident_kb(str(cold)) < 100 and resident_kb(str(hot)) >= 1000
    assert not t.maybe(now=101.0)  # the hot ones' period is up too
    assert resident_kb(str(hot)) < 100
    checksum(gh[1])
    assert t.maybe(now=110.0) and resident_kb(str(hot)) < 100
    del gc_, gh


def _code_pages_at_trims() -> None:
    from unwindd.serve.codepages import CodePages

    code = CodePages()
    t = heap.Trimmer(interval=10.0, release_interval=0.1, code=code)
    assert t.maybe(now=100.0) and code.mappings >= 2 and code.nbytes >= 1 << 20
    code.mappings = code.nbytes = 0
    assert not t.maybe(now=100.5) and code.mappings == 0  # the tables only
    assert t.maybe(now=110.0) and code.mappings >= 2
    assert heap.Trimmer().code is None  # (only the daemon's, which passes one)


def test_trimmer_releases_its_code_pages_at_each_trim() -> None:
    in_child(_code_pages_at_trims)


def test_trimmer_releases_the_tables_at_the_drain_ticks_pace() -> None:
    # A lookup's fault maps the cached pages around it too, so the tables' share of the RSS is
    # what one release period's lookups touched: the default period is no longer than the
    # drain tick, the pace at which new frames are named.
    from unwindd.serve.config import DaemonSection

    assert heap.Trimmer().release_interval <= DaemonSection().tick_ms / 1000
