"""What the daemon does once before it is ready, and the operator can get wrong: the query
socket's path and permissions, and the live profiler opened from the config.

Rules:
- An error the operator can fix is a ``StartupError`` whose message names the config key; the
  daemon logs it and exits 2.
- The built-in default socket path falls back to a per-user directory when it cannot be made
  (not root: /run is not writable), and says so; a configured path never falls back.
- A socket file left by a crashed daemon is removed; a live one (something answers on it) is an
  error, so two daemons never share a path.
- ``preflight`` is what start refuses that can be known without starting (an ``[api] group``
  that does not exist, a configured socket directory that cannot be made); the daemon runs it
  before opening anything and ``unwindd check-config`` runs the same function. It reads the
  group database and stats the socket's ancestors; it creates nothing.
- The profiler is the native live step with the store sized from ``[store]``; its counts reach
  the store every ``FLUSH_SECONDS`` and before every read (the daemon flushes first).
- The on-disk CFI and symbol cache is pruned to its bound once, here (O(files in it)); a cache
  dir that cannot be made is logged and the daemon runs without one.
- debuginfod (``[symbols]``, else ``DEBUGINFOD_URLS``): its cache dir becomes one of the ELF
  cache's debug roots and every binary whose symbols load is offered to it, before the
  bootstrap opens any (``attach_debuginfod``); bad URLs are a ``StartupError`` (``preflight``).
"""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING

from ..pipeline.live import LiveProfiler
from .config import (
    CACHE_DIR_FALLBACK,
    DEFAULT_SOCKET,
    ApiSection,
    Config,
    cache_dir,
    fallback_socket,
    parse_listen,
)

if TYPE_CHECKING:
    from ..binaries.debuginfod import Debuginfod, DebuginfodConfig
    from ..unwind.engine import StackEngine

log = logging.getLogger("unwindd")

# The longest the native step holds sample counts before storing them (a read flushes first):
# bounds the engine stats' lag and the C group table (<= one entry per sample held).
FLUSH_SECONDS = 1.0


class StartupError(Exception):
    """The daemon cannot start for a reason the operator can fix (message says which)."""


async def listen_tcp(
    key: str, listen: str,
    client: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> tuple[asyncio.AbstractServer, tuple[str, int]]:
    """A TCP server on ``listen`` (HOST:PORT, the config's ``key``) and the address it got; a
    failure is one ``StartupError`` naming the key, with the errno's text (uvloop's message
    repeats the address)."""
    host, port = parse_listen(listen)
    try:
        srv = await asyncio.start_server(client, host=host, port=port, reuse_address=True)
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        raise StartupError(f"{key}: cannot listen on {listen}: {why}") from None
    name = srv.sockets[0].getsockname()
    return srv, (name[0], name[1])


def preflight(cfg: Config) -> None:
    """Raise the ``StartupError`` start would raise for ``cfg`` where that is known without
    starting: an ``[api] group`` that does not exist; a configured (not the default, which
    falls back) socket directory that cannot be made or written."""
    group_id(cfg.api)
    debuginfod_config(cfg, os.environ)
    if cfg.api.socket != DEFAULT_SOCKET:
        d = os.path.dirname(cfg.api.socket)
        why = socket_dir_problem(d)
        if why is not None:
            raise StartupError(f"[api] socket: cannot create {d}: {why}")


def debuginfod_config(cfg: Config, env: Mapping[str, str]) -> DebuginfodConfig | None:
    """The debuginfod client's settings, or None when no server is set (``[symbols]
    debuginfod_urls``, else ``DEBUGINFOD_URLS``). Its cache: ``[symbols] debuginfod_cache``,
    else ``debuginfod/`` under the daemon's cache dir (the user's when that is off or not
    ours)."""
    from ..binaries.cachefiles import user_cache_dir
    from ..binaries.debuginfod import DEBUGINFOD_SUBDIR, DebuginfodConfig, urls_from

    s = cfg.symbols
    try:
        urls = urls_from(s.debuginfod_urls, env)
    except ValueError as e:
        raise StartupError(f"DEBUGINFOD_URLS: {e}") from None
    if not urls:
        return None
    d = s.debuginfod_cache
    if not d:
        root = cache_dir(cfg.cache, env)
        if root is None or (root == CACHE_DIR_FALLBACK and os.geteuid() != 0):
            root = user_cache_dir(env)
        d = os.path.join(root, DEBUGINFOD_SUBDIR)
    return DebuginfodConfig(urls, d, timeout=s.debuginfod_timeout,
                            max_bytes=s.debuginfod_max_bytes,
                            negative_seconds=s.debuginfod_negative_seconds)  # fmt: skip


def attach_debuginfod(engine: StackEngine, dcfg: DebuginfodConfig, *,
                      sync: bool = False, on_first_fetch: Callable[[], None] | None = None,
                      ) -> Debuginfod:  # fmt: skip
    """A debuginfod client on ``engine``'s ELF cache: its dir searched for debug files, every
    binary whose symbols are loaded from now on (its frames are being named) offered to it."""
    from ..binaries.debuginfod import Debuginfod
    from ..binaries.elfcache import ElfCache
    from ..lightdc import replace

    cache = engine.table.binaries
    assert isinstance(cache, ElfCache)
    if dcfg.cache_dir not in cache.config.debug_roots:
        cache.config = replace(cache.config,
                               debug_roots=(*cache.config.debug_roots, dcfg.cache_dir))
    dbg = Debuginfod(dcfg, sync=sync, on_first_fetch=on_first_fetch)
    cache.on_symbols = dbg.offer
    return dbg


def group_id(api: ApiSection) -> int | None:
    """``[api] group`` as a gid (None: keep the daemon's); a number is taken as is, as
    chown(1) takes it."""
    if not api.group:
        return None
    if api.group.isdigit():
        return int(api.group)
    try:
        return grp.getgrnam(api.group).gr_gid
    except KeyError:
        raise StartupError(f"[api] group: no such group {api.group!r}") from None


def socket_dir_problem(d: str) -> str | None:
    """Why directory ``d`` cannot be made or written by this process, or None. Makes nothing:
    the nearest existing ancestor must be a directory we may write and search (as makedirs
    and bind need)."""
    p = os.path.abspath(d)
    while not os.path.lexists(p):
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        return f"{p} is not a directory"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable"
    return None


def prepare_socket_path(path: str, is_default: bool) -> str:
    """Create the socket's directory. When it is the built-in default and cannot be created
    (not root: /run is not writable), fall back to a per-user directory and say so."""
    d = os.path.dirname(path)
    why = socket_dir_problem(d)
    if why is None:
        try:
            os.makedirs(d, mode=0o755, exist_ok=True)
            return path
        except OSError as e:
            why = str(e.strerror or e)
    if not is_default:
        raise StartupError(f"[api] socket: cannot create {d}: {why}")
    fb = fallback_socket()
    try:
        os.makedirs(os.path.dirname(fb), mode=0o700, exist_ok=True)
    except OSError as e2:
        raise StartupError(f"cannot create {d} ({why}) nor {fb} ({e2.strerror})") from None
    log.warning("cannot create %s (%s); listening on %s instead", d, why, fb)
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


def apply_socket_perms(api: ApiSection, path: str) -> None:
    """``[api] group`` and ``mode`` on the socket file (at start and on every reload)."""
    gid = group_id(api)
    try:
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, api.mode)
    except OSError as e:
        raise StartupError(f"[api] group/mode: cannot apply to {path}: {e}") from None


