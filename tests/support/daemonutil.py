"""Harness for end-to-end daemon tests: the real ``unwindd run`` as a subprocess from a temp
config, a fake ``$NOTIFY_SOCKET`` (a datagram socket in tmp), and a raw HTTP/1.1 client over
AF_UNIX that shares no code with the daemon or unwindctl."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

UNWINDD = [sys.executable, "-m", "unwindd.cli"]
UNWINDCTL = [sys.executable, "-m", "unwindd.ctl"]


def held(argv: tuple[str, ...] | list[str]) -> subprocess.Popen[bytes]:
    """Start ``argv`` held at a shell's ``read`` (same pid after exec): a stream can subscribe to
    the pid before it runs. Other sessions may run the same workloads on this machine, so tests
    filter by pid, never by comm alone. ``release`` starts it."""
    script = 'read _ && exec "$@"'
    return subprocess.Popen(["sh", "-c", script, "sh", *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL)  # fmt: skip


def release(p: subprocess.Popen[bytes]) -> None:
    assert p.stdin is not None
    p.stdin.write(b"go\n")
    p.stdin.close()


def watch_from_exec(d: DaemonProc, argv: tuple[str, ...] | list[str], count: int, *opts: str,
                    watch_opts: tuple[str, ...] = ()) -> tuple[int, str, int]:  # fmt: skip
    """``unwindctl [opts] watch [watch_opts] --pid P --count count`` of ``argv`` run held
    (``held``) until the stream has subscribed, so its first samples are streamed: (pid,
    watch's stdout, its exit status)."""
    child = held(argv)
    watch = subprocess.Popen([*UNWINDCTL, "--socket", str(d.sock), *opts, "watch", *watch_opts,
                              "--pid", str(child.pid), "--count", str(count), "--seconds", "30"],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    d.wait_status(lambda st: st["api"]["streams"] >= 1, "a stream subscriber")
    release(child)
    out, _ = watch.communicate(timeout=40)
    child.wait(60)
    return child.pid, out, watch.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raw_http(
    sock_path: str | Path, target: str, *, data: bytes | None = None, timeout: float = 10
) -> tuple[int, dict[str, str], bytes]:
    """One request with ``Connection: close``; reads to EOF; undoes chunked coding."""
    req = data if data is not None else (
        f"GET {target} HTTP/1.1\r\nHost: unwindd\r\nConnection: close\r\n\r\n".encode()
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock_path))
        s.sendall(req)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    return parse_response(buf)


def parse_response(buf: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    return status, headers, body


def dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        n = int(size_line.split(b";")[0], 16)
        if n == 0:
            break
        out += rest[:n]
        body = rest[n + 2 :]
    return out


class DaemonProc:
    def __init__(self, tmp: Path, extra_toml: str = "", frequency: int = 499,
                 ring_pages: int | None = 256, sampling_toml: str = "",
                 request_timeout: float = 1.5, api_toml: str = "") -> None:  # fmt: skip
        self.tmp = tmp
        # Its own world-traversable directory (pytest's tmp is 0700): non-root peers connect.
        self.sock_dir = Path(tempfile.mkdtemp(prefix="unwindd-test-"))
        self.sock_dir.chmod(0o755)
        self.sock = self.sock_dir / "unwindd.sock"
        self.port = free_port()
        self.config = tmp / "config.toml"
        self.frequency = frequency
        self.ring_pages = ring_pages  # None: the daemon's default (auto sized)
        self.sampling = sampling_toml  # more [sampling] keys (target, pids)
        self.extra = extra_toml
        # short, so that the tests of what a slow or silent client meets run fast
        self.request_timeout = request_timeout
        self.api = api_toml  # more [api] keys
        self.write_config()
        self.notify_path = tmp / "notify.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.messages: list[str] = []
        self.log = tmp / "daemon.log"
        env = dict(os.environ, NOTIFY_SOCKET=str(self.notify_path), WATCHDOG_USEC="400000")
        env.pop("WATCHDOG_PID", None)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [*UNWINDD, "run", "--config", str(self.config)], stderr=log,
                stdout=subprocess.DEVNULL, env=env,
            )  # fmt: skip

    def write_config(self, extra: str | None = None, frequency: int | None = None) -> None:
        self.config.write_text(
            # Rings of 1 MiB per CPU: cold ELF loads stall a step for a while (see README).
            f'[sampling]\nfrequency = {frequency or self.frequency}\n'
            + ("" if self.ring_pages is None else f"ring_pages = {self.ring_pages}\n")
            + self.sampling +
            f'[api]\nsocket = "{self.sock}"\nmode = "0666"\n'
            f'request_timeout = {self.request_timeout}\n' + self.api +
            f'[metrics]\nlisten = "127.0.0.1:{self.port}"\n'
            f'[cache]\ndir = "{self.tmp / "cache"}"\n'
            + (self.extra if extra is None else extra)
        )

    def recv_messages(self, timeout: float) -> list[str]:
        """Datagrams received within ``timeout`` (appended to ``messages`` too)."""
        got = []
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            self.notify.settimeout(left)
            try:
                got.append(self.notify.recv(4096).decode())
            except TimeoutError:
                break
        self.messages += got
        return got

    def wait_message(self, prefix: str, timeout: float = 20) -> list[str]:
        """Messages up to and including the first starting with ``prefix``."""
        got: list[str] = []
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.notify.settimeout(max(end - time.monotonic(), 0.01))
            try:
                m = self.notify.recv(4096).decode()
            except TimeoutError:
                break
            got.append(m)
            self.messages.append(m)
            if m.startswith(prefix):
                return got
            if self.proc.poll() is not None:
                break
        raise AssertionError(f"no {prefix!r} in {got}; log:\n{self.log.read_text()}")

    def get(self, target: str) -> tuple[int, dict[str, str], bytes]:
        return raw_http(self.sock, target)

    def json(self, target: str) -> Any:
        status, _, body = self.get(target)
        assert status == 200, body
        return json.loads(body)

    def wait_status(self, ready: Callable[[dict[str, Any]], bool], what: str,
                    timeout: float = 20) -> dict[str, Any]:  # fmt: skip
        """/v1/status (never cached: the answer cache holds store queries only) once ``ready``
        holds for it. For a state the daemon reaches on its own time, such as a connection it
        has yet to close or a stream it has yet to subscribe; fails naming ``what``."""
        deadline = time.monotonic() + timeout
        while not ready(st := self.json("/v1/status")):
            assert time.monotonic() < deadline, f"never {what}: {st['api']}"
            time.sleep(0.02)
        return st

    def wait_settled(self, pid: int, timeout: float = 30) -> int:
        """Once ``pid`` (exited) has all its samples stored: the same nonzero count in two
        reads of /v1/processes 0.6 s apart (past the answer cache's 0.5 s). A fixed sleep
        raced the daemon's step under load: records are ordered two rounds late, and a step
        loading cold binaries (other sessions' new programs) holds them longer."""
        deadline = time.monotonic() + timeout
        last = -1
        while True:
            procs = {p["pid"]: p for p in self.json("/v1/processes")["processes"]}
            n = procs[pid]["samples"] if pid in procs else 0
            if n and n == last:
                return n
            assert time.monotonic() < deadline, f"pid {pid}'s samples never settled: {n}"
            last = n
            time.sleep(0.6)

    def metrics(self) -> str:
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            buf = b""
            while chunk := s.recv(65536):
                buf += chunk
        status, _, body = parse_response(buf)
        assert status == 200
        return body.decode()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            self.notify.close()
        shutil.rmtree(self.sock_dir, ignore_errors=True)
        return self.proc.returncode


def metric_values(text: str, name: str) -> dict[str, float]:
    """Samples of one metric family from the Prometheus text format: {labels: value}."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            rest = key[len(name):]
            if rest[:1] in ("", "{"):
                out[rest] = float(val)
    return out
