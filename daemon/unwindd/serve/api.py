"""The query API: routes a parsed ``Request`` to the stack store and the daemon's counters.

Endpoints (GET only; JSON unless a format says otherwise)::

    /                               endpoints and the parameters each takes
    /v1/status                      version, uptime, samples, lost, throttled, processes, caches
    /v1/processes                   [{pid, comm, exe, samples, last_seen_ns, cgroup, unit,
                                      container_id}] (labels: null when not known)
    /v1/stacks?FILTERS&format=json|folded|pprof&limit=N&inline=0|1
    /v1/top?FILTERS&limit=N&by=function|line&inline=0|1
                                    functions (or source lines) by self and total samples
    /v1/stream?pid=&comm=&tid=&limit=&seconds=&inline=0|1
                                    chunked JSON lines, one per unwound sample
    inline=0: the frames as shown without inline expansion (perf script --no-inline:
    stackfmt.without_inline), stacks that then name the same frames merged
    /v1/openapi.json                this API as OpenAPI 3.0 (openapi.py, generated from PARAMS)
    FILTERS: since=SECONDS (ago) | since_ns=NS, until=SECONDS (ago) | until_ns=NS
             (CLOCK_MONOTONIC), pid=P[,P..] (repeatable), comm=NAME, tid=T,
             unit=UNIT, container=ID-PREFIX, cgroup=PATH (it or below it): the processes
             whose labels (procs/cgroups.py) match, resolved to pids in the store

Invariants:
- Sans-IO: handlers read the ``Source`` (store, counters, injected clock and uid lookup) and
  return a ``Response``, a ``ChunkedResponse`` or a ``StreamStart``; the shell owns sockets,
  subscriptions and where chunks are rendered.
- Visibility: a peer whose uid is not 0 sees only processes owned by its uid (the uid of a pid
  comes from ``Source.uid_of``; an unknown uid hides the process). The status endpoint shows
  machine-wide totals only, never per-process data.
- Bounded answers: at most ``Source.max_stacks`` stacks per reply (``truncated`` says so), at
  most 1000 functions or processes; a bad parameter is a 400 naming it, and so is a parameter
  the endpoint does not take (``PARAMS``, the one list of each endpoint's parameters): a typo
  never widens a query to the whole machine. Each refusal names its ``REJECTIONS`` reason.
- Answers say what they answered: a store query reports the window its counts cover
  (``window_json``: in the JSON, or ``x-unwindd-window-*`` headers for folded and pprof) —
  the requested window widened to whole buckets, narrowed to what the store still holds and to
  now — as CLOCK_MONOTONIC ns and as wall-clock times (``clock_offset_ns``: CLOCK_REALTIME
  minus CLOCK_MONOTONIC, perf's sample clock). The stream's head carries the offset too
  (``x-unwindd-clock-offset-ns``) so clients can show sample times on the wall clock.
- Cost: a stacks query is O(entries in the window) in C-level dict merges, plus O(limit log)
  to rank and O(limit) to render: each stack's frames are rendered once while it stays in the
  store (``StackStore.render``, ``render_id``). pprof and folded answers, and
  ``top?by=line``, are written from the stack table's frame keys (``Queries.query_ids``): no
  frame object is built, each distinct frame key is named once per answer. A top query
  without filters merges per-bucket summaries the store keeps (O(entries added since the last
  query) to bring them up to date); with filters, or when functions tie where the order
  matters, it walks the entries (O(entries)).
- Bounded while written: a JSON stacks answer is rendered from the ranked entries a chunk at a
  time (``JsonStacks``, ``CHUNK_BYTES``); past one chunk it is a ``ChunkedResponse`` whose
  chunks are rendered as the socket takes them, so beyond the ranked entries (with
  ``inline=0``, the merged stacks) it holds a chunk and one stack's frames, not the answer.
  An answer of one chunk is an ordinary ``Response`` (content-length; the answer cache keeps
  it).
- Answers are the same bytes as the straightforward computation (``stack_json``,
  ``top_functions`` over ``StackStore.query``); test_query_equiv.py checks it.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from functools import partial
from typing import Any, Final, Protocol

from ..lightdc import dataclass
from ..store.pprof import encode_profile, encode_profile_ids
from ..store.queries import Key, Stack, StackCount, top_functions, top_lines, top_lines_ids
from ..store.stackstore import StackStore
from ..store.stacktable import StackTable
from ..unwind import stackfmt
from ..unwind.stackfmt import UnwoundSample
from .httpapi import (
    ALLOW_GET,
    ChunkedResponse,
    Request,
    Response,
    StreamStart,
    error_response,
    json_response,
)

# A JSON stacks answer is rendered and written this many bytes at a time (a chunk ends after
# the stack that reaches it): what an answer holds while a slow reader takes it.
CHUNK_BYTES: Final = 256 * 1024

FILTER_PARAMS: Final = ("since", "until", "since_ns", "until_ns", "pid", "comm", "tid", "unit",
                        "container", "cgroup")

# Each endpoint's parameters: anything else in a query string is refused (400 naming it).
PARAMS: Final[dict[str, frozenset[str]]] = {
    "/": frozenset(),
    "/v1/status": frozenset(),
    "/v1/processes": frozenset({"limit"}),
    "/v1/stacks": frozenset({*FILTER_PARAMS, "format", "limit", "inline"}),
    "/v1/top": frozenset({*FILTER_PARAMS, "limit", "by", "inline"}),
    "/v1/stream": frozenset({"pid", "comm", "tid", "limit", "seconds", "inline"}),
    "/v1/openapi.json": frozenset(),
}


def clock_offset_ns() -> int:
    """CLOCK_REALTIME minus CLOCK_MONOTONIC (perf's sample clock): a sample time plus this is
    its wall-clock time. Read per answer: the wall clock may be stepped while we run."""
    return time.time_ns() - time.monotonic_ns()


# What a handler answers: a whole response, a body written as it is rendered, the live stream.
Answer = Response | ChunkedResponse | StreamStart


class Source(Protocol):
    @property
    def store(self) -> StackStore: ...

    @property
    def period_ns(self) -> int: ...

    @property
    def max_stacks(self) -> int: ...

    def status(self) -> dict[str, Any]: ...

    def now_ns(self) -> int: ...

    def uid_of(self, pid: int) -> int | None: ...

    def exe_of(self, pid: int) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Peer:
    uid: int | None  # None: SO_PEERCRED unavailable; sees nothing per-process
    pid: int | None = None

    @property
    def root(self) -> bool:
        return self.uid == 0


class BadParam(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Filters:
    since_ns: int | None
    until_ns: int | None
    pids: frozenset[int] | None
    tid: int | None
    comm: str | None
    unit: str | None = None
    container: str | None = None
    cgroup: str | None = None

    @property
    def by_label(self) -> bool:
        return self.unit is not None or self.container is not None or self.cgroup is not None


# Decimal ASCII only: Python's int() and float() also take "1_000", " 5" and other scripts'
# digits, which no client means as a number.
_INT_RE: Final = re.compile(r"[+-]?[0-9]+")
_FLOAT_RE: Final = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _int(req: Request, name: str) -> int | None:
    v = req.arg(name)
    if v is None or v == "":
        return None
    return _as_int(name, v)


def _as_int(name: str, v: str) -> int:
    if not _INT_RE.fullmatch(v):
        raise BadParam(f"{name}: not an integer: {v!r}")
    return int(v)


def float_param(req: Request, name: str) -> float | None:
    v = req.arg(name)
    if v is None or v == "":
        return None
    if not _FLOAT_RE.fullmatch(v):
        raise BadParam(f"{name}: not a number: {v!r}")
    f = float(v)
    if not f >= 0 or f == float("inf"):
        raise BadParam(f"{name}: must be a finite number >= 0, got {v!r}")
    return f


def parse_filters(req: Request, now_ns: int) -> Filters:
    since, until = float_param(req, "since"), float_param(req, "until")
    since_ns, until_ns = _int(req, "since_ns"), _int(req, "until_ns")
    if since is not None:
        since_ns = now_ns - _ago_ns(since)
    if until is not None:
        until_ns = now_ns - _ago_ns(until)
    if since_ns is not None and until_ns is not None and until_ns <= since_ns:
        raise BadParam("until: the window must end after it starts (until < since)")
    pids: set[int] = set()
    for p in req.args("pid"):
        pids.add(_as_int("pid", p))
    comm = req.arg("comm")
    container = req.arg("container") or None
    if container is not None and not (container.isascii() and container.isalnum()):
        raise BadParam(f"container: a container id (or its first digits), got {container!r}")
    cgroup = req.arg("cgroup") or None
    if cgroup is not None and not cgroup.startswith("/"):
        raise BadParam(f"cgroup: a cgroup path starting with /, got {cgroup!r}")
    return Filters(since_ns, until_ns, frozenset(pids) if pids else None, _int(req, "tid"),
                   comm or None, req.arg("unit") or None, container and container.lower(),
                   cgroup)  # fmt: skip


def _ago_ns(seconds: float) -> int:
    """``seconds`` (finite, >= 0) in ns. Past ~1.8e299 s, ``seconds * 1e9`` is inf as a
    float, which ``int`` refuses; such a float is a whole number, so its int is exact."""
    ns = seconds * 1e9
    return int(ns) if ns != float("inf") else int(seconds) * 1_000_000_000


def inline_param(req: Request) -> bool:
    """``inline``: 1 (the default) shows inlined functions as frames of their own, 0 the
    frames without them."""
    v = req.arg("inline")
    if v is None or v == "":
        return True
    if v not in ("0", "1"):
        raise BadParam(f"inline: 0 or 1, got {v!r}")
    return v == "1"


def _limit(req: Request, default: int, cap: int) -> int:
    n = _int(req, "limit")
    if n is None:
        return default
    if n <= 0:
        raise BadParam(f"limit: must be > 0, got {n}")
    return min(n, cap)


def window_json(from_ns: int, to_ns: int, offset_ns: int) -> dict[str, Any]:
    """The window an answer covers: [from, to) as wall-clock times (UTC, ISO 8601), its length,
    and the CLOCK_MONOTONIC ns (what ``since_ns``/``until_ns`` take)."""
    return {"from": _iso(from_ns + offset_ns), "to": _iso(to_ns + offset_ns),
            "seconds": round((to_ns - from_ns) / 1e9, 3), "from_ns": from_ns, "to_ns": to_ns}


def window_headers(w: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """``window_json`` for answers that are not JSON (folded, pprof)."""
    return (("x-unwindd-window-from", w["from"]), ("x-unwindd-window-to", w["to"]),
            ("x-unwindd-window-seconds", str(w["seconds"])))  # fmt: skip


def _iso(wall_ns: int) -> str:
    t = datetime.fromtimestamp(wall_ns / 1e9, UTC)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Api:
    def __init__(self, source: Source, clock_offset: Callable[[], int] = clock_offset_ns,
                 describe: Callable[[], bytes] | None = None,
                 plain_symbol: stackfmt.PlainSymbol | None = None,
                 chunk_bytes: int = CHUNK_BYTES) -> None:  # fmt: skip
        self.source = source
        self.chunk_bytes = chunk_bytes  # a JSON stacks answer's chunk (JsonStacks)
        # inline=0's names of frames whose inline chain holds no level named as the symbol
        # (engine.plain_symbol; None: their DWARF names, stackfmt.without_inline)
        self.plain_symbol = plain_symbol
        self.clock_offset = clock_offset
        # The OpenAPI document (openapi.spec_bytes, given by the service: openapi.py is
        # generated from this module's PARAMS, so this module cannot import it)
        self.describe = describe
        self.routes: dict[str, Callable[[Request, Peer], Answer]] = {
            "/": self.index,
            "/v1/status": self.status,
            "/v1/processes": self.processes,
            "/v1/stacks": self.stacks,
            "/v1/top": self.top,
            "/v1/stream": self.stream,
            "/v1/openapi.json": self.openapi,
        }
        assert set(self.routes) == set(PARAMS)
        self.requests: Counter[str] = Counter()  # by endpoint (bounded: the route names)

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Every ``requests`` label: the routes, and "other" for the rest."""
        return (*self.routes, "other")

    def handle(self, req: Request, peer: Peer) -> Answer:
        path = req.path.rstrip("/") or "/"
        route = self.routes.get(path)
        self.requests[path if route is not None else "other"] += 1
        if route is None:
            return error_response(404, f"no such endpoint: {req.path}", "no_such_endpoint")
        if req.method != "GET":
            return error_response(405, "only GET", headers=ALLOW_GET,
                                  rejected="method_not_allowed")
        unknown = sorted(set(req.query) - PARAMS[path])
        if unknown:
            takes = ", ".join(sorted(PARAMS[path])) or "none"
            return error_response(400, f"unknown parameter{'s' if len(unknown) > 1 else ''}: "
                                  f"{', '.join(unknown)} ({path} takes: {takes})",
                                  "unknown_parameter")  # fmt: skip
        try:
            return route(req, peer)
        except BadParam as e:
            return error_response(400, str(e), "bad_parameter")

    def _plain_stacks(self, store: StackStore, f: Filters, pids: frozenset[int] | None
                      ) -> list[StackCount]:  # fmt: skip
        """The stacks ``f`` and ``pids`` select, without their inline frames (``inline=0``,
        what perf script ``--no-inline`` shows)."""
        return frames_without_inline(store.query(f.since_ns, f.until_ns, pids=pids, tid=f.tid,
                                                 comm=f.comm), self.plain_symbol)  # fmt: skip

    def window(self, f: Filters) -> dict[str, Any]:
        """``window_json`` of what a store query with ``f`` covers."""
        now = self.source.now_ns()
        lo, hi = self.source.store.covered(f.since_ns, f.until_ns, now)
        # A window wholly before boot or after now covers nothing: shown as its nearest end
        # (CLOCK_MONOTONIC starts at 0; far-out ns are no date datetime can show).
        lo, hi = min(max(lo, 0), now), min(max(hi, 0), now)
        return window_json(lo, hi, self.clock_offset())

    # -- visibility

    def wanted_pids(self, f: Filters) -> frozenset[int] | None:
        """The pids ``f`` names: its pid filter, narrowed to the processes whose labels match
        its label filters (None: every pid)."""
        if not f.by_label:
            return f.pids
        match = self.source.store.label_pids(f.unit, f.container, f.cgroup)
        return match if f.pids is None else match & f.pids

    def visible_pids(self, peer: Peer, wanted: frozenset[int] | None) -> frozenset[int] | None:
        """None means "every pid" (root without a pid filter)."""
        if peer.root:
            return wanted
        candidates = wanted
        if candidates is None:
            candidates = frozenset(p.pid for p in self.source.store.processes())
        uid = peer.uid
        return frozenset(p for p in candidates if uid is not None and self.source.uid_of(p) == uid)

    def query(self, req: Request, peer: Peer) -> tuple[list[StackCount], Filters]:
        f = parse_filters(req, self.source.now_ns())
        pids = self.visible_pids(peer, self.wanted_pids(f))
        stacks = self.source.store.query(f.since_ns, f.until_ns, pids=pids, tid=f.tid,
                                         comm=f.comm)  # fmt: skip
        return stacks, f

    # -- endpoints

    def index(self, req: Request, peer: Peer) -> Response:
        return json_response({"endpoints": sorted(self.routes),
                              "parameters": {p: sorted(PARAMS[p]) for p in sorted(PARAMS)}})

    def status(self, req: Request, peer: Peer) -> Response:
        return json_response(self.source.status())

    def openapi(self, req: Request, peer: Peer) -> Response:
        if self.describe is None:
            return error_response(404, "this API has no description here")
        return Response(200, self.describe())

    def processes(self, req: Request, peer: Peer) -> Response:
        limit = _limit(req, 1000, 100_000)
        procs = self.source.store.processes()
        if not peer.root:
            vis = self.visible_pids(peer, None) or frozenset()
            procs = [p for p in procs if p.pid in vis]
        procs.sort(key=lambda p: -p.samples)
        out = [
            {"pid": p.pid, "comm": p.comm, "exe": self.source.exe_of(p.pid),
             "samples": p.samples, "last_seen_ns": p.last_seen_ns, "cgroup": p.labels.cgroup,
             "unit": p.labels.unit, "container_id": p.labels.container_id}
            for p in procs[:limit]
        ]  # fmt: skip
        return json_response({"processes": out, "truncated": len(procs) > limit})

    def stacks(self, req: Request, peer: Peer) -> Response | ChunkedResponse:
        fmt = req.arg("format") or "json"
        if fmt not in ("json", "folded", "pprof"):
            raise BadParam(f"format: one of json, folded, pprof, got {fmt!r}")
        limit = _limit(req, self.source.max_stacks, self.source.max_stacks)
        inline = inline_param(req)
        f = parse_filters(req, self.source.now_ns())
        pids = self.visible_pids(peer, self.wanted_pids(f))
        store = self.source.store
        if inline:
            # written from the stack table: no frame is built for folded and pprof; a JSON
            # answer's frames are rendered once per stack and cached by the store
            entries, n = store.query_ids(f.since_ns, f.until_ns, pids=pids, tid=f.tid,
                                         comm=f.comm, limit=limit)  # fmt: skip
            window = self.window(f)
            if fmt == "folded":
                return self.folded(folded_of_ids(entries, store.table), n > limit, window)
            if fmt == "pprof":
                return self.pprof(partial(encode_profile_ids, entries, store.table), window)
            render = partial(store.render_id, "json", fn=frames_json_bytes)
            samples = sum(c for _, c in entries)
            rows: Iterator[JsonRow] = ((pid, tid, comm, c, render(sid))
                                       for (pid, tid, comm, sid), c in entries)  # fmt: skip
            return self.json_stacks(samples, n > limit, rows, window)
        stacks, n = rank_without_inline(store.query(f.since_ns, f.until_ns, pids=pids,
                                                    tid=f.tid, comm=f.comm), limit,
                                        self.plain_symbol)  # fmt: skip
        truncated = n > limit
        window = self.window(f)
        if fmt == "folded":
            names = partial(store.render, "folded", fn=stackfmt.folded_names)
            return self.folded(render_folded(stacks, names).encode(), truncated, window)
        if fmt == "pprof":
            return self.pprof(partial(encode_profile, stacks), window)
        rend = store.render
        rows = ((s.pid, s.tid, s.comm, s.count, rend("json", s.frames, frames_json_bytes))
                for s in stacks)  # fmt: skip
        return self.json_stacks(sum(s.count for s in stacks), truncated, rows, window)

    def json_stacks(self, samples: int, truncated: bool, rows: Iterator[JsonRow],
                    window: dict[str, Any]) -> Response | ChunkedResponse:  # fmt: skip
        """json_response's bytes of ``{"samples", "truncated", "stacks", "window"}``, the
        stacks being ``rows`` (rendered as they are read): a ``Response`` when they fit in one
        chunk, else a ``ChunkedResponse`` of the rest to come."""
        head = (f'{{"samples":{samples},"truncated":{"true" if truncated else "false"},'
                f'"stacks":[').encode()  # fmt: skip
        tail = f'],"window":{json.dumps(window, separators=(",", ":"))}}}\n'.encode()
        body = JsonStacks(head, rows, tail, self.chunk_bytes)
        if body.done:
            return Response(200, body.take_first())
        return ChunkedResponse(body)

    def folded(self, body: bytes, truncated: bool, window: dict[str, Any]) -> Response:
        return Response(200, body, "text/plain; charset=utf-8",
                        (("x-unwindd-truncated", str(truncated).lower()),
                         *window_headers(window)))  # fmt: skip

    def pprof(self, encode: Callable[..., bytes], window: dict[str, Any]) -> Response:
        """The answer of ``encode`` (``encode_profile`` of the stacks or
        ``encode_profile_ids`` of the entries, the keywords to come)."""
        wall_from = window["from_ns"] + self.clock_offset()
        body = encode(period_ns=self.source.period_ns, time_nanos=wall_from,
                      duration_nanos=window["to_ns"] - window["from_ns"],
                      labels_of=self.source.store.labels_of)  # fmt: skip
        disposition = ("content-disposition", 'attachment; filename="profile.pb.gz"')
        return Response(200, body, "application/vnd.google.protobuf+gzip",
                        (disposition, *window_headers(window)))  # fmt: skip

    def top(self, req: Request, peer: Peer) -> Response:
        limit = _limit(req, 50, 1000)
        by = req.arg("by") or "function"
        if by not in ("function", "line"):
            raise BadParam(f"by: function or line, got {by!r}")
        inline = inline_param(req)
        f = parse_filters(req, self.source.now_ns())
        pids = self.visible_pids(peer, self.wanted_pids(f))
        store = self.source.store
        if by == "function" and inline:  # the store's summaries
            total, funcs = store.top(f.since_ns, f.until_ns, pids=pids, tid=f.tid,
                                     comm=f.comm, limit=limit)  # fmt: skip
        elif by == "line":  # over the stacks (O(distinct stacks * frames))
            if inline:  # from the stack table's frame keys: no frame is built
                entries = store.query_ids(f.since_ns, f.until_ns, pids=pids, tid=f.tid,
                                          comm=f.comm)[0]  # fmt: skip
                total = sum(n for _, n in entries)
                lines = top_lines_ids(entries, store.table, limit)
            else:
                stacks = self._plain_stacks(store, f, pids)
                total = sum(s.count for s in stacks)
                lines = top_lines(stacks, limit)
            return json_response({
                "samples": total,
                "lines": [{"file": lc.file, "line": lc.line, "sym": lc.sym, "dso": lc.dso,
                           "self": lc.self_count, "total": lc.total_count} for lc in lines],
                "window": self.window(f),
            })  # fmt: skip
        else:  # over the stacks (O(distinct stacks * frames))
            stacks = self._plain_stacks(store, f, pids)
            total = sum(s.count for s in stacks)
            funcs = top_functions(stacks, limit)
        return json_response({
            "samples": total,
            "functions": [{"sym": fc.sym, "dso": fc.dso, "self": fc.self_count,
                           "total": fc.total_count} for fc in funcs],
            "window": self.window(f),
        })  # fmt: skip

    def stream(self, req: Request, peer: Peer) -> StreamStart:
        f = parse_filters(req, self.source.now_ns())
        limit = _int(req, "limit")
        if limit is not None and limit <= 0:
            raise BadParam(f"limit: must be > 0, got {limit}")
        seconds = float_param(req, "seconds")
        accept = self.stream_filter(peer, f)
        line = (stream_line if inline_param(req)
                else partial(stream_line_without_inline, plain=self.plain_symbol))  # fmt: skip
        return StreamStart(params={"accept": accept, "limit": limit, "seconds": seconds,
                                   "line": line},
                           headers=(("x-unwindd-clock-offset-ns", str(self.clock_offset())),))

    def stream_filter(self, peer: Peer, f: Filters) -> Callable[[UnwoundSample], bool]:
        uid_of = self.source.uid_of

        def accept(s: UnwoundSample) -> bool:
            if f.pids is not None and s.pid not in f.pids:
                return False
            if (f.tid is not None and s.tid != f.tid) or (f.comm is not None and s.comm != f.comm):
                return False
            if peer.root:
                return True
            return s.pid is not None and peer.uid is not None and uid_of(s.pid) == peer.uid

        return accept


# One stack of a JSON stacks answer: pid, tid, comm, count and its frames as JSON bytes.
JsonRow = tuple[int, int, str, int, bytes]


class JsonStacks:
    """The body of a JSON stacks answer as chunks of at least ``chunk_bytes`` (the last may be
    shorter; a chunk ends after the stack that reaches the size, so it is at most that plus one
    stack's rendering): ``head``, each of ``rows`` as ``stack_json`` writes it, comma
    separated, ``tail``; the same bytes as the whole body joined at once. Rows are read (and
    so rendered) only as chunks are asked for; the first chunk is rendered at once, so
    ``done`` then says whether the answer is one chunk."""

    def __init__(self, head: bytes, rows: Iterator[JsonRow], tail: bytes,
                 chunk_bytes: int) -> None:  # fmt: skip
        self._head: bytes | None = head
        self._rows = rows
        self._tail = tail
        self._chunk_bytes = chunk_bytes
        self._sep = ""  # what goes before the next stack: "}," once one is written
        self.done = False  # the last chunk has been rendered
        self._first: bytes | None = self._chunk()

    def take_first(self) -> bytes:
        """The first chunk (the whole body when ``done``), handed over once."""
        first, self._first = self._first, None
        assert first is not None
        return first

    def __iter__(self) -> JsonStacks:
        return self

    def __next__(self) -> bytes:
        if self._first is not None:
            return self.take_first()
        if self.done:
            raise StopIteration
        return self._chunk()

    def close(self) -> None:
        """Render no more (the answer is abandoned): the rows and what they hold go."""
        self.done = True
        self._first = None
        self._rows = iter(())

    def _chunk(self) -> bytes:
        buf: list[bytes] = []
        size = 0
        if self._head is not None:
            buf.append(self._head)
            size = len(self._head)
            self._head = None
        sep, limit, dumps = self._sep, self._chunk_bytes, json.dumps
        for pid, tid, comm, count, frames in self._rows:
            pre = (f'{sep}{{"pid":{pid},"tid":{tid},"comm":{dumps(comm)},"count":{count},'
                   f'"frames":').encode()  # fmt: skip
            buf += (pre, frames)
            size += len(pre) + len(frames)
            sep = "},"
            if size >= limit:
                self._sep = sep
                return b"".join(buf)
        buf.append(b"}" + self._tail if sep else self._tail)
        self.done = True
        self._rows = iter(())
        return b"".join(buf)


def frames_without_inline(stacks: list[StackCount], plain: stackfmt.PlainSymbol | None = None
                          ) -> list[StackCount]:  # fmt: skip
    """``stacks`` with their frames ``stackfmt.without_inline`` (each distinct frames tuple
    once: a query's answer has one tuple per stack), in order, not merged."""
    seen: dict[int, Stack] = {}
    out = []
    for s in stacks:
        fr = seen.get(id(s.frames))
        if fr is None:
            fr = seen[id(s.frames)] = stackfmt.without_inline(s.frames, plain)
        out.append(StackCount(s.pid, s.tid, s.comm, fr, s.count))
    return out


def rank_without_inline(stacks: list[StackCount], limit: int,
                        plain: stackfmt.PlainSymbol | None = None
                        ) -> tuple[list[StackCount], int]:  # fmt: skip
    """(the first ``limit``, how many) of ``stacks`` (a whole ``query`` answer) without inline
    frames, entries that then have the same (pid, tid, comm, frames) merged, ranked as
    ``query`` ranks (count descending, ties first seen first): what the store would answer
    had the frames never been expanded (stacks that differ only in their inline frames are
    one). O(entries x frames)."""
    merged: dict[tuple[int, int, str, Stack], int] = {}
    for s in frames_without_inline(stacks, plain):
        key = (s.pid, s.tid, s.comm, s.frames)
        merged[key] = merged.get(key, 0) + s.count
    ranked = sorted(merged.items(), key=lambda kv: -kv[1])  # stable: ties keep their order
    return [StackCount(p, t, c, fr, n) for (p, t, c, fr), n in ranked[:limit]], len(ranked)


def stack_json(s: StackCount) -> dict[str, Any]:
    return {
        "pid": s.pid,
        "tid": s.tid,
        "comm": s.comm,
        "count": s.count,
        "frames": [frame_json(f) for f in s.frames],
    }


def frame_json(f: stackfmt.Frame) -> dict[str, Any]:
    """One frame of a /v1/stacks answer: ip, sym, dso, offset and kernel always; what only
    some frames have only on those (a stacks answer runs to 100,000 stacks): ``rel`` (the
    address in the dso, a user frame's), ``inlined`` (true: a function inlined at the next
    frame's call site), ``file`` and ``line`` (where DWARF places the pc)."""
    out: dict[str, Any] = {"ip": hex(f.ip), "sym": f.sym, "dso": f.dso, "offset": f.offset,
                           "kernel": f.kernel}  # fmt: skip
    if f.rel is not None and not f.kernel:
        out["rel"] = hex(f.rel)
    if f.inlined:
        out["inlined"] = True
    if f.file is not None:
        out["file"] = f.file
        out["line"] = f.line
    return out


def frames_json(frames: Stack) -> str:
    """The ``frames`` value of ``stack_json`` as json_response writes it."""
    return json.dumps([frame_json(f) for f in frames], separators=(",", ":"))


def frames_json_bytes(frames: Stack) -> bytes:
    """``frames_json``, encoded (it is ASCII: json.dumps escapes the rest)."""
    return frames_json(frames).encode()


def render_folded(
    stacks: Iterable[StackCount],
    names: Callable[[Stack], tuple[str, ...]] = stackfmt.folded_names,
) -> str:
    """``stackfmt.folded_key`` of each stack as a sample, counted; ``names`` may cache the
    frames' part per stack."""
    folded: Counter[tuple[str, ...]] = Counter()
    for s in stacks:
        folded[(s.comm or stackfmt.UNKNOWN, *names(s.frames))] += s.count
    return stackfmt.render_folded(folded)


def folded_of_ids(entries: Sequence[tuple[Key, int]], table: StackTable) -> bytes:
    """``render_folded`` of a query's ranked entries ((pid, tid, comm, stack id), count),
    encoded: the same text, from ``table``'s frame keys. A folded name depends on no ip, so
    each distinct frame is named once (``stackfmt.folded_names``) and each stack's names are
    joined once per stack id, as the bytes the answer shows them in
    (``stackfmt.render_folded_bytes``: no tuple or str per line, the text not rebuilt). A name
    or comm holding a NUL of its own (which that join cannot tell apart) takes the tuples'
    way."""
    # frame id -> its name (the entries' stacks, so their frames, stay while the query runs)
    name_of: dict[int, bytes] = {}
    names_of: dict[int, bytes] = {}  # stack id -> its names, outermost first, NUL-joined
    # the same by the stack's frame ids: the stacks of one code in many processes (other ips,
    # other stack ids, the same frame ids) share one joined text
    by_fids: dict[bytes, bytes] = {}
    folded: stackfmt.FoldedBytes = {}
    unknown = stackfmt.UNKNOWN
    for (_, _, comm, sid), n in entries:
        names = names_of.get(sid)
        if names is None:
            fids = table.frame_ids(sid)
            key = fids.tobytes()
            names = by_fids.get(key)
            if names is None:
                out = []
                for fid in reversed(fids):
                    name = name_of.get(fid)
                    if name is None:
                        # sym, kernel and inlined are all a folded name shows
                        k = table.frame_key(fid)
                        frame = stackfmt.Frame(0, k[0], k[1], k[2], kernel=k[3], inlined=k[4])
                        name = name_of[fid] = stackfmt.folded_names((frame,))[0].encode()
                        if b"\0" in name:
                            return _folded_of_ids_tuples(entries, table)
                    out.append(name)
                names = by_fids[key] = b"\0".join(out)
            names_of[sid] = names
        comm = comm or unknown
        per = folded.get(comm)
        if per is None:
            if "\0" in comm:
                return _folded_of_ids_tuples(entries, table)
            per = folded[comm] = {}
        per[names] = per.get(names, 0) + n
    names_of.clear()  # the keys of ``folded`` are then their last holder (written, then freed)
    by_fids.clear()
    return stackfmt.render_folded_bytes(folded)


def _folded_of_ids_tuples(entries: Sequence[tuple[Key, int]], table: StackTable) -> bytes:
    """``folded_of_ids`` by tuples of names (``stackfmt.render_folded``)."""
    folded: Counter[tuple[str, ...]] = Counter()
    for (_, _, comm, sid), n in entries:
        frames = table.frames(sid)
        folded[(comm or stackfmt.UNKNOWN, *stackfmt.folded_names(frames))] += n
    return stackfmt.render_folded(folded).encode()


def stream_line(s: UnwoundSample) -> bytes:
    return json.dumps(stackfmt.to_json(s), separators=(",", ":")).encode() + b"\n"


def stream_line_without_inline(s: UnwoundSample, plain: stackfmt.PlainSymbol | None = None
                               ) -> bytes:  # fmt: skip
    """``stream_line`` of ``s`` with its frames ``stackfmt.without_inline``."""
    fr = stackfmt.without_inline(s.frames, plain)
    if fr is not s.frames:
        s = UnwoundSample(s.time_ns, s.pid, s.tid, s.cpu, s.comm, s.period, s.unwind_status, fr)
    return stream_line(s)
