"""Push to Pyroscope: every ``[export] interval`` seconds, the stacks stored since the last push go
to Pyroscope's ``POST /ingest`` as gzipped pprof (store/pprof.py), one request per label set.

The request, as Pyroscope reads it (grafana/pyroscope: docs/sources/configure-server/
about-server-api.md; pkg/ingester/pyroscope/ingest_handler.go; api/model/labelset)::

    POST /ingest?name=APP{k=v,...}&from=UNIX_S&until=UNIX_S&format=pprof&sampleRate=HZ
                 &spyName=unwindd
    [X-Scope-OrgID: TENANT]  [Authorization: Basic ... | Bearer ...]
    body: the gzipped profile.proto itself

- ``name``: labelset.Parse reads the app name up to ``{`` (``[A-Za-z0-9_./-]``), then
  ``key=value`` pairs split at ``,`` and ended by ``}``: label names ``[A-Za-z0-9_.]`` (``__``
  names are dropped at ingestion), values trimmed and ending at ``,`` or ``}``. ``check_labels``
  refuses static labels it would misread; ``label_value`` rewrites dynamic ones.
- With ``format=pprof`` the ingest handler hands the raw body to pprof.RawFromBytes (gzip or
  not); a multipart form (``profile`` field) is only read when ``format`` is absent, so the body
  is the profile. ``sampleRate`` is ignored for pprof (the profile's period says it) but sent.
- ``from``/``until``: pkg/og/util/attime reads a 10-digit number as unix seconds.

Invariants:
- Windows: a push covers whole store buckets [from, until), each window starting where the last
  ended (no gap, no overlap: Pyroscope sums over time, so each sample counts once). A bucket is
  pushed once complete plus ``GRACE_NS`` (records are ordered and stored a little late); a
  sample stored later than that into a pushed bucket is not pushed. A tick with no newly
  complete bucket (``interval`` < ``[store] bucket_seconds``) pushes nothing and waits; an empty
  window is not sent. ``from``/``until`` are unix seconds anchored once (re-anchored if the wall
  clock moves by more than a second), so consecutive windows share their edge exactly.
- Series: ``split_series`` groups stacks by the label set ``labels_of`` gives each (the static
  labels and ``hostname`` always; per-process labels where the caller has them), one profile
  per set. Dynamic labels never override static ones.
- Never blocks sampling: a window is built on the loop once per interval (a store query,
  O(entries in the window), plus encode, O(distinct frames + stacks)); sending runs in its own
  task over asyncio streams (httpclient.py), each attempt bounded by ``timeout``.
- Bounded: at most ``max_pending`` built profiles wait; beyond, the oldest is dropped
  (``queue_full``). A profile gets at most ``ATTEMPTS`` tries, ``BACKOFF_S`` doubling up to
  ``MAX_BACKOFF_S`` between them (``retries_exhausted`` after); a 4xx other than 408/429 is not
  retried (``rejected``). Every failed attempt is counted by ``FAILURES`` reason, every dropped
  profile by ``DROPS`` reason (metrics.py exports both at 0 from the start).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import quote, urlencode

from ..lightdc import dataclass, field
from ..store.pprof import encode_profile
from ..store.queries import Queries, StackCount
from .httpclient import ConnectFailed, Endpoint, ProtocolFailed, post

log = logging.getLogger("unwindd")

SPY_NAME = "unwindd"
GRACE_NS = 1_000_000_000
ATTEMPTS = 5
BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
FAILURES = ("connect", "timeout", "http_4xx", "http_5xx", "protocol")
DROPS = ("queue_full", "retries_exhausted", "rejected")

_APP_NAME = re.compile(r"[A-Za-z0-9_./-]+")
_LABEL_NAME = re.compile(r"[A-Za-z0-9_.]+")
_NOT_LABEL_NAME = re.compile(r"[^A-Za-z0-9_.]")

Labels = tuple[tuple[str, str], ...]  # sorted by name: a series key
LabelsOf = Callable[[StackCount], Mapping[str, str]]


# -- config checks (config.py calls these)


def check_url(v: str) -> str | None:
    if v == "":
        return None
    try:
        Endpoint.parse(v)
    except ValueError as e:
        return str(e)
    return None


def check_app_name(v: str) -> str | None:
    return None if _APP_NAME.fullmatch(v) else "must be letters, digits and _ . / - only"


def check_labels(v: Mapping[str, str]) -> str | None:
    for k, val in v.items():
        if not _LABEL_NAME.fullmatch(k) or k.startswith("__"):
            return f"label {k!r}: names are letters, digits, _ and . (not starting with __)"
        if val != val.strip() or not val or "," in val or "}" in val or not val.isprintable():
            return f"label {k!r}: values are non-empty, printable, without , or }} or edge spaces"
    return None


# -- the request (sans-IO)


def label_value(v: str) -> str:
    """A dynamic label value as labelset.Parse reads it back: no ``,``/``}``, no edge spaces."""
    return "".join("_" if c in ",}" or not c.isprintable() else c for c in v).strip()


def label_name(k: str) -> str:
    return _NOT_LABEL_NAME.sub("_", k)


def series_name(app: str, labels: Labels) -> str:
    return app + "{" + ",".join(f"{k}={v}" for k, v in labels) + "}"


def ingest_target(app: str, labels: Labels, from_s: int, until_s: int, sample_rate: int) -> str:
    query = urlencode({"name": series_name(app, labels), "from": from_s, "until": until_s,
                       "format": "pprof", "sampleRate": sample_rate, "spyName": SPY_NAME},
                      quote_via=quote)  # fmt: skip
    return "/ingest?" + query


def split_series(stacks: Iterable[StackCount], base: Mapping[str, str],
                 labels_of: LabelsOf | None) -> dict[Labels, list[StackCount]]:  # fmt: skip
    """Stacks by label set: ``base`` plus what ``labels_of`` says of each stack (names and
    values made readable by labelset.Parse; a name ``base`` has is kept from ``base``)."""
    fixed = tuple(sorted(base.items()))
    if labels_of is None:
        return {fixed: list(stacks)}
    out: dict[Labels, list[StackCount]] = {}
    cache: dict[tuple[tuple[str, str], ...], Labels] = {}
    for s in stacks:
        extra = tuple(labels_of(s).items())
        key = cache.get(extra)
        if key is None:
            merged = dict(base)
            for k, v in extra:
                k, v = label_name(k), label_value(v)
                if k and v and not k.startswith("__") and k not in base:
                    merged[k] = v
            key = cache[extra] = tuple(sorted(merged.items()))
        out.setdefault(key, []).append(s)
    return out


@dataclass(frozen=True, slots=True)
class Profile:
    """One built request, waiting to be sent."""

    target: str
    body: bytes
    from_s: int
    until_s: int


class Clock:
    """CLOCK_MONOTONIC bucket edges -> unix seconds, anchored so that consecutive windows share
    their edge exactly (bucket lengths are whole seconds)."""

    def __init__(self) -> None:
        self.anchor: tuple[int, float] | None = None  # (mono ns, unix s at it)

    def unix(self, mono_ns: int, offset_ns: int) -> int:
        true = (mono_ns + offset_ns) / 1e9
        if self.anchor is not None:
            at, s = self.anchor
            mapped = s + (mono_ns - at) / 1e9
            if abs(mapped - true) <= 1.0:
                return round(mapped)
        self.anchor = (mono_ns, float(round(true)))
        return round(true)


# -- the shell


@dataclass
class PushStats:
    pushed: int = 0  # requests the server accepted (2xx)
    pushed_bytes: int = 0
    windows: int = 0  # windows built (each one profile per series)
    failures: Counter[str] = field(default_factory=Counter)  # failed attempts, by reason
    dropped: Counter[str] = field(default_factory=Counter)  # profiles given up, by reason
    pending: int = 0
    last_window: tuple[int, int] | None = None  # unix s
    last_success_unix: float | None = None
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class PushConfig:
    url: str
    app_name: str
    interval: float
    labels: Mapping[str, str]
    headers: tuple[tuple[str, str], ...]  # tenant, authorization
    timeout: float
    max_pending: int
    sample_rate: int
    period_ns: int

    @classmethod
    def from_section(cls, e: Any, *, frequency: int, hostname: str | None = None) -> PushConfig:
        """``e`` is config.ExportSection; reads ``basic_auth_password_file`` (OSError: the
        caller says which key)."""
        headers: list[tuple[str, str]] = []
        if e.tenant_id:
            headers.append(("X-Scope-OrgID", e.tenant_id))
        password = e.basic_auth_password
        if e.basic_auth_password_file:
            with open(e.basic_auth_password_file, encoding="utf-8") as fh:
                password = fh.read(4096).rstrip("\r\n")
        if e.basic_auth_user or password:
            cred = base64.b64encode(f"{e.basic_auth_user}:{password}".encode()).decode()
            headers.append(("Authorization", f"Basic {cred}"))
        elif e.bearer_token:
            headers.append(("Authorization", f"Bearer {e.bearer_token}"))
        labels = {"hostname": label_value(hostname or socket.gethostname()) or "unknown",
                  **e.labels}  # fmt: skip
        return cls(e.pyroscope_url, e.app_name, float(e.interval), labels, tuple(headers),
                   e.timeout, e.max_pending, frequency, int(1e9 / frequency))  # fmt: skip


class Pusher:
    """The two tasks: ``ticker`` builds a window's profiles each interval, ``sender`` sends
    them. ``store`` returns the store to query after ``flush`` put the sampler's counts in it;
    ``offset`` is CLOCK_REALTIME minus CLOCK_MONOTONIC (api.clock_offset_ns)."""

    def __init__(self, cfg: PushConfig, *, store: Callable[[], Queries], flush: Callable[[], None],
                 offset: Callable[[], int], labels_of: LabelsOf | None = None) -> None:  # fmt: skip
        self.cfg = cfg
        self.endpoint = Endpoint.parse(cfg.url)
        self.store = store
        self.flush = flush
        self.offset = offset
        self.labels_of = labels_of
        self.stats = PushStats()
        self.queue: deque[Profile] = deque()
        self.next_from: int | None = None
        self.clock = Clock()
        self._queued = asyncio.Event()
        self._failing = False  # logged the current outage

    # -- building

    def build(self, now_ns: int) -> list[Profile]:
        """The profiles of the buckets completed since the last window (empty: none yet)."""
        store = self.store()
        b = store.bucket_ns
        until = (now_ns - GRACE_NS) // b * b
        lo, hi = store.covered(self.next_from, until, now_ns)
        if self.next_from is not None:
            lo = self.next_from  # held or not: the window starts where the last one ended
        if hi <= lo:
            return []
        stacks = store.query(lo, hi)
        self.next_from = hi
        offset = self.offset()
        from_s, until_s = self.clock.unix(lo, offset), self.clock.unix(hi, offset)
        self.stats.windows += 1
        self.stats.last_window = (from_s, until_s)
        out = []
        for labels, group in split_series(stacks, self.cfg.labels, self.labels_of).items():
            if not group:
                continue
            body = encode_profile(group, period_ns=self.cfg.period_ns, time_nanos=lo + offset,
                                  duration_nanos=hi - lo)  # fmt: skip
            target = ingest_target(self.cfg.app_name, labels, from_s, until_s,
                                   self.cfg.sample_rate)  # fmt: skip
            out.append(Profile(target, body, from_s, until_s))
        return out

    def enqueue(self, profiles: Iterable[Profile]) -> None:
        for p in profiles:
            self.queue.append(p)
            while len(self.queue) > self.cfg.max_pending:
                self.queue.popleft()
                self.stats.dropped["queue_full"] += 1
        self.stats.pending = len(self.queue)
        if self.queue:
            self._queued.set()

    async def ticker(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if await _wait(stop, self.cfg.interval):
                return
            try:
                self.flush()
                self.enqueue(self.build(time.monotonic_ns()))
            except Exception as e:  # a bad window must not end the pushes
                log.exception("push: building a profile failed")
                self.stats.last_error = f"build: {e}"

    # -- sending

    async def sender(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if not self.queue:
                self._queued.clear()
                waiter = asyncio.ensure_future(self._queued.wait())
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait((waiter, stopper), return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                stopper.cancel()
                continue
            p = self.queue.popleft()
            self.stats.pending = len(self.queue)
            try:
                await self.send(p, stop)
            except Exception as e:  # a bug here must not end the pushes unseen
                log.exception("push: sending a profile failed")
                self.stats.last_error = f"send: {e}"

    async def send(self, p: Profile, stop: asyncio.Event) -> None:
        headers = [("Content-Type", "application/octet-stream"), *self.cfg.headers]
        for attempt in range(ATTEMPTS):
            reason, error, retry = await self._attempt(p, headers)
            if reason is None:
                self.stats.pushed += 1
                self.stats.pushed_bytes += len(p.body)
                self.stats.last_success_unix = time.time()
                if self._failing:
                    log.info("push: %s accepts profiles again", self.cfg.url)
                    self._failing = False
                return
            self.stats.failures[reason] += 1
            self.stats.last_error = error
            if not self._failing:
                # Once per outage, not per attempt: the counters and /v1/status say the rest.
                log.warning("push: %s; retrying, dropping what cannot wait (see "
                            "unwindd_push_failures_total, unwindd_push_dropped_profiles_total)",
                            error)  # fmt: skip
                self._failing = True
            if not retry:
                self.stats.dropped["rejected"] += 1
                log.debug("push: dropping the profile of %d..%d: %s", p.from_s, p.until_s, error)
                return
            if attempt + 1 == ATTEMPTS:
                break
            log.debug("push: %s (attempt %d of %d)", error, attempt + 1, ATTEMPTS)
            if await _wait(stop, min(BACKOFF_S * 2**attempt, MAX_BACKOFF_S)):
                return
        self.stats.dropped["retries_exhausted"] += 1
        log.debug("push: dropping the profile of %d..%d after %d attempts", p.from_s, p.until_s,
                  ATTEMPTS)  # fmt: skip

    async def _attempt(self, p: Profile,
                       headers: list[tuple[str, str]]) -> tuple[str | None, str, bool]:  # fmt: skip
        """(failure reason or None, what failed, whether to try again)."""
        try:
            reply = await post(self.endpoint, p.target, headers, p.body,
                               timeout=self.cfg.timeout)  # fmt: skip
        except ConnectFailed as e:
            return "connect", f"connect {self.cfg.url}: {e.strerror or e}", True
        except TimeoutError:
            return "timeout", f"no answer from {self.cfg.url} within {self.cfg.timeout:g} s", True
        except ProtocolFailed as e:
            return "protocol", f"bad answer from {self.cfg.url}: {e}", True
        if 200 <= reply.status < 300:
            return None, "", False
        text = reply.body[:200].decode("utf-8", "replace").strip()
        error = f"HTTP {reply.status} from {self.cfg.url}/ingest: {text}"
        if reply.status >= 500:
            return "http_5xx", error, True
        # 408 and 429 say "later"; any other 4xx would refuse the same request again.
        return "http_4xx", error, reply.status in (408, 429)

    def status(self) -> dict[str, Any]:
        s = self.stats
        return {"url": self.cfg.url, "app_name": self.cfg.app_name,
                "interval": self.cfg.interval, "windows": s.windows, "pushed": s.pushed,
                "pushed_bytes": s.pushed_bytes, "pending": len(self.queue),
                "failures": {r: s.failures[r] for r in FAILURES},
                "dropped": {r: s.dropped[r] for r in DROPS},
                "last_window": list(s.last_window) if s.last_window else None,
                "last_success_unix": s.last_success_unix, "last_error": s.last_error}  # fmt: skip


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` unless ``stop`` is set first; True if it was."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return False
    return True
