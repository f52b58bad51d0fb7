"""Python frames for sampled threads: finds a process's CPython interpreter from its address
space and reads its threads' frame chains (pyframes.py) as ``stackfmt.Frame`` segments.

Timing: perf samples reach the daemon when a round is drained (``[daemon] tick_ms``, 100 ms by
default, later under load), too late to read what the sampled thread ran then. So the chains
are read by a reader thread every ``interval_ms`` for each thread recently sampled inside the
interpreter (``want``), kept with the time of each read (CLOCK_MONOTONIC, perf's sample clock
here), and a sample takes the read nearest its own time, if one is within ``max_skew_ms``
(``nearest``); else it keeps its native frames, counted as ``late``.

Invariants:
- A process's interpreter is found from the process table's view of it: an executable mapping
  of a binary whose name contains ``python`` (the interpreter or libpython) and whose ELF
  symbols (``.dynsym``, else ``.symtab``) define ``_PyRuntime``; runtime address = symbol
  value + the mapping's load bias. The version comes from the process's ``Py_Version``
  (``_Py_DebugOffsets`` decide for 3.13+). Found or not, the answer is kept per (pid, mapping
  generation): a new mapping list looks again, a dropped pid (``forget``) is forgotten.
- ``read`` returns the segments or one reason from ``pyframes.FAILURES``; it never raises on
  anything the target process does.
- Threads: the process table, ``want``, ``nearest``, ``forget`` and the failure counts belong
  to the event loop; the reader thread only walks chains (``Interpreter`` objects ``want``
  handed over) and appends to the per-thread histories, under ``_lock``; walks, its or the
  loop's (``refresh``), take ``_walk_lock``. A read's time is its walk's (taken in C), not
  when the reader thread got the GIL back. A thread not wanted for ``WANT_SECONDS`` is no
  longer read; with no thread wanted and no read kept, the reader thread sleeps until
  ``want`` wakes it (no polling).
- Python frames are ``Frame(ip=0, dso=DSO, sym=qualname, file=co_filename, line=line)``,
  interned (one object per distinct (qualname, file, line)), so a stack's frames hash and
  compare as native ones do.
- Bounds: at most ``max_frames`` interpreter frames per read, ``MAX_WANTED`` threads read per
  interval, ``BATCH_RECORDS`` frame records per native batch (~2.6 MB), ``HISTORY`` reads
  kept per thread; per process the code cache and tid cache of pyframes.Interpreter; at most
  ``MAX_PROCS`` processes and ``MAX_FRAMES_INTERNED`` frames, each cleared whole past its
  bound. Symbol lookups: once per binary (by its cache uid).
  Reader cost per interval: one pass of a native batch walking every wanted thread
  (procs/pywalk.py: no GIL while it walks, about 4 syscalls per thread whatever its depth);
  per batch, O(frames) Python to decode the records (names read once per code object).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from bisect import bisect_left
from collections import Counter, deque

from ..binaries.elf import ElfError, ElfReader
from ..lightdc import dataclass, field
from ..procs.proctable import ProcessTable
from ..procs.pyframes import (
    FAILURES,
    Interpreter,
    ProcessMemory,
    RawFrame,
    ReadFailed,
    find_interpreter,
)
from ..procs.pywalk import Batch, Walker, short_slice
from .stackfmt import Frame

RUNTIME = "python"
DSO = "[python]"  # the dso of every Python frame; the source file is in Frame.file
EVAL_SYMBOL = "_PyEval_EvalFrameDefault"
MAX_PROCS = 1024
MAX_WANTED = 256
HISTORY = 512  # reads kept per thread: 5 s at the default interval, past a slow round
WANT_SECONDS = 2.0
BUDGET = 4  # a reader pass of t seconds is followed by a wait of at least BUDGET * t
PASSES = 50  # passes over the wanted threads per native batch (one GIL round trip), at most
# a newly wanted thread ends a batch older than this (each new batch waits for the GIL once),
# checked at ``want`` and each round; until then the loop's ``refresh`` reads it
CUT_AFTER_NS = 100_000_000
READER_SLICE_NS = 100_000  # the reader thread's scheduler slice (the kernel's least)
BATCH_RECORDS = 1 << 16  # frame records a batch has room for (40 bytes each): fewer passes
REFRESH_BUDGET_NS = 20_000_000  # reads on the event loop per round (``refresh``)
MAX_FRAMES_INTERNED = 1 << 16
LATENESS_BOUNDS_MS = (1, 10, 100, 1000)
LATENESS_LABELS = ("1", "10", "100", "1000", "+Inf")  # ms between a sample and its read
_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym
_WANTED = (b"_PyRuntime", b"Py_Version")
Segments = tuple[tuple[Frame, ...], ...]


@dataclass
class PyStats:
    """Samples whose stack was named by Python frames, and those that kept their native frames
    because the Python ones could not be read, by reason (``FAILURES``)."""

    named: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    reads: int = 0  # frame chains read
    bracketed: int = 0  # samples named by equal reads on both sides, none within the skew
    syscalls: int = 0
    # how long after each sample its frames were read: sample count by upper bound (ms)
    lateness_ms: Counter[str] = field(
        default_factory=lambda: Counter(dict.fromkeys(LATENESS_LABELS, 0)))

    def observe_lateness(self, ns: int) -> None:
        for bound, label in zip(LATENESS_BOUNDS_MS, LATENESS_LABELS, strict=False):
            if ns <= bound * 1_000_000:
                self.lateness_ms[label] += 1
                return
        self.lateness_ms[LATENESS_LABELS[-1]] += 1


def elf_symbols(reader: ElfReader, names: tuple[bytes, ...]) -> dict[bytes, int]:
    """The values of the defined symbols ``names`` in .dynsym, then .symtab (any type: these
    are data objects, which the symbol tables of symbolization drop)."""
    out: dict[bytes, int] = {}
    for sec_type in (11, 2):  # SHT_DYNSYM, SHT_SYMTAB
        secs = reader.sections
        sym = next((s for s in secs if s.type == sec_type), None)
        if sym is None or not 0 < sym.link < len(secs):
            continue
        data, strtab = reader.section_data(sym), reader.section_data(secs[sym.link])
        for st_name, _info, _other, shndx, value, _size in _SYM.iter_unpack(
                data[: len(data) - len(data) % _SYM.size]):  # fmt: skip
            if not shndx or st_name >= len(strtab):
                continue
            for n in names:
                if n not in out and strtab.startswith(n + b"\0", st_name):
                    out[n] = value
        if len(out) == len(names):
            break
    return out


class PythonFrames:
    def __init__(self, table: ProcessTable, max_frames: int = 128, interval_ms: float = 10.0,
                 max_skew_ms: float = 10.0) -> None:  # fmt: skip
        self.table = table
        self.max_frames = max_frames
        self.interval = interval_ms / 1000
        self.max_skew_ns = int(max_skew_ms * 1e6)
        self._lock = threading.Lock()
        self._walk_lock = threading.Lock()
        self._refresh_left = REFRESH_BUDGET_NS
        self._wanted: dict[tuple[int, int], tuple[Interpreter, float]] = {}
        self._history: dict[tuple[int, int], deque[tuple[int, Segments | str]]] = {}
        self._stop = threading.Event()
        # set by ``want`` for a thread not read yet and by ``close``: the reader thread, with
        # nothing to read and no history left to expire, sleeps on it instead of polling
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = PyStats()
        self.stats.failures.update(dict.fromkeys(FAILURES, 0))
        self._procs: dict[int, tuple[int, Interpreter | str]] = {}  # pid -> (generation, it)
        self._syms: dict[int, dict[bytes, int]] = {}  # ElfEntry uid -> its wanted symbols
        self._frames: dict[tuple[str, str, int | None], Frame] = {}
        self._walker: Walker | None = None  # the loop's and ``read``'s
        # the reader thread's batch in flight, and how many of its walks are taken
        # (batch, its keys in order, its start, its keys as a set)
        self._inflight: tuple[Batch, list[tuple[int, int]], int, set[tuple[int, int]]] | None
        self._inflight = None
        self._taken = 0
        self._own_pid = os.getpid()

    @property
    def reading(self) -> bool:
        """Whether any thread is wanted now (read by the reader thread). O(1)."""
        return bool(self._wanted)

    def known(self, pid: int) -> bool:
        """Whether ``pid`` was found to run a readable interpreter (cheap: no lookup)."""
        hit = self._procs.get(pid)
        return hit is not None and isinstance(hit[1], Interpreter)

    def forget(self, pid: int) -> None:
        """``pid`` is gone from the table: no longer read; the reads taken while it ran stay
        (its last samples may still be on their way) until they expire."""
        self._procs.pop(pid, None)
        now = time.monotonic_ns()
        with self._lock:
            for key in [k for k in self._wanted if k[0] == pid]:
                del self._wanted[key]
            for key, h in self._history.items():
                if key[0] == pid:
                    h.append((now, "gone"))  # what a read now would say

    def want(self, pid: int, tid: int) -> str | None:
        """Have the reader thread read ``tid`` of ``pid`` from now on (renewed by each call);
        why not, when its interpreter cannot be read."""
        got = self._interpreter(pid)
        if isinstance(got, str):
            return got
        now = time.monotonic()
        with self._lock:
            new = (pid, tid) not in self._wanted
            if not new or len(self._wanted) < MAX_WANTED:
                self._wanted[(pid, tid)] = (got, now)
        if new:
            self._cut_stale()
            self._wake.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="unwindd-pyframes",
                                            daemon=True)  # fmt: skip
            self._thread.start()
        return None

    def history(self, pid: int, tid: int) -> tuple[list[int], list[Segments | str]]:
        """The reads of ``tid`` kept now: their times (ascending) and results."""
        with self._lock:
            h = self._history.get((pid, tid))
            rows = list(h) if h else []
        return [t for t, _ in rows], [r for _, r in rows]

    def nearest(self, hist: tuple[list[int], list[Segments | str]], t: int
                ) -> Segments | str | None:  # fmt: skip
        """What ``hist`` says thread ran at time ``t``: the nearest read if within
        ``max_skew_ns``; else the nearer of the reads just before and after ``t`` if both show
        the same functions (lines may differ in the innermost one: which is sampled late) —
        the thread was in them on both sides (a reader starved of CPU usually means a starved
        target too); else the reason the read after ``t`` failed, if it did; else None."""
        times, results = hist
        i = bisect_left(times, t)
        best = None
        for j in (i - 1, i):
            if 0 <= j < len(times):
                d = abs(times[j] - t)
                if d <= self.max_skew_ns and (best is None or d < abs(times[best] - t)):
                    best = j
        if best is None:
            if 0 < i < len(times) and _shape(results[i - 1]) == _shape(results[i]):
                self.stats.bracketed += 1
                best = i if times[i] - t < t - times[i - 1] else i - 1
            elif 0 < i < len(times) and isinstance(results[i], str):
                return results[i]  # the next read failed (the process exited, say): why
            else:
                return None
        self.stats.observe_lateness(abs(times[best] - t))
        return results[best]

    def begin_round(self) -> None:
        """A new round: the reads the reader thread's batch has finished so far are taken
        into the histories (``collect``), a batch without a thread wanted since is ended
        (``_cut_stale``), and ``refresh`` may read for ``REFRESH_BUDGET_NS`` again."""
        self.collect()
        self._cut_stale()
        self._refresh_left = REFRESH_BUDGET_NS

    def _cut_stale(self) -> None:
        """End the batch in flight if it is older than ``CUT_AFTER_NS`` and lacks a wanted
        thread: the next batch has it."""
        fl = self._inflight
        if fl is None or time.monotonic_ns() - fl[2] <= CUT_AFTER_NS:
            return
        with self._lock:
            missing = any(k not in fl[3] for k in self._wanted)
        if missing:
            fl[0].stop()

    def collect(self, final: bool = False) -> None:
        """The walks of the batch in flight finished since the last call, decoded and
        appended to their histories (on the loop while the reader thread's native call goes
        on, and by the reader thread when it returns: ``final``)."""
        with self._walk_lock:
            fl = self._inflight
            if fl is None:
                return
            batch, keys, _, _ = fl
            lo, hi = self._taken, batch.ready()
            self._taken = hi
            if final:
                self._inflight = None
            got = self._decode_all(batch.items[lo:hi], batch.results(lo, hi))
        self._append([(keys[i % len(keys)], r) for i, r in zip(range(lo, hi), got, strict=True)])

    def refresh(self, pid: int, tid: int) -> None:
        """Read wanted ``tid`` now, on the calling thread, unless the reader thread did within
        the interval or this round's budget is spent: a starved reader thread leaves the
        samples of a round after its latest read, and a read now can still bracket them
        (``nearest``)."""
        if self._refresh_left <= 0:
            return
        with self._lock:
            w = self._wanted.get((pid, tid))
            h = self._history.get((pid, tid))
            last = h[-1][0] if h else None
        t0 = time.monotonic_ns()
        if w is not None and (last is None or t0 - last > self.interval * 1e9):
            self._read_into(pid, tid, w[0], wait=False)
            self._refresh_left -= time.monotonic_ns() - t0

    def _read_into(self, pid: int, tid: int, it: Interpreter, wait: bool = True) -> None:
        self._read_many([((pid, tid), it)], wait)

    def _read_many(self, todo: list[tuple[tuple[int, int], Interpreter]], wait: bool = True
                   ) -> None:  # fmt: skip
        """Timed reads of ``todo``'s threads, one native batch (pywalk.Walker: no GIL while it
        walks), each appended to its thread's history (kept in time order) with the time its
        walk ran. One batch at a time (the walker's buffers, the interning): the loop does not
        wait for the lock (``wait``), which a descheduled reader thread may hold a while."""
        if not self._walk_lock.acquire(blocking=wait):
            return
        try:
            got = self._walk_many([(it, key[1]) for key, it in todo])
        finally:
            self._walk_lock.release()
        self._append([(key, r) for (key, _), r in zip(todo, got, strict=True)])

    def _append(self, reads: list[tuple[tuple[int, int], tuple[int, Segments | str]]]) -> None:
        """Timed reads into their threads' histories, kept in time order."""
        with self._lock:
            for key, (t, res) in reads:
                h = self._history.get(key)
                if h is None:
                    if key not in self._wanted:
                        continue
                    h = self._history[key] = deque(maxlen=HISTORY)
                if not h or h[-1][0] <= t:
                    h.append((t, res))
                elif t > h[0][0]:  # a batch's read taken after a later one of the loop's
                    if len(h) == h.maxlen:
                        h.popleft()
                    h.insert(bisect_left([r[0] for r in h], t), (t, res))

    def close(self) -> None:
        """Stop the reader thread (its batch is ended: it stops within one walk; a daemon
        thread, so a stuck target cannot hold the exit)."""
        self._stop.set()
        self._wake.set()
        fl = self._inflight
        if fl is not None:
            fl[0].stop()
        if self._thread is not None:
            self._thread.join(1)

    def _run(self) -> None:
        """The reader thread: each wanted thread's chain every ``interval``, in native batches
        of up to ``PASSES`` passes paced by the C side (pywalk.Batch: no GIL from the first
        pass to the last, so a loop holding the GIL delays no read, only its decoding; a
        thread newly wanted ends a batch older than ``CUT_AFTER_NS``, and the next one has
        it). Passes that took long are spaced ``BUDGET`` times the CPU time each used (not
        their wall time, which a loaded machine stretches): the reader stays below about
        1 / (1 + BUDGET) of a core, whatever the number of threads it reads."""
        spacing, next_ns = self.interval, 0
        walker = Walker()
        # a read is only as timely as the reader's wakeups: a short slice puts them first on
        # a busy CPU (EEVDF deadlines), without a larger share of CPU (nice, policy kept)
        short_slice(READER_SLICE_NS)
        while not self._stop.is_set():
            self._wake.clear()  # (a ``want`` from here on is seen below, or wakes the wait)
            now, cpu = time.monotonic(), time.thread_time()
            now_ns = time.monotonic_ns()
            with self._lock:
                for key in [k for k, (_, t) in self._wanted.items() if now - t > WANT_SECONDS]:
                    del self._wanted[key]
                for key in [k for k, h in self._history.items() if k not in self._wanted
                            and (not h or now_ns - h[-1][0] > WANT_SECONDS * 1e9)]:
                    del self._history[key]  # fmt: skip
                todo = [(k, it) for k, (it, _) in self._wanted.items()]
                idle = not todo and not self._history
            if idle:  # an idle machine's daemon: no wakeups until a thread is wanted
                self._wake.wait()
                continue
            if not todo:
                self._stop.wait(self.interval)
                continue
            n = len(todo)
            start, step = max(time.monotonic_ns(), next_ns), int(spacing * 1e9)
            passes = max(1, min(PASSES, BATCH_RECORDS // (n * self.max_frames)))
            with self._walk_lock:
                batch = Batch(walker, [(it, key[1]) for key, it in todo], passes, start, step,
                              self.max_frames)  # fmt: skip
                keys = [key for key, _ in todo]
                self._inflight, self._taken = (batch, keys, start, set(keys)), 0
            batch.run()
            done = batch.ready()
            next_ns = start + -(-done // n) * step  # the next pass's time (a stop ends early)
            self.collect(final=True)
            spacing = max(self.interval, BUDGET * (time.thread_time() - cpu) / max(done / n, 1))

    def read(self, pid: int, tid: int) -> Segments | str:
        """Thread ``tid``'s Python frames as segments (innermost first), or why not (on the
        calling thread: tests and tools; the daemon reads on the reader thread)."""
        got = self._interpreter(pid)
        if isinstance(got, str):
            return got
        with self._walk_lock:
            return self._walk_many([(got, tid)])[0][1]

    def _walk_many(self, items: list[tuple[Interpreter, int]]) -> list[tuple[int, Segments | str]]:
        """Each (interpreter, tid)'s frames, walked in one native call, decoded here: (time of
        its walk, its segments or why not). The caller holds ``_walk_lock``."""
        if self._walker is None:
            self._walker = Walker()
        return self._decode_all(items, self._walker.walk(items, self.max_frames))

    def _decode_all(self, items: list[tuple[Interpreter, int]],
                    walks: list[tuple[int, list[RawFrame] | str, int]]
                    ) -> list[tuple[int, Segments | str]]:  # fmt: skip
        out: list[tuple[int, Segments | str]] = []
        for (it, _), (t, raw, calls) in zip(items, walks, strict=True):
            self.stats.reads += 1
            self.stats.syscalls += calls
            out.append((t, raw if isinstance(raw, str) else self._decode(it, raw)))
        return out

    def _decode(self, it: Interpreter, raw: list[RawFrame]) -> Segments | str:
        """Records as interned ``Frame`` segments (names read once per code object)."""
        mem = it.mem
        assert isinstance(mem, ProcessMemory)
        calls = mem.calls
        try:
            segs = it.decode(raw)
        except ReadFailed as e:
            return e.reason
        finally:
            self.stats.syscalls += mem.calls - calls
        frames = self._frames
        if len(frames) >= MAX_FRAMES_INTERNED:
            frames.clear()
        out = []
        for seg in segs:
            row = []
            for f in seg:
                key = (f.qualname, f.filename, f.line)
                fr = frames.get(key)
                if fr is None:
                    fr = frames[key] = Frame(0, DSO, f.qualname, None, file=f.filename,
                                             line=f.line)  # fmt: skip
                row.append(fr)
            out.append(tuple(row))
        return tuple(out)

    def _interpreter(self, pid: int) -> Interpreter | str:
        if pid == self._own_pid:
            return "self"
        sp = self.table.get(pid)
        if sp is None:
            return "gone"
        gen = sp.generation
        hit = self._procs.get(pid)
        if hit is not None and hit[0] == gen:
            return hit[1]
        got: Interpreter | str = "no_runtime"
        for m in sp.mappings:
            e = m.entry
            if e is None or not e.usable or "python" not in os.path.basename(m.filename):
                continue
            syms = self._syms.get(e.uid)
            if syms is None:
                try:
                    syms = elf_symbols(e.reader(), _WANTED)
                except ElfError:
                    syms = {}
                self._syms[e.uid] = syms
            if b"_PyRuntime" not in syms:
                continue
            mem = ProcessMemory(pid)
            try:
                version = None
                if b"Py_Version" in syms:
                    raw = mem.read(syms[b"Py_Version"] + m.bias, 4)
                    version = int.from_bytes(raw, "little")
                got = find_interpreter(mem, syms[b"_PyRuntime"] + m.bias, version)
            except ReadFailed as e2:
                got = e2.reason
            break
        if len(self._procs) >= MAX_PROCS:
            self._procs.clear()
        if got != "gone":
            self._procs[pid] = (gen, got)
        return got


def _shape(r: Segments | str) -> object:
    """A read without the line of its innermost frame."""
    if isinstance(r, str) or not r or not r[0]:
        return r
    leaf = r[0][0]
    return ((leaf.sym, leaf.file, *r[0][1:]), *r[1:])
