"""From time-ordered records to unwound, symbolized samples: the stage both replay and the live
pipeline run after ordering.

Invariants:
- Records must arrive in time order (ordering.py first): side-band records (MMAP/MMAP2/COMM/
  FORK/EXIT) are applied to the process table exactly where they fall between samples, so every
  sample is unwound against the address space its process had when it was taken.
- Samples are batched for the native unwinder (one cffi call per ``batch_size`` samples) without
  changing that: each queued sample holds the immutable native address space and mapping list
  of its own moment (``proctable`` replaces, never mutates, a space's state), so a later MMAP2
  cannot leak into an earlier sample. A COMM flushes the queue first, so each sample is named
  with the comm its thread had when it was taken (as perf does), whatever the batch size.
- Output order = input order of samples; one ``UnwoundSample`` per ``Sample``, whatever
  happened (a failed unwind still gives the kernel frames and the leaf, with a status).
- Frames follow perf script's conventions so the two can be compared: leaf first, kernel frames
  (from the kernel callchain) first; a caller frame's ``ip`` is its return address minus 1
  (perf's unwinders report ``pc - 1`` for non-activation frames: unwind-libunwind-local.c,
  "Decrement the IP for any non-activation frames"), and the symbol is looked up there, so a
  call that ends a function is attributed to the caller, not to the next function.
- Live mode (``attach(LiveTable)``): every sample is first offered to ``live.place``, which may
  rescan /proc for its pid or *hold* it for a rate-limited rescan; held samples come back from
  ``live.due()`` at the start of a later ``feed`` and are unwound then (so in live mode output
  order is input order except for those, each still exactly once); ``finish()`` returns the
  rest. After each batch is unwound ``live.end_batch()`` drops retired/over-cap pids, and a
  dropped pid's comms are forgotten here.
- Cost: a stack already seen in the same address-space generation costs one dict lookup; a new
  one costs, per frame, one bisect for the mapping and one dict hit per (binary, address)
  already symbolized, else one bisect in the binary's symbol table. Every cache is bounded
  (cleared when it outgrows ``sym_cache_size`` entries).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import abi
from .elfcache import CacheConfig, ElfCache
from .proctable import Mapping, ProcessTable
from .records import Comm, Record, Sample
from .stackfmt import Frame, UnwoundSample
from .symbolize import Symbolizer

if TYPE_CHECKING:
    from .livetable import LiveTable

KERNEL_DSO = "[kernel.kallsyms]"


@dataclass
class EngineStats:
    samples: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    frames: int = 0
    user_frames: int = 0
    kernel_frames: int = 0
    unsymbolized: int = 0
    batches: int = 0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One generation of one address space: what a sample is unwound and symbolized against."""

    key: tuple[int, int]  # (pid, generation)
    native: Any
    mappings: tuple[Mapping, ...]
    starts: tuple[int, ...]

    def find(self, addr: int) -> Mapping | None:
        i = bisect_right(self.starts, addr) - 1
        if i >= 0:
            m = self.mappings[i]
            if addr < m.end:
                return m
        return None


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
        self._snaps: OrderedDict[tuple[int, int], Snapshot] = OrderedDict()
        self._syms: OrderedDict[tuple[int, int], tuple[str, int] | None] = OrderedDict()
        self._sym_cache_size = sym_cache_size
        self._stacks: dict[tuple[tuple[int, int], tuple[int, ...]], tuple[Frame, ...]] = {}
        self._kstacks: dict[tuple[int, ...], tuple[Frame, ...]] = {}
        self.live: LiveTable | None = None
        self._tids: dict[int, set[int]] = {}  # pid -> threads with their own comm (live mode)

    @classmethod
    def create(
        cls,
        *,
        proc_root: str = "/proc",
        cache_config: CacheConfig | None = None,
        max_depth: int = 128,
        batch_size: int = 512,
        cfi_cache_dir: str | None = None,
    ) -> StackEngine:
        """The engine with the real ELF cache, CFI compiler and native unwinder. With
        ``cfi_cache_dir``, compiled CFI tables persist there by build-id (``CfiStore``)."""
        from . import unwinder as unw
        from .cfi import CfiStore, CfiTable

        store = CfiStore(cfi_cache_dir) if cfi_cache_dir is not None else None

        def factory(path: str, debug: str | None, build_id: bytes | None) -> object:
            if store is not None:
                return store.get_or_compile(build_id, path, debug)
            return CfiTable.from_elf(path, debug)

        cache = ElfCache(cache_config, proc_root=proc_root, cfi_factory=factory)
        table = ProcessTable(cache, unwinder=unw)
        return cls(table, unw.Unwinder(max_depth), Symbolizer(proc_root=proc_root),
                   batch_size=batch_size)  # fmt: skip

    # -- records in, samples out

    def feed(self, recs: Iterable[Record]) -> list[UnwoundSample]:
        out: list[UnwoundSample] = []
        pending: list[tuple[Snapshot, Sample]] = []
        live = self.live
        if live is not None:
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
                if isinstance(rec, Comm):
                    if pending:  # queued samples keep the comm they were taken under
                        out += self._unwind(pending)
                        pending = []
                    self._comms[rec.tid] = rec.comm
                    if live is not None and rec.tid != rec.pid:
                        self._tids.setdefault(rec.pid, set()).add(rec.tid)
                self.table.apply(rec)
                if live is not None:
                    live.observe(rec)
        if pending:
            out += self._unwind(pending)
        if live is not None:
            live.end_batch()
        return out

    # -- live mode

    def attach(self, live: LiveTable) -> None:
        """Run in live mode (see the module doc); ``live.table`` must be ``self.table``."""
        if live.table is not self.table:
            raise ValueError("the LiveTable must wrap this engine's process table")
        self.live = live
        live.on_comm = self.set_comm
        self.table.on_drop = self._dropped

    def finish(self) -> list[UnwoundSample]:
        """End of stream: unwind every sample still held for a rescan."""
        if self.live is None:
            return []
        held = self.live.flush_held()
        return self._unwind([(self.snapshot(s.pid), s) for s in held]) if held else []

    def set_comm(self, tid: int, comm: str) -> None:
        self._comms[tid] = comm

    def _dropped(self, pid: int) -> None:
        self._comms.pop(pid, None)
        for tid in self._tids.pop(pid, ()):
            self._comms.pop(tid, None)
        self.symbolizer.forget_pid(pid)
        if self.live is not None:
            self.live.forget(pid)

    def comm_of(self, pid: int | None, tid: int | None) -> str:
        if tid is not None and tid in self._comms:
            return self._comms[tid]
        if pid is not None and pid in self._comms:
            return self._comms[pid]
        return ":-1" if pid is None else f":{pid}"

    # -- internals

    def snapshot(self, pid: int | None) -> Snapshot:
        """The process's address space as it is now (immutable: later records do not change
        it); its ``native`` form is what the unwinder takes."""
        sp = self.table.space_for(pid if pid is not None else -1)
        key = (sp.pid, sp.generation)
        snap = self._snaps.get(key)
        if snap is None:
            mappings = sp.mappings
            snap = Snapshot(key, sp.native_space(), mappings, tuple(m.start for m in mappings))
            self._snaps[key] = snap
            if len(self._snaps) > 4096:
                self._snaps.popitem(last=False)
        return snap

    def _unwind(self, pending: list[tuple[Snapshot, Sample]]) -> list[UnwoundSample]:
        self.stats.batches += 1
        results = self.unwinder.unwind_batch([(snap.native, s) for snap, s in pending])
        out = []
        stats = self.stats
        for (snap, s), res in zip(pending, results, strict=True):
            kframes = self.kernel_frames(s.callchain) if s.callchain else ()
            if s.regs_abi == abi.REGS_ABI_NONE and kframes:
                status = "kernel_only"
                frames = kframes
            else:
                status = res.status.name.lower()
                frames = kframes + self.user_frames(s.pid, snap, res.pcs, res.signal_frames)
            stats.samples += 1
            stats.by_status[status] += 1
            stats.kernel_frames += len(kframes)
            stats.user_frames += len(frames) - len(kframes)
            comm = self.comm_of(s.pid, s.tid)
            out.append(UnwoundSample(s.time, s.pid, s.tid, s.cpu, comm, s.period, status, frames))
        stats.frames = stats.kernel_frames + stats.user_frames
        return out

    def user_frames(
        self, pid: int | None, snap: Snapshot, pcs: tuple[int, ...], signal_frames: int = 0
    ) -> tuple[Frame, ...]:
        """Symbolized user frames for unwound ``pcs`` (leaf first, return addresses as the
        unwinder found them; ``signal_frames``: the unwinder's mask of signal-trampoline
        frames, ``UnwindResult.signal_frames``). Profiles repeat the same stacks: each
        (address space, stack) is symbolized once (the mask is a function of both)."""
        key = (snap.key, pcs)
        hit = self._stacks.get(key)
        if hit is not None:
            return hit
        frames = []
        # The leaf's pc is exact; so is the pc of a frame right after a signal trampoline (it
        # was interrupted, not called); every other pc is a return address, reported - 1.
        exact = signal_frames << 1 | 1
        for i, pc in enumerate(pcs):
            frames.append(self._user_frame(pid, snap, pc if exact >> i & 1 else pc - 1))
        out = self._stacks[key] = tuple(frames)
        if len(self._stacks) > self._sym_cache_size:
            self._stacks.clear()
        return out

    def kernel_frames(self, callchain: tuple[int, ...]) -> tuple[Frame, ...]:
        """Symbolized kernel frames of a sample's kernel callchain (user entries skipped)."""
        hit = self._kstacks.get(callchain)
        if hit is not None:
            return hit
        frames: list[Frame] = []
        in_kernel = False
        for ip in callchain:
            if ip >= abi.CONTEXT_MAX:
                in_kernel = ip == abi.CONTEXT_KERNEL
                continue
            if not in_kernel:
                continue  # user entries: we unwind the user stack ourselves
            ks = self.symbolizer.kernel(ip)
            if ks is None:
                frames.append(Frame(ip, KERNEL_DSO, None, None, kernel=True))
            else:
                dso = f"[{ks.module}]" if ks.module else KERNEL_DSO
                frames.append(Frame(ip, dso, ks.name, ks.offset, kernel=True))
        out = self._kstacks[callchain] = tuple(frames)
        if len(self._kstacks) > self._sym_cache_size:
            self._kstacks.clear()
        return out

    def frame_at(self, pid: int | None, snap: Snapshot, ip: int) -> Frame:
        """One symbolized user frame for ``ip`` as named (already adjusted: a caller frame's
        return address - 1); counts ``unsymbolized`` like ``user_frames`` does per frame."""
        return self._user_frame(pid, snap, ip)

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
            self.stats.unsymbolized += 1
            return Frame(ip, m.filename, None, None, rel=rel)
        vaddr = m.vaddr(ip)
        key = (e.uid, vaddr)
        if key in self._syms:
            hit = self._syms[key]
        else:
            hit = self.symbolizer.symbolize(e, vaddr)
            self._syms[key] = hit
            if len(self._syms) > self._sym_cache_size:
                self._syms.popitem(last=False)
        if hit is None:
            self.stats.unsymbolized += 1
            return Frame(ip, m.filename, None, None, rel=rel)
        return Frame(ip, m.filename, hit[0], hit[1], rel=rel)
