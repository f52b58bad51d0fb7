"""A JSON stacks answer written as it is rendered (connections.write_chunked) over a real Unix
socket: ``Connections.serve`` on a loop of its own (asyncio's and uvloop's, the daemon's),
chunks rendered on a worker thread from a store snapshot as the service does, read by
``http.client``, curl and a raw HTTP/1.0 client; and the clients that must not break it: one
that stops reading, one that goes mid-answer, a rendering that fails."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import uvloop
from daemonutil import parse_response
from unwindd.serve.api import Api, Peer
from unwindd.serve.config import ApiSection
from unwindd.serve.connections import Connections
from unwindd.serve.httpapi import ChunkedResponse, Request, Response, StreamStart
from unwindd.store.stackstore import StackStore
from unwindd.unwind.stackfmt import Frame

SEC = 1_000_000_000
CHUNK = 4096
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


class Source:
    def __init__(self, store: Any) -> None:
        self.store = store
        self.period_ns = 1_000_000
        self.max_stacks = 100_000

    def status(self) -> dict[str, Any]:
        return {}

    def now_ns(self) -> int:
        return 10 * SEC

    def uid_of(self, pid: int) -> int | None:
        return 0

    def exe_of(self, pid: int) -> str | None:
        return None


def big_store() -> StackStore:
    """3,000 stacks of 20 frames: a JSON answer of ~5 MB, past any socket buffer."""
    frames = [Frame(0x400000 + 64 * i, "/usr/bin/app", f"function_{i}", 8, rel=64 * i,
                    file="/src/app.c", line=i) for i in range(400)]  # fmt: skip
    store = StackStore(bucket_ns=SEC)
    store.add_counts([(SEC, 1000 + i, 1000 + i, "app",
                       tuple(frames[(i * 7 + k) % 400] for k in range(20)), 1 + i % 13)
                      for i in range(3000)])  # fmt: skip
    return store


class Counted:
    """A ChunkedResponse's chunks, counted as they are rendered; failing at ``fail_at``."""

    def __init__(self, chunks: Iterator[bytes], fail_at: int | None = None) -> None:
        self.chunks = chunks
        self.pulled = 0
        self.fail_at = fail_at

    def __iter__(self) -> Counted:
        return self

    def __next__(self) -> bytes:
        if self.pulled == self.fail_at:
            raise RuntimeError("rendering failed")
        c = next(self.chunks)
        self.pulled += 1
        return c


class Server:
    """``Connections.serve`` on a Unix socket, on a loop in a thread of its own; every request
    answered by a JSON stacks answer from a snapshot of ``store``, its chunks rendered on a
    worker thread (the service's shape: service._api_request_off_loop)."""

    def __init__(self, path: Path, store: StackStore, loop_factory: Callable[[], Any],
                 timeout: float = 10.0, fail_at: int | None = None) -> None:  # fmt: skip
        self.path = path
        self.store = store
        self.fail_at = fail_at
        self.answers: list[Counted] = []
        self.pool = ThreadPoolExecutor(1)
        self.loop: asyncio.AbstractEventLoop = loop_factory()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(timeout,), daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self, timeout: float) -> None:
        asyncio.set_event_loop(self.loop)
        self.stop = asyncio.Event()

        async def never(*_: Any) -> None:
            raise AssertionError("no stream here")

        self.conns = Connections(lambda: ApiSection(request_timeout=timeout), self.stop, never)
        srv = self.loop.run_until_complete(asyncio.start_unix_server(
            lambda r, w: self.conns.serve(r, w, self.answer, Peer(0)), path=str(self.path)))
        self.ready.set()
        self.loop.run_until_complete(self.stop.wait())
        srv.close()
        self.loop.run_until_complete(srv.wait_closed())

    async def answer(self, req: Request, peer: Peer) -> Response | ChunkedResponse | StreamStart:
        snap = self.store.snapshot()
        res = Api(Source(snap), chunk_bytes=CHUNK, clock_offset=lambda: 0).handle(req, peer)
        assert isinstance(res, ChunkedResponse)
        counted = Counted(res.chunks, self.fail_at)
        self.answers.append(counted)
        return replace(res, chunks=counted, render_on=self.pool.submit, release=snap.close)

    def wait_idle(self) -> None:
        """Until every connection has ended and every answer let go of its snapshot."""
        deadline = time.monotonic() + 30
        while self.conns.open or self.store.snapshots:
            assert time.monotonic() < deadline, (self.conns.open, self.store.snapshots)
            time.sleep(0.01)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)
        self.pool.shutdown()


