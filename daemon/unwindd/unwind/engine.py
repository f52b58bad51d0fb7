"""From time-ordered records to unwound, symbolized samples, a Sample object at a time (batched
into the native unwinder): the Python replay's (``feed``, streamreplay.py), and the native live
step's held and deferred samples (``unwind_held``, ``unwind_as_of``); and what both native
paths take from it: the process table and comms, address-space snapshots and frame names
(``snapshot``, ``frame_at``, ``kernel_frames``).

Invariants:
- Records arrive in time order (ordering.py first); side-band records are applied to the
  process table exactly where they fall between samples, so every sample is unwound against
  the address space its process had when it was taken and named with the comm its thread had
  then, whatever the batch size (``feed``).
- One ``UnwoundSample`` per ``Sample``, in input order (in live mode, samples held for a
  rescan come later, each still exactly once: ``attach``); a failed unwind still gives the
  kernel frames and the leaf, with a status.
- Frames follow perf script's conventions: leaf first, kernel frames first, a caller frame
  named at its return address - 1 (``user_frames``). A sample with nothing to unwind (its
  layout samples no user registers: ``perf record -g`` or no call graph) gets the frames perf
  shows for it (``recorded_frames``): its callchain as recorded (status ``callchain``), else
  its ip alone (``ip_only``); ``frame_sources`` says which a file's events get.
- A JIT frame named from a jitdump is named as of its sample's time (``name_time``,
  ``jit_time``; the native paths: the newest sample of a run part, context.jit_parts), so
  code a JIT replaced at an address is named as the code that ran.
- Cost: one native unwinder call per ``batch_size`` samples; a stack already seen in an
  address-space generation is one dict lookup (``user_frames``).
- Memory: every cache is bounded, and per-process ones are dropped with the pid
  (``_PID_STACKS``).
"""

from __future__ import annotations

import os
import weakref
from bisect import bisect_right
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ..binaries.cachefiles import CACHE_STORES
from ..binaries.cfiprefetch import CFI_INLINE_MAX_BYTES, CfiPrefetcher
from ..binaries.elfcache import CacheConfig, ElfCache
from ..binaries.jitdump import is_jitdump_path
from ..binaries.symbolize import Symbolizer
from ..lightdc import dataclass, field
from ..procs.mapping import PROT_EXEC, Mapping, find_mapping
from ..procs.proctable import ProcessTable
from ..procs.space import SpaceState
from ..source import abi
from ..source.comms import default_comm
from ..source.records import Comm, Fork, Mmap, Mmap2, Record, Sample, frozen_maker
from .jitframes import JitStats
from .stackfmt import STATUS_CALLCHAIN, STATUS_IP_ONLY, Frame, UnwoundSample

if TYPE_CHECKING:
    from ..binaries.srclines import SrcLineCache, SrcLineTable
    from ..procs.livetable import LiveTable

KERNEL_DSO = "[kernel.kallsyms]"
# frame_sources' answers: what the samples of an event are given as frames
SOURCE_STACK = "user stack copies (DWARF unwind)"
SOURCE_CALLCHAIN = "the recorded callchain (frame pointers)"
SOURCE_IP = "the sample ip alone (no call graph recorded)"
# Frame(ip, dso, sym, offset, kernel, inlined, rel, file, line, <hash cache>): every frame of a new
# process is built anew (ASLR), so its constructor is the fast one (records.frozen_maker).
_new_frame = frozen_maker(Frame)
# Memory: every per-process cache (snapshots, stacks, frames) is keyed by pid and dropped with
# the pid when the process table drops it (``on_drop``: exit grace, cap, reuse), so under
# process churn it is bounded by the live pids, not by how many pids ever existed; each pid
# keeps only its newest snapshot, at most _PID_STACKS stacks and _PID_FRAMES frames, and all
# pids together at most ``sym_cache_size`` stacks (cleared whole past it: a cold cache only
# costs re-naming). Frames are at most ``max_depth`` long, so these are byte bounds too.
_PID_STACKS = 4096  # stacks cached per pid (one pid's JIT or deep recursion cannot hog the rest)
_PID_FRAMES = 16384  # named frames cached per pid
_MAX_SNAPS = 4096  # snapshots held outside live mode, where nothing tells us a pid is gone
# ``expand``'s levels kept per (binary, vaddr) (cleared whole past it: a miss reads the chain)
_MAX_LEVELS = 4096
# (table, symbol, offset, per level (sym, offset, inlined, file, line, decl_file, decl_line) or
# None: the frame unexpanded); the table held weakly, so the memo keeps no evicted table alive
_Levels = tuple[
    "weakref.ref[SrcLineTable]", str | None, int | None,
    tuple[tuple[str | None, int | None, bool, str | None, int | None, str | None, int | None],
          ...] | None,
]  # fmt: skip
# Lookups kept of (binary, address) -> symbol, and of kernel callchain -> frames: a miss costs
# one bisect in a mapped symbol table (its names are cached by the table), or one dict hit per
# kernel frame (``_kframes``), so a few thousand recent ones are as good as more. A callchain
# from the native step is kept under its packed bytes, not a tuple of int objects.
_SYMS_MAX = 4096
_KSTACKS_MAX = 4096
# Kernel frames kept by ip: their number grows with a busy machine's uptime (each new kernel
# path brings a few); the callchains' own cache holds the frames of the recent ones whatever
# this drops.
_KFRAMES_MAX = 8192


