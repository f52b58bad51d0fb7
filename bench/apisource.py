"""What the query benches (bench_query.py, bench_queries.py) give ``serve.api.Api`` in place of
the daemon: one store or snapshot, a fixed time, every pid visible."""

from __future__ import annotations

from typing import Any


class QuerySource:
    """What ``Api`` reads of the daemon, over one store (or snapshot) at a fixed time: every
    pid visible (uid 0)."""

    def __init__(self, store: Any, now_ns: int) -> None:
        self.store = store
        self.period_ns = 1_000_000
        self.max_stacks = 100_000
        self._now = now_ns

    def status(self) -> dict[str, Any]:
        return {}

    def now_ns(self) -> int:
        return self._now

    def uid_of(self, pid: int) -> int | None:
        return 0

    def exe_of(self, pid: int) -> str | None:
        return None
