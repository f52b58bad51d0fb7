"""procscan: /proc/<pid>/stat and maps parsing (sans-IO) and ProcFS on the committed fake tree
(tests/support/fakeproc) and on the real /proc."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from unwindd.procs.procscan import (
    PF_KTHREAD,
    ProcFS,
    exec_mappings,
    parse_stat,
    ticks_from_monotonic,
)

FAKEPROC = Path(__file__).parents[1] / "support" / "fakeproc"

STAT = (
    "11078 (cat) R 11074 11074 4554 0 -1 4194304 100 0 0 0 0 0 0 0 20 0 1 0 193117 3133440 "
    "416 18446744073709551615 94281084141568 94281084161449 140723036218864 0 0 0 0 0 0 0 0 0 "
    "17 0 0 0 0 0 0 94281084177456 94281084179072 94282110476288 140723036224216 0"
)


def test_parse_stat_fields() -> None:
    st = parse_stat(STAT)
    assert st is not None
    assert (st.pid, st.comm, st.state, st.ppid, st.start_time) == (11078, "cat", "R", 11074, 193117)
    assert not st.kernel_thread


def test_parse_stat_comm_with_parentheses_and_spaces() -> None:
    # comm is whatever 15 bytes the task chose: it runs to the LAST ')'
    st = parse_stat(STAT.replace("(cat)", "(a) b (c d)"))
    assert st is not None and st.comm == "a) b (c d" and st.start_time == 193117


def test_parse_stat_rejects_garbage() -> None:
    assert parse_stat("") is None
    assert parse_stat("12 (x) S 1 2 3") is None  # truncated
    assert parse_stat("12 x) S " + "1 " * 30) is None  # no '('
    assert parse_stat("zz (x) S " + "1 " * 30) is None  # bad pid
    assert parse_stat(STAT.replace(" 193117 ", " nope ")) is None


def test_exec_mappings_keeps_only_executable() -> None:
    text = (FAKEPROC / "4242" / "maps").read_text()
    names = [m.filename for m in exec_mappings(text)]
    assert names == ["/usr/bin/fake app", "/usr/lib/libfake.so", "", "/tmp/gone (deleted)",
                     "[vdso]", "[vsyscall]"]  # fmt: skip


def test_procfs_on_fake_tree() -> None:
    fs = ProcFS(str(FAKEPROC))
    assert fs.pids() == [2, 777, 4242, 5151]  # 'kallsyms', 'notapid' are not processes
    kt = fs.info(2)
    assert kt is not None and kt.kernel_thread and kt.maps == () and kt.comm == "kthreadd"
    assert fs.info(777) is None  # stat but no maps: gone (a zombie has an empty one)
    assert fs.info(31337) is None
    app = fs.info(4242)
    assert app is not None
    assert (app.comm, app.start_time, app.kernel_thread) == ("fake app", 123456, False)
    assert [hex(m.start) for m in app.maps][:2] == ["0x5600aa002000", "0x7f0000026000"]
    weird = fs.info(5151)
    assert weird is not None and weird.comm == "we) ird (x"
    assert [m.filename for m in weird.maps] == ["/opt/we ird/bin (deleted)", "[vsyscall]"]
    assert [i.pid for i in fs.scan()] == [2, 4242, 5151]
    assert [i.pid for i in fs.scan(max_processes=2)] == [2]  # 777 vanished: nothing to show
    assert fs.read(4242, "comm") == "fake app\n"
    assert fs.read(4242, "nosuch") is None


def test_procfs_bounds_maps_reads(tmp_path: Path) -> None:
    d = tmp_path / "9"
    d.mkdir()
    (d / "stat").write_text(STAT.replace("11078 (cat)", "9 (big)"))
    line = "7f0000000000-7f0000001000 r-xp 00000000 fe:00 5     /lib/x.so\n"
    (d / "maps").write_text(line * 1000)
    info = ProcFS(str(tmp_path), max_maps_bytes=len(line) * 10).info(9)
    assert info is not None and len(info.maps) == 10


def test_procfs_real_self_and_a_child() -> None:
    fs = ProcFS()
    me = fs.info(os.getpid())
    assert me is not None and not me.kernel_thread
    assert any("python" in m.filename or "libc" in m.filename for m in me.maps)
    kthreadd = fs.stat(2)
    assert kthreadd is not None and kthreadd.flags & PF_KTHREAD
    t0 = time.monotonic_ns()
    child = subprocess.Popen(["sleep", "5"])
    t1 = time.monotonic_ns()
    try:
        st = fs.stat(child.pid)
        assert st is not None
        # the start time derived from our monotonic clock matches the kernel's to a tick:
        # the fork happened between t0 and t1 (a loaded machine can stretch that gap)
        boot, tck = fs.boot_offset_ns(), fs.clk_tck
        lo, hi = ticks_from_monotonic(t0, boot, tck), ticks_from_monotonic(t1, boot, tck)
        assert lo - 1 <= st.start_time <= hi + 1, (st.start_time, lo, hi)
    finally:
        child.kill()
        child.wait()
    assert fs.info(child.pid) is None  # reaped: gone


def test_full_scan_cost_is_bounded() -> None:
    """The bootstrap's /proc cost on this machine, per process (printed for BENCHMARKS.md): the
    best of three scans in this thread's CPU time (kernel time included), so a preempted scan
    on a loaded machine is not taken for a slow one; the bound catches a scan gone quadratic."""
    fs = ProcFS()
    times = []
    for _ in range(3):
        t0 = time.thread_time()
        infos = list(fs.scan())
        times.append(time.thread_time() - t0)
    dt = min(times)
    n = len(infos)
    per = dt / max(n, 1)
    print(f"scan: {n} processes, {sum(len(i.maps) for i in infos)} exec mappings, "
          f"{dt * 1e3:.1f} ms, {per * 1e6:.0f} us/process")  # fmt: skip
    assert per < 2e-3
