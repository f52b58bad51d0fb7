"""Debug files fetched by build-id from debuginfod servers, for binaries whose symbols, CFI or
line tables are missing locally (stripped, no separate debug file found).

Rules:
- Servers: ``DEBUGINFOD_URLS`` (space-separated http(s) URLs, elfutils' convention) or the
  config's ``[symbols] debuginfod_urls``; asked in order with elfutils' HTTP API (debuginfod(8):
  ``GET /buildid/<hex>/debuginfo``, else ``/buildid/<hex>/executable``). The first answer
  that is an ELF file with that build-id wins; 404 from every server is ``not_found``.
- Wanted (``needs_fetch``): a usable binary with a build-id, no separate debug file under the
  debug roots, and no ``.symtab`` or no DWARF (``.debug_info``/``.debug_line``) of its own.
- Cache: ``<dir>/.build-id/xx/rest.debug`` (what elf.find_debug_file looks for in each debug
  root, so ``<dir>`` is one of the ELF cache's ``debug_roots``), written to a temporary file
  (``*.tmp``) and renamed into place once checked: a reader never sees half a file. The
  default ``<dir>``, ``DEBUGINFOD_SUBDIR`` of the cache dir, is bounded with the cache dir's
  other stores (cachefiles.prune_cache_dirs). A ``not_found`` leaves
  ``rest.miss`` beside it, honoured for ``negative_seconds`` (across restarts); other failures
  are remembered in memory for as long.
- Bounds: one fetch (every server, both kinds) takes at most ``timeout`` seconds (the socket
  timeout is the time left, and the deadline is checked between reads) and ``max_bytes``
  bytes (Content-Length, then the bytes read); at most ``max_pending`` fetches wait.
- Threads: ``Debuginfod.offer`` and ``finished`` run on the owner's thread (the daemon's event
  loop), which alone touches the ELF cache and the counters; fetches run on one worker thread
  (``start``), never on the sampling path. ``fetch_now`` fetches on the caller's thread
  (``unwindd replay``). Results count in ``stats.results`` by ``FETCH_RESULTS``.
- HTTP is urllib's (stdlib), on the worker: serve/httpclient.py is an asyncio client for the
  event loop (its fetches would run there) that truncates rather than refusing a long body.

Cost: per binary named one section-header read and a few stats (owner thread); per fetch one
HTTP exchange per server and kind tried, and a copy of the file to disk (worker). urllib and
http.client are imported by the first fetch, not with this module (the daemon imports it).
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..lightdc import dataclass, field
from .cachefiles import CACHE_STORES
from .elf import ElfError, ElfReader

if TYPE_CHECKING:
    from .elfentry import ElfEntry

__all__ = [
    "DEBUGINFOD_SUBDIR",
    "FETCH_RESULTS",
    "Debuginfod",
    "DebuginfodConfig",
    "DebuginfodStats",
    "cache_paths",
    "combine",
    "needs_fetch",
    "parse_urls",
]

# ok: a debug file (or the unstripped executable) is in the cache now; not_found: every server
# answered 404; error: connection refused, another HTTP status, a write that failed; timeout:
# the fetch's deadline passed; too_big: over max_bytes; bad_file: not an ELF file of that
# build-id; negative_cached: not asked, a recent not_found or failure stands; dropped: the
# queue of waiting fetches was full.
FETCH_RESULTS = ("ok", "not_found", "error", "timeout", "too_big", "bad_file",
                 "negative_cached", "dropped")  # fmt: skip
KINDS = ("debuginfo", "executable")
DEBUGINFOD_SUBDIR = CACHE_STORES[3]  # the downloads' default dir under the cache dir
_CHUNK = 1 << 16
_REMEMBERED = 4096  # build-ids offered or failed, remembered per process


@dataclass(frozen=True, slots=True)
class DebuginfodConfig:
    urls: tuple[str, ...]
    cache_dir: str
    timeout: float = 30.0
    max_bytes: int = 1 << 30
    negative_seconds: float = 600.0
    max_pending: int = 64


@dataclass
class DebuginfodStats:
    results: Counter[str] = field(default_factory=Counter)
    pending: int = 0  # fetches queued or running


def parse_urls(text: str) -> tuple[str, ...]:
    """``DEBUGINFOD_URLS``-style text -> the URLs, without trailing slashes. ValueError naming
    the first one that is not ``http(s)://HOST[:PORT][/PATH]``."""
    out = []
    for u in text.split():
        s = urlsplit(u)
        if s.scheme not in ("http", "https") or not s.hostname or s.query or s.fragment:
            raise ValueError(f"{u!r} is not an http(s)://HOST[:PORT][/PATH] URL")
        out.append(u.rstrip("/"))
    return tuple(out)


