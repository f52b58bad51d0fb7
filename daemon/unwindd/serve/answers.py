"""The answer cache: identical store queries within a short time share one answer.

Rules:
- Only GET ``/v1/stacks``, ``/v1/top`` and ``/v1/processes`` are cached (``CACHED_PATHS``),
  keyed by (request target, peer uid), so one uid never sees an answer filtered for another.
  Status is never cached (it is cheap and reload tests read it back at once).
- An answer lives ``ANSWER_TTL`` seconds: a burst of dashboards or scripts costs one pass over
  the store, not one each. Only 200 answers held whole are kept: a ``ChunkedResponse`` (a
  JSON stacks answer past one chunk, api.py) is written as it is rendered and never held, so
  each such query renders its own.
- Bounded: at most ``MAX_ANSWERS``, none kept past its TTL for long: expired answers go at
  every ``put`` and every ``expire`` (the daemon's, with each heap trim), so a body (up to
  megabytes: a pprof or folded answer) is not held after its time; when the cache is full of
  live answers, new ones are not kept until some expire.
- Used on the event loop only (no lock); a cache hit is O(1), a put or an expire
  O(``MAX_ANSWERS``).
"""

from __future__ import annotations

from .httpapi import ChunkedResponse, Request, Response, StreamStart

ANSWER_TTL = 0.5
MAX_ANSWERS = 64
CACHED_PATHS = frozenset({"/v1/stacks", "/v1/top", "/v1/processes"})

AnswerKey = tuple[str, int | None]  # request target, peer uid


def cacheable(req: Request) -> bool:
    return req.method == "GET" and req.path in CACHED_PATHS


class AnswerCache:
    def __init__(self) -> None:
        self._answers: dict[AnswerKey, tuple[float, Response]] = {}

    def get(self, key: AnswerKey, now: float) -> Response | None:
        """The answer to the same query from the same uid, if younger than ANSWER_TTL."""
        hit = self._answers.get(key)
        if hit is None or hit[0] <= now:
            return None
        return hit[1]

    def __len__(self) -> int:
        return len(self._answers)

    def put(self, key: AnswerKey, res: Response | ChunkedResponse | StreamStart,
            now: float) -> None:  # fmt: skip
        """Keep a 200 answer for ANSWER_TTL; at most MAX_ANSWERS answers (expired ones go
        first, then new ones are not kept until some expire). A ``ChunkedResponse`` is never
        kept: it is never held whole."""
        self.expire(now)
        if not isinstance(res, Response) or res.status != 200:
            return
        if len(self._answers) < MAX_ANSWERS:
            self._answers[key] = (now + ANSWER_TTL, res)

    def expire(self, now: float) -> None:
        """Drop the answers whose TTL has passed."""
        if any(v[0] <= now for v in self._answers.values()):
            self._answers = {k: v for k, v in self._answers.items() if v[0] > now}
