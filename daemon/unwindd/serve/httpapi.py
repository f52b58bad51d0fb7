"""HTTP/1.1 for the query socket, sans-IO: bytes in -> requests; responses -> bytes out.

Built on h11 (which itself does no I/O); this module adds the daemon's limits and turns every
client mistake into a response instead of an exception.

Invariants:
- No sockets, no clocks: the shell feeds received bytes (``b""`` at EOF), asks for the next
  request, and writes whatever bytes the session returns. Time limits are the shell's (it
  calls ``error(408)`` when a request is too slow).
- Bounded memory per connection: an incomplete request head may not exceed
  ``max_header_bytes`` (h11's ``max_incomplete_event_size``; 431 when exceeded) and a body may
  not exceed ``max_body_bytes`` (413). Nothing is buffered past those bounds.
- Garbage gets a 400 with a JSON ``{"error": ...}`` body and the connection is closed; a
  well-formed request gets exactly one response (plain, a ``ChunkedResponse`` written as it is
  rendered, or the live stream), after which the session accepts the next request on the same
  connection (keep-alive) unless either side asked to close. Every response carries its
  status's standard reason phrase.
- A body without a content-length (the live stream, a ``ChunkedResponse``) is framed by h11:
  chunked transfer coding for an HTTP/1.1 client, delimited by closing the connection for an
  HTTP/1.0 one (RFC 9112 6.3, which has no chunked coding).
- Cost: O(bytes received + bytes sent); a chunk is passed to the writer as it is (its framing
  beside it, not copied into one buffer with it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from http import HTTPStatus
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

import h11

from .. import __version__
from ..lightdc import dataclass, field

SERVER = f"unwindd/{__version__}".encode()

# The statuses a malformed request is answered with (h11's ``error_status_hint`` is kept when it
# is one of them, else 400).
SESSION_ERRORS: Final = (400, 413, 431)

# The stream-client limit is the shell's (service.py), not the API's: its reason named once.
TOO_MANY_STREAMS: Final = "too_many_streams"

# Every reason a refusal is counted under (``Connections.rejected``, the unwindd_api_rejected
# metric, which exports each at 0 from the start): the session's ``http_<status>``, the
# connection limits, and what the API refuses (``Response.rejected``).
REJECTIONS: Final = (
    *(f"http_{s}" for s in SESSION_ERRORS),
    "timeout",  # a request not received within [api] request_timeout (408)
    "answer_not_taken",  # an answer the client did not read in time: the connection dropped
    "too_many_connections",  # [api] max_connections (503)
    TOO_MANY_STREAMS,  # [api] max_stream_clients (429)
    "unknown_parameter",  # a query parameter the endpoint does not take (400)
    "bad_parameter",  # a parameter's value is wrong (400)
    "no_such_endpoint",  # 404
    "method_not_allowed",  # 405
)


def reason_phrase(status: int) -> bytes:
    """RFC 9110's reason phrase of ``status`` (every response carries one)."""
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    target: str
    path: str
    query: dict[str, list[str]]
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    def arg(self, name: str) -> str | None:
        v = self.query.get(name)
        return v[-1] if v else None

    def args(self, name: str) -> list[str]:
        """All values of a repeatable parameter; ``pid=1,2&pid=3`` -> ["1", "2", "3"]."""
        return [p for v in self.query.get(name, ()) for p in v.split(",") if p]


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()
    rejected: str | None = None  # a refusal: the ``REJECTIONS`` reason it is counted under


@dataclass(frozen=True, slots=True)
class StreamStart:
    """A chunked response whose body the shell produces over time (the live stream)."""

    content_type: str = "application/x-ndjson"
    params: dict[str, Any] = field(default_factory=dict)
    headers: tuple[tuple[str, str], ...] = ()


# Where a ``ChunkedResponse``'s next chunk is rendered: ``submit(fn)`` runs ``fn`` (the
# service's query thread: ``ThreadPoolExecutor.submit``) and returns its future.
Submit = Callable[[Callable[[], bytes | None]], "Future[bytes | None]"]