@dataclass
class EngineStats:
    """The engine's counts: samples by unwind status, frames by kind, unnamed frames."""

    samples: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    frames: int = 0
    user_frames: int = 0
    kernel_frames: int = 0
    unsymbolized: int = 0
    batches: int = 0


def _context_ips(callchain: Iterable[int], context: int, first: bool) -> Iterator[int]:
    """The entries of a raw PERF_SAMPLE_CALLCHAIN in ``context`` (a PERF_CONTEXT_* marker), in
    order: those after its marker up to the next one (and, ``first``, those before any
    marker). perf's add_callchain_ip (tools/perf/util/machine.c) reads them so: a marker sets
    the cpumode the next entries are looked up in, user to begin with."""
    inside = first
    for ip in callchain:
        if ip >= abi.CONTEXT_MAX:
            inside = ip == context
        elif inside:
            yield ip


def inline_frames(f: Frame, levels: tuple[tuple[Any, ...], ...]) -> tuple[Frame, ...]:
    """The frames perf script shows for frame ``f`` whose pc has the ``levels``
    (``SrcLineTable.lookup``: innermost first), as perf 6.1 builds them (tools/perf/util/
    machine.c append_inlines, srcline.c addr2inlines and new_inline_sym): one per level, up to
    the first without a file (addr2line's ``??:0`` ends its list); a level whose demangled
    name is the frame's symbol is the frame itself (with that level's file and line), any
    other is an inlined frame named so (perf prints it ``name (inlined)``, without the dso).
    A level without a DWARF function is named from the symbol table, as addr2line names it.
    Levels of ``SrcLineTable.chain`` (five fields) also give each frame its function's decl
    file and line. No level with a file: ``(f,)``."""
    out = []
    for lv in levels:
        name, file, line = lv[0], lv[1], lv[2]
        if file is None:
            break
        dfile, dline = (lv[3], lv[4] or None) if len(lv) > 3 else (None, None)
        if name is None or name == f.sym:
            out.append(_new_frame(f.ip, f.dso, f.sym, f.offset, False, False, f.rel, file, line,
                                  dfile, dline, None))  # fmt: skip
        else:
            out.append(_new_frame(f.ip, f.dso, name, None, False, True, f.rel, file, line, dfile,
                                  dline, None))  # fmt: skip
    return tuple(out) if out else (f,)


def kernel_ips(callchain: Iterable[int]) -> Iterator[int]:
    """The kernel entries of a raw callchain (user entries are skipped: we unwind the user
    stack ourselves). ``kernel_frames`` makes one frame of each, named or not."""
    return _context_ips(callchain, abi.CONTEXT_KERNEL, False)


def user_ips(callchain: Iterable[int]) -> Iterator[int]:
    """The user entries of a raw callchain, leaf first, for a sample without a stack copy."""
    return _context_ips(callchain, abi.CONTEXT_USER, True)


def frame_sources(formats: Iterable[tuple[int, int]]) -> tuple[str, ...]:
    """``frame_source`` of each (sample_type, sample_regs_user), distinct, in order."""
    return tuple(dict.fromkeys(frame_source(st, ru) for st, ru in formats))


def frames_note(sources: tuple[str, ...], name: str) -> str | None:
    """The one line ``unwindd replay`` says on stderr when samples of ``name`` are not
    unwound from stack copies (``sources``: ``frame_sources`` of its events), else None."""
    if not sources or sources == (SOURCE_STACK,):
        return None
    lead = "some events have" if SOURCE_STACK in sources else "no"
    return f"unwindd: {name}: {lead} user stack copies; frames from {', '.join(sources)}"


