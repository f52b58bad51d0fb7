"""procs/cgroups.py: /proc/<pid>/cgroup files as the kernel writes them (systemd services,
scopes, user slices and user managers, docker, containerd, cri-o, podman, kubepods with and
without the systemd cgroup driver, hybrid and v1-only machines), read through a /proc tree
in tmp byte for byte; the store keeping them per process and joining them in queries and
pprof; and a property test: never raises, bounded and printable output."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pprofcheck import decode
from unwindd.procs.cgroups import (
    MAX_PATH,
    UNIT_NAME_MAX,
    CgroupLabels,
    Labels,
    cgroup_path,
    labels_of_path,
)
from unwindd.procs.procscan import ProcFS
from unwindd.store.pprof import encode_profile
from unwindd.store.stackstore import StackStore
from unwindd.unwind.stackfmt import Frame, UnwoundSample

ID = "4f797c539e6c745de61a93ca3ff892358ecbcaccd8414d5db545c38428142970"
ID2 = "9ec39b91f3d70e1beff50a308f77067065ea6be0d91a3378375056cd4422cf3d"
POD = "pod8dbc5577_d0e2_4706_8787_57d52c03ddf2"

# (file bytes, expected cgroup, unit, container id)
CASES: list[tuple[bytes, str | None, str | None, str | None]] = [
    (b"0::/system.slice/nginx.service\n", "/system.slice/nginx.service", "nginx.service", None),
    (b"0::/user.slice/user-1000.slice/session-3.scope\n",
     "/user.slice/user-1000.slice/session-3.scope", "session-3.scope", None),
    # a user manager's unit: the innermost service/scope (systemd's cg_path_get_user_unit)
    (b"0::/user.slice/user-1000.slice/user@1000.service/app.slice/app-firefox-2345.scope\n",
     "/user.slice/user-1000.slice/user@1000.service/app.slice/app-firefox-2345.scope",
     "app-firefox-2345.scope", None),
    (b"0::/user.slice/user-1000.slice/user@1000.service/init.scope\n",
     "/user.slice/user-1000.slice/user@1000.service/init.scope", "init.scope", None),
    # a service's own sub-cgroup (Delegate=yes): the service
    (b"0::/system.slice/containerd.service/payload\n",
     "/system.slice/containerd.service/payload", "containerd.service", None),
    (b"0::/init.scope\n", "/init.scope", "init.scope", None),
    (b"0::/system.slice\n", "/system.slice", "system.slice", None),
    # systemd's escape of a name that would clash with a controller's files (cg_escape)
    (b"0::/system.slice/_cpu.pressure.service\n", "/system.slice/_cpu.pressure.service",
     "cpu.pressure.service", None),
    (b"0::/\n", "/", None, None),
    # docker, systemd cgroup driver (v2), and cgroupfs driver (v1: every controller)
    (b"0::/system.slice/docker-" + ID.encode() + b".scope\n",
     f"/system.slice/docker-{ID}.scope", f"docker-{ID}.scope", ID),
    (b"".join(b"%d:%s:/docker/%s\n" % (i, c, ID.encode()) for i, c in enumerate(
        (b"cpu,cpuacct", b"memory", b"pids", b"devices", b"name=systemd"), start=1)),
     f"/docker/{ID}", None, ID),
    # docker in docker: the innermost container
    (b"0::/docker/" + ID.encode() + b"/docker/" + ID2.encode() + b"\n",
     f"/docker/{ID}/docker/{ID2}", None, ID2),
    # kubernetes, systemd driver: containerd and cri-o
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-{POD}.slice/"
     f"cri-containerd-{ID}.scope\n".encode(),
     f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-{POD}.slice/"
     f"cri-containerd-{ID}.scope", f"cri-containerd-{ID}.scope", ID),
    (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-{POD}.slice/"
     f"crio-{ID}.scope\n".encode(),
     f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-{POD}.slice/"
     f"crio-{ID}.scope", f"crio-{ID}.scope", ID),
    # cri-o's conmon monitors the container from outside it: no id
    (f"0::/kubepods.slice/kubepods-{POD}.slice/crio-conmon-{ID}.scope\n".encode(),
     f"/kubepods.slice/kubepods-{POD}.slice/crio-conmon-{ID}.scope",
     f"crio-conmon-{ID}.scope", None),
    # kubernetes, cgroupfs driver (v2 and v1), burstable and guaranteed
    (f"0::/kubepods/burstable/pod8dbc5577-d0e2-4706-8787-57d52c03ddf2/{ID}\n".encode(),
     f"/kubepods/burstable/pod8dbc5577-d0e2-4706-8787-57d52c03ddf2/{ID}", None, ID),
    (f"11:memory:/kubepods/pod8dbc5577-d0e2-4706-8787-57d52c03ddf2/{ID}\n"
     f"1:name=systemd:/kubepods/pod8dbc5577-d0e2-4706-8787-57d52c03ddf2/{ID}\n".encode(),
     f"/kubepods/pod8dbc5577-d0e2-4706-8787-57d52c03ddf2/{ID}", None, ID),
    # podman (rootless, crun's "container" sub-cgroup) and its conmon
    (f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope/"
     f"container\n".encode(),
     f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope/container",
     f"libpod-{ID}.scope", ID),
    (f"0::/machine.slice/libpod-conmon-{ID}.scope\n".encode(),
     f"/machine.slice/libpod-conmon-{ID}.scope", f"libpod-conmon-{ID}.scope", None),
    # hybrid: the v2 line at the root, systemd's named hierarchy has the process
    (b"12:pids:/system.slice/ssh.service\n1:name=systemd:/system.slice/ssh.service\n0::/\n",
     "/system.slice/ssh.service", "ssh.service", None),
    # not ids: upper case, 63 digits, an unknown runtime's prefix
    (b"0::/docker/" + ID.upper().encode() + b"\n", f"/docker/{ID.upper()}", None, None),
    (b"0::/docker/" + ID[:63].encode() + b"\n", f"/docker/{ID[:63]}", None, None),
    (b"0::/machine.slice/foo-" + ID.encode() + b".scope\n",
     f"/machine.slice/foo-{ID}.scope", f"foo-{ID}.scope", None),
]


@pytest.fixture()
def proc(tmp_path: Path) -> Path:
    return tmp_path


def put(proc: Path, pid: int, data: bytes) -> None:
    (proc / str(pid)).mkdir(exist_ok=True)
    (proc / str(pid) / "cgroup").write_bytes(data)


@pytest.mark.parametrize("data,cgroup,unit,cid", CASES)
def test_real_forms(proc: Path, data: bytes, cgroup: str | None, unit: str | None,
                    cid: str | None) -> None:  # fmt: skip
    put(proc, 100, data)
    table = CgroupLabels(ProcFS(str(proc)))
    got = table.read(100)
    assert got == Labels(cgroup, unit, cid)
    assert table.get(100) is got and table.stats.reads == 1 and table.stats.unreadable == 0
    expect = {k: v for k, v in (("cgroup", cgroup), ("unit", unit), ("container_id", cid)) if v}
    assert got.as_dict() == expect


def test_unparsable_and_garbage(proc: Path) -> None:
    table = CgroupLabels(ProcFS(str(proc)))
    for pid, data in enumerate((b"", b"nonsense\n", b"0::relative\n", b"\xff\xfe:\x00"), 1):
        put(proc, pid, data)
        assert table.read(pid) == Labels()
    assert table.stats.unparsed == 4
    # a cgroup name may hold any byte but "/": no cgroup label, the unit still parsed
    put(proc, 9, b"0::/system.slice/x\xff\n/foo.service\n")
    got = table.read(9)
    assert got is not None and got.cgroup is None
    put(proc, 10, b"0::/" + b"a" * MAX_PATH + b"/ok.service\n")
    got = table.read(10)
    assert got == Labels(None, "ok.service", None)
    assert table.stats.unlabelled_path == 2


def test_vanished_process_has_no_labels(proc: Path) -> None:
    """A process gone before its file was read: no labels, counted; and the labels an earlier
    process with its pid had are dropped, never handed to the new one."""
    table = CgroupLabels(ProcFS(str(proc)))
    put(proc, 7, b"0::/system.slice/old.service\n")
    seen: list[tuple[int, Labels | None]] = []
    table.listeners.append(lambda pid, lab: seen.append((pid, lab)))
    assert table.labels_for(7) == Labels("/system.slice/old.service", "old.service", None)
    (proc / "7" / "cgroup").unlink()
    table.forget(7)  # FORK: pid 7 is a new process now
    assert table.labels_for(7) is None and table.get(7) is None
    assert table.stats.unreadable == 1
    assert seen[-1] == (7, None)


def test_bounded_tables(proc: Path) -> None:
    table = CgroupLabels(ProcFS(str(proc)), max_pids=4, max_paths=2)
    for pid in range(1, 11):
        put(proc, pid, f"0::/system.slice/s{pid}.service\n".encode())
        table.read(pid)
    assert len(table) == 4 and [table.get(p) is not None for p in (7, 8, 9, 10)] == [True] * 4
    assert len(table._by_path) <= 2
    # one parse per distinct path: pids in the same cgroup share one Labels
    put(proc, 20, b"0::/system.slice/s10.service\n")
    assert table.read(20) is table.get(10)


def _sample(pid: int, t: int, sym: str) -> UnwoundSample:
    return UnwoundSample(time_ns=t, pid=pid, tid=pid, cpu=0, comm=f"c{pid}", period=1,
                         frames=(Frame(ip=0x1000, dso="/bin/x", sym=sym, offset=0),),
                         unwind_status="ok")  # fmt: skip


def test_store_joins_labels_by_pid(proc: Path) -> None:
    put(proc, 11, b"0::/system.slice/a.service\n")
    put(proc, 12, f"0::/system.slice/docker-{ID}.scope\n".encode())
    table = CgroupLabels(ProcFS(str(proc)))
    store = StackStore()
    store.attach_labels(table)
    store.add([_sample(11, 1, "f"), _sample(12, 2, "g"), _sample(11, 3, "f"),
               _sample(13, 4, "h")])  # 13: no /proc entry  # fmt: skip
    assert table.stats.reads == 3 and table.stats.unreadable == 1  # once per pid
    assert store.labels_of(11) == {"cgroup": "/system.slice/a.service", "unit": "a.service"}
    assert store.labels_of(12)["container_id"] == ID
    assert store.labels_of(13) == {}
    assert store.label_pids(unit="a.service") == {11}
    assert store.label_pids(container=ID[:12]) == {12}
    assert store.label_pids(cgroup="/system.slice") == {11, 12}
    assert store.label_pids(cgroup="/system.slice/a.service") == {11}
    assert store.label_pids(cgroup="/system.sl") == frozenset()
    assert store.label_pids(unit="a.service", container=ID) == frozenset()
    procs = {p.pid: p for p in store.processes()}
    assert procs[12].labels.unit == f"docker-{ID}.scope" and procs[13].labels == Labels()
    # exec into another cgroup: the table re-reads, the store follows
    put(proc, 11, b"0::/system.slice/b.service\n")
    table.read(11)
    assert store.labels_of(11)["unit"] == "b.service"
    snap = store.snapshot()
    try:
        assert snap.label_pids(unit="b.service") == {11}
        assert snap.labels_of(12) == store.labels_of(12)
    finally:
        snap.close()
    # pprof: each sample of a pid carries its labels as string labels
    prof = decode(encode_profile(store.query(), period_ns=1000, labels_of=store.labels_of))
    by_pid = {lab["pid"]: lab for _, _, lab in prof.samples}
    assert by_pid[12]["container_id"] == ID and by_pid[12]["unit"] == f"docker-{ID}.scope"
    assert by_pid[11]["unit"] == "b.service" and "unit" not in by_pid[13]


def test_store_forgets_labels_with_the_process(proc: Path) -> None:
    put(proc, 11, b"0::/system.slice/a.service\n")
    table = CgroupLabels(ProcFS(str(proc)))
    store = StackStore(bucket_ns=10, max_buckets=1)
    store.attach_labels(table)
    store.add([_sample(11, 1, "f")])
    assert store.labels_of(11)
    store.add([_sample(12, 25, "g")])  # evicts pid 11's only bucket
    assert store.labels_of(11) == {} and 11 not in store._labels


LINES = st.lists(
    st.one_of(
        st.text(max_size=80),
        st.builds(lambda h, c, p: f"{h}:{c}:{p}", st.sampled_from(["0", "1", "12", "x"]),
                  st.sampled_from(["", "name=systemd", "memory", "cpu,cpuacct"]),
                  st.lists(st.one_of(st.sampled_from(
                      ["system.slice", "docker", ID, f"docker-{ID}.scope", "a.service", "",
                       "_x.scope", "user@1000.service", "crio-" + ID + ".scope", "..", "."]),
                      st.text(max_size=70)), max_size=12).map(lambda c: "/" + "/".join(c))),
    ),
    max_size=8,
)  # fmt: skip


@given(LINES)
def test_parser_property(lines: list[str]) -> None:
    text = "\n".join(lines)
    path = cgroup_path(text)
    assert path is None or path.startswith("/")
    lab = labels_of_path(path)
    if lab.cgroup is not None:
        assert len(lab.cgroup) <= MAX_PATH and lab.cgroup.isprintable() and lab.cgroup == path
    if lab.unit is not None:
        assert len(lab.unit) <= UNIT_NAME_MAX and lab.unit.isprintable()
        assert lab.unit.rsplit(".", 1)[1] in ("service", "scope", "slice")
    if lab.container_id is not None:
        assert len(lab.container_id) == 64 and set(lab.container_id) <= set("0123456789abcdef")
        assert path is not None and lab.container_id in path


@given(st.binary(max_size=600))
def test_read_property(data: bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        put(Path(d), 1, data)
        lab = CgroupLabels(ProcFS(d)).read(1)
        assert lab is not None
        assert lab.cgroup is None or (len(lab.cgroup) <= MAX_PATH and lab.cgroup.isprintable())
        encode_profile([], period_ns=1, labels_of=lambda pid: lab.as_dict())  # encodable
        for v in lab.as_dict().values():
            v.encode()


def test_live_table_reads_at_bootstrap_exec_and_rescan(proc: Path) -> None:
    """The live table reads a process's cgroup with its /proc at bootstrap, forgets it at a
    FORK of a new process (the store reads it at its first sample), re-reads at its exec (a
    runtime moved it before the exec) and at a rescan; a thread's FORK changes nothing."""
    from unwindd.procs.livetable import LiveTable
    from unwindd.procs.proctable import ProcessTable
    from unwindd.source.abi import MISC_COMM_EXEC
    from unwindd.source.records import NO_SAMPLE_ID, Comm, Fork

    def put_proc(pid: int, cg: str) -> None:
        put(proc, pid, f"0::{cg}\n".encode())
        (proc / str(pid) / "stat").write_text(
            f"{pid} (x) S 1 {pid} {pid} 0 -1 4194304 " + "0 " * 12 + "500 1 1\n")
        (proc / str(pid) / "maps").write_text("")

    put_proc(30, "/system.slice/a.service")
    live = LiveTable(ProcessTable(), ProcFS(str(proc)))
    store = StackStore()
    store.attach_labels(live.labels)
    live.bootstrap([30])
    assert live.labels.get(30) == Labels("/system.slice/a.service", "a.service", None)
    assert live.labels.stats.reads == 1
    live.observe(Fork(0, 31, 30, 31, 30, 10, NO_SAMPLE_ID))
    assert live.labels.get(31) is None and live.labels.stats.reads == 1  # lazily, not here
    live.observe(Fork(0, 30, 30, 32, 30, 11, NO_SAMPLE_ID))  # a thread of 30
    assert live.labels.get(30) is not None
    store.add([_sample(30, 12, "f")])
    put_proc(30, f"/system.slice/docker-{ID}.scope")
    live.observe(Comm(0, 30, 30, "x", NO_SAMPLE_ID))  # a rename (prctl): no read
    assert store.labels_of(30)["unit"] == "a.service"
    live.observe(Comm(MISC_COMM_EXEC, 30, 30, "x", NO_SAMPLE_ID))
    assert store.labels_of(30)["container_id"] == ID and live.labels.stats.reads == 2
    put_proc(30, "/system.slice/c.service")
    assert live._rescan(30, "retry", 0)
    assert store.labels_of(30)["unit"] == "c.service" and live.labels.stats.reads == 3


