"""CPython frame-chain decoding at byte level (procs/pyframes.py): a fake address space built
here with the 3.11 and 3.12 layouts (runtime -> interpreter -> thread states -> frames -> code
objects -> str/bytes), line tables of code objects this interpreter compiled, the 3.13 debug
offsets of a real 3.13 process this test starts, and the merge and time matching the live step
uses (unwind/pyreader.py)."""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path
from types import CodeType
from typing import Any

import pytest
from unwindd.procs import pyframes
from unwindd.procs.pyframes import (
    LAYOUTS,
    Layout,
    PyFrame,
    ReadFailed,
    find_interpreter,
    layout_from_debug_offsets,
    line_of,
    merge,
)
from unwindd.unwind.pyreader import PythonFrames, elf_symbols
from unwindd.unwind.stackfmt import Frame


class FakeMemory:
    """A sparse address space: ``alloc`` places bytes, ``read`` fails outside them."""

    def __init__(self) -> None:
        self.regions: list[tuple[int, bytearray]] = []
        self.next = 0x10000

    def alloc(self, data: bytes | int) -> int:
        buf = bytearray(data if isinstance(data, bytes) else bytes(data))
        addr = self.next
        self.regions.append((addr, buf))
        self.next += (len(buf) + 0x100) & ~0xF
        return addr

    def put(self, addr: int, off: int, value: int, size: int = 8) -> None:
        for base, buf in self.regions:
            if base <= addr < base + len(buf):
                buf[addr - base + off : addr - base + off + size] = value.to_bytes(size, "little")
                return
        raise AssertionError(hex(addr))

    def read(self, addr: int, n: int) -> bytes:
        for base, buf in self.regions:
            if base <= addr and addr + n <= base + len(buf):
                return bytes(buf[addr - base : addr - base + n])
        raise ReadFailed("moved")

    def read2(self, a: int, n: int, b: int, m: int) -> tuple[bytes, bytes]:
        return self.read(a, n), self.read(b, m)


def put_str(mem: FakeMemory, lay: Layout, s: str) -> int:
    """A compact str object as cpython/unicodeobject.h lays it out."""
    ascii_ = s.isascii()
    kind = 1 if max(map(ord, s), default=0) < 256 else 2 if max(map(ord, s)) < 65536 else 4
    head = bytearray(lay.ascii_size if ascii_ else lay.compact_size)
    struct.pack_into("<Q", head, lay.str_length, len(s))
    struct.pack_into("<I", head, lay.str_state, (kind << 2) | (1 << 5) | (int(ascii_) << 6))
    codec = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind]
    return mem.alloc(bytes(head) + s.encode(codec) + b"\0" * kind)


def put_bytes(mem: FakeMemory, lay: Layout, b: bytes) -> int:
    head = bytearray(lay.bytes_sval)
    struct.pack_into("<Q", head, lay.bytes_size, len(b))
    return mem.alloc(bytes(head) + b + b"\0")


def put_code(mem: FakeMemory, lay: Layout, co: CodeType, qualname: str | None = None) -> int:
    addr = mem.alloc(lay.code_adaptive + len(co.co_code))
    mem.put(addr, lay.code_qualname, put_str(mem, lay, qualname or co.co_qualname))
    mem.put(addr, lay.code_name, put_str(mem, lay, co.co_name))
    mem.put(addr, lay.code_filename, put_str(mem, lay, co.co_filename))
    mem.put(addr, lay.code_linetable, put_bytes(mem, lay, co.co_linetable))
    mem.put(addr, lay.code_firstlineno, co.co_firstlineno, 4)
    return addr


def put_frame(mem: FakeMemory, lay: Layout, code: int, lasti: int, prev: int,
              entry: bool = False, owner: int = 0) -> int:  # fmt: skip
    f = mem.alloc(lay.frame_bytes)
    mem.put(f, lay.frame_code, code)
    mem.put(f, lay.frame_previous, prev)
    mem.put(f, lay.frame_instr, code + lay.code_adaptive + 2 * lasti)
    mem.put(f, lay.frame_owner, owner, 1)
    if entry and lay.frame_is_entry >= 0:
        mem.put(f, lay.frame_is_entry, 1, 1)
    return f


