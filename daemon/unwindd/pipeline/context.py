"""The native pipeline context (``cffi_build/fastpath.h``, ``context.c``, ``stacks.c``) and its
Python mirror, shared by its two drivers: the ring driver (ringstep.py, the daemon and ``unwindd
record``) and the file driver (filereplay.py, ``unwindd replay``). What the C context knows by
number (address spaces, comms, frames, stacks, statuses) is named here, once.

Invariants:
- Names by C value: ``STATUS_NAMES[i]`` is the status name of ``UNW_*`` value ``i``
  (unwinder.UnwindStatus) or ``FP_STATUS_*`` value ``i`` (stackfmt.STATUS_CALLCHAIN,
  STATUS_IP_ONLY: samples with nothing to unwind), ``SAMPLE_ERRORS[i]`` the decoder's reason
  for ``FP_ERR_*`` ``i`` (decoder.RecordDecoder.decode_sample's reasons), ``END_ERRORS`` the
  decode error an index run ends on (``FP_END_*``): the same counters the Python decoder
  keeps.
- ``record_marks`` is what a decoded non-SAMPLE record's C index entry (``struct fp_rec``)
  must carry so the C orderer places it exactly where ordering.RoundOrderer would.
- ``NativeContext``: a space id names one snapshot key for the context's life; the snapshot
  itself is held while a pid uses it in C or a frame seen in it is still unnamed, so C never
  points into freed modules and dead processes' snapshots do not pile up. Comm ids intern
  ``engine.comm_of`` names. Each frame id is named once, each stack id exported once.
- Views and counts cross the boundary once per batch: ``view`` is a typed memoryview on a
  cffi buffer (no copy), ``count_flagged`` one C pass over a column.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterator
from typing import Any

from ..binaries.cfi import ARCH_X86_64
from ..source.records import Record
from ..unwcore import check, count, ffi, lib, owned
from ..unwind.engine import Snapshot, StackEngine
from ..unwind.stackfmt import STATUS_CALLCHAIN, STATUS_IP_ONLY, Frame
from ..unwind.unwinder import UnwindStatus

__all__ = [
    "END_ERRORS",
    "HAS_CPU",
    "SAMPLE_ERRORS",
    "STATUS_NAMES",
    "TIMED",
    "NativeContext",
    "callchain",
    "count_flagged",
    "jit_parts",
    "mark_record",
    "record_marks",
    "view",
]

SAMPLE_ERRORS = ("", "short_body", "bad_callchain_nr", "bad_raw_size", "bad_branch_nr",
                 "short_regs", "bad_stack_size", "bad_dyn_size")  # fmt: skip
END_ERRORS = {int(lib.FP_END_TRUNCATED): "truncated", int(lib.FP_END_BAD_SIZE): "bad_size"}
STATUS_NAMES = (*(s.name.lower() for s in sorted(UnwindStatus)), STATUS_CALLCHAIN,
                STATUS_IP_ONLY)  # fmt: skip
assert STATUS_NAMES.index(STATUS_CALLCHAIN) == lib.FP_STATUS_CALLCHAIN
assert STATUS_NAMES.index(STATUS_IP_ONLY) == lib.FP_STATUS_IP_ONLY
TIMED, HAS_CPU = int(lib.FP_TIMED), int(lib.FP_HAS_CPU)
_U64_MAX = (1 << 64) - 1


def view(buf: Any, fmt: str, n: int | None = None) -> memoryview:
    """The first ``n`` (default: all) items of cffi buffer ``buf`` as ``fmt``, without a copy."""
    mv: Any = memoryview(ffi.buffer(buf)).cast("B")
    out: memoryview = mv.cast(fmt)
    return out if n is None else out[:n]


def count_flagged(flag: bytes, vals: memoryview) -> list[tuple[int, int]]:
    """(value, occurrences) of the vals[k] with flag[k], in first-seen order."""
    n = len(flag)
    pairs = ffi.new("uint64_t[]", max(2, 2 * n))
    d = count(lib.fp_count_flagged(flag, ffi.from_buffer("uint32_t[]", vals), n, pairs),
              "fp_count_flagged")  # fmt: skip
    flat = view(pairs, "Q", 2 * d).tolist()
    return list(zip(flat[0::2], flat[1::2], strict=True))


def record_marks(rec: Record) -> tuple[int, int, int]:
    """(time, cpu, flags) for ``rec``'s C index entry; time and cpu are 0 where unflagged."""
    t, cpu = rec.time, rec.cpu
    flags = (0 if t is None else TIMED) | (0 if cpu is None else HAS_CPU)
    return t or 0, cpu or 0, flags


