"""The live profiler: perf rings -> the native step (ringstep.py) -> stack store, one round at a
time. The service's event loop and ``unwindd record`` both drive it.

Invariants:
- ``step()`` never blocks: it drains what the rings hold now (one round, see capture.py),
  unwinds it and adds it to the store; its work is bounded by the ring sizes.
- Every record drained is counted (``pipeline.stats``) before anything else happens to it;
  every sample delivered by the orderer is stored exactly once.
- ``close()`` drains and flushes what is left before closing the rings: stopping loses nothing
  that was already recorded (samples held for a rescan included).
- ``start()`` enables the rings before it loads the existing processes from /proc.
- A binary is pinned when its MMAP2 is drained, not when it is delivered (``_pin``).
- The step is ringstep.NativeStep, for every event format a ``PerfSession`` opens; any other
  is refused when the profiler is made. The whole-stream Python step over the same parts
  (tests/support/refstep.py) is the oracle it is tested against.
- Memory under process churn follows the table's cap (``native_max_spaces``); with
  ``forget_stream_pids`` (the daemon's) the stream's per-pid counts go with each pid the table
  drops, as the engine's caches do.
- Inline levels (engine.srclines with a worker, the daemon's): a binary's line/inline table
  is read or compiled in a worker, never on the step; frames named before it arrives have no
  inline levels (counted: ``inline_status``). When tables that frames were named without
  arrive, their binaries' frames and the native context's stacks holding them are retired at
  once (``_inline_arrivals``; frames are by code, ringstep.py), and the engine's name caches
  go: samples from then on get their inline levels, each retired stack named again at its
  next sample, no other stack touched; stacks already stored keep theirs without. No sample
  waits for it.
"""

from __future__ import annotations

from ..binaries.elfcache import ElfCache
from ..binaries.elfentry import ElfEntry
from ..procs.livetable import LiveTable, LiveTableConfig
from ..procs.mapping import PROT_EXEC
from ..procs.procscan import ProcFS
from ..source.capture import StreamPipeline
from ..source.perfcore import PerfSession
from ..source.records import Mmap2, Record
from ..source.sampling import SamplingConfig, Target
from ..store.stackstore import StackStore
from ..unwind.engine import StackEngine
from ..unwind.pyreader import PythonFrames
from ..unwind.stackfmt import UnwoundSample
from .ringstep import NativeStep, StepInfo, supported

# One round's drain: at most this many passes over the rings, of at most this many bytes each
# (capture.drain_round's defaults: the raw record capture drains the same rounds).
_DRAIN_PASSES = 8
_DRAIN_BYTES = 4 << 20
BOOTSTRAP_SLICE = 256  # processes read between two drains of the rings
# The native step's context, and its Python mirror (per-address frame instances and the
# stacks' frame tuples of every process it saw), grow with the spaces it unwound against until
# dropped whole: under process churn this bounds that peak, for naming the active frames again
# at each drop (frames by code: once per binary address, not per process).
_NATIVE_MAX_SPACES = 1024


def native_max_spaces(max_processes: int) -> int:
    """Snapshots the native step's context may hold before it is dropped whole: 2x the
    table's cap (live spaces plus as many dead ones), 64..``_NATIVE_MAX_SPACES``. The native
    step keeps one snapshot (mappings, named frames, stacks) per (pid, generation) it placed a
    sample in, dead pids' too, until its context is dropped whole past ``max_spaces``; tying
    that bound to ``LiveTableConfig.max_processes`` makes a small table cap bound it too,
    where a fixed bound held memory no configured cap accounted for."""
    return max(64, min(_NATIVE_MAX_SPACES, 2 * max_processes))


