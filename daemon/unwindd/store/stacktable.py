"""The stack store's compact stack table: stacks as bytes of interned frame ids, frames interned
once, independent of the process where possible.

Invariants:
- A frame is interned by what it is, not where it ran: its key is (dso, sym, offset, kernel,
  inlined, rel, file, line, decl_file, decl_line), and its ip after them where the stack keeps
  no delta for it. Under ASLR the same code has another absolute ip in every process, but
  ``ip - rel`` is constant per mapping (perf's map__map_ip: rel = ip - map start + pgoff), so
  a frame with a ``rel`` keys without its ip and the stack keeps the delta ``ip - rel``; a
  frame without one (kernel, unmapped) keys with its ip. Every frame is rebuilt equal (all
  eleven fields) to the one that was added: answers do not change.
- A stack is one ``bytes`` (``_encode``): a header (frames n, distinct deltas d), n uint32 frame
  ids, d int64 deltas, n uint8 delta indices (``NO_DELTA``: the ip is in the frame's key). The
  same frames in two processes loaded at the same addresses are one stack; the bytes are the
  interning key and carry their hash.
- Frames are reference-counted by the stacks that hold them and freed (their id reused) with
  the last one; a stack is freed only by the store, never while a snapshot may still read it,
  so ``frames``/``keys`` may run on a query thread while the owner adds (appends and slot
  writes of live ids only).
- Bytes: ``nbytes`` is what the table holds (the stacks' bytes objects, per-stack and per-frame
  overheads as tracemalloc measures them); strings (dso, sym, file) are shared with the
  symbolizer and not counted. Kept up to date as stacks come and go: O(1) to read.
- Cost: ``add`` is O(frames) (a key lookup per frame); ``free`` O(frames); ``frames`` O(frames)
  (one object per frame not in the caller's pool: querycache.py caches them); ``keys`` and
  ``refs`` O(frames) without building any frame.
"""

from __future__ import annotations

import struct
from array import array
from operator import attrgetter
from typing import Any

from ..source.records import frozen_maker
from ..unwind.stackfmt import UNKNOWN, Frame

Stack = tuple[Frame, ...]
FrameKey = tuple[Any, ...]  # dso, sym, offset, kernel, inlined, rel, file, line, decl_*[, ip]
FuncKey = tuple[str, str | None]
Pool = dict[tuple[int, int], tuple[FrameKey, Frame]]  # (id(frame key), ip) -> (key, frame)
_Keys = tuple[FuncKey, tuple[FuncKey, ...]]

NO_DELTA = 255  # delta index of a frame whose ip is in its key
_HEAD = struct.Struct("<II")
_DELTA_MIN, _DELTA_MAX = -(1 << 63), (1 << 63) - 1
_new_frame = frozen_maker(Frame)
_FIELDS = ("dso", "sym", "offset", "kernel", "inlined", "rel", "file", "line", "decl_file",
           "decl_line")  # fmt: skip
frame_key = attrgetter(*_FIELDS)  # a frame's key without its ip (FrameKey's first ten fields)
_key_ip = attrgetter(*_FIELDS, "ip")

# Bytes beyond the bytes objects' own size, as tracemalloc shows them retained (CPython 3.11+,
# 64-bit): per stack, its slots in the table's two dicts and its id int; per frame, its key
# tuple of 11 with its ints, its dict slot and its list slots.
STACK_OVERHEAD = 100
FRAME_BYTES = 266


def _size(b: bytes) -> int:
    """What CPython allocates for ``b`` (PyBytesObject: 33 bytes and the data, 8-aligned)."""
    return (33 + len(b) + 7) & ~7


