"""Unwound, symbolized samples and their three renderings: JSON lines, folded stacks, and perf
script's callchain text.

Invariants:
- Value types only: an ``UnwoundSample`` is the complete answer for one sample (who, when, how
  the unwind ended, every frame leaf first with kernel frames first); renderers are pure
  functions of it. A ``CodeStack`` stands for a stack's frames (``frames()`` builds them)
  where they are frames by code at other addresses (``at_ip``).
- ``perf_script`` reproduces ``perf script -F comm,pid,tid,time,ip,sym,dso --ns`` byte for byte
  for the fields it prints (tools/perf/builtin-script.c ``perf_sample__fprintf_start`` and
  util/evsel_fprintf.c ``sample__fprintf_callchain``): ``comm`` then ``%5d/%-5d``, the time as
  ``%5lu.%09llu:``, then one ``\\t%16x sym (dso)`` line per frame (the address perf prints:
  ``Frame.rel``) and an empty line. A sample of an event without a call graph
  (``STATUS_IP_ONLY``) is one line, as perf prints it (builtin-script.c: comm as ``%16s``,
  then `` %16x sym (dso)`` of the absolute ip after the time: ``sample__fprintf_sym``).
- ``folded`` follows flamegraph.pl's stackcollapse-perf.pl: ``comm;outermost;...;leaf count``,
  kernel frames suffixed ``_[k]`` like its ``--kernel`` option so they stay apart from user
  frames.
- A frame without a symbol is named ``UNKNOWN`` (``[unknown]``) everywhere a name is shown
  (``frame_name``: folded, perf script, the store's top and pprof, ``unwindctl watch``), as
  perf does: util/evsel_fprintf.c prints ``[unknown]`` for a frame without a symbol and
  names its binary in the ``(dso)`` column, and perf's stackcollapse.py
  (tools/perf/scripts/python) folds it as ``[unknown]``. Its binary is shown only where the
  output has a place for it (perf script's ``(dso)``, jsonl's ``dso``, top's DSO column,
  pprof's mapping). The native replay renders frames through these functions too
  (replaytext.py; fold.c only joins the names it is given).
- Cost: O(frames) per sample. A ``Frame`` hashes its fields once (cached; equality is the
  dataclass's, over the eleven fields only), so interning a new stack costs one call per frame.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from ..lightdc import dataclass, field
from ..source.records import frozen_maker


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame of a stack, named: its ip, binary, symbol and offset, and how perf shows it."""

    ip: int
    dso: str | None
    sym: str | None
    offset: int | None
    kernel: bool = False
    inlined: bool = False
    # What perf script prints for the frame: the address inside the dso as perf's map__map_ip
    # computes it (ip - map start + pgoff) for user frames, ip itself for kernel frames.
    rel: int | None = None
    # Where the frame is in the source: the file and line of its pc (for an inlined frame, of
    # the code inlined there; for the frame an inline chain sits in, of the call site), from
    # DWARF line tables or an interpreter's own frames; None where nothing says.
    file: str | None = None
    line: int | None = None
    # Where the frame's function starts in the source (DWARF DW_AT_decl_file and
    # DW_AT_decl_line of its subprogram, or of what an inlined frame inlined): pprof's
    # Function.filename and start_line. None where nothing says.
    decl_file: str | None = None
    decl_line: int | None = None
    # The hash of the eleven fields above, computed on first use: the store hashes a new
    # stack's frames tuple twice (lookup, insert) and a process's stacks share most frames,
    # so each frame would otherwise hash its 11-tuple many times. Not compared, not shown,
    # not pickled (str hashes differ between interpreters).
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = hash((self.ip, self.dso, self.sym, self.offset, self.kernel, self.inlined,
                      self.rel, self.file, self.line, self.decl_file, self.decl_line))  # fmt: skip
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.ip, self.dso, self.sym, self.offset, self.kernel, self.inlined, self.rel,
                self.file, self.line, self.decl_file, self.decl_line)  # fmt: skip

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for name, v in zip(_FRAME_FIELDS, state, strict=True):
            object.__setattr__(self, name, v)
        object.__setattr__(self, "_hash", None)

    def __repr__(self) -> str:
        where = f"{self.sym}+{self.offset:#x}" if self.sym and self.offset else self.sym
        k = " [k]" if self.kernel else ""
        return f"Frame({self.ip:#x} {where or UNKNOWN} in {self.dso or UNKNOWN}{k})"


_FRAME_FIELDS = ("ip", "dso", "sym", "offset", "kernel", "inlined", "rel", "file", "line",
                 "decl_file", "decl_line")  # fmt: skip
_new_frame = frozen_maker(Frame)


def at_ip(f: Frame, ip: int) -> Frame:
    """``f`` at ``ip``, another address of the same code: every other field the same (frames
    by code, fastpath.h fp_ctx_code_frames: a binary address is named once, and its name,
    inline levels and ``rel`` are the same wherever a process maps it)."""
    return _new_frame(ip, f.dso, f.sym, f.offset, f.kernel, f.inlined, f.rel, f.file, f.line,
                      f.decl_file, f.decl_line, None)  # fmt: skip


