"""A small HTTP/1.1 client on asyncio streams and h11 (already the server's parser): one request
per connection, for the Pyroscope push (pyroscope.py).

Invariants:
- Never blocks the event loop: connect, send and read are awaited on asyncio streams, and the
  whole exchange (DNS, connect, TLS, request, response) is bounded by one ``timeout``.
- One request per connection (``Connection: close``): a push every few seconds gains nothing
  from keep-alive, and a fresh connection cannot inherit a half-read answer from a timed-out one.
- Bounded: the response body is read up to ``max_body`` bytes (then the rest is dropped and the
  connection closed); the head is bounded by h11's ``max_incomplete_event_size``.
- Errors are typed: ``ConnectFailed`` (resolve, connect, TLS), ``TimeoutError`` (the deadline),
  ``ProtocolFailed`` (a malformed or truncated answer); any HTTP status is a ``Reply``.
- Cost: O(request + response head + ``max_body``) bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from urllib.parse import urlsplit

import h11

from ..lightdc import dataclass

_READ = 65536


class ConnectFailed(OSError):
    pass


class ProtocolFailed(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where requests go: from ``http(s)://HOST[:PORT][/PREFIX]``."""

    scheme: str
    host: str
    port: int
    prefix: str  # path prefix without the trailing slash ("" for none)

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError("must look like http://HOST:PORT or https://HOST")
        if u.username is not None or u.password is not None:
            raise ValueError("must not carry credentials (use basic_auth_user/_password)")
        if u.query or u.fragment:
            raise ValueError("must not have a query or fragment")
        port = u.port or (443 if u.scheme == "https" else 80)
        return cls(u.scheme, u.hostname, port, u.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes


async def post(
    ep: Endpoint,
    target: str,
    headers: list[tuple[str, str]],
    body: bytes,
    *,
    timeout: float,
    max_body: int = 4096,
) -> Reply:
    """POST ``body`` to ``ep`` + ``target`` (path and query, already encoded)."""
    async with asyncio.timeout(timeout):
        return await _exchange(ep, target, headers, body, max_body)


async def _exchange(ep: Endpoint, target: str, headers: list[tuple[str, str]], body: bytes,
                    max_body: int) -> Reply:  # fmt: skip
    tls = ssl.create_default_context() if ep.scheme == "https" else None
    try:
        reader, writer = await asyncio.open_connection(
            ep.host, ep.port, ssl=tls, server_hostname=ep.host if tls else None)
    except (OSError, ssl.SSLError) as e:
        # asyncio's "Connect call failed (addr)" hides the reason the errno names
        why = os.strerror(e.errno) if e.errno and e.errno > 0 else (e.strerror or str(e))
        raise ConnectFailed(e.errno, why) from None
    try:
        conn = h11.Connection(h11.CLIENT)
        head = [("Host", ep.host_header), ("Content-Length", str(len(body))),
                ("Connection", "close"), ("User-Agent", "unwindd"), *headers]  # fmt: skip
        try:
            out = conn.send(h11.Request(method="POST", target=ep.prefix + target, headers=head))
            out += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError as e:  # a header value h11 will not send
            raise ProtocolFailed(f"request not sent: {e}") from None
        writer.write(out)
        await writer.drain()
        status = 0
        got = bytearray()
        while True:
            try:
                ev = conn.next_event()
            except h11.RemoteProtocolError as e:
                raise ProtocolFailed(str(e)) from None
            if ev is h11.NEED_DATA:
                # b"" at EOF: h11 then ends a close-delimited body, or raises for a truncated
                # answer (or none at all).
                conn.receive_data(await reader.read(_READ))
            elif isinstance(ev, h11.Response):
                status = ev.status_code
            elif isinstance(ev, h11.Data):
                got += ev.data[: max(0, max_body - len(got))]
                if len(got) >= max_body:
                    break
            elif isinstance(ev, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        if not status:
            raise ProtocolFailed("no response")
        return Reply(status, bytes(got))
    except (ConnectionError, OSError) as e:
        raise ProtocolFailed(f"connection lost: {e}") from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 1.0)