def mark_record(r: Any, marks: tuple[int, int, int]) -> None:
    """Write ``record_marks``' answer into C index entry ``r``: only the flagged fields."""
    t, cpu, flags = marks
    if flags & TIMED:
        r.time = t
    if flags & HAS_CPU:
        r.cpu = cpu
    r.flags = flags


def jit_parts(nctx: NativeContext, recs: Any, perm: Any, a: int, b: int
              ) -> Iterator[tuple[int, int]]:  # fmt: skip
    """The run of samples perm[a, b) (time order) as parts (k, m) cut at the times a jitdump
    replaced code (``StackEngine.jit_time``); before each part, every pid with such a dump is
    moved to the part's first time, and a pid whose frames must be named again is forgotten
    by C (a new space id: new frames). The caller names each part's new frames as of the
    part's newest sample (``name_time``), so a pc is named as the code it ran. Without
    replacements: (a, b). Cost: O(pids with replacements + log(b - a)) per part."""
    engine = nctx.engine
    bounds = engine.symbolizer.all_jit_boundaries()
    if not bounds:
        yield a, b
        return

    def time_at(i: int) -> int:
        return int(recs[perm[i]].time)

    pids = engine.symbolizer.jit_boundary_pids
    k = a
    while k < b:
        t0 = time_at(k)
        for pid in pids:
            if engine.jit_time(pid, t0):
                nctx.forget_space(pid)
        nxt = bisect_right(bounds, (t0, _U64_MAX))  # the first boundary after t0
        m = b
        if nxt < len(bounds):
            # (at least one sample: a late record's time may be out of order)
            m = max(k + 1, bisect_left(range(k, b), bounds[nxt][0], key=time_at) + k)
        yield k, m
        k = m


def callchain(kc: bytes) -> tuple[int, ...]:
    """An exported stack's raw kernel callchain bytes as u64 words (``StackEngine.kernel_frames``
    takes the bytes themselves too)."""
    return tuple(memoryview(kc).cast("Q").tolist())


# One exported stack: (comm, space id, UNW_* status, regs_none, frame ids leaf first, raw
# kernel callchain as native-endian u64 bytes: ``callchain`` gives its words, and with code
# frames its user pcs, one per frame id; else empty).
NewStack = tuple[str, int, int, int, list[int], bytes, list[int]]


class _ExportBufs:
    """fp_stacks_export's out-arrays, with room for ``cnt`` stacks, ``nf`` frame ids and ``nk``
    kernel callchain words."""

    def __init__(self, cnt: int, nf: int, nk: int) -> None:
        self.cnt, self.nf, self.nk = cnt, nf, nk
        self.comm, self.space, self.npcs, self.nkc = (ffi.new("uint32_t[]", cnt) for _ in range(4))
        self.status, self.rn = ffi.new("uint8_t[]", cnt), ffi.new("uint8_t[]", cnt)
        self.fids, self.kc = ffi.new("uint32_t[]", nf), ffi.new("uint64_t[]", nk)
        self.pcs = ffi.new("uint64_t[]", nf)