class CodeStack:
    """A stack as frames named by code and the ip each one has in its process: ``frames()`` is
    ``at_ip(base[i], ips[i])`` for each frame (``base[i]`` itself where the ips agree). The
    base frames are shared by every process that runs that code (frames by code,
    fp_ctx_code_frames), so a new process of a known binary costs one ip per frame here, not
    a ``Frame``; the store interns it from the base frames and the ips (StackTable.add's
    ``ips``) without building its frames. ``frames()`` builds them once, on first use.
    Compared and hashed by identity (an owner's handle on one stack of one process)."""

    __slots__ = ("_frames", "base", "ips")

    def __init__(self, base: tuple[Frame, ...], ips: array[int]) -> None:
        self.base = base  # leaf first, kernel frames first
        self.ips = ips  # per base frame (array "Q")
        self._frames: tuple[Frame, ...] | None = None

    def __len__(self) -> int:
        return len(self.base)

    def frames(self) -> tuple[Frame, ...]:
        fr = self._frames
        if fr is None:
            fr = self._frames = tuple([f if f.ip == ip else at_ip(f, ip)
                                       for f, ip in zip(self.base, self.ips, strict=True)])
        return fr


def frames_of(stack: tuple[Frame, ...] | CodeStack) -> tuple[Frame, ...]:
    """A stack's frames, whichever form it is held in."""
    return stack.frames() if isinstance(stack, CodeStack) else stack

# The name of a frame without a symbol, and of a frame's binary when no mapping covers it:
# perf's spelling (util/evsel_fprintf.c sample__fprintf_callchain, scripts/python/
# stackcollapse.py). Every output names unknown frames through this one constant.
UNKNOWN = "[unknown]"


def frame_name(f: Frame) -> str:
    """The function name shown for ``f``: its symbol, else ``UNKNOWN`` (never its binary's
    name: outputs that show the binary have their own place for it)."""
    return f.sym or UNKNOWN


# (dso, rel) -> the (symbol, offset) a frame there has unexpanded (engine.plain_symbol)
PlainSymbol = Callable[[str | None, int | None], tuple[str, int | None] | None]


def without_inline(frames: tuple[Frame, ...], plain: PlainSymbol | None = None
                   ) -> tuple[Frame, ...]:  # fmt: skip
    """``frames`` as they are shown without inline expansion (perf script ``--no-inline``):
    each run of inlined frames at one pc (``Frame.inlined``, engine.inline_frames: innermost
    first) is dropped, and the frame it sits in (the next one, at the same pc) takes the run's
    first frame's file and line: the line table's row for its own pc, as addr2line without
    ``-i`` says it. A run with no such frame after it is one whose outermost level, the
    function the pc is in, DWARF names otherwise than the symbol table (an alias: perf shows
    it "(inlined)" too); that last frame stands for the function then, named as ``plain``
    says the symbol table names it (the frames no longer hold that name), else under its
    DWARF name. ``frames`` itself when nothing in it is inlined. O(frames)."""
    if not any(f.inlined for f in frames):
        return frames
    out: list[Frame] = []
    run: list[Frame] = []

    def close(f: Frame | None) -> None:
        first = run[0]
        sym, offset = None, None
        if f is None or f.ip != first.ip or f.dso != first.dso:
            f = run[-1]  # the outermost level stands for the function
            hit = plain(f.dso, f.rel) if plain is not None else None
            sym, offset = hit if hit is not None else (f.sym, f.offset)
        else:
            sym, offset = f.sym, f.offset
        out.append(Frame(f.ip, f.dso, sym, offset, f.kernel, False, f.rel, first.file,
                         first.line, f.decl_file, f.decl_line))  # fmt: skip
        run.clear()

    for f in frames:
        if f.inlined:
            if run and (run[0].ip != f.ip or run[0].dso != f.dso):
                close(None)
            run.append(f)
        elif run:
            same = f.ip == run[0].ip and f.dso == run[0].dso
            close(f if same else None)
            if not same:
                out.append(f)
        else:
            out.append(f)
    if run:
        close(None)
    return tuple(out)


# Statuses of samples with nothing to unwind (engine.recorded_frames): frames from the recorded
# callchain, or the sample ip alone.
STATUS_CALLCHAIN = "callchain"
STATUS_IP_ONLY = "ip_only"


@dataclass(frozen=True, slots=True)
class UnwoundSample:
    """One sample unwound and named: its pid, tid, time, comm, status and frames."""

    time_ns: int | None
    pid: int | None
    tid: int | None
    cpu: int | None
    comm: str
    period: int | None
    unwind_status: str
    frames: tuple[Frame, ...]  # leaf first; kernel frames first


def to_json(s: UnwoundSample) -> dict[str, Any]:
    return {
        "time_ns": s.time_ns,
        "pid": s.pid,
        "tid": s.tid,
        "cpu": s.cpu,
        "comm": s.comm,
        "period": s.period,
        "unwind_status": s.unwind_status,
        "frames": [
            {
                "ip": hex(f.ip),
                "dso": f.dso,
                "sym": f.sym,
                "offset": f.offset,
                "kernel": f.kernel,
                "inlined": f.inlined,
                "rel": hex(f.rel if f.rel is not None else f.ip),
                "file": f.file,
                "line": f.line,
            }
            for f in s.frames
        ],
    }


