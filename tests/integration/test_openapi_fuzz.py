"""The live daemon fuzzed from its own OpenAPI description (``/v1/openapi.json``) by
schemathesis, over its Unix socket, while it samples a busy loop.

Every socket operation gets valid (positive) and invalid (negative) requests, at most
``EXAMPLES`` of each; every answer must pass schemathesis's checks (no 5xx, the status code,
content type, headers and body the description gives, invalid input refused with a 4xx, valid
input accepted), arrive within ``REQUEST_TIMEOUT`` seconds, and the daemon must keep sampling
throughout (a monitor thread reads /v1/status every ``POLL`` s; the count must grow in every
``STALL`` s) and still be running and sampling afterwards.

The requests go through a requests adapter whose connections are AF_UNIX sockets (urllib3's
HTTPConnection with its ``_new_conn`` replaced), so no TCP proxy sits between.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
import urllib3
from daemonutil import DaemonProc, raw_http
from hypothesis import HealthCheck, Phase, given, settings
from requests.adapters import HTTPAdapter
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

EXAMPLES = 20  # per operation and mode: the whole fuzz stays within ~1-2 minutes on a quiet machine
REQUEST_TIMEOUT = 60.0  # bounded, with room for a shared, loaded machine (a query waits its turn)
STREAM_SECONDS = 0.3  # a stream case is ended after this (else it would never end)
POLL = 0.5
WINDOW_ORDER = b"the window must end after it starts"
STALL = 10.0


class _UnixConnection(urllib3.connection.HTTPConnection):
    def __init__(self, *args: Any, unix_path: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.unix_path = unix_path

    def _new_conn(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)  # type: ignore[arg-type]
        s.connect(self.unix_path)
        return s


class _UnixPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _UnixConnection  # type: ignore[assignment]


class UnixAdapter(HTTPAdapter):
    """Every URL this adapter is mounted for goes to the socket at ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def get_connection_with_tls_context(
        self, request: Any, verify: Any, proxies: Any = None, cert: Any = None
    ) -> urllib3.HTTPConnectionPool:
        return _UnixPool("localhost", unix_path=self.path)


def unix_session(path: Path) -> requests.Session:
    s = requests.Session()
    s.mount("http://unwindd/", UnixAdapter(str(path)))
    return s


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    tmp = tmp_path_factory.mktemp("fuzz")
    # The default request_timeout, not the test daemons' short one (made for the tests of
    # slow clients): here a request may wait its turn behind others while the busy loop and
    # the fuzzer share the CPUs. At most 2,000 stacks an answer: what the fuzz tests is the
    # API, and a whole-machine answer of a busy machine (hundreds of MB) takes a Python
    # client minutes to read under load.
    d = DaemonProc(tmp, request_timeout=10.0, api_toml="max_stacks = 2000\n")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        d.wait_message("READY=1")
        yield d
    finally:
        spin.kill()
        spin.wait()
        d.stop()