def urls_from(configured: str, env: Mapping[str, str]) -> tuple[str, ...]:
    """The servers in effect: the config's (``"off"``: none), else ``DEBUGINFOD_URLS``."""
    if configured == "off":
        return ()
    return parse_urls(configured or env.get("DEBUGINFOD_URLS", ""))


def needs_fetch(has_debug_file: bool, has_symtab: bool, has_dwarf: bool) -> bool:
    """Whether a binary's debug info is worth asking for (see the module rules)."""
    return not has_debug_file and not (has_symtab and has_dwarf)


def cache_paths(cache_dir: str, build_id: bytes) -> tuple[str, str]:
    """(debug file, negative marker) of ``build_id`` under ``cache_dir``."""
    h = build_id.hex()
    base = os.path.join(cache_dir, ".build-id", h[:2], h[2:])
    return base + ".debug", base + ".miss"


def combine(answers: Iterable[str]) -> str:
    """One fetch's result from its answers (one per server and kind asked; none ``ok``):
    ``not_found`` only if every answer was; else the first other."""
    rest = [a for a in answers if a != "not_found"]
    return rest[0] if rest else "not_found"


def negative_fresh(marker_mtime: float | None, now: float, ttl: float) -> bool:
    return marker_mtime is not None and now - marker_mtime < ttl


class _Answer(Exception):
    def __init__(self, result: str) -> None:
        super().__init__(result)
        self.result = result


def fetch(cfg: DebuginfodConfig, build_id: bytes) -> str:
    """Ask the servers for ``build_id``; on ``ok`` its file is in the cache, on ``not_found``
    the negative marker is. One of ``FETCH_RESULTS``; never raises for the network's sake."""
    debug, miss = cache_paths(cfg.cache_dir, build_id)
    deadline = time.monotonic() + cfg.timeout
    answers = []
    for url in cfg.urls:
        for kind in KINDS:
            try:
                _get(cfg, f"{url}/buildid/{build_id.hex()}/{kind}", build_id, debug, deadline)
                with contextlib.suppress(OSError):
                    os.unlink(miss)
                return "ok"
            except _Answer as a:
                answers.append(a.result)
                if a.result != "not_found":
                    break  # this server failed: the next one, not its other kind
        if answers and answers[-1] == "timeout":
            break  # the deadline is the fetch's, not a server's
    result = combine(answers)
    if result == "not_found":
        try:
            os.makedirs(os.path.dirname(miss), exist_ok=True)
            with open(miss, "wb"):
                pass
        except OSError:
            pass
    return result


def _get(cfg: DebuginfodConfig, url: str, build_id: bytes, dest: str, deadline: float) -> None:
    # urllib's HTTP stack (http.client, email, ...) is imported by the first fetch: a daemon
    # without debuginfod servers, or whose binaries all have their debug info, never pays it
    import http.client
    import urllib.error
    import urllib.request

    left = deadline - time.monotonic()
    if left <= 0:
        raise _Answer("timeout")
    req = urllib.request.Request(url, headers={"User-Agent": "unwindd"})
    try:
        resp: Any = urllib.request.urlopen(req, timeout=left)
    except urllib.error.HTTPError as e:
        e.close()
        raise _Answer("not_found" if e.code == 404 else "error") from None
    except urllib.error.URLError as e:
        raise _Answer("timeout" if isinstance(e.reason, TimeoutError | socket.timeout)
                      else "error") from None  # fmt: skip
    except TimeoutError:
        raise _Answer("timeout") from None
    except (OSError, ValueError, http.client.HTTPException):  # (a malformed answer)
        raise _Answer("error") from None
    with resp:
        _store(cfg, resp, build_id, dest, deadline)


def _store(cfg: DebuginfodConfig, resp: Any, build_id: bytes, dest: str,
           deadline: float) -> None:  # fmt: skip
    import http.client
    import tempfile

    length = resp.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) > cfg.max_bytes:
        raise _Answer("too_big")
    try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        # *.tmp: what prune_cache_dirs takes for a temporary (removed once stale)
        fd, tmp = tempfile.mkstemp(prefix=".fetch-", suffix=".tmp", dir=os.path.dirname(dest))
    except OSError:
        raise _Answer("error") from None
    try:
        with os.fdopen(fd, "w+b") as f:
            n = 0
            read = resp.read
            while True:
                if time.monotonic() > deadline:
                    raise _Answer("timeout")
                try:
                    chunk = read(_CHUNK)
                except TimeoutError:
                    raise _Answer("timeout") from None
                except (OSError, http.client.HTTPException):  # (a body cut short)
                    raise _Answer("error") from None
                if not chunk:
                    if length is not None and length.isdigit() and n != int(length):
                        raise _Answer("error")  # cut short (http.client's read(n) says b"")
                    break
                n += len(chunk)
                if n > cfg.max_bytes:
                    raise _Answer("too_big")
                f.write(chunk)
            f.flush()
            try:
                if ElfReader(f.fileno(), n).build_id() != build_id:
                    raise _Answer("bad_file")
            except ElfError:
                raise _Answer("bad_file") from None
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        tmp = ""
    except OSError:
        raise _Answer("error") from None
    finally:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


