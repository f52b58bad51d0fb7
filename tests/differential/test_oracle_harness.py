"""Tests of the unwinding oracle itself (tests/support/oracle.py, tests/support/workloads/),
needing no unwinder: the workloads build and run, perf's unwind of them shows the call chains they
were written to produce, the perf script parser reads byte-literal and real output exactly, and
``compare`` applies each rule."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import binfacts
import oracle
import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import NoteSection, SymbolTableSection
from oracle import (
    AddressSpaces,
    MapEntry,
    OracleFrame,
    OracleSample,
    PerfScript,
    Workload,
    compare,
    normalize_name,
    parse_perf_script,
)
from perfutil import PERF, perf_script_pid_tid_time, perf_stats

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"


# ---------------------------------------------------------------------------------------------
# fixtures: build once, record each workload once (about 1 s each)


@pytest.fixture(scope="module")
def workloads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Workload]:
    return oracle.build_workloads(tmp_path_factory.mktemp("workloads"))


@pytest.fixture(scope="module")
def recorded(
    workloads: dict[str, Workload], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, PerfScript]]:
    dest = tmp_path_factory.mktemp("perfdata")
    out: dict[str, tuple[Path, PerfScript]] = {}
    for name, w in workloads.items():
        path = oracle.record(w, dest)
        out[name] = (path, oracle.perf_script(path))
    return out


def names(s: OracleSample) -> list[str | None]:
    return [f.sym for f in s.user_frames]


def base(sym: str | None) -> str | None:
    """gcc may clone (``spin.constprop.0``); the chain is about the source function."""
    return None if sym is None else re.sub(r"\.(constprop|isra|part|cold)\.\d+$", "", sym)


# ---------------------------------------------------------------------------------------------
# workloads


def test_workloads_run_and_exit_zero(workloads: dict[str, Workload]) -> None:
    def run(w: Workload) -> tuple[str, int, str]:
        p = subprocess.run(w.argv, capture_output=True, text=True, timeout=60)
        return w.name, p.returncode, p.stderr

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, workloads.values()))
    assert [r for r in results if r[1] != 0] == []
    assert set(workloads) == {
        "c_o2", "c_o3", "cxx", "threads", "dlopen", "signal", "python", "forkexec",
    }  # fmt: skip


@pytest.mark.parametrize("name", ["c_o2", "c_o3"])
def test_c_chain(recorded: dict[str, tuple[Path, PerfScript]], name: str) -> None:
    samples = recorded[name][1].samples
    assert len(samples) >= 100
    chain = [
        s for s in samples if [base(n) for n in names(s)[:5]] == ["spin", "c", "b", "a", "main"]
    ]
    assert len(chain) >= 0.8 * len(samples), Counter(tuple(names(s)[:2]) for s in samples)
    # libc frames on the stack above c: memcpy/strlen under spin, or qsort's merge sort
    in_libc = [
        s for s in samples
        if "c" in (chain_names := [base(n) for n in names(s)])
        and any(f.dso == LIBC for f in s.user_frames[: chain_names.index("c")])
    ]  # fmt: skip
    assert len(in_libc) >= 3, Counter(tuple(names(s)[:3]) for s in samples)
    # every stack ends in _start (perf unwound to the bottom)
    assert sum(names(s)[-1] == "_start" for s in samples) >= 0.95 * len(samples)


def test_cxx_demangled(recorded: dict[str, tuple[Path, PerfScript]]) -> None:
    samples = recorded["cxx"][1].samples
    syms = Counter(f.sym for s in samples for f in s.user_frames if f.sym)
    assert syms["oracle::Worker::run"] >= 0.9 * len(samples)
    assert syms["oracle::Worker::catcher"] > 0 and syms["oracle::Worker::sorter"] > 0
    assert any(n.startswith("std::__introsort_loop<") and "{lambda(" in n for n in syms)
    assert not any(n.startswith("_Z") for n in syms)  # perf demangles ...
    assert "oracle::Worker::thrower(int) const" not in syms  # ... without parameter lists
    dsos = {f.dso for s in samples for f in s.user_frames}
    assert any("libstdc++" in d for d in dsos) and any("libgcc_s" in d for d in dsos)
    assert syms["__cxa_throw"] > 0


def test_threads_named_chains(recorded: dict[str, tuple[Path, PerfScript]]) -> None:
    samples = recorded["threads"][1].samples
    by_comm: dict[str, list[OracleSample]] = {}
    for s in samples:
        by_comm.setdefault(s.comm, []).append(s)
    want = {
        "wk alpha": ["alpha_leaf", "alpha_mid", "alpha_top", "start_thread"],
        "wk-beta": ["beta_leaf", "beta_top", "start_thread"],
        "wk gamma 3": ["gamma_leaf", "gamma_mid", "gamma_top", "start_thread"],
    }
    for comm, chain in want.items():
        got = by_comm.get(comm, [])
        assert len(got) >= 30, sorted(by_comm)
        assert len({s.tid for s in got}) == 1
        ok = [s for s in got if names(s)[: len(chain)] == chain]
        assert len(ok) >= 0.9 * len(got), Counter(tuple(names(s)) for s in got)
    assert len({s.tid for s in samples}) >= 3 and len({s.pid for s in samples}) == 1


def test_dlopen_frames_in_library(recorded: dict[str, tuple[Path, PerfScript]]) -> None:
    _, script = recorded["dlopen"]
    in_lib = [s for s in script.samples if s.user_frames and s.user_frames[0].dso.endswith(
        "libdlwork.so")]  # fmt: skip
    assert len(in_lib) >= 0.8 * len(script.samples)
    # perf itself (the oracle) misses a sample's chain now and then (1 CI run in many): allow
    # the 1 % the differential suite allows, and show what it printed for them
    bad = [s for s in in_lib if names(s)[:4] != ["dl_hot", "dl_inner", "dl_entry", "call_lib"]]
    assert len(bad) <= len(in_lib) // 100, [
        (s.time_ns, [(f.sym, f.dso) for f in s.user_frames]) for s in bad[:5]]  # fmt: skip
    (pid,) = {s.pid for s in script.samples}
    text_maps = [m for m in script.spaces.maps[pid] if m.path.endswith("libdlwork.so")
                 and m.pgoff == 0x1000]  # fmt: skip
    assert len(text_maps) == 3  # loaded three times
    # samples from each of the three loads
    loads = sorted(m.time_ns for m in text_maps)
    assert all(any(t0 <= s.time_ns < t1 for s in in_lib)
               for t0, t1 in zip(loads, [*loads[1:], 1 << 63], strict=True))  # fmt: skip


def _symbol_address(elf_path: str, name: str) -> int:
    """``name``'s address in libc, from its separate debug file (libc6-dbg)."""
    with open(elf_path, "rb") as f:
        elf = ELFFile(f)
        note = next(
            n for sec in elf.iter_sections() if isinstance(sec, NoteSection)
            for n in sec.iter_notes() if n["n_type"] == "NT_GNU_BUILD_ID"
        )  # fmt: skip
    bid = note["n_desc"]
    debug = Path("/usr/lib/debug/.build-id") / bid[:2] / f"{bid[2:]}.debug"
    with debug.open("rb") as f:
        symtab = ELFFile(f).get_section_by_name(".symtab")
        assert isinstance(symtab, SymbolTableSection)
        for sym in symtab.iter_symbols():
            if sym.name == name:
                return int(sym["st_value"])
    raise LookupError(name)


