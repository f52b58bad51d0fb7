"""The daemon: the thin asyncio (uvloop) shell around the live profiler, the query socket, the
metrics listener and systemd's notify protocol.

Invariants:
- Everything that changes state runs on one event-loop thread: ``step()``, metric scrapes,
  reloads and the answer cache never run concurrently, so the sans-IO stages need no locks.
  The one exception is read-only: store queries (stacks, top, processes) run on one worker
  thread against an immutable ``StackStore.snapshot()`` taken on the loop (O(buckets)), so a
  query over a big window (O(entries in it) of Python) does not hold the rings undrained; the
  loop gets the GIL back at least every ``sys.getswitchinterval()``.
- The loop is never blocked for long: a step drains at most one round (bounded by the ring
  sizes, see capture.drain_round) and unwinds it in the native live step (livefast.py: Python
  only for side-band records, unplaceable samples and new frames), and every socket wait has a
  timeout.
- Rings are drained when they signal (``add_reader`` on the perf fds) and at least every
  ``[daemon] tick_ms`` by a timer. A ring fd that stays readable without yielding records (a
  sampled pid exited: POLLHUP) is dropped from the reader set until the next tick, so it cannot
  spin the loop.
- Identical queries within ``_ANSWER_TTL`` share one answer (bounded cache of 64).
- Per connection: a request must arrive completely within ``[api] request_timeout`` (else 408),
  its head within ``max_header_bytes`` (431) and its body within ``max_body_bytes`` (413); more
  than ``max_connections`` open connections get 503 at once; a stream client that does not keep
  up loses samples (counted), never slows the sampler.
- Lifecycle: READY=1 after the rings are open and the socket listens; WATCHDOG=1 at half of
  WATCHDOG_USEC while steps keep completing; SIGHUP -> RELOADING=1, re-read the config, apply
  the live keys, READY=1; SIGTERM/SIGINT -> STOPPING=1, stop accepting, end streams, drain the
  rings into the store, remove the socket, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import grp
import logging
import os
import signal
import socket
import stat
import struct
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..pipeline.live import LiveProfiler
from ..pipeline.livefast import StepInfo
from ..unwind.stackfmt import UnwoundSample
from .api import Api, Peer, stream_line
from .config import (
    CACHE_DIR_FALLBACK,
    DEFAULT_SOCKET,
    Config,
    ConfigError,
    cache_dir,
    changed_keys,
    fallback_socket,
    load_config,
    merge_live,
    parse_listen,
    restart_keys,
)
from .httpapi import (
    CLOSED,
    NEED_DATA,
    HttpSession,
    Request,
    Response,
    StreamStart,
    error_response,
)
from .metrics import Measurements, UnwinddCollector
from .sdnotify import Notifier

if TYPE_CHECKING:
    from ..unwind.engine import StackEngine

log = logging.getLogger("unwindd")

_READ_CHUNK = 65536
# Identical stack/top/process queries (same target, same peer uid) within this many seconds
# share one answer: a burst of dashboards or scripts costs one pass over the store, not one
# each. Status is never cached (it is cheap and reload tests read it back at once).
_ANSWER_TTL = 0.5
# The longest the native step holds sample counts before storing them (a read flushes first):
# bounds the engine stats' lag and the C group table (<= one entry per sample held).
_FLUSH_SECONDS = 1.0
_CACHED_PATHS = frozenset({"/v1/stacks", "/v1/top", "/v1/processes"})
_UID_CACHE_MAX = 65536


class StartupError(Exception):
    """The daemon cannot start for a reason the operator can fix (message says which)."""


def prepare_socket_path(path: str, is_default: bool) -> str:
    """Create the socket's directory. When it is the built-in default and cannot be created
    (not root: /run is not writable), fall back to a per-user directory and say so."""
    d = os.path.dirname(path)
    try:
        os.makedirs(d, mode=0o755, exist_ok=True)
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable", d)
        return path
    except OSError as e:
        if not is_default:
            raise StartupError(f"[api] socket: cannot create {d}: {e.strerror or e}") from None
        fb = fallback_socket()
        try:
            os.makedirs(os.path.dirname(fb), mode=0o700, exist_ok=True)
        except OSError as e2:
            msg = f"cannot create {d} ({e.strerror}) nor {fb} ({e2.strerror})"
            raise StartupError(msg) from None
        log.warning("cannot create %s (%s); listening on %s instead", d, e.strerror, fb)
        return fb


def remove_stale_socket(path: str) -> None:
    """A socket file left by a crashed daemon is removed; a live one is an error."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"[api] socket: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise StartupError(f"another unwindd is already listening on {path}")


