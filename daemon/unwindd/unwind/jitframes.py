"""JIT frames in unwound stacks: which frames are a JIT's code, and what the walks through them
gave (``JitStats``: the metrics' ``unwindd_jit_frames_total`` and ``/v1/status``'s ``jit``).

A JIT's code lives in executable memory without a file (procs/space.py ``is_jit_name``: perf's
"//anon", an empty or "[anon:...]" name in /proc/<pid>/maps, a memfd). The unwinder walks it
by frame pointer (unwind.c's fallback for modules without a table); the engine names its
frames from /tmp/perf-<pid>.map when the JIT writes one (V8's --perf-basic-prof, HotSpot's
-XX:+DumpPerfMapAtExit), as perf does (tools/perf/util/map.c map__new: "//anon" maps are
looked up in /tmp/perf-%d.map), else from the jitdump the process maps (V8's --perf-prof:
binaries/jitdump.py; perf reads it in perf inject --jit).

Invariants:
- A frame's kind is a function of the frame alone (``jit_kind``): "perf_map" (named from the
  perf map: its dso is the map's path), "jitdump" (named from a jitdump: its dso is the
  dump's path), "anonymous" (in JIT code, unnamed), else None.
- A stack is complete when its outermost user frame is a thread's first frame as perf prints
  it: ``_start`` (the main thread) or ``clone``/``clone3`` (every other one) (``OUTERMOST``).
- ``JitStats.count`` counts each sample once: its JIT frames by kind, and, when it has any, the
  sample under its runtime (the base name of its process's executable), complete or not.
  Runtimes are a bounded label set in practice (one per JIT-running executable); past
  ``MAX_RUNTIMES`` the rest count under "other".
- Cost: a stack tuple seen before (profiles repeat stacks, and the engine hands out the same
  tuple object for the same stack) is one dict lookup by identity; a new one is one pass over
  its frames, a dict lookup per frame (kinds memoized per dso, at most ``_MAX_DSOS``). At
  most ``_MAX_STACKS`` stack tuples are held (then the cache is cleared), and none of a
  dropped live context (``forget``: the live step calls it with each new context, so
  the cache never keeps a dropped context's stacks, and their frames, alive).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from ..binaries.jitdump import is_jitdump_path
from ..lightdc import dataclass, field
from ..procs.space import is_jit_name
from .stackfmt import Frame

__all__ = ["JIT_KINDS", "OUTERMOST", "JitStats", "jit_kind", "stack_jit"]

JIT_KINDS = ("perf_map", "jitdump", "anonymous")
OUTERMOST = frozenset({"_start", "clone", "clone3"})
_KIND_INDEX = {k: i for i, k in enumerate(JIT_KINDS)}
MAX_RUNTIMES = 64
_MAX_STACKS = 1 << 16
_MAX_DSOS = 4096
_DSO_KINDS: dict[str, tuple[str | None, str | None]] = {}  # _dso_kinds' memo


def _dso_kinds(dso: str) -> tuple[str | None, str | None]:
    """A user frame's kind by its dso alone: (unnamed frame's, named frame's); memoized per dso
    (a bounded set: the binaries, maps and dumps mapped), so a stack costs a dict lookup per
    frame, not a path parse."""
    kinds = _DSO_KINDS.get(dso)
    if kinds is None:
        if dso.startswith("/tmp/perf-") and dso.endswith(".map"):
            kinds = ("perf_map", "perf_map")
        else:
            anon = "anonymous" if is_jit_name(dso) else None
            kinds = (anon, "jitdump" if is_jitdump_path(dso) else anon)
        if len(_DSO_KINDS) >= _MAX_DSOS:
            _DSO_KINDS.clear()
        _DSO_KINDS[dso] = kinds
    return kinds


def jit_kind(f: Frame) -> str | None:
    """"perf_map", "jitdump", "anonymous" or None (not a JIT frame): see the module doc."""
    dso = f.dso
    if f.kernel or dso is None:
        return None
    return _dso_kinds(dso)[f.sym is not None]


def stack_jit(frames: Sequence[Frame]) -> tuple[tuple[int, ...], bool]:
    """(JIT frames per kind in ``JIT_KINDS`` order, complete) of one stack, leaf first."""
    counts = [0] * len(JIT_KINDS)
    last = None
    memo, index = _DSO_KINDS, _KIND_INDEX
    for f in frames:
        if f.kernel:
            continue
        last = f
        dso = f.dso
        if dso is None:
            continue
        kinds = memo.get(dso)
        if kinds is None:
            kinds = _dso_kinds(dso)
        k = kinds[f.sym is not None]
        if k is not None:
            counts[index[k]] += 1
    return tuple(counts), last is not None and last.sym in OUTERMOST


@dataclass
class JitStats:
    """Counts of JIT frames and of stacks that crossed them (see the module doc).
    ``runtime_of(pid)``: the runtime name of a process (None: "unknown")."""

    runtime_of: Callable[[int | None], str | None] = lambda pid: None
    frames: Counter[str] = field(default_factory=Counter)  # kind -> frames
    stacks: Counter[str] = field(default_factory=Counter)  # runtime -> samples crossing JIT code
    complete: Counter[str] = field(default_factory=Counter)  # runtime -> ... reaching OUTERMOST
    _seen: dict[int, tuple[Sequence[Frame], tuple[int, ...], bool]] = field(default_factory=dict)

    def count(self, pid: int | None, frames: Sequence[Frame], n: int = 1) -> None:
        """Count ``n`` samples of ``frames`` taken in process ``pid``."""
        hit = self._seen.get(id(frames))
        if hit is None or hit[0] is not frames:
            if len(self._seen) >= _MAX_STACKS:
                self._seen.clear()
            hit = self._seen[id(frames)] = (frames, *stack_jit(frames))  # holds it: id stays
        _, counts, done = hit
        if not any(counts):
            return
        for k, c in zip(JIT_KINDS, counts, strict=True):
            if c:
                self.frames[k] += c * n
        rt = self.runtime_of(pid) or "unknown"
        if rt not in self.stacks and len(self.stacks) >= MAX_RUNTIMES:
            rt = "other"
        self.stacks[rt] += n
        if done:
            self.complete[rt] += n

    def forget(self) -> None:
        """Drop the held stack tuples: their owner (the live step's context) dropped its
        own, and this cache alone would keep their frames alive."""
        self._seen.clear()

    def status(self) -> dict[str, object]:
        """``/v1/status``'s ``jit``: frames by kind, and per runtime the samples whose stack
        crossed JIT code and how many of them reached a thread's first frame."""
        return {
            "frames": {k: self.frames[k] for k in JIT_KINDS},
            "runtimes": {rt: {"samples": n, "complete": self.complete[rt]}
                         for rt, n in sorted(self.stacks.items())},
        }  # fmt: skip
