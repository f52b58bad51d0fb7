"""The HTTP session and the query API, sans-IO: bytes in, response bytes out, on a store filled
with synthetic samples. Includes "parse or answer cleanly" fuzzing, whole and byte by byte."""

from __future__ import annotations

import json
from typing import Any

from daemonutil import parse_response
from hypothesis import given, settings
from hypothesis import strategies as st
from pprofcheck import check_valid, decode
from unwindd.serve.api import Api, Peer
from unwindd.serve.httpapi import (
    CLOSED,
    NEED_DATA,
    ChunkedResponse,
    HttpSession,
    Request,
    Response,
    StreamStart,
)
from unwindd.serve.openapi import spec_bytes
from unwindd.store.stackstore import StackStore
from unwindd.unwind.stackfmt import Frame, UnwoundSample

SEC = 1_000_000_000


def frame(sym: str, kernel: bool = False) -> Frame:
    return Frame(hash(sym) & 0xFFFFFF, "[k]" if kernel else "/w/app", sym, 0, kernel=kernel)


CHAIN = tuple(frame(s) for s in ("spin", "c", "b", "a", "main"))


class FakeSource:
    def __init__(self) -> None:
        self.store = StackStore(bucket_ns=SEC)
        self.period_ns = 10_000_000
        self.max_stacks = 100
        self.now = 100 * SEC
        self.uids = {10: 1000, 20: 0}

    def status(self) -> dict[str, Any]:
        return {"samples": self.store.stats.samples}

    def now_ns(self) -> int:
        return self.now

    def uid_of(self, pid: int) -> int | None:
        return self.uids.get(pid)

    def exe_of(self, pid: int) -> str | None:
        return f"/bin/p{pid}"


def sample(
    pid: int, t: float, frames: tuple[Frame, ...] = CHAIN, comm: str = "app"
) -> UnwoundSample:
    return UnwoundSample(int(t * SEC), pid, pid, 0, comm, 1, "ok", frames)


def api_with_data() -> tuple[Api, FakeSource]:
    src = FakeSource()
    src.store.add([sample(10, 50.5)] * 3 + [sample(10, 95.5, CHAIN[1:])] +
                  [sample(20, 96.5, (frame("idle"),), comm="root")] * 2)
    return Api(src, describe=spec_bytes), src


ROOT = Peer(0)


