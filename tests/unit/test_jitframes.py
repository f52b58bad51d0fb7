"""JIT frame kinds and counts (unwind/jitframes.py), and which mappings are JIT code
(procs/space.py is_jit_name): frames as the engine names them, stacks as it hands them out."""

from __future__ import annotations

from unwindd.procs.space import is_jit_name
from unwindd.unwind.jitframes import JIT_KINDS, JitStats, jit_kind, stack_jit
from unwindd.unwind.stackfmt import Frame

MAP = "/tmp/perf-42.map"
DUMP = "/srv/app/jit-42.dump"


def js(name: str, ip: int = 0x7F0000001000) -> Frame:
    return Frame(ip, MAP, f"JS:*{name} /x.js:1:1", 0x10, rel=ip)


def jd(name: str, ip: int = 0x7F0000003000) -> Frame:
    return Frame(ip, DUMP, f"JS:*{name} /x.js:1:1", 0x10, rel=ip)


KERNEL = Frame(0xFFFFFFFF81000000, "[kernel.kallsyms]", "asm_exc_page_fault", 0, kernel=True)
ANON = Frame(0x7F0000002000, "//anon", None, None, rel=0x7F0000002000)
NODE_MAIN = Frame(0xC6853E, "/usr/bin/node", "node::Start", 0x3E)
START = Frame(0xBB835D, "/usr/bin/node", "_start", 0x2D)
CLONE3 = Frame(0x7F00000F0000, "/usr/lib/x86_64-linux-gnu/libc.so.6", "clone3", 0x2C)


def test_jit_names() -> None:
    for name in ("//anon", "", "[anon:v8 code]", "/memfd:doublemapper (deleted)"):
        assert is_jit_name(name), name
    for name in ("[vdso]", "[vsyscall]", "[stack]", "/usr/bin/node", "[heap]"):
        assert not is_jit_name(name), name


def test_kinds() -> None:
    assert jit_kind(js("f")) == "perf_map"
    assert jit_kind(ANON) == "anonymous"
    assert jit_kind(Frame(0x1, "", None, None)) == "anonymous"  # /proc maps' nameless mapping
    assert jit_kind(NODE_MAIN) is None and jit_kind(KERNEL) is None
    assert jit_kind(Frame(0x1, None, None, None)) is None  # no mapping at all
    assert jit_kind(jd("f")) == "jitdump"
    # the dump's own (executable) mapping, unnamed: not JIT code
    assert jit_kind(Frame(0x1, DUMP, None, None)) is None
    assert set(JIT_KINDS) == {"perf_map", "jitdump", "anonymous"}


def test_stack_jit() -> None:
    assert stack_jit((KERNEL, js("leaf"), ANON, js("top"), NODE_MAIN, START)) == ((2, 0, 1),
                                                                                  True)
    assert stack_jit((js("leaf"), jd("mid"), CLONE3)) == ((1, 1, 0), True)
    assert stack_jit((js("leaf"), NODE_MAIN)) == ((1, 0, 0), False)  # stopped before _start
    assert stack_jit((NODE_MAIN, START, KERNEL)) == ((0, 0, 0), True)  # kernel frames: not last
    assert stack_jit((KERNEL,)) == ((0, 0, 0), False)


def test_counts_per_sample_and_runtime() -> None:
    runtimes = {1: "node", 2: "java"}
    st = JitStats(runtimes.get)
    through = (js("leaf"), ANON, js("top"), NODE_MAIN, START)
    stuck = (js("leaf"), ANON)
    native = (NODE_MAIN, START)
    st.count(1, through, 3)
    st.count(1, through)  # the same tuple again: from the identity cache
    st.count(1, stuck, 2)
    st.count(1, native, 5)  # no JIT frame: counted nowhere
    st.count(2, (js("m"), CLONE3))
    st.count(None, stuck)
    st.count(1, (jd("leaf"), jd("top"), NODE_MAIN), 2)
    assert st.frames == {"perf_map": 4 * 2 + 2 + 1 + 1, "anonymous": 4 + 2 + 1, "jitdump": 4}
    assert st.status() == {
        "frames": {"perf_map": 12, "jitdump": 4, "anonymous": 7},
        "runtimes": {"java": {"samples": 1, "complete": 1},
                     "node": {"samples": 8, "complete": 4},
                     "unknown": {"samples": 1, "complete": 0}},
    }  # fmt: skip
    # an equal but distinct tuple (a new stack object) counts the same
    st.count(1, tuple(through))
    st.count(1, (*through[:-1], START))
    assert st.stacks["node"] == 10 and st.complete["node"] == 6


def test_runtime_labels_are_bounded() -> None:
    st = JitStats(lambda pid: f"rt{pid}")
    for pid in range(200):
        st.count(pid, (js("f"),))
    assert len(st.stacks) == 65 and st.stacks["other"] == 200 - 64
