"""What this process has resident of a file it mapped, read from /proc/self/smaps: the tests
of the mapped cache tables (what their loads, lookups and releases leave in the RSS)."""

from __future__ import annotations


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