class Debuginfod:
    """The shell: decides per binary on the owner's thread, fetches on a worker (or at once,
    ``fetch_now``), reports what arrived (``finished``). See the module rules."""

    def __init__(self, cfg: DebuginfodConfig, *, sync: bool = False,
                 on_first_fetch: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.cfg = cfg
        self.sync = sync
        self.stats = DebuginfodStats()
        self.on_first_fetch = on_first_fetch
        self._fetched_any = False
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._failed: OrderedDict[bytes, float] = OrderedDict()  # build-id -> when
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._done: queue.SimpleQueue[tuple[bytes, str]] = queue.SimpleQueue()
        self._ok: list[bytes] = []
        self._thread: threading.Thread | None = None

    # -- owner's thread

    def offer(self, entry: ElfEntry) -> None:
        """A binary whose symbols were just loaded (its frames are being named): fetch its
        debug info if it lacks it. Never raises."""
        bid = entry.build_id
        if not bid or not entry.usable or bid in self._seen:
            return
        self._seen[bid] = None
        if len(self._seen) > _REMEMBERED:
            self._seen.popitem(last=False)
        try:
            reader = entry.reader()
            has_symtab = reader.section(".symtab") is not None
            has_dwarf = (reader.section(".debug_info") is not None
                         and reader.section(".debug_line") is not None)  # fmt: skip
            if not needs_fetch(entry.debug_path() is not None, has_symtab, has_dwarf):
                return
        except (ElfError, OSError):
            return
        if self.request(bid) == "ok":  # (sync: here already) looked for again on next use
            entry.forget_debug()

    def request(self, bid: bytes) -> str | None:
        """Fetch ``bid`` unless a recent failure or not_found stands (owner's thread): its
        result when fetched here (``sync``), else None."""
        now = time.time()
        when = self._failed.get(bid)
        _, miss = cache_paths(self.cfg.cache_dir, bid)
        try:
            mtime: float | None = os.stat(miss).st_mtime
        except OSError:
            mtime = None
        if (when is not None and now - when < self.cfg.negative_seconds) or negative_fresh(
                mtime, now, self.cfg.negative_seconds):  # fmt: skip
            self.stats.results["negative_cached"] += 1
            return None
        if not self._fetched_any:
            self._fetched_any = True
            if self.on_first_fetch is not None:
                self.on_first_fetch()
        if self.sync:
            result = fetch(self.cfg, bid)
            self._count(bid, result)
            return result
        if self.stats.pending >= self.cfg.max_pending:
            self.stats.results["dropped"] += 1
            self._seen.pop(bid, None)  # offered again when the binary is opened again
            return None
        self.stats.pending += 1
        self._queue.put(bid)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="unwindd-debuginfod",
                                            daemon=True)  # fmt: skip
            self._thread.start()
        return None

    def fetch_now(self, bid: bytes) -> str:
        """One fetch on the caller's thread, counted."""
        result = fetch(self.cfg, bid)
        self._count(bid, result)
        return result

    def finished(self) -> list[bytes]:
        """Build-ids whose debug file arrived since the last call; counts what the worker
        finished (owner's thread)."""
        while True:
            try:
                bid, result = self._done.get_nowait()
            except queue.Empty:
                break
            self.stats.pending -= 1
            self._count(bid, result)
        ok, self._ok = self._ok, []
        return ok

    def _count(self, bid: bytes, result: str) -> None:
        self.stats.results[result] += 1
        if result == "ok":
            self._ok.append(bid)
        elif result != "not_found":  # (a not_found has its marker on disk)
            self._failed[bid] = time.time()
            if len(self._failed) > _REMEMBERED:
                self._failed.popitem(last=False)

    def close(self) -> None:
        """Stop the worker after its current fetch (bounded by ``timeout``); not waited for."""
        if self._thread is not None:
            self._queue.put(None)

    # -- worker

    def _work(self) -> None:
        while True:
            bid = self._queue.get()
            if bid is None:
                return
            try:
                result = fetch(self.cfg, bid)
            except Exception:  # a bug here must not stop later fetches
                result = "error"
            self._done.put((bid, result))
