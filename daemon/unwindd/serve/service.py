"""The daemon: the thin asyncio (uvloop) shell around the live profiler, its lifecycle and the
loop that drains the rings (connections.py, streams.py, answers.py and startup.py hold the rest).

Invariants:
- Everything that changes state runs on the event-loop thread (steps, scrapes, reloads, the
  answer cache), so the sans-IO stages need no locks. The one exception is read-only: store
  queries run on one worker thread against a ``StackStore.snapshot()`` taken on the loop
  (O(buckets)), so a big window (O(entries in it) of Python) does not leave the rings undrained.
  An answer written as it is rendered (``ChunkedResponse``) renders each chunk on that thread
  too, from the same snapshot, which it releases when it is written or abandoned: the snapshot
  is held for the answer's rendering plus at most ``request_timeout`` of the client's waits
  (connections.py), so stacks the store drops meanwhile are freed that much later.
- The loop is never blocked for long: a step drains at most one round (bounded by the ring
  sizes, capture.drain_round) and unwinds it natively (ringstep.py), and socket waits time out.
- Rings are drained when they signal (``add_reader`` on the perf fds) and at least every
  ``[daemon] tick_ms`` (a tick is due that long after the last drain, whatever woke it,
  unless Python threads are read: then every ``tick_ms``); while the machine is idle each
  tick comes twice as late, up to ``idle_tick_ms``, and every read of the store drains the
  rings first when the tick is later than ``tick_ms`` (``_pace``, ``_flush``: answers are as
  fresh as at ``tick_ms``). A ring fd readable without
  records (a sampled pid exited: POLLHUP) is dropped from the reader set until the next
  tick, so it cannot spin the loop.
- Lifecycle: READY=1 once the rings are open and the socket listens; WATCHDOG=1 at half of
  WATCHDOG_USEC while steps keep completing; SIGHUP -> RELOADING=1, re-read the config, apply
  the live keys (or keep the running ones if it does not load), READY=1, and keep the outcome
  (``ReloadOutcome``: the latest one and counts, O(1)) for /v1/status; SIGTERM/SIGINT ->
  STOPPING=1, stop accepting, end streams, drain the rings into the store, remove the socket,
  exit 0.
- With ``[export] pyroscope_url`` set, the push (pyroscope.py) runs as two tasks on the loop;
  they end with the daemon (profiles still queued are not sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .. import __version__
from ..binaries.debuginfod import Debuginfod, DebuginfodStats
from ..lightdc import dataclass, replace
from ..pipeline.live import LiveProfiler
from ..pipeline.ringstep import StepInfo
from . import heap
from .answers import AnswerCache, cacheable
from .api import Answer, Api, Peer, clock_offset_ns
from .codepages import CodePages
from .config import (
    DEFAULT_SOCKET,
    Config,
    ConfigError,
    changed_keys,
    load_config,
    merge_live,
    restart_keys,
)
from .connections import Connections, peer_of
from .httpapi import (
    ALLOW_GET,
    TOO_MANY_STREAMS,
    ChunkedResponse,
    Request,
    Response,
    StreamStart,
    error_response,
)
from .metrics import Measurements, UnwinddCollector
from .openapi import spec_bytes
from .pprofpull import PprofPull
from .procfacts import Facts, ProcFacts
from .pyroscope import PushConfig, Pusher, PushStats
from .sdnotify import Notifier
from .startup import (
    StartupError,
    apply_socket_perms,
    attach_debuginfod,
    debuginfod_config,
    describe_target,
    listen_tcp,
    open_profiler_for,
    preflight,
    prepare_socket_path,
    remove_stale_socket,
)
from .streams import StreamFanout

log = logging.getLogger("unwindd")

# Every new stack and frame the daemon keeps is a container object, so the default collector
# (a young collection per 700 of them) ran young and middle passes over what the store holds
# for good many times a second; 20,000 makes those passes ~28x rarer (cyclic garbage, which the
# daemon makes little of, waits longer). Middle and full passes keep CPython's ratios (10 and
# 10; a full pass also waits until the objects added since the last one are 25 % of the old),
# so cycles that reached the old generation are not kept for much longer than that.
GC_THRESHOLDS = (20_000, 10, 10)

# Samples of tasks other than the idle task, as a share of the CPUs' time, below which a step
# is idle (_pace): kernel threads' housekeeping and the daemon's own steps come to less.
IDLE_SHARE = 0.02


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


@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    """One SIGHUP: when (wall clock), whether the new config's live keys took effect, and what
    failed (None: nothing). A config that does not load is not applied at all; socket
    permissions that cannot be set leave the rest of the new config applied."""

    unix: float
    applied: bool
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return {"unix": round(self.unix, 3), "ok": self.ok, "applied": self.applied,
                "error": self.error}  # fmt: skip


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
        self.api = Api(self, describe=spec_bytes, plain_symbol=self._plain_symbol)
        self.m = Measurements.create()
        self.started_mono = time.monotonic()
        self.started_wall = time.time()
        self.reloads = 0  # reloads whose config was applied
        self.reload_failures = 0  # reloads that failed, in whole or in part
        self.last_reload: ReloadOutcome | None = None
        self.reload_errors: deque[str] = deque(maxlen=5)  # the latest failures' errors
        self.pending_restart: list[str] = []
        self.socket_path = ""
        self.last_step_mono = time.monotonic()
        # uid and exe per pid, kept while the store holds the pid's samples (procfacts.py)
        self._facts = ProcFacts(self._read_facts, lambda pid: self.profiler.store.holds(pid))
        self._answers = AnswerCache()
        self._stop = asyncio.Event()
        self.streams = StreamFanout(lambda: self.config.api, self._stop,
                                    lambda: self.profiler.store.subscribers)  # fmt: skip
        self.conns = Connections(lambda: self.config.api, self._stop, self.streams.serve)
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._readers_on = False
        self._drained = False  # a step drained the rings in this pass of the loop (_stepped)
        self._ready = False  # READY=1 sent: a stop is then a shutdown, not a failed start
        self._timer: asyncio.TimerHandle | None = None
        self._tick_s = 0.0  # the next tick's delay (_pace); 0: tick_ms
        self._ncpus = os.cpu_count() or 1
        # free heap pages back to the kernel, unused code pages out of the RSS (heap.py)
        self.trimmer = heap.Trimmer(code=CodePages())
        self.metrics_address: tuple[str, int] | None = None
        self.pull: PprofPull | None = None  # [export] pprof_listen
        self._query_pool: ThreadPoolExecutor | None = None
        self._tls = threading.local()  # .store: the snapshot a worker-thread query reads
        self.pusher: Pusher | None = None  # [export] pyroscope_url: pyroscope.py
        self.push_stats = PushStats()  # the pusher's, once there is one (metrics read it)
        self.debuginfod: Debuginfod | None = None  # [symbols] debuginfod_urls / DEBUGINFOD_URLS
        self.debuginfod_stats = DebuginfodStats()  # its, once there is one (metrics read it)

    # -- what metrics and status read

    @property
    def connections(self) -> int:
        return self.conns.open

    @property
    def rejected(self) -> Counter[str]:
        return self.conns.rejected

    @property
    def stream_dropped(self) -> int:
        return self.streams.dropped

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

    def _read_facts(self, pid: int) -> Facts:
        uid = read_uid(self.proc_root, pid)
        try:
            exe: str | None = os.readlink(f"{self.proc_root}/{pid}/exe")
        except OSError:
            exe = None
        return uid, exe

    def _proc_facts(self, pid: int) -> Facts:
        return self._facts.get(pid, time.monotonic(), self.config.daemon.uid_cache_seconds)

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

    def _plain_symbol(self, dso: str | None, rel: int | None) -> tuple[str, int | None] | None:
        """engine.plain_symbol (the query thread's inline=0 answers: one dict read)."""
        return self.profiler.engine.plain_symbol(dso, rel)

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
            "tick_ms": round(1000 * self._tick_s) or self.config.daemon.tick_ms,  # _pace
            "started_unix": round(self.started_wall, 3),
            "now_ns": self.now_ns(),
            "samples": ps.by_type["SAMPLE"],
            "unwound": p.engine.stats.samples,
            "unwind": dict(p.engine.stats.by_status),
            "jit": {**p.engine.jit.status(),
                    "jitdumps": p.engine.symbolizer.jitdump_counts()},
            "inline": p.inline_status(),
            "lost": ps.lost,
            "lost_samples": ps.lost_samples,
            "throttled": ps.throttled,
            "decode_errors": p.pipeline.decoder.stats.error_count,
            "late": p.pipeline.orderer.stats.late,
            "processes": len(p.engine.table.spaces),
            "runtimes": _runtimes(p),
            "cache": {"entries": cache.entries, "bytes": cache.bytes, "hits": cache.hits,
                      "misses": cache.misses, "evictions": cache.evictions,
                      "mapped_bytes": cache.mapped_bytes},
            "store": {"samples": st.samples, "stacks": st.stacks, "entries": st.entries,
                      "bytes": st.bytes_estimate, "evicted_samples": st.evicted_samples,
                      "window_ns": list(window) if window else None,
                      "snapshots": p.store.snapshots},
            "api": {"socket": self.socket_path, "connections": self.connections,
                    "streams": len(self.streams.clients), "rejected": dict(self.rejected)},
            "reloads": self.reloads,
            "reload_failures": self.reload_failures,
            "last_reload": self.last_reload.to_json() if self.last_reload else None,
            "reload_errors": list(self.reload_errors),
            "pending_restart": self.pending_restart,
            "push": self.pusher.status() if self.pusher is not None else None,
            "memory": self.memory(),
            "rings": {"cpus": len(p.session.fds), "pages": p.session.config.ring_pages,
                      "wanted_pages": p.session.ring_pages_wanted,
                      "spill": p.session.spill_stats(),
                      "spill_max_bytes": self.config.sampling.spill_max_bytes},
            "config_source": self.config.source,
            "config": self.config.to_json(),
        }  # fmt: skip

    def memory(self) -> dict[str, Any]:
        """/v1/status's ``memory``: the live step's C context (its heap bytes and the stacks and
        frames it and its Python mirror hold until the next context reset), the engine's caches
        (per process, dropped with it: ``StackEngine.cache_sizes``) and the pids the stream's
        per-pid counts hold (``stream_pids``, dropped likewise), the pids whose uid and exe are
        kept (``proc_facts``, procfacts.py), the C heap (heap.py; None without glibc) and the
        mapped cache tables the last release dropped from the page tables (``mapped_tables``:
        their count and bytes), and the mappings of its own code the last trim did likewise
        (``code_pages``, codepages.py)."""
        ns = self.profiler.native_step
        code = self.trimmer.code
        hs = heap.stats()
        return {"native_context": {"bytes": ns.nctx.native_bytes, "stacks": ns.nstacks,
                                   "frames": ns.nframes, "resets": ns.contexts - 1},
                "per_process": {**self.profiler.engine.cache_sizes(),
                                "stream_pids": _stream_pids(self.profiler),
                                "proc_facts": len(self._facts)},
                "heap": hs.to_json() if hs is not None else None,
                "trims": self.trimmer.trims,
                "mapped_tables": {"tables": self.trimmer.mapped_tables,
                                  "bytes": self.trimmer.mapped_bytes},
                "code_pages": {"mappings": code.mappings if code else 0,
                               "bytes": code.nbytes if code else 0}}  # fmt: skip

    def heap_bytes(self) -> dict[str, int]:
        """The C heap by state, for the metrics ({} without glibc: heap.py)."""
        hs = heap.stats()
        if hs is None:
            return {}
        return {"in_use": hs.in_use, "free": hs.free, "mapped": hs.mapped}

    # -- lifecycle

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        cfg = self.running_config
        # What start would refuse, before the rings are opened: a second daemon on the same
        # socket, or a bad group, then fails with its one error and nothing else.
        preflight(cfg)
        push = self._push_config(cfg)
        path = prepare_socket_path(cfg.api.socket, cfg.api.socket == DEFAULT_SOCKET)
        remove_stale_socket(path)
        self.profiler = self._open_profiler(cfg)
        try:
            self._start_debuginfod(cfg)  # before the bootstrap opens binaries
            self.profiler.start()
            await self._listen(cfg, path)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop.set)
            loop.add_signal_handler(signal.SIGHUP, self.reload)
            self._set_readers(True)
            self._schedule_tick()
            if self.notifier.watchdog:
                self._spawn(self._watchdog(self.notifier.watchdog))
            if push is not None:
                self._start_push(push)
            self.notifier.ready(f"sampling {describe_target(cfg)} at "
                                f"{cfg.sampling.frequency} Hz")  # fmt: skip
            self._ready = True
            log.info("ready: %s at %d Hz; socket %s%s", describe_target(cfg),
                     cfg.sampling.frequency, self.socket_path,
                     f"; metrics http://{self._metrics_url()}/metrics"
                     if self.metrics_address else "")  # fmt: skip
            self._log_rings(cfg)
            await self._stop.wait()
        finally:
            await self._shutdown()
        return 0

    def _start_debuginfod(self, cfg: Config) -> None:
        dcfg = debuginfod_config(cfg, os.environ)
        if dcfg is None:
            return
        self.debuginfod = attach_debuginfod(self.profiler.engine, dcfg)
        self.debuginfod_stats = self.debuginfod.stats
        log.info("debuginfod: debug info of binaries that lack it is fetched from %s "
                 "(cache %s)", " ".join(dcfg.urls), dcfg.cache_dir)  # fmt: skip

    def _debuginfod_arrivals(self) -> None:
        """Debug files the worker fetched: their binaries' symbols load again from them, and
        every cached name goes (the engine's, the native step's frames), so frames sampled
        from now on are named from them."""
        if self.debuginfod is None:
            return
        got = self.debuginfod.finished()
        if not got:
            return
        from ..binaries.elfcache import ElfCache

        engine = self.profiler.engine
        cache = engine.table.binaries
        for bid in got:
            entry = cache.lookup_build_id(bid) if isinstance(cache, ElfCache) else None
            if entry is not None:
                entry.forget_debug()
        engine.forget_names()
        self.profiler.native_step.reset_context()
        log.info("debuginfod: debug info of %d binaries arrived", len(got))

    def _push_config(self, cfg: Config) -> PushConfig | None:
        if not cfg.export.pyroscope_url:
            return None
        try:
            return PushConfig.from_section(cfg.export, frequency=cfg.sampling.frequency)
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or str(e)
            raise StartupError(f"[export] basic_auth_password_file: cannot read "
                               f"{cfg.export.basic_auth_password_file}: {why}") from None

    def _start_push(self, push: PushConfig) -> None:
        """The push tasks (pyroscope.py): a series per process label set (unit, cgroup,
        container_id: the store keeps them per pid, procs/cgroups.py) besides the static ones."""
        self.pusher = Pusher(push, store=lambda: self.profiler.store, flush=self._flush,
                             offset=clock_offset_ns,
                             labels_of=lambda s: self.profiler.store.labels_of(s.pid))  # fmt: skip
        self.push_stats = self.pusher.stats
        self._spawn(self.pusher.ticker(self._stop))
        self._spawn(self.pusher.sender(self._stop))
        log.info("push: every %g s (windows of whole %d s store buckets) to %s/ingest as %s",
                 push.interval, self.running_config.store.bucket_seconds, push.url,
                 push.app_name)  # fmt: skip

    def _log_rings(self, cfg: Config) -> None:
        """The ring size in use; a warning when auto sizing got less than it wanted (a busy
        CPU's samples then fill half a ring in less than sampling._HEADROOM_S)."""
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

    async def _listen(self, cfg: Config, path: str) -> None:
        server = await asyncio.start_unix_server(
            lambda r, w: self.conns.serve(r, w, self._api_answer, peer_of(w)), path=path,
            backlog=1024,
        )  # fmt: skip
        self._servers.append(server)
        self.socket_path = path
        apply_socket_perms(self.config.api, self.socket_path)
        if cfg.metrics.enabled:
            msrv, self.metrics_address = await listen_tcp(
                "[metrics] listen", cfg.metrics.listen,
                lambda r, w: self.conns.serve(r, w, self._metrics_answer, Peer(None)))
            self._servers.append(msrv)
            from prometheus_client import CollectorRegistry, ProcessCollector

            self.registry = CollectorRegistry(auto_describe=False)
            self.registry.register(UnwinddCollector(self, self.m))
            # What the daemon itself costs, as every Prometheus client exports it:
            # process_cpu_seconds_total, process_resident_memory_bytes, open fds, start time
            # (read from /proc/self at each scrape).
            ProcessCollector(registry=self.registry)
        if cfg.export.pprof_listen:
            self.pull = PprofPull(self, self._flush, lambda: self.config, self._stop)
            self._servers.append(await self.pull.listen())

    async def _shutdown(self) -> None:
        """Stop (after READY=1: say so, drain, report), or undo a start that failed (quietly:
        the start's error, logged by the caller, is the one thing to say)."""
        if self._ready:
            self.notifier.stopping()
            log.info("stopping: draining rings")
        for srv in self._servers:
            srv.close()
        self.streams.close_all()
        self._set_readers(False)
        if self._timer is not None:
            self._timer.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=1.0)
            for t in pending:
                t.cancel()
        if self._query_pool is not None:
            self._query_pool.shutdown(wait=False, cancel_futures=True)
        if self.pull is not None:
            await self.pull.close()
        if hasattr(self, "profiler"):
            self.profiler.close()
        if self.debuginfod is not None:
            self.debuginfod.close()
        if self.socket_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        if self._ready:
            log.info("stopped: %d samples", self.profiler.pipeline.stats.by_type["SAMPLE"])

    def _spawn(self, coro: Awaitable[Any]) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _watchdog(self, interval: float) -> None:
        while not self._stop.is_set():
            # Ping only while the sampler makes progress: a wedged pipeline should be
            # restarted by systemd even though the loop itself still runs.
            idle = self.config.daemon.idle_tick_ms / 1000
            if time.monotonic() - self.last_step_mono < max(2 * interval, 2 * idle, 1.0):
                self.notifier.ping()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)

    def reload(self) -> None:
        self.notifier.reloading()
        try:
            new = load_config(self.config_path)
        except ConfigError as e:
            self._reloaded(applied=False, error=str(e))
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
        error = None
        try:
            apply_socket_perms(self.config.api, self.socket_path)
        except StartupError as e:
            error = str(e)
            log.error("%s", e)
        self._reloaded(applied=True, error=error)
        applied = [k for k in changed_keys(old, self.config)]
        log.info("reloaded %s: applied %s%s", new.source, ", ".join(applied) or "nothing",
                 f"; needs a restart: {', '.join(self.pending_restart)}"
                 if self.pending_restart else "")  # fmt: skip
        self.notifier.ready()

    def _reloaded(self, *, applied: bool, error: str | None) -> None:
        self.last_reload = ReloadOutcome(time.time(), applied, error)
        if error is not None:
            self.reload_failures += 1
            self.reload_errors.append(error)

    # -- sampling

    def _schedule_tick(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._tick_s or self.config.daemon.tick_ms / 1000,
                                      self._tick)

    def _pace(self, sideband: int, busy: int, now: float, last: float) -> None:
        """The next tick's delay. The tick bounds how late records reach the store and how
        long a short-lived process's binary waits to be pinned (live.py ``_pin``), so it is
        ``tick_ms`` whenever there is anything to be late for: process events, samples of
        tasks other than the idle task above 2 % of the CPUs' time (``IDLE_SHARE``: kernel
        threads and the daemon itself stay below), a ``/v1/stream`` client, a Python thread
        being read. Otherwise the machine is idle, where a wakeup costs more than the idle
        task's samples it drains: each quiet step doubles the delay, up to ``idle_tick_ms``.
        Store reads catch up first (``_flush``)."""
        d = self.config.daemon
        base = d.tick_ms / 1000
        py = self.profiler.python
        allowed = IDLE_SHARE * self._ncpus * self.config.sampling.frequency * (now - last)
        if (sideband or busy > allowed or d.idle_tick_ms <= d.tick_ms
                or self.profiler.store.subscribers or (py is not None and py.reading)):
            self._tick_s = base
        else:
            self._tick_s = min(2 * max(self._tick_s, base), d.idle_tick_ms / 1000)

    def _tick(self) -> None:
        self._debuginfod_arrivals()
        self._step()
        self._stepped(True)
        self._set_readers(True)

    def _on_readable(self) -> None:
        if self._drained:
            return  # a ring whose wakeup came in the same poll as one already stepped for
        self._debuginfod_arrivals()
        if not self._step():
            # readable but empty: POLLHUP of an exited pid; the tick already due (not moved
            # later: the rings are unwatched until it) turns the readers back on
            self._set_readers(False)
            return
        self._stepped(False)

    def _stepped(self, tick: bool) -> None:
        """After any step: the heap trim when due, and the next tick. A step drains every
        ring, so a tick is only due ``tick_ms`` after the last step: on a busy machine the
        rings' watermark wakeups drain them and no tick wakes the loop between. Not while
        Python threads are read (``[python] frames``): each round may read a thread the reader
        thread lags on (``PythonFrames.refresh``), so rounds keep the tick's pace there.
        The other rings' wakeups of the same poll are stale (the step drained them too): they
        are skipped until the loop's next pass (``_drained``), not stepped for again, and
        not taken for an exited pid's POLLHUP (which would drop the readers until the tick)."""
        loop = asyncio.get_running_loop()
        if not self._drained:
            self._drained = True
            loop.call_soon(self._undrain)
        now = time.monotonic()
        if self.trimmer.due(now):
            self._answers.expire(now)  # answers past their TTL: their bodies go before the trim
            self.trimmer.maybe(now)
        py = self.profiler.python
        if not tick and py is not None and py.reading:
            return  # the tick keeps its period
        if self._timer is not None:
            self._timer.cancel()
        if not self._stop.is_set():
            self._schedule_tick()

    def _undrain(self) -> None:
        self._drained = False

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
        by_type = self.profiler.pipeline.stats.by_type
        before, samples = by_type.total(), by_type["SAMPLE"]
        self.profiler.step()
        info = self.profiler.last_step  # counts even when no sample objects were built
        dt = time.perf_counter() - t0
        last, self.last_step_mono = self.last_step_mono, time.monotonic()
        after = by_type.total()
        self._pace(after - before - (by_type["SAMPLE"] - samples), info.busy,
                   self.last_step_mono, last)  # fmt: skip
        m = self.m
        m.step_seconds.observe(dt)
        if dt > 0.25:
            log.debug("slow step: %.3f s for %d samples (cold binaries?)", dt, info.samples)
        if info.samples:
            m.sample_seconds.observe(dt / info.samples, info.samples)
        self._observe_stored(info)
        return after != before

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
        """Counts the sampler holds (see open_profiler_for) into the store, before a read;
        while the idle tick is later than ``tick_ms``, the rings drained first if the last
        step is older than that (``_pace``)."""
        tick = self.config.daemon.tick_ms / 1000
        if (self._tick_s > tick and self._ready and not self._stop.is_set()
                and time.monotonic() - self.last_step_mono > tick):
            self._tick()
        self._observe_stored(self.profiler.flush())

    # -- requests

    async def _api_answer(self, req: Request, peer: Peer) -> Answer:
        if self._offloaded(req):
            return await self._api_request_off_loop(req, peer)
        return self._api_request(req, peer)

    async def _metrics_answer(self, req: Request, peer: Peer) -> Answer:
        return self._metrics_request(req, peer)

    def _api_request(self, req: Request, peer: Peer) -> Answer:
        cached = cacheable(req)
        key = (req.target, peer.uid)
        now = time.monotonic()
        if cached and (hit := self._cached_answer(req, key, now)) is not None:
            return hit
        self._flush()
        res = self.api.handle(req, peer)
        if cached:
            self._answers.put(key, res, now)
        full = len(self.streams.clients) >= self.config.api.max_stream_clients
        if isinstance(res, StreamStart) and full:
            return error_response(429, "too many stream clients", TOO_MANY_STREAMS)
        return res

    def _offloaded(self, req: Request) -> bool:
        return cacheable(req) and hasattr(self.profiler.store, "snapshot")

    async def _api_request_off_loop(self, req: Request, peer: Peer) -> Answer:
        """``_api_request`` for a store query: the cache on the loop, the query itself on the
        worker thread against a snapshot (see the module doc); a ``ChunkedResponse`` renders
        its chunks there too, and releases the snapshot when it is closed."""
        key = (req.target, peer.uid)
        if (hit := self._cached_answer(req, key, time.monotonic())) is not None:
            return hit
        if self._query_pool is None:
            self._query_pool = ThreadPoolExecutor(1, thread_name_prefix="unwindd-query")
        pool = self._query_pool
        self._flush()
        snap = self.profiler.store.snapshot()

        def run() -> Answer:
            self._tls.store = snap
            try:
                res = self.api.handle(req, peer)
            except BaseException:
                snap.close()
                raise
            finally:
                self._tls.store = None
            if isinstance(res, ChunkedResponse):
                # its chunks read the snapshot (the handler's): kept open until it is closed
                return replace(res, render_on=pool.submit, release=snap.close)
            snap.close()
            return res

        fut = pool.submit(run)
        try:
            res = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(_close_unwritten)  # its snapshot is released all the same
            raise
        self._answers.put(key, res, time.monotonic())
        return res

    def _cached_answer(self, req: Request, key: tuple[str, int | None],
                       now: float) -> Response | None:  # fmt: skip
        hit = self._answers.get(key, now)
        if hit is not None:
            self.api.requests[req.path] += 1
        return hit

    def _metrics_request(self, req: Request, peer: Peer) -> Response | StreamStart:
        if req.method != "GET":
            return error_response(405, "only GET", headers=ALLOW_GET)
        if req.path not in ("/metrics", "/"):
            return error_response(404, "try /metrics")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self._flush()
        return Response(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)

