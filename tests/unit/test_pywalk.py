"""The native frame walk (cffi_build/pywalk.c through procs/pywalk.py) against real processes:
real CPython 3.11-3.13 children blocked in known frames (the records equal the Python walk's,
``Interpreter.raw_walk``, and decode to the child's own view of its stack), a child exiting
while it is walked, and fake remotes (a buffer in a child holding a chain built at each
layout's offsets) with a cycle, garbage and truncated pointers and a chain too deep: each
ends with the same reason the Python walk gives, counted, never a crash or a wrong name."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from pyinterp import INTERPRETERS, interpreter_of, started
from test_pyframes_decode import FakeMemory, _runtime, put_code, put_frame, sample_code
from unwindd.procs import pyframes
from unwindd.procs.pyframes import FAILURES, LAYOUTS, Interpreter, ProcessMemory, ReadFailed
from unwindd.procs.pywalk import Batch, Walker
from unwindd.unwind.pyreader import PythonFrames

# Blocks in leaf() with, innermost first: leaf, gen (a generator's frame, outside the data
# stack), key (called back from C by sorted: a new interpreter entry), rec x 30, C.method,
# <module>; a second thread blocks in side(). Each prints its own view of its stack.
CHILD = """
import json, sys, threading, time
LOCK = threading.Lock()
def say():
    with LOCK:
        print(json.dumps({"tid": threading.get_native_id(), "stack": view()[1:]}), flush=True)
def view():
    f, out = sys._getframe(1), []
    while f is not None:
        out.append([f.f_code.co_qualname, f.f_lineno])
        f = f.f_back
    return out
def leaf():
    say()
    sys.stdin.readline()
def gen():
    leaf()
    yield 1
def key(x):
    return next(gen())
def rec(n):
    if n:
        return rec(n - 1)
    return sorted([1], key=key)
def side():
    say()
    time.sleep(1000)
class C:
    def method(self):
        threading.Thread(target=side, daemon=True).start()
        rec(30)
C().method()
"""


def _settled(it: Interpreter, tid: int) -> list[pyframes.RawFrame]:
    """``tid``'s records once two reads 50 ms apart agree (it printed, then blocked)."""
    last = None
    for _ in range(200):
        got = it.raw_walk(tid, 128)
        if got == last:
            return got
        last = got
        time.sleep(0.05)
    raise AssertionError(f"thread {tid} never blocked")


def _qualnames(module: object) -> set[str]:
    """The qualnames of a module's functions and its classes' methods, property accessors
    included (``Thread.daemon``'s getter runs in ``Thread.__init__`` and ``_shutdown``)."""
    out: set[str] = set()
    for v in vars(module).values():
        members = list(vars(v).values()) if isinstance(v, type) else []
        members += [f for m in members if isinstance(m, property) for f in (m.fget, m.fset, m.fdel)]
        for f in (v, *members):
            if inspect.isfunction(f) and f.__module__ == getattr(module, "__name__", None):
                out.add(f.__qualname__)
    return out


# What a child running only its own code can also be in: threading's own frames (its threads'
# bootstrap, and at exit ``_shutdown`` and what it calls: ``Thread._stop``, the shutdown locks)
THREADING = _qualnames(threading)


def _names(it: Interpreter, raws: list[pyframes.RawFrame]) -> list[tuple[str, int | None]]:
    return [(f.qualname, f.line) for seg in it.decode(raws) for f in seg]


