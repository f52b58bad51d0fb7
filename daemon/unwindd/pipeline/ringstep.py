"""The ring driver of the native context, the live step: ring chunks -> C index -> C round
ordering -> C placement, unwinding and per-(bucket, pid, tid, stack) counts ->
``StackStore.add_counts``. Its reference is the whole-stream Python step of the tests
(tests/support/refstep.py: ``capture.drain_round`` + ``StackEngine.feed`` +
``StackStore.add``); test_ringstep.py replays the same recorded chunks through both.

Invariants:
- Same records, same order, same counts as the reference step (``_round``).
- Side-band records are applied in delivered order between runs of samples, exactly as
  ``StackEngine.feed`` does (``_apply``).
- Each sample is unwound against its pid's space, and named with its thread's comm, as they
  were when it was placed, as in the reference step (``_run``, deferred.py).
- Each distinct frame is named once, each unique stack built once (``_name_new``): a frame is
  (snapshot, pc), or with ``code_frames`` (binary, mapped name, ELF vaddr) in a module, so a new
  process of a known binary, or a process whose mappings changed, names no frame again
  (``_code_stack``): its stacks are ``CodeStack``s, the frames named once and each one's ip in
  this process, no ``Frame`` built per process (the store interns them from those; subscribers
  and Python-frame merging build the frames, once per stack, when they need them).
  A frame named while its binary's line table was still being read is retired when
  the table arrives (``retire_code``), with the context's stacks that hold it: the next sample
  of such code, in any process, names it afresh; counts already held keep their names.
- Memory: the C context and its Python mirrors are dropped whole past ``max_stacks`` stacks
  or ``max_spaces`` snapshots (``_new_ctx``), and with them every other holder of their
  stacks (the JIT stats' cache); the counts they name reach the store first, and at close
  (``flush_counts``). ``nctx.native_bytes`` is the C context's heap (O(1)). Per stack by code
  the mirror holds a tuple of shared frames and an array of ips (8 bytes a frame).
- Python frames (``python``, unwind/pyreader.py): a delivered sample whose stack holds
  ``_PyEval_EvalFrameDefault`` frames gets its thread's Python frames, the reader thread's
  read nearest the sample's time, in place of or beside them (``_python_frames``); its stack
  id then names a merged stack (ids from ``_PY_BASE``). Per (pid, tid) per round the thread is
  kept wanted and, when the reader lags, read once on the loop (bounded per round). No read
  near the sample, a failed read, or one that does not line up with the C frames keeps the
  native stack, counted by reason; samples unwound outside the round (held, deferred) too.

Cost per step: O(records) native; Python O(side-band records + unplaceable samples + new
frames), plus O(groups) per flush and O(samples) only with stream subscribers or in a round
that delivers a sample whose stack holds interpreter frames (plus one frame-chain read per
such thread; while the context holds such a stack, other rounds take one C-speed pass over
their stack ids).
"""

from __future__ import annotations

import struct
import time
from array import array
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from ..lightdc import dataclass, field
from ..procs.livetable import LiveTable
from ..procs.pyframes import merge
from ..source import abi
from ..source.capture import StreamPipeline, round_drained
from ..source.mapfile import layout_of
from ..source.perfcore import MAX_RECORD_SIZE
from ..source.records import Comm, Fork, Lost, Mmap2, Record
from ..source.streamstats import PLAIN
from ..store.stackstore import StackStore, StoreGroup
from ..unwcore import count, ffi, lib, owned
from ..unwind.engine import StackEngine
from ..unwind.pyreader import EVAL_SYMBOL, PythonFrames
from ..unwind.stackfmt import (
    STATUS_CALLCHAIN,
    STATUS_IP_ONLY,
    CodeStack,
    Frame,
    UnwoundSample,
    at_ip,
    frames_of,
)
from .context import (
    END_ERRORS,
    HAS_CPU,
    STATUS_NAMES,
    TIMED,
    NativeContext,
    jit_parts,
    view,
)
from .deferred import Deferred

# status codes of stacks shown as recorded, without inline chains (engine.expand)
_FIXED = frozenset(STATUS_NAMES.index(x) for x in (STATUS_CALLCHAIN, STATUS_IP_ONLY))
__all__ = ["DrainSource", "NativeStep", "StepInfo", "supported"]

_HELD = 0xFFFFFFFF
_ARENA_MIN = 64 << 10  # each drain arena's least size (see NativeStep.__init__)
_SHRINK_ROUNDS = 256  # rounds between two looks at the arenas' sizes (NativeStep._shrink)
_RECS_MIN = 1024  # records the per-round arrays hold at least (NativeStep._grow)
_PY_BASE = 0x80000000  # stack ids of stacks merged with Python frames (the C ids stay below)
PYTHON_MODES = ("replace", "beside", "off")
# A decoded non-SAMPLE record with what context.mark_record writes into its C index entry
# (time, cpu, flags): computed once, rewritten when the record is carried to the next round.
# (None: marked from its bytes, unw_sb_trailer_marks)
_Marked = tuple[Record, tuple[int, int, int] | None]
_Frames = tuple[Frame, ...] | CodeStack  # a mirrored stack's frames (stackfmt.frames_of)


class DrainSource(Protocol):
    """What the step drains: a ``perfcore.PerfSession`` (tests: a captured session)."""

    def pending_bytes(self) -> int: ...

    def drain_into(self, out: Any) -> list[tuple[int, int]]: ...


_IP_BIT = abi.X86_REG_NAMES.index("ip")
_U64 = struct.Struct("<Q")
_NO_STOP = (1 << 64) - 1
_COLS = ("uint8_t", "uint64_t", "uint64_t", "uint32_t", "uint32_t", "uint32_t")  # fp_columns
_PLAIN_NAMES = {t: t.__name__.upper() for t in PLAIN}  # record_type_name of each (MMAP2, ...)


@dataclass
class StepInfo:
    """For metrics: the samples one step processed and their pids; the depths of the samples
    it (or a ``flush_counts``) stored. Natively unwound samples are counted, with their pids,
    when their round runs and stored, with their depths, when their counts are flushed.
    ``busy``: the samples of tasks other than the idle task (pid 0) as they left the ring (the
    service's pace, service.py ``_pace``)."""

    samples: int = 0
    depths: Counter[int] = field(default_factory=Counter)
    pids: set[int] = field(default_factory=set)
    busy: int = 0