@contextlib.contextmanager
def serving(tmp: Path, loop: str, **kw: Any) -> Iterator[Server]:
    srv = Server(tmp / "s.sock", big_store(), LOOPS[loop], **kw)
    try:
        yield srv
    finally:
        srv.close()


def whole(store: StackStore) -> bytes:
    """The answer rendered whole (one chunk: a Response)."""
    res = Api(Source(store), chunk_bytes=1 << 40, clock_offset=lambda: 0).handle(
        Request("GET", "/v1/stacks", "/v1/stacks", {}), Peer(0))
    assert isinstance(res, Response)
    return res.body


class UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=30)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(self.path))


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_clients_read_the_whole_answer(loop: str, tmp_path: Path) -> None:
    """http.client (two requests on one connection), curl and HTTP/1.0 each read the bytes of
    the whole answer, written in chunks; every snapshot is let go."""
    with serving(tmp_path, loop) as server:
        _read_whole(server)


def _read_whole(server: Server) -> None:
    want = whole(server.store)
    assert len(want) > 1 << 22
    c = UnixHTTP(server.path)
    for _ in range(2):  # keep-alive: the second request on the same connection
        c.request("GET", "/v1/stacks")
        r = c.getresponse()
        assert r.status == 200 and r.getheader("transfer-encoding") == "chunked"
        assert r.getheader("content-length") is None and r.read() == want
    c.close()
    got = subprocess.run(["curl", "-sS", "--unix-socket", str(server.path), "-D", "-",
                          "http://x/v1/stacks"], capture_output=True, check=True,
                         timeout=60).stdout  # fmt: skip
    head, _, body = got.partition(b"\r\n\r\n")  # (curl undid the chunked coding)
    assert head.startswith(b"HTTP/1.1 200") and b"\r\nTransfer-Encoding: chunked" in head
    assert body == want
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(server.path))
        s.sendall(b"GET /v1/stacks HTTP/1.0\r\n\r\n")
        buf = bytearray()
        while chunk := s.recv(1 << 16):
            buf += chunk
    status, headers, body = parse_response(bytes(buf))
    assert status == 200 and headers["connection"] == "close" and body == want
    assert "transfer-encoding" not in headers and "content-length" not in headers
    server.wait_idle()
    assert len(server.answers) == 4
    assert all(a.pulled >= len(want) // (2 * CHUNK) for a in server.answers)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_reader_that_stops_reading_holds_a_few_chunks_and_is_dropped(loop: str,
                                                                       tmp_path: Path) -> None:
    """A client that asks and never reads: its answer renders only what the socket and the
    transport's buffer take (a few chunks, not the answer), and once its waits pass
    request_timeout the connection goes and the snapshot is let go. Others are answered
    meanwhile."""
    with serving(tmp_path, loop, timeout=1.0) as server:
        _stall(server)


