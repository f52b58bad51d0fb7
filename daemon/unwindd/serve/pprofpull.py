"""Pull export: Go's ``net/http/pprof`` convention on an opt-in TCP listener, for scrapers
(Parca, Grafana Alloy's ``pyroscope.scrape``, ``go tool pprof URL``).

    GET /debug/pprof/                      what is served (text)
    GET /debug/pprof/profile?seconds=N&FILTERS
        blocks N seconds (default 30, as Go's), then answers the CPU profile of those N seconds
        as gzipped pprof: sample types samples/count and cpu/nanoseconds, period type
        cpu/nanoseconds, period the sampling period (store/pprof.py; Go's runtime/pprof writes
        a CPU profile the same way, and scrapers' ``process_cpu`` expects it).

Invariants:
- Delta, not cumulative: the answer counts the samples stored between the request's start and
  its end (what a query of the window held at the end minus what it held at the start; the
  store's buckets are coarser than N). A sample counts when it reaches the store, within
  ``[daemon] tick_ms`` of being taken. Samples of the window evicted by the store's bounds
  before the end are missing, and the answer says so (``x-unwindd-evicted: true``).
- Filters are the socket API's (``api.PARAMS["/v1/stacks"]`` minus the window and format
  parameters, parsed and applied by ``Api.query``): any filter added there is taken here too;
  anything else is a 400 naming it. A TCP peer has no uid: it sees every process, which is why
  the listener is off by default, on localhost by default, and takes a bearer token
  (``Authorization: Bearer T``, compared in constant time; 401 without it).
- Bounded: ``seconds`` in (0, ``pprof_max_seconds``] (400 beyond), at most
  ``pprof_max_concurrent`` profiles in progress (429 beyond), at most ``[api] max_stacks``
  stacks per profile (the largest counts); connections, request size and time are limited as on
  the socket (connections.py with the ``[api]`` limits, counted apart from the socket's). Each
  refusal is counted by reason (``PULL_REJECTIONS``), each request by endpoint.
- The loop only waits and takes snapshots (O(buckets)); the two store queries of a profile
  (O(entries from the start of the window's bucket)), the delta, its ranking and the encoding
  run on this module's one worker thread against snapshots. A client that goes away holds its
  slot until its window ends (at most ``pprof_max_seconds``). On
  shutdown a profile in progress is answered 503 at once (``close`` waits up to a second for
  those answers and connections before the worker and the store go away).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar, cast

from ..lightdc import replace
from ..store.pprof import encode_profile
from ..store.queries import Stack, StackCount
from .api import PARAMS, Api, BadParam, Peer, Source, float_param, window_headers, window_json
from .config import Config
from .connections import Connections
from .httpapi import (
    ALLOW_GET,
    REJECTIONS,
    TOO_MANY_STREAMS,
    Request,
    Response,
    error_response,
)
from .startup import StartupError, listen_tcp

log = logging.getLogger("unwindd")

INDEX: Final = "/debug/pprof/"
PROFILE: Final = "/debug/pprof/profile"
ENDPOINTS: Final = (INDEX, PROFILE, "other")
DEFAULT_SECONDS: Final = 30.0  # net/http/pprof's Profile handler default

# The window is the request's own: the socket API's window parameters do not apply; nor does
# ``inline``: a pprof carries inline frames as Lines of one Location, which pprof's tools show
# or fold themselves (go tool pprof -noinlines).
_NOT_FILTERS: Final = frozenset({"since", "until", "since_ns", "until_ns", "format", "limit",
                                 "inline"})

PULL_REJECTIONS: Final = (
    *(r for r in REJECTIONS if r != TOO_MANY_STREAMS),
    "unauthorized",  # no or a wrong bearer token (401)
    "too_many_profiles",  # [export] pprof_max_concurrent (429)
)

_Key = tuple[int, int, str, Stack]  # pid, tid, comm, frames
_T = TypeVar("_T")


def pull_params() -> frozenset[str]:
    """The profile endpoint's parameters: ``seconds`` and the stacks endpoint's filters."""
    return (PARAMS["/v1/stacks"] - _NOT_FILTERS) | {"seconds"}


class _SnapshotSource:
    """The daemon as ``api.Source``, whose store is the snapshot the calling worker thread
    reads (set per query): ``Api.query`` then runs off the loop unchanged."""

    def __init__(self, daemon: Any) -> None:
        self._d = daemon
        self._tls = threading.local()

    @property
    def store(self) -> Any:
        return self._tls.store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._d, name)


class PprofPull:
    """The listener's handler, its counters (``requests``, ``rejected``) and its worker."""

    def __init__(self, daemon: Any, flush: Callable[[], None], config: Callable[[], Config],
                 stop: asyncio.Event) -> None:  # fmt: skip
        self._d = daemon
        self._flush = flush
        self._config = config  # the effective config: the live keys change on reload
        self._stop = stop
        self._source = _SnapshotSource(daemon)
        self._api = Api(cast(Source, self._source))
        self.conns = Connections(lambda: self._config().api, stop, _no_streams)
        self.requests: Counter[str] = Counter()
        self.active = 0
        self.address: tuple[str, int] | None = None
        self._token = b""
        self._pool: ThreadPoolExecutor | None = None

    @property
    def rejected(self) -> Counter[str]:
        return self.conns.rejected

    async def listen(self) -> asyncio.AbstractServer:
        exp = self._config().export
        self._token = _read_token(exp.pprof_token, exp.pprof_token_file)
        srv, self.address = await listen_tcp(
            "[export] pprof_listen", exp.pprof_listen,
            lambda r, w: self.conns.serve(r, w, self.answer, Peer(0)))
        name = self.address
        shown = f"[{name[0]}]:{name[1]}" if ":" in name[0] else f"{name[0]}:{name[1]}"
        log.info("pprof export: http://%s%s%s", shown, PROFILE,
                 " (bearer token required)" if self._token else "")  # fmt: skip
        if not self._token and not _loopback(name[0]):
            log.warning("[export] pprof_listen %s is not a loopback address and no token is "
                        "set: anyone who can connect can read every process's stacks",
                        exp.pprof_listen)  # fmt: skip
        return srv

    async def close(self) -> None:
        """After ``stop`` is set: let the profiles in progress answer and their connections
        close (a connection task cancelled when the loop ends logs a traceback), then end the
        worker."""
        deadline = asyncio.get_running_loop().time() + 1.0
        while (self.active or self.conns.open) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- requests

    async def answer(self, req: Request, peer: Peer) -> Response:
        path = req.path if req.path != "/debug/pprof" else INDEX
        if path not in (INDEX, PROFILE):
            self.requests["other"] += 1
            return error_response(404, f"no such endpoint: {req.path} (try {PROFILE})",
                                  "no_such_endpoint")  # fmt: skip
        self.requests[path] += 1
        if req.method != "GET":
            return error_response(405, "only GET", headers=ALLOW_GET,
                                  rejected="method_not_allowed")
        if self._token and not self._authorized(req):
            return replace(
                error_response(401, "a bearer token is required", "unauthorized"),
                headers=(("www-authenticate", 'Bearer realm="unwindd"'),))
        if path == INDEX:
            return self._index(req)
        exp = self._config().export
        try:
            seconds = self._seconds(req, exp.pprof_max_seconds)
        except _Unknown as e:
            return error_response(400, str(e), "unknown_parameter")
        except BadParam as e:
            return error_response(400, str(e), "bad_parameter")
        if self.active >= exp.pprof_max_concurrent:
            return error_response(429, f"more than {exp.pprof_max_concurrent} profiles in "
                                  "progress ([export] pprof_max_concurrent)",
                                  "too_many_profiles")  # fmt: skip
        self.active += 1
        try:
            return await self._profile(req, seconds)
        except BadParam as e:
            return error_response(400, str(e), "bad_parameter")
        finally:
            self.active -= 1

    def _authorized(self, req: Request) -> bool:
        import hmac  # (with hashlib: only a daemon that pulls with a token needs it)

        got = b""
        for k, v in req.headers:
            if k.lower() == "authorization":
                scheme, _, cred = v.partition(" ")
                if scheme.lower() == "bearer":
                    got = cred.strip().encode("latin-1")
        return hmac.compare_digest(got, self._token)

    def _index(self, req: Request) -> Response:
        if req.query:
            names = ", ".join(sorted(req.query))
            return error_response(400, f"unknown parameters: {names} ({INDEX} takes none)",
                                  "unknown_parameter")  # fmt: skip
        params = ", ".join(sorted(pull_params()))
        body = (f"unwindd pprof export\n\n{PROFILE}?seconds=N\n"
                f"    CPU profile of the next N seconds (gzipped pprof)\n"
                f"    parameters: {params}\n")  # fmt: skip
        return Response(200, body.encode(), "text/plain; charset=utf-8")

    def _seconds(self, req: Request, cap: int) -> float:
        unknown = sorted(set(req.query) - pull_params())
        if unknown:
            takes = ", ".join(sorted(pull_params()))
            raise _Unknown(f"unknown parameter{'s' if len(unknown) > 1 else ''}: "
                           f"{', '.join(unknown)} ({PROFILE} takes: {takes})")  # fmt: skip
        seconds = float_param(req, "seconds")
        if seconds is None:
            return DEFAULT_SECONDS if DEFAULT_SECONDS <= cap else float(cap)
        if not 0 < seconds <= cap:
            raise BadParam(f"seconds: must be > 0 and <= {cap} ([export] pprof_max_seconds), "
                           f"got {req.arg('seconds')!r}")  # fmt: skip
        return seconds

    async def _profile(self, req: Request, seconds: float) -> Response:
        t0 = self._d.now_ns()
        filters = {k: v for k, v in req.query.items() if k != "seconds"}
        query = Request(req.method, req.target, req.path, {**filters, "since_ns": [str(t0)]})
        store = self._d.profiler.store
        evictions = store.stats.evicted_buckets
        # A bad filter is refused here, before the wait.
        base = await self._off_loop(query, _baseline)
        # The event loop's timers may fire a little early (uvloop rounds to milliseconds): wait
        # again until the clock has passed the end, so a profile covers at least N seconds.
        end = t0 + int(seconds * 1e9)
        while (left := end - self._d.now_ns()) > 0 and not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), left / 1e9 + 0.001)
        if self._stop.is_set():
            return error_response(503, "the daemon is stopping")
        t1 = self._d.now_ns()
        offset = self._api.clock_offset()
        period_ns, max_stacks = self._d.period_ns, self._d.max_stacks

        def encode(stacks: list[StackCount]) -> bytes:
            delta = _delta(base, stacks)
            return encode_profile(delta[:max_stacks], period_ns=period_ns,
                                  time_nanos=t0 + offset, duration_nanos=t1 - t0)  # fmt: skip

        body = await self._off_loop(query, encode)
        held = store.window()
        evicted = store.stats.evicted_buckets != evictions and (
            held is None or held[0] > t0 // store.bucket_ns * store.bucket_ns)
        headers = (("content-disposition", 'attachment; filename="profile"'),
                   *window_headers(window_json(t0, t1, offset)),
                   ("x-unwindd-evicted", str(evicted).lower()))  # fmt: skip
        return Response(200, body, "application/octet-stream", headers)

    async def _off_loop(self, query: Request, then: Callable[[list[StackCount]], _T]) -> _T:
        """``then(Api.query(query))`` on the worker, against a snapshot of the store as it is
        now (taken on the loop, after the sampler's held counts are flushed into it)."""
        self._flush()
        snap = self._d.profiler.store.snapshot()

        def run() -> _T:
            self._source._tls.store = snap
            try:
                stacks, _ = self._api.query(query, Peer(0))
            finally:
                self._source._tls.store = None
                snap.close()
            return then(stacks)

        return await asyncio.get_running_loop().run_in_executor(self._worker(), run)

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="unwindd-pprof")
        return self._pool