class NativeContext:
    """One C pipeline context and the Python mirror of its ids.

    Memory: per space id its snapshot key (ids are never reused) and, for the live placement
    check, its mapping ranges (16 bytes a mapping); per comm its name, one byte
    per frame id (has no symbol), per counted (space, frames) key with an unnamed frame its
    packed bytes; snapshots only while held (see the module's invariants)."""

    def __init__(self, engine: StackEngine, *, by_code: int = 0, code_frames: bool = False,
                 par_min: int | None = None, par_stress: bool = False) -> None:  # fmt: skip
        self.engine = engine
        self.ctx = owned(lib.fp_ctx_new(ARCH_X86_64, engine.unwinder.max_depth),
                         lib.fp_ctx_free, "fp_ctx_new")  # fmt: skip
        if par_min is not None:
            lib.fp_ctx_par(self.ctx, par_min)
        if par_stress and lib.fp_ctx_par_stress(self.ctx, 1) != 0:
            raise RuntimeError("fp_ctx_par_stress: no worker thread")
        # by code (1) or by function (2): frames and stacks without their address space
        # (fp_ctx_by_code), for output that prints no addresses
        if by_code:
            check(lib.fp_ctx_by_code(self.ctx, by_code), "fp_ctx_by_code")
        # frames by code, stacks by space (fp_ctx_code_frames): a frame id's frames were named
        # at one address (``plain[id].ip``); ``new_stacks`` gives each stack's pcs
        self.code_frames = code_frames
        if code_frames:
            check(lib.fp_ctx_code_frames(self.ctx, 1), "fp_ctx_code_frames")
        self.comms: list[str] = []
        self._comm_ids: dict[str, int] = {}
        # (pid, generation, engine.name_epoch) -> space id: a new epoch names frames anew
        self._space_ids: dict[tuple[int, int, int], int] = {}
        self._snaps: dict[int, Snapshot] = {}  # space id -> snapshot, while held
        # space id -> its mappings as C [start, end) pairs, kept for the context's life (not
        # released with the snapshot): a live pid's space is forgotten at each of its side-band
        # records and set again, mostly as the same snapshot, at its next sample
        self._ranges: dict[int, Any] = {}
        self._pid_sid: dict[int, int] = {}  # pid -> the space id C has for it
        self._sid_refs: Counter[int] = Counter()
        self._unheld: set[int] = set()  # space ids whose last pid let go since the last naming
        self.unsym = bytearray()  # per frame id: 1 if it has no symbol
        self.plain: list[Frame] = []  # per frame id: its frame, not expanded (new_frames)
        self.exact = bytearray()  # per frame id: 1 if named at its pc, 0 at pc - 1
        self.nunsym_frames = 0  # the frame ids flagged in unsym
        self.nstacks = 0  # stacks exported (new_stacks) or counted (count_code_stacks)
        self._seen: set[bytes] = set()  # (space, frames) keys whose unnamed frames are counted
        self._nunsym: list[int] = []  # by code: per stack, its frames with no symbol
        self._npairs = 0  # by code: fp_pairs consumed
        self._pair_bufs = (ffi.new("uint32_t[]", 4096), ffi.new("uint32_t[]", 4096),
                           ffi.new("uint64_t[]", 4096))  # fmt: skip
        self._frame_out = (ffi.new("uint32_t *"), ffi.new("uint64_t *"), ffi.new("uint8_t *"))
        self._p_nkc = ffi.new("uint64_t *")
        self._export = _ExportBufs(64, 1024, 1024)

    @property
    def native_bytes(self) -> int:
        """The C context's heap bytes (``fp_ctx_bytes``: its tables at capacity), O(1)."""
        return int(lib.fp_ctx_bytes(self.ctx))

    @property
    def nspaces(self) -> int:
        """Space ids given out (one per snapshot key the context has unwound against)."""
        return len(self._space_ids)

    # -- what C asks for

    def set_comm(self, pid: int, tid: int) -> None:
        """FP_RUN_NEED_COMM: the comm id of (pid, tid), ``engine.comm_of`` interned."""
        comm = self.engine.comm_of(pid, tid)
        cid = self._comm_ids.get(comm)
        if cid is None:
            cid = self._comm_ids[comm] = len(self.comms)
            self.comms.append(comm)
        check(lib.fp_set_comm(self.ctx, pid, tid, cid), "fp_set_comm")

    def set_space(self, pid: int, snap: Snapshot, *, ranges: bool = False) -> int:
        """Give C ``snap`` as pid's space (``ranges``: with its mappings, for the live
        placement check, fp_set_live_space); its space id."""
        key = (*snap.key, self.engine.name_epoch(pid))
        sid = self._space_ids.get(key)
        if sid is None:
            sid = self._space_ids[key] = len(self._space_ids)
        self._snaps[sid] = snap  # keeps snap.native (the modules C points at) alive
        native = snap.native
        if ranges:
            r = self._ranges.get(sid)
            if r is None:
                flat = [x for mp in snap.mappings for x in (mp.start, mp.end)]
                r = self._ranges[sid] = ffi.new("uint64_t[]", flat or [0])
            rc = lib.fp_set_live_space(self.ctx, pid, native._c, len(native.modules), sid, r,
                                       len(snap.mappings))  # fmt: skip
        else:
            rc = lib.fp_set_space(self.ctx, pid, native._c, len(native.modules), sid)
        check(rc, "fp_set_space")
        self._unhold(pid)
        self._pid_sid[pid] = sid
        self._sid_refs[sid] += 1
        return sid

    def snapshot_of(self, pid: int) -> Snapshot:
        """The snapshot C has as pid's space."""
        return self._snaps[self._pid_sid[pid]]

    def forget_space(self, pid: int) -> None:
        """pid's space may have changed: C asks for it again at its next sample. Every space C
        holds was given by ``set_space`` and is in ``_pid_sid`` until forgotten here, so a pid
        not in it costs no call into C (most side-band records are of pids C never saw)."""
        if pid in self._pid_sid:
            lib.fp_forget_space(self.ctx, pid)
            self._unhold(pid)

    def forget_all_spaces(self) -> None:
        lib.fp_forget_all_spaces(self.ctx)
        for pid in list(self._pid_sid):
            self._unhold(pid)

    def forget_comms(self) -> None:
        lib.fp_forget_comms(self.ctx)

    def retire_code(self, keys: list[int]) -> int:
        """Frames by code: the frames of modules ``keys`` are named again in the stacks added
        from now on (fp_ctx_retire_code); the frames retired."""
        got = int(lib.fp_ctx_retire_code(self.ctx, ffi.new("uint64_t[]", keys), len(keys)))
        check(got, "fp_ctx_retire_code")
        return got

    def _unhold(self, pid: int) -> None:
        old = self._pid_sid.pop(pid, None)
        if old is not None:
            self._sid_refs[old] -= 1
            if self._sid_refs[old] <= 0:
                del self._sid_refs[old]
                self._unheld.add(old)

    # -- naming what a run added

    def new_frames(self) -> list[tuple[Frame, ...]]:
        """Name the frames the last runs added, each once, with the engine's own ``frames_at``
        (the table is in the state the reference path names them in): per frame id its
        frames, one or, with inline expansion, one per inline level innermost first (the
        frame unexpanded, for stacks of recorded callchains, goes to ``plain``); flags
        the unnamed ones in ``unsym``. ``frames_at`` counts an unnamed frame each time; the
        reference path counts per new (snapshot, frames) key: that is
        ``count_unsymbolized``'s, so the count is taken back here."""
        engine, ctx, unsym = self.engine, self.ctx, self.unsym
        first, nfr = len(unsym), int(lib.fp_nframes(ctx))
        out: list[tuple[Frame, ...]] = []
        if nfr > first:
            sp, pc, ex = self._frame_out
            snaps, frame_at, expand, plain = self._snaps, engine.frame_at, engine.expand, self.plain
            for fid in range(first, nfr):
                lib.fp_frame(ctx, fid, sp, pc, ex)
                snap = snaps[sp[0]]
                ip = pc[0] if ex[0] else pc[0] - 1
                f = frame_at(snap.key[0], snap, ip)
                plain.append(f)
                self.exact.append(ex[0])
                out.append(expand(snap, ip, f))
                unsym.append(f.sym is None)
            counted = sum(unsym[first:])
            self.nunsym_frames += counted
            engine.stats.unsymbolized -= counted
        return out

    def release_snapshots(self) -> None:
        """Drop the snapshots no pid holds in C once their frames are named (after
        ``new_frames``): without this the context keeps every mapping generation of every
        process it saw."""
        for sid in self._unheld:
            if sid not in self._sid_refs:
                del self._snaps[sid]
        self._unheld.clear()

    def new_stacks(self) -> list[NewStack]:
        """The stacks added since the last call, exported from C in one call, in id order.
        The export arrays are kept and grown (doubling) across calls: most runs add a stack
        or two, and fresh arrays per call would cost more than the export."""
        ctx, first = self.ctx, self.nstacks
        nst = int(lib.fp_nstacks(ctx))
        if nst <= first:
            return []
        self.nstacks = nst
        cnt = nst - first
        p_nkc = self._p_nkc
        nf = int(lib.fp_stacks_words(ctx, first, nst, p_nkc))
        nk = int(p_nkc[0])
        a = self._export
        if cnt > a.cnt or nf > a.nf or nk > a.nk:
            a = self._export = _ExportBufs(max(cnt, 2 * a.cnt), max(nf, 2 * a.nf),
                                           max(nk, 2 * a.nk))  # fmt: skip
        lib.fp_stacks_export(ctx, first, nst, a.comm, a.space, a.status, a.rn, a.npcs, a.nkc,
                             a.fids, a.kc)  # fmt: skip
        unpack = ffi.unpack
        fids = unpack(a.fids, nf)
        pcs: list[int] = []
        if self.code_frames:
            lib.fp_stacks_pcs(ctx, first, nst, a.pcs)
            pcs = unpack(a.pcs, nf)
        kcb = ffi.buffer(a.kc, 8 * nk)[:]
        comms = self.comms
        out: list[NewStack] = []
        fo = ko = 0
        cols = (unpack(col, cnt) for col in (a.comm, a.space, a.status, a.rn, a.npcs, a.nkc))
        for c, sp, st, rn, n, k in zip(*cols, strict=True):
            k *= 8
            out.append((comms[c], sp, st, rn, fids[fo : fo + n], kcb[ko : ko + k],
                        pcs[fo : fo + n]))  # fmt: skip
            fo += n
            ko += k
        return out

    def count_unsymbolized(self, space: int, ids: list[int], pcs: list[int]) -> None:
        """``engine.stats.unsymbolized`` as ``StackEngine.user_frames`` counts it: a stack's
        unnamed frames once per new (snapshot, frames) key (with code frames the ids alone do
        not say the pcs: a process may run one binary's code at two addresses)."""
        if not self.nunsym_frames:
            return
        n = sum(map(self.unsym.__getitem__, ids))
        if n:
            key = (space.to_bytes(4, "little") + array("I", ids).tobytes()
                   + array("Q", pcs).tobytes())  # fmt: skip
            if key not in self._seen:
                self._seen.add(key)
                self.engine.stats.unsymbolized += n

    def count_code_stacks(self) -> None:
        """By code: ``count_unsymbolized`` for the stacks and samples the last runs added.
        Stacks have no space, so C keeps the distinct (space, stack, pcs hash) triples
        (fp_pairs); each stack's unnamed frames are counted in C over the per-frame flags
        (fp_stacks_unsym), O(1) Python per run, not per stack."""
        ctx, first = self.ctx, self.nstacks
        nst = int(lib.fp_nstacks(ctx))
        if nst > first:
            cnt = nst - first
            if self.nunsym_frames:
                out = ffi.new("uint32_t[]", cnt)
                lib.fp_stacks_unsym(ctx, first, nst, ffi.from_buffer(self.unsym),
                                    len(self.unsym), out)  # fmt: skip
                self._nunsym.extend(view(out, "I", cnt).tolist())
            else:
                self._nunsym.extend(bytes(cnt))
            self.nstacks = nst
        n = self._npairs
        spaces, stacks, hashes = self._pair_bufs
        chunk = len(spaces)
        nunsym, seen, es = self._nunsym, self._seen, self.engine.stats
        while True:
            got = int(lib.fp_pairs(ctx, n, spaces, stacks, hashes, chunk))
            if not got:
                break
            n += got
            for space, sid, h in zip(spaces[0:got], stacks[0:got], hashes[0:got], strict=True):
                if nunsym[sid]:
                    key = space.to_bytes(4, "little") + h.to_bytes(8, "little")
                    if key not in seen:
                        seen.add(key)
                        es.unsymbolized += nunsym[sid]
        self._npairs = n