def supported(fmt: Any) -> bool:
    """The native step needs TID, TIME and CPU in every SAMPLE (the daemon's default)."""
    lay = layout_of(fmt)
    return bool(lay.i_tid >= 0 and lay.i_time >= 0 and lay.i_cpu >= 0)


class NativeStep:
    def __init__(
        self,
        pipeline: StreamPipeline,
        engine: StackEngine,
        store: StackStore,
        pin: Callable[[Record], None],
        unpin: Callable[[list[Record]], None],
        *,
        max_stacks: int = 1 << 16,
        max_spaces: int = 4096,
        max_deferred: int = 4096,
        flush_interval: float = 0.0,
        python: PythonFrames | None = None,
        python_mode: str = "replace",
        code_frames: bool = False,
    ) -> None:
        self.pipeline = pipeline
        # frames by code (fp_ctx_code_frames; off: by address space, the same answers with
        # every process's frames named anew), from the next context on; see the module doc
        self.code_frames = code_frames
        # the stream's samples per pid (StreamStats.samples_by_pid), for a recording's summary
        self.count_pid_samples = True
        self.python = python  # Python frames for interpreter stacks (None: off)
        self.python_beside = python_mode == "beside"
        self.engine = engine
        self.store = store
        self.pin = pin
        self.unpin = unpin
        assert engine.live is not None
        self.live: LiveTable = engine.live
        # MMAP2s after an exec built only when the process is asked for (proctable.py): under
        # churn most processes exit unsampled and never build one
        engine.table.defer_mappings = True
        fmt = pipeline.decoder.formats[0]
        self.lay = layout_of(fmt)
        # the byte offset of the ip register in a sample's REGS_USER regs[] (-1: not sampled)
        mask = fmt.sample_regs_user
        self._pc_off = 8 * (mask & ((1 << _IP_BIT) - 1)).bit_count() if mask >> _IP_BIT & 1 else -1
        self.max_stacks = max_stacks
        self.max_spaces = max_spaces
        # Counts reach the store at most this long after their round (0: every round); the
        # daemon holds them up to a second and flushes before every read of the store.
        self.flush_interval = flush_interval
        self._flushed_at = time.monotonic()
        self._acc = owned(lib.fp_live_groups_new(store.bucket_ns), lib.fp_live_groups_free,
                          "fp_live_groups_new")  # fmt: skip
        self.orderer = owned(lib.fp_live_order_new(pipeline.orderer.max_queued),
                             lib.fp_live_order_free, "fp_live_order_new")  # fmt: skip
        # Two arenas, reused for the life of the step: the rings are drained into the current
        # one (the carry already at its head), the carry gathered into the other, and they
        # swap. A fresh buffer per round would cost a zero-fill or a page-faulting mmap per
        # round, kernel time in proportion to the bytes drained. Each grows to the largest
        # round seen (at most the ring bytes of one drain round plus one carry), and goes back to
        # twice the largest of the last ``_SHRINK_ROUNDS`` rounds when it is more than twice that
        # (``_shrink``): a burst does not keep its memory for the step's life.
        self._arenas = [bytearray(_ARENA_MIN), bytearray(_ARENA_MIN)]
        # each arena's memoryview and cffi pointer, made once per arena, not per round
        self._views = [memoryview(b) for b in self._arenas]
        self._cbufs = [ffi.from_buffer(b) for b in self._arenas]
        self._peak = 0  # the largest round since the last _shrink
        self._peak_n = 0  # the most records a round indexed since then
        self._rounds = 0
        self._cur = 0
        self._carry_len = 0
        self._carry_objs: dict[int, _Marked] = {}
        self._ncarry = 0
        # per-round arrays, reused and grown to the largest round (cffi zero-fills each new);
        # ``_shrink`` gives them back after a burst as it does the arenas
        self._cap = 0
        self._lr = ffi.new("struct fp_live_round *")  # fp_live_round's arrays and answers
        self._grow(_RECS_MIN)
        self._pp = ffi.new("struct fp_rec **")
        self._u64s = ffi.new("uint64_t[9]")  # out-params: [0, 3) _index's, [6, 9) _run's
        self._u32s = ffi.new("uint32_t[2]")
        # _run's out-params as pointers made once (each ``+`` makes a new cdata)
        self._run_out = (self._u64s + 6, self._u64s + 7, self._u64s + 8, self._u32s,
                         self._u32s + 1)  # fmt: skip
        self._bounds, self._ends = ffi.new("uint64_t[]", 64), ffi.new("int[]", 64)  # _index's
        self.runs = 0
        self.contexts = 0  # C contexts created (1 + resets)
        # Placed samples waiting for a CFI compile in the worker (engine.cfi_prefetch)
        self.deferred = Deferred(engine, self.live, max_deferred)
        self._new_ctx()
        engine.drop_listeners.append(self._dropped)

    def _grow(self, n: int, cap: int = 0) -> None:
        """Room for ``n`` records in every per-round array (doubling: O(1) amortized); with
        ``cap``, arrays of exactly that many (``_shrink``). Nothing in them outlives a round."""
        self._peak_n = max(self._peak_n, n)
        if n <= self._cap and not cap:
            return
        cap = cap or max(n, 2 * self._cap)
        self._cap = cap
        self._perm, self._keep = ffi.new("uint32_t[]", cap), ffi.new("uint32_t[]", cap)
        self._late = ffi.new("uint64_t[]", cap)
        self._cols = [ffi.new(f"{t}[]", cap) for t in _COLS]
        self._stack_ids = ffi.new("uint32_t[]", cap)
        self._idx = ffi.new("uint32_t[]", cap)
        self._rows, self._marks = ffi.new("uint64_t[]", 5 * cap), ffi.new("uint64_t[]", 3 * cap)
        self._inv, self._slots = ffi.new("uint32_t[]", cap), ffi.new("uint32_t[]", cap)
        self._touched, self._touched_t = ffi.new("uint32_t[]", cap), ffi.new("uint64_t[]", cap)
        # the new samples' distinct pids and cpus as (value, count) pairs (fp_live_round), and
        # views of them made once
        self._by = (ffi.new("uint64_t[]", 2 * cap), ffi.new("uint64_t[]", 2 * cap))
        self._by_pid, self._by_cpu = view(self._by[0], "Q"), view(self._by[1], "Q")
        # the delivered records' stack ids, pids, tids and times (``_python_frames``' reads),
        # viewed once per size, not per round
        self._py_views = (view(self._stack_ids, "I"), view(self._cols[3], "I"),
                          view(self._cols[4], "I"), view(self._cols[1], "Q"))  # fmt: skip
        lr = self._lr
        lr.perm, lr.keep, lr.late_ns = self._perm, self._keep, self._late
        (lr.is_sample, lr.time, lr.period, lr.pid, lr.tid, lr.cpu) = self._cols
        lr.by_pid, lr.by_cpu = self._by
        lr.cap = cap

    # -- context and the caches mirroring it

    def _new_ctx(self) -> None:
        """A fresh C context and empty mirrors. ``step`` drops the context (stacks, frames,
        spaces) and the Python caches that mirror it whole when they pass ``max_stacks``
        stacks or ``max_spaces`` snapshots (a cold context only costs re-naming), so they are
        bounded under process churn."""
        self.nctx = NativeContext(self.engine, code_frames=self.code_frames)
        self.ctx = self.nctx.ctx
        self.engine.jit.forget()  # it holds the old context's stack tuples
        self._reset = False
        self.contexts += 1
        self._frames: list[tuple[Frame, ...]] = []  # per frame id (several: an inline chain)
        # per stack id: (frames, comm, status, user frame count, kernel frame count); with
        # code frames the frames are a CodeStack (see _name_new)
        self._stacks: list[tuple[_Frames, str, str, int, int]] = []
        self._evals: list[int] = []  # per stack id: its _PyEval_EvalFrameDefault frames
        self._eval_sids: set[int] = set()  # the stack ids whose _evals entry is not 0
        # stacks merged with Python frames, id _PY_BASE + i, interned by (stack id, segments)
        self._pystacks: list[tuple[_Frames, str, str, int, int]] = []
        self._pymerged: dict[tuple[int, object], int] = {}

    @property
    def nstacks(self) -> int:
        """Stacks the context's mirror holds (merged Python ones too): ``max_stacks`` bounds
        it."""
        return len(self._stacks) + len(self._pystacks)

    @property
    def nframes(self) -> int:
        """Frame ids the context's mirror has named."""
        return len(self._frames)

    def _stack(self, sid: int) -> tuple[_Frames, str, str, int, int]:
        return self._stacks[sid] if sid < _PY_BASE else self._pystacks[sid - _PY_BASE]

    def reset_context(self) -> None:
        """Drop the C context and its mirrors at the next step (as past ``max_stacks``): its
        frames were named once and a binary's names changed (debuginfod.py)."""
        self._reset = True

    def retire_code(self, keys: list[int]) -> int:
        """Frames by code: a table the names of modules ``keys`` depend on arrived: their
        frames, and the context's stacks that hold one, are named again at their next sample
        (fp_ctx_retire_code), while the stack ids already counted keep their names. The frames
        retired (0 when a reset is due anyway); by space, a ``reset_context``."""
        if not self.nctx.code_frames:
            self.reset_context()
            return 0
        return 0 if self._reset else self.nctx.retire_code(keys)

    def forget_all(self) -> None:
        self.nctx.forget_all_spaces()
        self.nctx.forget_comms()

    def _dropped(self, pid: int) -> None:
        self.nctx.forget_space(pid)
        self.nctx.forget_comms()
        if self.python is not None:
            self.python.forget(pid)

    # -- one step

    def step(
        self,
        source: DrainSource,
        max_passes: int,
        max_bytes: int,
        final: bool = False,
    ) -> tuple[list[UnwoundSample], StepInfo]:
        """Drain (up to ``max_passes`` of ``source.drain_into``, straight into the arena after
        the carry), order, place, unwind, store."""
        end = self._carry_len
        bounds = [0, end]  # bounds[i + 1] ends part i (part 0: the carry)
        cpus: list[int] = []  # the ring of each drained part
        for _ in range(max_passes):
            # Room for what the rings hold now plus one record that may land meanwhile: the
            # arena grows to the largest round, as a bytes-per-drain buffer would.
            want = min(max_bytes, source.pending_bytes() + MAX_RECORD_SIZE)
            self._reserve(self._cur, end, end + want)
            got = source.drain_into(self._views[self._cur][end : end + want])
            n = 0
            for cpu, size in got:
                n += size
                end += size
                bounds.append(end)
                cpus.append(cpu)
            if round_drained(n, want):
                break
        flushed = None
        if self._reset or self.nstacks > self.max_stacks or self.nctx.nspaces > self.max_spaces:
            flushed = self.flush_counts()  # its groups name stacks of the context being dropped
            self._new_ctx()
        for pid in self.engine.refresh_jit_names():  # its JIT frames are named again
            self.nctx.forget_space(pid)
        self._peak = max(self._peak, bounds[-1])
        out, info = self._round(cpus, bounds, False)
        if flushed is not None:
            info.depths.update(flushed.depths)
        if final:  # close(): end_round, then flush_all (capture: drain_round + finish)
            more, info2 = self._round([], [0, self._carry_len], True)
            late = self.deferred.take(True)  # deferred during that last round
            if late:
                self.store.add(late)
                more += late
                info2.samples += len(late)
                info2.depths.update(len(s.frames) for s in late)
            out += more
            info.samples += info2.samples
            info.depths.update(info2.depths)
            info.pids |= info2.pids
            info.busy += info2.busy
        self._rounds += 1
        if self._rounds % _SHRINK_ROUNDS == 0:
            self._shrink()
        return out, info

    def _shrink(self) -> None:
        """Each arena more than twice the size the recent rounds needed (``_peak``) is replaced
        by one of that size, the carry (at the current arena's head) kept; the per-round arrays
        likewise, past twice the most records a recent round indexed (``_peak_n``)."""
        keep = max(_ARENA_MIN, 2 * self._peak)
        for i, buf in enumerate(self._arenas):
            if len(buf) > 2 * keep:
                new = bytearray(keep)
                if i == self._cur:  # (the carry is at most one round: keep >= it)
                    new[: self._carry_len] = memoryview(buf)[: self._carry_len]
                self._set_arena(i, new)
        self._peak = 0
        want = max(_RECS_MIN, 2 * self._peak_n)
        if self._cap > 2 * want:  # the per-round arrays likewise
            self._grow(0, want)
        self._peak_n = 0

    def _reserve(self, i: int, used: int, size: int) -> None:
        """Arena ``i`` holds at least ``size`` bytes, its first ``used`` kept (doubling: O(1)
        amortized copies; ``_shrink`` gives back what bursts left)."""
        buf = self._arenas[i]
        if size > len(buf):
            grown = bytearray(max(size, 2 * len(buf)))
            grown[:used] = memoryview(buf)[:used]
            self._set_arena(i, grown)

    def _set_arena(self, i: int, buf: bytearray) -> None:
        """``buf`` is arena ``i`` from now on, with its view and pointer."""
        self._arenas[i], self._views[i], self._cbufs[i] = buf, memoryview(buf), ffi.from_buffer(buf)

    def _round(self, cpus: list[int], bounds: list[int], flush: bool
               ) -> tuple[list[UnwoundSample], StepInfo]:  # fmt: skip
        """One live round (``flush``: the orderer's flush_all instead of end_round) over the
        current arena's ``[0, bounds[-1])``: the carry, then the part drained from ring
        ``cpus[i]`` in ``[bounds[i + 1], bounds[i + 2])``.

        Same records, same order, same counts as the reference step: chunks are indexed per ring
        (``fp_live_index``: fp_index, i.e. decoder.py's SAMPLE checks); every record that is
        not a good SAMPLE is decoded by ``RecordDecoder.decode_one`` itself, counted by
        ``StreamStats.observe`` with its ring's cpu (MMAP2/EXIT/MMAP in bulk per round,
        ``observe_plain``) and pinned (``LiveProfiler._pin``) as it leaves the ring;
        samples are counted in the decoder, stream and ordering stats
        natively. Its C index entry gets the time/cpu/flags ``context.mark_record`` would give
        it, computed once at decode and rewritten from them whenever the record is carried
        into the next round (records are re-indexed from the carry buffer). Ordering is
        ``RoundOrderer``'s rule kept in C across rounds (``fp_live_round``, with the new
        samples' counts, the delivered records' columns and the carry copy: one call, in
        the index's call when the round is samples only); records still queued after a round
        are copied into the next round's buffer (each sample's bytes once more: one memcpy per
        sample), decoded side-band objects ride along by index (``_carry_round``)."""
        info = StepInfo()
        due_out = self._held_first(flush)
        cur = self._cur
        mv, cbuf = self._views[cur], self._cbufs[cur]
        recs, n, ends, rc = self._index(cbuf, bounds, flush)
        ncarry = self._ncarry
        new_other = self._decode_others(recs, n, mv, cbuf, cpus, bounds)
        errors = self.pipeline.decoder.stats.errors
        for end in ends:
            if end in END_ERRORS:
                errors[END_ERRORS[end]] += 1
        fit = self._order(recs, n, flush, cbuf, bounds[-1], rc)
        lr = self._lr
        nsamples = n - ncarry - new_other
        if nsamples:
            self._count_new_samples(nsamples, info)
        d, nkeep = int(lr.nout), int(lr.nkeep)
        cols, stack_ids = self._cols, self._stack_ids
        is_sample = bytes(ffi.buffer(cols[0], d))
        objs = self._carry_objs
        applied = self._runs(mv, bounds[-1], cbuf, recs, is_sample, objs)
        self.live.end_batch()
        if applied:  # (most rounds apply no side-band record)
            self.unpin(applied)
        self._carry_round(cbuf, recs, nkeep, objs, fit)
        if self.python is not None and self._eval_sids and d:
            self._python_frames(is_sample, d)
        if self.python is not None and due_out:
            self._count_late(due_out)
        # -- aggregate (stored by flush_counts: every round, or every flush_interval seconds)
        if d:
            info.samples += count(lib.fp_live_groups_add(self._acc, cols[0], stack_ids, cols[1],
                                                         cols[3], cols[4], d),
                                  "fp_live_groups_add")  # fmt: skip
        for s in due_out:
            info.samples += 1
            info.depths[len(s.frames)] += 1
            if s.pid is not None:
                info.pids.add(s.pid)
        # ``UnwoundSample`` objects only when the store has subscribers (the live stream)
        subs = self.store.subscribers
        out = self._stream_samples(is_sample, d) if subs else []
        if due_out:
            self.store.add(due_out)  # calls the subscribers with them
        if flush or time.monotonic() - self._flushed_at >= self.flush_interval:
            self.flush_counts(info)
        if out:
            for cb in list(subs):
                cb(out)
        return due_out + out, info

    def _held_first(self, flush: bool) -> list[UnwoundSample]:
        """The samples due before this round's: held ones ``live.due()`` gives back and
        deferred ones whose binaries are ready (all of them on ``flush``), unwound by the
        engine's per-sample path."""
        out: list[UnwoundSample] = []
        due = self.live.due()
        if due:
            self.forget_all()  # due() rescanned pids and may have set comms
            out = self.engine.unwind_held(due)
        if self.deferred:
            out += self.deferred.take(flush)
        return out

    def _index(self, cbuf: Any, bounds: list[int], flush: bool
               ) -> tuple[Any, int, list[int], int]:  # fmt: skip
        """The round's records indexed in C, per drained part, and when they are all good
        SAMPLEs (nothing to decode) the round's fixed work too, in the same call
        (``fp_live_index_round``; see ``_order``): the index, its length, the FP_END_* each
        ring's part ended on, and fp_live_round's answer (2: not run, ``_order`` runs it)."""
        nparts = len(bounds) - 1
        u64 = self._u64s  # [0] records, [1] others, [2] stop
        if len(bounds) > len(self._bounds):  # (the parts of a round: a few per ring)
            self._bounds = ffi.new("uint64_t[]", 2 * len(bounds))
            self._ends = ffi.new("int[]", 2 * len(bounds))
        cb, ends = self._bounds, self._ends
        cb[0 : len(bounds)] = bounds
        self._aim_carry()
        rc = int(lib.fp_live_index_round(self.lay, cbuf, cb, nparts, self._pp, u64, u64 + 1,
                                         ends, u64 + 2, self.orderer, self._ncarry, int(flush),
                                         self._lr))  # fmt: skip
        if self._pp[0] == ffi.NULL:
            raise MemoryError("fp_live_index")
        recs = ffi.gc(self._pp[0], lib.unw_free)
        n = int(u64[0])
        if int(u64[2]) != _NO_STOP:  # a record type > 255: the kernel never writes one
            raise RuntimeError(f"unexpected record type at ring offset {int(u64[2])}")
        self._grow(n)
        return recs, n, list(ends[1:nparts]), rc

    def _decode_others(self, recs: Any, n: int, mv: memoryview, cbuf: Any, cpus: list[int],
                       bounds: list[int]) -> int:  # fmt: skip
        """The records that are not good SAMPLEs: the new ones decoded, counted and pinned in
        drain order (``RecordDecoder.decode_side_band``: one call), each index entry marked
        (the common ones from their bytes in C, ``unw_sb_trailer_marks``, the others from their
        decoded values); their number (carried ones not counted)."""
        if not int(self._u64s[1]):
            return 0
        ncarry, objs, idx = self._ncarry, self._carry_objs, self._idx
        observe, pin = self.pipeline.stats.observe, self.pin
        # (index, type, misc, off, size) of every side-band entry, read in C (unw_sb_rows)
        k = int(lib.unw_sb_rows(recs, n, self._rows))
        flat = view(self._rows, "Q", 5 * k).tolist()
        # the new ones (past the carry) decoded in one call, in drain order
        first = 0
        while first < k and flat[5 * first] < ncarry:
            first += 1
        new = flat[5 * first :]
        del new[0::5]  # (type, misc, off, size) each
        mark_i: list[int] = []  # the entries marked from Python (unw_sb_marks) ...
        marks: list[int] = []  # ... and their (time, cpu, flags)
        dec = self.pipeline.decoder
        decoded, times, rcpus = dec.decode_side_band(mv, new)
        # the marks (context.mark_record) of the common records from their bytes, in C, of
        # carried ones again (re-indexed from the carry); the rest from their decoded values
        idx[0:k] = flat[0::5]
        trailer = dec.sample_id_trailer()
        if trailer is not None:
            left = int(lib.unw_sb_trailer_marks(cbuf, len(mv), recs, idx, k, *trailer,
                                                self._inv))  # fmt: skip
            rest = set(view(self._inv, "I", left).tolist()) if left else set()
        else:  # (several trailer layouts: every record from its decoded value)
            rest = set(flat[0::5])
        for j in range(first):
            i = flat[5 * j]
            if i in rest:
                m = objs[i][1]
                assert m is not None  # (a rest entry is one both rounds mark from Python)
                mark_i.append(i)
                marks += m  # carried: decoded and marked once already
        new_idx = flat[5 * first :: 5]
        objs.update(zip(new_idx, zip(decoded, [None] * len(decoded), strict=True),
                        strict=True))  # (marked in C: no marks kept)
        if rest:  # the few marked from Python: their marks kept for when they are carried
            for i, rec, rtime, rcpu in zip(new_idx, decoded, times, rcpus, strict=True):
                if i in rest:  # context.record_marks, inline
                    fl = (0 if rtime is None else TIMED) | (0 if rcpu is None else HAS_CPU)
                    m = (rtime or 0, rcpu or 0, fl)
                    objs[i] = (rec, m)
                    mark_i.append(i)
                    marks += m
        for rec in [r for r in decoded if type(r) is Mmap2]:
            pin(rec)  # (LiveProfiler._pin: only MMAP2s pin a binary)
        # MMAP2/EXIT/MMAP records carrying their cpu (all of them with sample_id_all) counted
        # by (type, cpu) in bulk (StreamStats.observe_plain), the others one by one, in order
        kinds = list(map(type, decoded))
        observe_plain = self.pipeline.stats.observe_plain
        for (kind, cpu), c in Counter(zip(kinds, rcpus, strict=True)).items():
            if cpu is not None and kind in PLAIN:
                observe_plain(_PLAIN_NAMES[kind], cpu, c)
        for rec, off in [(rec, off) for rec, kind, rcpu, off
                         in zip(decoded, kinds, rcpus, new[2::4], strict=True)
                         if rcpu is None or kind not in PLAIN]:  # fmt: skip
            observe(rec, cpus[bisect_right(bounds, off) - 2])
        new_other = len(decoded)
        if mark_i:
            idx[0 : len(mark_i)] = mark_i
            self._marks[0 : len(marks)] = marks
            lib.unw_sb_marks(recs, idx, self._marks, len(mark_i))
        return new_other

    def _aim_carry(self) -> None:
        """fp_live_round copies the carry to the other arena's head (when it fits there)."""
        lr, other = self._lr, 1 - self._cur
        lr.carry, lr.carry_cap = self._cbufs[other], len(self._arenas[other])

    def _order(self, recs: Any, n: int, flush: bool, cbuf: Any, size: int, rc: int) -> bool:
        """The round's fixed work in one call (``fp_live_round``), unless ``_index`` ran it
        (``rc`` its answer, 2: not run): the new samples counted by pid and cpu
        (``_count_new_samples`` takes them); the round ordered (records delivered, ``lr.nout``
        in ``_perm``, their columns in ``_cols``; records kept queued, ``lr.nkeep`` in
        ``_keep``); the kept records' bytes copied to the other arena's head when they fit
        there (the answer; else ``_carry_round`` makes room and copies them)."""
        lr = self._lr
        if rc == 2:  # side-band records marked first (or the arrays grew): run it now
            rc = int(lib.fp_live_round(self.orderer, cbuf, size, recs, self._ncarry, n,
                                       int(flush), lr))  # fmt: skip
        if rc < 0:
            raise RuntimeError("fp_live_round failed")
        self.pipeline.orderer.stats.add_native(lr.st, self._late[0 : int(lr.nlate)])
        return rc == 0

    def _runs(self, mv: memoryview, size: int, cbuf: Any, recs: Any, is_sample: bytes,
              objs: dict[int, _Marked]) -> list[Record]:  # fmt: skip
        """The delivered records in order: each run of samples unwound (``_run``), each
        side-band record between them applied (``_apply``); the records applied."""
        perm, stack_ids, d = self._perm, self._stack_ids, len(is_sample)
        applied: list[Record] = []
        pos = 0
        while pos < d:
            p = is_sample.find(b"\0", pos)
            end = d if p < 0 else p
            if end > pos:
                for k, m in jit_parts(self.nctx, recs, perm, pos, end):  # usually one part
                    self._run(mv, size, cbuf, recs, perm, k, m, stack_ids)
            if p < 0:
                break
            q = is_sample.find(b"\1", p)  # the side-band records up to the next sample
            q = d if q < 0 else q
            batch = [objs.pop(i)[0] for i in perm[p:q]]
            self._apply(batch)
            applied += batch
            pos = q
        return applied

    def _stream_samples(self, is_sample: bytes, d: int) -> list[UnwoundSample]:
        """The round's stored samples as ``UnwoundSample`` objects, for the store's
        subscribers (the live stream): O(samples), only when someone listens."""
        cols = self._cols
        times, pids, tids = view(cols[1], "Q", d), view(cols[3], "I", d), view(cols[4], "I", d)
        ids, s_cpus = view(self._stack_ids, "I", d), view(cols[5], "I", d)
        periods = view(cols[2], "Q", d)
        has_period = self.lay.i_period >= 0
        out: list[UnwoundSample] = []
        for k in range(d):
            if is_sample[k] and ids[k] != _HELD:
                fr, comm, status, _, _ = self._stack(ids[k])
                period = periods[k] if has_period else None
                out.append(UnwoundSample(times[k], pids[k], tids[k], s_cpus[k], comm, period,
                                         status, frames_of(fr)))  # fmt: skip
        return out

    def _count_new_samples(self, nsamples: int, info: StepInfo) -> None:
        """decode/StreamStats.observe's counts for the round's new good SAMPLEs (counted by pid
        and cpu in ``fp_live_round``, first-seen order); their pids go to ``info`` as they
        leave the ring (the daemon learns each pid's uid while it is alive, which a flush a
        second later could miss)."""
        dec, s, lr = self.pipeline.decoder, self.pipeline.stats, self._lr
        dec.stats.records["SAMPLE"] += nsamples
        s.by_type["SAMPLE"] += nsamples
        by_pid = self._by_pid[: 2 * lr.npids].tolist()  # pid, count, pid, count, ...
        pids = by_pid[0::2]
        if self.count_pid_samples:
            samples_by_pid = s.samples_by_pid
            for pid, c in zip(pids, by_pid[1::2], strict=True):
                samples_by_pid[pid] += c
        info.pids.update(pids)
        info.busy += lr.busy
        by_cpu = self._by_cpu[: 2 * lr.ncpus].tolist()
        by_cpu_type = s.by_cpu_type
        for cpu, c in zip(by_cpu[0::2], by_cpu[1::2], strict=True):
            per = by_cpu_type.get(cpu)
            if per is None:
                per = by_cpu_type[cpu] = Counter()
            per["SAMPLE"] += c

    def _carry_round(self, cbuf: Any, recs: Any, nkeep: int, objs: dict[int, _Marked],
                     fit: bool) -> None:  # fmt: skip
        """What stays queued becomes the head of the next round's buffer (the other arena), in
        keep order: ``fp_live_round`` copied it there when it ``fit``, else it is copied now,
        the arena grown to its size."""
        self._ncarry = nkeep
        if not nkeep:
            self._carry_len, self._carry_objs = 0, {}
            return
        keep, size = self._keep, int(self._lr.carry_len)
        self._cur = cur = 1 - self._cur  # (cbuf still holds the round's arena)
        if not fit:
            self._reserve(cur, 0, size)
            lib.fp_live_gather(cbuf, recs, keep, nkeep, self._cbufs[cur])
        self._carry_len = size
        if objs:  # side-band records ride along: each one's new slot, O(nkeep + objs) in C
            k = len(objs)
            want = self._idx  # (free again: _decode_others is done with it)
            want[0:k] = list(objs)
            lib.unw_sb_slots(keep, nkeep, want, k, self._inv, self._slots)
            self._carry_objs = dict(zip(view(self._slots, "I", k).tolist(), objs.values(),
                                        strict=True))  # fmt: skip
        else:
            self._carry_objs = {}

    # -- side-band and samples

    def _apply(self, batch: list[Record]) -> None:
        """StackEngine.feed's handling of side-band records delivered one after another (no
        sample between them), then the C tables follow, once for the batch: comms forgotten
        if a COMM or FORK renamed a task; every space after a LOST (epoch bump); else the
        space of each pid C holds whose space a record changed. C keeps a pid's space when the
        records left it as it was (the same ``AddressSpace`` with the same immutable state: a
        thread's FORK or EXIT, a rename, a process's EXIT, a data mapping over nothing, a
        deferred MMAP2): what C holds was built from exactly that state, so its next sample
        needs no placing again. A pid C does not hold (most side-band records are of
        processes C never saw) costs no look at its space."""
        nctx, apply = self.nctx, self.engine.apply_side_band
        held = nctx._pid_sid  # the pids C holds a space for (NativeContext.forget_space)
        spaces = self.engine.table.spaces  # (its dict: no method call)
        before: dict[int, tuple[Any, object]] = {}
        if held:  # (a held pid's space changes only by its own records: C holds no queued one)
            for pid in held.keys() & {getattr(rec, "pid", None) for rec in batch}:
                sp = spaces.get(pid)
                before[pid] = (sp, sp.state if sp is not None else None)
        for rec in batch:
            apply(rec)
        kinds = set(map(type, batch))  # (record types are final classes)
        if Comm in kinds or Fork in kinds:
            nctx.forget_comms()  # COMM renames; FORK names a new task after its parent
        if Lost in kinds:
            nctx.forget_all_spaces()  # epoch bump: every space is re-verified
            return
        for pid, (was, state) in before.items():
            if was is None or was.state is not state or spaces.get(pid) is not was:
                nctx.forget_space(pid)

    def _run(self, mv: memoryview, size: int, cbuf: Any, recs: Any, perm: Any, a: int, b: int,
             stack_ids: Any) -> None:  # fmt: skip
        """Place and unwind the samples perm[a, b), a run between two side-band records.

        Placement: the C pid table holds, per pid, the engine's current snapshot (modules +
        mapping ranges). It is valid only while the process table has not changed that pid's
        space since Python set it: a side-band record of the pid, any ``LiveTable.place`` call
        for it (rescan, verify), a drop (``StackEngine.drop_listeners``) forget it; LOST (epoch
        bump: every space must be re-verified), ``live.due()`` retries and bootstrap forget
        all. A sample whose pid is not in the C table or whose user pc is outside every
        mapping (``FP_RUN_NEED_PLACE``) is decoded and given to ``LiveTable.place`` (rescan /
        hold / give-up, as in the reference step), unless ``place`` and ``deferred`` would take
        it as it is (``_place_raw``: read from its raw record, no decode); placed samples then
        unwind natively against the snapshot ``place`` left. Held samples come back from
        ``live.due()`` and are unwound by the engine's Python path, as in the reference step; a
        sample whose binaries still compile in the CFI worker waits in ``deferred``
        (deferred.py).

        Comms: (pid, tid) -> comm id in C, from ``engine.comm_of`` on first use; all
        forgotten on COMM, on a drop and whenever a rescan may have set a comm
        (``LiveTable.on_comm``)."""
        live, engine, nctx = self.live, self.engine, self.nctx
        ctx = nctx.ctx
        stopped, rt, ntouched, need_pid, need_tid = self._run_out
        touched, touched_t = self._touched, self._touched_t
        k, force = a, 0
        while True:
            self.runs += 1
            rt[0] = live.record_time
            rc = lib.fp_live_run(ctx, self.lay, cbuf, size, recs, perm, k, b, force,
                                 _IP_BIT, rt, stack_ids, stopped, need_pid, need_tid, touched,
                                 touched_t, ntouched)  # fmt: skip
            live.record_time = int(rt[0])
            for j in range(int(ntouched[0])):
                sp = engine.table.get(touched[j])
                if sp is not None:
                    sp.last_used = int(touched_t[j])
            k = int(stopped[0])
            if rc == lib.FP_RUN_DONE:
                break
            if rc == lib.FP_RUN_NEED_PLACE:
                r = recs[perm[k]]
                if self._place_raw(r, mv):  # what place and hold answer, without decoding
                    nctx.forget_space(r.pid)
                    nctx.set_space(r.pid, engine.snapshot(r.pid), ranges=True)
                    force = 1
                    continue
                s = self.pipeline.decoder.decode_sample(r.misc, mv[r.off + 8 : r.off + r.size])
                rescans = live.stats.rescans.total()
                placed = live.place(s)
                nctx.forget_space(r.pid)
                if live.stats.rescans.total() != rescans:
                    nctx.forget_comms()  # a rescan may have set a comm
                if placed and not self.deferred.hold(s):
                    nctx.set_space(r.pid, engine.snapshot(s.pid), ranges=True)
                    force = 1
                else:
                    stack_ids[k] = _HELD
                    k += 1
                    force = 0
                    if k >= b:
                        break
                continue
            if rc == lib.FP_RUN_NEED_COMM:
                nctx.set_comm(int(need_pid[0]), int(need_tid[0]))
                continue  # force stays: k is still the sample the caller placed
            raise RuntimeError(f"fp_live_run failed at {k} ({rc})")
        engine.name_time = int(recs[perm[b - 1]].time)  # JIT frames: as of the newest sample
        self._name_new()

    def _place_raw(self, r: Any, mv: memoryview) -> bool:
        """For sample ``r`` (an index entry C could not place): True, with ``LiveTable.place``'s
        effects taken, when ``place`` would take it as it is and ``deferred`` would not hold
        it (its pid's space verified, its user pc inside a mapping, no binary of it still
        compiling): the common case after a side-band record changed a space, which then
        costs no Python decode of the sample. Else False, nothing done: the caller decodes
        it and asks them. The user pc is the REGS_USER ``ip`` slot (livetable.user_pc)."""
        pid = r.pid
        if self._pc_off < 0 or pid <= 0 or not r.regs_abi or not self.lay.nregs:
            return False  # (place's early answer for such samples is the decoder's to give)
        (pc,) = _U64.unpack_from(mv, r.off + 8 + r.regs_off + self._pc_off)
        sp = self.live.mapped(pid, pc)
        if sp is None or self.deferred.would_hold(pid):
            return False
        self.live.place_mapped(sp, int(r.time))
        return True

    def _name_new(self) -> None:
        """Frames and stacks the last run added, named now (the table is in the state the
        reference step names them in): each frame id once (``NativeContext.new_frames``), and each
        unique stack once (the same object each time: the store interns by identity first).
        With ``code_frames`` frame ids are by code (fp_ctx_code_frames): a frame id at another
        address than the one it was named at is the same frames at that address
        (``stackfmt.at_ip``), so a stack is a ``CodeStack``: the named frames and each one's ip
        here, no ``Frame`` built for it (``_code_stack``)."""
        nctx, kernel_frames = self.nctx, self.engine.kernel_frames  # cached by callchain
        self._frames += nctx.new_frames()
        stacks, frame_of = self._stacks, self._frames.__getitem__
        for comm, space, code, regs_none, ids, kc, pcs in nctx.new_stacks():
            kframes = kernel_frames(kc) if kc else ()
            if regs_none and kframes:
                stacks.append((kframes, comm, "kernel_only", 0, len(kframes)))
                if self.python is not None:
                    self._evals.append(0)  # one entry per stack id, in id order
                continue
            nctx.count_unsymbolized(space, ids, pcs)
            fr: _Frames
            if not pcs:  # frames by address space: a frame id is one address
                uframes = (tuple(map(nctx.plain.__getitem__, ids)) if code in _FIXED
                           else tuple([f for i in ids for f in frame_of(i)]))  # fmt: skip
                fr = kframes + uframes if kframes else uframes
            else:
                fr, uframes = self._code_stack(kframes, ids, pcs, code in _FIXED)
            stacks.append((fr, comm, STATUS_NAMES[code], len(uframes), len(kframes)))
            if self.python is not None:
                n = _eval_frames(uframes)
                if n:
                    self._eval_sids.add(len(self._evals))
                self._evals.append(n)
        nctx.release_snapshots()

    def _code_stack(self, kframes: tuple[Frame, ...], ids: list[int], pcs: list[int],
                    fixed: bool) -> tuple[_Frames, tuple[Frame, ...]]:  # fmt: skip
        """Frames by code: (the stack, its user frames as named) of frame ids ``ids`` at user
        pcs ``pcs``, kernel frames ``kframes`` first. Each frame id's frames (one per inline
        level, engine.expand: all at one ip), or unexpanded (``fixed``: a recorded callchain
        or a lone ip, ``NativeContext.plain``), at the ip of its pc: the pc itself where the
        frame id was named at it (``exact``), else pc - 1 (a return address). Their other
        fields are the same at every address of a frame id: its module key is the binary and
        the mapped name, its ELF vaddr gives the symbol and the inline levels, and the vaddr's
        segment the ``rel`` (ElfEntry.bias_for: rel - vaddr is the segment's p_offset -
        p_vaddr)."""
        exact = self.nctx.exact
        ips = [f.ip for f in kframes]
        if fixed:
            ubase = tuple(map(self.nctx.plain.__getitem__, ids))
            ips += [pc if exact[i] else pc - 1 for i, pc in zip(ids, pcs, strict=True)]
        else:
            frames = self._frames
            ub: list[Frame] = []
            for i, pc in zip(ids, pcs, strict=True):
                fs = frames[i]
                ub += fs
                ip = pc if exact[i] else pc - 1
                if len(fs) == 1:
                    ips.append(ip)
                else:
                    ips += [ip] * len(fs)
            ubase = tuple(ub)
        base = kframes + ubase if kframes else ubase
        if min(ips, default=0) < 0:  # (no u64 for it: the frames themselves)
            return tuple(map(at_ip, base, ips)), ubase
        return CodeStack(base, array("Q", ips)), ubase

    def flush_counts(self, info: StepInfo | None = None) -> StepInfo:
        """Store the sample counts accumulated since the last flush (``StackStore.add_counts``,
        one call per (bucket, pid, tid, stack) group, not per round) and count them in the
        engine stats; their depths go to ``info`` (samples were counted when the
        rounds added them, their pids as they left the ring). It runs every round, or every
        ``flush_interval`` seconds and on demand (the service calls it before it reads the
        store), and always before the context whose stack ids the groups name is dropped and
        at close. O(groups)."""
        info = info if info is not None else StepInfo()
        self._flushed_at = time.monotonic()
        acc = self._acc
        ng = int(lib.fp_live_groups_len(acc))
        if not ng:
            return info
        gt, gc = ffi.new("uint64_t[]", ng), ffi.new("uint64_t[]", ng)
        gp, gtid, gs = (ffi.new("uint32_t[]", ng) for _ in range(3))
        lib.fp_live_groups_take(acc, gt, gp, gtid, gs, gc)
        es = self.engine.stats
        stack = self._stack
        out: list[StoreGroup] = []
        # the columns as lists, one call each (not a cffi index per field per group)
        cols = (view(gt, "Q", ng).tolist(), view(gp, "I", ng).tolist(),
                view(gtid, "I", ng).tolist(), view(gs, "I", ng).tolist(),
                view(gc, "Q", ng).tolist())  # fmt: skip
        jit_count, by_status, depths = self.engine.jit.count, es.by_status, info.depths
        samples = kframes = uframes = 0
        for t, pid, tid, sid, c in zip(*cols, strict=True):
            fr, comm, status, nu, nk = stack(sid)
            out.append((t, pid, tid, comm, fr, c))
            samples += c
            by_status[status] = by_status.get(status, 0) + c  # (Counter's += costs two calls)
            kframes += nk * c
            uframes += nu * c
            # (a CodeStack's base frames: JIT stats read no ip)
            jit_count(pid, fr.base if isinstance(fr, CodeStack) else fr, c)
            n = nk + nu
            depths[n] = depths.get(n, 0) + c
        es.samples += samples
        es.kernel_frames += kframes
        es.user_frames += uframes
        es.frames = es.kernel_frames + es.user_frames
        self.store.add_counts(out)
        return info

    # -- Python frames

    def _python_frames(self, is_sample: bytes, d: int) -> None:
        """The round's delivered samples whose stack holds interpreter frames get their
        thread's Python frames: the reader thread's read nearest the sample's time
        (pyreader.PythonFrames.nearest), merged into a new stack id that replaces theirs before
        the round's counts are aggregated. A thread seen here for the first time is read from
        now on (``want``): its samples until then keep their native frames, counted ``late``.
        O(samples) in C (a set's look at the round's stack ids) when no delivered record's
        stack id has interpreter frames, the common round; else O(samples) Python."""
        py = self.python
        assert py is not None
        sids = self._stack_ids
        v_ids, v_pids, v_tids, v_times = self._py_views
        ids = v_ids[:d]
        # (side-band records' entries hold stale ids: at worst they send a round the long way)
        if self._eval_sids.isdisjoint(ids):
            return
        pids, tids, times = v_pids[:d], v_tids[:d], v_times[:d]
        evals, stats = self._evals, py.stats
        todo = [k for k in range(d) if is_sample[k] and ids[k] < _PY_BASE and evals[ids[k]]]
        if not todo:  # (side-band, held (_HELD > _PY_BASE) or no interpreter frames)
            return
        # once per (pid, tid) per round, busiest first (the loop's reads have a budget): keep
        # it read, read it now if the reader thread lags, take its reads
        py.begin_round()
        hists: dict[tuple[int, int], tuple[list[int], list[Any]] | str] = {}
        for key, _ in Counter((pids[k], tids[k]) for k in todo).most_common():
            why = py.want(key[0], key[1])
            if why is None:
                py.refresh(key[0], key[1])
            h = py.history(key[0], key[1])  # (kept after an exit: reads from before it)
            hists[key] = h if h[0] or why is None else why
        for k in todo:
            sid = ids[k]
            hist = hists[(pids[k], tids[k])]
            if isinstance(hist, str):
                stats.failures[hist] += 1
                continue
            got = py.nearest(hist, times[k])
            if got is None:
                stats.failures["late"] += 1
                continue
            if isinstance(got, str):
                stats.failures[got] += 1
                continue
            merged = self._merged(sid, got)
            if merged < 0:
                stats.failures["moved"] += 1
                continue
            sids[k] = merged
            stats.named += 1

    def _merged(self, sid: int, segs: object) -> int:
        """The id of stack ``sid`` merged with Python frame segments ``segs`` (interned), or
        -1 when they do not line up (pyframes.merge)."""
        key = (sid, segs)
        if len(self._pymerged) > self.max_stacks:
            self._pymerged.clear()  # failed merges only: merged ones also count in max_stacks
        got = self._pymerged.get(key)
        if got is not None:
            return got
        fr, comm, status, nu, nk = self._stacks[sid]
        assert isinstance(segs, tuple)
        out = merge(frames_of(fr), _is_eval, segs, status == "ok", self.python_beside)
        if out is None:
            self._pymerged[key] = -1
            return -1
        frames = tuple(out)
        self._pystacks.append((frames, comm, status, nu + len(frames) - len(fr), nk))
        got = self._pymerged[key] = _PY_BASE + len(self._pystacks) - 1
        return got

    def _count_late(self, samples: list[UnwoundSample]) -> None:
        """Samples unwound after their round (held for a rescan, deferred for a CFI compile)
        keep their native frames: reading now would name what the thread runs later."""
        assert self.python is not None
        n = sum(1 for s in samples if _eval_frames(s.frames))
        if n:
            self.python.stats.failures["late"] += n


def _is_eval(f: Frame) -> bool:
    return f.sym == EVAL_SYMBOL and not f.kernel


def _eval_frames(frames: tuple[Frame, ...]) -> int:
    """The interpreter's C frames of a stack, 0 when it also holds perf-map trampoline frames
    (``py::`` names, 3.12+ ``-X perf``): those already name the Python functions."""
    n = 0
    for f in frames:
        sym = f.sym
        if sym is not None:
            if sym == EVAL_SYMBOL:
                n += 1
            elif sym.startswith("py::"):
                return 0
    return n