class LiveProfiler:
    python: PythonFrames | None = None  # the Python frame reader, when on

    def __init__(
        self,
        session: PerfSession,
        engine: StackEngine,
        store: StackStore,
        *,
        live: LiveTable | None = None,
        bootstrap: bool = True,
        flush_interval: float = 0.0,
        python_frames: str = "off",
    ) -> None:
        fmt = session.event_format
        if not supported(fmt):
            # PerfSession always samples TID, TIME and CPU (perfcore.c PC_BASE_SAMPLE_TYPE):
            # only a session made some other way can get here.
            raise ValueError(f"the live step needs TID, TIME and CPU in every SAMPLE: {fmt!r}")
        self._join(session, engine, store, live, bootstrap)
        spaces = native_max_spaces(self.live.config.max_processes)
        # CPython's own frames for interpreter stacks (the daemon's [python] frames,
        # unwind/pyreader.py); off by default: a replayed capture's pids are not live processes,
        # and ``unwindd record`` matches perf script
        if python_frames != "off":
            self.python = PythonFrames(engine.table)
        self.native_step = NativeStep(self.pipeline, engine, store, self._pin, self._unpin,
                                      max_spaces=spaces, flush_interval=flush_interval,
                                      python=self.python, python_mode=python_frames,
                                      code_frames=True)  # fmt: skip
        self.renames = 0  # arrivals of tables that frames were named without
        self.retired = 0  # frames by code named again at once for arrived tables

    def forget_stream_pids(self) -> None:
        """From now on, each pid the table drops (exit grace, cap, reuse) also leaves the
        stream's per-pid counts (``pipeline.stats``: ``samples_by_pid``, ``comm_by_pid``),
        and samples are no longer counted per pid at all (a sample counted after its pid's
        drop would bring the pid back for good). They name the pids of a recording's summary
        (``unwindd record`` keeps them all); a daemon never reads them, and under process
        churn they held an entry for every process that ever ran."""
        self.engine.drop_listeners.append(self._forget_stream_pid)
        self.native_step.count_pid_samples = False

    def _forget_stream_pid(self, pid: int) -> None:
        st = self.pipeline.stats
        st.samples_by_pid.pop(pid, None)
        st.comm_by_pid.pop(pid, None)

    def _join(self, session: PerfSession, engine: StackEngine, store: StackStore,
              live: LiveTable | None, bootstrap: bool) -> None:  # fmt: skip
        """The parts a step works on: the session, its stream pipeline, the engine in live mode
        (on ``live``, else a table over the engine's /proc), the store and the drain pins."""
        self.session = session
        self.engine = engine
        self.store = store
        self.pipeline = StreamPipeline.for_format(session.event_format)
        self.closed = False
        self.bootstrap = bootstrap
        if live is None and engine.live is None:
            live = LiveTable(engine.table, ProcFS(_proc_root(engine)))
        if live is not None:
            engine.attach(live)
        assert engine.live is not None
        self.live: LiveTable = engine.live
        store.attach_labels(self.live.labels)  # each process's cgroup labels (cgroups.py)
        self._pinned: dict[int, tuple[Record, ElfEntry]] = {}  # id(MMAP2) -> (it, its entry)
        self.stats_pinned = 0  # MMAP2 binaries acquired at drain time
        self.last_step = StepInfo()  # what the last step stored (samples, depths, pids)

    @classmethod
    def open(
        cls,
        target: Target,
        config: SamplingConfig | None = None,
        *,
        engine: StackEngine | None = None,
        store: StackStore | None = None,
        live_config: LiveTableConfig | None = None,
        proc_root: str = "/proc",
        bootstrap: bool = True,
        flush_interval: float = 0.0,
        python_frames: str = "off",
    ) -> LiveProfiler:
        session = PerfSession.open(target, config or SamplingConfig())
        try:
            engine = engine or StackEngine.create(proc_root=proc_root)
            live = None
            if engine.live is None:
                live = LiveTable(engine.table, ProcFS(proc_root), live_config)
            return cls(session, engine, store or StackStore(), live=live, bootstrap=bootstrap,
                       flush_interval=flush_interval, python_frames=python_frames)  # fmt: skip
        except BaseException:
            session.close()
            raise

    @property
    def fds(self) -> list[int]:
        return self.session.fds

    def start(self) -> list[UnwoundSample]:
        """Enable sampling, then load the processes that already exist. Returns the samples
        processed while bootstrapping.

        The table is live (livetable.py): the rings are enabled *first*, then every existing
        process is loaded from /proc in slices with a drain between them (so a slow scan of a
        big machine cannot overflow the rings). Enabling first means every change after the
        scan's moment is also in the record stream, which is replayed on top of the scan in
        time order. The kernel's symbols are parsed before the rings are enabled: parsed by
        the first step that names a kernel frame, they would stall the draining of rings that
        have just started to fill."""
        self.engine.symbolizer.kernel(0)
        self.session.enable()
        out: list[UnwoundSample] = []
        if self.bootstrap:
            pids = self.live.procfs.pids()
            cap = self.live.config.bootstrap_max_processes
            if cap is not None:
                pids = pids[:cap]
            for i in range(0, len(pids), BOOTSTRAP_SLICE):
                self.live.bootstrap(pids[i : i + BOOTSTRAP_SLICE])
                self._scanned()
                out += self.step()
        return out

    def _scanned(self) -> None:
        """A bootstrap slice replaced spaces and comms: the step forgets what it held of them."""
        self.native_step.forget_all()

    def step(self) -> list[UnwoundSample]:
        """Drain one round and process it; returns the samples it built (the native step builds
        them only for the store's subscribers, and for samples held for a rescan or deferred;
        ``last_step`` always counts them). Whoever owns the loop decides when to call it (poll
        on ``fds`` plus a timer, so a quiet ring is still drained every tick).

        A step drains one whole round (the round rule needs every ring emptied, capture.py),
        so its work is bounded by the ring sizes, not by a record count: per sample it is a
        little C, and what can take long is per new binary (its CFI compile runs in a worker,
        cfiprefetch.CfiPrefetcher; its symbol table loads on the step that first names one of its
        frames)."""
        if self.engine.srclines is not None and self.engine.srclines.worker is not None:
            self._inline_arrivals()
        out, self.last_step = self.native_step.step(self.session, _DRAIN_PASSES, _DRAIN_BYTES)
        return out

    def _inline_arrivals(self) -> None:
        """Line/inline tables the worker finished: when frames were named without one of them,
        the engine forgets the names it cached (symbol lookups stay) and the native step
        retires those binaries' frames and the stacks holding them, so samples from this step
        on are named with their inline levels. O(jobs held) per step; per arrival one C pass
        over the context's frames and stacks, and the naming again of the retired frames that
        are sampled again."""
        src = self.engine.srclines
        assert src is not None
        missed = src.collect()
        if missed:
            self.names_changed(missed)

    def names_changed(self, uids: set[int]) -> None:
        """The binaries ``uids`` (ELF cache entries) name their code differently from now on:
        names cached of them go (the engine's, symbol lookups kept; the native context's
        frames by code and its stacks holding them, ``NativeStep.retire_code``)."""
        self.renames += 1
        self.engine.forget_stacks()
        self.retired += self.native_step.retire_code(self.engine.table.code_keys_of(uids))

    def inline_status(self) -> dict[str, int] | None:
        """The inline expansion's counts (None when off): tables held, being fetched, asked
        for while fetched (frames named without inline levels), re-namings, frames retired
        (named again at once in new stacks)."""
        src = self.engine.srclines
        if src is None:
            return None
        return {**src.stats, "pending": src.pending, "renames": self.renames,
                "retired": self.retired}  # fmt: skip

    def flush(self) -> StepInfo:
        """Store the native step's counts held since its last flush (its ``flush_interval``):
        call before reading the store. The depths of what it stored."""
        return self.native_step.flush_counts()

    def _pin(self, rec: Record) -> None:
        """Pin the binary of an executable MMAP2 as it is *drained*, not when the orderer
        delivers it (up to a round later): the ELF cache entry, and its open fd, is acquired
        right away through ``/proc/<pid>/root`` or ``map_files`` while the process still
        exists, and released once the record has been applied (``_unpin``: the table then
        holds its own reference). A process that lives briefly in another mount namespace, or
        runs a binary deleted right after exec, is still unwound and symbolized, the CFI
        compiled later from the held fd."""
        if not isinstance(rec, Mmap2) or not rec.prot & PROT_EXEC:
            return
        name = rec.filename
        if not name.startswith("/") or name.startswith("//"):
            return
        cache = self.engine.table.binaries
        if not isinstance(cache, ElfCache):
            return
        entry = cache.acquire(
            rec.pid, name, rec.start, rec.start + rec.length, build_id=rec.build_id,
            maj=rec.maj, min=rec.min, ino=rec.ino, ino_generation=rec.ino_generation,
        )  # fmt: skip
        self._pinned[id(rec)] = (rec, entry)
        self.stats_pinned += 1

    def _unpin(self, recs: list[Record]) -> None:
        if not self._pinned:
            return
        cache = self.engine.table.binaries
        for rec in recs:
            hit = self._pinned.pop(id(rec), None)
            if hit is not None and cache is not None:
                cache.release(hit[1])

    def close(self) -> list[UnwoundSample]:
        """Stop sampling, process everything still in the rings and the orderer, close."""
        if self.closed:
            return []
        self.session.disable()
        out = self._last_round()
        self._unpin([r for r, _ in list(self._pinned.values())])
        if self.python is not None:
            self.python.close()
        self.session.close()
        self.closed = True
        return out

    def _last_round(self) -> list[UnwoundSample]:
        """What ``close`` processes: the rings' last round, everything still queued, deferred
        or held, the CFI worker stopped."""
        out, self.last_step = self.native_step.step(self.session, _DRAIN_PASSES, _DRAIN_BYTES,
                                                    final=True)  # fmt: skip
        held = self.engine.unwind_held(self.live.flush_held())
        if held:
            self.store.add(held)
            self.last_step.samples += len(held)
            self.last_step.depths.update(len(s.frames) for s in held)
        out += held
        if self.engine.cfi_prefetch is not None:
            self.engine.cfi_prefetch.close()
        if self.engine.srclines is not None:
            self.engine.srclines.close()
        return out


def _proc_root(engine: StackEngine) -> str:
    cache = engine.table.binaries
    return cache.proc_root if isinstance(cache, ElfCache) else "/proc"
