"""Process table: per-pid address spaces built from MMAP/MMAP2/COMM/FORK/EXIT records.

Invariants:
- Sans-IO: records (or /proc/<pid>/maps mappings, procmaps.py) in, address spaces (space.py)
  out. The only outside effect is through the injected ``binaries`` resolver (the ELF cache,
  which opens files); with ``binaries=None`` mappings carry no binary and the table touches
  nothing.
- Records are applied in stream order (the caller runs ordering.py first). One space per
  process (pid = tgid); threads (FORK with pid == ppid) share it.
- A space's mappings are sorted and disjoint, executable only (MMAP2 ``prot & PROT_EXEC``, MMAP
  without ``PERF_RECORD_MISC_MMAP_DATA``). A new mapping removes what it overlaps, keeping the
  non-overlapped head and tail pieces (mapping.py ``cut``, after perf's maps__fixup_overlappings
  in tools/perf/util/maps.c). A non-executable mapping also cuts what it overlaps (the old code
  is gone) but is not inserted: better than perf, which only sees it with mmap_data.
- COMM with the exec flag for pid == tid clears the space: the kernel emits it from
  begin_new_exec (fs/exec.c) *before* load_elf_binary maps the new image, so everything in the
  space at that point belongs to the old image.
- FORK of a new process copies the parent's space in O(1) (spaces share an immutable state
  object; a change replaces the state) plus one reference per distinct binary.
- EXIT of the main thread retires the pid: the space stays queryable (a sample taken before
  the EXIT may be delivered after it) until ``drop(pid)``; ``on_retire`` is the hook for the
  retirement policy. ``reap(now, grace)`` drops spaces retired more than ``grace`` ns (record
  time) ago, oldest first; ``evict_to(cap)`` enforces a cap on tracked spaces (retired first,
  then least recently used live ones, which a /proc rescan can rebuild). Every drop is counted
  by reason in ``stats.drops`` and reported through ``on_drop`` (so caches keyed by pid can
  forget it).
- A space knows which process it is: ``start_time`` (``/proc/<pid>/stat`` starttime ticks, exact
  when read from /proc, estimated from the FORK record's time otherwise). A pid whose start
  time changed is a new process: its space is cleared, never inherited (pid reuse).
- /proc maps merge three ways (``load_mappings``): ``replace`` (bootstrap, pid reuse: the space
  becomes exactly the maps), ``fill`` (backfill: maps only fill holes; every mapping the table
  already has, in particular those from MMAP2 records, is kept as is) and ``override`` (the
  churn fallback: /proc, read *now*, after every record applied so far, wins where it overlaps;
  non-overlapping mappings are kept for samples still in flight).
- References: each space holds one reference per distinct binary (ELF cache entry) it maps,
  taken when the first mapping of it arrives and released when the last one goes.
- Deferred mappings (``defer_mappings``, the live step's): after an exec, a process's MMAP2s
  are queued, not inserted, until something asks for its space (``get``, ``space_for``,
  a FORK of a child, a /proc merge, any other mapping change); then they are inserted at once
  (``_build``), one new state for all. Queued mappings are disjoint (one that overlaps a
  queued one builds the queue first and is applied as usual), so building them in one go
  gives the mappings the records would have; their binaries are resolved and held as each
  MMAP2 is applied, as without deferral (the references, the ELF cache's opens and releases
  are the same, in the same order). A process that exits and is dropped before anything
  asks (most of a churning machine's: sampled by nobody) never builds a mapping.
- Cost: a mapping change is O(n) in the space's mapping count (tens to hundreds) for the new
  immutable tuple, and finding what it overlaps is one bisect on the cached starts (a MMAP2
  over nothing, most of them, cuts nothing and copies the tuple once). MMAP2 identities are
  interned (one ``Identity`` per file, at most 4096 held).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any, Protocol

from ..binaries.elfentry import ElfEntry
from ..lightdc import dataclass, field, replace
from ..source.abi import MISC_MMAP_DATA
from ..source.records import Comm, Exit, Fork, Mmap, Mmap2, Record
from .mapping import (
    MAP_PRIVATE,
    NO_IDENTITY,
    PROT_EXEC,
    PROT_READ,
    Identity,
    Mapping,
    cut,
    holes,
    make_mapping,
    overlapping,
)
from .procmaps import parse_proc_maps
from .space import AddressSpace

__all__ = ["DROP_REASONS", "BinaryResolver", "ProcessTable", "TableStats"]


class BinaryResolver(Protocol):
    """The ELF cache's side of the contract (``elfcache.ElfCache``)."""

    def acquire(
        self,
        pid: int | None,
        filename: str,
        start: int = 0,
        end: int = 0,
        *,
        build_id: bytes | None = None,
        maj: int | None = None,
        min: int | None = None,
        ino: int | None = None,
        ino_generation: int | None = None,
    ) -> ElfEntry: ...

    def acquire_vdso(self) -> ElfEntry: ...

    def retain(self, entry: ElfEntry) -> None: ...

    def release(self, entry: ElfEntry) -> None: ...

    def retain_all(self, entries: Iterable[ElfEntry]) -> None: ...

    def release_all(self, entries: Iterable[ElfEntry]) -> None: ...


