"""/proc/<pid>/maps text -> ``Mapping`` values.

Invariants:
- Sans-IO: text in, values out; the caller reads the file (procscan.py) and decides what to do
  with the mappings (ProcessTable.load_mappings merges them).
- Every mapping of the text is returned, executable or not, in the kernel's order (sorted,
  disjoint); the caller filters on ``prot & PROT_EXEC``. Malformed lines are skipped, never
  an error: the file can change under a reader.
- The identity is device + inode (no build-id in maps); inode 0 (anonymous) has none.
- Cost: O(lines), one split per line.
"""

from __future__ import annotations

from .mapping import (
    MAP_PRIVATE,
    MAP_SHARED,
    NO_IDENTITY,
    PROT_EXEC,
    PROT_READ,
    PROT_WRITE,
    Identity,
    Mapping,
)

__all__ = ["parse_maps_line", "parse_proc_maps"]


def parse_proc_maps(text: str) -> list[Mapping]:
    """The mappings of a /proc/<pid>/maps text, one per line (``parse_maps_line``);
    malformed lines are skipped."""
    return [m for m in map(parse_maps_line, text.splitlines()) if m is not None]


def parse_maps_line(line: str) -> Mapping | None:
    """One line of /proc/<pid>/maps, or a mapping's header line in /proc/<pid>/smaps
    (fs/proc/task_mmu.c show_map_vma)::

        start-end perms offset maj:min inode [pathname]
        55a966728000-55a96672d000 r-xp 00002000 fe:00 260131   /usr/bin/cat

    all hex except the decimal inode; the pathname may contain spaces and ends with
    `` (deleted)`` for an unlinked file. None for a malformed line (or an smaps field line)."""
    parts = line.split(maxsplit=5)
    if len(parts) < 5:
        return None
    try:
        lo, hi = (int(x, 16) for x in parts[0].split("-", 1))
        perms = parts[1]
        pgoff = int(parts[2], 16)
        maj, mnr = (int(x, 16) for x in parts[3].split(":", 1))
        ino = int(parts[4])
    except ValueError:
        return None
    if len(perms) < 4:
        return None
    prot = ((PROT_READ if perms[0] == "r" else 0) | (PROT_WRITE if perms[1] == "w" else 0)
            | (PROT_EXEC if perms[2] == "x" else 0))  # fmt: skip
    flags = MAP_SHARED if perms[3] == "s" else MAP_PRIVATE
    name = parts[5].rstrip("\n") if len(parts) > 5 else ""
    ident = Identity(None, maj, mnr, ino, None) if ino else NO_IDENTITY
    return Mapping(lo, hi, pgoff, prot, flags, name, ident)