def test_signal_frames(recorded: dict[str, tuple[Path, PerfScript]]) -> None:
    samples = recorded["signal"][1].samples
    assert len(samples) >= 100  # (with none, every check below holds of nothing)
    in_handler = [s for s in samples if names(s)[:2] == ["handler_spin", "on_alarm"]]
    assert len(in_handler) >= 0.2 * len(samples)
    # perf prints the trampoline as __restore_rt - 1 (caller frames are return address - 1,
    # and the kernel's return address is __restore_rt itself): glibc's nop, "[unknown]".
    restore_rt = _symbol_address(LIBC, "__restore_rt")
    tramp = [s.user_frames[2] for s in in_handler]
    assert all(f.dso == LIBC and f.ip + 1 == restore_rt and f.sym is None for f in tramp), tramp
    # below the trampoline, the interrupted code, unwound to main
    assert sum(names(s)[3:5] == ["main_spin", "main"] for s in in_handler) >= 0.9 * len(in_handler)


def test_python_interpreter_frames(recorded: dict[str, tuple[Path, PerfScript]]) -> None:
    samples = recorded["python"][1].samples
    assert len(samples) >= 100
    evals = [s for s in samples if "_PyEval_EvalFrameDefault" in names(s)]
    assert len(evals) >= 0.8 * len(samples)
    assert all(any(f.dso.endswith("python3.11") for f in s.user_frames) for s in evals)


