"""The file driver of the native context: ``unwindd replay --format folded|jsonl|perf-script``
of a perf.data file. It crosses into C once per data section (index), once per file
(ordering) and once per run of samples between two side-band records (unwind + aggregate,
``cffi_build/stacks.c``), and names each unique frame once (context.NativeContext). The
Python replay (streamreplay.py: perfdata -> RecordDecoder -> RoundOrderer -> StackEngine.feed
-> stackfmt, a Python object per record and per sample) is its reference, and replays what it
does not take.

Invariants:
- Same output and same counts as the Python replay (test_filereplay.py compares them byte for
  byte; ``_Replay.run`` says how).
- Side-band records that cannot change the process table, or change only what no sample
  reads (the processes and threads no later sample depends on, ``_skip_unsampled``; data
  MMAP2s over nothing, ``_skip_noop_mmaps``), are counted where the Python replay counts them
  (decode, stream and process table counts), never decoded or applied. What they would have
  changed, no sample reads: each sample meets the mappings and comm it meets in the Python
  replay. Runs of samples merge where only such records separated them (fewer runs,
  ``EngineStats.batches``).
- ``Unsupported`` is raised before any state changes, for inputs the native path does not take
  (pipe mode, attrs whose SAMPLE layouts differ, no TID/TIME in samples, synthesized
  HEADER_ATTR records, record types > 255): the caller then runs the Python replay.
- Memory: the file is mapped, never copied; per record 56 bytes of index plus 4 of order; per
  unique stack its key words and its rendering (``_Replay``).

Cost: O(records) native work plus O(side-band records some sample depends on + unique frames
+ runs) Python work for folded output; jsonl/perf-script add O(unique stacks) and one string format
per sample, frames being named once per binary code address (not per process running it) and
shown at each other address by a string join (jsonl) or as named (perf-script's rel).
"""

from __future__ import annotations

import gc
import os
import struct
import sys
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable
from typing import Any, TextIO

from ..binaries.symtab import SymbolTable
from ..lightdc import dataclass
from ..procs.mapping import PROT_EXEC, Mapping
from ..source.abi import (
    MISC_CPUMODE_MASK,
    MISC_GUEST_USER,
    MISC_USER,
    RecordType,
    SampleType,
)
from ..source.mapfile import MappedFile, RecordIndex, Unsupported, native_layout
from ..source.ordering import OrderStats
from ..source.perfdata import PerfData
from ..source.records import Comm, FinishedRound, Fork, Mmap2, Record, record_type_name
from ..source.streamstats import StreamStats
from ..unwcore import check, count, ffi, lib
from ..unwind.engine import StackEngine
from ..unwind.stackfmt import STATUS_CALLCHAIN, STATUS_IP_ONLY, Frame, at_ip
from .context import (
    END_ERRORS,
    STATUS_NAMES,
    NativeContext,
    callchain,
    count_flagged,
    jit_parts,
    mark_record,
    record_marks,
    view,
)
from .replaytext import emitter, ip_only_text, render_frame, render_frames, write_folded

__all__ = ["FastResult", "Unsupported", "replay"]

_NO_STOP = (1 << 64) - 1
_REC_SIZE = ffi.sizeof("struct fp_rec")
_REC_TYPE = ffi.offsetof("struct fp_rec", "type")
# the byte of fp_rec.misc (u16, host order) that holds its low bits, the cpumode
_REC_MISC = ffi.offsetof("struct fp_rec", "misc") + (sys.byteorder == "big")
_HEADER_ATTR = bytes([RecordType.HEADER_ATTR])
# bytes.translate tables: a record type byte -> 1 for SAMPLE; a misc low byte -> 1 unless its
# cpumode is user or guest user
_IS_SAMPLE = bytes(int(t == RecordType.SAMPLE) for t in range(256))
_NOT_USER = bytes(int(m & MISC_CPUMODE_MASK not in (MISC_USER, MISC_GUEST_USER))
                  for m in range(256))  # fmt: skip
_CALLCHAIN = int(SampleType.CALLCHAIN)
_T_FINISHED_ROUND = int(RecordType.FINISHED_ROUND)
_T_MMAP2 = int(RecordType.MMAP2)
_FINISHED_ROUND_NAME = record_type_name(FinishedRound())
# fp_ctx_par's min_run for new contexts; None: the C default (fastpath_int.h PAR_MIN). Tests set 1
# (unwind every run with the worker thread) or 0 (one thread) to compare the two.
PAR_MIN: int | None = None
# Tests: the worker made to take blocks (fp_ctx_par_stress), so the threaded path surely runs.
PAR_STRESS = False
# Tests: False applies the side-band records ``_skip_unsampled`` (``_skip_noop_mmaps``) would
# drop, to compare.
SKIP_UNSAMPLED = True
SKIP_NOOP_MMAPS = True
# unw_sb_unsampled's counts -> what ProcessTable.apply counts each as (a plain COMM: nothing)
_TABLE_COUNTS = (("MMAP2", lib.UNW_SB_MMAP2), ("MMAP", lib.UNW_SB_MMAP), ("FORK", lib.UNW_SB_FORK),
                 ("EXIT", lib.UNW_SB_EXIT), ("EXEC", lib.UNW_SB_EXEC))  # fmt: skip


_MMAP2_HEAD = struct.Struct("<IIQQ")  # pid, tid, addr, len
_U32 = struct.Struct("<I")


def _start(m: Mapping) -> int:
    return m.start


def _kernel_samples(types: bytes, rows: memoryview) -> bool:
    """Whether any SAMPLE of the index (``rows``, its records' ``types``) was taken outside
    user mode: three C-speed passes, no object per record."""
    is_sample = types.translate(_IS_SAMPLE)
    not_user = rows[_REC_MISC::_REC_SIZE].tobytes().translate(_NOT_USER)
    return int.from_bytes(is_sample, "little") & int.from_bytes(not_user, "little") != 0