class StackTable:
    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}  # encoding -> stack id
        self._enc: dict[int, bytes] = {}  # stack id -> encoding
        self._next = 0
        self._fids: dict[FrameKey, int] = {}
        self._fkeys: list[FrameKey | None] = []  # frame id -> key (None: free)
        self._frefs: list[int] = []  # frame id -> stacks holding it
        self._ffree: list[int] = []
        self.slots = 0  # sum of the stacks' lengths
        self.nbytes = 0  # stacks and frames, see the module docstring

    def __len__(self) -> int:
        return len(self._enc)

    def __contains__(self, sid: object) -> bool:
        return sid in self._enc

    @property
    def nframes(self) -> int:
        return len(self._fids)

    def encoded(self, sid: int) -> bytes:
        return self._enc[sid]

    def stack_bytes(self, sid: int) -> int:
        """The bytes ``sid`` adds to ``nbytes`` beyond its frames."""
        return _size(self._enc[sid]) + STACK_OVERHEAD

    def add(self, frames: Stack) -> tuple[int, bool]:
        """(stack id, whether it is new) of ``frames``."""
        enc, new_keys = self._encode(frames)
        sid = self._ids.get(enc)
        if sid is not None:
            if new_keys:
                self._unref(new_keys)  # interned by the lookup, but no new stack holds them
            return sid, False
        sid = self._next
        self._next += 1
        self._ids[enc] = sid
        self._enc[sid] = enc
        refs = self._frefs
        for fid in array("I", enc[8:8 + 4 * len(frames)]):
            refs[fid] += 1
        if new_keys:
            self._unref(new_keys)  # the lookup's hold; the stack's is counted above
        self.slots += len(frames)
        self.nbytes += _size(enc) + STACK_OVERHEAD
        return sid, True

    def free(self, sid: int) -> None:
        enc = self._enc.pop(sid)
        del self._ids[enc]
        n = _HEAD.unpack_from(enc)[0]
        self.slots -= n
        self.nbytes -= _size(enc) + STACK_OVERHEAD
        self._unref(array("I", enc[8:8 + 4 * n]))

    def _unref(self, fids: Any) -> None:
        refs, keys = self._frefs, self._fkeys
        for fid in fids:
            n = refs[fid] - 1
            refs[fid] = n
            if not n:
                key = keys[fid]
                keys[fid] = None
                del self._fids[key]
                self._ffree.append(fid)
                self.nbytes -= FRAME_BYTES

    def _encode(self, frames: Stack) -> tuple[bytes, list[int]]:
        """The stack's bytes, and the frame ids this call interned (held once each, so a
        stack that turns out to exist already releases them)."""
        fids, keys, refs = self._fids, self._fkeys, self._frefs
        ids = array("I")
        idx = bytearray()
        deltas: dict[int, int] = {}  # delta -> its index
        new: list[int] = []
        for f in frames:
            rel = f.rel
            if rel is None:
                key, di = _key_ip(f), NO_DELTA
            else:
                delta = f.ip - rel
                di = deltas.get(delta, NO_DELTA)
                if di == NO_DELTA and len(deltas) < NO_DELTA and _DELTA_MIN <= delta <= _DELTA_MAX:
                    di = deltas[delta] = len(deltas)
                # without the ip: one key per line of code in every process (a key of 10 never
                # equals one of 11)
                key = frame_key(f) if di != NO_DELTA else _key_ip(f)
            fid = fids.get(key)
            if fid is None:
                if self._ffree:
                    fid = self._ffree.pop()
                    keys[fid] = key
                    refs[fid] = 1
                else:
                    fid = len(keys)
                    keys.append(key)
                    refs.append(1)
                fids[key] = fid
                new.append(fid)
                self.nbytes += FRAME_BYTES
            ids.append(fid)
            idx.append(di)
        enc = (_HEAD.pack(len(ids), len(deltas)) + ids.tobytes()
               + array("q", list(deltas)).tobytes() + bytes(idx))  # fmt: skip
        return enc, new

    def stack_len(self, sid: int) -> int:
        return int(_HEAD.unpack_from(self._enc[sid])[0])

    def _frame_ids(self, sid: int) -> array[int]:
        enc = self._enc[sid]
        return array("I", enc[8:8 + 4 * _HEAD.unpack_from(enc)[0]])

    def frames(self, sid: int, pool: Pool | None = None) -> Stack:
        """The stack's frames, equal to those added: new objects, or those of ``pool``, which
        gets the new ones. A pool is keyed by the frame key's identity (frame ids are reused
        once freed; the entry holds its key, so the key's id is not) and the ip."""
        enc = self._enc[sid]
        n, d = _HEAD.unpack_from(enc)
        ids = array("I", enc[8:8 + 4 * n])
        o = 8 + 4 * n
        deltas = array("q", enc[o:o + 8 * d])
        idx = enc[o + 8 * d:]
        keys, make = self._fkeys, _new_frame
        out = []
        for fid, di in zip(ids, idx, strict=True):
            k = keys[fid]
            assert k is not None  # a stack's frames live while it does
            if di == NO_DELTA:
                dso, sym, offset, kernel, inlined, rel, file, line, dfile, dline, ip = k
            else:
                dso, sym, offset, kernel, inlined, rel, file, line, dfile, dline = k
                ip = rel + deltas[di]
            if pool is None:
                out.append(make(ip, dso, sym, offset, kernel, inlined, rel, file, line, dfile,
                                dline, None))  # fmt: skip
                continue
            hit = pool.get((id(k), ip))
            if hit is None or hit[0] is not k:
                hit = pool[(id(k), ip)] = (k, make(ip, dso, sym, offset, kernel, inlined, rel,
                                                   file, line, dfile, dline, None))  # fmt: skip
            out.append(hit[1])
        return tuple(out)

    def frame_keys(self, sid: int) -> list[FrameKey]:
        """The stack's frame keys, leaf first: the interned tuples, shared (read-only)."""
        enc = self._enc[sid]
        ids = array("I", enc[8:8 + 4 * _HEAD.unpack_from(enc)[0]])
        keys = self._fkeys  # a stack's frames live while it does: none of its keys is None
        return [keys[fid] for fid in ids]  # type: ignore[misc]

    def refs(self, sid: int) -> tuple[list[FrameKey], list[int]]:
        """The stack's frame keys (the interned tuples, shared: no frame is built) and its
        frames' ips, leaf first: what ``frames`` rebuilds each frame from."""
        enc = self._enc[sid]
        n, d = _HEAD.unpack_from(enc)
        o = 8 + 4 * n
        ks = self.frame_keys(sid)
        if not d:  # no delta: every ip is in its key
            return ks, [k[10] for k in ks]
        deltas = array("q", enc[o:o + 8 * d])
        return ks, [k[10] if di == NO_DELTA else k[5] + deltas[di]
                    for k, di in zip(ks, enc[o + 8 * d:], strict=True)]  # fmt: skip

    def keys(self, sid: int) -> _Keys | tuple[()]:
        """``queries.func_keys`` of the stack: (leaf function, distinct functions), a function
        being (symbol or UNKNOWN, dso), from the frame keys alone."""
        enc = self._enc[sid]
        n = _HEAD.unpack_from(enc)[0]
        if not n:
            return ()
        keys = self._fkeys  # a stack's frames live while it does: none of its keys is None
        out: list[FuncKey] = [(k[1] or UNKNOWN, k[0])  # type: ignore[index]
                              for k in map(keys.__getitem__, array("I", enc[8:8 + 4 * n]))]
        return out[0], tuple(dict.fromkeys(out))