def perf_script(s: UnwoundSample) -> str:
    t = s.time_ns or 0
    pid = -1 if s.pid is None else s.pid
    tid = -1 if s.tid is None else s.tid
    when = f"{pid:5d}/{tid:<5d} {t // 1_000_000_000:5d}.{t % 1_000_000_000:09d}:"
    if s.unwind_status == STATUS_IP_ONLY and len(s.frames) == 1:
        return f"{s.comm:>16} {when} {ip_only_line(s.frames[0])}"
    lines = [f"{s.comm} {when} \n"]
    for f in s.frames:
        addr = f.rel if f.rel is not None else f.ip
        lines.append(perf_script_frame(f, addr))
    lines.append("\n")
    return "".join(lines)


def perf_script_frame(f: Frame, addr: int) -> str:
    """One callchain line of perf script: ``\t%16x sym (dso)`` at ``addr``; an inlined frame
    ``\t%16x sym (inlined)`` (util/evsel_fprintf.c sample__fprintf_callchain prints the dso
    only for a symbol that is not inlined, then `` (inlined)``)."""
    if f.inlined:
        return f"\t{addr:16x} {frame_name(f)} (inlined)\n"
    return f"\t{addr:16x} {frame_name(f)} ({f.dso or UNKNOWN})\n"


def ip_only_line(f: Frame) -> str:
    """perf script's text of the one frame of a sample without a call graph, after its time:
    the absolute ip (``sample->ip``), not the mapping-relative address of a callchain line."""
    return f" {f.ip:16x} {frame_name(f)} ({f.dso or UNKNOWN})\n"


def folded_key(s: UnwoundSample) -> tuple[str, ...]:
    """The stack as flamegraph.pl folds it: comm first, then outermost frame to leaf."""
    return (s.comm or UNKNOWN, *folded_names(s.frames))


def folded_names(frames: tuple[Frame, ...]) -> tuple[str, ...]:
    """``folded_key`` without the comm: the frames' names, outermost first."""
    names = []
    for f in reversed(frames):
        name = f.sym or UNKNOWN  # frame_name, inlined: called per frame of every stack
        if f.kernel:
            name += "_[k]"
        elif f.inlined:  # stackcollapse-perf.pl --inline's mark of an inlined call
            name += "_[i]"
        names.append(name.replace(";", ":"))
    return tuple(names)


def fold(samples: Iterable[UnwoundSample], by_period: bool = False) -> Counter[tuple[str, ...]]:
    """Aggregate samples into folded stacks, counting samples (or their periods)."""
    out: Counter[tuple[str, ...]] = Counter()
    for s in samples:
        out[folded_key(s)] += (s.period or 1) if by_period else 1
    return out


def render_folded(folded: Counter[tuple[str, ...]]) -> str:
    """One ``comm;outermost;...;leaf count`` line per stack, in the order of the key tuples."""
    joined = {"\0".join(k): n for k, n in folded.items()}
    text = _nul_lines(joined)
    # No name held a NUL of its own iff no two keys merged and the text has only the joins'
    if len(joined) == len(folded) and text.count("\0") == sum(map(len, folded)) - len(folded):
        return text.replace("\0", ";")
    return "".join(f"{';'.join(k)} {n}\n" for k, n in sorted(folded.items()))


# comm -> (the stack's folded names, outermost first, UTF-8 and joined by NUL) -> count
FoldedBytes = dict[str, dict[bytes, int]]


def render_folded_bytes(folded: FoldedBytes) -> bytes:
    """``render_folded(...).encode()`` of the same counts held as ``FoldedBytes``, with no name
    or comm holding a NUL (the caller's check); ``folded`` is emptied as it is written. The same
    order: comm by comm, then the joined names as bytes (UTF-8 keeps code point order, NUL
    sorts first: ``_nul_lines``). Each comm's keys go as its lines are written, so the text is
    held about twice at most (its parts and the answer), where ``render_folded`` and an
    encode build it five times over."""
    out = []
    for comm in sorted(folded):
        per = folded.pop(comm)
        c = comm.encode()
        out.append(b"".join([c + b";" + k.replace(b"\0", b";") + b" %d\n" % per[k] if k
                             else c + b" %d\n" % per[k] for k in sorted(per)]))  # fmt: skip
    return b"".join(out)


def _nul_lines(folded: dict[str, int]) -> str:
    """Why NUL-joined keys: sorting the joined strings orders the stacks exactly as their
    tuples of names (NUL is below every other code point, and a stack that is a prefix of
    another sorts first either way), and comparing two strings is one memcmp where comparing
    two tuples of n names is up to n rich comparisons (deep stacks share long prefixes)."""
    return "".join([f"{k} {folded[k]}\n" for k in sorted(folded)])
