"""Per-pid facts the API's visibility rules need (the real uid and the executable), read from
/proc while the process lives and kept while the store holds its samples.

Invariants:
- Sans-IO: the caller passes the time and a ``read(pid)`` that returns (uid, exe) from /proc
  (None for what it could not read); this module never reads a clock or a file.
- A pid's facts are re-read at most once per ``ttl`` seconds. A read that finds the process
  gone (uid None) keeps the facts it had: its stored samples still belong to that uid.
- Bounded without forgetting what answers need: when the table reaches its limit, the
  entries of pids the store no longer holds (``held``) whose facts are past their ``ttl`` are
  dropped; a held pid's entry is never dropped (the store's byte bound bounds its pids, so
  these are bounded too). The limit is then at least twice what was kept, so pruning is
  amortized O(1) per insertion.
- Any thread: one dict read per lookup; a prune replaces the dict whole (a reader on another
  thread sees the old or the new one, both valid).
Cost: O(1) per lookup and per read; a prune O(entries).
"""

from __future__ import annotations

from collections.abc import Callable

Facts = tuple[int | None, str | None]  # real uid, executable path

__all__ = ["Facts", "ProcFacts"]


class ProcFacts:
    def __init__(self, read: Callable[[int], Facts], held: Callable[[int], bool], *,
                 max_entries: int = 4096) -> None:  # fmt: skip
        if max_entries <= 0:
            raise ValueError("max_entries must be > 0")
        self._read = read
        self._held = held
        self.max_entries = max_entries
        self._limit = max_entries
        self._facts: dict[int, tuple[int | None, str | None, float]] = {}  # pid -> facts, until
        self.prunes = 0

    def __len__(self) -> int:
        return len(self._facts)

    def get(self, pid: int, now: float, ttl: float) -> Facts:
        """``pid``'s (uid, exe): cached until ``now`` passes its expiry, else read again."""
        facts = self._facts
        hit = facts.get(pid)
        if hit is not None and hit[2] > now:
            return hit[0], hit[1]
        uid, exe = self._read(pid)
        if uid is None and hit is not None:
            uid, exe = hit[0], hit[1]  # exited: its stored samples keep the uid it had
        if hit is None and len(facts) >= self._limit:
            facts = self._prune(now)
        facts[pid] = (uid, exe, now + ttl)
        return uid, exe

    def _prune(self, now: float) -> dict[int, tuple[int | None, str | None, float]]:
        held = self._held
        kept = {p: v for p, v in self._facts.items() if v[2] > now or held(p)}
        self._facts = kept
        self._limit = max(self.max_entries, 2 * len(kept))
        self.prunes += 1
        return kept