def _stall(server: Server) -> None:
    want = whole(server.store)
    total = -(-len(want) // CHUNK)
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(str(server.path))
    stalled.sendall(b"GET /v1/stacks HTTP/1.1\r\nHost: x\r\n\r\n")
    c = UnixHTTP(server.path)  # served while the first waits
    c.request("GET", "/v1/stacks")
    assert c.getresponse().read() == want
    c.close()
    server.wait_idle()  # the stalled connection timed out (request_timeout: 1 s)
    assert server.conns.rejected["answer_not_taken"] == 1  # counted
    assert server.answers[0].pulled < total // 4, (server.answers[0].pulled, total)
    stalled.settimeout(30)
    got = bytearray()
    with contextlib.suppress(ConnectionResetError):
        while chunk := stalled.recv(1 << 16):
            got += chunk
    stalled.close()
    assert 0 < len(got) < len(want)  # cut short: the answer was not written whole


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_slow_steady_reader_gets_the_whole_answer(loop: str, tmp_path: Path) -> None:
    """A client that keeps reading, slowly (64 KiB then a 20 ms pause: a few MiB/s, well above
    MIN_READ_RATE), waits far longer in all than request_timeout (0.2 s here) for a ~5 MB
    answer: it still gets the whole answer, only a stalled one is dropped."""
    with serving(tmp_path, loop, timeout=0.2) as server:
        want = whole(server.store)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        s.connect(str(server.path))
        s.sendall(b"GET /v1/stacks HTTP/1.0\r\n\r\n")  # (its body ends with the connection)
        s.settimeout(30)
        got = bytearray()
        t0 = time.monotonic()
        while chunk := s.recv(1 << 16):
            got += chunk
            time.sleep(0.02)
        s.close()
        assert time.monotonic() - t0 > 5 * 0.2  # (else this reader was not slow at all)
        assert parse_response(bytes(got))[2] == want
        server.wait_idle()


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_reader_that_goes_mid_answer(loop: str, tmp_path: Path,
                                       caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """A client that reads a little and closes: the answer stops, its snapshot is let go,
    nothing is logged as an error, and the next client is answered."""
    with serving(tmp_path, loop) as server:
        _go_mid_answer(server)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def _go_mid_answer(server: Server) -> None:
    want = whole(server.store)
    for _ in range(3):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(server.path))
        s.sendall(b"GET /v1/stacks HTTP/1.1\r\nHost: x\r\n\r\n")
        s.recv(20000)
        s.close()
    server.wait_idle()
    assert all(a.pulled < -(-len(want) // CHUNK) for a in server.answers)
    c = UnixHTTP(server.path)
    c.request("GET", "/v1/stacks")
    assert c.getresponse().read() == want
    c.close()
    server.wait_idle()


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_rendering_error_cuts_the_body(loop: str, tmp_path: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """A chunk whose rendering fails: logged, and the connection is aborted, so the client
    sees a chunked body without its end (not a shorter answer); the snapshot is let go."""
    with serving(tmp_path, loop, fail_at=3) as srv:
        c = UnixHTTP(srv.path)
        c.request("GET", "/v1/stacks")
        r = c.getresponse()
        assert r.status == 200
        with pytest.raises(http.client.IncompleteRead):
            r.read()
        c.close()
        srv.wait_idle()
        assert srv.answers[0].pulled == 3
        assert any("rendering an answer" in r.getMessage() for r in caplog.records)


class ClosingWriter:
    """A StreamWriter whose transport closes while a chunk is rendered (the client went: the
    loop saw the socket fail meanwhile); a write to it then raises, as uvloop's does."""

    def __init__(self) -> None:
        self.closed = False
        self.written: list[bytes] = []
        self.transport = self

    def is_closing(self) -> bool:
        return self.closed

    def write(self, data: bytes) -> None:
        self.writelines([data])

    def writelines(self, parts: list[bytes]) -> None:
        if self.closed:
            raise RuntimeError("unable to perform operation: the handler is closed")
        self.written += parts

    async def drain(self) -> None:
        pass

    def abort(self) -> None:
        self.closed = True


def test_nothing_is_written_once_the_transport_closes() -> None:
    """The transport closes while the second chunk is rendered: the answer ends quietly (no
    write, no exception), released."""
    from unwindd.serve.connections import write_chunked
    from unwindd.serve.httpapi import HttpSession

    w = ClosingWriter()
    released: list[bool] = []

    def chunks() -> Iterator[bytes]:
        yield b"[1,"
        w.closed = True
        yield b"2]"

    session = HttpSession()
    session.receive(b"GET /v1/stacks HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(session.next_request(), Request)
    res = ChunkedResponse(chunks(), release=lambda: released.append(True))
    done = asyncio.run(write_chunked(session, w, res, 1.0))  # type: ignore[arg-type]
    assert done is False and released == [True]
    assert b"".join(w.written).endswith(b"\r\n3\r\n[1,\r\n")