@dataclass(frozen=True, slots=True)
class ChunkedResponse:
    """A 200 answer too big to hold whole (a JSON ``/v1/stacks`` past one chunk): its body is
    ``chunks``, in order, each pulled only once the previous one is written (back-pressure: a
    slow reader holds a chunk or two, not the answer). Framed without a content-length.
    ``render_on`` says where a chunk is rendered (None: in the caller); ``release`` lets go of
    what the chunks read (the query's store snapshot). ``close`` must be called once the
    answer is written or abandoned, and not while a chunk is being rendered."""

    chunks: Iterator[bytes]
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()
    render_on: Submit | None = None
    release: Callable[[], None] | None = None

    def close(self) -> None:
        close = getattr(self.chunks, "close", None)
        try:
            if close is not None:
                close()
        finally:
            if self.release is not None:
                self.release()


def json_response(obj: object, status: int = 200) -> Response:
    return Response(status, json.dumps(obj, separators=(",", ":")).encode() + b"\n")


# The head of a 405 (RFC 9110 15.5.6: it lists the methods the target supports).
ALLOW_GET: Final = (("allow", "GET"),)


def error_response(status: int, message: str, rejected: str | None = None,
                   headers: tuple[tuple[str, str], ...] = ()) -> Response:  # fmt: skip
    """Every error's body: ``{"error": message, "status": status}`` (openapi.py's Error)."""
    body = json.dumps({"error": message, "status": status}, separators=(",", ":")).encode()
    return Response(status, body + b"\n", headers=headers, rejected=rejected)


class NeedData:
    """More bytes are needed before the next request is complete."""


class Closed:
    """The peer closed the connection cleanly (between requests)."""


NEED_DATA: Final = NeedData()
CLOSED: Final = Closed()