def sample_code() -> CodeType:
    def outer(n: int) -> int:
        total = 0
        for i in range(n):
            if i % 2:
                total += i
            else:
                total -= 1
        return total

    return outer.__code__


def line_at(co: CodeType, off: int) -> int | None:
    for start, end, line in co.co_lines():
        if start <= off < end:
            return line
    return None


@pytest.mark.parametrize("co", [sample_code(), compile("x = 1\n\n\ny = [x\n for _ in ()]\n",
                                                        "m", "exec")])  # fmt: skip
def test_line_of_agrees_with_co_lines(co: CodeType) -> None:
    """Every instruction's line by the location table decoder == ``co_lines()``."""
    offs = range(0, len(co.co_code), 2)
    got = [line_of(co.co_linetable, co.co_firstlineno, off) for off in offs]
    assert got == [line_at(co, off) for off in offs]
    assert len(set(got)) >= 3  # the table really moves between lines
    assert line_of(co.co_linetable, co.co_firstlineno, -2) == co.co_firstlineno


def test_walk_311_segments_at_entry_frames() -> None:
    """3.11: frames innermost first; a frame with ``is_entry`` ends its segment (the
    ``_PyEval_EvalFrameDefault`` call that runs it); another thread's chain is its own."""
    lay = LAYOUTS[11]
    co = sample_code()
    mem = FakeMemory()
    c = {n: put_code(mem, lay, co, n) for n in ("<module>", "Kettle.pour", "Kettle.drip",
                                                  "brühen", "沸かす")}  # fmt: skip
    f_mod = put_frame(mem, lay, c["<module>"], 2, 0, entry=True)
    f_mid = put_frame(mem, lay, c["Kettle.pour"], 6, f_mod)
    f_cb = put_frame(mem, lay, c["Kettle.drip"], 4, f_mid, entry=True)
    f_leaf = put_frame(mem, lay, c["brühen"], 10, f_cb)
    f_other = put_frame(mem, lay, c["沸かす"], 0, 0, entry=True)
    runtime = _runtime(mem, lay, {101: f_leaf, 102: f_other})
    it = pyframes.Interpreter(mem, runtime, lay)
    segs = it.walk(101, 64)
    assert [[f.qualname for f in s] for s in segs] == [["brühen", "Kettle.drip"],
                                                       ["Kettle.pour", "<module>"]]
    assert segs[0][0] == PyFrame("brühen", co.co_filename, line_at(co, 20))
    assert [f.line for f in segs[1]] == [line_at(co, 12), line_at(co, 4)]
    assert [[f.qualname for f in s] for s in it.walk(102, 64)] == [["沸かす"]]
    with pytest.raises(ReadFailed) as e:
        it.walk(103, 64)
    assert e.value.reason == "no_thread"
    with pytest.raises(ReadFailed) as e:
        it.walk(101, 3)
    assert e.value.reason == "too_deep"
    # a reused code address with other contents is decoded again, not served from the cache
    mem.put(c["brühen"], lay.code_qualname, put_str(mem, lay, "steep"))
    assert it.walk(101, 64)[0][0].qualname == "steep"


def _runtime(mem: FakeMemory, lay: Layout, tids: dict[int, int]) -> int:
    """``build``'s runtime, interpreter and thread states, in ``mem``."""
    runtime = mem.alloc(lay.interpreters_head + 8)
    interp = mem.alloc(max(lay.interp_threads_head, lay.interp_next) + 8)
    mem.put(runtime, lay.interpreters_head, interp)
    prev = 0
    for tid, top in reversed(tids.items()):
        ts = mem.alloc(max(lay.ts_native_thread_id, lay.ts_cframe, lay.current_frame) + 8)
        mem.put(ts, lay.ts_next, prev)
        mem.put(ts, lay.ts_native_thread_id, tid)
        if lay.ts_cframe >= 0:
            cf = mem.alloc(lay.current_frame + 8)
            mem.put(cf, lay.current_frame, top)
            mem.put(ts, lay.ts_cframe, cf)
        else:
            mem.put(ts, lay.current_frame, top)
        prev = ts
    mem.put(interp, lay.interp_threads_head, prev)
    return runtime