def setup_logging(level: str) -> None:
    logging.basicConfig(format="unwindd: %(levelname)s: %(message)s", level=level.upper())


def run_daemon(config_path: str | None) -> int:
    """``unwindd run``: load the config, run until SIGTERM. Operator errors -> one line, 2."""
    from ..source.sampling import PerfOpenError

    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        print(f"unwindd: error: {e}", flush=True, file=_stderr())
        return 2
    setup_logging(cfg.daemon.log_level)
    gc.set_threshold(*GC_THRESHOLDS)
    heap.limit_arenas()  # before any thread starts (heap.py)
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


def _close_unwritten(fut: Future[Answer]) -> None:
    """The answer of a query whose connection went while it ran: closed if it holds anything
    (a ``ChunkedResponse``'s snapshot)."""
    if not fut.cancelled() and fut.exception() is None:
        res = fut.result()
        if isinstance(res, ChunkedResponse):
            res.close()


def _stream_pids(p: LiveProfiler) -> int:
    """Pids the stream's per-pid counts hold (pipeline.stats: samples and comms by pid), which
    the daemon drops with each pid the table drops (LiveProfiler.forget_stream_pids)."""
    st = p.pipeline.stats
    return len(st.samples_by_pid.keys() | st.comm_by_pid.keys())


def _runtimes(p: LiveProfiler) -> dict[str, Any]:
    """Samples named by an interpreter's own frames and why others were not ([python] frames;
    ``None`` when off)."""
    py = p.python
    if py is None:
        return {"python": None}
    st = py.stats
    return {"python": {"named": st.named, "failures": dict(st.failures), "reads": st.reads,
                       "syscalls": st.syscalls, "bracketed": st.bracketed,
                       "lateness_ms": dict(st.lateness_ms)}}
