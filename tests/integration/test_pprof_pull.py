"""The pull export ([export] pprof_listen) against a real daemon and a real scraper: ``go tool
pprof`` fetches a CPU profile of a running workload over TCP and finds its call chain; a plain
HTTP client (sharing no code with the daemon) checks the profile's types, that it counts only
the samples of its window (delta), the filters, and every refusal: bad or unknown parameters,
too many profiles at once, a missing or wrong token, and a half-sent request that must not hold
up anyone else."""

from __future__ import annotations

import gzip
import os
import re
import select
import shutil
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonutil import UNWINDD, DaemonProc, free_port, metric_values, parse_response
from pprofcheck import check_valid, decode, fields_of, one
from workloads.build import build_workloads

GO = shutil.which("go") or "/usr/bin/go"
FREQ = 499
MAX_CONCURRENT = 2


class Env:
    def __init__(self, d: DaemonProc, port: int, pids: tuple[int, int]) -> None:
        self.d, self.port, self.pids = d, port, pids


def http(port: int, target: str, *, headers: str = "",
         timeout: float = 30) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    """One GET over TCP with ``Connection: close``, read to EOF."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\n\r\n"
                  .encode())  # fmt: skip
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    return parse_response(buf)


def stored_samples(d: DaemonProc, pid: int) -> int:
    procs = {p["pid"]: p for p in d.json("/v1/processes")["processes"]}
    return int(procs[pid]["samples"]) if pid in procs else 0


def rejected(d: DaemonProc) -> dict[str, float]:
    vals = metric_values(d.metrics(), "unwindd_pprof_rejected_total")
    return {k.split('"')[1]: v for k, v in vals.items()}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    wl = build_workloads(tmp_path_factory.mktemp("pull-wl"))["c_o2"]
    port = free_port()
    # One bucket holds the whole test: a profile widened to buckets, or counted since the
    # workload started, would then hold every sample the workload ever had, not the window's.
    extra = (f'[store]\nbucket_seconds = 3600\nretention_seconds = 3600\n'
             f'[export]\npprof_listen = "127.0.0.1:{port}"\n'
             f'pprof_max_concurrent = {MAX_CONCURRENT}\npprof_max_seconds = 60\n')
    d = DaemonProc(tmp_path_factory.mktemp("pull"), extra, frequency=FREQ)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        d.wait_message("READY=1")
        # Two long runs (killed at the end): each is a -> b -> c -> spin, one thread.
        procs = [subprocess.Popen([wl.argv[0], "1000000"], stdout=subprocess.DEVNULL)
                 for _ in range(2)]  # fmt: skip
        yield Env(d, port, (procs[0].pid, procs[1].pid))
    finally:
        for p in procs:
            p.kill()
            p.wait()
        assert d.stop() == 0


def test_go_tool_pprof_scrapes_the_call_chain(env: Env, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    goenv = dict(os.environ, HOME=str(home), GOCACHE=str(tmp_path / "gocache"),
                 GOPATH=str(tmp_path / "gopath"), GOFLAGS="", PPROF_TMPDIR=str(tmp_path))
    url = f"http://127.0.0.1:{env.port}/debug/pprof/profile?seconds=3&pid={env.pids[0]}"
    res = subprocess.run([GO, "tool", "pprof", "-raw", url], capture_output=True, text=True,
                         env=goenv, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "PeriodType: cpu nanoseconds" in out and f"Period: {10**9 // FREQ}" in out, out[:300]
    # -raw: "Locations" lists "ID: ADDRESS M=MAPPING FUNCTION FILE:LINE s=0"; a sample is
    # "COUNT NANOS: ID ID ..." (leaf first).
    names = {int(m[1]): m[2] for m in re.finditer(r"^\s+(\d+): 0x[0-9a-f]+ M=\d+ (\S+)", out,
                                                  re.M)}  # fmt: skip
    chains = [[names[int(i)] for i in m[3].split()]
              for m in re.finditer(r"^\s+(\d+)\s+(\d+): ([\d ]+)$", out, re.M)]  # fmt: skip
    assert chains, out[:2000]
    want = ["spin", "c", "b", "a", "main"]
    hits = [c for c in chains if c[: len(want)] == want]
    assert hits, f"no {' <- '.join(want)} in {chains[:5]}"
    assert f"pid:[{env.pids[0]}]" in out and f"pid:[{env.pids[1]}]" not in out


def test_profile_counts_only_its_window(env: Env) -> None:
    d, (pid, other) = env.d, env.pids
    seconds = 2
    window_cpu = seconds * FREQ  # a single thread's samples in the window, at most
    # Before the window, the workload already has 3 windows' worth stored (in the same bucket).
    deadline = time.monotonic() + 60
    while stored_samples(d, pid) < 3 * window_cpu:
        assert time.monotonic() < deadline, f"pid {pid}: {stored_samples(d, pid)} samples"
        time.sleep(0.5)
    t0 = time.time()
    status, headers, body = http(env.port, f"/debug/pprof/profile?seconds={seconds}&pid={pid}")
    elapsed = time.time() - t0
    assert status == 200, body
    assert headers["content-type"] == "application/octet-stream"
    assert seconds <= elapsed < seconds + 5
    p = decode(body)
    check_valid(p)
    assert p.sample_types == [("samples", "count"), ("cpu", "nanoseconds")]
    assert p.period_type == ("cpu", "nanoseconds") and p.period == 10**9 // FREQ
    assert {s[2]["pid"] for s in p.samples} == {pid}
    counts = [s[1][0] for s in p.samples]
    assert all(v[1] == v[0] * p.period for _, v, _ in p.samples)
    total = sum(counts)
    # Delta: at most the window's CPU (plus a tick of drain at either edge), never the
    # samples stored before it; and the spinning workload got some CPU in it.
    assert 0.1 * window_cpu <= total <= 1.2 * window_cpu + 20, (total, window_cpu)
    top = fields_of(gzip.decompress(body))
    start_s, dur_s = one(top, 9) / 1e9, one(top, 10) / 1e9
    assert t0 - 0.5 <= start_s <= t0 + 0.5 and seconds <= dur_s < seconds + 0.5, (start_s, dur_s)
    # comm and no filter: both workloads; pid=other: only it.
    status, _, body = http(env.port, "/debug/pprof/profile?seconds=1&comm=chain_o2")
    assert status == 200
    got = decode(body)
    assert {s[2]["comm"] for s in got.samples} == {"chain_o2"}
    assert {pid, other} <= {s[2]["pid"] for s in got.samples}
    status, _, body = http(env.port, f"/debug/pprof/profile?seconds=1&pid={other}")
    assert status == 200 and {s[2]["pid"] for s in decode(body).samples} == {other}


def test_refusals_are_answered_and_counted(env: Env) -> None:
    before = rejected(env.d)
    expected: Counter[str] = Counter()
    for target, status, reason, says in [
        ("/debug/pprof/profile?seconds=61", 400, "bad_parameter", "seconds"),
        ("/debug/pprof/profile?seconds=abc", 400, "bad_parameter", "seconds"),
        ("/debug/pprof/profile?seconds=0", 400, "bad_parameter", "seconds"),
        ("/debug/pprof/profile?seconds=1&pid=x", 400, "bad_parameter", "pid"),
        ("/debug/pprof/profile?seconds=1&sicne=3", 400, "unknown_parameter", "sicne"),
        ("/debug/pprof/heap", 404, "no_such_endpoint", "/debug/pprof/heap"),
    ]:
        t0 = time.monotonic()
        got, _, body = http(env.port, target)
        assert (got, says in body.decode()) == (status, True), (target, body)
        assert time.monotonic() - t0 < 1.0, f"{target}: refused only after waiting"
        expected[reason] += 1
    after = rejected(env.d)
    assert {r: after[r] - before[r] for r in expected} == expected
    status, _, body = http(env.port, "/debug/pprof/")
    assert status == 200 and b"/debug/pprof/profile?seconds=N" in body


def test_too_many_profiles_at_once(env: Env) -> None:
    d = env.d
    results: list[int] = []

    def scrape() -> None:
        results.append(http(env.port, "/debug/pprof/profile?seconds=3")[0])

    threads = [threading.Thread(target=scrape) for _ in range(MAX_CONCURRENT)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    gauge = "unwindd_pprof_profiles_in_progress"
    while metric_values(d.metrics(), gauge).get("") != MAX_CONCURRENT:
        assert time.monotonic() < deadline, "the profiles never started"
        time.sleep(0.05)
    before = rejected(d)["too_many_profiles"]
    status, _, body = http(env.port, "/debug/pprof/profile?seconds=1")
    assert status == 429, body
    assert rejected(d)["too_many_profiles"] == before + 1
    for t in threads:
        t.join(30)
    assert results == [200] * MAX_CONCURRENT
    assert http(env.port, "/debug/pprof/profile?seconds=1")[0] == 200  # the slots are free


def test_half_a_request_holds_up_no_one(env: Env) -> None:
    before = rejected(env.d)["timeout"]
    with socket.create_connection(("127.0.0.1", env.port), timeout=10) as slow:
        slow.sendall(b"GET /debug/pprof/profile?seco")
        status, _, _ = http(env.port, "/debug/pprof/profile?seconds=0.2")
        assert status == 200
        # Answered while the half-sent request still waits: [api] request_timeout (1.5 s in
        # DaemonProc's config) has not ended it yet.
        poll = select.poll()  # not select(): the full suite's fds may be past FD_SETSIZE
        poll.register(slow, select.POLLIN)
        assert poll.poll(0) == [], "the scrape waited for the slow one"
        buf = b""
        while chunk := slow.recv(4096):
            buf += chunk
    assert parse_response(buf)[0] == 408
    assert rejected(env.d)["timeout"] == before + 1


@pytest.mark.parametrize("where", ["pprof_token", "pprof_token_file"])
def test_bearer_token(tmp_path: Path, where: str) -> None:
    port = free_port()
    token = "s3cret-" + os.urandom(8).hex()
    tf = tmp_path / "token"
    tf.write_text(token + "\n")
    value = token if where == "pprof_token" else str(tf)
    d = DaemonProc(tmp_path, f'[export]\npprof_listen = "127.0.0.1:{port}"\n'
                             f'{where} = "{value}"\n')  # fmt: skip
    try:
        d.wait_message("READY=1")
        target = "/debug/pprof/profile?seconds=1"
        for hdr in ("", "Authorization: Bearer wrong\r\n", f"Authorization: Basic {token}\r\n",
                    f"Authorization: Bearer {token}x\r\n"):
            status, headers, _ = http(port, target, headers=hdr)
            assert status == 401 and headers["www-authenticate"].startswith("Bearer"), hdr
            assert http(port, "/debug/pprof/", headers=hdr)[0] == 401
        assert rejected(d)["unauthorized"] == 8
        auth = f"Authorization: Bearer {token}\r\n"
        status, _, body = http(port, target, headers=auth)
        assert status == 200, body
        check_valid(decode(body))
        # /v1/status shows the config to every socket peer: never the token itself.
        shown = d.json("/v1/status")["config"]["export"]
        assert token not in str(shown) and shown[where] == (
            "<hidden>" if where == "pprof_token" else str(tf))
        # A stop does not wait for a profile in progress: it is answered 503 at once.
        got: list[int] = []
        scrape = threading.Thread(target=lambda: got.append(http(
            port, "/debug/pprof/profile?seconds=60", headers=auth)[0]))  # fmt: skip
        scrape.start()
        deadline = time.monotonic() + 10
        while metric_values(d.metrics(), "unwindd_pprof_profiles_in_progress").get("") != 1:
            assert time.monotonic() < deadline, "the profile never started"
            time.sleep(0.05)
        t0 = time.monotonic()
        assert d.stop() == 0 and time.monotonic() - t0 < 5
        scrape.join(10)
        assert got == [503] and "Traceback" not in d.log.read_text(), d.log.read_text()
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("export, error", [
    ('pprof_listen = "6061"', "[export] pprof_listen: must look like '127.0.0.1:9464'"),
    ('pprof_token = "a"\npprof_token_file = "/etc/t"',
     "[export] pprof_token_file: set pprof_token or pprof_token_file, not both"),
    ('pprof_listen = "127.0.0.1:0"\npprof_token_file = "/nonexistent/token"',
     "[export] pprof_token_file: /nonexistent/token: No such file or directory"),
])  # fmt: skip
def test_config_errors_are_one_line(tmp_path: Path, export: str, error: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[api]\nsocket = "{tmp_path}/s.sock"\n[metrics]\nenabled = false\n'
                   f'[cache]\ndir = "off"\n[export]\n{export}\n')
    res = subprocess.run([*UNWINDD, "run", "--config", str(cfg)], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2 and error in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