def test_cut_file_never_yields_a_cut_path(proc: Path) -> None:
    """A file past the read limit (hybrid machines list every hierarchy, the v2 line last):
    its cut last line is dropped, not read as a shorter path."""
    v1 = b"".join(b"%d:c%d:/system.slice/v1.service\n" % (i, i) for i in range(1, 11))
    v2 = b"0::/system.slice/" + b"y" * 20000 + b"/real.service\n"
    put(proc, 5, v1 + v2)
    got = CgroupLabels(ProcFS(str(proc))).read(5)
    assert got == Labels("/system.slice/v1.service", "v1.service", None)


def test_exec_of_a_new_process_reads_at_its_first_placed_sample(proc: Path) -> None:
    """A new process's exec (its FORK forgot its labels) is read when its first sample is
    placed, not at the exec: a process that exits unsampled is never read (process churn);
    one whose labels are held is read at the exec itself (the test above). Its drop forgets
    the pending read."""
    from unwindd.procs.livetable import LiveTable
    from unwindd.procs.proctable import ProcessTable
    from unwindd.source import abi
    from unwindd.source.abi import MISC_COMM_EXEC
    from unwindd.source.records import NO_SAMPLE_ID, Comm, Fork, Sample

    def sample(pid: int) -> Sample:
        regs = [0] * bin(abi.X86_64_REGS_MASK).count("1")
        return Sample(0, pid, pid, 5, 0, 0x1000, None, 1, (), abi.REGS_ABI_64,
                      abi.X86_64_REGS_MASK, tuple(regs), b"", 0)  # fmt: skip

    live = LiveTable(ProcessTable(), ProcFS(str(proc)))
    store = StackStore()
    store.attach_labels(live.labels)
    for pid in (41, 42):
        put(proc, pid, b"0::/system.slice/a.service\n")
        live.observe(Fork(0, pid, 1, pid, 1, 10, NO_SAMPLE_ID))
        put(proc, pid, f"0::/system.slice/docker-{ID}.scope\n".encode())  # moved, then exec
        live.observe(Comm(MISC_COMM_EXEC, pid, pid, "x", NO_SAMPLE_ID))
    assert live.labels.stats.reads == 0 and set(live.labels.due) == {41, 42}
    live.place(sample(41))
    assert live.labels.stats.reads == 1 and live.labels.get(41) == labels_of_path(
        f"/system.slice/docker-{ID}.scope")  # fmt: skip
    live.place(sample(41))
    assert live.labels.stats.reads == 1  # once
    live.forget(42)  # the table dropped it unsampled: never read
    assert not live.labels.due and live.labels.stats.reads == 1
    store.add([_sample(41, 12, "f")])
    assert store.labels_of(41)["container_id"] == ID and live.labels.stats.reads == 1