class HttpSession:
    """One server-side connection."""

    def __init__(self, *, max_header_bytes: int = 16384, max_body_bytes: int = 4096) -> None:
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.max_body_bytes = max_body_bytes
        self._head: h11.Request | None = None
        self._body = bytearray()
        self.requests = 0
        self.must_close = False

    def receive(self, data: bytes) -> None:
        """Feed bytes from the socket; ``b""`` means the peer sent EOF."""
        try:
            self.conn.receive_data(data)
        except RuntimeError:
            # Data after we decided to close (e.g. after an error): ignore it.
            pass

    def next_request(self) -> Request | Response | NeedData | Closed:
        """A complete request; or an error ``Response`` to send before closing; or
        ``NEED_DATA``/``CLOSED``."""
        while True:
            try:
                ev = self.conn.next_event()
            except h11.RemoteProtocolError as e:
                status = e.error_status_hint if e.error_status_hint in SESSION_ERRORS else 400
                msg = str(e) or "malformed request"
                if status == 431:
                    msg = "request head too large"
                return self._fail(status, msg)
            if ev is h11.NEED_DATA:
                return NEED_DATA
            if isinstance(ev, h11.ConnectionClosed):
                return CLOSED
            if ev is h11.PAUSED:
                # Our response to the previous request is not finished yet.
                return NEED_DATA
            if isinstance(ev, h11.Request):
                self._head = ev
                self._body.clear()
                declared = dict(ev.headers).get(b"content-length")
                if declared is not None and int(declared) > self.max_body_bytes:
                    return self._fail(413, f"body larger than {self.max_body_bytes} bytes")
            elif isinstance(ev, h11.Data):
                self._body += ev.data
                if len(self._body) > self.max_body_bytes:
                    return self._fail(413, f"body larger than {self.max_body_bytes} bytes")
            elif isinstance(ev, h11.EndOfMessage):
                head = self._head
                assert head is not None
                self._head = None
                self.requests += 1
                try:
                    return _to_request(head, bytes(self._body))
                except ValueError as e:
                    return self._fail(400, f"bad query string: {e}")

    def _fail(self, status: int, message: str) -> Response:
        self.must_close = True
        return error_response(status, message)

    def error(self, status: int, message: str) -> bytes:
        """Bytes of an error response sent outside the normal flow (timeouts, overload);
        the connection must be closed after them."""
        return self.respond(self._fail(status, message))

    def respond(self, resp: Response) -> bytes:
        """Bytes for a complete response. After it, ``keep_alive`` says whether to read on."""
        return b"".join(self.respond_parts(resp))

    def respond_parts(self, resp: Response) -> list[bytes]:
        """``respond`` as the pieces to write in turn: the head, the body object itself (h11
        passes a content-length body through as it is), the end. An answer of many MiB is
        not copied once more into one buffer with its head."""
        headers = self._headers(resp.content_type, resp.headers)
        headers.append((b"content-length", str(len(resp.body)).encode()))
        try:
            head = h11.Response(
                status_code=resp.status, headers=headers, reason=reason_phrase(resp.status)
            )
            return [
                self.conn.send(head) or b"",
                self.conn.send(h11.Data(data=resp.body)) or b"",
                self.conn.send(h11.EndOfMessage()) or b"",
            ]
        except h11.LocalProtocolError:
            # h11 refuses to answer in its current state (e.g. the request line itself was
            # unparseable): write the minimal response by hand.
            self.must_close = True
            return [_raw_response(resp)]

    def start_stream(self, content_type: str,
                     extra: tuple[tuple[str, str], ...] = ()) -> bytes:  # fmt: skip
        headers = self._headers(content_type, extra)
        # No content-length: h11 frames the body with chunked transfer coding (HTTP/1.1) or
        # delimits it by closing (HTTP/1.0).
        return self.conn.send(h11.Response(status_code=200, headers=headers,
                                           reason=reason_phrase(200))) or b""  # fmt: skip

    def stream_data(self, data: bytes) -> bytes:
        return self.conn.send(h11.Data(data=data)) or b"" if data else b""

    def stream_parts(self, data: bytes) -> list[bytes]:
        """``stream_data`` as the pieces to write in turn: the chunk's size line, the chunk
        object itself, its CRLF (HTTP/1.0: the chunk alone), so a big chunk is not copied."""
        if not data:
            return []
        return self.conn.send_with_data_passthrough(h11.Data(data=data)) or []

    def end_stream(self) -> bytes:
        self.must_close = True
        return self.end_answer()

    def end_answer(self) -> bytes:
        """The end of a body without a content-length: the last chunk (HTTP/1.1; the
        connection may then serve the next request, ``keep_alive``), or nothing (HTTP/1.0:
        the close ends it)."""
        try:
            return self.conn.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError:
            self.must_close = True
            return b""

    @property
    def keep_alive(self) -> bool:
        """After a complete response: start the next request cycle if both sides allow it."""
        if self.must_close or self.conn.our_state is not h11.DONE:
            return False
        if self.conn.their_state is not h11.DONE:
            return False
        try:
            self.conn.start_next_cycle()
        except h11.LocalProtocolError:
            return False
        return True

    def _headers(
        self, content_type: str, extra: tuple[tuple[str, str], ...]
    ) -> list[tuple[bytes, bytes]]:
        h = [(b"server", SERVER), (b"content-type", content_type.encode())]
        h += [(k.encode(), v.encode()) for k, v in extra]
        if self.must_close:
            h.append((b"connection", b"close"))
        return h


def _to_request(head: h11.Request, body: bytes) -> Request:
    target = head.target.decode("latin-1")
    parts = urlsplit(target)
    # max_num_fields bounds the work a hostile query string can cause (ValueError past it).
    query = parse_qs(parts.query, keep_blank_values=True, max_num_fields=64)
    headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in head.headers)
    return Request(head.method.decode("latin-1"), target, parts.path, query, headers, body)


def _raw_response(resp: Response) -> bytes:
    head = (
        f"HTTP/1.1 {resp.status} {reason_phrase(resp.status).decode()}\r\n"
        f"server: {SERVER.decode()}\r\ncontent-type: {resp.content_type}\r\n"
        f"content-length: {len(resp.body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + resp.body
