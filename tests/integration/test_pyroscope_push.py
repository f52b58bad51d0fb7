"""The Pyroscope push against a real daemon: a loopback HTTP server in the test receives what the
daemon sends with ``[export] pyroscope_url`` set, and every request is checked against
Pyroscope's documented ``POST /ingest`` (docs/sources/configure-server/about-server-api.md in
grafana/pyroscope; ``name`` parsed here the way its labelset.Parse reads it): method, path,
parameters, consecutive windows, tenant and auth headers, a raw (not multipart) gzipped pprof
body that decodes with the workload's frames. Then the failure paths: a closed port and 503s
before the server accepts (the same profile arrives, failures counted), and a server that never
answers (the queue bound drops the oldest, counted; sampling and the socket go on)."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import http.server
import itertools
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest
from cgrouputil import cgroup2_mount, in_cgroup, rmdir_when_empty
from daemonutil import DaemonProc, free_port, metric_values
from pprofcheck import check_valid, decode
from workloads.build import Workload, build_workloads

FREQ = 499


@dataclass
class Got:
    method: str
    path: str
    params: dict[str, str]
    headers: dict[str, str]
    body: bytes
    answered: int
    at: float


class Ingest:
    """A loopback HTTP/1.1 server recording every request; answers 503 to the first
    ``fail_first`` requests, then 200 (as Pyroscope does, with an empty body)."""

    def __init__(self, port: int = 0, fail_first: int = 0) -> None:
        self.got: list[Got] = []
        self.fail_first = fail_first
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # the method the push must use
                self._record()

            def do_GET(self) -> None:
                self._record()

            def do_PUT(self) -> None:
                self._record()

            def _record(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(n)
                u = urlsplit(self.path)
                with outer.lock:
                    status = 503 if len(outer.got) < outer.fail_first else 200
                    outer.got.append(Got(self.command, u.path, dict(parse_qsl(u.query)),
                                         {k.lower(): v for k, v in self.headers.items()},
                                         body, status, time.time()))  # fmt: skip
                text = b"busy\n" if status == 503 else b""
                self.send_response(status)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def requests(self) -> list[Got]:
        with self.lock:
            return list(self.got)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def parse_name(name: str) -> tuple[str, dict[str, str]]:
    """``APP{k=v,...}`` the way Pyroscope's labelset.Parse reads it: the app up to ``{``, then
    pairs split at ``,``, ended by ``}``, names and values trimmed."""
    app, brace, rest = name.partition("{")
    assert brace and rest.endswith("}"), name
    labels = {}
    for pair in filter(None, rest[:-1].split(",")):
        k, eq, v = pair.partition("=")
        assert eq, pair
        labels[k.strip()] = v.strip()
    return app.strip(), labels


# What the daemon adds to the static labels: each process's (procs/cgroups.py), a series each.
PROCESS_LABELS = {"unit", "cgroup", "container_id"}


def check_request(g: Got, app: str, labels: dict[str, str]) -> tuple[int, int]:
    """Every documented part of one /ingest request, ``labels`` the static ones (a request
    may add process labels); returns its (from, until)."""
    assert g.method == "POST" and g.path == "/ingest", (g.method, g.path)
    assert set(g.params) == {"name", "from", "until", "format", "sampleRate", "spyName"}, g.params
    assert g.params["format"] == "pprof" and g.params["spyName"] == "unwindd"
    assert g.params["sampleRate"] == str(FREQ)
    got_app, got_labels = parse_name(g.params["name"])
    assert got_app == app and labels.items() <= got_labels.items(), (labels, got_labels)
    assert set(got_labels) - set(labels) <= PROCESS_LABELS, got_labels
    frm, until = int(g.params["from"]), int(g.params["until"])
    assert frm < until and abs(until - g.at) < 60, (frm, until, g.at)
    # with format=pprof Pyroscope reads the body itself as the profile, never a form
    assert "multipart" not in g.headers.get("content-type", "")
    assert g.body[:2] == b"\x1f\x8b", "gzipped pprof"
    check_valid(decode(g.body))
    return frm, until


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.05)


def metric(d: DaemonProc, family: str, reason: str | None = None) -> float:
    values = metric_values(d.metrics(), family)
    return values.get(f'{{reason="{reason}"}}' if reason else "", -1.0)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Workload:
    return build_workloads(tmp_path_factory.mktemp("push-wl"))["c_o2"]


@contextlib.contextmanager
def daemon(tmp: Path, export: str) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp, f"[store]\nbucket_seconds = 1\n[export]\n{export}", frequency=FREQ)
    try:
        d.wait_message("READY=1")
        yield d
    finally:
        assert d.stop() == 0, d.log.read_text()


def test_pushes_follow_the_ingest_api(tmp_path: Path, chain: Workload) -> None:
    ingest = Ingest()
    pw = tmp_path / "password"
    pw.write_text("s3cret\n")
    export = (f'pyroscope_url = "http://127.0.0.1:{ingest.port}"\ninterval = 1\n'
              'app_name = "unwindd-test"\nlabels = { env = "ci", team = "perf" }\n'
              'tenant_id = "tenant-7"\nbasic_auth_user = "pusher"\n'
              f'basic_auth_password_file = "{pw}"\n')  # fmt: skip
    try:
        with daemon(tmp_path, export) as d:
            proc = subprocess.Popen([*chain.argv, "120"], stdout=subprocess.DEVNULL)
            assert proc.wait(120) == 0
            stored = d.wait_settled(proc.pid)

            def pid_samples() -> int:
                n = 0
                for g in ingest.requests():
                    p = decode(g.body)
                    n += sum(v[0] for _, v, lb in p.samples if lb.get("pid") == proc.pid)
                return n

            wait_for(lambda: pid_samples() >= stored * 0.9, "pushed the workload's samples")
            wait_for(lambda: len(ingest.requests()) >= 3, "pushed three windows")
            n = len(ingest.requests())  # received before the daemon counted (one in flight)
            st = d.json("/v1/status")
            text = d.metrics()
    finally:
        ingest.close()
    got = ingest.requests()
    assert len(got) >= 3
    labels = {"env": "ci", "team": "perf", "hostname": socket.gethostname()}
    windows = [check_request(g, "unwindd-test", labels) for g in got]
    for g in got:
        assert g.headers["x-scope-orgid"] == "tenant-7"
        assert g.headers["authorization"] == "Basic " + base64.b64encode(b"pusher:s3cret").decode()
    # consecutive windows: each starts where the one before ended (sampling all CPUs, the
    # daemon and this test always leave samples in every window; a window's series, one per
    # process label set, share its bounds)
    for (_, until), (frm, _) in itertools.pairwise(sorted(set(windows))):
        assert frm == until, windows
    # each sample once: the pushes hold the workload's samples the store holds, not more
    pushed = pid_samples()
    assert stored * 0.9 <= pushed <= stored, (pushed, stored)
    # its frames, in the pushed profiles: a -> b -> c -> spin (leaf first in pprof)
    chains = set()
    for g in got:
        p = decode(g.body)
        chains |= {tuple(p.stack_names(i)) for i, (_, _, lb) in enumerate(p.samples)
                   if lb.get("pid") == proc.pid}  # fmt: skip
    assert any(c[:4] == ("spin", "c", "b", "a") for c in chains), sorted(chains)[:5]
    push = st["push"]
    assert push["pushed"] >= n - 1 and push["failures"]["connect"] == 0
    assert st["config"]["export"]["basic_auth_user"] == "pusher"
    assert metric_values(text, "unwindd_push_profiles_total")[""] >= n - 1
    for r in ("queue_full", "retries_exhausted", "rejected"):
        assert metric_values(text, "unwindd_push_dropped_profiles_total")[f'{{reason="{r}"}}'] == 0


def test_retries_until_the_server_accepts(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there yet: connections are refused
    export = (f'pyroscope_url = "http://127.0.0.1:{port}"\ninterval = 1\n'
              'bearer_token = "tok-1"\n')
    with daemon(tmp_path, export) as d:
        # every reason is a series from the first scrape
        for r in ("connect", "timeout", "http_4xx", "http_5xx", "protocol"):
            assert metric(d, "unwindd_push_failures_total", r) >= 0
        # the first profile's second attempt is 0.5 s after its first, its third 1 s later:
        # 503 to that one and the next, and its fourth attempt (of five) is accepted
        wait_for(lambda: metric(d, "unwindd_push_failures_total", "connect") >= 1,
                 "counted a refused connection", timeout=30)
        ingest = Ingest(port, fail_first=2)
        try:
            wait_for(lambda: any(g.answered == 200 for g in ingest.requests()),
                     "a push accepted")
            text = d.metrics()
            st = d.json("/v1/status")
        finally:
            ingest.close()
    got = ingest.requests()
    assert [g.answered for g in got[:3]] == [503, 503, 200]
    # the refused profile is sent again, the same request, until it is accepted
    assert got[0].params == got[1].params == got[2].params and got[0].body == got[2].body
    for g in got:
        check_request(g, "unwindd", {"hostname": socket.gethostname()})
        assert g.headers["authorization"] == "Bearer tok-1" and "x-scope-orgid" not in g.headers
    fails = metric_values(text, "unwindd_push_failures_total")
    assert fails['{reason="connect"}'] >= 1 and fails['{reason="http_5xx"}'] >= 2, fails
    assert metric_values(text, "unwindd_push_profiles_total")[""] >= 1
    assert st["push"]["failures"]["http_5xx"] >= 2 and st["push"]["pushed"] >= 1
    # the log says it once per outage, and when it is over (closing the server at the end
    # may start another outage: only the first one is this test's)
    log = d.log.read_text()
    first, over, _ = log.partition("accepts profiles again")
    assert over, log
    assert first.count("push: connect") == 1 and "Connection refused" in first, log


def test_a_server_that_never_answers_costs_bounded_drops(tmp_path: Path) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel accepts connections; nobody reads or answers
    held: list[socket.socket] = []
    stop = threading.Event()

    def hold() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                held.append(silent.accept()[0])

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    port = silent.getsockname()[1]
    export = (f'pyroscope_url = "http://127.0.0.1:{port}"\ninterval = 1\ntimeout = 1.0\n'
              "max_pending = 2\n")
    try:
        with daemon(tmp_path, export) as d:
            before = d.json("/v1/status")["samples"]
            wait_for(lambda: metric(d, "unwindd_push_dropped_profiles_total", "queue_full") >= 2,
                     "dropped the oldest pending profiles")
            # (a window is a profile per process label set: the queue may fill before the
            # first attempt has timed out)
            wait_for(lambda: metric(d, "unwindd_push_failures_total", "timeout") >= 1,
                     "timed out an attempt")
            t0 = time.monotonic()
            st = d.json("/v1/status")  # the socket still answers, promptly
            assert time.monotonic() - t0 < 2
            assert st["samples"] > before  # and sampling goes on
            push = st["push"]
            assert push["pending"] <= 2 and push["pushed"] == 0
            assert push["failures"]["timeout"] >= 1 and push["dropped"]["queue_full"] >= 2
            assert "within 1 s" in push["last_error"]
            assert metric(d, "unwindd_push_pending_profiles") <= 2
            assert metric(d, "unwindd_push_failures_total", "timeout") >= 1
    finally:
        stop.set()
        t.join(5)
        for s in held:
            s.close()
        silent.close()


def test_pushes_split_by_process_labels(tmp_path: Path, chain: Workload) -> None:
    """A workload in a cgroup of its own (a transient-unit-shaped scope) is pushed as a series
    of its own: its requests name its unit and cgroup, and hold only its samples."""
    tag = secrets.token_hex(4)
    scope = cgroup2_mount() / f"unwindd-push-{tag}.scope"
    scope.mkdir()
    ingest = Ingest()
    export = f'pyroscope_url = "http://127.0.0.1:{ingest.port}"\ninterval = 1\n'
    try:
        with daemon(tmp_path, export) as d:
            pid = in_cgroup(dataclasses.replace(chain, argv=(*chain.argv, "120")), scope)
            stored = d.wait_settled(pid)

            def ours() -> list[Got]:
                return [g for g in ingest.requests()
                        if parse_name(g.params["name"])[1].get("unit") == scope.name]  # fmt: skip

            wait_for(lambda: sum(sample_count(g, pid) for g in ours()) >= stored * 0.9,
                     "pushed the scope's series")  # fmt: skip
    finally:
        ingest.close()
        rmdir_when_empty(scope)
    mine = ours()
    for g in mine:
        check_request(g, "unwindd", {"hostname": socket.gethostname()})
        labels = parse_name(g.params["name"])[1]
        assert labels["cgroup"] == "/" + scope.name, labels
        p = decode(g.body)
        assert {lb.get("pid") for _, _, lb in p.samples} == {pid}  # its samples only
    others = [g for g in ingest.requests() if g not in mine]
    assert others and all(sample_count(g, pid) == 0 for g in others)


def sample_count(g: Got, pid: int) -> int:
    return sum(v[0] for _, v, lb in decode(g.body).samples if lb.get("pid") == pid)

