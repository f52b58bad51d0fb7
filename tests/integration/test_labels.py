"""Process labels end to end: workloads run in cgroups of their own (a transient-unit-shaped
``unwindd-test-<tag>.scope`` and a docker-shaped ``.../docker-<64 hex>.scope`` made in the
cgroup v2 hierarchy, as systemd and docker would name them; a third left where it started),
a real daemon samples them, and its socket answers: ``/v1/processes`` shows each one's unit,
cgroup and container id; ``unit=``, ``container=`` and ``cgroup=`` select exactly its stacks
(the same answer as its ``pid=``) on stacks, folded, top and pprof; pprof samples carry the
labels; ``unwindctl ps``/``top --unit`` show and filter them; ``unwindd record --format
jsonl`` of a command that moves itself into a cgroup before its exec labels its samples."""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
from cgrouputil import cgroup2_mount, in_cgroup, rmdir_when_empty
from daemonutil import UNWINDCTL, UNWINDD, DaemonProc
from pprofcheck import decode
from workloads.build import Workload, build_workloads


@dataclass
class Env:
    d: DaemonProc
    wl: Workload
    root: Path
    tag: str
    cid: str
    unit_pid: int
    docker_pid: int
    other_pid: int

    @property
    def unit(self) -> str:
        return f"unwindd-test-{self.tag}.scope"

    @property
    def slice(self) -> str:
        return f"/unwindd-test-{self.tag}.slice"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    wl = build_workloads(tmp_path_factory.mktemp("labels-wl"))["c_o2"]
    root = cgroup2_mount()
    tag = secrets.token_hex(4)
    cid = secrets.token_hex(32)
    scope = root / f"unwindd-test-{tag}.scope"
    slice_ = root / f"unwindd-test-{tag}.slice"
    dock = slice_ / f"docker-{cid}.scope"
    made = [scope, slice_, dock]
    for cg in made:
        cg.mkdir()
    d = DaemonProc(tmp_path_factory.mktemp("labels"))
    try:
        d.wait_message("READY=1")
        pids = [in_cgroup(wl, scope), in_cgroup(wl, dock), in_cgroup(wl, None)]
        for pid in pids:
            d.wait_settled(pid)
        yield Env(d, wl, root, tag, cid, *pids)
    finally:
        assert d.stop() == 0
        for cg in reversed(made):
            rmdir_when_empty(cg)


def procs(e: Env) -> dict[int, dict[str, object]]:
    return {p["pid"]: p for p in e.d.json("/v1/processes?limit=100000")["processes"]}


def test_processes_show_labels(env: Env) -> None:
    ps = procs(env)
    u, dk, other = ps[env.unit_pid], ps[env.docker_pid], ps[env.other_pid]
    assert (u["unit"], u["cgroup"], u["container_id"]) == (env.unit, f"/{env.unit}", None)
    assert dk["container_id"] == env.cid and dk["unit"] == f"docker-{env.cid}.scope"
    assert dk["cgroup"] == f"{env.slice}/docker-{env.cid}.scope"
    assert other["unit"] != env.unit and other["container_id"] is None


def stacks(e: Env, query: str) -> dict[str, object]:
    got: dict[str, object] = e.d.json(f"/v1/stacks?limit=100000&{query}")
    got.pop("window")
    return got


@pytest.mark.parametrize("which", ["unit", "container", "cgroup", "container_full"])
def test_filters_select_exactly_its_stacks(env: Env, which: str) -> None:
    query, pid = {
        "unit": (f"unit={env.unit}", env.unit_pid),
        "container": (f"container={env.cid[:12]}", env.docker_pid),
        "container_full": (f"container={env.cid}", env.docker_pid),
        "cgroup": (f"cgroup={quote(env.slice)}", env.docker_pid),
    }[which]
    by_label = stacks(env, query)
    by_pid = stacks(env, f"pid={pid}")
    assert by_label == by_pid and by_pid["samples"] == procs(env)[pid]["samples"]
    assert {s["pid"] for s in by_label["stacks"]} == {pid}  # type: ignore[attr-defined]
    st, _, folded = env.d.get(f"/v1/stacks?format=folded&{query}")
    assert st == 200 and folded == env.d.get(f"/v1/stacks?format=folded&pid={pid}")[2]
    top = env.d.json(f"/v1/top?{query}")
    assert top["samples"] == by_pid["samples"]
    assert top["functions"] == env.d.json(f"/v1/top?pid={pid}")["functions"]


