"""Code slots: the stack table's memory of the ``CodeStack`` base frames it was given, laid out
for C (cffi_build/stackenc.c ``unw_st_resolve``), so that a stack of frames seen before is
encoded without a Python step per frame.

Invariants:
- A slot is one base frame object (remembered by identity: the slot holds it, so its ``id``
  names no other object while the slot exists) and ``WORDS`` u64 words: its frame id in the
  table | flags << 32, the table's serial of that frame id when resolved (0: not yet), its
  ``rel`` and its ``ip``. A frame whose ``ip`` or ``rel`` is not a u64 gets no slot (its
  stacks are encoded in Python).
- A resolution is the table's (``resolve``): the frame id ``_encode_at`` would give the frame
  keyed as itself (with its delta, or at its own ip when it has no ``rel``); C takes it only
  while the table's ``uids[fid]`` is still that serial.
- Memory: at most ``MAX_SLOTS`` slots (past that they start over: a miss only costs a
  look-up); per slot ``WORDS`` u64 words,
  one list entry and one dict entry with its two ints (the frames are the caller's: a slot
  keeps one alive only until ``sweep``, which keeps only the frames someone else still holds,
  renumbered).
Cost: ``slots_of`` one C-level pass over a stack's frames plus O(new frames) Python.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from itertools import repeat

from ..unwcore import lib
from ..unwind.stackfmt import Frame

WORDS = int(lib.UNW_ST_WORDS)
HAS_REL = int(lib.UNW_ST_HAS_REL)
MAX_SLOTS = 16384
_U64 = 1 << 64


def _refcounts(frames: list[Frame]) -> list[int]:
    return [sys.getrefcount(f) for f in frames]


_ONLY_OURS = _refcounts([Frame(0, None, None, None)])[0]  # a frame only the slots hold


class CodeSlots:
    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._of: dict[int, int] = {}  # id(frame) -> its slot
        self._frames: list[Frame] = []  # slot -> the frame (held: its id stays its own)
        self.words = array("Q")

    def __len__(self) -> int:
        return len(self._frames)

    def slots_of(self, frames: Sequence[Frame]) -> list[int] | None:
        """The slot of each of ``frames`` (new ones made), or None when one cannot have one."""
        of = self._of
        out = list(map(of.get, map(id, frames), repeat(-1)))
        if -1 not in out:
            return out
        if len(self._frames) + len(out) > MAX_SLOTS:
            self.clear()  # (the slots found above are gone with it: every frame anew)
            of = self._of
            out = [-1] * len(out)
        i = out.index(-1)
        while True:
            f = frames[i]
            s = of.get(id(f))  # (made for an earlier place in this stack)
            if s is None:
                ip, rel = f.ip, f.rel
                if not 0 <= ip < _U64 or (rel is not None and not 0 <= rel < _U64):
                    return None
                s = of[id(f)] = len(self._frames)
                self._frames.append(f)
                self.words.extend((0 if rel is None else HAS_REL << 32, 0, rel or 0, ip))
            out[i] = s
            try:
                i = out.index(-1, i + 1)
            except ValueError:
                return out

    def resolve(self, slot: int, fid: int, serial: int) -> None:
        """Slot ``slot``'s frame keyed as itself is the table's frame ``fid`` of ``serial``."""
        w = self.words
        o = slot * WORDS
        w[o] = (w[o] >> 32 << 32) | fid
        w[o + 1] = serial

    def sweep(self) -> None:
        """Let go of the frames only the slots hold; the others keep their resolutions under
        new slot numbers. O(slots)."""
        keep = [s for s, n in enumerate(_refcounts(self._frames)) if n > _ONLY_OURS]
        if len(keep) == len(self._frames):
            return
        frames, words = self._frames, self.words
        self.clear()
        for s in keep:
            f = frames[s]
            self._of[id(f)] = len(self._frames)
            self._frames.append(f)
            self.words.extend(words[s * WORDS : (s + 1) * WORDS])
