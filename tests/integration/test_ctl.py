"""``unwindctl`` against a real daemon: every command, human and --json output, filters, the
pprof file, watch streaming live, and the error path when no daemon listens."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonutil import UNWINDCTL, DaemonProc, watch_from_exec
from pprofcheck import check_valid, decode
from stacks import CHAIN, all_callers_after_calls, folded, json_addrs, json_syms
from workloads.build import Workload, build_workloads


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, int, Workload]]:
    wl = build_workloads(tmp_path_factory.mktemp("ctl-wl"))["c_o2"]
    d = DaemonProc(tmp_path_factory.mktemp("ctl"))
    try:
        d.wait_message("READY=1")
        proc = subprocess.Popen(wl.argv, stdout=subprocess.DEVNULL)
        assert proc.wait(60) == 0
        d.wait_settled(proc.pid)
        yield d, proc.pid, wl
    finally:
        assert d.stop() == 0


def ctl(d: DaemonProc, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*UNWINDCTL, "--socket", str(d.sock), *args], capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_status_and_ps(env: tuple[DaemonProc, int, Workload]) -> None:
    d, pid, wl = env
    res = ctl(d, "status")
    assert res.returncode == 0 and "samples:" in res.stdout and "ELF cache:" in res.stdout
    st = json.loads(ctl(d, "--json", "status").stdout)
    assert st["samples"] > 0 and st["config"]["api"]["socket"] == str(d.sock)
    # the rings and the ring spill, in one line (the spill's counts move between the reads)
    rings = next(ln for ln in res.stdout.splitlines() if ln.startswith("rings:"))
    r = st["rings"]
    assert f"{r['cpus']} CPUs x {r['pages']} pages; ring spill: " in rings, rings
    assert f" of {r['spill_max_bytes'] / 1e6:.1f} MB), full " in rings, rings
    ps = ctl(d, "ps")
    head = ["PID", "SAMPLES", "COMM", "EXE", "UNIT", "CONTAINER"]
    assert ps.stdout.splitlines()[0].split() == head
    row = next(ln.split() for ln in ps.stdout.splitlines() if ln.split()[0] == str(pid))
    assert row[2] == "chain_o2" and row[3] == wl.argv[0]
    procs = json.loads(ctl(d, "--json", "ps").stdout)["processes"]
    assert any(p["pid"] == pid and p["samples"] >= 50 for p in procs)


def test_top_folded_pprof(env: tuple[DaemonProc, int, Workload], tmp_path: Path) -> None:
    d, pid, _ = env
    top = ctl(d, "top", "--pid", str(pid), "--since", "120")
    assert top.returncode == 0
    first = top.stdout.splitlines()[2].split()  # after the window line and the heads
    assert first[4] == "spin", top.stdout
    tj = json.loads(ctl(d, "--json", "top", "--pid", str(pid), "--comm", "chain_o2", "--limit",
                        "50").stdout)
    assert tj["functions"][0]["sym"] == "spin" and tj["samples"] >= 50
    # --no-inline: CHAIN is the stack as perf shows it without inline frames (stacks.py)
    lines = ctl(d, "folded", "--pid", str(pid), "--no-inline").stdout.splitlines()
    # the whole stack, _start to spin (samples in spin's own code have no kernel frames)
    hot = [ln for ln in lines if ln.rsplit(" ", 1)[0] == folded("chain_o2", CHAIN)]
    assert hot and sum(int(ln.rsplit(" ", 1)[1]) for ln in hot) >= 25, lines[:5]
    out = tmp_path / "p.pb.gz"
    res = ctl(d, "pprof", "--pid", str(pid), "--no-inline", "-o", str(out))
    assert res.returncode == 0 and "go tool pprof" in res.stdout
    p = decode(out.read_bytes())
    check_valid(p)
    assert list(CHAIN) in [p.stack_names(i) for i in range(len(p.samples))]
    assert ctl(d, "top", "--pid", "1", "--since", "0.001").returncode == 0


def test_watch_streams_live(env: tuple[DaemonProc, int, Workload]) -> None:
    d, _, wl = env
    # the workload starts once watch has subscribed (its stream is open in the daemon)
    pid, out, rc = watch_from_exec(d, wl.argv, 10, "--json", watch_opts=("--no-inline",))
    lines = [json.loads(ln) for ln in out.splitlines()]
    assert rc == 0 and len(lines) == 10
    assert {x["pid"] for x in lines} == {pid}
    comms = [x["comm"] for x in lines]
    # before its exec: "sh", or this test process's comm (a sample between Popen's fork and
    # its exec of sh, still in a ring when the stream subscribed: seen once in CI)
    mine = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    assert set(comms) <= {mine, "sh", "chain_o2"} and "chain_o2" in comms
    # whole stacks, callers at return address - 1 (--json has each frame's address in its file)
    whole = [x["frames"] for x in lines if json_syms(x["frames"]) == CHAIN]
    assert whole, [json_syms(x["frames"]) for x in lines]
    assert all_callers_after_calls(json_addrs(frames) for frames in whole) >= 7 * len(whole)
    human = subprocess.run([*UNWINDCTL, "--socket", str(d.sock), "watch", "--seconds", "0.5"],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
    assert human.returncode == 0 and human.stdout.strip(), human.stderr


def test_errors(env: tuple[DaemonProc, int, Workload], tmp_path: Path) -> None:
    d, _, _ = env
    res = subprocess.run([*UNWINDCTL, "--socket", str(tmp_path / "none.sock"), "status"],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip().endswith("no such socket (is unwindd running?)")
    res = ctl(d, "top", "--since", "-5")
    assert res.returncode == 2 and "HTTP 400" in res.stderr and "since" in res.stderr