@pytest.mark.parametrize("python", INTERPRETERS)
def test_native_records_equal_the_python_walk_and_the_childs_view(python: str) -> None:
    """Each thread's records == ``raw_walk``'s (same memory: the child is blocked), decoded
    to the qualnames and lines the child reports (the leaf's line: where it blocks), in far
    fewer syscalls than one per frame."""
    if not Path(python).exists():
        pytest.skip(f"{python} is not installed")
    p = subprocess.Popen([python, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None
        views = [json.loads(p.stdout.readline()) for _ in range(2)]
        it = interpreter_of(p.pid)
        mem = it.mem
        assert isinstance(mem, ProcessMemory)
        for v in views:  # the side thread may print first: block until both printed
            want = [(q, ln) for q, ln in v["stack"]]
            ref = _settled(it, v["tid"])
            calls = mem.calls
            got = Walker().walk([(it, v["tid"])], 128)
            assert mem.calls == calls  # the walk itself made no Python-side read
            t, raws, syscalls = got[0]
            assert raws == ref
            assert isinstance(raws, list)
            names = _names(it, raws)
            assert [n for n, _ in names] == [n for n, _ in want]
            assert names[1:] == want[1:]  # the leaf has moved on to its blocking call
            assert abs(t - time.monotonic_ns()) < 10e9
            if len(want) > 30:
                assert syscalls <= 8 < len(want)
                segs = it.decode(raws)
                assert len(segs) >= 2  # sorted's and next's C calls: entries of their own
        # a batch of both threads, three passes 2 ms apart, in one call
        start = time.monotonic_ns()
        b = Batch(Walker(), [(it, v["tid"]) for v in views], 3, start, 2_000_000, 128)
        b.run()
        assert b.ready() == 6
        res = b.results(0, 6)
        assert [r[1] for r in res] == [it.raw_walk(v["tid"], 128) for v in views] * 3
        times = [r[0] for r in res]
        assert times == sorted(times) and times[4] >= start + 4_000_000
        assert Walker().walk([(it, 1)], 128)[0][1] == "no_thread"
        deep = max(views, key=lambda v: len(v["stack"]))["tid"]
        assert Walker().walk([(it, deep)], 5)[0][1] == "too_deep"
    finally:
        p.kill()
        p.wait()


def test_a_child_exiting_mid_walk_ends_gone_never_wrong() -> None:
    """A child that exits by itself while its threads are walked every ms: every walk is its
    stack (names the child has) or a reason, and the last ones are ``gone``."""
    code = ("import sys, threading, time\n"
            "def spin(end):\n"
            "    while time.monotonic() < end:\n"
            "        pass\n"
            "def deep(n, end):\n"
            "    return deep(n - 1, end) if n else spin(end)\n"
            "end = time.monotonic() + 0.3\n"
            "threading.Thread(target=deep, args=(20, end)).start()\n"
            "print(1, flush=True)\n"
            "deep(40, end)\n")  # fmt: skip
    p = started(sys.executable, code)
    it = interpreter_of(p.pid)
    tids = [int(t.name) for t in Path(f"/proc/{p.pid}/task").iterdir()]
    walker, seen = Walker(), Counter[str]()
    deadline = time.monotonic() + 30
    last: list[str] = []
    while time.monotonic() < deadline:
        b = Batch(walker, [(it, t) for t in tids], 20, time.monotonic_ns(), 1_000_000, 128)
        b.run()
        for _, raws, _ in b.results(0, b.ready()):
            if isinstance(raws, str):
                assert raws in FAILURES
                seen[raws] += 1
                last.append(raws)
                continue
            try:
                names = {n for n, _ in _names(it, raws)}
            except ReadFailed as e:  # its strings went with it
                seen["decode:" + e.reason] += 1
                continue
            seen["ok"] += 1
            last.append("ok")
            assert names <= {"spin", "deep", "<module>"} | THREADING, names
        if p.poll() is not None and last[-len(tids):] == ["gone"] * len(tids):
            break
    assert p.wait() == 0
    assert seen["ok"] > 0 and seen["gone"] > 0, seen
    assert last[-1] == "gone"
    assert Walker().walk([(it, tids[0])], 128)[0][1] == "gone"


# A child holding a fake remote: ``size`` bytes mapped and followed by an unmapped page, with
# a hole (an unmapped page) two pages before the end; its address printed; each image sent as
# "<length>\n<bytes>" is copied to the start, then "ok".
HOLDER = """
import ctypes, sys
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
size = int(sys.argv[1])
base = libc.mmap(None, size + 4096, 3, 0x22, -1, 0)
libc.munmap(ctypes.c_void_p(base + size), 4096)
libc.munmap(ctypes.c_void_p(base + size - 8192), 4096)
print(base, flush=True)
while line := sys.stdin.buffer.readline():
    data = sys.stdin.buffer.read(int(line))
    ctypes.memmove(base, data, len(data))
    print("ok", flush=True)
"""
SIZE = 1 << 18


class Remote(FakeMemory):
    """FakeMemory whose addresses are the holder child's: ``load`` copies it there."""

    def __init__(self, holder: subprocess.Popen[bytes], base: int) -> None:
        super().__init__()
        self.holder, self.base = holder, base
        self.next = base

    def load(self) -> None:
        img = bytearray(max(a + len(b) for a, b in self.regions) - self.base)
        for addr, buf in self.regions:
            assert addr + len(buf) <= self.base + SIZE - 8192  # below the hole
            img[addr - self.base : addr - self.base + len(buf)] = buf
        assert self.holder.stdin is not None and self.holder.stdout is not None
        self.holder.stdin.write(b"%d\n" % len(img) + bytes(img))
        self.holder.stdin.flush()
        assert self.holder.stdout.readline() == b"ok\n"


def _both(mem: Remote, runtime: int, lay: pyframes.Layout, tid: int, max_frames: int = 64
          ) -> tuple[object, object]:  # fmt: skip
    """(the native walk of the child's copy, the Python walk of this process's): records or
    reason of each."""
    mem.load()
    it = Interpreter(ProcessMemory(mem.holder.pid), runtime, lay)
    native = Walker().walk([(it, tid)], max_frames)[0][1]
    try:
        ref: object = Interpreter(mem, runtime, lay).raw_walk(tid, max_frames)
    except ReadFailed as e:
        ref = e.reason
    return native, ref


@pytest.fixture
def holder() -> object:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(SIZE)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)  # fmt: skip
    assert p.stdout is not None
    base = int(p.stdout.readline())
    yield p, base
    p.kill()
    p.wait()


@pytest.mark.parametrize("minor", [11, 12])
def test_fake_remote_cycles_garbage_truncation_depth(holder: tuple[subprocess.Popen[bytes], int],
                                                      minor: int) -> None:  # fmt: skip
    """A chain in a child's buffer at the 3.11 / 3.12 offsets: intact, the native records ==
    the Python walk's of the same bytes; a cycle, a garbage or truncated pointer (a frame or
    code header running into the unmapped page after the buffer) and a chain deeper than
    max_frames each end with the Python walk's reason."""
    lay = LAYOUTS[minor]
    mem = Remote(*holder)
    co = sample_code()
    codes = [put_code(mem, lay, co, f"f{i}") for i in range(5)]
    frames: list[int] = []
    prev = 0
    for i in range(30):
        prev = put_frame(mem, lay, codes[i % 5], 2 + i % 4, prev, entry=i % 10 == 0,
                         owner=3 if minor >= 12 and i % 10 == 5 else 0)  # fmt: skip
        frames.append(prev)
    runtime = _runtime(mem, lay, {55: frames[-1], 56: frames[3]})
    native, ref = _both(mem, runtime, lay, 55)
    assert isinstance(native, list) and native == ref and len(native) == 30
    it = Interpreter(mem, runtime, lay)
    assert [q for seg in it.decode(native) for q in (f.qualname for f in seg)][:3] == [
        "f4", "f3", "f2"]  # fmt: skip
    assert _both(mem, runtime, lay, 56) == (ref[-4:], ref[-4:])
    assert _both(mem, runtime, lay, 57) == ("no_thread", "no_thread")
    assert _both(mem, runtime, lay, 55, 29) == ("too_deep", "too_deep")
    end = mem.base + SIZE  # the unmapped page
    cases = {
        "cycle": (frames[2], lay.frame_previous, frames[20]),
        "self": (frames[7], lay.frame_previous, frames[7]),
        "garbage prev": (frames[10], lay.frame_previous, 0xDEAD0000),
        "kernel prev": (frames[10], lay.frame_previous, 0xFFFF_8880_0000_0000),
        "truncated frame": (frames[10], lay.frame_previous, end - lay.frame_bytes // 2),
        "frame after a hole": (frames[10], lay.frame_previous,
                               end - 4096 - lay.frame_bytes // 2),
        "garbage code": (frames[11], lay.frame_code, 0x10),
        "truncated code": (frames[11], lay.frame_code, end - 8),
        "null code": (frames[11], lay.frame_code, 0),
    }
    for name, (addr, off, value) in cases.items():
        old = int.from_bytes(mem.read(addr + off, 8), "little")
        mem.put(addr, off, value)
        got = _both(mem, runtime, lay, 55)
        assert got == ("moved", "moved"), name
        mem.put(addr, off, old)
    assert _both(mem, runtime, lay, 55) == (ref, ref)


def test_reader_counts_a_dead_pid_as_gone() -> None:
    """PythonFrames over the native walk: a thread whose process exited reads as ``gone``,
    counted as a read with its syscalls."""
    p = started(sys.executable, "import sys; print(1, flush=True); sys.stdin.read()")
    it = interpreter_of(p.pid)
    py = PythonFrames(table=None)  # type: ignore[arg-type]
    got = py._walk_many([(it, p.pid)])
    assert isinstance(got[0][1], tuple) and got[0][1][0][0].sym == "<module>"
    p.kill()
    p.wait()
    assert py._walk_many([(it, p.pid)])[0][1] == "gone"
    assert py.stats.reads == 2 and 2 <= py.stats.syscalls < 20


def test_short_slice_keeps_policy_and_nice() -> None:
    """The reader thread's slice (pywalk.short_slice): the kernel's ``se.slice`` of that thread
    only, its nice and policy unchanged (this machine's kernel has custom slices)."""
    import os
    import threading

    from unwindd.procs.pywalk import short_slice

    out: dict[str, object] = {}

    def run() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + 1)
        before = os.getpriority(os.PRIO_PROCESS, tid)
        out["ok"] = short_slice(300_000)
        out["nice"] = (before, os.getpriority(os.PRIO_PROCESS, tid))
        out["sched"] = Path(f"/proc/self/task/{tid}/sched").read_text()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert out["ok"]
    nice = out["nice"]
    assert isinstance(nice, tuple) and nice[0] == nice[1]
    fields = {k.strip(): v.strip() for k, _, v in
              (ln.partition(":") for ln in str(out["sched"]).splitlines() if ":" in ln)}
    assert int(fields["se.slice"]) == 300_000 and int(fields["policy"]) == 0
    own = Path(f"/proc/self/task/{threading.get_native_id()}/sched").read_text()
    assert "se.slice" in own and " 300000\n" not in own  # the caller's own slice untouched