def _baseline(stacks: list[StackCount]) -> dict[_Key, StackCount]:
    # Keyed by the frames' value: two queries rebuild a stack as equal frames, not always the
    # same objects (the store keeps frame ids; a Frame caches its hash).
    return {(s.pid, s.tid, s.comm, s.frames): s for s in stacks}


def _delta(base: dict[_Key, StackCount], now: list[StackCount]) -> list[StackCount]:
    """``now`` minus ``base`` per (pid, tid, comm, stack), the positive ones, largest first."""
    out = []
    for s in now:
        b = base.get((s.pid, s.tid, s.comm, s.frames))
        n = s.count - (b.count if b is not None else 0)
        if n > 0:
            out.append(StackCount(s.pid, s.tid, s.comm, s.frames, n))
    out.sort(key=lambda s: -s.count)
    return out


class _Unknown(BadParam):
    pass


async def _no_streams(*_: Any) -> None:
    raise AssertionError("the pprof listener never streams")


def _read_token(token: str, path: str) -> bytes:
    if not path:
        return token.encode()
    try:
        with open(path, "rb") as fh:
            got = fh.read(4097).strip()
    except OSError as e:
        raise StartupError(f"[export] pprof_token_file: {path}: {e.strerror or e}") from None
    if not got or len(got) > 4096 or b"\n" in got:
        raise StartupError(f"[export] pprof_token_file: {path}: must hold one token "
                           "(one line, at most 4096 bytes)")  # fmt: skip
    return got


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
