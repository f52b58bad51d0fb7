"""The daemon end to end: ``unwindd run`` as a subprocess from a temp config (socket in tmp,
metrics on a free localhost port, a fake NOTIFY_SOCKET), a known workload, and queries over raw
HTTP on AF_UNIX; then hostile clients, SIGHUP and SIGTERM. Tests run in file order and share
one daemon; the lifecycle tests at the end stop it."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonutil import (
    DaemonProc,
    dechunk,
    held,
    metric_values,
    parse_response,
    raw_http,
    release,
)
from pprofcheck import check_valid, decode
from stacks import (
    CHAIN,
    all_callers_after_calls,
    check_thread_samples,
    folded,
    json_addrs,
    json_syms,
    thread_ids,
)
from unwindd.source.sampling import auto_ring_pages, online_cpus, system_ring_cap
from workloads.build import Workload, build_deep, build_workloads


@pytest.fixture(scope="module")
def workloads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Workload]:
    return build_workloads(tmp_path_factory.mktemp("svc-wl"))


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, workloads: dict[str, Workload]
) -> Iterator[DaemonProc]:
    # Workloads are compiled first: gcc's many cold binaries would otherwise stall the
    # daemon's first steps (see README: cold ELF loads) and cost samples.
    d = DaemonProc(tmp_path_factory.mktemp("svc"))
    try:
        d.wait_message("READY=1")
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def workload_pid(daemon: DaemonProc, workloads: dict[str, Workload]) -> int:
    child = subprocess.run(workloads["c_o2"].argv, stdout=subprocess.DEVNULL, timeout=60)
    assert child.returncode == 0
    proc = subprocess.Popen(workloads["c_o2"].argv, stdout=subprocess.DEVNULL)
    assert proc.wait(60) == 0
    daemon.wait_settled(proc.pid)
    return proc.pid


def test_ready_and_watchdog(daemon: DaemonProc) -> None:
    assert any(m.startswith("READY=1") for m in daemon.messages)
    # WATCHDOG_USEC=400000: a ping every 0.2 s, except while a step is stuck loading cold
    # binaries (the first steps after start parse every running program's ELF files: under
    # other sessions' load that took most of a 2 s window). So: a first ping, then pings keep
    # coming (~20 in 4 s when idle; a daemon that stops pinging gets at most one).
    daemon.wait_message("WATCHDOG=1", timeout=20)
    got = daemon.recv_messages(4.0)
    assert got.count("WATCHDOG=1") >= 2, got


def test_stacks_of_the_workload_over_raw_http(daemon: DaemonProc, workload_pid: int) -> None:
    # inline=0: CHAIN is the stack as perf shows it without inline frames (stacks.py)
    out = daemon.json(f"/v1/stacks?pid={workload_pid}&inline=0")
    total = out["samples"]
    assert total >= 50, out
    spin = [s for s in out["stacks"] if json_syms(s["frames"])[:1] == ("spin",)]
    n_spin = sum(s["count"] for s in spin)
    good = sum(s["count"] for s in spin if json_syms(s["frames"]) == CHAIN)  # to _start
    assert n_spin >= total // 2 and good >= 0.95 * n_spin, out["stacks"][:3]
    procs = {p["pid"]: p for p in daemon.json("/v1/processes")["processes"]}
    assert procs[workload_pid]["comm"] == "chain_o2"
    assert procs[workload_pid]["samples"] == total
    status, headers, body = daemon.get(f"/v1/stacks?pid={workload_pid}&format=folded&inline=0")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    whole = folded("chain_o2", CHAIN)
    assert whole in {ln.rsplit(" ", 1)[0] for ln in body.decode().splitlines()}, body[:500]
    # The same window by time: everything of the last minute includes the workload.
    recent = daemon.json(f"/v1/stacks?pid={workload_pid}&since=60")
    assert recent["samples"] == total
    assert daemon.json(f"/v1/stacks?pid={workload_pid}&comm=nope")["samples"] == 0


def test_top_and_status(
    daemon: DaemonProc, workloads: dict[str, Workload], workload_pid: int
) -> None:
    top = daemon.json(f"/v1/top?pid={workload_pid}&limit=100")
    assert top["functions"][0]["sym"] == "spin"
    totals = {f["sym"]: f["total"] for f in top["functions"]}
    assert totals["main"] >= 0.9 * top["samples"]
    # stacks reach the outermost frame: the program's _start (ld.so has a _start of its own,
    # the bottom of the few samples taken while it loads the program)
    start = {f["dso"]: f["total"] for f in top["functions"] if f["sym"] == "_start"}
    assert start.get(workloads["c_o2"].argv[0], 0) >= 0.9 * top["samples"], start
    st = daemon.json("/v1/status")
    assert st["version"] == "0.1.0" and st["samples"] >= top["samples"]
    assert st["processes"] >= 1 and st["cache"]["entries"] >= 1
    text = daemon.metrics()
    lost = metric_values(text, "unwindd_lost_records_total")
    assert sum(lost.values()) >= st["lost"]  # metrics are read later: never fewer
    assert metric_values(text, "unwindd_ring_pages") == {"": 256.0}
    assert st["config"]["sampling"]["frequency"] == 499 and st["uptime_s"] > 0
    spill = st["rings"].pop("spill")
    assert st["rings"] == {"cpus": len(online_cpus()), "pages": 256, "wanted_pages": 256,
                           "spill_max_bytes": 16 << 20}  # fmt: skip
    # the ring spill runs (its thread has woken) within its bound, and its counts are exported
    assert set(spill) == {"records", "bytes", "held", "held_max", "full", "wakeups"}, spill
    assert spill["wakeups"] > 0 and spill["held_max"] <= 16 << 20, spill
    assert metric_values(text, "unwindd_ring_spilled_records_total")[""] >= spill["records"]
    assert metric_values(text, "unwindd_ring_spill_full_total")[""] >= spill["full"]
    assert 0 <= metric_values(text, "unwindd_ring_spill_bytes")[""] <= 16 << 20


def test_rings_sized_from_the_frequency_by_default(tmp_path: Path) -> None:
    """No ring_pages in the config: the rings are sized for the frequency and stack size
    (256 pages at 999 Hz with 8 KiB stacks) within the locked-memory budget, and the daemon
    says so (a warning only when the budget gave less). With spill_max_bytes = 0, no ring
    spill, and none of its metrics."""
    d = DaemonProc(tmp_path, frequency=999, ring_pages=None,
                   sampling_toml="spill_max_bytes = 0\n")
    try:
        d.wait_message("READY=1")
        rings = d.json("/v1/status")["rings"]
        text = d.metrics()
    finally:
        assert d.stop() == 0
    assert rings.pop("spill") is None and rings.pop("spill_max_bytes") == 0
    assert "unwindd_ring_spill" not in text
    # the daemon runs as this test process does (same uid, capabilities and limits)
    ncpu, page = len(online_cpus()), os.sysconf("SC_PAGE_SIZE")
    wanted = auto_ring_pages(999, 8192, page)
    pages = min(wanted, system_ring_cap(page, ncpu))
    assert rings == {"cpus": ncpu, "pages": pages, "wanted_pages": wanted}
    log = d.log.read_text()
    assert f"rings: {pages} pages per CPU (auto)" in log, log
    assert (f"rings: {wanted} pages per CPU would suit 999 Hz" in log) is (pages < wanted), log


def test_pprof_parses(daemon: DaemonProc, workload_pid: int) -> None:
    status, _headers, body = daemon.get(f"/v1/stacks?pid={workload_pid}&format=pprof&inline=0")
    assert status == 200 and body[:2] == b"\x1f\x8b"
    p = decode(body)
    check_valid(p)
    assert p.sample_types == [("samples", "count"), ("cpu", "nanoseconds")]
    total = sum(v[0] for _, v, _ in p.samples)
    assert total == daemon.json(f"/v1/stacks?pid={workload_pid}")["samples"]
    # a sample in spin's own code (no kernel frames): the whole stack and nothing else
    assert list(CHAIN) in [p.stack_names(i) for i in range(len(p.samples))]
    assert all(lb["pid"] == workload_pid for _, _, lb in p.samples)


def test_metrics_show_the_samples(daemon: DaemonProc, workload_pid: int) -> None:
    text = daemon.metrics()
    by_result = metric_values(text, "unwindd_samples_total")
    st = daemon.json("/v1/status")
    assert sum(by_result.values()) >= 50 and by_result.get('{result="ok"}', 0) >= 50, by_result
    assert metric_values(text, "unwindd_records_total")['{type="SAMPLE"}'] <= st["samples"]
    assert metric_values(text, "unwindd_unwind_depth_frames_count")[""] >= 50
    assert metric_values(text, "unwindd_step_seconds_count")[""] > 0
    assert metric_values(text, "unwindd_elf_cache_entries")[""] >= 1
    # [cache] dir (daemonutil: the test's own): the workload's compiled CFI and symbol tables
    # persist by build-id for the next start
    cache = daemon.tmp / "cache"
    assert list((cache / "cfi").glob("*.cfi")) and list((cache / "sym").glob("*.sym")), cache
    assert metric_values(text, "unwindd_cfi_disk_cache_total")['{result="compiled"}'] >= 1
    assert metric_values(text, "unwindd_symbol_disk_cache_total")['{result="misses"}'] >= 1
    assert "unwindd_reorder_lateness_seconds_bucket" in text
    assert "unwindd_build_info{" in text
    # no pid as a label value (values may contain its digits: "1922.0" holds pid 922)
    labels = [ln[ln.index("{") : ln.rindex("}") + 1] for ln in text.splitlines()
              if "{" in ln and not ln.startswith("#")]  # fmt: skip
    assert not [lb for lb in labels if re.search(rf'="{workload_pid}"', lb)], labels


def test_stream_is_live(
    daemon: DaemonProc, workloads: dict[str, Workload], workload_pid: int
) -> None:
    lines: list[bytes] = []
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(str(daemon.sock))
    started = time.monotonic_ns()
    child = held(workloads["c_o3"].argv)
    s.sendall(f"GET /v1/stream?pid={child.pid}&limit=20&inline=0 HTTP/1.1\r\nHost: x\r\n\r\n"
              .encode())  # (inline=0: CHAIN is perf's stack without inline frames, stacks.py)
    # The daemon subscribes the stream before it sends the response head (streams.py,
    # StreamFanout.serve): once the head is in, the workload starts, and every line is a live
    # sample of it.
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, buf
        buf += chunk
    release(child)
    while b"\r\n0\r\n\r\n" not in buf:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            raise AssertionError(f"{buf[:2000]!r} {daemon.json('/v1/status')}") from None
        if not chunk:
            break
        buf += chunk
    s.close()
    child.wait(60)
    head, _, body = buf.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    lines = dechunk(body).splitlines()
    assert len(lines) == 20
    samples = [json.loads(ln) for ln in lines]
    assert {x["pid"] for x in samples} == {child.pid}
    # Before its first exec the child is named after its parent (this test process, as perf's
    # thread__fork does); the held shell's samples before its exec carry "sh".
    parent = Path("/proc/self/comm").read_text().strip()
    assert {x["comm"] for x in samples} <= {parent, "sh", "chain_o3"}
    assert all(x["time_ns"] >= started for x in samples)
    whole = [x for x in samples if json_syms(x["frames"]) == CHAIN]
    assert whole, [json_syms(x["frames"]) for x in samples]
    # callers at return address - 1 (the lines carry each frame's address in its file)
    assert all_callers_after_calls(json_addrs(x["frames"]) for x in whole) >= 7 * len(whole)


def test_threads_are_sampled_under_their_pid_with_their_tids(
    daemon: DaemonProc, workloads: dict[str, Workload], tmp_path: Path
) -> None:
    """Three busy pthreads: every sample is stored under the process's pid with the id of the
    thread that ran (the workload writes its gettid()s: the main thread's is the pid, the
    workers' are not), and each worker's stacks are whole down to clone3."""
    tids_file = tmp_path / "tids"
    # 64 units: ~0.3 s of CPU per worker here, ~140 samples each at 499 Hz (20 are needed)
    proc = subprocess.Popen([workloads["threads"].argv[0], "64", str(tids_file)],
                            stdout=subprocess.DEVNULL)  # fmt: skip
    assert proc.wait(120) == 0
    pid = proc.pid
    tids = thread_ids(tids_file)
    daemon.wait_settled(pid)
    stacks = daemon.json(f"/v1/stacks?pid={pid}&inline=0")["stacks"]  # (mix inlined: stacks.py)
    check_thread_samples(((s["pid"], s["tid"], s["comm"], json_syms(s["frames"]), s["count"])
                          for s in stacks), pid, tids)  # fmt: skip


def test_non_root_peer_sees_only_its_own_processes(daemon: DaemonProc, workload_pid: int) -> None:
    nobody = 65534
    # A busy process owned by nobody, then a query from a nobody peer (SO_PEERCRED).
    busy = subprocess.Popen(["python3", "-c", "import time\ne=time.time()+20\n"
                             "while time.time()<e: pass"], user=nobody)  # fmt: skip
    deadline = time.monotonic() + 15
    while busy.pid not in {p["pid"] for p in daemon.json("/v1/processes")["processes"]}:
        assert time.monotonic() < deadline, "the nobody process was never sampled"
        time.sleep(0.6)  # > the answer cache's 0.5 s
    script = ("import json,sys; sys.path.insert(0, sys.argv[2]); from daemonutil import raw_http;"
              "print(json.dumps([json.loads(raw_http(sys.argv[1], p)[2]) for p in "
              "('/v1/processes', '/v1/stacks?pid=%d' % int(sys.argv[3]))]))")
    helpers = Path(__file__).parents[1] / "support"  # daemonutil, for the child
    res = subprocess.run(["python3", "-c", script, str(daemon.sock), str(helpers),
                          str(workload_pid)], user=nobody, capture_output=True, text=True,
                         timeout=30)  # fmt: skip
    busy.kill()
    busy.wait()
    assert res.returncode == 0, res.stderr
    procs, stacks = json.loads(res.stdout)
    pids = {p["pid"] for p in procs["processes"]}
    assert busy.pid in pids and workload_pid not in pids
    assert stacks["samples"] == 0
    assert workload_pid in {p["pid"] for p in daemon.json("/v1/processes")["processes"]}


def test_bad_clients_get_errors(daemon: DaemonProc) -> None:
    big = b"GET /v1/status HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 100_000 + b"\r\n\r\n"
    assert raw_http(daemon.sock, "", data=big)[0] == 431
    assert raw_http(daemon.sock, "", data=b"\x16\x03\x01garbage\r\n\r\n")[0] == 400
    assert raw_http(daemon.sock, "", data=b"GET / HTTP/1.1\r\n\r\n")[0] == 400
    body = b"POST /v1/status HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
    assert raw_http(daemon.sock, "", data=body)[0] == 413
    assert daemon.get("/v1/nothing")[0] == 404
    assert daemon.get("/v1/stacks?since=abc")[0] == 400


def test_slow_client_times_out_without_stalling(daemon: DaemonProc) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(daemon.sock))
    s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")  # never finished
    t0 = time.monotonic()
    before = daemon.json("/v1/status")["samples"]
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # to sample meanwhile
    try:
        # others are answered meanwhile: the stalled request has not been answered (408) yet
        # when the status reply is in (a daemon serving one client at a time would have timed
        # the stalled one out first; a "< 1 s" bound here could fail on a loaded machine)
        s.setblocking(False)
        with pytest.raises(BlockingIOError):
            s.recv(1, socket.MSG_PEEK)
        s.setblocking(True)
        s.settimeout(10)
        buf = b""
        while chunk := s.recv(4096):
            buf += chunk
        waited = time.monotonic() - t0
        s.close()
        assert buf.startswith(b"HTTP/1.1 408"), buf
        assert 1.0 < waited < 10.0  # request_timeout = 1.5 in the test config
        daemon.wait_status(lambda st: st["samples"] > before, "new samples")  # still sampling
    finally:
        spin.kill()
        spin.wait()


def test_200_concurrent_clients(daemon: DaemonProc) -> None:
    before = daemon.json("/v1/status")["samples"]
    # something to sample meanwhile: the daemon must keep sampling while it serves (on a quiet
    # machine nothing else may run during the test)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    results: list[int] = []
    errors: list[BaseException] = []

    def client() -> None:
        try:
            results.append(raw_http(daemon.sock, "/v1/top?limit=3", timeout=30)[0])
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=client) for _ in range(200)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        assert len(results) == 200 and set(results) <= {200, 503}
        assert results.count(200) >= 100
        # every client's connection is closed again: only the status request's own is open,
        # and the spinner's samples reach the counts
        daemon.wait_status(lambda st: st["api"]["connections"] == 1 and st["samples"] > before,
                           "one connection and new samples")  # fmt: skip
    finally:
        spin.kill()
        spin.wait()


@pytest.fixture(scope="module")
def deep_pid(daemon: DaemonProc, tmp_path_factory: pytest.TempPathFactory) -> int:
    """An exited process whose stacks (many depths, up to ~180 frames: workloads/deep.c) are
    all stored: a JSON answer of megabytes, many chunks."""
    deep = build_deep(tmp_path_factory.mktemp("deep"))
    proc = subprocess.Popen(deep.argv, stdout=subprocess.DEVNULL)
    assert proc.wait(60) == 0
    daemon.wait_settled(proc.pid)
    return proc.pid


def _get_http10(sock: Path, target: str) -> tuple[int, dict[str, str], bytes]:
    """An HTTP/1.0 request: the answer's body ends where the connection does."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(sock))
        s.sendall(f"GET {target} HTTP/1.0\r\n\r\n".encode())
        buf = bytearray()
        while chunk := s.recv(1 << 16):
            buf += chunk
    return parse_response(bytes(buf))


def test_a_big_json_answer_is_written_in_chunks(daemon: DaemonProc, deep_pid: int) -> None:
    """A JSON stacks answer of megabytes comes chunked (no content-length), and curl,
    http.client and an HTTP/1.0 client (its body delimited by the close) read the same stacks
    byte for byte (the window's end moves with the clock); then no snapshot is held."""
    target = f"/v1/stacks?pid={deep_pid}"
    got = subprocess.run(["curl", "-sS", "--unix-socket", str(daemon.sock), "-D", "-",
                          f"http://x{target}"], capture_output=True, check=True,
                         timeout=60).stdout  # fmt: skip
    head, _, body = got.partition(b"\r\n\r\n")  # curl undid the chunked coding
    assert head.startswith(b"HTTP/1.1 200") and b"\r\nTransfer-Encoding: chunked" in head
    assert b"content-length" not in head.lower()
    answer = json.loads(body)
    assert len(body) > 4 * (256 << 10) and answer["truncated"] is False
    assert answer["samples"] == sum(s["count"] for s in answer["stacks"]) > 0
    assert {s["pid"] for s in answer["stacks"]} == {deep_pid}
    conn = http.client.HTTPConnection("x", timeout=30)
    conn.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.sock.connect(str(daemon.sock))
    for _ in range(2):  # one connection, kept alive after a chunked answer
        conn.request("GET", target)
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("transfer-encoding") == "chunked"
        again = r.read()
        assert again.rpartition(b'],"window":')[0] == body.rpartition(b'],"window":')[0]
    conn.close()
    status, headers, old = _get_http10(daemon.sock, target)
    assert status == 200 and headers["connection"] == "close"
    assert "transfer-encoding" not in headers and "content-length" not in headers
    assert old.rpartition(b'],"window":')[0] == body.rpartition(b'],"window":')[0]
    daemon.wait_status(lambda st: st["store"]["snapshots"] == 0 and
                       st["api"]["connections"] == 1, "no snapshot held")  # fmt: skip


def test_slow_and_vanishing_readers_of_a_big_answer(daemon: DaemonProc, deep_pid: int) -> None:
    """A client that asks for a big JSON answer and never reads, and clients that read a
    little and go: the daemon answers others meanwhile, drops the stalled one once its waits
    pass request_timeout (1.5 s here), lets go of every snapshot and logs no error."""
    target = f"/v1/stacks?pid={deep_pid}"
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.connect(str(daemon.sock))
    stalled.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    for _ in range(3):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
            gone.connect(str(daemon.sock))
            gone.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            gone.recv(20000)
    whole = daemon.json(target)  # answered while the stalled one waits
    assert whole["samples"] > 0
    daemon.wait_status(lambda st: st["store"]["snapshots"] == 0 and
                       st["api"]["connections"] == 1, "the stalled reader dropped")  # fmt: skip
    stalled.settimeout(30)
    got = bytearray()
    while chunk := stalled.recv(1 << 16):
        got += chunk
    stalled.close()
    assert got.startswith(b"HTTP/1.1 200") and not got.endswith(b"\r\n0\r\n\r\n")  # cut
    assert "Traceback" not in daemon.log.read_text()


def test_sighup_reloads_without_losing_state(daemon: DaemonProc) -> None:
    before = daemon.json("/v1/status")
    daemon.write_config(extra="[store]\nmax_entries = 123456\n", frequency=1000)
    daemon.recv_messages(0.05)
    daemon.proc.send_signal(signal.SIGHUP)
    got = daemon.wait_message("READY=1", timeout=10)
    reloading = [m for m in got if m.startswith("RELOADING=1")]
    assert reloading and "MONOTONIC_USEC=" in reloading[0], got
    after = daemon.json("/v1/status")
    assert after["reloads"] == before["reloads"] + 1
    assert after["config"]["store"]["max_entries"] == 123456  # applied live
    assert after["config"]["sampling"]["frequency"] == 499  # rings stay as opened
    assert after["pending_restart"] == ["[sampling] frequency"]
    assert after["samples"] >= before["samples"] and after["uptime_s"] > before["uptime_s"]
    assert after["store"]["samples"] >= before["store"]["samples"]
    # A broken file is refused and the running config kept.
    daemon.config.write_text("[sampling]\nfrequency = -1\n")
    daemon.proc.send_signal(signal.SIGHUP)
    daemon.wait_message("READY=1", timeout=10)
    bad = daemon.json("/v1/status")
    assert "[sampling] frequency" in bad["reload_errors"][-1]
    assert bad["config"]["store"]["max_entries"] == 123456


def test_sigterm_drains_and_exits_zero(daemon: DaemonProc) -> None:
    assert daemon.sock.exists()
    t0 = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    rc = daemon.proc.wait(10)
    assert rc == 0 and time.monotonic() - t0 < 5
    assert not daemon.sock.exists()
    daemon.recv_messages(0.2)
    assert "STOPPING=1" in daemon.messages
    log = daemon.log.read_text()
    assert "Traceback" not in log, log


def test_default_socket_falls_back_when_run_is_not_writable(tmp_path: Path) -> None:
    """`pip install . && unwindd` as a user who cannot create /run/unwindd: the daemon says
    where it listens instead (checked on the helper, not by starting a second sampler)."""
    from unwindd.serve.startup import prepare_socket_path

    env_before = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(tmp_path)
    try:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        os.chmod(ro, 0o500)
        if os.geteuid() == 0:
            # root can write anywhere; emulate the failure with a path under a file.
            target = str(tmp_path / "file" / "sub" / "unwindd.sock")
            (tmp_path / "file").write_text("")
        else:
            target = str(ro / "unwindd" / "unwindd.sock")
        got = prepare_socket_path(target, is_default=True)
        assert got == str(tmp_path / "unwindd" / "unwindd.sock")
        from unwindd.serve.startup import StartupError

        with pytest.raises(StartupError, match=r"\[api\] socket"):
            prepare_socket_path(target, is_default=False)
    finally:
        if env_before is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = env_before


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    """`systemd-analyze verify` accepts the unit (ExecStart pointed at the installed script:
    verify insists that the binary exists)."""
    import shutil

    analyze, exe = shutil.which("systemd-analyze"), shutil.which("unwindd")
    assert analyze, "systemd-analyze is part of the systemd package (.ci/run installs it)"
    assert exe, "the unwindd console script is installed"
    unit = (Path(__file__).parents[2] / "systemd" / "unwindd.service").read_text()
    assert "Type=notify" in unit and "WatchdogSec=" in unit and "Restart=on-failure" in unit
    copy = tmp_path / "unwindd.service"
    copy.write_text(unit.replace("/usr/local/bin/unwindd", os.path.realpath(exe)))
    res = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