def test_walk_312_segments_at_cstack_shims_and_refuses_cycles() -> None:
    """3.12: each ``_PyEval_EvalFrameDefault`` call pushes a FRAME_OWNED_BY_CSTACK shim
    frame, which ends a segment and is not shown; a frame not started yet (prev_instr before
    instruction 0) is skipped as tracebacks skip it; a cycle is ``moved``."""
    lay = LAYOUTS[12]
    co = sample_code()
    mem = FakeMemory()
    c = {n: put_code(mem, lay, co, n) for n in ("<module>", "main", "cb", "new")}
    shim0 = put_frame(mem, lay, c["main"], 0, 0, owner=3)
    f_mod = put_frame(mem, lay, c["<module>"], 2, shim0)
    f_main = put_frame(mem, lay, c["main"], 4, f_mod)
    shim1 = put_frame(mem, lay, c["main"], 0, f_main, owner=3)
    f_cb = put_frame(mem, lay, c["cb"], 6, shim1)
    f_new = put_frame(mem, lay, c["new"], -1, f_cb)  # pushed, not started
    runtime = _runtime(mem, lay, {7: f_new})
    it = pyframes.Interpreter(mem, runtime, lay)
    assert [[f.qualname for f in s] for s in it.walk(7, 64)] == [["cb"], ["main", "<module>"]]
    mem.put(shim0, lay.frame_previous, f_main)  # main -> <module> -> shim0 -> main: a cycle
    with pytest.raises(ReadFailed) as e:
        it.walk(7, 64)
    assert e.value.reason == "moved"


def test_a_string_that_is_not_compact_is_refused() -> None:
    lay = LAYOUTS[11]
    mem = FakeMemory()
    s = put_str(mem, lay, "fine")
    assert pyframes.read_str(mem, lay, s) == "fine"
    mem.put(s, lay.str_state, 1 << 2, 4)  # kind 1, not compact (a legacy string)
    with pytest.raises(ReadFailed):
        pyframes.read_str(mem, lay, s)


def test_versions_without_a_layout_are_unknown() -> None:
    mem = FakeMemory()
    runtime = mem.alloc(pyframes.DEBUG_OFFSETS_BYTES)
    for version in (None, 0x030A0DF0, 0x040000F0):
        with pytest.raises(ReadFailed) as e:
            find_interpreter(mem, runtime, version)
        assert e.value.reason == "unknown_version"
    # 3.14's _Py_DebugOffsets is another struct: refused even with the cookie
    mem.put(runtime, 0, int.from_bytes(b"xdebugpy", "little"))
    mem.put(runtime, 8, 0x030E00F0)
    with pytest.raises(ReadFailed) as e:
        find_interpreter(mem, runtime, 0x030E00F0)
    assert e.value.reason == "unknown_version"
    assert find_interpreter(mem, runtime, 0x030B07F0).lay.minor == 11


PY313 = sorted(Path("/root/.pyenv/versions").glob("3.13.*/lib/libpython3.13.so.1.0"))


