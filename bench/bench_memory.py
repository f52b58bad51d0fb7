"""What a running daemon's RSS is: its mappings by kind, from /proc/<pid>/smaps and the
mappings' own bytes (/proc/<pid>/mem), without stopping or instrumenting it.

    python3 bench/bench_memory.py PID [--cache-dir DIR] [--regions 12]

Kinds: the cache dir's mapped tables (sym, srcline, cfi), other files (libraries, the
executable, ELF files being read), glibc's main heap (``[heap]``), glibc thread arenas
(64 MiB-aligned heaps, glibc malloc/arena.c HEAP_MAX_SIZE), CPython's small-object arenas
(pymalloc: 16 KiB pools, each opening with a pool header, Objects/obmalloc.c struct
pool_header; adjacent 1 MiB arenas merge into one mapping, so one region may be many arenas),
thread stacks (a mapping right after a guard page) and other anonymous memory (large
allocations glibc mmaps on their own). A region is counted as pymalloc when most of its
16 KiB-aligned resident blocks read as pool headers. Prints the RSS of each kind and the
largest anonymous regions with their kind. Root (or the daemon's uid) is needed to read
/proc/<pid>/mem.
"""

from __future__ import annotations

import argparse
import struct
from collections import Counter
from dataclasses import dataclass, field

POOL = 16 << 10  # CPython 3.10+ POOL_SIZE (POOL_BITS 14)
THREAD_HEAP = 64 << 20  # glibc HEAP_MAX_SIZE on 64-bit (2 * DEFAULT_MMAP_THRESHOLD_MAX)
# struct pool_header: ref, freeblock, nextpool, prevpool (8 bytes each), arenaindex, szidx,
# nextoffset, maxnextoffset (uint each)
_POOL_HEAD = struct.Struct("<QQQQIIII")


@dataclass
class Region:
    start: int
    end: int
    perm: str
    name: str
    kb: dict[str, int] = field(default_factory=dict)

    @property
    def rss(self) -> int:
        return self.kb.get("Rss", 0)


def read_smaps(pid: int) -> list[Region]:
    regions: list[Region] = []
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if "-" in head[0] and not head[0].endswith(":"):
                a, b = (int(x, 16) for x in head[0].split("-"))
                regions.append(Region(a, b, head[1], head[5].strip() if len(head) > 5 else ""))
            elif len(head) >= 3 and head[2] == "kB":
                regions[-1].kb[head[0].rstrip(":")] = int(head[1])
    return regions


def _is_pool(head: bytes, lo: int, hi: int) -> bool:
    """Whether ``head`` reads as a pymalloc pool header of a pool inside [lo, hi)."""
    if len(head) < _POOL_HEAD.size:
        return False
    _, freeblock, nxt, prv, _, szidx, nextoffset, maxnext = _POOL_HEAD.unpack_from(head)
    return (szidx < 64 and 0 < nextoffset <= POOL and 0 < maxnext <= POOL
            and all(p == 0 or p > 4096 for p in (freeblock, nxt, prv)))  # fmt: skip


def pool_share(mem: object, r: Region) -> float:
    """The share of ``r``'s 16 KiB-aligned blocks whose first bytes read as a pool header."""
    first = -r.start % POOL + r.start
    n = hits = 0
    for a in range(first, r.end - POOL + 1, POOL):
        try:
            mem.seek(a)  # type: ignore[attr-defined]
            head = mem.read(_POOL_HEAD.size)  # type: ignore[attr-defined]
        except OSError:
            continue
        if head == bytes(len(head)):
            continue  # never touched (or a free, zeroed page): not counted either way
        n += 1
        hits += _is_pool(head, r.start, r.end)
    return hits / n if n else 0.0


def classify(pid: int, cache_dir: str | None) -> list[tuple[str, Region]]:
    regions = read_smaps(pid)
    out: list[tuple[str, Region]] = []
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for i, r in enumerate(regions):
            name = r.name
            if cache_dir and name.startswith(cache_dir):
                sub = name[len(cache_dir):].lstrip("/").split("/", 1)[0]
                kind = f"file: cache {sub}"
            elif name == "[heap]":
                kind = "anon: glibc main heap [heap]"
            elif name.startswith("["):
                kind = f"other: {name}"
            elif name:
                kind = "file: libraries, executable, other files"
            elif "w" not in r.perm:
                kind = "anon: guard or reserved (no RSS)"
            elif r.start % THREAD_HEAP == 0 and i + 1 < len(regions) \
                    and regions[i + 1].start == r.end and regions[i + 1].perm.startswith("---"):
                kind = "anon: glibc thread arena"
            elif i > 0 and regions[i - 1].end == r.start and regions[i - 1].perm.startswith("---") \
                    and not regions[i - 1].name and r.end - r.start <= (8 << 20) + 4096:
                kind = "anon: thread stack"
            elif r.rss and pool_share(mem, r) > 0.5:
                kind = "anon: pymalloc arenas"
            else:
                kind = "anon: other (glibc mmap'd blocks, buffers)"
            out.append((kind, r))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pid", type=int)
    ap.add_argument("--cache-dir", help="the daemon's [cache] dir (its tables' mappings)")
    ap.add_argument("--regions", type=int, default=12, help="largest anonymous regions shown")
    args = ap.parse_args()
    got = classify(args.pid, args.cache_dir)
    by_kind: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for kind, r in got:
        by_kind[kind] += r.rss
        count[kind] += 1
    total = sum(by_kind.values())
    print(f"pid {args.pid}: RSS {total / 1024:.1f} MiB")
    for kind, kb in by_kind.most_common():
        if kb:
            print(f"  {kb / 1024:8.1f} MiB  {count[kind]:5d} mappings  {kind}")
    print("largest anonymous regions:")
    anon = sorted((x for x in got if x[0].startswith("anon")), key=lambda x: -x[1].rss)
    for kind, r in anon[: args.regions]:
        print(f"  {r.start:x}-{r.end:x} size {(r.end - r.start) >> 10:8d} kB  "
              f"rss {r.rss:8d} kB  {kind}")  # fmt: skip


if __name__ == "__main__":
    main()
