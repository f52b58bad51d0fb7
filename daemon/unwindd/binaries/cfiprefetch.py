"""Compiling ahead of use, off the event loop: ``KeyedWorker`` (jobs by key in one worker thread)
and, over it, the ELF cache's CFI factory for the daemon (``CfiPrefetcher``), which compiles a
new big binary's table in the worker so that the event loop does not stall on it while the
rings fill. srclines.SrcLineCache compiles line/inline tables in a ``KeyedWorker`` of its own.

Rules:
- A worker runs only pure jobs (``compile(path, debug, build_id)``); the ElfCache and its
  entries are touched only on the owner's thread (elfcache.py's rule).
- A result is used only for the same arguments and the same opened file (dev, inode, size,
  mtime): ``fd_path`` names an fd, and fd numbers are reused.
- Small binaries (``inline_max_bytes``) and tables already stored are left to the loop.

- ``KeyedWorker``: one job per key under way or done and not taken; at most ``max_pending``
  kept (oldest dropped: they only cost a redo); one thread, started by the first job.

Cost: ``ready`` is a dict hit for an entry asked before, else one ``os.stat`` (and a debug-file
lookup); at most ``max_pending`` results and remembered answers are held (oldest dropped: they
only cost a recompile); one worker thread, started on the first compile it is given.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from .elfentry import NOT_LOADED

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

# With prefetch_cfi, binaries up to this size are compiled on the loop all the same: the
# compile is O(file size), and at this size it takes a small part of the ring's headroom
# (source.sampling._HEADROOM_S).
CFI_INLINE_MAX_BYTES = 4 << 20


class KeyedWorker(Generic[K, T]):
    """Jobs run in one worker thread (named ``name``), one per key: ``submit`` starts a job for
    a key none is held for, ``get`` answers the one held, ``pop`` takes it. At most
    ``max_pending`` are held (oldest dropped, still running if they started: a dropped result
    only costs a redo). The thread is started by the first job; ``close`` cancels the jobs not
    started and waits for the running one. Owner's thread only (the futures are the only
    things the worker touches)."""

    def __init__(self, name: str, max_pending: int = 256) -> None:
        self.name = name
        self.max_pending = max_pending
        self.futures: OrderedDict[K, Future[T]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self.started = 0  # jobs submitted

    def get(self, key: K) -> Future[T] | None:
        return self.futures.get(key)

    def pop(self, key: K) -> Future[T] | None:
        return self.futures.pop(key, None)

    def submit(self, key: K, fn: Callable[..., T], *args: Any) -> Future[T]:
        f = self.futures.get(key)
        if f is not None:
            return f
        if self._pool is None:
            # imported here: concurrent.futures (with logging) would add to a replay's
            # start-up, and only the daemon compiles ahead
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.name)
        f = self.futures[key] = self._pool.submit(fn, *args)
        self.started += 1
        while len(self.futures) > self.max_pending:
            self.futures.popitem(last=False)
        return f

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self.futures.clear()


class CfiPrefetcher:
    """The ELF cache's CFI factory, able to compile ahead in one worker thread, so that the
    first sample of a binary nobody has unwound yet does not stall the event loop for the
    compile (a big binary's takes longer than the rings' headroom: they would overflow).

    Rules: the worker runs only the pure ``compile(path, debug, build_id)`` (it reads the file
    and compiles; cffi releases the GIL inside the C compiler); the ElfCache and its entries
    are touched only on the owner's thread, as elfcache.py requires. ``ready(entry)`` (owner)
    starts a compile and says whether the entry's table is loaded or done; the factory call
    that ``ElfEntry.cfi()`` makes then picks the result up. Results are keyed by the arguments
    *and* the opened file's identity (dev, inode, size, mtime): ``fd_path`` names an fd, and an
    fd number is reused once its entry is gone. At most ``max_pending`` results wait (oldest
    dropped: they only cost a recompile).

    A binary of at most ``inline_max_bytes``, or whose table ``cached(build_id)`` says is on
    disk, is not sent to the worker: ``ready`` says yes and the loop compiles or loads it when
    ``cfi()`` asks (a stored table: one read). A sample that waits for the worker is unwound
    later by the engine's Python path, far slower per sample than the native one, so on a
    machine that runs many new small binaries (builds, tests) waiting would cost more than
    the compile it spared the loop.
    """

    def __init__(self, compile: Callable[[str, str | None, bytes | None], object],
                 max_pending: int = 256, inline_max_bytes: int = 0,
                 cached: Callable[[bytes | None], bool] | None = None) -> None:  # fmt: skip
        self._compile = compile
        self.inline_max_bytes = inline_max_bytes
        self._cached = cached
        self._jobs: KeyedWorker[tuple[object, ...], object] = KeyedWorker("unwindd-cfi",
                                                                        max_pending)
        # entry uid -> (its key, its future; None if left to the loop): ready() asked again for
        # an entry still compiling (every sample of a process waiting for its binaries asks for
        # each of them) costs a dict hit, not an os.stat and a debug-file lookup; at most
        # max_pending, oldest dropped
        self._asked: OrderedDict[int, tuple[tuple[object, ...], Future[object] | None]]
        self._asked = OrderedDict()
        self.max_pending = max_pending
        self.inline = 0  # binaries left to the loop: small, or their table stored
        self.used = 0  # of which picked up by the factory

    def __call__(self, path: str, debug: str | None, build_id: bytes | None) -> object:
        key = _file_key(path, debug, build_id)
        f = self._jobs.pop(key) if key is not None else None
        if f is not None:
            self.used += 1
            return f.result()  # done when ready() said so; else waits for the worker
        return self._compile(path, debug, build_id)

    def ready(self, entry: Any) -> bool:
        """True if ``entry``'s CFI is loaded or compiled (or cannot be); else start it."""
        if not entry.usable or _cfi_loaded(entry):
            return True
        asked = self._asked.get(entry.uid)
        if asked is not None:  # uids are never reused
            if asked[1] is None:
                return True  # answered "on the loop" before; cfi() has not been asked yet
            if self._jobs.get(asked[0]) is asked[1]:
                return asked[1].done()  # the key is still the live one
        path, debug, bid = entry.fd_path, entry.debug_path(), entry.store_key
        key = _file_key(path, debug, bid)
        if key is None:
            return True  # cannot stat it: cfi() will fail fast on the loop too
        if cast(int, key[5]) <= self.inline_max_bytes or (
            self._cached is not None and self._cached(bid)
        ):
            # small or stored: compiled or loaded on the loop (see the class doc); remembered,
            # so the next asks (each placement of a process mapping it) cost no stat
            self.inline += 1
            self._remember(entry.uid, key, None)
            return True
        f = self._jobs.submit(key, self._compile, path, debug, bid)
        self._remember(entry.uid, key, f)
        return f.done()

    def _remember(self, uid: int, key: tuple[object, ...], f: Future[object] | None) -> None:
        self._asked[uid] = (key, f)
        while len(self._asked) > self.max_pending:
            self._asked.popitem(last=False)

    @property
    def started(self) -> int:
        """Compiles run in the worker."""
        return self._jobs.started

    def close(self) -> None:
        self._jobs.close()
        self._asked.clear()


def _cfi_loaded(entry: Any) -> bool:
    # A read-only peek at ElfEntry's lazy slot (elfentry.py has no public "loaded?" query):
    # calling cfi() would compile on this thread, which asking is meant to avoid.
    return getattr(entry, "_cfi", NOT_LOADED) is not NOT_LOADED


def _file_key(path: str, debug: str | None, build_id: bytes | None) -> tuple[object, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (path, debug, build_id, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