@pytest.mark.skipif(not PY313, reason="no CPython 3.13 on this machine")
def test_debug_offsets_of_a_real_313_process() -> None:
    """The first bytes of ``_PyRuntime`` in a 3.13 process this test starts decode to a layout
    whose thread-state offsets find that process's own main thread."""
    lib = PY313[0]
    exe = lib.parent.parent / "bin" / "python3"
    p = subprocess.Popen([str(exe), "-c", "import sys; print(1, flush=True); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline() == b"1\n"  # initialized
        start = None
        while start is None:
            for line in Path(f"/proc/{p.pid}/maps").read_text().splitlines():
                parts = line.split()
                if len(parts) >= 6 and parts[5] == str(lib) and parts[2] == "00000000":
                    start = int(parts[0].split("-")[0], 16)
                    break
        from unwindd.binaries.elf import ElfReader

        fd = os.open(lib, os.O_RDONLY)
        try:
            r = ElfReader(fd, os.fstat(fd).st_size)
            syms = elf_symbols(r, (b"_PyRuntime", b"Py_Version"))
            bias = start - (min(s.vaddr for s in r.load_segments()) & ~0xFFF)
        finally:
            os.close(fd)
        mem = pyframes.ProcessMemory(p.pid)
        raw = mem.read(syms[b"_PyRuntime"] + bias, pyframes.DEBUG_OFFSETS_BYTES)
        lay = layout_from_debug_offsets(raw)
        assert lay is not None and lay.minor == 13 and lay.ts_cframe == -1
        assert layout_from_debug_offsets(b"xdebugpz" + raw[8:]) is None
        it = pyframes.Interpreter(mem, syms[b"_PyRuntime"] + bias, lay)
        assert it.thread_state(p.pid)
    finally:
        p.kill()
        p.wait()


def test_process_memory_reads_and_reports_gone() -> None:
    data = b"unwindd pyframes " * 4
    buf = __import__("ctypes").create_string_buffer(data)
    mem = pyframes.ProcessMemory(os.getpid())
    addr = __import__("ctypes").addressof(buf)
    assert mem.read(addr, len(data)) == data
    assert mem.read2(addr, 4, addr + 8, 8) == (data[:4], data[8:16])
    with pytest.raises(ReadFailed) as e:
        mem.read(8, 8)
    assert e.value.reason == "moved"
    p = subprocess.Popen(["true"])
    p.wait()
    with pytest.raises(ReadFailed) as e:
        pyframes.ProcessMemory(p.pid).read(addr, 8)
    assert e.value.reason == "gone"


def F(sym: str) -> Frame:
    return Frame(0x1000, "/lib/x", sym, 0)


EVAL = "_PyEval_EvalFrameDefault"


def test_merge_replace_and_beside() -> None:
    native = [F("leaf"), F(EVAL), F("map_next"), F(EVAL), F("main")]
    segs = [[F("drip")], [F("pour"), F("<module>")]]

    def is_eval(f: Frame) -> bool:
        return f.sym == EVAL

    names = [f.sym for f in merge(native, is_eval, segs, True, False) or []]
    assert names == ["leaf", "drip", "map_next", "pour", "<module>", "main"]
    names = [f.sym for f in merge(native, is_eval, segs, True, True) or []]
    assert names == ["leaf", "drip", EVAL, "map_next", "pour", "<module>", EVAL, "main"]
    # more C frames than segments: never; fewer: only when the native unwind stopped early
    assert merge(native, is_eval, segs[:1], True, False) is None
    assert merge(native[:2], is_eval, segs, True, False) is None
    assert [f.sym for f in merge(native[:2], is_eval, segs, False, False) or []] == [
        "leaf", "drip"]
    assert merge([F("x")], is_eval, segs, False, False) is None


def test_nearest_read_in_time() -> None:
    """Within the skew the nearest read; beyond it only reads on both sides that show the
    same functions (the innermost line may differ), else nothing."""
    py = PythonFrames(table=None, max_skew_ms=10)  # type: ignore[arg-type]
    a = ((Frame(0, "[python]", "spin", None, line=3), Frame(0, "[python]", "main", None)),)
    a2 = ((Frame(0, "[python]", "spin", None, line=4), a[0][1]),)
    b = ((Frame(0, "[python]", "steep", None, line=9), a[0][1]),)
    ms = 1_000_000
    hist: tuple[list[int], list[Any]] = ([100 * ms, 200 * ms, 300 * ms], [a, a2, b])
    assert py.nearest(hist, 105 * ms) is a
    assert py.nearest(hist, 195 * ms) is a2
    assert py.nearest(hist, 140 * ms) is a  # bracketed by a and a2: same functions
    assert py.nearest(hist, 160 * ms) is a2
    assert py.nearest(hist, 250 * ms) is None  # a2 then b: moved on in between
    assert py.nearest(hist, 400 * ms) is None  # nothing read after it yet
    assert py.nearest(([], []), 1) is None
    assert py.stats.bracketed == 2
    gone: tuple[list[int], list[Any]] = ([100 * ms, 200 * ms], [a, "gone"])
    assert py.nearest(gone, 150 * ms) == "gone"  # the process exited between the reads