def frame_source(sample_type: int, sample_regs_user: int) -> str:
    """What the samples of an event with this ``sample_type`` and ``sample_regs_user`` get as
    frames (``StackEngine._unwind``'s rule, and stacks.c unwind_sample's): user registers
    sampled, a DWARF unwind of the stack copy; else the recorded callchain if sampled; else the
    sample ip."""
    if sample_regs_user:
        return SOURCE_STACK
    if sample_type & abi.SampleType.CALLCHAIN:
        return SOURCE_CALLCHAIN
    return SOURCE_IP


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One generation of one address space: what a sample is unwound and symbolized against."""

    key: tuple[int, int]  # (pid, generation)
    native: Any
    mappings: tuple[Mapping, ...]
    starts: tuple[int, ...]

    def find(self, addr: int) -> Mapping | None:
        return find_mapping(self.starts, self.mappings, addr)


# StackEngine.create(cache_dir=): where in it the CFI and the symbol tables are kept
CACHE_SUBDIRS = CACHE_STORES[:2]
SRCLINE_SUBDIR = CACHE_STORES[2]  # ... and the compiled line/inline tables (srclines.py)
KERNEL_SUBDIR = CACHE_STORES[4]  # ... and the kernel image's symbols (kallsymstore.py)
# Whether engines made by ``create`` expand inlined frames: the CLI's ``replay`` and ``record``
# set it (on, perf script's default, unless ``--no-inline``) for every engine their command
# makes; engines made otherwise (the daemon's) do not expand.
DEFAULT_INLINE = [False]


class StackEngine:
    def __init__(
        self,
        table: ProcessTable,
        unwinder: Any,
        symbolizer: Symbolizer,
        *,
        batch_size: int = 512,
        sym_cache_size: int = 1 << 16,
    ) -> None:
        self.table = table
        self.unwinder = unwinder
        self.symbolizer = symbolizer
        self.batch_size = batch_size
        self.stats = EngineStats()
        self._comms: dict[int, str] = {}  # tid -> comm
        self._snaps: dict[int, Snapshot] = {}  # pid -> its newest snapshot (insertion = age)
        self._syms: OrderedDict[tuple[int, int], tuple[str, int] | None] = OrderedDict()
        self._sym_cache_size = sym_cache_size
        self._syms_max = min(sym_cache_size, _SYMS_MAX)
        self._kstacks_max = min(sym_cache_size, _KSTACKS_MAX)
        # pid -> {(generation, pcs): frames}; pid -> {(generation, named ip): frame}
        self._stacks: dict[int, dict[tuple[int, tuple[int, ...]], tuple[Frame, ...]]] = {}
        self._nstacks = 0
        # pid -> {(2 * generation + exact, named ip): its frames (one, or one per inline level)}
        self._frames: dict[int, dict[tuple[int, int], tuple[Frame, ...]]] = {}
        self._joined: dict[tuple[int, int], tuple[tuple[Frame, ...], ...]] = {}
        self._kstacks: dict[tuple[int, ...] | bytes, tuple[Frame, ...]] = {}
        self._kframes: dict[int, Frame] = {}  # kernel ip -> its frame (kernel_frame)
        self.live: LiveTable | None = None
        self._tids: dict[int, set[int]] = {}  # pid -> threads with their own comm (live mode)
        # called with each pid the table drops, after the engine forgot it (ringstep's C table)
        self.drop_listeners: list[Callable[[int], None]] = []
        self.cfi_prefetch: CfiPrefetcher | None = None  # set by create(prefetch_cfi=True)
        # the on-disk stores' counters by store ("cfi", "sym"; set by create with a cache dir)
        self.disk_stats: dict[str, dict[str, int]] = {}
        # JIT frames and the samples through them (jitframes.py), counted by the live paths
        self.jit = JitStats(self.runtime_of)
        self._runtimes: dict[int, tuple[int, str | None]] = {}  # pid -> (generation, runtime)
        # The time JIT frames are named as of (a jitdump's code loads up to it: jitdump.py):
        # the sample's own in ``_unwind``, the newest of a run's in the native paths.
        self.name_time: int | None = None
        self._dumps: dict[tuple[int, int], str | None] = {}  # snapshot key -> jitdump path
        self._name_epochs: dict[int, int] = {}  # pid -> times its frames were renamed
        self._jit_at: dict[int, int] = {}  # pid -> its jitdump boundaries crossed (jit_time)
        # line/inline tables by binary (create(inline=True)); None: frames are not expanded
        self.srclines: SrcLineCache | None = None
        # (dso, rel) -> (symbol, offset) of expanded frames whose chain has no level named as
        # the symbol (plain_symbol)
        self._plain: dict[tuple[str | None, int | None], tuple[str, int | None]] = {}
        # (binary uid, vaddr) -> (its table, symbol, offset, levels) of ``expand``: a new
        # process of a known binary expands each frame from it, not from the table's chain
        self._levels: dict[tuple[int, int], _Levels] = {}

    @classmethod
    def create(
        cls,
        *,
        proc_root: str = "/proc",
        cache_config: CacheConfig | None = None,
        max_depth: int = 128,
        batch_size: int = 512,
        cfi_cache_dir: str | None = None,
        sym_cache_dir: str | None = None,
        prefetch_cfi: bool = False,
        cfi_inline_max_bytes: int = CFI_INLINE_MAX_BYTES,
        cache_dir: str | None = None,
        inline: bool | None = None,
        inline_worker: bool = False,
        kernel_store: bool = False,
    ) -> StackEngine:
        """The engine with the real ELF cache, CFI compiler and native unwinder. ``cache_dir``
        (the CLI's and the daemon's): both stores in its ``CACHE_SUBDIRS``; with
        ``kernel_store`` (a replay's and the daemon's), the kernel image's symbols of this
        boot in its ``KERNEL_SUBDIR`` (kallsymstore.py), and of /proc/kallsyms only what lies
        outside the image (symbolize.py). With
        ``cfi_cache_dir``, compiled CFI tables persist there by build-id (``CfiStore``); with
        ``sym_cache_dir``, symbol tables do (``SymbolStore``, the ELF cache's
        ``symbol_factory``: counts in its ``stats``). With ``prefetch_cfi``, binaries larger
        than ``cfi_inline_max_bytes`` whose table is not stored compile in a worker
        (``CfiPrefetcher``). With ``inline`` (default ``DEFAULT_INLINE``), a frame whose pc
        DWARF places in inlined code becomes one frame per inline level (``frames_at``), from
        tables kept in ``cache_dir``'s ``SRCLINE_SUBDIR``; with ``inline_worker`` (the daemon's)
        they are read or compiled in a worker thread (``SrcLineCache``: frames named before
        their binary's table is there have no inline levels). OSError if a directory cannot be
        made."""
        from ..binaries.cfi import CfiStore, CfiTable
        from ..binaries.symstore import SymbolStore
        from . import unwinder as unw

        if cache_dir is not None:
            cfi_cache_dir, sym_cache_dir = (os.path.join(cache_dir, d) for d in CACHE_SUBDIRS)

        store = CfiStore(cfi_cache_dir) if cfi_cache_dir is not None else None
        symbols = SymbolStore(sym_cache_dir) if sym_cache_dir is not None else None

        def factory(path: str, debug: str | None, build_id: bytes | None) -> object:
            if store is not None:
                return store.get_or_compile(build_id, path, debug)
            return CfiTable.from_elf(path, debug)

        pre = None
        if prefetch_cfi:
            pre = CfiPrefetcher(factory, inline_max_bytes=cfi_inline_max_bytes,
                                cached=store.has if store is not None else None)  # fmt: skip
        # a stored table by build-id before the debug file is looked for (not with the
        # daemon's prefetcher, whose compiles are keyed by the debug file too)
        lookup = store.lookup if store is not None and pre is None else None
        cache = ElfCache(cache_config, proc_root=proc_root, cfi_factory=pre or factory,
                         symbol_factory=symbols, cfi_lookup=lookup)  # fmt: skip
        table = ProcessTable(cache, unwinder=unw)
        kstore = None
        if cache_dir is not None and kernel_store:
            from ..binaries.kallsymstore import KernelImageStore

            kstore = KernelImageStore(os.path.join(cache_dir, KERNEL_SUBDIR), proc_root)
        engine = cls(table, unw.Unwinder(max_depth),
                     Symbolizer(proc_root=proc_root, kernel_store=kstore),
                     batch_size=batch_size)  # fmt: skip
        engine.cfi_prefetch = pre
        if DEFAULT_INLINE[0] if inline is None else inline:
            from ..binaries.cfiprefetch import KeyedWorker
            from ..binaries.srclines import SrcLineCache, SrcLineStore

            src = SrcLineStore(os.path.join(cache_dir, SRCLINE_SUBDIR)
                               if cache_dir is not None else None)  # fmt: skip
            worker: KeyedWorker[int, SrcLineTable | None] | None = None
            if inline_worker:
                worker = KeyedWorker("unwindd-srcline")
            engine.srclines = SrcLineCache(src, worker=worker)
            engine.disk_stats["srcline"] = src.stats
        if store is not None:
            engine.disk_stats["cfi"] = store.stats
        if symbols is not None:
            engine.disk_stats["sym"] = symbols.stats
        return engine

    # -- records in, samples out

    def feed(self, recs: Iterable[Record]) -> list[UnwoundSample]:
        """Unwind the samples of ``recs`` (time-ordered), applying the side-band records
        between them. Samples are batched for the native unwinder (one cffi call per
        ``batch_size`` samples) without changing what they are unwound against: each queued
        sample holds the immutable native address space and mapping list of its own moment
        (``proctable`` replaces, never mutates, a space's state), so a later MMAP2 cannot leak
        into an earlier sample. A COMM flushes the queue first, so each sample is named with
        the comm its thread had when it was taken (as perf does)."""
        out: list[UnwoundSample] = []
        pending: list[tuple[Snapshot, Sample]] = []
        live = self.live
        if live is not None:
            self.refresh_jit_names()
            pending = [(self.snapshot(s.pid), s) for s in live.due()]
        for rec in recs:
            if isinstance(rec, Sample):
                if live is not None and not live.place(rec):
                    continue  # held for a rescan: comes back from live.due()
                pending.append((self.snapshot(rec.pid), rec))
                if len(pending) >= self.batch_size:
                    out += self._unwind(pending)
                    pending = []
            else:
                if isinstance(rec, Comm) and pending:
                    # queued samples keep the comm they were taken under
                    out += self._unwind(pending)
                    pending = []
                self.apply_side_band(rec)
        if pending:
            out += self._unwind(pending)
        if live is not None:
            live.end_batch()
        return out

    def apply_side_band(self, rec: Record) -> None:
        """A non-SAMPLE record, in time order (``feed``; the native live step calls it
        between its runs of samples)."""
        t = type(rec)  # record types are final classes: identity tests
        if t is Mmap2:  # most side-band records under churn: note_jitdump, the table's
            # apply and the live table's observe of a MMAP2, without their type dispatch
            m: Mmap2 = rec  # type: ignore[assignment]  # (narrowed by the identity test)
            if m.prot & PROT_EXEC and is_jitdump_path(m.filename):
                self.symbolizer.open_jitdump(m.pid, m.filename)
            self.table.apply_mmap2(m)
            live = self.live
            if live is not None:
                rtime = m.sample_id.time
                if rtime is not None and rtime > live.record_time:
                    live.record_time = rtime
            return
        if t is Mmap:  # (the only other record note_jitdump looks at)
            self.note_jitdump(rec)
        elif t is Comm:  # (with FORK below, the only records note_comm looks at)
            self.note_comm(rec)
        self.table.apply(rec)
        if t is Fork:  # named once the table dropped a reused pid's old process and its
            # names, as perf's machine__process_fork_event removes the old thread before
            # thread__fork copies the parent's comm (tools/perf/util/machine.c)
            self.note_comm(rec)
        if self.live is not None:
            self.live.observe(rec)

    def note_comm(self, rec: Record) -> bool:
        """Track task names: a COMM names its tid; a FORK's new task starts with its parent's
        name until its own COMM (exec or prctl), as perf's thread__fork copies the parent's
        comm (tools/perf/util/thread.c), so a child sampled before it execs has its parent's
        name. True when a name changed (callers caching (pid, tid) -> comm must forget)."""
        if isinstance(rec, Comm):
            comm: str | None = rec.comm
        elif isinstance(rec, Fork):
            comm = self._comms.get(rec.ptid) or self._comms.get(rec.ppid)
        else:
            return False
        if comm is None:
            return self._comms.pop(rec.tid, None) is not None  # a reused tid's old name
        self._comms[rec.tid] = comm
        if self.live is not None and rec.tid != rec.pid:
            self._tids.setdefault(rec.pid, set()).add(rec.tid)
        return True

    def unwind_held(self, samples: list[Sample]) -> list[UnwoundSample]:
        """Samples back from ``live.due()``, unwound now as ``feed`` does."""
        return self._unwind([(self.snapshot(s.pid), s) for s in samples])

    def unwind_as_of(self, held: list[tuple[Sample, object, str]]) -> list[UnwoundSample]:
        """Samples unwound later than they were placed, each against its space and named with
        its comm as they were then: (sample, ``AddressSpace.state`` then, comm then). What
        ``feed`` would have given at the sample's place in the stream, whatever records were
        applied since (an exec, a dlopen)."""
        pending = []
        for s, state, _ in held:
            sp = self.table.space_for(s.pid if s.pid is not None else -1)
            if state is sp.state:
                snap = self.snapshot(s.pid)
            else:
                assert isinstance(state, SpaceState)
                mappings = state.mappings
                snap = Snapshot((sp.pid, state.generation), sp.native_space(state), mappings,
                                tuple(state.starts))  # fmt: skip
            pending.append((snap, s))
        return self._unwind(pending, [comm for _, _, comm in held])

    # -- live mode

    def attach(self, live: LiveTable) -> None:
        """Run in live mode; ``live.table`` must be ``self.table``. Every sample is first
        offered to ``live.place``, which may rescan /proc for its pid or *hold* it for a
        rate-limited rescan; held samples come back from ``live.due()`` at the start of a later
        ``feed`` (the native live step takes them itself) and are unwound then (so in live mode
        output order is input order except for those, each still exactly once);
        ``unwind_held(live.flush_held())`` unwinds the rest at the end. After each batch is
        unwound ``live.end_batch()`` drops retired/over-cap pids, and a dropped pid's comms are
        forgotten here, as is a thread's once its EXIT is past the grace."""
        if live.table is not self.table:
            raise ValueError("the LiveTable must wrap this engine's process table")
        self.live = live
        live.on_comm = self.set_comm
        live.on_thread_gone = self._thread_gone
        self.table.on_drop = self._dropped

    def set_comm(self, tid: int, comm: str) -> None:
        self._comms[tid] = comm

    def _thread_gone(self, pid: int, tid: int) -> None:
        """A thread exited past the grace (``LiveTable.on_thread_gone``): its name goes."""
        tids = self._tids.get(pid)
        if tids is not None:
            tids.discard(tid)
        self._comms.pop(tid, None)

    def _dropped(self, pid: int) -> None:
        self.forget_pid(pid)
        self._comms.pop(pid, None)
        for tid in self._tids.pop(pid, ()):
            self._comms.pop(tid, None)
        self.symbolizer.forget_pid(pid)
        self._name_epochs.pop(pid, None)
        self._jit_at.pop(pid, None)
        if self.live is not None:
            self.live.forget(pid)
        for cb in self.drop_listeners:
            cb(pid)

    def forget_pid(self, pid: int) -> None:
        """Drop ``pid``'s snapshot, stacks and frames (the table dropped its space)."""
        self._snaps.pop(pid, None)
        self._forget_frames(pid)

    def _forget_frames(self, pid: int) -> None:
        self._nstacks -= len(self._stacks.pop(pid, ()))
        self._frames.pop(pid, None)

    def refresh_jit_names(self) -> list[int]:
        """Live: read on the jitdumps of the processes seen so far; a pid whose dump gained
        code (a JIT writes it through a buffer, so a load can land after the code first ran)
        has its cached frames dropped and its ``name_epoch`` bumped, so its frames, unnamed
        ones too, are named again from then on (the native contexts key their spaces by the
        epoch). Cost: an open and fstat per dump, and reading what it gained."""
        pids = self.symbolizer.refresh_jitdumps()
        for pid in pids:
            self._rename(pid)
        return pids

    def name_epoch(self, pid: int) -> int:
        """How many times ``refresh_jit_names`` or ``jit_time`` renamed ``pid``'s frames."""
        return self._name_epochs.get(pid, 0)

    def _rename(self, pid: int) -> None:
        self._name_epochs[pid] = self._name_epochs.get(pid, 0) + 1
        self._forget_frames(pid)

    def jit_time(self, pid: int, t: int) -> bool:
        """Samples of ``pid`` are named at time ``t`` from now on (time order): if its jitdump
        replaced code since the last call (``JitCodeTable.boundaries``: a boundary crossed),
        its cached frames go and its ``name_epoch`` is bumped (True), so a pc is named again
        as the code there was then. Cost: one bisect."""
        i = bisect_right(self.symbolizer.jit_boundaries(pid), t)
        if i == self._jit_at.get(pid, 0):
            return False
        self._jit_at[pid] = i
        self._rename(pid)
        return True

    def note_jitdump(self, rec: Record) -> None:
        """A side-band record: an executable mapping of a jitdump (what a JIT maps so that perf
        records it, perf's jit_detect) is opened and read now, so its replacement times are
        known before its frames are named (the native file replay splits runs at them)."""
        if isinstance(rec, Mmap2):
            exe = bool(rec.prot & PROT_EXEC)
        elif isinstance(rec, Mmap):  # no prot: an executable mapping unless flagged as data
            exe = not rec.misc & abi.MISC_MMAP_DATA
        else:
            return
        if exe and is_jitdump_path(rec.filename):
            self.symbolizer.open_jitdump(rec.pid, rec.filename)

    def forget_names(self) -> None:
        """Drop every cached name (frames, stacks, symbol lookups): a binary's symbols changed
        (a debug file arrived, debuginfod.py), so frames are named again from now on."""
        self._syms.clear()
        self.forget_stacks()

    def forget_stacks(self) -> None:
        """Drop the named frames and stacks, keeping symbol lookups: a binary's line/inline
        table arrived (``SrcLineCache.collect``), so frames are expanded again from now on."""
        self._stacks.clear()
        self._nstacks = 0
        self._frames.clear()
        self._joined.clear()
        self._levels.clear()

    def cache_sizes(self) -> dict[str, int]:
        """Entries per cache, for metrics and the churn benchmark."""
        return {"snapshots": len(self._snaps), "stacks": self._nstacks,
                "frames": sum(len(f) for f in self._frames.values()), "syms": len(self._syms),
                "kstacks": len(self._kstacks), "comms": len(self._comms)}  # fmt: skip

    def comm_of(self, pid: int | None, tid: int | None) -> str:
        """The task's name now: its COMM (or /proc's, or its parent's at FORK), else its
        process's, else the name perf gives a task nothing named (comms.default_comm)."""
        if tid is not None and tid in self._comms:
            return self._comms[tid]
        if pid is not None and pid in self._comms:
            return self._comms[pid]
        return default_comm(pid, tid)

    def runtime_of(self, pid: int | None) -> str | None:
        """The base name of ``pid``'s executable (the lowest mapping of a file: where the
        kernel's ELF loader puts it), for counts by runtime; None if the table has no such
        mapping for it. Cached per address-space generation."""
        sp = self.table.get(pid) if pid is not None else None  # (builds deferred mappings)
        if sp is None:
            return None
        hit = self._runtimes.get(sp.pid)
        if hit is not None and hit[0] == sp.generation:
            return hit[1]
        exe = next((m.filename for m in sp.mappings if m.entry is not None
                    and m.filename.startswith("/")), None)  # fmt: skip
        name = os.path.basename(exe) if exe else None
        if len(self._runtimes) >= _MAX_SNAPS:
            self._runtimes.clear()
        self._runtimes[sp.pid] = (sp.generation, name)
        return name

    # -- internals

    def snapshot(self, pid: int | None) -> Snapshot:
        """The process's address space as it is now (immutable: later records do not change
        it); its ``native`` form is what the unwinder takes."""
        sp = self.table.space_for(pid if pid is not None else -1)
        key = (sp.pid, sp.generation)
        snap = self._snaps.get(sp.pid)
        if snap is None or snap.key != key:
            # Generations only grow (proctable: one global counter), so an older snapshot of
            # this pid is never wanted again; samples queued against it hold their own.
            state = sp.state
            assert isinstance(state, SpaceState)
            snap = Snapshot(key, sp.native_space(state), state.mappings, tuple(state.starts))
            self._snaps.pop(sp.pid, None)
            self._snaps[sp.pid] = snap
            if len(self._snaps) > _MAX_SNAPS and self.live is None:
                del self._snaps[next(iter(self._snaps))]
        return snap

    def _unwind(self, pending: list[tuple[Snapshot, Sample]], comms: list[str] | None = None
                ) -> list[UnwoundSample]:  # fmt: skip
        """``comms``: each sample's comm (default: its thread's comm now)."""
        self.stats.batches += 1
        results = self.unwinder.unwind_batch([(snap.native, s) for snap, s in pending])
        out = []
        stats = self.stats
        has_dump = self.symbolizer.has_jitdump
        for i, ((snap, s), res) in enumerate(zip(pending, results, strict=True)):
            self.name_time = s.time
            if s.time is not None and has_dump(s.pid):
                self.jit_time(s.pid, s.time)  # type: ignore[arg-type]
            if not s.regs_mask:  # nothing to unwind (the unwinder said no_regs)
                status, kframes, uframes = self.recorded_frames(snap, s)
                frames = self._join(kframes, uframes) if kframes else uframes
            else:
                kframes = self.kernel_frames(s.callchain) if s.callchain else ()
                if s.regs_abi == abi.REGS_ABI_NONE and kframes:
                    status = "kernel_only"
                    frames = kframes
                else:
                    status = res.status.name.lower()
                    uframes = self.user_frames(s.pid, snap, res.pcs, res.signal_frames)
                    frames = self._join(kframes, uframes) if kframes else uframes
            self.jit.count(s.pid, frames)
            stats.samples += 1
            stats.by_status[status] += 1
            stats.kernel_frames += len(kframes)
            stats.user_frames += len(frames) - len(kframes)
            comm = self.comm_of(s.pid, s.tid) if comms is None else comms[i]
            out.append(UnwoundSample(s.time, s.pid, s.tid, s.cpu, comm, s.period, status, frames))
        stats.frames = stats.kernel_frames + stats.user_frames
        return out

    def recorded_frames(self, snap: Snapshot, s: Sample
                        ) -> tuple[str, tuple[Frame, ...], tuple[Frame, ...]]:  # fmt: skip
        """(status, kernel frames, user frames) of a sample whose layout samples no user
        registers, as perf script resolves it (tools/perf/util/machine.c
        thread__resolve_callchain_sample): with callchain entries, its kernel entries and its
        user entries (``user_ips``, at most ``max_depth``) as recorded, each named at the
        address itself (add_callchain_ip: no return address - 1); without, its ip alone, a
        kernel frame if taken in kernel mode (header.misc's cpumode, as perf picks the map).
        stacks.c unwind_sample / intern_sample are this rule in C."""
        cc = s.callchain
        if cc:
            pcs = tuple(user_ips(cc))[: self.unwinder.max_depth]
            return (STATUS_CALLCHAIN, self.kernel_frames(cc),
                    self.user_frames(s.pid, snap, pcs, exact=True))  # fmt: skip
        if s.ip is None:
            return "no_regs", (), ()
        if s.cpumode == abi.MISC_KERNEL:
            return STATUS_IP_ONLY, self.kernel_frames((abi.CONTEXT_KERNEL, s.ip)), ()
        # its symbol alone, as perf prints it (builtin-script.c sample__fprintf_sym: no inline)
        return STATUS_IP_ONLY, (), self.user_frames(s.pid, snap, (s.ip,), exact=True)

    def _join(self, kframes: tuple[Frame, ...], uframes: tuple[Frame, ...]) -> tuple[Frame, ...]:
        """``kframes + uframes``, the same tuple object each time for the same two cached
        tuples: the store interns stacks by identity first (no per-frame hashing)."""
        key = (id(kframes), id(uframes))
        hit = self._joined.get(key)
        if hit is not None and hit[0] is kframes and hit[1] is uframes:
            return hit[2]
        out = kframes + uframes
        if len(self._joined) >= self._sym_cache_size:
            self._joined.clear()
        self._joined[key] = (kframes, uframes, out)  # holds both: their ids stay theirs
        return out

    def user_frames(
        self, pid: int | None, snap: Snapshot, pcs: tuple[int, ...], signal_frames: int = 0,
        exact: bool = False,
    ) -> tuple[Frame, ...]:  # fmt: skip
        """Symbolized user frames for unwound ``pcs`` (leaf first, return addresses as the
        unwinder found them; ``signal_frames``: the unwinder's mask of signal-trampoline
        frames, ``UnwindResult.signal_frames``; ``exact``: every pc is named as it is, a
        recorded callchain's). Profiles repeat the same stacks: each (address space, stack)
        is symbolized once (the mask is a function of both; ``exact`` is part of the key).

        Frames follow perf script's conventions so the two can be compared: a caller frame's
        ``ip`` is its return address minus 1 (perf's unwinders report ``pc - 1`` for
        non-activation frames: unwind-libunwind-local.c, "Decrement the IP for any
        non-activation frames"), and the symbol is looked up there, so a call that ends a
        function is attributed to the caller, not to the next function.

        Cost: a stack already seen in the same address-space generation costs one dict
        lookup; a new one costs one dict hit per frame already named in that generation
        (profiles repeat callers: only leaves vary), else one bisect for the mapping and one
        dict hit per (binary, address) already symbolized, else one bisect in the binary's
        symbol table."""
        spid, gen = snap.key
        per = self._stacks.get(spid)
        if per is None:
            per = self._stacks[spid] = {}
        key = (2 * gen + exact, pcs)  # (generation, exact) in one int
        hit = per.get(key)
        if hit is not None:
            return hit
        fcache = self._frames.get(spid)
        if fcache is None:
            fcache = self._frames[spid] = {}
        frames = []
        # The leaf's pc is exact; so is the pc of a frame right after a signal trampoline (it
        # was interrupted, not called); every other pc is a return address, reported - 1.
        exact_bits = -1 if exact else signal_frames << 1 | 1
        unsym = 0
        for i, pc in enumerate(pcs):
            ip = pc if exact_bits >> i & 1 else pc - 1
            fkey = (key[0], ip)  # a recorded callchain's frames are not expanded (expand)
            fs = fcache.get(fkey)
            if fs is None:
                f = self._user_frame(pid, snap, ip)
                fs = (f,) if exact else self.expand(snap, ip, f)
                self.stats.unsymbolized -= f.sym is None  # counted below, once per stack
                if len(fcache) >= _PID_FRAMES:
                    fcache.clear()
                fcache[fkey] = fs
            unsym += fs[-1].sym is None
            if len(fs) == 1:
                frames.append(fs[0])
            else:
                frames += fs
        self.stats.unsymbolized += unsym
        out = tuple(frames)
        if len(per) >= _PID_STACKS:
            self._nstacks -= len(per)
            per.clear()
        per[key] = out
        self._nstacks += 1
        if self._nstacks > self._sym_cache_size or len(self._frames) > _MAX_SNAPS:
            # Outside live mode nothing drops pids: this bounds the pid count too.
            self._stacks.clear()
            self._frames.clear()
            self._nstacks = 0
        return out

    def kernel_frames(self, callchain: tuple[int, ...] | bytes) -> tuple[Frame, ...]:
        """Symbolized kernel frames of a sample's kernel callchain (user entries skipped): its
        u64 words, or the words packed native-endian (the native step's export, kept as the
        key as it is: 8 bytes a word, where a tuple holds an int object of 4-5 times that)."""
        hit = self._kstacks.get(callchain)
        if hit is not None:
            return hit
        words = memoryview(callchain).cast("Q") if isinstance(callchain, bytes) else callchain
        out = self._kstacks[callchain] = tuple(map(self.kernel_frame, kernel_ips(words)))
        if len(self._kstacks) > self._kstacks_max:
            self._kstacks.clear()
        return out

    def kernel_frame(self, ip: int) -> Frame:
        """The frame of kernel ip, the same in every callchain: named once, since new
        callchains mostly repeat the entry, interrupt and syscall paths. At most ``_KFRAMES_MAX``
        kept: a miss is one bisect in the kernel image's mapped symbols."""
        f = self._kframes.get(ip)
        if f is None:
            ks = self.symbolizer.kernel(ip)
            if ks is None:
                f = Frame(ip, KERNEL_DSO, None, None, kernel=True)
            else:
                dso = f"[{ks.module}]" if ks.module else KERNEL_DSO
                f = Frame(ip, dso, ks.name, ks.offset, kernel=True)
            if len(self._kframes) >= _KFRAMES_MAX:
                self._kframes.clear()
            self._kframes[ip] = f
        return f

    def frame_at(self, pid: int | None, snap: Snapshot, ip: int) -> Frame:
        """One symbolized user frame for ``ip`` as named (already adjusted: a caller frame's
        return address - 1); counts ``unsymbolized`` like ``user_frames`` does per frame."""
        return self._user_frame(pid, snap, ip)

    def frames_at(self, pid: int | None, snap: Snapshot, ip: int) -> tuple[Frame, ...]:
        """``frame_at``'s frame expanded by ``expand``."""
        return self.expand(snap, ip, self._user_frame(pid, snap, ip))

    def expand(self, snap: Snapshot, ip: int, f: Frame) -> tuple[Frame, ...]:
        """User frame ``f`` named at ``ip``, or with ``srclines`` and a pc DWARF places in
        inlined code, one frame per level as perf script shows them (``inline_frames``),
        innermost first. Only frames of a DWARF unwind are expanded: perf script shows a
        recorded callchain's entries and a sample's lone ip as they are. Cost: one mapping
        bisect and the table's two (its table compiled or read once per binary)."""
        src = self.srclines
        if src is None or f.sym is None:
            return (f,)
        m = snap.find(ip)
        e = m.entry if m is not None else None
        if m is None or e is None or not e.usable:
            return (f,)
        table = src.table(e)
        if table is None:
            return (f,)
        key = (e.uid, m.vaddr(ip))
        hit = self._levels.get(key)
        if hit is None or hit[0]() is not table or hit[1] != f.sym or hit[2] != f.offset:
            out = inline_frames(f, table.chain(key[1]))
            if len(self._levels) >= _MAX_LEVELS:
                self._levels.clear()
            # the frames without ip, dso and rel (those of ``f``, the same in every level)
            self._levels[key] = hit = (weakref.ref(table), f.sym, f.offset, None if out == (f,)
                                       else tuple((x.sym, x.offset, x.inlined, x.file, x.line,
                                                   x.decl_file, x.decl_line) for x in out))
        if hit[3] is None:
            return (f,)
        at, dso, rel = f.ip, f.dso, f.rel
        out = tuple([_new_frame(at, dso, sym, off, False, inl, rel, file, line, dfile, dline, None)
                     for sym, off, inl, file, line, dfile, dline in hit[3]])  # fmt: skip
        if out[-1].inlined:
            # no level named as the symbol: the chain alone no longer says it (plain_symbol)
            if len(self._plain) >= self._sym_cache_size:
                self._plain.clear()
            self._plain[(f.dso, f.rel)] = (f.sym, f.offset)
        return out

    def _jitdump_of(self, snap: Snapshot) -> str | None:
        """The path of the jitdump ``snap``'s process maps (a JIT maps its ``jit-<pid>.dump``
        executable so that perf records the mapping: tools/perf/util/jitdump.c jit_detect),
        else None. Cached per snapshot."""
        key = snap.key
        if key in self._dumps:
            return self._dumps[key]
        path = next((m.filename for m in snap.mappings if is_jitdump_path(m.filename)), None)
        if len(self._dumps) >= _MAX_SNAPS:
            self._dumps.clear()
        self._dumps[key] = path
        return path

    def plain_symbol(self, dso: str | None, rel: int | None) -> tuple[str, int | None] | None:
        """The symbol and offset of the frame at (``dso``, ``rel``) unexpanded, for a pc whose
        inline chain has no level named as its symbol (the function is there under a DWARF
        name the symbol table spells otherwise): what ``stackfmt.without_inline`` shows for
        it. None if not named so lately (at most ``sym_cache_size`` kept). Any thread: one
        dict read."""
        return self._plain.get((dso, rel))

    def _user_frame(self, pid: int | None, snap: Snapshot, ip: int) -> Frame:
        m = snap.find(ip)
        if m is None:
            self.stats.unsymbolized += 1
            return Frame(ip, None, None, None)
        rel = ip if m.anonymous else ip - m.start + m.pgoff
        e = m.entry
        if e is None or not e.usable:
            if m.anonymous and pid is not None:
                jit = self.symbolizer.jit(pid, ip)
                if jit is not None:
                    return Frame(ip, f"/tmp/perf-{pid}.map", jit[0], jit[1], rel=ip)
                dump = self._jitdump_of(snap)
                if dump is not None:
                    jit = self.symbolizer.jitdump(pid, dump, ip, self.name_time)
                    if jit is not None:
                        return Frame(ip, dump, jit[0], jit[1], rel=ip)
            self.stats.unsymbolized += 1
            return Frame(ip, m.filename, None, None, rel=rel)
        vaddr = m.vaddr(ip)
        key = (e.uid, vaddr)
        if key in self._syms:
            hit = self._syms[key]
        else:
            hit = self.symbolizer.symbolize(e, vaddr)
            self._syms[key] = hit
            if len(self._syms) > self._syms_max:
                self._syms.popitem(last=False)
        if hit is None:
            self.stats.unsymbolized += 1
            return _new_frame(ip, m.filename, None, None, False, False, rel, None, None, None,
                              None, None)  # fmt: skip
        return _new_frame(ip, m.filename, hit[0], hit[1], False, False, rel, None, None, None,
                          None, None)  # fmt: skip