def test_filters_combine_and_refuse(env: Env) -> None:
    none = stacks(env, f"unit={env.unit}&pid={env.docker_pid}")
    assert none["samples"] == 0 and none["stacks"] == []
    assert stacks(env, f"unit=unwindd-test-{env.tag}-nothing.service")["samples"] == 0
    assert stacks(env, f"unit={env.unit}&cgroup=/{env.unit}")["samples"] > 0
    for bad in ("cgroup=relative", "container=not-an-id!"):
        st, _, body = env.d.get(f"/v1/stacks?{bad}")
        assert st == 400 and bad.split("=")[0] in json.loads(body)["error"]
    st, _, _ = env.d.get(f"/v1/stream?unit={env.unit}")
    assert st == 400  # the stream takes no label filters (PARAMS)


def test_pprof_samples_carry_labels(env: Env) -> None:
    st, _, body = env.d.get(f"/v1/stacks?format=pprof&unit={env.unit}")
    assert st == 200
    prof = decode(body)
    assert prof.samples
    for _, _, lab in prof.samples:
        assert lab["pid"] == env.unit_pid and lab["unit"] == env.unit
        assert lab["cgroup"] == f"/{env.unit}" and "container_id" not in lab
    every = decode(env.d.get("/v1/stacks?format=pprof")[2])
    dock = [lab for _, _, lab in every.samples if lab.get("pid") == env.docker_pid]
    assert dock and all(lab["container_id"] == env.cid for lab in dock)
    other = [lab for _, _, lab in every.samples if lab.get("pid") == env.other_pid]
    assert other and not any(lab.get("unit") == env.unit for lab in other)


def ctl(e: Env, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*UNWINDCTL, "--socket", str(e.d.sock), *args], capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_unwindctl(env: Env) -> None:
    ps = ctl(env, "ps", "--limit", "100000")
    assert ps.returncode == 0, ps.stderr
    rows = {ln.split()[0]: ln.split() for ln in ps.stdout.splitlines()[1:]}
    assert rows[str(env.unit_pid)][-2:] == [env.unit, "-"]
    assert rows[str(env.docker_pid)][-1] == env.cid[:12]
    top = json.loads(ctl(env, "--json", "top", "--unit", env.unit).stdout)
    assert top["samples"] == procs(env)[env.unit_pid]["samples"]
    top = json.loads(ctl(env, "--json", "top", "--container", env.cid[:12]).stdout)
    assert top["samples"] == procs(env)[env.docker_pid]["samples"]
    folded = ctl(env, "folded", "--cgroup", env.slice)
    assert folded.returncode == 0 and folded.stdout == ctl(
        env, "folded", "--pid", str(env.docker_pid)).stdout  # fmt: skip


def test_record_jsonl_labels(env: Env) -> None:
    """A command that moves itself into a scope and then execs: its samples are labelled with
    the scope (read at the exec, not the fork)."""
    scope = env.root / f"unwindd-test-{env.tag}-rec.scope"
    scope.mkdir()
    try:
        script = f'echo $$ > {scope}/cgroup.procs && exec "$@"'
        res = subprocess.run([*UNWINDD, "record", "--format", "jsonl", "-F", "499", "--",
                              "sh", "-c", script, "sh", *env.wl.argv],
                             capture_output=True, text=True, timeout=180)  # fmt: skip
        assert res.returncode == 0, res.stderr
        lines = [json.loads(ln) for ln in res.stdout.splitlines()]
        mine = [s for s in lines if s["comm"] == Path(env.wl.argv[0]).name[:15]]
        assert len(mine) >= 20
        assert all(s["unit"] == scope.name and s["cgroup"] == f"/{scope.name}" for s in mine)
        assert all("container_id" not in s for s in mine)
    finally:
        rmdir_when_empty(scope)