def get(target: str, peer: Peer = ROOT) -> tuple[int, dict[str, str], bytes]:
    api, _ = api_with_data()
    s = HttpSession()
    s.receive(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    req = s.next_request()
    assert isinstance(req, Request)
    res = api.handle(req, peer)
    assert isinstance(res, Response)
    return parse_response(s.respond(res))


def test_status_and_index() -> None:
    status, headers, body = get("/v1/status")
    assert status == 200 and headers["content-type"] == "application/json"
    assert json.loads(body) == {"samples": 6}
    assert "/v1/stream" in json.loads(get("/")[2])["endpoints"]


def test_stacks_filters_and_formats() -> None:
    out = json.loads(get("/v1/stacks?pid=10")[2])
    assert out["samples"] == 4 and not out["truncated"]
    assert [f["sym"] for f in out["stacks"][0]["frames"]] == ["spin", "c", "b", "a", "main"]
    assert json.loads(get("/v1/stacks?since=10")[2])["samples"] == 3  # buckets >= t=90 s
    assert json.loads(get("/v1/stacks?comm=root")[2])["samples"] == 2
    assert json.loads(get("/v1/stacks?pid=10,20")[2])["samples"] == 6
    assert json.loads(get("/v1/stacks?pid=10&pid=20&tid=20")[2])["samples"] == 2
    assert json.loads(get("/v1/stacks?limit=1")[2])["truncated"] is True
    _, h, body = get("/v1/stacks?format=folded&pid=10")
    assert h["content-type"].startswith("text/plain")
    assert body.decode().splitlines() == ["app;main;a;b;c 1", "app;main;a;b;c;spin 3"]
    _st, h, body = get("/v1/stacks?format=pprof")
    p = decode(body)
    check_valid(p)
    assert sum(v[0] for _, v, _ in p.samples) == 6


def test_top() -> None:
    out = json.loads(get("/v1/top?pid=10")[2])
    assert out["samples"] == 4
    assert out["functions"][0] == {"sym": "spin", "dso": "/w/app", "self": 3, "total": 3}
    assert {f["sym"]: f["total"] for f in out["functions"]}["main"] == 4


def test_processes_and_visibility() -> None:
    procs = json.loads(get("/v1/processes")[2])["processes"]
    assert [(p["pid"], p["samples"], p["exe"]) for p in procs] == [(10, 4, "/bin/p10"),
                                                                   (20, 2, "/bin/p20")]
    # uid 1000 owns pid 10 only; an unknown peer (no SO_PEERCRED) sees nothing per process.
    assert [p["pid"] for p in json.loads(get("/v1/processes", Peer(1000))[2])["processes"]] == [10]
    assert json.loads(get("/v1/stacks", Peer(1000))[2])["samples"] == 4
    assert json.loads(get("/v1/stacks?pid=20", Peer(1000))[2])["samples"] == 0
    assert json.loads(get("/v1/top", Peer(None))[2])["samples"] == 0
    assert json.loads(get("/v1/processes", Peer(4242))[2])["processes"] == []


def test_stream_filter_respects_visibility() -> None:
    api, _ = api_with_data()
    req = Request("GET", "/v1/stream?comm=app&limit=5", "/v1/stream", {"comm": ["app"],
                                                                       "limit": ["5"]})
    res = api.handle(req, Peer(1000))
    assert isinstance(res, StreamStart) and res.params["limit"] == 5
    accept = res.params["accept"]
    assert accept(sample(10, 1)) and not accept(sample(20, 1))
    assert not accept(sample(10, 1, comm="x"))
    res = api.handle(Request("GET", "/v1/stream", "/v1/stream", {}), Peer(0))
    assert isinstance(res, StreamStart) and res.params["accept"](sample(20, 1))


def test_errors() -> None:
    assert get("/nope")[0] == 404
    for bad in ("/v1/stacks?pid=x", "/v1/stacks?since=-1", "/v1/stacks?since=nan",
                "/v1/stacks?format=svg", "/v1/top?limit=0", "/v1/stacks?tid=1.5"):
        status, _, body = get(bad)
        assert status == 400 and json.loads(body)["error"], bad
    api, _ = api_with_data()
    res = api.handle(Request("POST", "/v1/status", "/v1/status", {}), Peer(0))
    assert isinstance(res, Response) and res.status == 405


def test_keep_alive_and_pipelining() -> None:
    s = HttpSession()
    s.receive(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
    first = s.next_request()
    assert isinstance(first, Request) and first.path == "/a"
    s.respond(Response(200, b"{}"))
    assert s.keep_alive
    second = s.next_request()
    assert isinstance(second, Request) and second.path == "/b"
    s.respond(Response(200, b"{}"))
    assert s.keep_alive and s.next_request() is NEED_DATA
    s.receive(b"")
    assert s.next_request() is CLOSED


def test_stream_is_chunked() -> None:
    s = HttpSession()
    s.receive(b"GET /v1/stream HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(s.next_request(), Request)
    wire = s.start_stream("application/x-ndjson") + s.stream_data(b'{"a":1}\n') + s.end_stream()
    _status, headers, body = parse_response(wire)
    assert headers["transfer-encoding"] == "chunked" and body == b'{"a":1}\n'


def _wire_of_chunked(version: str) -> tuple[HttpSession, bytes, bytes, int]:
    """(the session, the bytes written, the whole body, the chunks) of a JSON stacks answer
    in chunks of 64 bytes, written to an HTTP/``version`` client as connections.write_chunked
    writes it."""
    src = FakeSource()
    src.store.add([sample(10, 50.5)] * 3 + [sample(10, 95.5, CHAIN[1:])] +
                  [sample(20, 96.5, (frame("idle"),), comm="root")] * 2)
    s = HttpSession()
    s.receive(f"GET /v1/stacks HTTP/{version}\r\nHost: x\r\n\r\n".encode())
    req = s.next_request()
    assert isinstance(req, Request)
    whole = Api(src, chunk_bytes=1 << 30, clock_offset=lambda: 0).handle(req, ROOT)
    res = Api(src, chunk_bytes=64, clock_offset=lambda: 0).handle(req, ROOT)
    assert isinstance(whole, Response) and isinstance(res, ChunkedResponse)
    wire = [s.start_stream(res.content_type, res.headers)]
    n = 0
    for c in res.chunks:
        wire += s.stream_parts(c)
        n += 1
    wire.append(s.end_answer())
    res.close()
    return s, b"".join(wire), whole.body, n


def test_chunked_answer_framing() -> None:
    """A ChunkedResponse as h11 frames it: chunked for HTTP/1.1 (the connection then serves
    the next request), delimited by the close for HTTP/1.0; the same body as the whole
    answer. Parsed by h11 as a client."""
    import h11

    for version in ("1.1", "1.0"):
        s, wire, whole, chunks = _wire_of_chunked(version)
        assert chunks > 2
        client = h11.Connection(h11.CLIENT)  # (h11 sends 1.1 only: it reads either answer)
        client.send(h11.Request(method="GET", target="/v1/stacks", headers=[("Host", "x")]))
        client.send(h11.EndOfMessage())
        client.receive_data(wire)
        if version == "1.0":
            client.receive_data(b"")  # the daemon closes: the end of the body
        head = client.next_event()
        assert isinstance(head, h11.Response) and head.status_code == 200
        headers = dict(head.headers)
        assert b"content-length" not in headers
        body = b""
        while isinstance(ev := client.next_event(), h11.Data):
            body += ev.data
        assert isinstance(ev, h11.EndOfMessage) and body == whole
        if version == "1.1":
            assert headers[b"transfer-encoding"] == b"chunked"
            assert s.keep_alive
        else:
            assert b"transfer-encoding" not in headers and headers[b"connection"] == b"close"
            assert not s.keep_alive


def error_of(data: bytes, **limits: int) -> int:
    s = HttpSession(**limits)
    s.receive(data)
    item = s.next_request()
    assert isinstance(item, Response), item
    assert s.must_close
    return parse_response(s.respond(item))[0]


def test_limits_and_garbage() -> None:
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000
    assert error_of(head, max_header_bytes=16384) == 431
    assert error_of(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 99999\r\n\r\n") == 413
    chunked = b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert error_of(chunked + b"2000\r\n" + b"x" * 0x2000 + b"\r\n", max_body_bytes=100) == 413
    assert error_of(b"\x00\x01garbage\r\n\r\n") == 400
    assert error_of(b"GET / HTTP/1.1\r\n\r\n") == 400  # HTTP/1.1 requires Host
    q = "&".join(f"k{i}=1" for i in range(100))
    assert error_of(f"GET /?{q} HTTP/1.1\r\nHost: x\r\n\r\n".encode()) == 400
    # A timeout answer works whatever state the session is in.
    s = HttpSession()
    s.receive(b"GET / HTT")
    assert s.next_request() is NEED_DATA
    assert parse_response(s.error(408, "slow"))[0] == 408


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 17))
def test_fuzz_any_bytes_get_a_request_or_a_clean_error(data: bytes, step: int) -> None:
    api, _ = api_with_data()
    for chunks in ([data], [data[i : i + step] for i in range(0, len(data), step)]):
        s = HttpSession(max_header_bytes=256, max_body_bytes=64)
        for c in chunks:
            s.receive(c)
        s.receive(b"")
        for _ in range(10):
            item = s.next_request()
            if item is NEED_DATA or item is CLOSED:
                break
            if isinstance(item, Response):
                status = parse_response(s.respond(item))[0]
                assert 400 <= status < 500
                break
            assert isinstance(item, Request)
            res = api.handle(item, Peer(0))
            if isinstance(res, Response):
                assert parse_response(s.respond(res))[0] in (200, 400, 404, 405)
            if not s.keep_alive:
                break
