"""The answer cache (serve/answers.py): an answer is shared only within its TTL, and one past
its TTL is not held (its body may be megabytes) once the cache is next used or expired, even
when the cache is far from full."""

from __future__ import annotations

from unwindd.serve.answers import ANSWER_TTL, MAX_ANSWERS, AnswerCache
from unwindd.serve.httpapi import ChunkedResponse, Response


def _ok(n: int) -> Response:
    return Response(200, b"x" * n, "text/plain")


def test_answers_live_for_their_ttl_and_are_dropped_after() -> None:
    c = AnswerCache()
    c.put(("/v1/stacks?format=pprof", 0), _ok(1 << 20), 100.0)
    assert c.get(("/v1/stacks?format=pprof", 0), 100.0 + ANSWER_TTL / 2) is not None
    assert c.get(("/v1/stacks?format=pprof", 0), 100.0 + ANSWER_TTL) is None
    assert c.get(("/v1/stacks?format=pprof", 1), 100.0) is None  # another uid's
    # the next put, of another query long after, drops the expired answer: not held until
    # MAX_ANSWERS of them piled up
    c.put(("/v1/top", 0), _ok(10), 200.0)
    assert len(c) == 1 and c.get(("/v1/top", 0), 200.0) is not None
    # the daemon's periodic expire drops the last one when no query follows
    c.expire(200.0 + ANSWER_TTL)
    assert len(c) == 0
    # errors are not kept; a put of one still drops what expired
    c.put(("/v1/top", 0), _ok(10), 300.0)
    c.put(("/v1/top?limit=x", 0), Response(400, b"bad", "text/plain"), 301.0)
    assert len(c) == 0


def test_a_full_cache_of_live_answers_keeps_no_more() -> None:
    c = AnswerCache()
    for i in range(MAX_ANSWERS + 5):
        c.put((f"/v1/top?limit={i}", 0), _ok(10), 10.0)
    assert len(c) == MAX_ANSWERS
    assert c.get((f"/v1/top?limit={MAX_ANSWERS}", 0), 10.0) is None
    c.put(("/v1/processes", 0), _ok(10), 10.0 + ANSWER_TTL)
    assert len(c) == 1


def test_an_answer_written_as_it_is_rendered_is_not_kept() -> None:
    """A ChunkedResponse (a JSON stacks answer past one chunk) is never held whole: each such
    query renders its own."""
    c = AnswerCache()
    c.put(("/v1/stacks", 0), ChunkedResponse(iter([b"{", b"}"])), 10.0)
    assert len(c) == 0 and c.get(("/v1/stacks", 0), 10.0) is None