def patient_get(d: DaemonProc, target: str) -> tuple[int, dict[str, str], bytes]:
    """``d.get``, retried for a minute: a daemon just started on a busy machine is still
    parsing the running processes' binaries (on its loop) and may answer late."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return raw_http(d.sock, target, timeout=REQUEST_TIMEOUT)
        except TimeoutError:
            assert time.monotonic() < deadline, f"{target}: no answer within a minute"


class Monitor:
    """/v1/status's sample count every ``POLL`` s on a thread of its own, until stopped."""

    def __init__(self, d: DaemonProc) -> None:
        self.d = d
        self.series: list[tuple[float, int]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(POLL):
            try:
                _, _, body = raw_http(self.d.sock, "/v1/status", timeout=REQUEST_TIMEOUT)
                self.series.append((time.monotonic(), json.loads(body)["samples"]))
            except (OSError, ValueError, KeyError) as e:
                self.errors.append(repr(e))

    def stalls(self) -> list[str]:
        """Windows of ``STALL`` s in which the count did not grow."""
        out = []
        for i, (t, n) in enumerate(self.series):
            later = [m for u, m in self.series[i:] if u - t >= STALL]
            if later and later[0] <= n:
                out.append(f"no new samples in {STALL} s from {n} at +{t - self.series[0][0]:.1f}s")
        return out


def test_fuzz_the_socket_api_from_its_description(daemon: DaemonProc) -> None:
    status, headers, body = patient_get(daemon, "/v1/openapi.json")
    assert status == 200 and headers["content-type"] == "application/json"
    raw = json.loads(body)
    schema = schemathesis.openapi.from_dict(raw).include(tag="socket")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} == set(json.loads(patient_get(daemon, "/")[2])["endpoints"])
    session = unix_session(daemon.sock)
    monitor = Monitor(daemon)
    monitor.thread.start()
    seen: dict[tuple[str, str], set[int]] = {}
    t0 = time.monotonic()
    try:
        for op in ops:
            # Negative cases need something to make invalid: a parameter.
            modes = [GenerationMode.POSITIVE] + [GenerationMode.NEGATIVE] * bool(
                op.query)
            for mode in modes:
                fuzz(op, mode, session, seen.setdefault((op.path, mode.value), set()))
                assert daemon.proc.poll() is None, daemon.log.read_text()[-3000:]
    finally:
        monitor.stop.set()
        monitor.thread.join(5)
    took = time.monotonic() - t0
    print(f"fuzzed {len(ops)} operations in {took:.0f} s: "
          + ", ".join(f"{p} {m}: {sorted(s)}" for (p, m), s in seen.items()))  # fmt: skip
    # Both modes reached every operation and got real answers (not only errors) in positive.
    assert all(200 in s for (_, m), s in seen.items() if m == "positive"), seen
    assert len(monitor.series) > 10 and not monitor.errors, monitor.errors[:3]
    assert not monitor.stalls(), monitor.stalls()[:3]
    after = monitor.series[-1][1]
    # Still alive and sampling afterwards.
    deadline = time.monotonic() + 20
    while daemon.json("/v1/status")["samples"] <= after:
        assert time.monotonic() < deadline, "the daemon stopped sampling after the fuzz"
        time.sleep(0.2)
    assert daemon.proc.poll() is None
    assert "Traceback" not in daemon.log.read_text(), daemon.log.read_text()[-3000:]


def fuzz(op: Any, mode: GenerationMode, session: requests.Session, statuses: set[int]) -> None:
    """Up to ``EXAMPLES`` cases of ``op`` in ``mode``, each called and checked; the statuses
    answered are added to ``statuses``."""

    @given(case=op.as_strategy(generation_mode=mode))
    # No shrinking: a failing case is reported as found (schemathesis prints its curl), and
    # shrinking a slow one (up to REQUEST_TIMEOUT per try) could outlast CI's budget.
    # Derandomized: the same cases every run, so a run's answer is reproducible (a failure
    # is met again by the next run).
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=(Phase.explicit, Phase.generate),
              suppress_health_check=list(HealthCheck))  # fmt: skip
    def one(case: schemathesis.Case) -> None:
        if case.path == "/v1/stream":
            bound_stream(case)
        q0 = time.monotonic()
        r = case.call(base_url="http://unwindd", session=session, timeout=REQUEST_TIMEOUT)
        assert time.monotonic() - q0 < REQUEST_TIMEOUT
        # The one rule between parameters a schema cannot state: a window must end after it
        # starts (since/since_ns before until/until_ns). Valid values apart, refused together.
        crossed = r.status_code == 400 and WINDOW_ORDER in r.content
        case.validate_response(r, excluded_checks=[positive_data_acceptance] if crossed else None)
        statuses.add(r.status_code)

    one()


def bound_stream(case: schemathesis.Case) -> None:
    """A stream runs until its ``seconds`` or ``limit``: keep each case's short (a wrong value
    stays wrong, so negative cases still test the refusal). A list (a negative case's) is sent
    as the parameter repeated: each of its values bounded alike, none sent as none at all."""
    q = case.query if isinstance(case.query, dict) else {}
    s = q.get("seconds")
    q["seconds"] = [_bounded(v) for v in s] or STREAM_SECONDS if isinstance(s, list) else (
        _bounded(s))  # fmt: skip
    case.query = q


def _bounded(s: object) -> object:
    if isinstance(s, (int, float)) and not isinstance(s, bool) and s >= 0:
        return min(s, STREAM_SECONDS)
    if s is None or s == "":  # empty is absent: a stream without end
        return STREAM_SECONDS
    return s
