"""Address-space values: what one mapping is, and the arithmetic of mappings over each other.

Invariants:
- Values only: frozen dataclasses and pure functions over sorted, disjoint mapping sequences
  (each with the list of its start addresses, kept beside it by the caller). Nothing here
  holds state or touches a file.
- A ``Mapping`` is [start, end) of ``filename`` from file offset ``pgoff``; its ``bias`` maps a
  runtime address to the ELF vaddr symbol tables and CFI are keyed by (runtime = vaddr + bias).
  ``entry`` (the binary, an ELF cache entry) is not part of its equality.
- ``Identity`` is what a record says the mapped file is: build-id, or device + inode.
- A new mapping removes what it overlaps, keeping the non-overlapped head and tail pieces
  (tail pgoff advanced by the cut, bias unchanged), like perf's maps__fixup_overlappings
  (tools/perf/util/maps.c): ``cut``. ``holes`` is the other direction: the parts of new
  mappings that no existing one covers.
- Cost: ``find_mapping`` is one bisect, O(log n); ``overlapping`` O(log n + overlaps) (a new
  mapping over nothing, most MMAP2 records, costs one bisect); ``cut`` O(n) for the copy;
  ``holes`` O(n + m).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from ..binaries.elfentry import ElfEntry
from ..lightdc import dataclass, field, replace
from ..source.records import frozen_maker

__all__ = [
    "MAP_PRIVATE",
    "MAP_SHARED",
    "NO_IDENTITY",
    "PROT_EXEC",
    "PROT_READ",
    "PROT_WRITE",
    "Identity",
    "Mapping",
    "cut",
    "find_mapping",
    "holes",
    "make_mapping",
    "overlapping",
]

PROT_READ, PROT_WRITE, PROT_EXEC = 1, 2, 4
MAP_SHARED, MAP_PRIVATE = 1, 2


@dataclass(frozen=True, slots=True)
class Identity:
    """What the record says the mapped file is: build-id, or device + inode."""

    build_id: bytes | None = None
    maj: int | None = None
    min: int | None = None
    ino: int | None = None
    ino_generation: int | None = None

    def __repr__(self) -> str:
        if self.build_id:
            return f"Identity({self.build_id.hex()})"
        if self.ino is not None:
            return f"Identity({self.maj:x}:{self.min:x} ino={self.ino})"
        return "Identity()"


NO_IDENTITY = Identity()


@dataclass(frozen=True, slots=True)
class Mapping:
    """[start, end) of ``filename`` from file offset ``pgoff``; runtime = ELF vaddr + bias."""

    start: int
    end: int
    pgoff: int
    prot: int
    flags: int
    filename: str
    identity: Identity = NO_IDENTITY
    entry: ElfEntry | None = field(default=None, compare=False)
    bias: int = 0

    def __repr__(self) -> str:
        return (
            f"Mapping({self.start:#x}-{self.end:#x} pgoff={self.pgoff:#x} prot={self.prot} "
            f"{self.filename!r} bias={self.bias:#x})"
        )

    def __contains__(self, addr: int) -> bool:
        return self.start <= addr < self.end

    @property
    def anonymous(self) -> bool:
        """Memory without a file as perf tells it (util/map.c map__new: is_anon_memory,
        is_no_dso_memory), whose addresses perf shows as they are (identity__map_ip), not as
        ``ip - start + pgoff``: "//anon" (in /proc/<pid>/maps an empty or "[anon:...]" name),
        /dev/zero, /anon_hugepage, [stack, /SYSV, [heap]. Not "[vdso]" or the kernel's other
        named mappings: perf maps those as it maps files, so the same vdso code shows the same
        address in every process, wherever the kernel put the vdso."""
        return self.filename == "" or self.filename.startswith(_ANON_NAMES)

    def vaddr(self, addr: int) -> int:
        """ELF vaddr (what symbol tables and CFI are keyed by) of runtime ``addr``."""
        return addr - self.bias


_ANON_NAMES = ("//anon", "[anon:", "/dev/zero", "/anon_hugepage", "[stack", "/SYSV", "[heap]")


def find_mapping(starts: Sequence[int], mappings: Sequence[Mapping], addr: int) -> Mapping | None:
    """The mapping of sorted, disjoint ``mappings`` (``starts`` their start addresses) that
    contains ``addr``, or None. One bisect: O(log n)."""
    i = bisect_right(starts, addr) - 1
    if i >= 0:
        m = mappings[i]
        if addr < m.end:
            return m
    return None


# Mapping(start, end, pgoff, prot, flags, filename, identity, entry, bias), cheaper than
# its __init__: one per executable MMAP2 (records.frozen_maker)
make_mapping = frozen_maker(Mapping)


def overlapping(starts: Sequence[int], mappings: Sequence[Mapping], start: int, end: int
             ) -> tuple[int, int]:  # fmt: skip
    """[lo, hi): the indices of sorted, disjoint ``mappings`` (``starts`` their starts) that
    overlap [start, end). lo == hi (the insertion point) when none does. O(log n + overlaps):
    the common MMAP2 (a new mapping over nothing) costs one bisect, not a pass over the space."""
    lo = bisect_right(starts, start)
    if lo and mappings[lo - 1].end > start:
        lo -= 1  # the one starting at or before start reaches into [start, end)
    hi = lo
    n = len(mappings)
    while hi < n and mappings[hi].start < end:
        hi += 1
    return lo, hi


def cut(
    mappings: Sequence[Mapping], start: int, end: int, starts: Sequence[int] | None = None
) -> tuple[list[Mapping], list[Mapping], list[Mapping]]:
    """maps__fixup_overlappings: (mappings with [start, end) removed, removed originals,
    new head/tail pieces). Pieces keep their binary and bias (start - pgoff is unchanged);
    a tail piece's pgoff advances by what was cut. O(n) (the copy), O(log n) to find."""
    if starts is None:
        starts = [m.start for m in mappings]
    lo, hi = overlapping(starts, mappings, start, end)
    removed = list(mappings[lo:hi])
    pieces: list[Mapping] = []
    for m in removed:
        if m.start < start:
            pieces.append(replace(m, end=start))
        if m.end > end:
            pieces.append(replace(m, start=end, pgoff=m.pgoff + (end - m.start)))
    # what was removed was contiguous and the pieces lie inside its span: order is kept
    kept = [*mappings[:lo], *pieces, *mappings[hi:]]
    return kept, removed, pieces


def holes(have: Sequence[Mapping], new: Sequence[Mapping]) -> list[Mapping]:
    """The parts of ``new`` (sorted, disjoint) that no mapping in ``have`` (sorted, disjoint)
    covers; a piece keeps its mapping's bias (pgoff advances by the cut). O(n + m)."""
    out: list[Mapping] = []
    i = 0
    for m in new:
        lo = m.start
        while i < len(have) and have[i].end <= lo:
            i += 1
        j = i
        while lo < m.end:
            if j < len(have) and have[j].start < m.end:
                h = have[j]
                if h.start > lo:
                    out.append(replace(m, start=lo, end=h.start, pgoff=m.pgoff + (lo - m.start)))
                lo = max(lo, h.end)
                j += 1
            else:
                out.append(replace(m, start=lo, pgoff=m.pgoff + (lo - m.start)))
                break
    return out
