"""What this process has resident of a file it mapped, read from /proc/self/smaps: the tests
of the mapped cache tables (what their loads, lookups and releases leave in the RSS); and
``in_child``, for a test that drops pages of its own process's mappings."""

from __future__ import annotations

import multiprocessing
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


def in_child(body: Callable[..., None], *args: object) -> None:
    """Run ``body`` in a forked child and require it to end well: a release that discarded
    the process's own private copies (serve/codepages.py's one danger) crashes the child,
    failing the test, not the test run."""
    child = multiprocessing.get_context("fork").Process(target=body, args=args)
    child.start()
    child.join(120)
    assert child.exitcode == 0, f"the child ended with {child.exitcode}"