def describe_target(cfg: Config) -> str:
    s = cfg.sampling
    if s.target == "pids":
        return "pids " + ",".join(map(str, s.pids))
    if s.target == "cgroup":
        return f"cgroup {s.cgroup}"
    return "all CPUs"


def engine_with_disk_cache(cfg: Config) -> StackEngine:
    """The daemon's engine. Compiled CFI and symbol tables persist by build-id under the
    cache dir (``config.cache_dir``): a restart loads them (a read and a check per binary)
    instead of compiling and re-reading symbols. The dir is bounded at start
    (``bound_cache_dir``: ``dir_max_bytes`` over all its stores together, ``CACHE_STORES``,
    the debuginfod downloads among them; least recently used first). Not root and the
    default dir not writable: the user's cache dir; a dir that cannot be made is logged and
    the daemon runs without one. Line/inline tables ([symbols] inline) are read or
    compiled in a worker thread (srclines.SrcLineCache)."""
    from ..binaries.cachefiles import bound_cache_dir, user_cache_dir
    from ..binaries.elfcache import CacheConfig
    from ..unwind.engine import StackEngine

    make = partial(StackEngine.create, cache_config=CacheConfig(max_bytes=cfg.cache.max_bytes),
                   max_depth=cfg.unwind.max_depth, prefetch_cfi=True,
                   inline=cfg.symbols.inline, inline_worker=True, kernel_store=True)  # fmt: skip
    root = cache_dir(cfg.cache, os.environ)
    if root is None:
        return make()
    if root == CACHE_DIR_FALLBACK and os.geteuid() != 0:
        root = user_cache_dir(os.environ)  # not root, not under systemd: /var/cache is not ours
    # one bound over every store: the least recently used file goes first, whichever store
    # holds it (a configured [symbols] debuginfod_cache elsewhere is not the dir's to prune)
    n, freed = bound_cache_dir(root, cfg.cache.dir_max_bytes) or (0, 0)
    if n:
        log.info("cache dir %s: removed %d files (%d bytes) past its bound", root, n, freed)
    try:
        return make(cache_dir=root)
    except OSError as e:  # the directory cannot be made: run without it, and say so
        log.warning("cache dir %s unusable (%s): CFI and symbols are not persisted", root, e)
        return make()


def open_profiler_for(cfg: Config) -> LiveProfiler:
    from ..source.sampling import SamplingConfig, Target
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
    engine = engine_with_disk_cache(cfg)
    st = cfg.store
    store = StackStore(bucket_ns=st.bucket_seconds * 1_000_000_000,
                       max_buckets=max(1, st.retention_seconds // st.bucket_seconds),
                       max_entries=st.max_entries, max_bytes=st.max_bytes)  # fmt: skip
    # Counts reach the store once a second and before every read of it (Daemon._flush), not
    # every drain: a busy stack's group recurs in most drains of a second, and each store
    # update of it is Python work.
    prof = LiveProfiler.open(target, sampling, engine=engine, store=store,
                             flush_interval=FLUSH_SECONDS,
                             python_frames=cfg.python.frames)  # fmt: skip
    prof.forget_stream_pids()  # per-pid stream counts go with the pid (record keeps them)
    if s.spill_max_bytes:
        try:  # (perfcore.PerfSession.start_spill: what a held-up step would have lost, kept)
            prof.session.start_spill(s.spill_max_bytes)
        except OSError as e:
            log.warning("%s: rings are drained by the loop alone", e)
    for note in prof.session.notes:  # the fallbacks taken to open (sampling.fallback)
        log.warning("%s", note)
    return prof
