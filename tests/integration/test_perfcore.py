"""unwindd.source.perfcore (with sampling.py's configs and error messages) against the real
kernel: sessions on real processes, decoded with ``decoder.RecordDecoder([session.event_format])``,
checked against ground truth the target itself announces (tests/support/native/busy.c prints its
pid and the address of a stack slot holding a magic value while it spins).

Layers: argument checks and error messages; one system-wide session around a child
that execs and exits (samples, MMAP2, COMM exec, EXIT, their order); a pid session with inherit
that must see a grandchild forked after it opened; a cgroup v2 session; the output-full path
of drain on real rings. Needs root (or CAP_PERFMON), cgroup v2 and gcc, all present on the dev
machine; nothing here is skipped.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection
from unwindd.source import abi, perfcore, records, sampling
from unwindd.source.decoder import RecordDecoder
from unwindd.source.perfcore import PerfSession
from unwindd.source.sampling import (
    AUTO_MAX_PAGES,
    PerfOpenError,
    SamplingConfig,
    Target,
    auto_ring_pages,
    online_cpus,
    parse_cpu_list,
    ring_fill_seconds,
    ring_pages_cap,
)

TESTS = pathlib.Path(__file__).resolve().parents[1]
BUSY_SRC = TESTS / "support" / "native" / "busy.c"
MAGIC = 0xFEEDFACECAFEBEEF
SP = abi.regs_in_mask(abi.X86_64_REGS_MASK).index(7)  # perf_regs.h: PERF_REG_X86_SP = 7
IP = abi.regs_in_mask(abi.X86_64_REGS_MASK).index(8)  # PERF_REG_X86_IP = 8
PROT_EXEC = 4


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="session")
def busy(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "gcc is needed to build the sampling target"
    exe = tmp_path_factory.mktemp("busy").resolve() / "busy"
    subprocess.run([cc, "-O1", "-g", "-o", str(exe), str(BUSY_SRC)], check=True)
    return exe


def build_id_of(path: pathlib.Path) -> bytes:
    out = subprocess.run(["readelf", "-n", str(path)], check=True, capture_output=True, text=True)
    m = re.search(r"Build ID: ([0-9a-f]+)", out.stdout)
    assert m, out.stdout
    return bytes.fromhex(m.group(1))


@dataclass
class Announce:
    pid: int
    local: int  # address of the stack slot holding MAGIC


def read_announce(proc: subprocess.Popen[bytes]) -> Announce:
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    m = re.fullmatch(r"pid=(\d+) local=0x([0-9a-f]+)\n", line)
    assert m, f"unexpected announce line {line!r}"
    return Announce(int(m.group(1)), int(m.group(2), 16))


@dataclass
class Capture:
    per_cpu: dict[int, list[records.Record]]
    decoder: RecordDecoder

    def all(self) -> Iterator[records.Record]:
        for recs in self.per_cpu.values():
            yield from recs

    def samples(self, pid: int | None = None) -> list[records.Sample]:
        out = [r for r in self.all() if isinstance(r, records.Sample)]
        return [s for s in out if pid is None or s.pid == pid]


def collect(session: PerfSession, done: Callable[[], bool], timeout: float = 10.0) -> Capture:
    """Drain every 5 ms until ``done()`` (checked *before* a drain, so the drain after it sees
    everything written up to then) or the timeout."""
    dec = RecordDecoder([session.event_format])
    per_cpu: dict[int, list[records.Record]] = defaultdict(list)
    deadline = time.monotonic() + timeout
    while True:
        finished = done()
        for cpu, chunk in session.drain():
            assert len(chunk) % 8 == 0
            per_cpu[cpu].extend(dec.decode(chunk))
        if finished:
            break
        assert time.monotonic() < deadline, "target did not finish in time"
        time.sleep(0.005)
    assert session.ring_errors == 0
    assert dec.stats.error_count == 0, dec.stats
    return Capture(dict(per_cpu), dec)


def check_sample_shape(s: records.Sample, config: SamplingConfig) -> None:
    """What every sample of a user task must look like under ``config``."""
    if s.regs_abi == abi.REGS_ABI_NONE:
        # A task that has left its mm behind in do_exit (exit_mm runs before
        # perf_event_exit_task) has no user regs: kernel/events/core.c perf_sample_regs_user
        # reports ABI_NONE, and perf_output_sample_ustack then writes a zero size.
        assert s.cpumode == abi.MISC_KERNEL
        assert s.regs == () and s.stack_size == 0 and s.dyn_size == 0
        return
    assert s.regs_abi == abi.REGS_ABI_64
    assert len(s.regs) == bin(config.regs_mask).count("1")
    assert s.stack_size == config.stack_size
    assert s.dyn_size <= s.stack_size
    # In the kernel (exec, exit, a fault) the nofault copy of the user stack can fail whole
    # (kernel/events/core.c perf_output_sample_ustack: dyn_size = what was copied): seen once
    # in CI, a kernel-mode sample of this child with regs and dyn_size 0. Interrupted in user
    # code, sp's page was just in use.
    if s.cpumode == abi.MISC_USER:
        assert s.dyn_size > 0
        assert s.ip == s.regs[IP]  # a user-mode sample's ip is the interrupted user ip
        assert s.callchain == ()  # exclude_callchain_user, and no kernel part in user mode


def check_magic(s: records.Sample, ann: Announce) -> None:
    """A sample inside spin(): the stack copy starts at sp and holds MAGIC at &magic."""
    sp = s.regs[SP]
    assert sp <= ann.local < sp + s.dyn_size, (hex(sp), hex(ann.local), s.dyn_size)
    off = ann.local - sp
    assert struct.unpack_from("<Q", s.stack, off)[0] == MAGIC


def exec_range(cap: Capture, pid: int, path: pathlib.Path) -> list[records.Mmap2]:
    return [
        r
        for r in cap.all()
        if isinstance(r, records.Mmap2)
        and r.pid == pid
        and r.filename == str(path)
        and r.prot & PROT_EXEC
    ]


def in_ranges(ip: int, ranges: list[tuple[int, int]]) -> bool:
    return any(lo <= ip < hi for lo, hi in ranges)


# Where magic is live on the stack: spin() and the one function of the binary it calls. A
# sample elsewhere in the binary's text (_init's first touch of the text page at start-up,
# main around the call) has its sp above &magic.
SPINNING = ("spin", "now_ms")


def spinning_ranges(path: pathlib.Path, maps: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """Run-time ranges of SPINNING's functions in ``maps``' executable mappings of ``path``
    (start, end, file offset): a symbol's file offset comes from its PT_LOAD segment (ELF
    gABI, program header), its address from the mapping holding that offset."""
    with path.open("rb") as f:
        elf = ELFFile(f)
        symtab = elf.get_section_by_name(".symtab")
        assert isinstance(symtab, SymbolTableSection), "busy is built with a symbol table"
        loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
        spans = []
        for name in SPINNING:
            (sym,) = symtab.get_symbol_by_name(name) or [None]
            assert sym is not None and sym["st_size"] > 0, f"{name} not in {path}"
            addr = sym["st_value"]
            (seg,) = [s for s in loads if s["p_vaddr"] <= addr < s["p_vaddr"] + s["p_memsz"]]
            off = addr - seg["p_vaddr"] + seg["p_offset"]
            spans.append((off, off + sym["st_size"]))
    out = [
        (start + lo - pgoff, start + hi - pgoff)
        for start, end, pgoff in maps
        for lo, hi in spans
        if pgoff <= lo and hi <= pgoff + (end - start)
    ]
    assert len(out) == len(SPINNING), (maps, spans)
    return out


def proc_text_maps(pid: int, path: pathlib.Path) -> list[tuple[int, int, int]]:
    """Executable mappings of ``path`` in /proc/<pid>/maps as (start, end, file offset)
    (proc(5))."""
    out = []
    for line in pathlib.Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path) and "x" in fields[1]:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi, int(fields[2], 16)))
    assert out, f"{path} not mapped executable in pid {pid}"
    return out


# --------------------------------------------------------------------------- argument checks


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("0") == [0]
    assert parse_cpu_list("") == []
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")
    assert online_cpus() == parse_cpu_list(
        pathlib.Path("/sys/devices/system/cpu/online").read_text()
    )


def missing_pid() -> int:
    pid_max = int(pathlib.Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(pid_max - 1, 1, -1):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    raise AssertionError("no free pid")


@pytest.mark.parametrize("stack_size", [12, 65536, 65528 + 8, -8])
def test_bad_stack_size_is_refused_before_any_syscall(stack_size: int) -> None:
    # A missing pid would make perf_event_open fail with ESRCH: a ValueError proves we never
    # got that far.
    with pytest.raises(ValueError, match="stack_size"):
        PerfSession.open(Target(pids=(missing_pid(),)), SamplingConfig(stack_size=stack_size))


@pytest.mark.parametrize(
    ("config", "pattern"),
    [
        (SamplingConfig(event="cycle"), "unknown event 'cycle'"),
        (SamplingConfig(ring_pages=3), "ring_pages"),
        (SamplingConfig(ring_pages=-1), "ring_pages"),
        (SamplingConfig(ring_pages=1 << 21), "ring_pages"),
        (SamplingConfig(frequency=0), "frequency"),
        (SamplingConfig(period=0), "period"),
        (SamplingConfig(regs_mask=1 << 64), "regs_mask"),
    ],
)
def test_bad_config(config: SamplingConfig, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        PerfSession.open(Target(all_cpus=True), config)


def test_auto_ring_pages() -> None:
    """ring_pages 0 takes a ring whose half holds 60 ms of a busy CPU's samples (each the
    whole stack_size plus ~512 bytes) and at least 2 of them, a power of two from 64 to 256
    pages; the cap is the locked-memory budget per CPU (perf_event_mlock_kb in whole pages
    each, plus RLIMIT_MEMLOCK shared, less each ring's header page; none with CAP_IPC_LOCK),
    at least 16 pages (below that the map fails with the kernel's error)."""
    assert auto_ring_pages(99, 8192) == 64
    assert auto_ring_pages(499, 8192) == 128
    assert auto_ring_pages(999, 8192) == auto_ring_pages(1000, 8192) == 256
    assert auto_ring_pages(1, 0) == 64 and auto_ring_pages(10**6, 65528) == AUTO_MAX_PAGES
    assert auto_ring_pages(1, 65528) == 128  # half must hold 2 samples of ~64.5 KiB
    for freq in (1, 50, 99, 250, 999, 4000):
        for stack in (0, 512, 8192, 65528):
            pages = auto_ring_pages(freq, stack)
            rec = stack + 512
            half = pages * 4096 // 2
            assert pages & (pages - 1) == 0 and 64 <= pages <= AUTO_MAX_PAGES
            assert pages == AUTO_MAX_PAGES or half >= max(freq * rec * 0.06, rec)
            assert pages == 64 or half < 2 * max(freq * rec * 0.06, 2 * rec)  # the smallest
    mib = 1 << 20
    assert ring_pages_cap(4096, 2, 516, 0, False) == 128  # 129 pages a CPU, less the header
    assert ring_pages_cap(4096, 2, 516, 255 * 4096, False) == 128  # 1 page short of 256
    assert ring_pages_cap(4096, 2, 516, 256 * 4096, False) == 256
    assert ring_pages_cap(4096, 64, 516, 8 * mib, False) == 128  # 8 MiB over 64 CPUs: +32
    assert ring_pages_cap(4096, 64, 516, 64 * mib, False) == 256
    assert ring_pages_cap(4096, 64, 4, 0, False) == 16  # nothing fits: the retry floor
    assert ring_pages_cap(4096, 64, 4, 0, True) == AUTO_MAX_PAGES  # CAP_IPC_LOCK: no budget
    assert ring_pages_cap(4096, 2, 517, 0, False) == 128  # whole pages: 517 KiB is 129
    assert ring_pages_cap(65536, 2, 516, 64 * 65536, False) == 32  # 8 + 32 - 1 -> 32
    sized = SamplingConfig(frequency=999).resolved(4096, 128)
    assert (sized[0].ring_pages, sized[1]) == (128, 256)
    # the spill's longest sleep comes from the time a ring takes to fill at the most the
    # samples write: 256 pages 3/4 full at 999 Hz of 8 KiB stacks (+512) is ~90 ms
    fill = ring_fill_seconds(SamplingConfig(frequency=999, ring_pages=256), 0.75)
    assert fill == 256 * 4096 * 0.75 / (999 * (8192 + 512))
    assert ring_fill_seconds(SamplingConfig(period=10_000, ring_pages=256), 0.75) is None
    assert ring_fill_seconds(SamplingConfig(frequency=999), 0.75) is None  # not sized yet
    assert SamplingConfig(frequency=99).resolved(4096, 128)[0].ring_pages == 64
    assert SamplingConfig(period=10**6).resolved(4096, 32)[0].ring_pages == 32
    assert SamplingConfig(ring_pages=8).resolved(4096, 128) == (SamplingConfig(ring_pages=8), 8)


def test_auto_ring_pages_in_a_real_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """The session opens with the auto size resolved (what the watermark and mmap used),
    keeps an operator's size as chosen, and halves an auto size the kernel will not lock."""
    ncpu, page = len(online_cpus()), os.sysconf("SC_PAGE_SIZE")
    cap = sampling.system_ring_cap(page, ncpu)
    for freq in (99, 999):
        want = auto_ring_pages(freq, 8192, page)
        with PerfSession.open(Target(all_cpus=True), SamplingConfig(frequency=freq)) as s:
            # as root here (CAP_IPC_LOCK) the budget is not checked, so no EPERM halving
            assert (s.config.ring_pages, s.ring_pages_wanted) == (min(want, cap), want)
    with PerfSession.open(Target(all_cpus=True), SamplingConfig(ring_pages=8)) as s:
        assert (s.config.ring_pages, s.ring_pages_wanted) == (8, 8)
    # the kernel refuses (EPERM) rings over 32 pages: auto halves down to 32, a set size fails
    real_lib = perfcore.lib
    real_map = real_lib.pc_ring_map
    sizes: list[int] = []

    class Lib:
        def __getattr__(self, name: str) -> Any:
            return getattr(real_lib, name)

        @staticmethod
        def pc_ring_map(ring: Any, fd: int, cpu: int, pages: int) -> int:
            sizes.append(pages)
            return -errno.EPERM if pages > 32 else int(real_map(ring, fd, cpu, pages))

    monkeypatch.setattr(perfcore, "lib", Lib())
    monkeypatch.setattr(perfcore, "system_ring_cap", lambda page, n: 256)
    with PerfSession.open(Target(all_cpus=True), SamplingConfig(frequency=999)) as s:
        assert (s.config.ring_pages, s.ring_pages_wanted) == (32, 256)
    assert sizes[:3] == [256, 128, 64] and set(sizes[3:]) == {32}
    with pytest.raises(sampling.RingMapError, match="64 data pages") as e:
        PerfSession.open(Target(all_cpus=True), SamplingConfig(ring_pages=64))
    assert e.value.errno == errno.EPERM


@pytest.mark.parametrize(
    "target",
    [Target(), Target(all_cpus=True, pids=(1,)), Target(pids=(0,)), Target(cgroup="")],
)
def test_bad_target(target: Target) -> None:
    with pytest.raises(ValueError):
        PerfSession.open(target)


def test_nonexistent_pid() -> None:
    pid = missing_pid()
    with pytest.raises(PerfOpenError, match=f"pid {pid} does not exist") as ei:
        PerfSession.open(Target(pids=(pid,)))
    assert ei.value.errno == errno.ESRCH
    assert isinstance(ei.value, OSError)


def test_nonexistent_cgroup(tmp_path: pathlib.Path) -> None:
    path = f"/sys/fs/cgroup/unwindd-no-such-{uuid.uuid4().hex[:8]}"
    with pytest.raises(PerfOpenError, match="does not exist") as ei:
        PerfSession.open(Target(cgroup=path))
    assert ei.value.errno == errno.ENOENT and path in str(ei.value)
    # A directory that is not a cgroup: the kernel says EBADF (perf_cgroup_connect).
    with pytest.raises(PerfOpenError, match="not a cgroup directory") as ei:
        PerfSession.open(Target(cgroup=str(tmp_path)))
    assert ei.value.errno == errno.EBADF


def test_unsupported_attr_names_what_was_asked() -> None:
    # DS is not a 64-bit user register (arch/x86/kernel/perf_regs.c: REG_NOSUPPORT).
    mask = abi.X86_64_REGS_MASK | 1 << 12
    with pytest.raises(PerfOpenError, match="unsupported perf_event_attr") as ei:
        PerfSession.open(Target(all_cpus=True), SamplingConfig(regs_mask=mask))
    assert ei.value.errno == errno.EINVAL and f"regs_mask={mask:#x}" in str(ei.value)
    # Above kernel.perf_event_max_sample_rate (perf_event_open: sample_freq > sysctl -> EINVAL).
    with pytest.raises(PerfOpenError, match="perf_event_max_sample_rate=") as ei:
        PerfSession.open(Target(all_cpus=True), SamplingConfig(frequency=10**9))
    assert "1000000000 Hz" in str(ei.value)


def _run_as_child(code: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    # The package this test imported (installed or editable), not the checkout's sources,
    # which lack the built extension after a plain `pip install .`.
    import unwindd

    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(unwindd.__file__).parent.parent))
    return subprocess.run(
        [*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env
    )


def test_permission_error_explains_what_is_needed() -> None:
    code = (
        "from unwindd.source.perfcore import PerfSession\n"
        "from unwindd.source.sampling import PerfOpenError, Target\n"
        "try:\n"
        "    PerfSession.open(Target(all_cpus=True))\n"
        "except PerfOpenError as e:\n"
        "    print(e.errno, e)\n"
    )
    # Root without capabilities (empty bounding set, so exec grants none): what an
    # unprivileged daemon user sees, while still able to read this checkout.
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to drop capabilities"
    proc = _run_as_child(code, (setpriv, "--bounding-set", "-all", "--inh-caps", "-all", "--"))
    assert proc.returncode == 0, proc.stderr
    paranoid = pathlib.Path("/proc/sys/kernel/perf_event_paranoid").read_text().strip()
    err, _, msg = proc.stdout.partition(" ")
    assert int(err) in (errno.EACCES, errno.EPERM)
    assert "CAP_PERFMON" in msg and "perf_event_paranoid <= 0" in msg
    assert f"(currently {paranoid})" in msg


def test_fd_exhaustion_says_how_many_fds() -> None:
    code = (
        "import os, resource\n"
        "from unwindd.source.perfcore import PerfSession\n"
        "from unwindd.source.sampling import PerfOpenError, Target\n"
        "n = len(os.listdir('/proc/self/fd'))\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (n + 1, resource.getrlimit(resource."
        "RLIMIT_NOFILE)[1]))\n"
        "try:\n"
        "    PerfSession.open(Target(all_cpus=True), cpus=[0, 1, 0, 1])\n"
        "except PerfOpenError as e:\n"
        "    print(e.errno, e)\n"
    )
    proc = _run_as_child(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{errno.EMFILE} "), proc.stdout
    assert "needs 4 perf fds" in proc.stdout and "RLIMIT_NOFILE" in proc.stdout


# --------------------------------------------------------------------------- real sessions


@pytest.mark.parametrize("build_id", [True, False])
def test_system_wide_sees_child_lifecycle(busy: pathlib.Path, build_id: bool) -> None:
    config = SamplingConfig(frequency=999, ring_pages=256, build_id=build_id)
    with PerfSession.open(Target(all_cpus=True), config) as session:
        assert session.cpus == online_cpus() and len(session.fds) == len(session.cpus)
        assert session.skipped_cpus == []
        assert session.build_id_mmap2 is build_id  # kernel 6.18 grants it when asked
        fmt = session.event_format
        assert fmt.sample_regs_user == config.regs_mask and fmt.sample_id_all
        session.enable()
        proc = subprocess.Popen([str(busy), "spin", "250"], stdout=subprocess.PIPE)
        ann = read_announce(proc)
        cap = collect(session, lambda: proc.poll() is not None)
        assert proc.wait() == 0
        session.disable()
    assert session.closed
    pid = proc.pid
    assert ann.pid == pid

    # Samples: this pid/tid, the layout the attr asked for, times rising per CPU ring.
    mine = cap.samples(pid)
    assert len(mine) >= 50, f"only {len(mine)} samples in 250 ms at 999 Hz"
    for s in mine:
        assert s.tid == pid
        check_sample_shape(s, config)
    for cpu, recs in cap.per_cpu.items():
        times = [r.time for r in recs if isinstance(r, records.Sample)]
        assert times == sorted(times), f"cpu {cpu} samples out of order"
        assert all(r.cpu == cpu for r in recs if isinstance(r, records.Sample))

    # MMAP2 of its own binary, with the identity form the kernel granted.
    maps = exec_range(cap, pid, busy)
    assert maps, "no executable MMAP2 for the target binary"
    st = busy.stat()
    for m in maps:
        if build_id:
            assert m.misc & abi.MISC_MMAP_BUILD_ID and m.build_id == build_id_of(busy)
        else:
            assert m.build_id is None and m.ino == st.st_ino
            assert (m.maj, m.min) == (os.major(st.st_dev), os.minor(st.st_dev))

    # Samples inside spin(): the stack copy is really the stack at sp.
    spinning = spinning_ranges(busy, [(m.start, m.start + m.length, m.pgoff) for m in maps])
    in_spin = [s for s in mine if s.cpumode == abi.MISC_USER and in_ranges(s.regs[IP], spinning)]
    assert len(in_spin) >= 10
    for s in in_spin:
        check_magic(s, ann)

    # COMM (exec) < samples in the new image <= EXIT.
    comms = [r for r in cap.all() if isinstance(r, records.Comm) and r.pid == pid and r.exec]
    assert [c.comm for c in comms] == ["busy"]
    exits = [r for r in cap.all() if isinstance(r, records.Exit) and r.pid == pid]
    assert len(exits) == 1
    comm_t, exit_t = comms[0].time, exits[0].time
    assert comm_t is not None
    assert all(m.time is not None and m.time > comm_t for m in maps)
    assert comm_t < min(s.time or 0 for s in in_spin)
    # Kernel-mode samples can follow perf_event_exit_task inside do_exit; user ones cannot.
    assert max(s.time or 0 for s in mine if s.cpumode == abi.MISC_USER) <= exit_t


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(frequency=999, ring_pages=128),
        SamplingConfig(event="task-clock", period=1_000_000, stack_size=16384, ring_pages=128),
    ],
    ids=["cpu-clock", "task-clock-period"],
)
def test_pid_target_inherits_to_grandchild(busy: pathlib.Path, config: SamplingConfig) -> None:
    proc = subprocess.Popen(
        [str(busy), "wait-fork", "200"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdin is not None
    try:
        with PerfSession.open(Target(pids=(proc.pid,)), config) as session:
            assert len(session.fds) == len(session.cpus) == len(online_cpus())
            session.enable()
            proc.stdin.write(b"g")  # the session is open: fork now
            proc.stdin.close()
            ann = read_announce(proc)
            # The grandchild runs the image mapped before the session opened (so no MMAP2):
            # take its text range from /proc while the child waits for it.
            spinning = spinning_ranges(busy, proc_text_maps(ann.pid, busy))
            cap = collect(session, lambda: proc.poll() is not None)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.wait() == 0
    child, grandchild = proc.pid, ann.pid
    assert grandchild != child

    pids = {s.pid for s in cap.samples()}
    assert pids <= {child, grandchild}, pids  # nothing from outside the task tree
    gc = cap.samples(grandchild)
    assert len(gc) >= 30, f"only {len(gc)} grandchild samples"
    for s in gc:
        check_sample_shape(s, config)
        if config.period is not None:
            assert s.period == config.period
    forks = [r for r in cap.all() if isinstance(r, records.Fork) and r.pid == grandchild]
    assert len(forks) == 1 and forks[0].ppid == child
    exits = [r for r in cap.all() if isinstance(r, records.Exit) and r.pid == grandchild]
    assert len(exits) == 1
    assert forks[0].time < min(s.time or 0 for s in gc)
    assert max(s.time or 0 for s in gc if s.cpumode == abi.MISC_USER) <= exits[0].time
    # The stack copies are real: every user sample inside spin() holds magic where it said.
    spun = [s for s in gc if s.cpumode == abi.MISC_USER and in_ranges(s.regs[IP], spinning)]
    assert len(spun) >= 10
    for s in spun:
        check_magic(s, ann)


def cgroup2_mount() -> pathlib.Path:
    for line in pathlib.Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2":
            return pathlib.Path(fields[1])
    pytest.fail("cgroup v2 is not mounted on this machine; the cgroup target cannot be tested")


def test_cgroup_target(busy: pathlib.Path) -> None:
    root = cgroup2_mount()
    cg = root / f"unwindd-test-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    proc = subprocess.Popen(
        [str(busy), "wait-spin", "200"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdin is not None
    try:
        (cg / "cgroup.procs").write_text(str(proc.pid))
        with PerfSession.open(Target(cgroup=str(cg)), SamplingConfig(frequency=999)) as session:
            assert len(session.fds) == len(online_cpus())
            session.enable()
            proc.stdin.write(b"g")
            proc.stdin.close()
            ann = read_announce(proc)
            cap = collect(session, lambda: proc.poll() is not None)
        assert proc.wait() == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for _ in range(100):  # the cgroup depopulates asynchronously after the exit
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.01)
    assert not cg.exists()
    samples = cap.samples()
    assert {s.pid for s in samples} == {proc.pid}, "samples from outside the cgroup"
    assert len(samples) >= 30
    assert ann.pid == proc.pid
    exits = [r for r in cap.all() if isinstance(r, records.Exit) and r.pid == proc.pid]
    assert len(exits) == 1


def test_drain_stops_at_record_boundary_when_output_is_full() -> None:
    config = SamplingConfig(frequency=999, ring_pages=256)
    with PerfSession.open(Target(pids=(os.getpid(),)), config) as session:
        session.enable()
        end = time.thread_time() + 0.15  # CPU time: as many samples on a loaded machine
        while time.thread_time() < end:
            pass
        session.disable()
        pending = sum(session.pending())
        assert pending > 3 * 65536, pending  # enough to need several small drains
        dec = RecordDecoder([session.event_format])
        drained = 0
        calls = 0
        while True:
            chunks = session.drain(max_bytes=65536)
            if not chunks:
                break
            calls += 1
            got = sum(len(c) for _, c in chunks)
            assert got <= 65536
            drained += got
            assert sum(session.pending()) == pending - drained  # the rest stayed queued
            for _, chunk in chunks:
                n = sum(1 for _ in dec.decode(chunk))
                assert n > 0
        assert drained == pending and calls >= 4
        assert dec.stats.error_count == 0 and dec.stats.records["SAMPLE"] >= 50
        assert session.ring_errors == 0
        with pytest.raises(ValueError, match="max_bytes"):
            session.drain(max_bytes=4096)
    with pytest.raises(ValueError, match="closed"):
        session.drain()
    session.close()  # idempotent


@contextlib.contextmanager
def busy_run(busy: pathlib.Path, config: SamplingConfig, ms: int,
             spill: int = 0) -> Iterator[PerfSession]:  # fmt: skip
    """A pid session on ``busy wait-spin MS`` run to its end, disabled, its records still in
    the rings. The child has an empty environment: its stack from sp up (frames, then argv,
    envp, auxv and their strings) is ~1 KiB plus the random 0-8 KiB gap exec leaves below the
    strings (arch/x86/kernel/process.c arch_align_stack): 0.8-8.8 KiB measured over 30 runs,
    so a 16 KiB copy always has bytes left to cut (an 8 KiB one had none in ~1 run of 10;
    with the test runner's environment the stack can pass any small copy)."""
    child = subprocess.Popen([str(busy), "wait-spin", str(ms)], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, env={})  # fmt: skip
    with PerfSession.open(Target(pids=(child.pid,)), config) as session:
        if spill:  # ``spill`` bytes of ring spill
            session.start_spill(spill)
        session.enable()
        assert child.stdin is not None
        child.stdin.write(b"x")
        child.stdin.close()
        assert child.wait(30) == 0
        session.disable()
        yield session


def test_drain_into_writes_whole_records_in_place(busy: pathlib.Path) -> None:
    """drain_into (the live step's path): records land in the caller's buffer slice, back to
    back in the returned (cpu, size) order, nothing outside the slice is written, and what
    does not fit stays queued; pending_bytes is the sum of pending(). Samples come out with
    their user stack copy cut to the bytes the kernel filled (fewer written than consumed)."""
    config = SamplingConfig(frequency=999, ring_pages=512, stack_size=16384)
    with busy_run(busy, config, 300) as session:
        pending = session.pending_bytes()
        assert pending == sum(session.pending()) and pending > 3 * 65536, pending
        dec = RecordDecoder([session.event_format])
        arena = bytearray(b"\xa5" * (3 * 65536))
        consumed = written = calls = cut = 0
        while True:
            before = session.pending_bytes()
            got = session.drain_into(memoryview(arena)[4096 : 4096 + 65536])
            if not got:
                break
            calls += 1
            total = sum(n for _, n in got)
            assert total <= 65536 and all(n > 0 for _, n in got)
            assert arena[:4096] == b"\xa5" * 4096  # before the slice: untouched
            assert arena[4096 + 65536 :] == b"\xa5" * (len(arena) - 4096 - 65536)
            consumed += before - session.pending_bytes()
            written += total
            assert written <= consumed and session.pending_bytes() == pending - consumed
            pos = 4096
            for _, n in got:
                recs = list(dec.decode(bytes(arena[pos : pos + n])))
                assert recs
                # each user stack copy cut to what the kernel filled (pc_drain_trim)
                for s in recs:
                    if isinstance(s, records.Sample) and s.stack_size:
                        assert s.dyn_size <= s.stack_size < s.dyn_size + 8
                        assert len(s.stack) == s.dyn_size
                        cut += s.stack_size < config.stack_size
                pos += n
        assert consumed == pending and calls >= 2
        samples = dec.stats.records["SAMPLE"]
        assert dec.stats.error_count == 0 and samples >= 50
        assert cut >= samples // 2 and written < consumed, (cut, samples, written, consumed)
        with pytest.raises(ValueError, match=r"64|65536"):
            session.drain_into(bytearray(4096))


def _held_up(
    busy: pathlib.Path, spill: int
) -> tuple[dict[int, list[records.Record]], dict[str, int] | None]:
    """A pid session with 16-page rings (64 KiB: ~7 samples with 8 KiB stack copies) on
    ``busy`` spinning 0.5 s of CPU at 999 Hz, not drained until the child is done (a consumer
    held up for ~70 rings' worth of samples), then drained whole through ``drain_into``, with
    ``spill`` bytes of spill (0: none). Its records by CPU, and the spill's counts."""
    arena = bytearray(1 << 20)
    got: dict[int, list[records.Record]] = defaultdict(list)
    with busy_run(busy, SamplingConfig(frequency=999, ring_pages=16), 500, spill) as session:
        if spill:
            with pytest.raises(ValueError, match="already"):
                session.start_spill(spill)
        dec = RecordDecoder([session.event_format])
        while parts := session.drain_into(arena):
            pos = 0
            for cpu, size in parts:
                got[cpu].extend(dec.decode(bytes(arena[pos : pos + size])))
                pos += size
        assert session.pending_bytes() == 0
        assert dec.stats.error_count == 0 and session.ring_errors == 0
        stats = session.spill_stats()
    final = session.spill_stats()  # kept after close: read at close, before the thread stopped
    assert (final is None) == (stats is None)
    if final is not None and stats is not None:  # (its wakeups may have grown meanwhile)
        assert {**final, "wakeups": 0} == {**stats, "wakeups": 0}
        assert final["wakeups"] >= stats["wakeups"]
    with pytest.raises(ValueError, match="closed"):
        session.start_spill(1 << 20)
    return got, stats


def test_spill_keeps_what_the_ring_cannot_hold(busy: pathlib.Path) -> None:
    """Without the spill, the held-up consumer gets at most a ring's worth of samples and the
    kernel reports the rest lost. With it (cffi_build/ringspill.c) the spill's thread moved
    the records out as the ring filled, and the consumer gets nearly every sample of the
    child's 0.5 s, each whole (decoded without error), each CPU's in time order."""
    plain, none = _held_up(busy, 0)
    assert none is None
    recs = [r for rs in plain.values() for r in rs]
    lost = sum(r.lost for r in recs if isinstance(r, records.Lost))
    n = sum(isinstance(r, records.Sample) for r in recs)
    assert lost > 0 and n < 20, (lost, n)

    spilled, stats = _held_up(busy, 16 << 20)
    assert stats is not None
    recs = [r for rs in spilled.values() for r in rs]
    lost = sum(r.lost for r in recs if isinstance(r, records.Lost))
    n = sum(isinstance(r, records.Sample) for r in recs)
    # ~500 samples; the spill's thread may run late on a busy machine: a few may be lost
    assert n >= 200 and lost * 4 <= n, (n, lost, stats)
    assert stats["records"] >= n - 20 and stats["held"] == 0, stats
    assert 0 < stats["held_max"] <= stats["bytes"] <= 16 << 20 and stats["wakeups"] > 0, stats
    for rs in spilled.values():
        times = [r.time for r in rs if isinstance(r, records.Sample)]
        assert times == sorted(times)  # one ring's records leave in the kernel's order


def test_cut_of_a_sample_whose_stack_copy_failed(busy: pathlib.Path) -> None:
    """dyn_size 0 (the kernel's nofault copy of the user stack failed, as in exec or exit): the
    cut record ends at a zero stack size with no dyn_size field, as the kernel writes a sample
    without a stack, and decodes to the same sample with an empty stack."""
    from unwindd.source.perfcore import ffi, lib

    config = SamplingConfig(frequency=999, ring_pages=64)
    with busy_run(busy, config, 100) as session:
        chunks = session.drain()
        fmt = session.event_format
    data = b"".join(c for _, c in chunks)
    pos = 0
    while True:  # the first sample with a stack copy
        typ, size = struct.unpack_from("<IxxH", data, pos)
        if typ == 9 and size > 8192:
            break
        pos += size
    rec = bytearray(data[pos : pos + size])
    rec[-8:] = bytes(8)  # dyn_size 0
    nregs = lib.pc_trim_nregs(fmt.sample_type, fmt.sample_regs_user)
    n = lib.pc_trim_records(ffi.from_buffer(rec), len(rec), nregs)
    assert n == size - 8192 - 8  # the 8 KiB copy and dyn_size gone, the size field kept
    cut = bytes(rec[:n])
    assert struct.unpack_from("<H", cut, 6)[0] == n and struct.unpack_from("<Q", cut, n - 8) == (0,)
    dec = RecordDecoder([fmt])
    (orig,) = dec.decode(bytes(data[pos : pos + size - 8]) + bytes(8))
    (got,) = dec.decode(cut)
    assert dec.stats.error_count == 0
    assert isinstance(orig, records.Sample) and isinstance(got, records.Sample)
    assert (got.ip, got.pid, got.time, got.regs) == (orig.ip, orig.pid, orig.time, orig.regs)
    assert got.stack_size == got.dyn_size == orig.dyn_size == 0 and got.stack == b""


def test_fds_are_pollable(busy: pathlib.Path) -> None:
    import select

    config = SamplingConfig(frequency=999, ring_pages=16)  # watermark = 32 KiB: ~4 samples
    with PerfSession.open(Target(all_cpus=True), config) as session:
        poller = select.poll()
        for fd in session.fds:
            poller.register(fd, select.POLLIN)
        session.enable()
        proc = subprocess.Popen([str(busy), "spin", "100"], stdout=subprocess.DEVNULL)
        ready = poller.poll(2000)
        proc.wait()
        assert ready and {fd for fd, _ in ready} <= set(session.fds)
        assert any(ev & select.POLLIN for _, ev in ready)
        assert session.drain()


THREADED = """
import sys, threading, time
go = threading.Event()
def spin():
    go.wait()
    end = time.thread_time() + 0.2
    while time.thread_time() < end:
        pass
t = threading.Thread(target=spin)
t.start()
print(t.native_id, flush=True)
sys.stdin.read(1)
go.set()
t.join()
"""


def test_pid_target_covers_existing_threads() -> None:
    """A pid means all its threads (perf's thread_map__new_by_pid): one event per (thread, cpu),
    all of a CPU's events redirected into that CPU's single ring."""
    proc = subprocess.Popen(
        [sys.executable, "-c", THREADED], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        tid = int(proc.stdout.readline())
        assert tid != proc.pid
        # 1 MiB rings: the default 256 KiB holds ~30 samples, so a descheduled drain loop
        # could lose the thread's EXIT record
        config = SamplingConfig(frequency=999, ring_pages=256)
        with PerfSession.open(Target(pids=(proc.pid,)), config) as session:
            assert len(session.fds) == len(online_cpus())  # still one ring per CPU
            session.enable()
            proc.stdin.write(b"g")
            proc.stdin.close()
            cap = collect(session, lambda: proc.poll() is not None)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.wait() == 0
    spun = [s for s in cap.samples(proc.pid) if s.tid == tid]
    assert len(spun) >= 30, f"only {len(spun)} samples of thread {tid}"
    exits = [r for r in cap.all() if isinstance(r, records.Exit) and r.tid == tid]
    assert len(exits) == 1 and exits[0].pid == proc.pid


def test_spill_of_a_session_dropped_unclosed(busy: pathlib.Path) -> None:
    """A session that is never closed: its spill's thread is stopped when the session is
    collected, before the ring array it reads is freed (no crash, the thread gone)."""
    import gc

    config = SamplingConfig(frequency=999, ring_pages=16)
    session = PerfSession.open(Target(pids=(os.getpid(),)), config)
    session.start_spill(1 << 20)

    def names() -> set[str]:
        return {p.read_text().strip() for p in pathlib.Path("/proc/self/task").glob("*/comm")}

    assert "unwindd-spill" in names()
    del session
    gc.collect()
    assert "unwindd-spill" not in names()
