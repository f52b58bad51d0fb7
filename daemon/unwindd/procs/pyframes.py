"""CPython's own frames (3.11 and newer), read from a live process: which Python functions a
thread is running, innermost first, split at the interpreter's C entries.

Layout sources (x86_64, the default GIL build):
- 3.13 and newer publish ``_Py_DebugOffsets`` at the start of ``_PyRuntime``
  (Include/internal/pycore_runtime.h: cookie ``xdebugpy``, ``PY_VERSION_HEX``, then one offset
  block per struct); ``layout_from_debug_offsets`` decodes the 3.13 form of that struct. A
  later version changes the struct and is refused as ``unknown_version``.
- 3.11 and 3.12 publish nothing: ``LAYOUTS`` holds their offsets as ``offsetof`` gives them
  over Include/internal/pycore_{runtime,interp,frame,code}.h and cpython/pystate.h of those
  releases (compiled against 3.11.7's and 3.12.1's installed headers; the structs do not change
  within a minor release, Debian's 3.11.2 reads the same). The version is read from
  the process's ``Py_Version`` (Include/pylifecycle.h, since 3.11): a 3.10 or older interpreter,
  which has no such symbol, is ``unknown_version``.

Invariants:
- Sans-IO core: every function here reads through a ``Memory`` (``read(addr, n) -> bytes``,
  raising ``ReadFailed(reason)``); ``ProcessMemory`` is the thin process_vm_readv shell.
- ``walk`` never trusts the target: a cycle, an address that does not read, a string that is
  not a compact str, or more than ``max_frames`` frames end it as a ``ReadFailed`` with a
  reason from ``FAILURES``; nothing raises anything else.
- Segments: each ``_PyEval_EvalFrameDefault`` on the C stack runs one run of interpreter frames
  ending at its entry frame (3.11: the frame with ``is_entry``; 3.12+: before the
  ``FRAME_OWNED_BY_CSTACK`` shim frame the call pushes, pycore_frame.h), so ``walk`` returns
  them as a list of segments, innermost first, for the caller to line up with those C frames.
- ``walk`` = ``decode(raw_walk(...))``: ``raw_walk`` reads the chain as records (code
  address, instruction pointer, code header fields), ``decode`` turns records into names,
  files and lines. The daemon walks natively (procs/pywalk.py, cffi_build/pywalk.c: the same
  records, off the GIL) and decodes here; ``raw_walk`` is the reference the tests hold it to.
- Cost: ``raw_walk`` one process_vm_readv per frame (frame and the next frame's code header
  read together); ``decode``, per code object not yet cached, its strings and line table
  (capped at ``MAX_STR`` characters and ``MAX_LINETABLE`` bytes), per instruction not yet
  seen in it one line-table scan (``MAX_LINES`` kept per code object); bounded by
  ``max_frames``.
"""

from __future__ import annotations

import ctypes
import errno
import struct
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from ..lightdc import dataclass, field

# Why a sample's Python frames could not be named (metrics labels: a fixed set).
# "self": the daemon's own process is not read (pyreader): reading itself would make each of its
# reads a new sample to read, and its own Python frames are not what it profiles
FAILURES = ("gone", "denied", "no_runtime", "unknown_version", "no_thread", "moved", "too_deep",
            "late", "self")

MAX_STR = 512  # characters of a name or file name read
MAX_LINETABLE = 1 << 16  # bytes of co_linetable read (the line of later code is unknown)
MAX_THREADS = 4096  # thread states walked to find a tid
MAX_CODES = 8192  # code objects cached per process (cleared whole past it)
MAX_LINES = 256  # frames (by instruction) cached per code object (cleared whole past it)
_COOKIE = b"xdebugpy"
_F = TypeVar("_F")
_OWNED_BY_CSTACK = 3  # pycore_frame.h FRAME_OWNED_BY_CSTACK (3.12, 3.13)


class ReadFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Memory(Protocol):
    def read(self, addr: int, n: int) -> bytes: ...

    def read2(self, a: int, n: int, b: int, m: int) -> tuple[bytes, bytes]: ...


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each field the walk reads sits (byte offsets), for one interpreter version."""

    version: int  # PY_VERSION_HEX
    interpreters_head: int  # _PyRuntimeState.interpreters.head
    interp_next: int
    interp_threads_head: int
    ts_next: int
    ts_native_thread_id: int
    ts_cframe: int  # PyThreadState.cframe (3.11, 3.12); -1: current_frame is in the tstate
    current_frame: int  # in _PyCFrame (cframe >= 0) or in PyThreadState
    frame_code: int  # f_code (3.11, 3.12) / f_executable (3.13)
    frame_previous: int
    frame_instr: int  # prev_instr (3.11, 3.12) / instr_ptr (3.13)
    frame_owner: int
    frame_is_entry: int  # 3.11 only; -1 after
    code_filename: int
    code_name: int
    code_qualname: int
    code_firstlineno: int
    code_linetable: int
    code_adaptive: int  # _co_code_adaptive: instruction 0
    str_state: int  # PyASCIIObject.state
    str_length: int
    ascii_size: int  # sizeof(PyASCIIObject): ASCII data follows it
    compact_size: int  # sizeof(PyCompactUnicodeObject): other compact data follows it
    bytes_size: int  # PyVarObject.ob_size of a bytes object
    bytes_sval: int

    @property
    def minor(self) -> int:
        return (self.version >> 16) & 0xFF

    @property
    def frame_bytes(self) -> int:
        return max(self.frame_code, self.frame_previous, self.frame_instr, self.frame_owner,
                   self.frame_is_entry) + 8

    @property
    def code_bytes(self) -> int:
        return max(self.code_filename, self.code_name, self.code_qualname,
                   self.code_firstlineno, self.code_linetable) + 8  # fmt: skip


# offsetof() over the 3.11 / 3.12 internal headers (x86_64, GIL build): _PyRuntimeState,
# PyInterpreterState (pycore_interp.h), PyThreadState (cpython/pystate.h), _PyCFrame,
# _PyInterpreterFrame (pycore_frame.h), PyCodeObject (cpython/code.h), PyASCIIObject
# (cpython/unicodeobject.h; 3.12 dropped its wstr field), PyBytesObject.
LAYOUTS: dict[int, Layout] = {
    11: Layout(version=0x030B0000, interpreters_head=40, interp_next=0, interp_threads_head=16,
               ts_next=8, ts_native_thread_id=160, ts_cframe=56, current_frame=8,
               frame_code=32, frame_previous=48, frame_instr=56, frame_owner=69,
               frame_is_entry=68, code_filename=112, code_name=120, code_qualname=128,
               code_firstlineno=72, code_linetable=136, code_adaptive=184, str_state=32,
               str_length=16, ascii_size=48, compact_size=72, bytes_size=16, bytes_sval=32),
    12: Layout(version=0x030C0000, interpreters_head=40, interp_next=0, interp_threads_head=72,
               ts_next=8, ts_native_thread_id=144, ts_cframe=56, current_frame=0,
               frame_code=0, frame_previous=8, frame_instr=56, frame_owner=70,
               frame_is_entry=-1, code_filename=112, code_name=120, code_qualname=128,
               code_firstlineno=68, code_linetable=136, code_adaptive=192, str_state=32,
               str_length=16, ascii_size=40, compact_size=56, bytes_size=16, bytes_sval=32),
}  # fmt: skip

DEBUG_OFFSETS_BYTES = 73 * 8  # sizeof(_Py_DebugOffsets) in 3.13


def layout_for_version(version: int) -> Layout | None:
    """The known layout of a 3.11 or 3.12 ``PY_VERSION_HEX``, else None."""
    if version >> 24 != 3:
        return None
    lay = LAYOUTS.get((version >> 16) & 0xFF)
    return None if lay is None else _with_version(lay, version)


def _with_version(lay: Layout, version: int) -> Layout:
    return Layout(**{**{f: getattr(lay, f) for f in Layout.__slots__}, "version": version})


def layout_from_debug_offsets(buf: bytes) -> Layout | None:
    """The layout a 3.13 ``_Py_DebugOffsets`` (the first ``DEBUG_OFFSETS_BYTES`` of
    ``_PyRuntime``) states, or None: no cookie, another minor version (the struct grows in
    3.14), or a free-threaded build (its object header differs)."""
    if len(buf) < DEBUG_OFFSETS_BYTES or buf[:8] != _COOKIE:
        return None
    u = struct.unpack_from("<73Q", buf)
    version, free_threaded = u[1], u[2]
    if version >> 16 != 0x030D or free_threaded:
        return None
    # indices of the uint64 fields, in the struct's declaration order (pycore_runtime.h)
    return Layout(version=version, interpreters_head=u[5], interp_next=u[8],
                  interp_threads_head=u[9], ts_next=u[21], ts_native_thread_id=u[25],
                  ts_cframe=-1, current_frame=u[23], frame_code=u[30], frame_previous=u[29],
                  frame_instr=u[31], frame_owner=u[33], frame_is_entry=-1, code_filename=u[35],
                  code_name=u[36], code_qualname=u[37], code_firstlineno=u[39],
                  code_linetable=u[38], code_adaptive=u[43], str_state=u[68], str_length=u[69],
                  ascii_size=u[70], compact_size=u[70] + 16, bytes_size=u[65],
                  bytes_sval=u[66])  # fmt: skip


# -- decoding


def _u64(b: bytes, off: int) -> int:
    return int.from_bytes(b[off : off + 8], "little")


def _u32(b: bytes, off: int) -> int:
    return int.from_bytes(b[off : off + 4], "little")


def read_str(mem: Memory, lay: Layout, addr: int) -> str:
    """A compact ``str`` object's text (cpython/unicodeobject.h: state bits interned:2 kind:3
    compact:1 ascii:1), at most ``MAX_STR`` characters."""
    if not addr:
        raise ReadFailed("moved")
    head = mem.read(addr, lay.ascii_size)
    state = _u32(head, lay.str_state)
    length = _u64(head, lay.str_length)
    kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
    if not compact or kind not in (1, 2, 4) or (ascii_ and kind != 1) or length > 1 << 20:
        raise ReadFailed("moved")
    n = min(length, MAX_STR)
    data = mem.read(addr + (lay.ascii_size if ascii_ else lay.compact_size), n * kind)
    codec = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind]
    return data.decode(codec, "replace")


def read_bytes(mem: Memory, lay: Layout, addr: int, cap: int) -> bytes:
    if not addr:
        raise ReadFailed("moved")
    size = _u64(mem.read(addr + lay.bytes_size, 8), 0)
    if size > 1 << 24:
        raise ReadFailed("moved")
    return mem.read(addr + lay.bytes_sval, min(size, cap)) if size else b""


def _varint(t: bytes, i: int) -> tuple[int, int]:
    b = t[i]
    i += 1
    val, shift = b & 63, 0
    while b & 64:
        b = t[i]
        i += 1
        shift += 6
        val |= (b & 63) << shift
    return val, i


def line_of(linetable: bytes, firstlineno: int, addrq: int) -> int | None:
    """The line of byte offset ``addrq`` into the code, by the location table of 3.11+
    (Objects/locations.md; Objects/codeobject.c ``advance``/``get_line_delta``): entries of a
    first byte ``1cccclll`` (code c, length l + 1 code units) and code-specific bytes; codes
    13 (no columns) and 14 (long) carry a signed varint line delta, 10-12 a delta of 0-2, 15
    means no line. None where the table says no line or ends before ``addrq``."""
    if addrq < 0:
        return firstlineno  # PyCode_Addr2Line: before the first instruction
    line, end, i, n = firstlineno, 0, 0, len(linetable)
    try:
        while i < n:
            first = linetable[i]
            code = (first >> 3) & 15
            if code in (13, 14):
                u, _ = _varint(linetable, i + 1)
                line += -(u >> 1) if u & 1 else u >> 1
            elif 10 <= code <= 12:
                line += code - 10
            end += ((first & 7) + 1) * 2
            if addrq < end:
                return None if code == 15 else line
            i += 1
            while i < n and not linetable[i] & 128:
                i += 1
    except IndexError:
        return None
    return None


@dataclass(frozen=True, slots=True)
class PyFrame:
    qualname: str
    filename: str
    line: int | None


# A raw frame record, as the walk reads it (cffi_build/unwcore.h struct unw_py_rec, same field
# order): code object address (0: a shim), raw instruction pointer, the code header's
# qualname, filename and linetable pointers, its firstlineno, and flags (ENTRY, SHIM).
RawFrame = tuple[int, int, int, int, int, int, int]
ENTRY = 1  # 3.11: the frame is_entry: its segment ends after it (unwcore.h UNW_PY_ENTRY)
SHIM = 2  # 3.12+: a FRAME_OWNED_BY_CSTACK shim: a segment ends here (UNW_PY_SHIM)


@dataclass(slots=True)
class _Code:
    key: tuple[int, int, int, int]  # the header fields it was decoded from (reuse reads otherwise)
    qualname: str
    filename: str
    firstlineno: int
    linetable: bytes
    frames: dict[int, PyFrame] = field(default_factory=dict)  # by instruction index (lasti)


class Interpreter:
    """One process's interpreter: ``_PyRuntime``'s address and the layout; caches its code
    objects (validated by their header on every use) and tid -> thread state."""

    def __init__(self, mem: Memory, runtime: int, lay: Layout) -> None:
        self.mem, self.runtime, self.lay = mem, runtime, lay
        self.codes: dict[int, _Code] = {}
        self.tstates: dict[int, int] = {}

    def thread_state(self, tid: int) -> int:
        """The PyThreadState of native thread ``tid`` (cached, checked on each use)."""
        lay, mem = self.lay, self.mem
        ts = self.tstates.get(tid)
        if ts is not None:
            if _u64(mem.read(ts + lay.ts_native_thread_id, 8), 0) == tid:
                return ts
            del self.tstates[tid]
        seen = 0
        interp = _u64(mem.read(self.runtime + lay.interpreters_head, 8), 0)
        while interp and seen < MAX_THREADS:
            ts = _u64(mem.read(interp + lay.interp_threads_head, 8), 0)
            while ts and seen < MAX_THREADS:
                seen += 1
                head = mem.read(ts, lay.ts_native_thread_id + 8)
                if _u64(head, lay.ts_native_thread_id) == tid:
                    self.keep_thread_state(tid, ts)
                    return ts
                ts = _u64(head, lay.ts_next)
            interp = _u64(mem.read(interp + lay.interp_next, 8), 0)
        raise ReadFailed("no_thread")

    def keep_thread_state(self, tid: int, ts: int) -> None:
        if self.tstates.get(tid) != ts:
            if len(self.tstates) >= MAX_THREADS:
                self.tstates.clear()
            self.tstates[tid] = ts

    def current_frame(self, ts: int) -> int:
        lay = self.lay
        if lay.ts_cframe >= 0:
            cframe = _u64(self.mem.read(ts + lay.ts_cframe, 8), 0)
            if not cframe:
                return 0
            return _u64(self.mem.read(cframe + lay.current_frame, 8), 0)
        return _u64(self.mem.read(ts + lay.current_frame, 8), 0)

    def _code(self, raw: RawFrame) -> _Code:
        addr, _, qn, fn, lt, fl, _ = raw
        key = (qn, fn, lt, fl)
        got = self.codes.get(addr)
        if got is not None and got.key == key:
            return got
        lay, mem = self.lay, self.mem
        code = _Code(key, read_str(mem, lay, qn), read_str(mem, lay, fn), fl,
                     read_bytes(mem, lay, lt, MAX_LINETABLE))
        if len(self.codes) >= MAX_CODES:
            self.codes.clear()
        self.codes[addr] = code
        return code

    def raw_walk(self, tid: int, max_frames: int) -> list[RawFrame]:
        """Thread ``tid``'s frame records, innermost first (the reference of the native walk,
        cffi_build/pywalk.c, which the daemon uses: the same records for the same memory)."""
        lay, mem = self.lay, self.mem
        frame = self.current_frame(self.thread_state(tid))
        out: list[RawFrame] = []
        seen: set[int] = set()
        fb, cb = lay.frame_bytes, lay.code_bytes
        buf = mem.read(frame, fb) if frame else b""
        while frame:
            if frame in seen:
                raise ReadFailed("moved")
            if len(seen) >= max_frames:
                raise ReadFailed("too_deep")
            seen.add(frame)
            owner = buf[lay.frame_owner]
            prev = _u64(buf, lay.frame_previous)
            if lay.frame_is_entry < 0 and owner == _OWNED_BY_CSTACK:
                out.append((0, 0, 0, 0, 0, 0, SHIM))  # a _PyEval_EvalFrameDefault call's shim
                nxt = mem.read(prev, fb) if prev else b""
            else:
                code_addr = _u64(buf, lay.frame_code)
                if not code_addr:
                    raise ReadFailed("moved")
                # the next frame read with this frame's code header: one syscall per frame
                if prev:
                    head, nxt = mem.read2(code_addr, cb, prev, fb)
                else:
                    head, nxt = mem.read(code_addr, cb), b""
                entry = lay.frame_is_entry >= 0 and buf[lay.frame_is_entry]
                out.append((code_addr, _u64(buf, lay.frame_instr), _u64(head, lay.code_qualname),
                            _u64(head, lay.code_filename), _u64(head, lay.code_linetable),
                            _u32(head, lay.code_firstlineno), ENTRY if entry else 0))
            frame, buf = prev, nxt
        return out

    def decode(self, raws: Sequence[RawFrame]) -> list[list[PyFrame]]:
        """Frame records as segments: one per C-level entry into the interpreter, innermost
        first; names, files and line tables read once per code object (``codes``)."""
        lay = self.lay
        segments: list[list[PyFrame]] = []
        seg: list[PyFrame] = []
        for raw in raws:
            flags = raw[6]
            if flags & SHIM:
                segments.append(seg)
                seg = []
                continue
            code = self._code(raw)
            lasti = (raw[1] - raw[0] - lay.code_adaptive) // 2
            if lasti >= 0 or lay.minor >= 13:
                # 3.11/3.12: prev_instr before instruction 0 is a frame not started yet
                # (_PyFrame_IsIncomplete), which tracebacks and sys._current_frames skip
                f = code.frames.get(lasti)
                if f is None:
                    if len(code.frames) >= MAX_LINES:
                        code.frames.clear()
                    f = code.frames[lasti] = PyFrame(
                        code.qualname, code.filename,
                        line_of(code.linetable, code.firstlineno, lasti * 2))
                seg.append(f)
            if flags & ENTRY:
                segments.append(seg)
                seg = []
        if seg:
            segments.append(seg)  # frames below the outermost entry: none in a sane chain
        return segments

    def walk(self, tid: int, max_frames: int) -> list[list[PyFrame]]:
        """Thread ``tid``'s interpreter frames, innermost first, as segments: one per C-level
        entry into the interpreter, innermost segment first."""
        return self.decode(self.raw_walk(tid, max_frames))


def find_interpreter(mem: Memory, runtime: int, py_version: int | None) -> Interpreter:
    """The interpreter at ``_PyRuntime`` address ``runtime``: by its debug offsets (3.13), else
    by ``py_version`` (the process's ``Py_Version``) among ``LAYOUTS``."""
    lay = None
    if py_version is not None and (py_version >> 16) >= 0x030D:
        lay = layout_from_debug_offsets(mem.read(runtime, DEBUG_OFFSETS_BYTES))
    elif py_version is not None:
        lay = layout_for_version(py_version)
    if lay is None:
        raise ReadFailed("unknown_version")
    return Interpreter(mem, runtime, lay)


def merge(native: Sequence[_F], is_eval: Callable[[_F], bool], segments: Sequence[Sequence[_F]],
          complete: bool, beside: bool) -> list[_F] | None:
    """``native`` (leaf first) with each interpreter C frame (``is_eval``) replaced by, or
    (``beside``) preceded by, the Python frames of its segment (leaf first), the innermost
    C frame taking the innermost segment. None when they do not line up: more C frames than
    segments, or (a ``complete`` native stack) fewer."""
    n_eval = sum(1 for f in native if is_eval(f))
    if n_eval > len(segments) or (complete and n_eval < len(segments)) or not n_eval:
        return None
    out: list[_F] = []
    k = 0
    for f in native:
        if is_eval(f):
            out += segments[k]
            k += 1
            if beside:
                out.append(f)
        else:
            out.append(f)
    return out


# -- the process_vm_readv shell


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_readv = _libc.process_vm_readv
_readv.restype = ctypes.c_ssize_t
_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip


class ProcessMemory:
    """Reads of another process's memory (process_vm_readv(2)): ESRCH is ``gone``, EPERM
    ``denied``, a short read or EFAULT ``moved`` (the chain pointed at freed memory)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.calls = 0
        self._buf = ctypes.create_string_buffer(4096)
        self._local = (_IoVec * 2)()
        self._remote = (_IoVec * 2)()

    def _readv(self, parts: list[tuple[int, int]]) -> bytes:
        total = sum(n for _, n in parts)
        if total > len(self._buf):
            self._buf = ctypes.create_string_buffer(max(total, 2 * len(self._buf)))
        base = ctypes.addressof(self._buf)
        off = 0
        for i, (addr, n) in enumerate(parts):
            self._local[i].base, self._local[i].len = base + off, n
            self._remote[i].base, self._remote[i].len = addr, n
            off += n
        self.calls += 1
        got = _readv(self.pid, self._local, len(parts), self._remote, len(parts), 0)
        if got != total:
            e = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise ReadFailed({errno.ESRCH: "gone", errno.EPERM: "denied"}.get(e, "moved"))
        return self._buf.raw[:total]

    def read(self, addr: int, n: int) -> bytes:
        if not 0 < addr < 1 << 63:
            raise ReadFailed("moved")
        return self._readv([(addr, n)])

    def read2(self, a: int, n: int, b: int, m: int) -> tuple[bytes, bytes]:
        if not (0 < a < 1 << 63 and 0 < b < 1 << 63):
            raise ReadFailed("moved")
        data = self._readv([(a, n), (b, m)])
        return data[:n], data[n:]
