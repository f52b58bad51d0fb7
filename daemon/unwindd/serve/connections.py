"""The HTTP connections of the query socket and the metrics listener: one coroutine each.

Rules:
- A request must arrive completely within ``[api] request_timeout`` (else 408), its head within
  ``max_header_bytes`` (431) and its body within ``max_body_bytes`` (413); a malformed one gets
  its 4xx and the connection closes. Each refusal is counted in ``rejected`` by reason (one of
  ``httpapi.REJECTIONS``), so is an answer the API marks as one (``Response.rejected``).
- More than ``max_connections`` open connections: the new one gets 503 at once.
- Every socket wait has a timeout (a response must drain within ``request_timeout``, a close
  within a second, else the transport is aborted), so a slow or silent client holds only its
  own coroutine, never the loop; an answer not taken in time is counted (``answer_not_taken``).
  Nothing is written to a transport already closing (a client gone while its answer was made:
  uvloop raises there), the connection just ends.
- A ``ChunkedResponse`` is written a chunk at a time (``write_chunked``): the next chunk is
  rendered (on ``render_on``: the service's query thread, off the loop) only once the previous
  one has drained, so a slow reader holds a chunk or two, not the answer. The time spent
  waiting for the client to take the chunks adds up to at most ``request_timeout`` plus a
  second per ``MIN_READ_RATE`` bytes written: a client that stalls is dropped as one whose
  whole response does not drain is, one that keeps reading at that rate or better is never cut
  however long its answer, and one that trickles cannot hold a snapshot for long. Rendering
  is ours and does not count. An answer that cannot
  be finished (a timeout, the client gone, a rendering error: logged) ends the connection
  without the last chunk, so an HTTP/1.1 client sees it cut short (an HTTP/1.0 one, whose
  body ends with the connection, only by its JSON ending early). Whatever ends it, the answer
  is closed once no chunk is being rendered (its store snapshot released).
- Keep-alive: requests on one connection are answered in order until the client or the
  daemon stops; a handler's exception is logged and answered 500, and the connection goes on.
- A ``StreamStart`` answer hands the connection to the stream fan-out (streams.py) for good.
- The limits are read per connection from the effective config, so a reload applies to new
  connections.
- Cost: O(bytes received) of h11 parsing per request (httpapi.py) plus the handler; a chunked
  answer holds at most the chunk being written and the one being rendered.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from functools import partial

from .api import Peer
from .config import ApiSection
from .httpapi import (
    CLOSED,
    NEED_DATA,
    ChunkedResponse,
    HttpSession,
    Request,
    Response,
    StreamStart,
    error_response,
)

log = logging.getLogger("unwindd")

_READ_CHUNK = 65536
# The slowest reading of a chunked answer that is never cut (bytes a second of waiting): any
# real client on a local socket reads hundreds of times faster.
MIN_READ_RATE = 1 << 20

Handler = Callable[[Request, Peer], Awaitable[Response | ChunkedResponse | StreamStart]]
StreamServer = Callable[
    [HttpSession, asyncio.StreamReader, asyncio.StreamWriter, StreamStart], Awaitable[None]
]


def peer_of(writer: asyncio.StreamWriter) -> Peer:
    sock = writer.get_extra_info("socket")
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", raw)
    except (OSError, AttributeError):
        return Peer(None)
    return Peer(uid, pid)


class Connections:
    """The open connections (``open``) and the refusals (``rejected``, by reason)."""

    def __init__(self, api: Callable[[], ApiSection], stop: asyncio.Event,
                 stream: StreamServer) -> None:  # fmt: skip
        self._api = api  # the effective [api] section (live keys change on reload)
        self._stop = stop
        self._stream = stream
        self.open = 0
        self.rejected: Counter[str] = Counter()

    async def serve(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handle: Handler,
        peer: Peer,
    ) -> None:
        api = self._api()
        session = HttpSession(max_header_bytes=api.max_header_bytes,
                              max_body_bytes=api.max_body_bytes)  # fmt: skip
        if self.open >= api.max_connections:
            self.rejected["too_many_connections"] += 1
            writer.write(session.error(503, "too many connections"))
            await close_writer(writer)
            return
        self.open += 1
        loop = asyncio.get_running_loop()
        try:
            while not self._stop.is_set():
                deadline = loop.time() + api.request_timeout
                item = session.next_request()
                while item is NEED_DATA:
                    remaining = deadline - loop.time()
                    try:
                        if remaining <= 0:
                            raise TimeoutError
                        data = await asyncio.wait_for(reader.read(_READ_CHUNK), remaining)
                    except TimeoutError:
                        self.rejected["timeout"] += 1
                        writer.write(session.error(408, "request not received in time"))
                        return
                    session.receive(data)
                    item = session.next_request()
                if item is CLOSED:
                    return
                if isinstance(item, Response):
                    self.rejected[f"http_{item.status}"] += 1
                    writer.write(session.respond(item))
                    return
                assert isinstance(item, Request)
                try:
                    result = await handle(item, peer)
                except Exception:
                    log.exception("handling %s", item.target)
                    result = error_response(500, "internal error")
                if isinstance(result, StreamStart):
                    await self._stream(session, reader, writer, result)
                    return
                if isinstance(result, ChunkedResponse):
                    try:
                        if not await write_chunked(session, writer, result, api.request_timeout):
                            return
                    except TimeoutError:
                        self.rejected["answer_not_taken"] += 1
                        return
                    if not session.keep_alive:
                        return
                    continue
                if result.rejected is not None:
                    self.rejected[result.rejected] += 1
                if writer.is_closing():
                    return  # the client went while the answer was made
                writer.writelines(session.respond_parts(result))
                try:
                    await asyncio.wait_for(writer.drain(), api.request_timeout)
                except TimeoutError:
                    self.rejected["answer_not_taken"] += 1
                    return
                if not session.keep_alive:
                    return
        except (TimeoutError, ConnectionError):
            pass
        finally:
            self.open -= 1
            await close_writer(writer)


def _render_now(fn: Callable[[], bytes | None]) -> Future[bytes | None]:
    """``ChunkedResponse.render_on`` when none is given: the chunk is rendered in place."""
    fut: Future[bytes | None] = Future()
    try:
        fut.set_result(fn())
    except Exception as e:
        fut.set_exception(e)
    return fut


async def write_chunked(session: HttpSession, writer: asyncio.StreamWriter,
                        res: ChunkedResponse, timeout: float) -> bool:  # fmt: skip
    """Write ``res`` a chunk at a time, each rendered once the previous one has drained; the
    client's waits add up to at most ``timeout`` plus a second per ``MIN_READ_RATE`` bytes
    written (else TimeoutError). True when the whole answer was written (the connection may
    serve the next request), False when it had to stop (the connection must close); ``res``
    is closed in every case."""
    loop = asyncio.get_running_loop()
    submit = res.render_on or _render_now
    pending: Future[bytes | None] | None = None
    try:
        writer.write(session.start_stream(res.content_type, res.headers))
        while True:
            try:
                pending = submit(partial(next, res.chunks, None))
            except RuntimeError:  # the query thread is shut down: the daemon is stopping
                return False
            try:
                chunk = await asyncio.wrap_future(pending)
            except Exception:
                log.exception("rendering an answer")
                writer.transport.abort()  # no last chunk: the body is seen cut short
                return False
            pending = None
            if writer.is_closing():
                return False  # the client went while the chunk was rendered
            if chunk is None:
                break
            writer.writelines(session.stream_parts(chunk))
            timeout += len(chunk) / MIN_READ_RATE
            del chunk  # the transport holds what the socket has not taken yet
            timeout = await _drain(writer, timeout, loop)
        writer.write(session.end_answer())
        await _drain(writer, timeout, loop)
        return True
    finally:
        if pending is not None and not pending.done():
            # a chunk is being rendered on the query thread: close the answer after it
            pending.add_done_callback(lambda _: res.close())
        else:
            res.close()


async def _drain(writer: asyncio.StreamWriter, budget: float,
                 loop: asyncio.AbstractEventLoop) -> float:  # fmt: skip
    """Wait until the client has taken what is written, within ``budget`` seconds: what is left
    of it (TimeoutError when it is spent)."""
    t0 = loop.time()
    await asyncio.wait_for(writer.drain(), budget)
    left = budget - (loop.time() - t0)
    if left <= 0:
        raise TimeoutError
    return left


async def close_writer(writer: asyncio.StreamWriter) -> None:
    try:
        if writer.can_write_eof():
            writer.write_eof()
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (OSError, TimeoutError, RuntimeError):
        writer.transport.abort()