@dataclass
class FastResult:
    """What one native replay did: samples, unique stacks, runs, side-band records met."""

    samples: int
    unique_stacks: int
    runs: int
    side_band: int
    worker_samples: int = 0  # unwound by the parallel unwind's worker thread
    unsampled: int = 0  # side-band records no sample depends on: counted, never applied
    noop_mmaps: int = 0  # data MMAP2s over nothing of their pid's space: counted, never applied


def replay(
    data: PerfData,
    path: str | os.PathLike[str],
    fmt: str,
    out: TextIO,
    *,
    engine: StackEngine | None = None,
    stream_stats: StreamStats | None = None,
    order_stats: OrderStats | None = None,
    max_queued: int = 1_000_000,
    mapped: MappedFile | None = None,
) -> FastResult:
    """Replay ``data`` (opened from ``path``) to ``out`` in ``fmt`` (folded, jsonl or
    perf-script); counts go to ``data``'s decoder and errors, ``stream_stats``, ``order_stats``
    and ``engine.stats``. Raises ``Unsupported`` (nothing done yet) when the Python replay must.
    ``mapped``: ``path`` already mapped (the CLI maps it before its imports, its page tables
    filling meanwhile); the replay closes it, whatever happens."""
    gc_was_on = gc.isenabled()
    try:
        if fmt not in ("folded", "jsonl", "perf-script"):
            raise Unsupported(f"format {fmt}")
        lay = native_layout(data)
        # The page tables filled first (mapfile.c): the replay reads every page (headers, then
        # stack copies), and faulting them in as one batch costs less than taking a fault or
        # two per record. A mapping from the caller may still be filling: waited for.
        if mapped is None:
            try:
                mapped = MappedFile(path)
            except ValueError:
                raise Unsupported("empty file") from None
            mapped.prefault()
        else:
            mapped.wait()
        # No cyclic GC while replaying: what a replay allocates (names, stacks, snapshots, ELF
        # entries) lives until it ends, so the collections its allocation counts trigger only
        # traverse live objects, O(objects) each for nothing; its cyclic garbage (exceptions
        # caught on error paths) waits at most until it returns.
        gc.disable()
        return _Replay(data, mapped, lay, fmt, out, engine, stream_stats, order_stats,
                       max_queued).run()  # fmt: skip
    finally:
        if gc_was_on:
            gc.enable()
        # unmapped on a thread (the run did so already unless an exception came first), not
        # waited for: nothing reads it any more, and the caller has output to finish (munmap
        # is O(pages)); a view still exported (an exception unwinding): GC unmaps
        if mapped is not None:
            mapped.close(background=True)


