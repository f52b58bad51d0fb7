"""The native replay's text: one frame rendered in an output format, the per-sample lines of
jsonl and perf-script output, and the folded text made in C from ranked names. filereplay.py
decides what is written when; this module decides how it reads, byte for byte what the
reference path (stackfmt, ``unwindd replay``'s Python sink) writes.

Invariants:
- ``render_frame`` is stackfmt's rendering of one frame: ``folded_names``' name, ``to_json``'s
  frame object, perf script's frame line; so a stack's text is its frames' texts joined. A
  perf-script ``ip_only`` stack is ``stackfmt.ip_only_line`` of its frame (``ip_only_text``),
  written after a ``%16s`` comm (``emitter``), as ``stackfmt.perf_script`` writes it.
- Folded names are ranked as Python sorts str, so C's order of rank sequences (fold.c) is
  ``render_folded``'s order of name tuples; names cross to C as UTF-8 with surrogates passed
  through, so decoding gives back the same str.

Cost: one string format per frame rendered (each distinct frame once, by the caller), one per
sample line; folded output O(names log names) here plus C's pass over the stacks, written in
pieces of a reused 256 KiB buffer.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

from ..unwcore import ffi, lib
from ..unwind import stackfmt
from ..unwind.stackfmt import STATUS_IP_ONLY, Frame, UnwoundSample
from .context import NativeContext, view

__all__ = ["emitter", "ip_only_text", "render_frame", "render_frames", "write_folded"]

Emit = Callable[[int, int], None]


def render_frame(fmt: str, f: Frame) -> str:
    """One frame in ``fmt``: a folded name, a JSON object, or a perf script line."""
    if fmt == "folded":  # folded_key's name of the frame (no comm, no sample object)
        return stackfmt.folded_names((f,))[0]
    if fmt == "jsonl":
        import json  # (a folded replay does not pay for importing it)

        u = UnwoundSample(None, None, None, None, "", None, "", (f,))
        return json.dumps(stackfmt.to_json(u)["frames"][0], separators=(",", ":"))
    return stackfmt.perf_script_frame(f, f.rel if f.rel is not None else f.ip)


def render_frames(fmt: str, fs: tuple[Frame, ...]) -> str:
    """The text of several frames one frame id stands for (an inline chain, innermost first)
    in ``fmt``, joined as the stack's frames are: perf-script lines in order, jsonl objects
    with commas, folded names outermost first with ``;``."""
    if fmt == "folded":
        return ";".join(render_frame(fmt, f) for f in reversed(fs))
    if fmt == "jsonl":
        return ",".join(render_frame(fmt, f) for f in fs)
    return "".join(render_frame(fmt, f) for f in fs)


def ip_only_text(frame_line: str, ip: int) -> str:
    """``stackfmt.ip_only_line`` of the frame whose perf-script ``render_frame`` line is
    ``frame_line`` and whose absolute ip is ``ip``: the line's address column (a tab and 16
    hex digits, every u64 fits) becomes a space and the absolute ip."""
    return f" {ip:16x}{frame_line[17:]}"


def emitter(
    fmt: str,
    write: Callable[[str], Any],
    stacks: list[tuple[str, str, int, int]],
    rendered: list[str],
    cols: tuple[memoryview, memoryview | None, memoryview, memoryview, memoryview | None],
    ids: memoryview,
) -> Emit:
    """What writes the samples of delivered positions [a, b): their lines in ``fmt`` (jsonl,
    perf-script; folded writes at the end). ``cols``: times, periods (None: the layout has
    none), pids, tids, cpus (None: none), by delivered position; ``ids`` their stack ids into
    ``stacks`` (comm, status, ...) and ``rendered`` (each stack's frames as text)."""
    times, periods, pids, tids, cpus = cols
    if fmt == "folded":
        return lambda a, b: None
    if fmt == "jsonl":
        import json

        dumps = json.dumps
        # A line is json.dumps of stackfmt.to_json's dict with separators (",", ":"), written
        # out here: its ints print as str() does, None as null, strings as dumps gives them;
        # what is the same for every sample of a stack (comm, status, frames) is made once
        # per stack id (``mid``: between cpu and period; ``tail``: after period).
        mid: list[str] = []
        tail: list[str] = []

        def emit(a: int, b: int) -> None:
            for sid in range(len(mid), len(stacks)):
                comm, status = stacks[sid][0], stacks[sid][1]
                mid.append(f',"comm":{dumps(comm)},"period":')
                tail.append(f',"unwind_status":{dumps(status)},"frames":{rendered[sid]}}}\n')
            parts = []
            for k in range(a, b):
                sid = ids[k]
                cpu = "null" if cpus is None else cpus[k]
                period = "null" if periods is None else periods[k]
                parts.append(f'{{"time_ns":{times[k]},"pid":{pids[k]},"tid":{tids[k]},'
                             f'"cpu":{cpu}{mid[sid]}{period}{tail[sid]}')  # fmt: skip
            write("".join(parts))

        return emit

    def emit_script(a: int, b: int) -> None:
        parts = []
        for k in range(a, b):
            sid = ids[k]
            t = times[k]
            comm, status = stacks[sid][0], stacks[sid][1]
            if status == STATUS_IP_ONLY:  # one line: rendered[sid] follows the time
                parts.append(f"{comm:>16} {pids[k]:5d}/{tids[k]:<5d} "
                             f"{t // 1_000_000_000:5d}.{t % 1_000_000_000:09d}: ")  # fmt: skip
            else:
                parts.append(f"{comm} {pids[k]:5d}/{tids[k]:<5d} "
                             f"{t // 1_000_000_000:5d}.{t % 1_000_000_000:09d}: \n")  # fmt: skip
            parts.append(rendered[sid])
        write("".join(parts))

    return emit_script


def _inline_order(
    nctx: NativeContext,
    kernel_frame: Callable[[int], Frame],
    frame_text: list[str],
    write: Callable[[str], Any],
) -> None:
    """``write_folded`` where some frame ids stand for several names (an inline chain's
    ``render_frames``, joined by ``;``, which no single folded name holds: folded_names maps
    it to ``:``): fold.c orders stacks by one rank per frame id, which is not the order of
    their names one by one, so its lines are sorted again here as ``stackfmt.render_folded``
    sorts them (NUL-joined names). O(lines log lines)."""
    parts: list[str] = []
    write_folded(nctx, kernel_frame, [t.replace(";", "\x01") for t in frame_text],
                 parts.append)  # fmt: skip
    lines = "".join(parts).splitlines()
    keyed = []
    for line in lines:
        stack, _, n = line.rpartition(" ")
        keyed.append((stack.replace(";", "\0").replace("\x01", "\0"), n))
    keyed.sort()
    write("".join(f"{k.replace(chr(0), ';')} {n}\n" for k, n in keyed))


def write_folded(
    nctx: NativeContext,
    kernel_frame: Callable[[int], Frame],
    frame_text: list[str],
    write: Callable[[str], Any],
) -> None:
    """The folded text of every stack of ``nctx`` (by code), made in C (fold.c) from the names
    ranked here: comms, ``frame_text`` (per frame id) and kernel frames, named now once per
    ip by ``kernel_frame``. Written in pieces of 256 KiB (one buffer reused: a text built
    whole would page-fault fresh memory for every page of it); with inline chains, whole
    (``_inline_order``)."""
    if any(";" in t for t in frame_text):
        return _inline_order(nctx, kernel_frame, frame_text, write)
    ctx = nctx.ctx
    cap = 4096
    while True:
        a_kips = ffi.new("uint64_t[]", cap)
        nk = int(lib.fp_kernel_ips(ctx, a_kips, cap))
        if nk <= cap:
            break
        cap = nk
    kips = view(a_kips, "Q", nk).tolist()
    # one folded_names call for all: it names frames outermost first, so reversed twice
    knames = list(stackfmt.folded_names(tuple(map(kernel_frame, reversed(kips)))))
    comms = [c or stackfmt.UNKNOWN for c in nctx.comms]  # folded_key's comm
    names = sorted({*comms, *frame_text, *knames})
    rank = {n: r for r, n in enumerate(names)}
    comm_rank = array("I", [rank[c] for c in comms] or [0])
    frame_rank = array("I", [rank[t] for t in frame_text] or [0])
    krank = array("I", [rank[t] for t in knames] or [0])
    kip_arr = array("Q", kips or [0])
    blobs = [n.encode("utf-8", "surrogatepass") for n in names]
    offs = array("Q", [0])
    for b in blobs:
        offs.append(offs[-1] + len(b))
    blob = b"".join(blobs) or b"\0"
    p_fold = ffi.new("struct fp_fold **")
    rc = lib.fp_fold_new(ctx, ffi.from_buffer("uint32_t[]", comm_rank), len(comms),
                         ffi.from_buffer("uint32_t[]", frame_rank), len(frame_text),
                         ffi.from_buffer("uint64_t[]", kip_arr),
                         ffi.from_buffer("uint32_t[]", krank), len(kips), p_fold)  # fmt: skip
    if rc == -1:
        raise MemoryError("fp_fold_new")
    if rc != 0:
        raise RuntimeError(f"fp_fold_new: a frame, comm or kernel ip without a name ({rc})")
    fold = ffi.gc(p_fold[0], lib.fp_fold_free)
    c_blob, c_offs = ffi.from_buffer(blob), ffi.from_buffer("uint64_t[]", offs)
    cap = 256 << 10
    buf = ffi.new("uint8_t[]", cap)
    while True:
        n = int(lib.fp_fold_text(fold, c_blob, c_offs, len(names), buf, cap))
        if n == 0:
            break
        if n < 0:
            if n == -(1 << 63):
                raise RuntimeError("fp_fold_text: bad name rank")
            cap = -n
            buf = ffi.new("uint8_t[]", cap)
            continue
        write(ffi.buffer(buf, n)[:].decode("utf-8", "surrogatepass"))
