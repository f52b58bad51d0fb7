"""The stack store's compact stack table: stacks as bytes of interned frame ids, frames as
fixed-size rows of packed fields, independent of the process where possible.

Invariants:
- A frame is interned by what it is, not where it ran: its key is (dso, sym, offset, kernel,
  inlined, rel, file, line, decl_file, decl_line), and its ip after them where the stack keeps
  no delta for it. Under ASLR the same code has another absolute ip in every process, but
  ``ip - rel`` is constant per mapping (perf's map__map_ip: rel = ip - map start + pgoff), so
  a frame with a ``rel`` keys without its ip and the stack keeps the delta ``ip - rel``; a
  frame without one (kernel, unmapped) keys with its ip. Every frame is rebuilt equal (all
  eleven fields, the same types) to the one that was added: answers do not change.
- Frames: row ``fid`` of ``_rows`` (``_ROW``): the string ids of dso, sym, file and decl_file,
  offset, rel, ip (0 unless the key holds it), line, decl_line and flags (the two bools, which
  fields are None, whether the ip is in the key). Strings are interned once (``_strs``, id 0 is
  None) and counted by the frames that name them. ``_slots`` is an open-addressing index (linear
  probing, at most half full) from a row's hash to its frame id; the row's bytes are the key. A
  frame whose fields a row cannot hold exactly (a bool that is not True/False, an int out of
  range) keeps its key tuple in ``_odd`` instead (its row holds its dso, sym and flags).
- A stack is one ``bytes`` (``_encode``): a header (frames n, distinct deltas d, id width w),
  n frame ids of w bytes (2 when every id fits), d int64 deltas, n uint8 delta indices
  (``NO_DELTA``: the ip is in the frame's key). The same frames in two processes loaded at the
  same addresses are one stack; the bytes are the interning key and carry their hash.
- Frames are reference-counted by the stacks that hold them and freed (their id reused, their
  row's strings released) with the last one; a stack is freed only by the store, never while a
  snapshot may still read it, so ``frames``/``keys``/``refs`` may run on a query thread while
  the owner adds (new rows and rewrites of free ones only; the index is the owner's). A frame's
  ``_uids`` serial is never reused: a pool of rebuilt frames (querycache.py) keys on it.
- Bytes: ``nbytes`` is what the table holds beyond an empty one: the stacks' bytes objects and
  per-stack overheads as tracemalloc measures them, the containers' allocated sizes (rows,
  counts, serials, index, string table: free rows included) and each interned string with its
  object (the table may be its last holder). O(1) to read. The frame containers start over
  when the last frame goes.
- Cost: ``add`` is O(frames): a frame object seen earlier (remembered by identity while the
  caller holds it, see ``forget_frames``, and its frame lives) is one dict lookup, another one
  row packed and probed; with ``ips`` (a ``CodeStack``: frames named once by code, each at
  another ip per process) no frame is built, and the deltas and the frame ids of base frames
  seen before are found in C from their code slots (codeslots.py, cffi_build/stackenc.c: no
  Python step for such a frame; the new stack's frames are held there too), the others
  looked up as above; ``free`` O(frames); ``frames`` O(frames) (one object per frame not in the
  caller's pool); ``keys``, ``refs``, ``ips`` and ``frame_ids`` O(frames) without building any
  frame; the index grows and shrinks in amortized O(1) per frame.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from ..source.records import frozen_maker
from ..unwcore import check, ffi, lib
from ..unwind.stackfmt import UNKNOWN, Frame, at_ip
from .codeslots import CodeSlots

Stack = tuple[Frame, ...]
FrameKey = tuple[Any, ...]  # dso, sym, offset, kernel, inlined, rel, file, line, decl_*
FuncKey = tuple[str, str | None]
Pool = dict[tuple[int, int], Frame]  # (frame serial, ip) -> the frame rebuilt
KeyMemo = dict[int, FrameKey]  # frame id -> its key, filled by one query (``refs``)
_Keys = tuple[FuncKey, tuple[FuncKey, ...]]

NO_DELTA = 255  # delta index of a frame whose ip is in its key
_HEAD = struct.Struct("<IBB")  # frames, distinct deltas, id width (2 or 4)
_H = _HEAD.size
_DELTA_MIN, _DELTA_MAX = -(1 << 63), (1 << 63) - 1
_new_frame = frozen_maker(Frame)
_FIELDS = ("dso", "sym", "offset", "kernel", "inlined", "rel", "file", "line", "decl_file",
           "decl_line")  # fmt: skip
frame_key = attrgetter(*_FIELDS)  # a frame's key without its ip

# A frame's row: string ids of dso, sym, file, decl_file; offset, rel, ip; line, decl_line;
# flags. Packed ("<": no padding), so the bytes of a row are its key in the index.
_ROW = struct.Struct("<IIIIqQQIIB")
_W = _ROW.size
_DSO_SYM = struct.Struct("<II")  # a row's first two fields
_STRS = struct.Struct("<IIII")  # a row's string ids
_IP = struct.Struct("<Q")
_IP_AT = 32  # the ip's offset in a row
_REL_AT = 24  # the rel's offset
_KERNEL, _INLINED, _NO_OFFSET, _NO_REL, _NO_LINE, _NO_DLINE, _WITH_IP, _ODD = (
    1, 2, 4, 8, 16, 32, 64, 128)  # fmt: skip
_BOOL = (False, True)
_EMPTY, _GONE = -1, -2  # index slots without a frame (never used, freed)
_MIN_SLOTS = 8
_MEMO_MAX = 16384  # frame objects ``add`` remembers at most (see forget_frames)


# Bytes beyond the containers' and bytes objects' own sizes, as tracemalloc shows them
# retained (CPython 3.11+, 64-bit): per stack, its slots in the table's two dicts and its id
# int; per string, its id int; per odd frame, its key tuple with its ints and its dict slots.
STACK_OVERHEAD = 100
STRING_OVERHEAD = 32
ODD_FRAME_BYTES = 300


def _size(b: bytes) -> int:
    """What CPython allocates for ``b`` (PyBytesObject: 33 bytes and the data, 8-aligned)."""
    return (33 + len(b) + 7) & ~7


_KEYED = int(lib.UNW_ST_KEYED)
assert NO_DELTA == lib.UNW_ST_NO_DELTA


class _EncodeBufs:
    """unw_st_resolve's and unw_st_pack's out-arrays for stacks of up to ``n`` frames: about
    26 bytes a frame of the deepest stack the table was given (kept: most stacks fit)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.fids, self.miss = ffi.new("uint32_t[]", n), ffi.new("uint32_t[]", n)
        self.di, self.nd = ffi.new("uint8_t[]", n), ffi.new("uint32_t *")
        self.deltas = ffi.new("int64_t[]", NO_DELTA)
        self.out = ffi.new("uint8_t[]", 6 + 13 * n)