def peer_of(writer: asyncio.StreamWriter) -> Peer:
    sock = writer.get_extra_info("socket")
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", raw)
    except (OSError, AttributeError):
        return Peer(None)
    return Peer(uid, pid)


def read_uid(proc_root: str, pid: int) -> int | None:
    """Real uid of a process from /proc/<pid>/status ("Uid:\\treal\\teffective\\t...")."""
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as fh:
            for line in fh.read(8192).splitlines():
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        config_path: str | None = None,
        notifier: Notifier | None = None,
        proc_root: str = "/proc",
        open_profiler: Callable[[Config], LiveProfiler] | None = None,
    ) -> None:
        self.running_config = config  # what the rings, socket and listener were opened with
        self.config = config  # effective: running + live keys from the latest reload
        self.config_path = config_path
        self.notifier = notifier or Notifier()
        self.proc_root = proc_root
        self._open_profiler = open_profiler or open_profiler_for
        self.profiler: LiveProfiler
        self.api = Api(self)
        self.m = Measurements.create()
        self.started_mono = time.monotonic()
        self.started_wall = time.time()
        self.connections = 0
        self.rejected: Counter[str] = Counter()
        self.stream_dropped = 0
        self.reloads = 0
        self.reload_errors: list[str] = []
        self.pending_restart: list[str] = []
        self.socket_path = ""
        self.last_step_mono = time.monotonic()
        self._streams: set[_StreamClient] = set()
        self._uid_cache: dict[int, tuple[int | None, str | None, float]] = {}
        self._answers: dict[tuple[str, int | None], tuple[float, Response]] = {}
        self._stop = asyncio.Event()
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._readers_on = False
        self._timer: asyncio.TimerHandle | None = None
        self.metrics_address: tuple[str, int] | None = None
        self._query_pool: ThreadPoolExecutor | None = None
        self._tls = threading.local()  # .store: the snapshot a worker-thread query reads

    # -- Source protocol (api.Api reads these)

    @property
    def store(self) -> Any:
        snap = getattr(self._tls, "store", None)
        return snap if snap is not None else self.profiler.store

    @property
    def period_ns(self) -> int:
        return int(1e9 / self.running_config.sampling.frequency)

    @property
    def max_stacks(self) -> int:
        return self.config.api.max_stacks

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def uptime(self) -> float:
        return time.monotonic() - self.started_mono

    def _proc_facts(self, pid: int) -> tuple[int | None, str | None]:
        now = time.monotonic()
        hit = self._uid_cache.get(pid)
        if hit is not None and hit[2] > now:
            return hit[0], hit[1]
        uid = read_uid(self.proc_root, pid)
        try:
            exe: str | None = os.readlink(f"{self.proc_root}/{pid}/exe")
        except OSError:
            exe = None
        if uid is None and hit is not None:
            # The process exited: its stored samples still belong to the uid it had.
            uid, exe = hit[0], hit[1]
        if len(self._uid_cache) >= _UID_CACHE_MAX:
            self._uid_cache.clear()  # bounded; a cold cache only costs re-reads
        self._uid_cache[pid] = (uid, exe, now + self.config.daemon.uid_cache_seconds)
        return uid, exe

    def uid_of(self, pid: int) -> int | None:
        return self._proc_facts(pid)[0]

    def exe_of(self, pid: int) -> str | None:
        exe = self._proc_facts(pid)[1]
        if exe is None:
            # Gone before we looked (short-lived, or its samples were processed late): the
            # lowest file mapping of its address space is, in practice, the executable.
            sp = self.profiler.engine.table.get(pid)
            files = [m for m in sp.mappings if m.filename.startswith("/")] if sp else []
            exe = min(files, key=lambda m: m.start).filename if files else None
        return exe

    def status(self) -> dict[str, Any]:
        p = self.profiler
        ps = p.pipeline.stats
        cache = p.engine.table.binaries.stats  # type: ignore[union-attr]
        st = p.store.stats
        window = p.store.window()
        return {
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(self.uptime(), 3),
            "started_unix": round(self.started_wall, 3),
            "now_ns": self.now_ns(),
            "samples": ps.by_type["SAMPLE"],
            "unwound": p.engine.stats.samples,
            "unwind": dict(p.engine.stats.by_status),
            "lost": ps.lost,
            "lost_samples": ps.lost_samples,
            "throttled": ps.throttled,
            "decode_errors": p.pipeline.decoder.stats.error_count,
            "late": p.pipeline.orderer.stats.late,
            "processes": len(p.engine.table.spaces),
            "cache": {"entries": cache.entries, "bytes": cache.bytes, "hits": cache.hits,
                      "misses": cache.misses, "evictions": cache.evictions},
            "store": {"samples": st.samples, "stacks": st.stacks, "entries": st.entries,
                      "bytes": st.bytes_estimate, "evicted_samples": st.evicted_samples,
                      "window_ns": list(window) if window else None},
            "api": {"socket": self.socket_path, "connections": self.connections,
                    "streams": len(self._streams), "rejected": dict(self.rejected)},
            "reloads": self.reloads,
            "reload_errors": self.reload_errors[-5:],
            "pending_restart": self.pending_restart,
            "rings": {"cpus": len(p.session.fds), "pages": p.session.config.ring_pages,
                      "wanted_pages": p.session.ring_pages_wanted},
            "config_source": self.config.source,
            "config": self.config.to_json(),
        }  # fmt: skip

    # -- lifecycle

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        cfg = self.running_config
        self.profiler = self._open_profiler(cfg)
        try:
            self.profiler.start()
            await self._listen(cfg)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop.set)
            loop.add_signal_handler(signal.SIGHUP, self.reload)
            self._set_readers(True)
            self._schedule_tick()
            if self.notifier.watchdog:
                self._spawn(self._watchdog(self.notifier.watchdog))
            self.notifier.ready(f"sampling {describe_target(cfg)} at "
                                f"{cfg.sampling.frequency} Hz")  # fmt: skip
            log.info("ready: %s at %d Hz; socket %s%s", describe_target(cfg),
                     cfg.sampling.frequency, self.socket_path,
                     f"; metrics http://{self._metrics_url()}/metrics"
                     if self.metrics_address else "")  # fmt: skip
            self._log_rings(cfg)
            await self._stop.wait()
        finally:
            await self._shutdown()
        return 0

    def _log_rings(self, cfg: Config) -> None:
        """The ring size in use; a warning when auto sizing got less than it wanted (a busy
        CPU's samples then fill half a ring in less than perfcore._HEADROOM_S)."""
        s = self.profiler.session
        pages, wanted = s.config.ring_pages, s.ring_pages_wanted
        how = "set" if cfg.sampling.ring_pages else "auto"
        log.info("rings: %d pages per CPU (%s)", pages, how)
        if pages < wanted:
            log.warning("rings: %d pages per CPU would suit %d Hz with %d-byte stacks, but the "
                        "locked-memory budget allows %d (kernel.perf_event_mlock_kb per CPU "
                        "plus LimitMEMLOCK, none with CAP_IPC_LOCK; other perf users of this "
                        "uid share it): watch unwindd_lost_records_total, or raise the budget",
                        wanted, cfg.sampling.frequency, cfg.sampling.stack_size,
                        pages)  # fmt: skip

    def _metrics_url(self) -> str:
        assert self.metrics_address is not None
        host, port = self.metrics_address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def _listen(self, cfg: Config) -> None:
        path = prepare_socket_path(cfg.api.socket, cfg.api.socket == DEFAULT_SOCKET)
        remove_stale_socket(path)
        server = await asyncio.start_unix_server(
            lambda r, w: self._connection(r, w, self._api_request, peer_of(w)), path=path,
            backlog=1024,
        )  # fmt: skip
        self._servers.append(server)
        self.socket_path = path
        self._apply_socket_perms()
        if cfg.metrics.enabled:
            host, port = parse_listen(cfg.metrics.listen)
            try:
                msrv = await asyncio.start_server(
                    lambda r, w: self._connection(r, w, self._metrics_request, Peer(None)),
                    host=host, port=port, reuse_address=True,
                )  # fmt: skip
            except OSError as e:
                raise StartupError(f"[metrics] listen: cannot listen on {cfg.metrics.listen}: "
                                   f"{e.strerror or e}") from None  # fmt: skip
            self._servers.append(msrv)
            sockname = msrv.sockets[0].getsockname()
            self.metrics_address = (sockname[0], sockname[1])
            from prometheus_client import CollectorRegistry

            self.registry = CollectorRegistry(auto_describe=False)
            self.registry.register(UnwinddCollector(self, self.m))

    def _apply_socket_perms(self) -> None:
        api = self.config.api
        try:
            if api.group:
                gid = int(api.group) if api.group.isdigit() else grp.getgrnam(api.group).gr_gid
                os.chown(self.socket_path, -1, gid)
            os.chmod(self.socket_path, api.mode)
        except (KeyError, OSError) as e:
            msg = f"[api] group/mode: cannot apply to {self.socket_path}: {e}"
            if isinstance(e, KeyError):
                msg = f"[api] group: no such group {api.group!r}"
            raise StartupError(msg) from None

    async def _shutdown(self) -> None:
        self.notifier.stopping()
        log.info("stopping: draining rings")
        for srv in self._servers:
            srv.close()
        for sc in list(self._streams):
            sc.close()
        self._set_readers(False)
        if self._timer is not None:
            self._timer.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=1.0)
            for t in pending:
                t.cancel()
        if self._query_pool is not None:
            self._query_pool.shutdown(wait=False, cancel_futures=True)
        if hasattr(self, "profiler"):
            self.profiler.close()
        if self.socket_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        log.info("stopped: %d samples", self.profiler.pipeline.stats.by_type["SAMPLE"]
                 if hasattr(self, "profiler") else 0)  # fmt: skip

    def _spawn(self, coro: Awaitable[Any]) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _watchdog(self, interval: float) -> None:
        while not self._stop.is_set():
            # Ping only while the sampler makes progress: a wedged pipeline should be
            # restarted by systemd even though the loop itself still runs.
            if time.monotonic() - self.last_step_mono < max(2 * interval, 1.0):
                self.notifier.ping()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)

    def reload(self) -> None:
        self.notifier.reloading()
        try:
            new = load_config(self.config_path)
        except ConfigError as e:
            self.reload_errors.append(str(e))
            log.error("reload failed, keeping the running config: %s", e)
            self.notifier.ready("reload failed: " + str(e)[:200])
            return
        old = self.config
        self.config = merge_live(self.running_config, new)
        self.pending_restart = restart_keys(self.running_config, new)
        self.reloads += 1
        store = self.profiler.store
        s = self.config.store
        store.max_entries = s.max_entries
        store.max_bytes = s.max_bytes  # a smaller cap evicts oldest buckets at the next add
        store.max_buckets = max(1, s.retention_seconds // s.bucket_seconds)
        logging.getLogger().setLevel(self.config.daemon.log_level.upper())
        try:
            self._apply_socket_perms()
        except StartupError as e:
            self.reload_errors.append(str(e))
            log.error("%s", e)
        applied = [k for k in changed_keys(old, self.config)]
        log.info("reloaded %s: applied %s%s", new.source, ", ".join(applied) or "nothing",
                 f"; needs a restart: {', '.join(self.pending_restart)}"
                 if self.pending_restart else "")  # fmt: skip
        self.notifier.ready()

    # -- sampling

    def _schedule_tick(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.config.daemon.tick_ms / 1000, self._tick)

    def _tick(self) -> None:
        self._step()
        self._set_readers(True)
        if not self._stop.is_set():
            self._schedule_tick()

    def _on_readable(self) -> None:
        if not self._step():
            self._set_readers(False)  # readable but empty: POLLHUP of an exited pid

    def _set_readers(self, on: bool) -> None:
        if on == self._readers_on or (on and self._stop.is_set()):
            return
        loop = asyncio.get_running_loop()
        for fd in self.profiler.fds:
            if on:
                loop.add_reader(fd, self._on_readable)
            else:
                loop.remove_reader(fd)
        self._readers_on = on

    def _step(self) -> bool:
        t0 = time.perf_counter()
        before = self.profiler.pipeline.stats.by_type.total()
        self.profiler.step()
        info = self.profiler.last_step  # counts even when no sample objects were built
        dt = time.perf_counter() - t0
        self.last_step_mono = time.monotonic()
        m = self.m
        m.step_seconds.observe(dt)
        if dt > 0.25:
            log.debug("slow step: %.3f s for %d samples (cold binaries?)", dt, info.samples)
        if info.samples:
            m.sample_seconds.observe(dt / info.samples, info.samples)
        self._observe_stored(info)
        return self.profiler.pipeline.stats.by_type.total() != before

    def _observe_stored(self, info: StepInfo) -> None:
        """Metrics of samples that reached the store (depths), and each new sampled pid's uid
        learnt while it is alive, so visibility still works after it exits (one /proc read
        per pid per uid_cache_seconds)."""
        depth = self.m.depth
        for d, c in info.depths.items():
            depth.observe(d, c)
        for pid in info.pids:
            if pid > 0:
                self._proc_facts(pid)

    def _flush(self) -> None:
        """Counts the sampler holds (see open_profiler_for) into the store, before a read."""
        self._observe_stored(self.profiler.flush())

    def _fanout(self, samples: Sequence[UnwoundSample]) -> None:
        for sc in self._streams:
            sc.offer(samples)

    # The store calls _fanout only while a stream is open: with a subscriber the native step
    # builds an UnwoundSample per sample, which nobody would read.
    def _add_stream(self, sc: _StreamClient) -> None:
        if not self._streams:
            self.profiler.store.subscribers.append(self._fanout)
        self._streams.add(sc)

    def _drop_stream(self, sc: _StreamClient) -> None:
        self._streams.discard(sc)
        subs = self.profiler.store.subscribers
        if not self._streams and self._fanout in subs:
            subs.remove(self._fanout)

    # -- connections

    async def _connection(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handle: Callable[[Request, Peer], Response | StreamStart],
        peer: Peer,
    ) -> None:
        api = self.config.api
        session = HttpSession(max_header_bytes=api.max_header_bytes,
                              max_body_bytes=api.max_body_bytes)  # fmt: skip
        if self.connections >= api.max_connections:
            self.rejected["too_many_connections"] += 1
            writer.write(session.error(503, "too many connections"))
            await self._close(writer)
            return
        self.connections += 1
        loop = asyncio.get_running_loop()
        try:
            while not self._stop.is_set():
                deadline = loop.time() + api.request_timeout
                item = session.next_request()
                while item is NEED_DATA:
                    remaining = deadline - loop.time()
                    try:
                        if remaining <= 0:
                            raise TimeoutError
                        data = await asyncio.wait_for(reader.read(_READ_CHUNK), remaining)
                    except TimeoutError:
                        self.rejected["timeout"] += 1
                        writer.write(session.error(408, "request not received in time"))
                        return
                    session.receive(data)
                    item = session.next_request()
                if item is CLOSED:
                    return
                if isinstance(item, Response):
                    self.rejected[f"http_{item.status}"] += 1
                    writer.write(session.respond(item))
                    return
                assert isinstance(item, Request)
                try:
                    if handle == self._api_request and self._offloaded(item):
                        result = await self._api_request_off_loop(item, peer)
                    else:
                        result = handle(item, peer)
                except Exception:
                    log.exception("handling %s", item.target)
                    result = error_response(500, "internal error")
                if isinstance(result, StreamStart):
                    await self._stream(session, reader, writer, result)
                    return
                writer.write(session.respond(result))
                await asyncio.wait_for(writer.drain(), api.request_timeout)
                if not session.keep_alive:
                    return
        except (TimeoutError, ConnectionError):
            pass
        finally:
            self.connections -= 1
            await self._close(writer)

    async def _close(self, writer: asyncio.StreamWriter) -> None:
        try:
            if writer.can_write_eof():
                writer.write_eof()
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except (OSError, TimeoutError, RuntimeError):
            writer.transport.abort()

    def _api_request(self, req: Request, peer: Peer) -> Response | StreamStart:
        cacheable = req.method == "GET" and req.path in _CACHED_PATHS
        key = (req.target, peer.uid)
        now = time.monotonic()
        if cacheable and (hit := self._cached_answer(req, key, now)) is not None:
            return hit
        self._flush()
        res = self.api.handle(req, peer)
        if cacheable:
            self._remember_answer(key, res, now)
        full = len(self._streams) >= self.config.api.max_stream_clients
        if isinstance(res, StreamStart) and full:
            self.rejected["too_many_streams"] += 1
            return error_response(429, "too many stream clients")
        return res

    def _offloaded(self, req: Request) -> bool:
        return (req.method == "GET" and req.path in _CACHED_PATHS
                and hasattr(self.profiler.store, "snapshot"))  # fmt: skip

    async def _api_request_off_loop(self, req: Request, peer: Peer) -> Response | StreamStart:
        """``_api_request`` for a store query: the cache on the loop, the query itself on the
        worker thread against a snapshot (see the module doc)."""
        key = (req.target, peer.uid)
        if (hit := self._cached_answer(req, key, time.monotonic())) is not None:
            return hit
        if self._query_pool is None:
            self._query_pool = ThreadPoolExecutor(1, thread_name_prefix="unwindd-query")
        self._flush()
        snap = self.profiler.store.snapshot()

        def run() -> Response | StreamStart:
            self._tls.store = snap
            try:
                return self.api.handle(req, peer)
            finally:
                self._tls.store = None
                snap.close()

        res = await asyncio.get_running_loop().run_in_executor(self._query_pool, run)
        self._remember_answer(key, res, time.monotonic())
        return res

    def _cached_answer(self, req: Request, key: tuple[str, int | None],
                       now: float) -> Response | None:  # fmt: skip
        """The answer to the same query from the same uid, if younger than _ANSWER_TTL."""
        hit = self._answers.get(key)
        if hit is None or hit[0] <= now:
            return None
        self.api.requests[req.path] += 1
        return hit[1]

    def _remember_answer(self, key: tuple[str, int | None], res: Response | StreamStart,
                         now: float) -> None:  # fmt: skip
        """Keep a 200 answer for _ANSWER_TTL; at most 64 answers (expired ones go first, then
        new ones are not kept until some expire)."""
        if not isinstance(res, Response) or res.status != 200:
            return
        if len(self._answers) >= 64:
            self._answers = {k: v for k, v in self._answers.items() if v[0] > now}
        if len(self._answers) < 64:
            self._answers[key] = (now + _ANSWER_TTL, res)

    def _metrics_request(self, req: Request, peer: Peer) -> Response | StreamStart:
        if req.method != "GET":
            return error_response(405, "only GET")
        if req.path not in ("/metrics", "/"):
            return error_response(404, "try /metrics")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self._flush()
        return Response(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)

    async def _stream(
        self,
        session: HttpSession,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        start: StreamStart,
    ) -> None:
        p = start.params
        sc = _StreamClient(p["accept"], self.config.api.stream_queue, self)
        limit: int | None = p.get("limit")
        seconds: float | None = p.get("seconds")
        loop = asyncio.get_running_loop()
        end = None if seconds is None else loop.time() + seconds
        self._add_stream(sc)
        sent = 0
        try:
            writer.write(session.start_stream(start.content_type))
            await asyncio.wait_for(writer.drain(), self.config.api.request_timeout)
            while not sc.closed and not self._stop.is_set():
                timeout = 1.0 if end is None else min(1.0, end - loop.time())
                if timeout <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(sc.wake.wait(), timeout)
                if reader.at_eof() or writer.is_closing():
                    return
                batch = sc.take()
                if limit is not None:
                    batch = batch[: limit - sent]
                if batch:
                    writer.write(session.stream_data(b"".join(stream_line(s) for s in batch)))
                    sent += len(batch)
                    # A client that cannot take a batch within the timeout is dropped.
                    await asyncio.wait_for(writer.drain(), self.config.api.request_timeout)
                if limit is not None and sent >= limit:
                    break
            writer.write(session.end_stream())
            await asyncio.wait_for(writer.drain(), 1.0)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            self._drop_stream(sc)


class _StreamClient:
    """One live-stream subscriber: a bounded queue the sampler fills without waiting."""

    def __init__(self, accept: Callable[[UnwoundSample], bool], cap: int, daemon: Daemon) -> None:
        self.accept = accept
        self.cap = cap
        self.daemon = daemon
        self.queue: list[UnwoundSample] = []
        self.wake = asyncio.Event()
        self.closed = False

    def offer(self, samples: Sequence[UnwoundSample]) -> None:
        got = [s for s in samples if self.accept(s)]
        if not got:
            return
        room = self.cap - len(self.queue)
        if room < len(got):
            self.daemon.stream_dropped += len(got) - max(room, 0)
            got = got[: max(room, 0)]
        self.queue += got
        self.wake.set()

    def take(self) -> list[UnwoundSample]:
        out, self.queue = self.queue, []
        self.wake.clear()
        return out

    def close(self) -> None:
        self.closed = True
        self.wake.set()


def describe_target(cfg: Config) -> str:
    s = cfg.sampling
    if s.target == "pids":
        return "pids " + ",".join(map(str, s.pids))
    if s.target == "cgroup":
        return f"cgroup {s.cgroup}"
    return "all CPUs"


def _engine_with_disk_cache(cfg: Config) -> StackEngine:
    """The daemon's engine. Compiled CFI and symbol tables persist by build-id under the
    cache dir (``config.cache_dir``): a restart loads them (a read and a check per binary)
    instead of compiling and re-reading symbols. The dir is bounded at start
    (``prune_cache_dir``: ``dir_max_bytes`` split over cfi/ and sym/, LRU). Not root and the
    default dir not writable: the user's cache dir; a dir that cannot be made is logged and
    the daemon runs without one."""
    from ..binaries.cachefiles import prune_cache_dir, user_cache_dir
    from ..binaries.elfcache import CacheConfig
    from ..unwind.engine import CACHE_SUBDIRS, StackEngine

    make = partial(StackEngine.create, cache_config=CacheConfig(max_bytes=cfg.cache.max_bytes),
                   max_depth=cfg.unwind.max_depth, prefetch_cfi=True)  # fmt: skip
    root = cache_dir(cfg.cache, os.environ)
    if root is None:
        return make()
    if root == CACHE_DIR_FALLBACK and os.geteuid() != 0:
        root = user_cache_dir(os.environ)  # not root, not under systemd: /var/cache is not ours
    # CFI files take more of the dir than symbol files for the same binaries: split the bound
    # 60 / 40
    for sub, share in zip(CACHE_SUBDIRS, (0.6, 0.4), strict=True):
        n, freed = prune_cache_dir(os.path.join(root, sub), int(cfg.cache.dir_max_bytes * share))
        if n:
            log.info("cache dir %s/%s: removed %d files (%d bytes) past its bound", root, sub, n,
                     freed)  # fmt: skip
    try:
        return make(cache_dir=root)
    except OSError as e:  # the directory cannot be made: run without it, and say so
        log.warning("cache dir %s unusable (%s): CFI and symbols are not persisted", root, e)
        return make()


def open_profiler_for(cfg: Config) -> LiveProfiler:
    from ..source.perfcore import SamplingConfig, Target
    from ..store.stackstore import StackStore

    s = cfg.sampling
    if s.target == "pids":
        target = Target(pids=s.pids)
    elif s.target == "cgroup":
        target = Target(cgroup=s.cgroup)
    else:
        target = Target(all_cpus=True)
    sampling = SamplingConfig(event=s.event, frequency=s.frequency, stack_size=s.stack_size,
                              ring_pages=s.ring_pages)  # fmt: skip
    engine = _engine_with_disk_cache(cfg)
    st = cfg.store
    store = StackStore(bucket_ns=st.bucket_seconds * 1_000_000_000,
                       max_buckets=max(1, st.retention_seconds // st.bucket_seconds),
                       max_entries=st.max_entries, max_bytes=st.max_bytes)  # fmt: skip
    # Counts reach the store once a second and before every read of it (Daemon._flush), not
    # every drain: a busy stack's group recurs in most drains of a second, and each store
    # update of it is Python work.
    return LiveProfiler.open(target, sampling, engine=engine, store=store, native=True,
                             flush_interval=_FLUSH_SECONDS)  # fmt: skip


def setup_logging(level: str) -> None:
    logging.basicConfig(format="unwindd: %(levelname)s: %(message)s", level=level.upper())


def run_daemon(config_path: str | None) -> int:
    """``unwindd run``: load the config, run until SIGTERM. Operator errors -> one line, 2."""
    from ..source.perfcore import PerfOpenError

    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        print(f"unwindd: error: {e}", flush=True, file=_stderr())
        return 2
    setup_logging(cfg.daemon.log_level)
    # Every new stack and frame the daemon keeps is a container object, so the default
    # collector (a young collection per 700 of them) ran young and middle passes over what the
    # store holds for good many times a second; 20,000 makes those passes ~28x rarer (cyclic
    # garbage, which the daemon makes little of, waits longer). Middle and full passes keep
    # CPython's ratios (10 and 10; a full pass also waits until the objects added since the
    # last one are 25 % of the old), so cycles that reached the old generation are not kept
    # for much longer than that.
    gc.set_threshold(20_000, 10, 10)
    daemon = Daemon(cfg, config_path=config_path)
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(daemon.run())
    except (StartupError, PerfOpenError, ValueError) as e:
        log.error("%s", e)
        return 2
    finally:
        daemon.notifier.close()


def _stderr() -> Any:
    import sys

    return sys.stderr