def _start_of(e: tuple[Any, ...]) -> int:
    return e[0]  # type: ignore[no-any-return]


# Module keys past every ElfEntry uid (a process-wide counter): aliased mapping names.
_ALIAS_KEYS = 1 << 48


# Why a space leaves the table (``TableStats.drops``): retired and past the grace period, over
# ``max`` spaces (retired ones first, then live ones), a new process took the pid, ``drop()``.
DROP_REASONS = ("exit_grace", "cap_retired", "cap_live", "reused", "manual")


@dataclass
class TableStats:
    """The process table's counts: records applied and ignored, spaces dropped."""

    records: Counter[str] = field(default_factory=Counter)
    ignored: Counter[str] = field(default_factory=Counter)
    drops: Counter[str] = field(default_factory=Counter)  # spaces dropped, by DROP_REASONS


MERGE_MODES = ("replace", "fill", "override")


class ProcessTable:
    """pid -> AddressSpace, driven by records in stream order."""

    def __init__(
        self,
        binaries: BinaryResolver | None = None,
        *,
        unwinder: Any = None,
        on_retire: Callable[[int], None] | None = None,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        """``unwinder``: an object with ``new_module`` and ``AddressSpace`` attributes (the
        ``unwindd.unwind.unwinder`` module, given by the stage above: the table builds native
        address spaces with it but does not import it); without one, spaces have mappings
        and no native form."""
        self.binaries = binaries
        self._unwinder = unwinder
        self.on_retire = on_retire
        self.on_drop = on_drop
        self.spaces: dict[int, AddressSpace] = {}
        self.retired: dict[int, int] = {}  # pid -> retire time; insertion order = retire order
        self.epoch = 0  # bumped when records were lost: every space must be re-verified
        self.stats = TableStats()
        # (entry uid, mapped name) -> module key, for mappings named unlike their entry
        self._code_keys: dict[tuple[int, str], int] = {}
        self._next_code_key = _ALIAS_KEYS
        # (build_id, maj, min, ino, gen) -> Identity: one immutable value per mapped file,
        # shared by its mappings (MMAP2 churn re-maps the same few files)
        self._idents: dict[tuple[Any, ...], Identity] = {}
        # Deferred mappings (see the module doc): pid -> its queued MMAP2s since its exec,
        # (start, end, pgoff, prot, flags, filename, identity, entry, bias) each
        self.defer_mappings = False
        self._queued: dict[int, list[tuple[Any, ...]]] = {}

    def code_key(self, entry: ElfEntry, m: Mapping) -> int:
        """The unwinder module key of ``m`` (a mapping of ``entry``): everything a frame's
        name depends on besides its ELF vaddr (StackEngine.frame_at: the binary and the mapped
        file name), so frames aggregated by code (fastpath.h fp_ctx_by_code) are named right.
        The entry's uid when the mapping carries the entry's own name, else a key of its own,
        never reused (the map is cleared at a bound, keys keep counting)."""
        if m.filename == entry.filename:
            return entry.uid
        k = (entry.uid, m.filename)
        key = self._code_keys.get(k)
        if key is None:
            if len(self._code_keys) >= 65536:
                self._code_keys.clear()  # costs only sharing: a fresh key is still distinct
            key = self._code_keys[k] = self._next_code_key
            self._next_code_key += 1
        return key

    def code_keys_of(self, uids: set[int]) -> list[int]:
        """The module keys ``code_key`` gave mappings of the entries ``uids``: their uids and
        their aliases' keys still held. O(aliases held)."""
        return [*uids, *(key for (uid, _), key in self._code_keys.items() if uid in uids)]

    def module_factory(self) -> Callable[..., Any]:
        return self._unwinder_module().new_module  # type: ignore[no-any-return]

    def space_factory(self) -> Callable[..., Any]:
        return self._unwinder_module().AddressSpace  # type: ignore[no-any-return]

    def _unwinder_module(self) -> Any:
        if self._unwinder is None:
            raise RuntimeError("this ProcessTable was given no unwinder: no native spaces")
        return self._unwinder

    # -- queries

    def space_for(self, pid: int) -> AddressSpace:
        if self._queued and pid in self._queued:
            self._build(pid)
        sp = self.spaces.get(pid)
        if sp is None:
            sp = self.spaces[pid] = AddressSpace(pid, self)
        return sp

    def get(self, pid: int) -> AddressSpace | None:
        if self._queued and pid in self._queued:
            self._build(pid)
        return self.spaces.get(pid)

    def __contains__(self, pid: int) -> bool:
        return pid in self.spaces

    # -- records

    def apply(self, rec: Record) -> None:
        """Apply one record; records other than MMAP/MMAP2/COMM/FORK/EXIT are ignored."""
        if isinstance(rec, Mmap2):
            self.apply_mmap2(rec)
        elif isinstance(rec, Mmap):
            self.stats.records["MMAP"] += 1
            prot = PROT_READ if rec.misc & MISC_MMAP_DATA else PROT_READ | PROT_EXEC
            self.add_mapping(rec.pid, rec.start, rec.start + rec.length, rec.pgoff, prot,
                             MAP_PRIVATE, rec.filename, NO_IDENTITY)  # fmt: skip
        elif isinstance(rec, Comm):
            if rec.exec and rec.pid == rec.tid:
                self.stats.records["EXEC"] += 1
                self.exec(rec.pid)
                if self.defer_mappings:
                    self._queued[rec.pid] = []  # its new image's MMAP2s: queued
        elif isinstance(rec, Fork):
            self.stats.records["FORK"] += 1
            self.fork(rec.pid, rec.ppid)
        elif isinstance(rec, Exit):
            self.stats.records["EXIT"] += 1
            if rec.pid == rec.tid:
                self.retire(rec.pid, rec.time)

    def apply_mmap2(self, rec: Mmap2) -> None:
        """``apply`` of a MMAP2 (the engine's side-band path calls it directly)."""
        counts = self.stats.records
        counts["MMAP2"] = counts.get("MMAP2", 0) + 1  # (Counter's += costs two calls)
        k = (rec.build_id, rec.maj, rec.min, rec.ino, rec.ino_generation)
        ident = self._idents.get(k)
        if ident is None:
            if len(self._idents) >= 4096:
                self._idents.clear()  # costs only re-creating equal values
            ident = self._idents[k] = Identity(*k)
        pid, start = rec.pid, rec.start
        q = self._queued.get(pid) if self._queued else None
        if q is None or not self._queue(q, pid, start, start + rec.length, rec.pgoff, rec.prot,
                                        rec.flags, rec.filename, ident):  # fmt: skip
            self.add_mapping(pid, start, start + rec.length, rec.pgoff, rec.prot, rec.flags,
                             rec.filename, ident)  # fmt: skip

    def apply_all(self, recs: Iterable[Record]) -> None:
        for r in recs:
            self.apply(r)

    def add_mapping(
        self,
        pid: int,
        start: int,
        end: int,
        pgoff: int,
        prot: int,
        flags: int,
        filename: str,
        identity: Identity = NO_IDENTITY,
    ) -> Mapping | None:
        """Insert a mapping (cutting what it overlaps); returns it if it was kept."""
        if end <= start:
            self.stats.ignored["empty_mapping"] += 1
            return None
        if self._queued and pid in self._queued:
            self._build(pid)
        sp = self.spaces.get(pid)
        if sp is None:
            sp = self.spaces[pid] = AddressSpace(pid, self)
        st = sp._state
        starts, maps = st.starts, st.mappings
        lo, hi = overlapping(starts, maps, start, end)
        if lo == hi:  # overlaps nothing (most records): no cut, one insertion
            if not prot & PROT_EXEC:
                return None  # a data mapping over nothing we track: no change
            m = self._new_mapping(sp, pid, start, end, pgoff, prot, flags, filename, identity)
            if lo == len(maps):  # (after every mapping: the order most images map in)
                sp._set((*maps, m), [*starts, start])
            else:
                sp._set((*maps[:lo], m, *maps[lo:]), [*starts[:lo], start, *starts[lo:]])
            return m
        kept, removed, pieces = cut(st.mappings, start, end, st.starts)
        new: Mapping | None = None
        if prot & PROT_EXEC:
            new = self._new_mapping(sp, pid, start, end, pgoff, prot, flags, filename, identity)
            kept.insert(bisect_right([m.start for m in kept], start), new)
        # pieces keep their binary: hold once per piece, drop once per removed original
        for m in pieces:
            sp._hold(m.entry)
        for m in removed:
            self._release(sp._unhold(m.entry))
        sp._set(tuple(kept))
        return new

    def _queue(self, q: list[tuple[Any, ...]], pid: int, start: int, end: int, pgoff: int,
               prot: int, flags: int, name: str, identity: Identity) -> bool:  # fmt: skip
        """``add_mapping`` of a MMAP2 of a pid whose mappings are deferred, queued: its binary
        resolved and held now, its Mapping built by ``_build``. False (nothing done) when it
        must be applied as usual: empty, overlapping a queued mapping, or past the queue's
        bound (a JIT's many mappings: built, deferral ends)."""
        if end <= start or len(q) >= 64:
            return False
        for e in q:
            if e[0] < end and start < e[1]:
                return False  # a cut: add_mapping builds the queue first
        if not prot & PROT_EXEC:
            return True  # a data mapping over nothing (the space is the queue): no change
        entry, bias = self._held(self.spaces[pid], pid, start, end, pgoff, name, identity)
        q.append((start, end, pgoff, prot, flags, name, identity, entry, bias))
        return True

    def _build(self, pid: int) -> None:
        """Insert ``pid``'s queued mappings (disjoint, into the space its exec emptied: no cut)
        and end its deferral."""
        q = self._queued.pop(pid)
        sp = self.spaces.get(pid)
        if not q or sp is None:
            return
        assert not sp._state.mappings
        q.sort(key=_start_of)
        sp._set(tuple([make_mapping(*e) for e in q]), [e[0] for e in q])

    def _new_mapping(self, sp: AddressSpace, pid: int, start: int, end: int, pgoff: int,
                     prot: int, flags: int, name: str, identity: Identity) -> Mapping:  # fmt: skip
        """The Mapping of an executable mapping, its binary resolved and held by ``sp``."""
        entry, bias = self._held(sp, pid, start, end, pgoff, name, identity)
        return make_mapping(start, end, pgoff, prot, flags, name, identity, entry, bias)

    def _held(self, sp: AddressSpace, pid: int, start: int, end: int, pgoff: int, name: str,
              identity: Identity) -> tuple[ElfEntry | None, int]:  # fmt: skip
        """The binary of an executable mapping, resolved and held by ``sp``, and its bias."""
        entry = self._resolve(pid, start, end, name, identity)
        bias = entry.bias_for(start, pgoff) if entry is not None and entry.usable else (
            start - pgoff
        )  # fmt: skip
        if not sp._hold(entry):
            self._release(entry)  # the space already had its one reference
        return entry, bias

    def _resolve(
        self, pid: int, start: int, end: int, filename: str, ident: Identity
    ) -> ElfEntry | None:
        if self.binaries is None:
            return None
        if filename == "[vdso]":
            return self.binaries.acquire_vdso()
        if not filename.startswith("/") or filename.startswith("//"):
            return None  # anon, [stack], //anon JIT code: no file (JIT: perfmaps.PerfMap)
        return self.binaries.acquire(
            pid, filename, start, end, build_id=ident.build_id, maj=ident.maj, min=ident.min,
            ino=ident.ino, ino_generation=ident.ino_generation,
        )  # fmt: skip

    def _release(self, entry: ElfEntry | None) -> None:
        """Give back the resolver's reference once a space stops mapping ``entry``."""
        if entry is not None and self.binaries is not None:
            self.binaries.release(entry)

    def _clear(self, sp: AddressSpace) -> None:
        if self.binaries is not None and sp._entries:
            self.binaries.release_all(list(sp._entries.values()))
        sp._refs.clear()
        sp._entries.clear()
        sp._set(())

    def exec(self, pid: int) -> None:
        if self._queued:
            self._queued.pop(pid, None)  # cleared below all the same: nothing to build
        sp = self.space_for(pid)
        self._clear(sp)
        self._unretire(sp)
        sp.from_proc_maps = False

    def fork(self, pid: int, ppid: int, start_time: int | None = None) -> None:
        """``start_time``: the child's starttime estimated from the record time, if known."""
        if pid == ppid:
            return  # a new thread: it shares its process's space
        if pid in self.spaces:
            self._drop(pid, "reused")  # pid reuse: whatever was there is gone
        child = self.space_for(pid)
        child.start_time = start_time
        child.verified_epoch = self.epoch
        parent = self.get(ppid)
        if parent is None:
            self.stats.ignored["fork_unknown_parent"] += 1
            return
        child._state = parent._state  # shared until either side changes (copy-on-write)
        child._refs = dict(parent._refs)
        child._entries = dict(parent._entries)
        if self.binaries is not None and child._entries:
            # the cache counts spaces: one more per binary
            self.binaries.retain_all(child._entries.values())

    def retire(self, pid: int, time: int | None = None) -> None:
        """The process exited at record time ``time``: every earlier sample of it has already
        been taken (records are applied in time order); later ones can only be late records,
        which ``reap``'s grace period leaves room for."""
        sp = self.spaces.get(pid)
        if sp is None or sp.retired:
            return
        sp.retired = True
        sp.retired_at = time if time is not None else 0
        self.retired[pid] = sp.retired_at
        if self.on_retire is not None:
            self.on_retire(pid)

    def _unretire(self, sp: AddressSpace) -> None:
        sp.retired = False
        sp.retired_at = None
        self.retired.pop(sp.pid, None)

    def drop(self, pid: int, reason: str = "manual") -> None:
        """Forget a pid for good, releasing its binaries."""
        if pid in self.spaces:
            self._drop(pid, reason)

    def _drop(self, pid: int, reason: str) -> None:
        if self._queued:
            self._queued.pop(pid, None)  # never built: its binaries are released below
        sp = self.spaces.pop(pid)
        self.retired.pop(pid, None)
        self._clear(sp)
        self.stats.drops[reason] += 1
        if self.on_drop is not None:
            self.on_drop(pid)

    def reap(self, now: int, grace: int, pinned: Container[int] = ()) -> int:
        """Drop spaces retired at or before ``now - grace`` (record time), except ``pinned``
        pids (samples of them still wait somewhere). Returns how many were dropped. O(dropped +
        pinned) per call: ``retired`` is in retire order, so the scan stops at the first young
        one."""
        due = []
        limit = now - grace
        for pid, t in self.retired.items():  # collected first: _drop changes the dict
            if t > limit:
                break
            if pid not in pinned:
                due.append(pid)
        for pid in due:
            self._drop(pid, "exit_grace")
        return len(due)

    def evict_to(self, cap: int, pinned: Container[int] = ()) -> int:
        """Drop spaces until at most ``cap`` remain: retired ones first (oldest retirement),
        then live ones least recently used (a rescan of /proc rebuilds them if they sample
        again). O(n log n) when over the cap, O(1) otherwise."""
        excess = len(self.spaces) - cap
        if excess <= 0:
            return 0
        n = 0
        for pid in list(self.retired):
            if n >= excess:
                return n
            if pid not in pinned:
                self._drop(pid, "cap_retired")
                n += 1
        live = sorted((sp.last_used, sp.pid) for sp in self.spaces.values() if not sp.retired)
        for _, pid in live:
            if n >= excess:
                break
            if pid not in pinned:
                self._drop(pid, "cap_live")
                n += 1
        return n

    def bump_epoch(self) -> None:
        """Records were lost: any space may have missed an exec, an exit or a pid reuse."""
        self.epoch += 1

    # -- /proc/<pid>/maps

    def load_proc_maps(self, pid: int, text: str) -> AddressSpace:
        """Replace ``pid``'s space with the executable mappings of its maps text."""
        return self.load_mappings(pid, [m for m in parse_proc_maps(text) if m.prot & PROT_EXEC])

    def load_mappings(
        self,
        pid: int,
        maps: Sequence[Mapping],
        mode: str = "replace",
        *,
        start_time: int | None = None,
    ) -> AddressSpace:
        """Merge executable mappings read from /proc/<pid>/maps (sorted, disjoint, as the
        kernel prints them) into ``pid``'s space; see the module doc for ``mode``. A
        ``start_time`` that differs from the space's known one means another process had the
        pid: the space is cleared first whatever the mode (counted as a "reused" drop).
        Cost: O(n + m) list work plus one resolver call per inserted mapping."""
        if mode not in MERGE_MODES:
            raise ValueError(f"mode must be one of {MERGE_MODES}, got {mode!r}")
        sp = self.get(pid)
        if sp is not None and start_time is not None and not self.same_process(sp, start_time):
            self._drop(pid, "reused")
            sp = None
        if sp is None:
            sp = self.space_for(pid)
        if mode == "replace":
            self._clear(sp)
        new = [m for m in maps if m.prot & PROT_EXEC and m.end > m.start]
        if mode == "fill":
            new = holes(sp.mappings, new)
        elif mode == "override":
            for m in new:
                kept, removed, pieces = cut(sp.mappings, m.start, m.end)
                for p in pieces:
                    sp._hold(p.entry)
                for r in removed:
                    self._release(sp._unhold(r.entry))
                sp._set(tuple(kept))
        if new:
            merged = list(sp.mappings)
            for m in new:
                entry = self._resolve(pid, m.start, m.end, m.filename, m.identity)
                bias = (entry.bias_for(m.start, m.pgoff) if entry is not None and entry.usable
                        else m.start - m.pgoff)  # fmt: skip
                if not sp._hold(entry):
                    self._release(entry)
                merged.append(replace(m, entry=entry, bias=bias))
            merged.sort(key=lambda m: m.start)
            sp._set(tuple(merged))
        elif mode == "replace":
            sp._set(())
        sp.from_proc_maps = True
        if mode == "replace":
            self._unretire(sp)  # a zombie's empty maps must not revive a space EXIT retired
        if start_time is not None:
            sp.start_time = start_time
            sp.start_exact = True
        sp.verified_epoch = self.epoch
        return sp

    @staticmethod
    def same_process(sp: AddressSpace, start_time: int, slack: int = 2) -> bool:
        """Whether ``start_time`` (exact, from /proc) is the process ``sp`` describes. An
        estimate from a FORK record's time may be off by the tick rounding (``slack`` ticks)."""
        if sp.start_time is None:
            return True  # nothing to compare: the caller's verification records it
        if sp.start_exact:
            return sp.start_time == start_time
        return abs(sp.start_time - start_time) <= slack