class _Replay:
    """One replay of one mapped file.

    Memory: the file is mmap'd read-only (``mapfile.MappedFile``, possibly mapped, filled and
    indexed by the CLI before this module is imported); stacks are read in place. Per record
    56 bytes of index plus 4 of order; per unique stack its key words and its rendered frames.
    Folded output aggregates by function (``fp_ctx_by_code(ctx, 2)``: a frame is its binary
    and the symbol region of its ELF vaddr in the table ``frame_at`` names it from, handed to
    C once per binary; stacks without their address space), so N processes running the same
    code cost what one does, and the addresses of one function are one frame. A snapshot is
    held only while a pid uses it in C or its frames are unnamed; MMAP2 records that decode
    cleanly are counted in bulk and decoded once, when applied (``_lazy_mmaps``): a replay
    holds their bytes, not objects, between ordering and applying them."""

    def __init__(
        self,
        data: PerfData,
        mapped: MappedFile,
        lay: Any,
        fmt: str,
        out: TextIO,
        engine: StackEngine | None,
        stream_stats: StreamStats | None,
        order_stats: OrderStats | None,
        max_queued: int,
    ) -> None:
        self.data = data
        self.lay = lay
        self.fmt = fmt
        self.out = out
        self.engine = engine or StackEngine.create()
        if not lay.regs_mask:
            # no stack copies to unwind: every stack is a recorded callchain or a lone ip, which
            # are never expanded (engine.expand), so no line table is wanted; and folded's frame
            # ids by code would be shared by stacks of every kind (the native path takes only
            # files whose events all lay samples out alike: never a mix)
            self.engine.srclines = None
        self.sstats = stream_stats if stream_stats is not None else StreamStats()
        self.ostats = order_stats if order_stats is not None else OrderStats()
        self.max_queued = max_queued
        mm = mapped.mm
        start = min(data.data_offset, len(mm))
        self.length = min(data.data_size, len(mm) - start)
        self._whole = ffi.from_buffer(mm)
        self.buf = self._whole + start
        self.mm = mm
        self.mapped = mapped
        self.start = start
        # Folded output prints no addresses, only function names: aggregate frames and stacks
        # by function (binary, symbol), so the same code run by many processes, and every
        # address of one function, is named and stored once (fp_ctx_by_code, on = 2).
        # With inline chains, by code address (on = 1): the chain depends on the address, not
        # only on the function.
        self.by_code = fmt == "folded"
        mode = (1 if self.engine.srclines is not None else 2) if self.by_code else 0
        # jsonl/perf-script print addresses, so stacks stay by address space, but a frame is
        # named once per binary code address (fp_ctx_code_frames), not once per process
        # running it: a frame id's text at another address of it is ``_moved``'s. (The live
        # step may not do this while a binary's line table is still pending, ringstep.py; a
        # replay reads every table before it names a frame: srclines.SrcLineCache without a
        # worker.)
        self.code_frames = not self.by_code
        self.nctx = NativeContext(self.engine, by_code=mode, code_frames=self.code_frames,
                                  par_min=PAR_MIN, par_stress=PAR_STRESS)  # fmt: skip
        self.ctx = self.nctx.ctx
        # by function: the symbol tables whose arrays C searches, by module key (held here:
        # the ELF cache may drop an entry, and its table, while C still points at them)
        self._symtabs: dict[int, SymbolTable] = {}
        # jsonl/perf-script, per unique stack: (comm, status, user frame count, kernel frame
        # count) and its rendering. Folded keeps nothing per stack here: its counts and text
        # come from C at the end (fold.c), kernel frames then named once per ip, so the
        # kallsyms load (Symbolizer.preload_kernel) overlaps the whole unwind.
        self._stacks: list[tuple[str, str, int, int]] = []
        self._rendered: list[str] = []
        # Per distinct user frame (fp_frame id: by code, one per binary code address or, for
        # folded, function; JIT and unmapped code per (address space, pc)): its rendering in
        # self.fmt at the address it was named at, interned, so that memory grows with
        # distinct texts, not with processes; the Frame itself is kept only where its text
        # holds its address (``_frames``).
        self._frame_text: list[str] = []
        self._texts: dict[str, str] = {}
        # jsonl/perf-script, per frame id: the absolute ip it was named at (an ip_only stack
        # prints it, not rel), and whether its text holds that ip (jsonl's "ip", or a frame
        # without rel in perf-script's address column): at another ip it is ``_moved``'s
        self._frame_ip: list[int] = []
        self._frame_moves = bytearray()
        self._frames: list[tuple[Frame, ...]] = []  # per frame id that moves: its frames
        # (frame id, ip, unexpanded) -> the id's text at that ip, made once (``_moved``)
        self._moved_text: dict[tuple[int, int, bool], str] = {}
        self._tails: dict[tuple[int, bool], tuple[str, ...] | None] = {}  # (``_json_tails``)
        self._frame_n: list[int] = []  # per frame id: the frames it stands for (inline chain)
        self._frame_plain: list[str] = []  # per frame id: its text unexpanded (with srclines)
        # kernel callchain (raw u64s) -> its frames' renderings in self.fmt, leaf first; bounded
        # by the distinct callchains of the file
        self._ktext: dict[bytes, list[str]] = {}
        self._kframe_text: dict[Frame, str] = {}
        self._run_out = (ffi.new("uint64_t *"), ffi.new("uint32_t *"), ffi.new("uint32_t *"))
        self.runs = 0
        # whether ``_runs`` asks the table if a data MMAP2 would change it (``_raw_noop``):
        # not once ``_skip_noop_mmaps`` dropped every such record in C
        self.check_noops = True

    # -- the whole file

    def run(self) -> FastResult:
        """The whole file, with the Python replay's answer and counts: the same records decoded
        (non-SAMPLE records and SAMPLEs that fail to decode go through
        ``RecordDecoder.decode_one`` itself; MMAP2s that decode cleanly through
        ``decode_quiet`` when applied, their counts taken in bulk), the same delivery order
        (fp_order is ``RoundOrderer.feed_file_order``), side-band records applied to the
        process table in that order between runs, each sample unwound against its pid's
        snapshot of that moment (a pid's native space is dropped on the C side whenever a
        record of that pid is applied, and re-taken from ``StackEngine.snapshot`` at its
        next sample), the comm of that moment (all comm ids are dropped at each COMM), and
        the engine's own ``user_frames``/``kernel_frames`` for names. The same counts:
        ``DecodeStats`` (records by type, errors), ``PerfData.errors``, ``StreamStats``,
        ``OrderStats`` and the engine's per-status sample and frame counts
        (``EngineStats.batches`` counts native runs here; ``unsymbolized`` matches while
        fewer than ``sym_cache_size`` unique stacks exist, as the Python replay
        re-symbolizes after clearing its cache)."""
        idx = self.mapped.take_index(self.lay, self.start, self.length)
        if idx is None:
            idx = RecordIndex(self.lay, self.buf, self.length)
        if idx.stopped_at != _NO_STOP:
            raise Unsupported(f"record type > 255 at data offset {idx.stopped_at}")
        n, recs = idx.n, idx.recs
        others = ffi.new("uint32_t[]", max(1, idx.other))
        nother = int(lib.fp_select_other(recs, n, others))
        # every record's type and misc (low byte) sliced out of the index at C speed, not read
        # as cdata record by record
        rows = memoryview(ffi.buffer(recs, n * _REC_SIZE)) if n else memoryview(b"")
        types = rows[_REC_TYPE::_REC_SIZE].tobytes()
        if _HEADER_ATTR in types:  # (a SAMPLE never is one)
            raise Unsupported("HEADER_ATTR in the data section")
        if self.lay.sample_type & _CALLCHAIN and _kernel_samples(types, rows):
            # kallsyms read and parsed on a thread, overlapping the runs, only when a sample
            # was taken outside user mode: the kernel chains kernel frames only for a sample
            # taken in the kernel (kernel/events/callchain.c get_perf_callchain). A kernel ip
            # met all the same is named through a load on first use (Symbolizer.kernel).
            self.engine.symbolizer.preload_kernel()
        cand, cand_pids, ncand, nrest = self._scan_data_mmaps(recs, n, others, nother)
        nrest = self._lazy_mmaps(recs, others, nrest)
        nrest = self._lazy_exits(recs, others, nrest)
        mv = memoryview(self.mm)
        objs = self._decode_others(mv, recs, others, nrest)
        dec = self.data.decoder
        nsamples = n - nother
        if nsamples:
            dec.stats.records["SAMPLE"] += nsamples
        if idx.end == lib.FP_END_PAYLOAD_TRUNCATED:
            self.data.errors["payload_truncated"] += 1
        elif idx.end in END_ERRORS:
            dec.stats.errors[END_ERRORS[idx.end]] += 1
        perm, m = self._order(recs, n)
        skipped = 0
        if ncand:
            m, skipped = self._skip_data_mmaps(recs, perm, m, cand, cand_pids, ncand)
        m, unsampled = self._skip_unsampled(recs, perm, m)
        m, noops = self._skip_noop_mmaps(recs, perm, m)

        # -- columns of the delivered stream, stream counts
        ctypes = ("uint8_t", "uint64_t", "uint64_t", "uint32_t", "uint32_t", "uint32_t")
        cols = [ffi.new(f"{t}[]", max(1, m)) for t in ctypes]
        lib.fp_columns(recs, perm, m, *cols)
        is_sample = bytes(ffi.buffer(cols[0], m))
        times, periods = view(cols[1], "Q")[:m], view(cols[2], "Q")[:m]
        pids, tids, cpus = view(cols[3], "I")[:m], view(cols[4], "I")[:m], view(cols[5], "I")[:m]
        has_cpu = self.lay.i_cpu >= 0
        self._stream_stats(objs, is_sample, pids, cpus if has_cpu else None, nsamples)

        # -- runs of samples between side-band records, in delivered order
        stack_ids = ffi.new("uint32_t[]", max(1, m))
        has_period = self.lay.i_period >= 0
        emit = emitter(self.fmt, self.out.write, self._stacks, self._rendered,
                       (times, periods if has_period else None, pids, tids,
                        cpus if has_cpu else None), view(stack_ids, "I"))  # fmt: skip
        side = self._runs(mv, recs, perm, is_sample, stack_ids, objs, emit)
        # Nothing reads the file any more (names, counts and output come from the context):
        # unmapped on a thread while the output is built (munmap is O(pages)).
        mv.release()
        ffi.release(self._whole)
        self.buf = ffi.NULL
        self.mapped.close(background=True)
        self._finish()
        return FastResult(nsamples, self.nctx.nstacks, self.runs,
                          side + skipped + unsampled + noops, int(lib.fp_ctx_par_stats(self.ctx)),
                          unsampled, noops)  # fmt: skip

    def _scan_data_mmaps(self, recs: Any, n: int, others: Any, nother: int
                         ) -> tuple[Any, Any, int, int]:  # fmt: skip
        """Data MMAP2 records that cannot change the process table (sideband.c): their index
        entries get time/cpu natively and they are never decoded into objects. Data
        (non-exec) MMAP2s overlapping no executable range of the file, after their pid's
        first (sideband.c states the proof), are only counted where the Python replay counts
        them (_skip_data_mmaps); so are data MMAP2s over nothing the pid's space maps
        (_data_mmap_is_noop). Deep CPython recursion makes them by the hundred thousand.
        Returns (candidate flags and pids by record, their number, the others left in
        ``others[0, nrest)``)."""
        cand = ffi.new("uint8_t[]", max(1, n))
        cand_pids = ffi.new("uint32_t[]", max(1, n))
        ncand, nrest = 0, nother
        trailer = self.data.decoder.sample_id_trailer()
        if trailer is not None and nother:
            p_rest = ffi.new("uint64_t *")
            ncand = check(lib.unw_sb_scan(self.buf, self.length, recs, others, nother, *trailer,
                                          cand, cand_pids, p_rest), "unw_sb_scan")  # fmt: skip
            nrest = int(p_rest[0])
        return cand, cand_pids, ncand, nrest

    def _lazy_mmaps(self, recs: Any, others: Any, nother: int) -> int:
        """The MMAP2 records among ``others[0, nother)`` that decode without error or repair
        (sideband.c ``unw_sb_lazy``; many per process): their index entries marked natively
        and their counts taken in bulk here (decode_one's and StreamStats.observe's: a MMAP2
        counts by type and cpu only); each is decoded once, when applied (``_record``), and
        not at all when it cannot change the table (``_raw_noop``). The others left, in
        ``others[0, result)``."""
        return self._lazy("MMAP2", "unw_sb_lazy", recs, others, nother)

    def _lazy_exits(self, recs: Any, others: Any, nother: int) -> int:
        """The EXIT records among ``others[0, nother)`` that decode without error (sideband.c
        ``unw_sb_lazy_exits``): their index entries marked natively and their counts taken in
        bulk, as ``_lazy_mmaps`` does for MMAP2s (an EXIT counts by type and cpu only). The
        replay drops them all (``_skip_unsampled``: an EXIT changes nothing a sample reads),
        so they are never decoded unless it skips nothing (``_record``). The others left, in
        ``others[0, result)``."""
        return self._lazy("EXIT", "unw_sb_lazy_exits", recs, others, nother)

    def _lazy(self, name: str, fn: str, recs: Any, others: Any, nother: int) -> int:
        """``_lazy_mmaps``/``_lazy_exits``: the records of type ``name`` C function ``fn``
        lists among ``others[0, nother)`` counted; the others left, in ``others[0, result)``."""
        trailer = self.data.decoder.sample_id_trailer()
        if trailer is None or not nother:
            return nother
        lazy = ffi.new("uint32_t[]", nother)
        p_rest = ffi.new("uint64_t *")
        k = check(getattr(lib, fn)(self.buf, self.length, recs, others, nother, *trailer, lazy,
                                   p_rest), fn)  # fmt: skip
        if k:
            self._count_listed(name, recs, lazy, k, trailer[2] >= 0)
        return int(p_rest[0])

    def _count_listed(self, name: str, recs: Any, listed: Any, k: int, has_cpu: bool) -> None:
        """``_count_plain`` of the ``k`` records of type ``name`` whose indices are
        ``listed``, their cpus read from their index entries (fp_columns)."""
        cols = [ffi.new("uint8_t[]", k), ffi.new("uint64_t[]", k), ffi.new("uint64_t[]", k),
                *(ffi.new("uint32_t[]", k) for _ in range(3))]  # fmt: skip
        lib.fp_columns(recs, listed, k, *cols)
        self._count_plain(name, k, view(cols[5], "I", k) if has_cpu else None)

    def _count_plain(self, name: str, k: int, cpus: memoryview | None) -> None:
        """decode_one's and StreamStats.observe's counts of ``k`` records of type ``name``
        (MMAP2, EXIT: counted by type and cpu only) decoded without error (of these cpus;
        None: their trailer carries none)."""
        self.data.decoder.stats.records[name] += k
        observe_plain = self.sstats.observe_plain
        if cpus is None:
            observe_plain(name, None, k)
            return
        for cpu, c in count_flagged(b"\x01" * k, cpus):
            observe_plain(name, cpu, c)

    def _decode_others(self, mv: memoryview, recs: Any, others: Any, nrest: int
                       ) -> dict[int, Record]:  # fmt: skip
        """Decode what is not a good SAMPLE, exactly as PerfData.records() does, and mark
        each index entry for the orderer. (MMAP2 records that decode cleanly, most of them,
        are not here: ``_lazy_mmaps``.) The records by index."""
        data, dec, sstats = self.data, self.data.decoder, self.sstats
        objs: dict[int, Record] = {}
        rounds = 0
        marker = int(lib.FP_MARKER)
        for i in others[0:nrest]:
            r = recs[i]
            if r.type == _T_FINISHED_ROUND:
                # decode_one makes a FinishedRound of any body, never an error, and nothing
                # but its counts follows from it (PerfData.user_record ignores its type): one
                # a round, counted below in bulk instead of decoded one by one
                r.flags = marker
                rounds += 1
                continue
            off = self.start + r.off
            rtype, misc, body = r.type, r.misc, mv[off + 8 : off + r.size]
            if rtype >= RecordType.HEADER_ATTR:
                data.user_record(rtype, misc, body)
            rec = objs[i] = dec.decode_one(rtype, misc, body)
            mark_record(r, record_marks(rec))
            # (a view left bound after the loop would keep the mapping exported, and its
            # unmap after the runs would fail: mmap.close refuses while views exist)
            del body
        if rounds:
            name = _FINISHED_ROUND_NAME  # what decode_one and StreamStats.observe count
            dec.stats.records[name] += rounds
            sstats.by_type[name] += rounds
            sstats.by_cpu_type.setdefault(None, Counter())[name] += rounds  # (no cpu)
        return objs

    def _order(self, recs: Any, n: int) -> tuple[Any, int]:
        """The file's records in delivery order (fp_order is RoundOrderer.feed_file_order):
        the permutation and its length."""
        perm = ffi.new("uint32_t[]", max(1, n))
        late = ffi.new("uint64_t[]", max(1, n))
        nout, nlate = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        ost = ffi.new("struct fp_order_stats *")
        check(lib.fp_order(recs, n, self.max_queued, perm, nout, late, nlate, ost), "fp_order")
        self.ostats.add_native(ost, late[0 : int(nlate[0])])
        return perm, int(nout[0])

    def _runs(self, mv: memoryview, recs: Any, perm: Any, is_sample: bytes, stack_ids: Any,
              objs: dict[int, Record], emit: Callable[[int, int], None]) -> int:  # fmt: skip
        """The delivered records in order: each run of samples unwound and written, each
        side-band record between them applied to the process table (a data MMAP2 that cannot
        change it only counted); the side-band records met."""
        engine, nctx, m = self.engine, self.nctx, len(is_sample)
        apply = engine.apply_side_band
        check = self.check_noops  # (else unw_sb_noop_mmaps dropped every one already)
        pos = side = 0
        while pos < m:
            p = is_sample.find(b"\0", pos)
            end = m if p < 0 else p
            if end > pos:
                self._run(recs, perm, pos, end, stack_ids)
                emit(pos, end)
            if p < 0:
                break
            i = perm[p]
            side += 1
            pos = p + 1
            rec = objs.pop(i, None)
            if rec is None:  # a MMAP2 or EXIT counted in bulk, not decoded yet
                if check and recs[i].type == _T_MMAP2 and self._raw_noop(recs[i]):
                    engine.table.stats.records["MMAP2"] += 1  # what apply() would have counted
                    continue
                rec = self._record(mv, recs, i)
            elif check and type(rec) is Mmap2 and self._data_mmap_is_noop(rec):
                engine.table.stats.records["MMAP2"] += 1
                continue
            apply(rec)  # (StackEngine.feed's handling, as the live step's; MMAP2s undispatched)
            t = type(rec)
            if t is Comm or t is Fork:
                nctx.forget_comms()  # COMM renames; FORK names a new task after its parent
            rpid = getattr(rec, "pid", None)
            if isinstance(rpid, int):
                nctx.forget_space(rpid)
        return side

    def _skip_data_mmaps(
        self, recs: Any, perm: Any, m: int, cand: Any, pids: Any, ncand: int
    ) -> tuple[int, int]:  # fmt: skip
        """Drop the scan's candidates from the delivered order, except each pid's first (it
        may create the pid's space: decoded again and applied like any record). Counts the dropped
        ones where decode_one, StreamStats.observe and ProcessTable.apply would have.
        Returns (new length of perm, records dropped)."""
        kept = ffi.new("uint32_t[]", ncand)
        nkept = ffi.new("uint64_t *")
        cpus = ffi.new("uint32_t[]", ncand)
        new_m = count(lib.unw_sb_compact(perm, m, cand, pids, ncand, recs, kept, nkept, cpus),
                      "unw_sb_compact")  # fmt: skip
        dec = self.data.decoder
        nk = int(nkept[0])
        if nk:  # (marked by the scan, decoded when applied: decode_one's counts in bulk)
            kcpus = ffi.new("uint32_t[]", [recs[i].cpu for i in kept[0:nk]])
            trailer = dec.sample_id_trailer()
            has_cpu = trailer is not None and trailer[2] >= 0
            self._count_plain("MMAP2", nk, view(kcpus, "I", nk) if has_cpu else None)
        skipped = m - new_m
        if skipped:
            dec.stats.records["MMAP2"] += skipped
            self.engine.table.stats.records["MMAP2"] += skipped
            s = self.sstats
            s.by_type["MMAP2"] += skipped
            trailer = dec.sample_id_trailer()
            if trailer is not None and trailer[2] >= 0:  # the trailer carries the cpu
                for cpu, c in Counter(view(cpus, "I")[:skipped]).items():
                    s.by_cpu_type.setdefault(cpu, Counter())["MMAP2"] += c
            else:
                s.by_cpu_type.setdefault(None, Counter())["MMAP2"] += skipped
        return new_m, skipped

    def _skip_unsampled(self, recs: Any, perm: Any, m: int) -> tuple[int, int]:
        """Drop from the delivered order the side-band records no sample's address space or
        comm depends on (sideband.c ``unw_sb_unsampled``: the records of processes and threads
        no later sample reads, through FORK ancestry, and every EXIT; most of a churning
        machine's processes are never sampled). Their decode and stream counts were taken
        already; what ``ProcessTable.apply`` would have counted for them is counted here in
        bulk. Returns (new length of perm, records dropped)."""
        trailer = self.data.decoder.sample_id_trailer()
        if not SKIP_UNSAMPLED or trailer is None or not m:
            return m, 0
        counts = ffi.new("uint64_t[]", lib.UNW_SB_NCOUNTS)
        new_m = check(lib.unw_sb_unsampled(self.buf, self.length, recs, perm, m, trailer[0],
                                           counts), "unw_sb_unsampled")  # fmt: skip
        table = self.engine.table.stats.records
        for name, k in _TABLE_COUNTS:
            if counts[k]:
                table[name] += counts[k]
        return new_m, m - new_m

    def _skip_noop_mmaps(self, recs: Any, perm: Any, m: int) -> tuple[int, int]:
        """Drop from the delivered order the data MMAP2s that find their pid's space there and
        overlapping none of its mappings (sideband.c ``unw_sb_noop_mmaps`` follows each pid's
        executable ranges through the records left to apply): what ``_raw_noop`` would find,
        found in C. Counted where ``ProcessTable.apply`` would have counted them. Returns (new
        length of perm, records dropped)."""
        trailer = self.data.decoder.sample_id_trailer()
        if not SKIP_NOOP_MMAPS or trailer is None or not m:
            return m, 0
        rc = lib.unw_sb_noop_mmaps(self.buf, self.length, recs, perm, m, trailer[0])
        if rc == lib.UNW_SB_UNTOUCHED:
            return m, 0  # (a file mapping a jitdump: the table is asked, run by run, as before)
        new_m = check(rc, "unw_sb_noop_mmaps")
        self.check_noops = False
        if new_m < m:
            self.engine.table.stats.records["MMAP2"] += m - new_m
        return new_m, m - new_m

    def _record(self, mv: memoryview, recs: Any, i: int) -> Record:
        """Record i (a MMAP2 or EXIT counted in bulk before ordering, ``_lazy_mmaps``,
        ``_lazy_exits``) decoded, once, nothing counted."""
        r = recs[i]
        off = self.start + r.off
        body = mv[off + 8 : off + r.size]  # (``mv``: the mapping, released after the runs)
        return self.data.decoder.decode_quiet(r.type, r.misc, body)

    def _raw_noop(self, r: Any) -> bool:
        """``_data_mmap_is_noop`` of a MMAP2 not decoded yet (``_lazy_mmaps`` checked its
        body holds the fixed part), read from its bytes: pid, addr, len at body offsets 0, 8,
        16 and prot at 56 (perf_event.h)."""
        off = self.start + r.off + 8
        pid, _, start, length = _MMAP2_HEAD.unpack_from(self.mm, off)
        if _U32.unpack_from(self.mm, off + 56)[0] & PROT_EXEC or length <= 0:
            return False
        sp = self.engine.table.get(pid)
        if sp is None:
            return False  # apply() would create the space
        maps = sp.mappings
        end = start + length
        k = bisect_left(maps, end, key=_start) - 1  # the last mapping starting below end
        return k < 0 or maps[k].end <= start

    def _data_mmap_is_noop(self, rec: Mmap2) -> bool:
        """True if applying ``rec`` cannot change the process table: a non-executable
        mapping (never inserted, proctable.add_mapping) of a pid that already has a space,
        overlapping none of its mappings (so it cuts nothing). CPython's frame-chunk mmaps
        are such records, by the hundred thousand in deep-recursion profiles; the table's own
        path costs O(mappings) Python per record, this O(log mappings)."""
        if rec.prot & PROT_EXEC or rec.length <= 0:
            return False
        sp = self.engine.table.get(rec.pid)
        if sp is None:
            return False  # apply() would create the space
        maps = sp.mappings
        end = rec.start + rec.length
        i = bisect_left(maps, end, key=_start) - 1  # the last mapping starting below end
        return i < 0 or maps[i].end <= rec.start

    # -- stats

    def _stream_stats(
        self,
        objs: dict[int, Record],
        is_sample: bytes,
        pids: memoryview,
        cpus: memoryview | None,
        nsamples: int,
    ) -> None:
        s = self.sstats
        for rec in objs.values():
            s.observe(rec)
        if not nsamples:
            return
        s.by_type["SAMPLE"] += nsamples
        # the samples' pids (cpus), counted in C in first-seen order (what Counter over them
        # gives, without an int object per record)
        for pid, c in count_flagged(is_sample, pids):
            s.samples_by_pid[pid] += c
        if cpus is None:
            per = s.by_cpu_type.setdefault(None, Counter())
            per["SAMPLE"] += nsamples
            return
        for cpu, c in count_flagged(is_sample, cpus):
            s.by_cpu_type.setdefault(cpu, Counter())["SAMPLE"] += c

    # -- native runs

    def _run(self, recs: Any, perm: Any, a: int, b: int, stack_ids: Any) -> None:
        """``_run_part`` over perm[a, b) cut where a jitdump replaced code (its boundaries,
        ``StackEngine.jit_time``): the frames of each part are named as of its newest
        sample, so a pc whose code was replaced is named as the code it ran."""
        for k, m in jit_parts(self.nctx, recs, perm, a, b):
            self._run_part(recs, perm, k, m, stack_ids)

    def _run_part(self, recs: Any, perm: Any, a: int, b: int, stack_ids: Any) -> None:
        """Unwind the samples perm[a, b), a run between two side-band records, answering
        the run's stops (space, comm, symbols). A long run's samples are unwound by the
        calling thread and a worker thread the C context owns while the machine has a CPU to
        spare (``fp_ctx_par``; the stacks are interned in sample order, so the output does
        not depend on it)."""
        stopped, need_pid, need_tid = self._run_out
        k = a
        while True:
            self.runs += 1
            rc = lib.fp_unwind_run(self.ctx, self.lay, self.buf, self.length, recs, perm, k, b,
                                   stack_ids, stopped, need_pid, need_tid)  # fmt: skip
            if rc == lib.FP_RUN_DONE:
                break
            k = int(stopped[0])
            if rc == lib.FP_RUN_NEED_SPACE:
                pid = int(need_pid[0])
                self.nctx.set_space(pid, self.engine.snapshot(pid))
            elif rc == lib.FP_RUN_NEED_SYMS:
                self._set_symbols(int(need_pid[0]), int(need_tid[0]))
            elif rc == lib.FP_RUN_NEED_COMM:
                self.nctx.set_comm(int(need_pid[0]), int(need_tid[0]))
            else:
                raise RuntimeError(f"fp_unwind_run failed at {k} ({rc})")
        # JIT frames are named as of the run's newest sample (the frames are new in the run)
        self.engine.name_time = int(recs[perm[b - 1]].time) if b > a else None
        self._symbolize_new()

    def _set_symbols(self, pid: int, index: int) -> None:
        """By function: give C the symbol table of module ``index`` of ``pid``'s space, the
        table ``frame_at`` names that module's frames from (``Symbolizer.table`` of the
        mapping's entry): once per module key."""
        snap = self.nctx.snapshot_of(pid)
        mod = snap.native.modules[index]
        m = snap.find(mod.start)
        if m is None or m.entry is None or mod.key in self._symtabs:
            raise RuntimeError(f"fp_unwind_run asked for module {index} of pid {pid}")
        table = self.engine.symbolizer.table(m.entry)
        self._symtabs[mod.key] = table
        n = len(table.starts)
        starts = ffi.from_buffer("uint64_t[]", table.starts) if n else ffi.NULL
        ends = ffi.from_buffer("uint64_t[]", table.ends) if n else ffi.NULL
        check(lib.fp_set_symbols(self.ctx, mod.key, starts, ends, n), "fp_set_symbols")

    def _symbolize_new(self) -> None:
        """Name the stacks the last run added, now: the ELF cache and process table are in the
        state the Python replay would symbolize them in (before the next side-band record). Each
        distinct user frame (fp_frame; for folded output one per binary code address, see
        fp_ctx_by_code) is named once (``NativeContext.new_frames``) and rendered once, so a
        stack costs one list lookup per frame."""
        text, texts, fmt = self._frame_text, self._texts, self.fmt
        for fs in self.nctx.new_frames():
            if len(fs) == 1:
                t = render_frame(fmt, fs[0])
            else:  # an inline chain (engine.inline_frames), innermost first: its frames' text
                t = render_frames(fmt, fs)
            text.append(texts.setdefault(t, t))
            self._frame_n.append(len(fs))
            if self.code_frames:
                self._frame_ip.append(fs[0].ip)
                # perf-script prints rel, the same at every address of the code, where a
                # frame has one (stackfmt.perf_script); jsonl prints the ip itself
                moves = fmt == "jsonl" or any(f.rel is None for f in fs)
                self._frame_moves.append(moves)
                self._frames.append(fs if moves else ())
        if self.engine.srclines is not None:
            # the frames unexpanded: how stacks of recorded callchains and lone ips show them
            plain, first = self.nctx.plain, len(self._frame_plain)
            self._frame_plain += [render_frame(fmt, f) for f in plain[first:]]
        if self.by_code:
            self.nctx.count_code_stacks()
        else:
            self._add_stacks()
        self.nctx.release_snapshots()

    def _add_stacks(self) -> None:
        """The new stacks: their kernel frames (rendered once per callchain), their unnamed
        frames counted, their rendering in self.fmt."""
        engine, nctx, fmt = self.engine, self.nctx, self.fmt
        ktexts = self._ktext
        stacks, rendered = self._stacks, self._rendered
        texts = self._frame_text
        plains = self._frame_plain if engine.srclines is not None else texts
        fip, moves, exact, moved = self._frame_ip, self._frame_moves, nctx.exact, self._moved
        for comm, space, code, regs_none, ids, kkey, pcs in nctx.new_stacks():
            krendered = ktexts.get(kkey)
            if krendered is None:  # kernel frames rendered once per callchain
                kframes = engine.kernel_frames(kkey) if kkey else ()
                krendered = ktexts[kkey] = [self._render_kernel(f) for f in kframes]
            nk = len(krendered)
            if regs_none and nk:
                status, ids = "kernel_only", []
            else:
                status = STATUS_NAMES[code]
                nctx.count_unsymbolized(space, ids, pcs)
            # recorded callchains and lone ips as they are (engine.expand); unwound stacks with
            # their inline chains
            fixed = status in (STATUS_CALLCHAIN, STATUS_IP_ONLY)
            shown = plains if fixed else texts
            # each frame id's text at its pc (frames by code: an id is one binary address,
            # named at one of the addresses processes run it at; by space: at its own)
            ips: list[int] = []
            if pcs:
                ips = [pc if exact[i] else pc - 1 for i, pc in zip(ids, pcs, strict=True)]
                show = [shown[i] if not moves[i] or ip == fip[i] else moved(i, ip, fixed)
                        for i, ip in zip(ids, ips, strict=True)]  # fmt: skip
            else:
                show = [shown[i] for i in ids]
            nu = len(ids)
            if not fixed and engine.srclines is not None:
                nu = sum(map(self._frame_n.__getitem__, ids))
            stacks.append((comm, status, nu, nk))
            if fmt == "jsonl":
                rendered.append("[" + ",".join([*krendered, *show]) + "]")
            elif status == STATUS_IP_ONLY and nk + len(ids) == 1:  # (stackfmt.perf_script)
                if ids:
                    rendered.append(ip_only_text(show[0], ips[0] if ips else fip[ids[0]]))
                else:  # a kernel ip: the callchain intern_sample made, {CONTEXT_KERNEL, ip}
                    rendered.append(ip_only_text(krendered[0], callchain(kkey)[-1]))
            else:
                rendered.append("".join([*krendered, *show]) + "\n")

    def _moved(self, fid: int, ip: int, plain: bool) -> str:
        """Frames by code: frame id ``fid``'s text (``plain``: unexpanded) at ``ip``, another
        address of the same code than the one it was named at: its frames with that ip, the
        other fields being the same at every address of an id (context.NativeContext: its
        module key is the binary and mapped name, its ELF vaddr gives the symbol, inline levels
        and, by its segment, ``rel``). Made once per (id, ip)."""
        key = (fid, ip, plain)
        t = self._moved_text.get(key)
        if t is not None:
            return t
        if plain or self.engine.srclines is None:
            fs: tuple[Frame, ...] = (self.nctx.plain[fid],)
        else:
            fs = self._frames[fid]
        tails = self._json_tails(fid, plain, fs) if self.fmt == "jsonl" else None
        if tails is not None:  # only the ip differs (its frames share it: engine.expand)
            t = ",".join([f'{{"ip":"{ip:#x}"{tail}' for tail in tails])
        else:
            at = tuple([at_ip(f, ip) for f in fs])
            t = render_frame(self.fmt, at[0]) if len(at) == 1 else render_frames(self.fmt, at)
        self._moved_text[key] = t
        return t

    def _json_tails(self, fid: int, plain: bool, fs: tuple[Frame, ...]) -> tuple[str, ...] | None:
        """jsonl: the text of each of ``fs`` (frame id ``fid``'s) after its leading ``"ip"``
        member (stackfmt.to_json puts it first), once per id; None if another member shows the
        ip too (a frame without ``rel`` shows the ip as its rel)."""
        key = (fid, plain)
        if key in self._tails:
            return self._tails[key]
        tails: list[str] = []
        for f in fs:
            t, head = render_frame("jsonl", f), f'{{"ip":"{f.ip:#x}"'
            if f.rel is None or not t.startswith(head):
                self._tails[key] = None
                return None
            tails.append(t[len(head) :])
        self._tails[key] = out = tuple(tails)
        return out

    def _render_kernel(self, f: Frame) -> str:
        """render_frame of a kernel frame, once per distinct frame: callchains share most of theirs
        (bounded by the distinct kernel frames of the file)."""
        t = self._kframe_text.get(f)
        if t is None:
            t = self._kframe_text[f] = render_frame(self.fmt, f)
        return t

    def _inline_extra(self) -> int:
        """By code: the user frames inline chains add to C's count of frame ids (each id of n
        frames adds n - 1 to every sample of every stack it is in), counted in C over one flag
        column per inline depth (fp_stacks_unsym): O(stacks x depth)."""
        fn = self._frame_n
        deepest = max(fn, default=1)
        if deepest <= 1:
            return 0
        ctx = self.ctx
        nst = int(lib.fp_nstacks(ctx))
        counts = ffi.new("uint64_t[]", max(1, nst))
        lib.fp_stack_counts(ctx, counts)
        per = ffi.new("uint32_t[]", max(1, nst))
        extra = 0
        for j in range(1, deepest):
            flags = bytes(n > j for n in fn)
            lib.fp_stacks_unsym(ctx, 0, nst, flags, len(flags), per)
            extra += sum(c * e for c, e in zip(view(counts, "Q", nst), view(per, "I", nst),
                                                strict=True) if e)  # fmt: skip
        return extra

    def _finish(self) -> None:
        """Final per-stack counts: engine stats, and the folded output."""
        es = self.engine.stats
        if self.by_code:  # (folded) counted in C over its stacks, statuses in first-seen order
            by = ffi.new("uint64_t[]", lib.FP_FOLD_NSTATUS)
            first = ffi.new("uint32_t[]", lib.FP_FOLD_NSTATUS)
            uf, kf = ffi.new("uint64_t *"), ffi.new("uint64_t *")
            if lib.fp_fold_stats(self.ctx, by, first, uf, kf) != 0:
                raise RuntimeError("fp_fold_stats: a stack with a bad status")
            names = (*STATUS_NAMES, "kernel_only")
            for _, k in sorted((first[k], k) for k in range(len(names)) if by[k]):
                es.samples += by[k]
                es.by_status[names[k]] += by[k]
            es.user_frames += uf[0] + self._inline_extra()
            es.kernel_frames += kf[0]
        else:
            nst = len(self._stacks)
            counts = ffi.new("uint64_t[]", max(1, nst))
            lib.fp_stack_counts(self.ctx, counts)
            for count, (_comm, status, nu, nk) in zip(view(counts, "Q")[:nst], self._stacks,
                                                      strict=True):  # fmt: skip
                es.samples += count
                es.by_status[status] += count
                es.kernel_frames += nk * count
                es.user_frames += nu * count
        es.frames = es.kernel_frames + es.user_frames
        es.batches += self.runs
        if self.fmt == "folded":
            write_folded(self.nctx, self.engine.kernel_frame, self._frame_text, self.out.write)