class StackTable:
    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}  # encoding -> stack id
        self._enc: dict[int, bytes] = {}  # stack id -> encoding
        self._next = 0
        self._serial = 0  # the last frame serial handed out
        self._reset_frames()
        self._base = self._containers()
        self._stack_bytes = 0
        self.slots = 0  # sum of the stacks' lengths
        self._bufs = _EncodeBufs(64)  # unw_st_resolve's out-arrays, grown to the deepest stack

    def _reset_frames(self) -> None:
        """An empty frame table (its containers as small as new)."""
        self._rows = bytearray()  # frame id -> row (_ROW)
        self._frefs = array("I")  # frame id -> stacks holding it (0: free)
        self._uids = array("Q")  # frame id -> its serial (0: free)
        self._ffree = array("I")
        self._slots = array("i", [_EMPTY]) * _MIN_SLOTS  # the index: frame ids by row hash
        self._used = 0  # index slots not _EMPTY
        self._live = 0  # frames interned
        self._odd: dict[int, FrameKey] = {}  # frame id -> its key, for frames no row holds
        self._odd_ids: dict[FrameKey, int] = {}
        self._strs: list[Any] = [None]  # string id -> string
        self._sids: dict[Any, int] = {None: 0}
        self._srefs = array("I", [0])  # string id -> rows naming it
        self._sfree = array("I")
        self._str_bytes = 0
        # id(frame object) -> (it, its frame id, that frame's serial): see forget_frames; a
        # CodeStack's base frames have code slots instead (they outlive the caller's batch)
        self._memo: dict[int, tuple[Frame, int, int]] = {}
        self._cslots = CodeSlots()

    def _containers(self) -> int:
        size = sys.getsizeof
        return (size(self._rows) + size(self._frefs) + size(self._uids) + size(self._ffree)
                + size(self._slots) + size(self._odd) + size(self._odd_ids) + size(self._strs)
                + size(self._sids) + size(self._srefs) + size(self._sfree))  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Stacks and frames, see the module docstring."""
        return (self._stack_bytes + self._str_bytes + ODD_FRAME_BYTES * len(self._odd)
                + self._containers() - self._base)  # fmt: skip

    def __len__(self) -> int:
        return len(self._enc)

    def __contains__(self, sid: object) -> bool:
        return sid in self._enc

    @property
    def nframes(self) -> int:
        return self._live

    def encoded(self, sid: int) -> bytes:
        return self._enc[sid]

    def stack_bytes(self, sid: int) -> int:
        """The bytes ``sid`` adds to ``nbytes`` beyond its frames."""
        return _size(self._enc[sid]) + STACK_OVERHEAD

    def add(self, frames: Stack, ips: Sequence[int] | None = None) -> tuple[int, bool]:
        """(stack id, whether it is new) of ``frames``; with ``ips``, of the stack whose frame
        ``i`` is ``stackfmt.at_ip(frames[i], ips[i])`` (a ``CodeStack``), without building
        those frames: frames keyed without their ip (a ``rel``) are found by identity as
        themselves, only the delta differs."""
        enc, new_ids = self._encode(frames) if ips is None else self._encode_at(frames, ips)
        sid = self._ids.get(enc)
        if sid is not None:
            if new_ids:
                self._unref(new_ids)  # interned by the lookup, but no new stack holds them
            return sid, False
        sid = self._next
        self._next += 1
        self._ids[enc] = sid
        self._enc[sid] = enc
        with ffi.from_buffer("uint32_t[]", self._frefs) as rp:  # each of its frames held once more
            check(lib.unw_st_hold(enc, len(enc), rp, len(self._frefs)), "unw_st_hold")
        if new_ids:
            self._unref(new_ids)  # the lookup's hold; the stack's is counted above
        self.slots += len(frames)
        self._stack_bytes += _size(enc) + STACK_OVERHEAD
        return sid, True

    def free(self, sid: int) -> None:
        enc = self._enc.pop(sid)
        del self._ids[enc]
        self.slots -= _HEAD.unpack_from(enc)[0]
        self._stack_bytes -= _size(enc) + STACK_OVERHEAD
        self._unref(_ids_of(enc))

    # -- frames

    def _unref(self, fids: Any) -> None:
        refs = self._frefs
        for fid in fids:
            n = refs[fid] - 1
            refs[fid] = n
            if not n:
                self._drop(fid)
        if not self._live:
            self._reset_frames()  # the rows and index as small as new
        elif self._live * 8 < len(self._slots) > _MIN_SLOTS:
            self._rehash()  # shrink the index after a wave of frees

    def _drop(self, fid: int) -> None:
        """Free frame ``fid`` (its last stack went): its index slot, strings and id."""
        o = fid * _W
        if self._rows[o + _W - 1] & _ODD:
            del self._odd_ids[self._odd.pop(fid)]
        else:
            row = bytes(self._rows[o:o + _W])
            slots, mask = self._slots, len(self._slots) - 1
            i = hash(row) & mask
            while slots[i] != fid:
                i = (i + 1) & mask
            slots[i] = _GONE
        srefs = self._srefs
        for s in _STRS.unpack_from(self._rows, o):
            if s:
                n = srefs[s] - 1
                srefs[s] = n
                if not n:
                    gone = self._strs[s]
                    self._strs[s] = None
                    del self._sids[gone]
                    self._sfree.append(s)
                    self._str_bytes -= sys.getsizeof(gone) + STRING_OVERHEAD
        self._uids[fid] = 0
        self._ffree.append(fid)
        self._live -= 1

    def _sid(self, s: Any) -> int:
        """The id of string ``s``, interned if new (one more row names it)."""
        sid = self._sids.get(s)
        if sid is None:
            if self._sfree:
                sid = self._sfree.pop()
                self._strs[sid] = s
                self._srefs[sid] = 1
            else:
                sid = len(self._strs)
                self._strs.append(s)
                self._srefs.append(1)
            self._sids[s] = sid
            self._str_bytes += sys.getsizeof(s) + STRING_OVERHEAD
        elif sid:
            self._srefs[sid] += 1
        return sid

    def _new_row(self, row: bytes | None, key: FrameKey, flags: int) -> int:
        """Intern a frame not in the table: ``row`` (string ids still unresolved: they are
        taken here) or, when None, the odd frame ``key``. Held once (the caller's)."""
        s = (self._sid(key[0]), self._sid(key[1]), self._sid(key[6]), self._sid(key[8]))
        if self._ffree:
            fid = self._ffree.pop()
            self._frefs[fid] = 1
        else:
            fid = len(self._frefs)
            self._frefs.append(1)
            self._uids.append(0)
            if (fid + 1) * _W > len(self._rows):
                # a new, larger bytearray (capacity doubles), never one resized in place: a
                # query thread may be reading the old one, and struct.unpack_from exports it
                # while it makes the values (an allocation may run a collection, whose
                # callbacks let this thread in); resizing an exported bytearray raises
                # BufferError. The old one stays valid for the rows it has.
                self._rows = self._rows + bytes(max(len(self._rows), 64 * _W))
        self._serial += 1
        self._uids[fid] = self._serial
        self._live += 1
        o = fid * _W
        if row is None:
            self._rows[o:o + _W] = _ROW.pack(*s, 0, 0, 0, 0, 0, flags | _ODD)
            self._odd[fid] = key
            self._odd_ids[key] = fid
            return fid
        row = _STRS.pack(*s) + row[16:]
        self._rows[o:o + _W] = row
        slots, mask = self._slots, len(self._slots) - 1
        i = hash(row) & mask
        while slots[i] >= 0:
            i = (i + 1) & mask
        if slots[i] == _EMPTY:
            self._used += 1
        slots[i] = fid
        if 2 * self._used > len(self._slots):
            self._rehash()
        return fid

    def _rehash(self) -> None:
        """A new index at most a third full (and no fewer than _MIN_SLOTS slots)."""
        n = _MIN_SLOTS
        while n < 3 * self._live:
            n *= 2
        slots, mask, rows = array("i", [_EMPTY]) * n, n - 1, self._rows
        for fid, uid in enumerate(self._uids):
            o = fid * _W
            if uid and not rows[o + _W - 1] & _ODD:
                i = hash(bytes(rows[o:o + _W])) & mask
                while slots[i] != _EMPTY:
                    i = (i + 1) & mask
                slots[i] = fid
        self._slots, self._used = slots, self._live - len(self._odd)

    def _encode(self, frames: Stack) -> tuple[bytes, list[int]]:
        """The stack's bytes, and the frame ids this call interned (held once each, so a
        stack that turns out to exist already releases them)."""
        memo, uids = self._memo, self._uids
        ids = array("I")
        idx = bytearray()
        deltas: dict[int, int] = {}  # delta -> its index
        new: list[int] = []
        for f in frames:
            rel = f.rel
            if rel is None:
                di = NO_DELTA
            else:
                delta = f.ip - rel
                di = deltas.get(delta, NO_DELTA)
                if di == NO_DELTA and len(deltas) < NO_DELTA and _DELTA_MIN <= delta <= _DELTA_MAX:
                    di = deltas[delta] = len(deltas)
            # the same frame object again (a process's stacks share theirs): its frame id,
            # while that frame still lives (its serial unchanged)
            hit = memo.get(id(f))
            if (hit is not None and hit[0] is f and uids[hit[1]] == hit[2]
                    and (di != NO_DELTA or rel is None)):  # fmt: skip
                fid = hit[1]
            else:
                fid = self._lookup(f, di, new)
                if di != NO_DELTA or rel is None:
                    if len(memo) >= _MEMO_MAX:
                        memo.clear()
                    memo[id(f)] = (f, fid, uids[fid])
            ids.append(fid)
            idx.append(di)
        return _pack(ids, deltas, idx), new

    def _encode_at(self, frames: Stack, ips: Sequence[int]) -> tuple[bytes, list[int]]:
        """``_encode`` of the stack whose frame ``i`` is ``frames[i]`` at ``ips[i]`` (``add``):
        a frame keyed without its ip is found as ``frames[i]`` itself (its code slot, then its
        row), the stack keeps the delta of ``ips[i]``; one keyed with its ip is looked up at
        that ip. The deltas and the frame ids the slots resolve are C's (``unw_st_resolve``);
        the other frames are looked up here, and their slots resolved when they key as
        themselves."""
        n = len(frames)
        if len(ips) != n:
            raise ValueError(f"{n} frames, {len(ips)} ips")
        slots = self._cslots.slots_of(frames)
        try:
            at = ips if isinstance(ips, array) and ips.typecode == "Q" else array("Q", ips)
        except OverflowError:
            at = None
        if slots is None or at is None:
            return self._encode_at_py(frames, ips)
        b = self._bufs if n <= self._bufs.n else self._grow_bufs(n)
        uids, cs = self._uids, self._cslots
        with (ffi.from_buffer("uint64_t[]", at) as ap,
              ffi.from_buffer("uint64_t[]", cs.words) as wp,
              ffi.from_buffer("uint64_t[]", uids) as up):  # fmt: skip
            nmiss = lib.unw_st_resolve(n, slots, len(cs), wp, ap, up, len(uids), b.fids, b.di,
                                       b.deltas, b.nd, b.miss)  # fmt: skip
        assert nmiss >= 0  # (every slot is one of ``cs``'s)
        new: list[int] = []
        if nmiss:
            fids, di, resolve = b.fids, b.di, cs.resolve
            for m in ffi.unpack(b.miss, nmiss):
                i = m & ~_KEYED
                f = frames[i]
                if m & _KEYED:
                    fid = fids[i] = self._lookup(f, di[i], new)
                    resolve(slots[i], fid, uids[fid])
                else:
                    ip = at[i]
                    fids[i] = self._lookup(f if ip == f.ip else at_ip(f, ip), di[i], new)
        m = lib.unw_st_pack(n, b.fids, b.deltas, b.nd[0], b.di, b.out)
        return ffi.buffer(b.out, m)[:], new

    def _grow_bufs(self, n: int) -> _EncodeBufs:
        self._bufs = _EncodeBufs(max(n, 2 * self._bufs.n))
        return self._bufs

    def _encode_at_py(self, frames: Stack, ips: Sequence[int]) -> tuple[bytes, list[int]]:
        """``_encode_at`` frame by frame, for a stack C cannot take (an ip or rel that is not a
        u64)."""
        ids = array("I")
        idx = bytearray()
        deltas: dict[int, int] = {}  # delta -> its index
        new: list[int] = []
        for f, ip in zip(frames, ips, strict=True):
            rel = f.rel
            if rel is None:
                di = NO_DELTA
            else:
                delta = ip - rel
                di = deltas.get(delta, NO_DELTA)
                if di == NO_DELTA and len(deltas) < NO_DELTA and _DELTA_MIN <= delta <= _DELTA_MAX:
                    di = deltas[delta] = len(deltas)
            keyed = di != NO_DELTA or (rel is None and ip == f.ip)
            ids.append(self._lookup(f if keyed or ip == f.ip else at_ip(f, ip), di, new))
            idx.append(di)
        return _pack(ids, deltas, idx), new

    def forget_frames(self) -> None:
        """Let go of the frame objects ``add`` remembers by identity (the caller's batch is
        done: the table keeps no frame objects for longer), but for those of ``CodeStack``s
        (``add``'s ``ips``): see ``sweep_code_frames``."""
        self._memo.clear()

    def sweep_code_frames(self) -> None:
        """Let go of the ``CodeStack`` base frames ``add`` remembers by identity that only it
        still holds. Those the caller holds stay remembered across its batches (the live
        step's frames by code, held for its context's life: every new process's stacks are
        made of them, and each would otherwise be looked up again per batch). O(frames
        remembered): the store calls it every few batches (``StackStore._sweep``)."""
        self._cslots.sweep()

    def _lookup(self, f: Frame, di: int, new: list[int]) -> int:
        """The id of frame ``f``'s key (with its ip when ``di`` is NO_DELTA), interned if new
        (then appended to ``new``)."""
        key = frame_key(f)
        dso, sym, offset, kernel, inlined, rel, file, line, dfile, dline = key
        ip = f.ip
        # a bool that is not True/False, or an int a row cannot hold, keys as its tuple: it
        # is rebuilt as it came
        fl = _KERNEL if kernel is True else 0 if kernel is False else _ODD
        if inlined is True:
            fl |= _INLINED
        elif inlined is not False:
            fl = _ODD
        if offset is None:
            fl |= _NO_OFFSET
            offset = 0
        if rel is None:
            fl |= _NO_REL
            rel = 0
        if line is None:
            fl |= _NO_LINE
            line = 0
        if dline is None:
            fl |= _NO_DLINE
            dline = 0
        if di == NO_DELTA:
            fl |= _WITH_IP  # without it, one key per line of code in every process
        else:
            ip = 0
        sids = self._sids
        a, b, c, e = sids.get(dso), sids.get(sym), sids.get(file), sids.get(dfile)
        known = a is not None and b is not None and c is not None and e is not None
        row: bytes | None = None
        if not fl & _ODD:
            try:
                row = (_ROW.pack(a, b, c, e, offset, rel, ip, line, dline, fl) if known
                       else _ROW.pack(0, 0, 0, 0, offset, rel, ip, line, dline, fl))  # fmt: skip
            except struct.error:
                pass
        if row is None:  # odd
            if fl & _WITH_IP:
                key = (*key, f.ip)
            fid = self._odd_ids.get(key, -1)
        else:  # a string not interned yet: a new frame
            fid = self._find(row) if known else -1
        if fid < 0:
            fid = self._new_row(row, key, fl & ~_ODD)
            new.append(fid)
        return fid

    def _find(self, row: bytes) -> int:
        """The frame id of ``row``, or -1."""
        slots, rows, mask = self._slots, self._rows, len(self._slots) - 1
        i = hash(row) & mask
        while True:
            fid = slots[i]
            if fid == _EMPTY:
                return -1
            if fid >= 0 and rows[fid * _W:fid * _W + _W] == row:
                return fid
            i = (i + 1) & mask

    def frame_key(self, fid: int) -> FrameKey:
        """Frame ``fid``'s key without its ip (dso, sym, offset, kernel, inlined, rel, file,
        line, decl_file, decl_line): a new tuple."""
        dso, sym, file, dfile, offset, rel, _, line, dline, fl = _ROW.unpack_from(
            self._rows, fid * _W)
        if fl & _ODD:
            return self._odd[fid][:10]
        strs = self._strs
        return (strs[dso], strs[sym], None if fl & _NO_OFFSET else offset, _BOOL[fl & 1],
                _BOOL[fl >> 1 & 1], None if fl & _NO_REL else rel, strs[file],
                None if fl & _NO_LINE else line, strs[dfile],
                None if fl & _NO_DLINE else dline)  # fmt: skip

    def _ip(self, fid: int) -> int:
        """The ip in frame ``fid``'s key (one with _WITH_IP)."""
        if fid in self._odd:
            return int(self._odd[fid][10])
        return int(_IP.unpack_from(self._rows, fid * _W + _IP_AT)[0])

    # -- stacks

    def stack_len(self, sid: int) -> int:
        return int(_HEAD.unpack_from(self._enc[sid])[0])

    def frame_ids(self, sid: int) -> array[int]:
        """The stack's frame ids, leaf first. A frame id names one frame while a stack
        holding it lives (a query's stacks do while it runs)."""
        return _ids_of(self._enc[sid])

    def frames(self, sid: int, pool: Pool | None = None) -> Stack:
        """The stack's frames, equal to those added: new objects, or those of ``pool``, which
        gets the new ones. A pool is keyed by the frame's serial (never reused, unlike its id)
        and the ip."""
        enc = self._enc[sid]
        n, d, w = _HEAD.unpack_from(enc)
        o = _H + w * n
        ids = array("H" if w == 2 else "I", enc[_H:o])
        deltas = array("q", enc[o:o + 8 * d])
        idx = enc[o + 8 * d:]
        rows, strs, uids, unpack, make = self._rows, self._strs, self._uids, _ROW.unpack_from, \
            _new_frame  # fmt: skip
        out = []
        for fid, di in zip(ids, idx, strict=True):
            dso, sym, file, dfile, offset, rel, ip, line, dline, fl = unpack(rows, fid * _W)
            if fl & _ODD:
                k = self._odd[fid]
                ip = k[10] if di == NO_DELTA else k[5] + deltas[di]
            elif di != NO_DELTA:
                ip = rel + deltas[di]
            if pool is not None:
                pk = (uids[fid], ip)
                hit = pool.get(pk)
                if hit is not None:
                    out.append(hit)
                    continue
            if fl & _ODD:
                f = make(ip, *self._odd[fid][:10], None)
            else:
                f = make(ip, strs[dso], strs[sym], None if fl & _NO_OFFSET else offset,
                         _BOOL[fl & 1], _BOOL[fl >> 1 & 1], None if fl & _NO_REL else rel,
                         strs[file], None if fl & _NO_LINE else line, strs[dfile],
                         None if fl & _NO_DLINE else dline, None)  # fmt: skip
            if pool is not None:
                pool[pk] = f
            out.append(f)
        return tuple(out)

    def refs(self, sid: int, memo: KeyMemo) -> tuple[list[FrameKey], list[int]]:
        """The stack's frame keys and its frames' ips, leaf first: what ``frames`` rebuilds
        each frame from, without building one. A key is made once per frame id into ``memo``
        (one query's, so the keys it hands out stay alive and distinct while it runs)."""
        enc = self._enc[sid]
        n, d, w = _HEAD.unpack_from(enc)
        o = _H + w * n
        ids = array("H" if w == 2 else "I", enc[_H:o])
        get = memo.get
        ks = []
        for fid in ids:
            k = get(fid)
            if k is None:
                k = memo[fid] = self.frame_key(fid)
            ks.append(k)
        deltas = array("q", enc[o:o + 8 * d])
        ip_of = self._ip
        return ks, [ip_of(fid) if di == NO_DELTA else k[5] + deltas[di]
                    for fid, k, di in zip(ids, ks, enc[o + 8 * d:], strict=True)]  # fmt: skip

    def frame_bound(self) -> int:
        """One more than the largest frame id (rows, free ones included)."""
        return len(self._rows) // _W

    def ips(self, sid: int) -> tuple[array[int], list[int]]:
        """The stack's frame ids and its frames' ips, leaf first: ``refs`` without a key (a
        frame's ``rel`` read from its row)."""
        enc = self._enc[sid]
        n, d, w = _HEAD.unpack_from(enc)
        o = _H + w * n
        ids = array("H" if w == 2 else "I", enc[_H:o])
        deltas = array("q", enc[o:o + 8 * d])
        rows, odd, ip_of, q = self._rows, self._odd, self._ip, _IP.unpack_from
        return ids, [ip_of(fid) if di == NO_DELTA
                     else (odd[fid][5] if fid in odd else q(rows, fid * _W + _REL_AT)[0])
                     + deltas[di]
                     for fid, di in zip(ids, enc[o + 8 * d:], strict=True)]  # fmt: skip

    def keys(self, sid: int) -> _Keys | tuple[()]:
        """``queries.func_keys`` of the stack: (leaf function, distinct functions), a function
        being (symbol or UNKNOWN, dso), from the rows alone."""
        ids = _ids_of(self._enc[sid])
        if not ids:
            return ()
        rows, strs, unpack = self._rows, self._strs, _DSO_SYM.unpack_from
        out: list[FuncKey] = []
        for fid in ids:
            dso, sym = unpack(rows, fid * _W)
            out.append((strs[sym] or UNKNOWN, strs[dso]))
        return out[0], tuple(dict.fromkeys(out))


def _pack(ids: array[int], deltas: dict[int, int], idx: bytearray) -> bytes:
    """A stack's bytes: its header, frame ids, distinct deltas and delta indices."""
    w = 2 if not ids or max(ids) < 1 << 16 else 4
    return (_HEAD.pack(len(ids), len(deltas), w)
            + (array("H", ids).tobytes() if w == 2 else ids.tobytes())
            + array("q", list(deltas)).tobytes() + bytes(idx))  # fmt: skip


def _ids_of(enc: bytes) -> array[int]:
    """The frame ids of a stack's bytes."""
    n, _, w = _HEAD.unpack_from(enc)
    return array("H" if w == 2 else "I", enc[_H:_H + w * n])