def test_forkexec_pids(recorded: dict[str, tuple[Path, PerfScript]]) -> None:
    samples = recorded["forkexec"][1].samples
    pids = Counter(s.pid for s in samples)
    assert len(pids) >= 3, pids  # parent and two exec'd children
    comms = {s.comm for s in samples}
    assert {"forkexec", "chain_o2"} <= comms
    kids = [s for s in samples if s.comm == "chain_o2"]
    assert sum(names(s)[:2] == ["spin", "c"] for s in kids) >= 0.7 * len(kids)


# ---------------------------------------------------------------------------------------------
# parser on the real output


@pytest.mark.parametrize("name", ["c_o2", "cxx", "threads", "signal", "forkexec", "python"])
def test_parsed_sample_count_equals_perf(
    recorded: dict[str, tuple[Path, PerfScript]], name: str
) -> None:
    path, script = recorded[name]
    stacks = oracle.perf_script_stacks(path)
    assert [s.key for s in stacks] == [s.key for s in script.samples]
    keys = perf_script_pid_tid_time(path)
    assert Counter(s.key for s in stacks) == keys
    assert len(stacks) == sum(keys.values()) == perf_stats(path)["SAMPLE"]
    assert all(s.frames for s in stacks)


def _absolute_sample_ips(path: Path) -> dict[tuple[int, int, int], int]:
    """``sample->ip`` as perf prints it without the callchain: absolute."""
    out = subprocess.run(
        [PERF, "script", "-i", str(path), "-F", "pid,tid,time,ip", "--ns", "--hide-call-graph"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    got = {}
    for line in out.splitlines():
        m = re.match(r"^\s*(\d+)/(\d+)\s+(\d+)\.(\d{9}):\s+([0-9a-f]+)\s*$", line)
        assert m is not None, line
        got[int(m[1]), int(m[2]), int(m[3]) * 10**9 + int(m[4])] = int(m[5], 16)
    return got


@pytest.mark.parametrize("name", ["c_o2", "dlopen", "python", "forkexec"])
def test_address_spaces_reproduce_perf_relative_ips(
    recorded: dict[str, tuple[Path, PerfScript]], name: str
) -> None:
    """perf prints callchain user ips relative to their mapping; AddressSpaces must turn the
    absolute sample ip into exactly the leaf perf printed (fork + exec + dlopen included)."""
    path, script = recorded[name]
    absolute = _absolute_sample_ips(path)
    checked = 0
    for s in script.samples:
        ip = absolute[s.key]
        if ip >= oracle.KERNEL_START or s.frames[0].kernel:
            continue
        assert script.spaces.to_perf_ip(s.pid, s.time_ns, ip) == s.frames[0].ip, (s, hex(ip))
        checked += 1
    assert checked >= 0.5 * len(script.samples) and checked >= 50, (checked, len(script.samples))


def test_unwindd_stacks_reads_replay(recorded: dict[str, tuple[Path, PerfScript]]) -> None:
    path, script = recorded["c_o2"]
    got = oracle.unwindd_stacks(path)
    assert len(got) == len(script.samples) >= 100


def test_identity_compare_on_real_output(recorded: dict[str, tuple[Path, PerfScript]]) -> None:
    for name, (_, script) in recorded.items():
        rep = compare(script.samples, oracle.ours_from_perf(script.samples))
        assert rep.match_ratio == 1.0 and rep.total == len(script.samples), (name, rep.render())


# ---------------------------------------------------------------------------------------------
# parser on byte literals

SNIPPET = (
    # comm with spaces and a digit; kernel frames first, then user frames
    b"wk gamma 3 18329/18333   835.623407137: \n"
    b"\tffffffff81b587fe __rq_qos_merge ([kernel.kallsyms])\n"
    b"\tffffffff81000130 entry_SYSCALL_64_after_hwframe ([kernel.kallsyms])\n"
    b"\t           f786a __GI___fstatat64 (/usr/lib/x86_64-linux-gnu/libc.so.6)\n"
    b"\t            13c2 gamma_leaf+0x12 (/tmp/w/threads)\n"
    b"\t           27304 __libc_start_main@@GLIBC_2.34 (/usr/lib/x86_64-linux-gnu/libc.so.6)\n"
    b"\n"
    # C++ names with parentheses, [unknown] symbol, (deleted) dso, [unknown] dso
    b"cxx_exc 7/8   1.000000001: \n"
    b"\t            1132 ns::W::f(int) const (/tmp/w/cxx_exc)\n"
    b"\t            14d0 std::sort<{lambda(unsigned int, unsigned int)#1}> (/tmp/w/cxx_exc)\n"
    b"\t            1635 X::operator() (/tmp/w (x)/cxx_exc)\n"
    b"\t           15637 [unknown] (/usr/lib/x86_64-linux-gnu/libgcc_s.so.1)\n"
    b"\t            1168 dl_entry (/tmp/w/libdlwork.so (deleted))\n"
    b"\t    7f0000001234 [unknown] ([unknown])\n"
    b"\n"
    # side-band lines are not samples (but feed the address spaces)
    b"forkexec 18370/18370   840.346200541: PERF_RECORD_MMAP2 18370/18370: "
    b"[0x55b14a35b000(0x1000) @ 0x1000 fe:00 2146705 660682148]: r-xp /tmp/w/forkexec\n"
    b"forkexec 18370/18370   840.347081958: PERF_RECORD_FORK(18372:18372):(18370:18370)\n"
    b"chain_o2 18372/18372   840.347263436: PERF_RECORD_COMM exec: chain_o2:18372/18372\n"
    # a sample without a callchain: the one frame on the header line
    b"a 1/2 3 4/4   9.000000009:     55b14a35b010 main (/tmp/w/forkexec)\n"
)


def test_parse_snippet() -> None:
    script = parse_perf_script(SNIPPET.decode())
    s1, s2, s3 = script.samples
    assert (s1.comm, s1.pid, s1.tid, s1.time_ns) == ("wk gamma 3", 18329, 18333, 835_623_407_137)
    assert [f.kernel for f in s1.frames] == [True, True, False, False, False]
    assert s1.frames[0] == OracleFrame(0xFFFFFFFF81B587FE, "__rq_qos_merge", "[kernel.kallsyms]",
                                       True)  # fmt: skip
    assert s1.frames[3] == OracleFrame(0x13C2, "gamma_leaf", "/tmp/w/threads", False)
    assert s1.frames[4].sym == "__libc_start_main@@GLIBC_2.34"
    assert [f.sym for f in s1.user_frames] == ["__GI___fstatat64", "gamma_leaf",
                                               "__libc_start_main@@GLIBC_2.34"]  # fmt: skip
    assert (s2.comm, s2.pid, s2.tid, s2.time_ns) == ("cxx_exc", 7, 8, 1_000_000_001)
    assert [(f.sym, f.dso) for f in s2.frames] == [
        ("ns::W::f(int) const", "/tmp/w/cxx_exc"),
        ("std::sort<{lambda(unsigned int, unsigned int)#1}>", "/tmp/w/cxx_exc"),
        ("X::operator()", "/tmp/w (x)/cxx_exc"),
        (None, "/usr/lib/x86_64-linux-gnu/libgcc_s.so.1"),
        ("dl_entry", "/tmp/w/libdlwork.so (deleted)"),
        (None, "[unknown]"),
    ]
    assert s2.frames[-1].ip == 0x7F0000001234 and not s2.frames[-1].kernel
    assert (s3.comm, s3.pid, s3.tid) == ("a 1/2 3", 4, 4)
    assert s3.frames == (OracleFrame(0x55B14A35B010, "main", "/tmp/w/forkexec", False),)
    # the fork copied the parent's map into the child
    assert script.spaces.to_perf_ip(18372, 840_347_100_000, 0x55B14A35B123) == 0x1123
    assert script.spaces.to_perf_ip(18370, 840_000_000_000, 0x55B14A35B123) == 0x55B14A35B123


@pytest.mark.parametrize(
    "bad",
    [
        "not a header at all\n",
        "c 1/1 1.000000001: \n\t   zz [unknown] ([unknown])\n",
        "c 1/1 1.000000001: \n\t   1234 foo no-dso\n",
        "c 1/1 1.000000001: \n\t   1234 foo (unbalanced\n",
    ],
)
def test_parse_rejects_unknown_lines(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_perf_script(bad)


def test_address_spaces_rules() -> None:
    sp = AddressSpaces()
    sp.add_mmap(MapEntry(10, 1, 0x1000, 0x5000, 0, "/bin/x"))  # r--p whole file
    sp.add_mmap(MapEntry(11, 1, 0x2000, 0x1000, 0x1000, "/bin/x"))  # r-xp
    sp.add_mmap(MapEntry(12, 1, 0x9000, 0x1000, 0x9000, "//anon"))
    sp.add_mmap(MapEntry(50, 1, 0x2000, 0x1000, 0x7000, "/lib/y.so"))  # later load, same range
    assert sp.to_perf_ip(1, 20, 0x2010) == 0x1010
    assert sp.to_perf_ip(1, 60, 0x2010) == 0x7010  # newest mapping wins
    assert sp.to_perf_ip(1, 20, 0x9010) == 0x9010  # anon: identity
    assert sp.to_perf_ip(1, 20, 0xA000) == 0xA000  # unmapped: as is
    assert sp.to_perf_ip(1, 5, 0x2010) == 0x2010  # before the mmap
    assert sp.to_perf_ip(1, 20, oracle.KERNEL_START + 5) == oracle.KERNEL_START + 5
    sp.fork(30, 2, 1)
    assert sp.to_perf_ip(2, 60, 0x2010) == 0x1010  # child inherits maps made before the fork


# ---------------------------------------------------------------------------------------------
# names and compare() rules


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("__libc_start_main@@GLIBC_2.34", "__libc_start_main"),
        ("memcpy@GLIBC_2.2.5", "memcpy"),
        ("spin", "spin"),
        ("[unknown]", None),
        (None, None),
        ("_ZNK6oracle6Worker7throwerEi", "oracle::Worker::thrower"),
        ("oracle::Worker::thrower(int) const", "oracle::Worker::thrower"),
        ("X::operator()", "X::operator()"),
        ("X::operator()(int, int) const", "X::operator()"),
        ("f(int) [clone .cold]", "f [clone .cold]"),
        ("std::sort<{lambda(int)#1}>", "std::sort<{lambda(int)#1}>"),
        ("spin.constprop.0", "spin.constprop.0"),
    ],
)
def test_normalize_name(raw: str | None, norm: str | None) -> None:
    assert normalize_name(raw) == norm


def _perf(pid: int, tid: int, t: int, *frames: tuple[int, str | None]) -> OracleSample:
    return OracleSample(
        pid, tid, t, "w", tuple(OracleFrame(ip, sym, "/bin/w", False) for ip, sym in frames)
    )


def _ours(pid: int, tid: int, t: int, *frames: tuple[int, str | None]) -> dict[str, Any]:
    return {
        "time_ns": t, "pid": pid, "tid": tid, "cpu": 0, "comm": "w", "period": 1,
        "unwind_status": "ok",
        "frames": [{"ip": hex(ip), "dso": "/bin/w", "sym": s, "offset": None, "kernel": False,
                    "inlined": False} for ip, s in frames],
    }  # fmt: skip


PERF_STACK = ((0x1254, "spin"), (0x12A5, "c"), (0x27304, "__libc_start_main@@GLIBC_2.34"))


class FakeFacts:
    """A binary's answers given as data: symbols by file offset, call sites by file offset."""

    def __init__(self, names: dict[int, str] | None = None, calls: set[int] | None = None):
        self.names = names or {}
        self.calls = calls or set()

    def names_at(self, path: str, off: int) -> frozenset[str]:
        return frozenset({self.names[off]}) if off in self.names else frozenset()

    def follows_call(self, path: str, off: int) -> bool:
        return off in self.calls


def _one(
    ours: dict[str, Any], perf: OracleSample | None = None, facts: FakeFacts | None = None
) -> oracle.Report:
    return compare([perf or _perf(1, 1, 100, *PERF_STACK)], [ours], facts=facts or FakeFacts())


def test_compare_ips_must_be_exact() -> None:
    rep = _one(_ours(1, 1, 100, (0x1254, "spin"), (0x12A5, "c"), (0x27304, "__libc_start_main")))
    assert rep.matched == 1 and rep.caller_frames == 2 and rep.match_ratio == 1.0
    # callers at their return address (perf's ip + 1): not the same frames
    rep = _one(_ours(1, 1, 100, (0x1254, "spin"), (0x12A6, "c"), (0x27305, "__libc_start_main")))
    (d,) = rep.mismatched
    assert (d.reason, d.index) == ("ip", 1) and rep.caller_frames == 0


def test_compare_leaf_must_be_exact() -> None:
    rep = _one(_ours(1, 1, 100, (0x1255, "spin"), (0x12A5, "c"), (0x27304, "__libc_start_main")))
    assert rep.matched == 0
    (d,) = rep.mismatched
    assert (d.reason, d.index) == ("ip", 0)


def test_compare_ip_mismatch_reports_first_frame() -> None:
    rep = _one(_ours(1, 1, 100, (0x1254, "spin"), (0x12B0, "c"), (0x27304, "__libc_start_main")))
    (d,) = rep.mismatched
    assert (d.reason, d.index) == ("ip", 1)
    assert d.perf_frame is not None and d.perf_frame.ip == 0x12A5
    assert d.ours_frame is not None and d.ours_frame["ip"] == "0x12b0"
    text = rep.render()
    assert "ip at frame 1" in text and "0x12a5 c (w)" in text and "0x12b0 c (w)" in text
    assert rep.match_ratio == 0.0


def test_compare_version_suffix_on_either_side() -> None:
    perf = _perf(1, 1, 100, (0x1254, "spin"), (0x27304, "__libc_start_main"))
    rep = _one(_ours(1, 1, 100, (0x1254, "spin"), (0x27304, "__libc_start_main@@GLIBC_2.34")),
               perf)  # fmt: skip
    assert rep.matched == 1


def test_compare_unknown_rules() -> None:
    perf = _perf(1, 1, 100, (0x1254, "spin"), (0x3C04F, None))
    named = _ours(1, 1, 100, (0x1254, "spin"), (0x3C04F, "__restore_rt"))
    nameless = _ours(1, 1, 100, (0x1254, "spin"), (0x3C04F, None))
    # the binary has a symbol there that perf did not print: naming it is better, not different
    has = FakeFacts({0x3C04F: "__restore_rt"})
    rep = _one(named, perf, has)
    assert rep.matched == 1 and rep.named_where_perf_unknown == 1
    (d,) = _one(nameless, perf, has).mismatched
    assert (d.reason, d.index) == ("ours unknown", 1)  # both missed a name the file has
    # the binary has no symbol there: unknown is right, any name of ours is made up
    assert _one(nameless, perf).matched == 1
    (d,) = _one(named, perf).mismatched
    assert (d.reason, d.index) == ("name not in binary", 1)
    (d,) = _one(named, perf, FakeFacts({0x3C04F: "other"})).mismatched
    assert (d.reason, d.index) == ("name not in binary", 1)
    rep = _one(_ours(1, 1, 100, (0x1254, None), (0x3C04F, None)), perf)
    (d,) = rep.mismatched
    assert (d.reason, d.index) == ("ours unknown", 0)  # we lost a name perf has


def test_compare_name_mismatch_and_demangling() -> None:
    perf = _perf(
        1, 1, 100, (0x1132, "oracle::Worker::thrower"), (0x1764, "oracle::Worker::catcher")
    )
    ok = _ours(1, 1, 100, (0x1132, "_ZNK6oracle6Worker7throwerEi"),
               (0x1764, "oracle::Worker::catcher(int) const"))  # fmt: skip
    assert _one(ok, perf).matched == 1
    bad = _ours(1, 1, 100, (0x1132, "oracle::Worker::thrower"), (0x1764, "oracle::Worker::run"))
    (d,) = _one(bad, perf).mismatched
    assert (d.reason, d.index) == ("name", 1)


SHORT = _perf(1, 1, 100, (0x1254, "spin"), (0x12A5, "c"))  # perf stopped above the base
CALLS = FakeFacts(calls={0x27304, 0x1140})


def test_compare_ours_longer_only_down_to_the_base() -> None:
    longer = _ours(1, 1, 100, (0x1254, "spin"), (0x12A5, "c"), (0x27304, "__libc_start_main"),
                   (0x1140, "_start"))  # fmt: skip
    rep = _one(longer, SHORT, CALLS)
    assert rep.matched == 1 and rep.ours_longer == 1
    # perf reached a base already: anything of ours past it is made up
    based = _perf(1, 1, 100, (0x1254, "spin"), (0x12A5, "c"), (0x27304, "__libc_start_main"),
                  (0x1140, "_start"))  # fmt: skip
    past = _ours(1, 1, 100, *((f.ip, f.sym) for f in based.frames), (0x1100, "_start"))
    (d,) = _one(past, based, FakeFacts(calls={0x1100})).mismatched
    assert (d.reason, d.index) == ("ours longer", 4)
    # ours must end on a base
    (d,) = _one(_ours(1, 1, 100, *PERF_STACK), SHORT, CALLS).mismatched
    assert (d.reason, d.index) == ("ours longer", 2)
    # every added frame must sit right after a call in its binary
    (d,) = _one(longer, SHORT, FakeFacts(calls={0x27304})).mismatched
    assert (d.reason, d.index) == ("ours longer", 3)


def test_compare_ours_shorter() -> None:
    shorter = _ours(1, 1, 100, (0x1254, "spin"), (0x12A5, "c"))
    rep = _one(shorter)
    (d,) = rep.mismatched
    assert (d.reason, d.index, d.ours_frame) == ("ours shorter", 2, None)


def test_compare_missing_and_extra_samples() -> None:
    perf = [_perf(1, 1, 100, *PERF_STACK), _perf(1, 2, 100, *PERF_STACK)]
    ours = [_ours(1, 1, 100, *PERF_STACK), _ours(1, 1, 101, *PERF_STACK)]
    rep = compare(perf, ours)
    assert (rep.total, rep.matched) == (2, 1) and rep.match_ratio == 0.5
    (d,) = rep.mismatched
    assert (d.reason, d.key) == ("missing", (1, 2, 100))
    assert rep.extra == [(1, 1, 101)]  # matched by time exactly: 101 is not 100
    assert "missing" in rep.render()


def test_compare_drops_kernel_and_inlined_frames() -> None:
    kframe = OracleFrame(0xFFFFFFFF81000130, "entry_SYSCALL_64", "[kernel.kallsyms]", True)
    perf = OracleSample(1, 1, 100, "w", (kframe, *_perf(1, 1, 100, *PERF_STACK).frames))
    ours = _ours(1, 1, 100, *PERF_STACK)
    ours["frames"][:0] = [
        {"ip": "0xffffffff81000130", "dso": "[kernel.kallsyms]", "sym": "x", "offset": None,
         "kernel": True, "inlined": False},
    ]  # fmt: skip
    ours["frames"].insert(2, {"ip": "0x12a5", "dso": "/bin/w", "sym": "inlined_helper",
                              "offset": None, "kernel": False, "inlined": True})  # fmt: skip
    assert compare([perf], [ours]).matched == 1


def test_compare_converts_absolute_ips_with_address_spaces() -> None:
    sp = AddressSpaces()
    sp.add_mmap(MapEntry(10, 1, 0x555500001000, 0x1000, 0x1000, "/bin/w"))
    sp.add_mmap(MapEntry(10, 1, 0x7F0000026000, 0x156000, 0x26000, "/lib/libc.so.6"))
    ours = _ours(1, 1, 100, (0x555500001254, "spin"), (0x5555000012A5, "c"),
                 (0x7F0000027304, "__libc_start_main"))  # fmt: skip
    perf = [_perf(1, 1, 100, *PERF_STACK)]
    assert compare(perf, [ours], sp).matched == 1
    assert compare(perf, [ours]).matched == 0  # absolute ips without the maps: no match


def test_render_is_compact() -> None:
    perf = [_perf(1, 1, t, *PERF_STACK) for t in range(50)]
    ours = [_ours(1, 1, t, (0x1254, "spin")) for t in range(50)]
    rep = compare(perf, ours)
    text = rep.render(3)
    assert rep.match_ratio == 0.0 and "... and 47 more" in text
    assert len(text.splitlines()) < 40


# ---------------------------------------------------------------------------------------------
# binfacts, judged by perf: what perf names, the file has there; perf's callers follow calls


def test_binfacts_agree_with_perf(recorded: dict[str, tuple[Path, PerfScript]]) -> None:
    named = calls = 0
    for name, (_, script) in recorded.items():
        for s in script.samples:
            frames = s.user_frames
            for i, f in enumerate(frames):
                if not f.dso.startswith("/") or (f.sym or "").endswith("@plt"):
                    continue  # [unknown], [vdso]: no file; perf makes up PLT stubs' names
                held = {normalize_name(n) for n in binfacts.names_at(f.dso, f.ip)}
                if f.sym is None:
                    assert not held, (name, f, held)  # perf found nothing: nor is there any
                else:
                    assert normalize_name(f.sym) in held, (name, f, held)
                    named += 1
                # a caller's ip is its return address - 1, except the signal trampoline
                # (perf's [unknown] __restore_rt - 1) and the frame the signal interrupted,
                # whose ip is where it was interrupted: below the trampoline, named so when
                # the sample is in it (the leaf, at its rt_sigreturn syscall)
                tramp = name == "signal" and (
                    None in (f.sym, frames[i - 1].sym) or frames[i - 1].sym == "__restore_rt"
                )
                if i > 0 and not tramp:
                    assert binfacts.follows_call(f.dso, f.ip), (name, i, frames)
                    calls += 1
    assert named > 1000 and calls > 1000, (named, calls)


def test_binfacts_without_a_file(tmp_path: Path) -> None:
    assert not binfacts.follows_call(str(tmp_path / "absent"), 0x10)
    assert binfacts.names_at("[unknown]", 0xBB7) == frozenset()
    restore = binfacts.names_at(LIBC, 0x3C050)  # from libc6-dbg's separate debug file
    assert "__restore_rt" in restore
