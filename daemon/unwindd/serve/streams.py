"""The live stream: samples fanned out from the store to ``/v1/stream`` clients as they are added.

Rules:
- The sampler never waits for a client: each client has a bounded queue (``[api]
  stream_queue``) that ``offer`` fills without blocking; what does not fit is dropped and
  counted (``dropped``, the unwindd_stream_dropped_samples metric).
- The store calls the fan-out only while a stream is open: with a subscriber the native step
  builds an UnwoundSample per sample, which nobody would read otherwise.
- A client that cannot take a batch within ``[api] request_timeout`` is dropped; a stream ends
  at its ``limit`` or ``seconds``, when the client goes, or when the daemon stops.
- The client is subscribed before the response head is sent, so no sample added after the
  head is missed.
- Cost: ``offer`` is O(samples in the batch) per client (its filter); a wake-up sends what
  queued since the last one in one write, at least once a second.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

from ..unwind.stackfmt import UnwoundSample
from .api import stream_line
from .config import ApiSection
from .httpapi import HttpSession, StreamStart

Subscribers = list[Callable[[Sequence[UnwoundSample]], None]]


class StreamClient:
    """One live-stream subscriber: a bounded queue the sampler fills without waiting."""

    def __init__(self, accept: Callable[[UnwoundSample], bool], cap: int,
                 fanout: StreamFanout) -> None:  # fmt: skip
        self.accept = accept
        self.cap = cap
        self.fanout = fanout
        self.queue: list[UnwoundSample] = []
        self.wake = asyncio.Event()
        self.closed = False

    def offer(self, samples: Sequence[UnwoundSample]) -> None:
        got = [s for s in samples if self.accept(s)]
        if not got:
            return
        room = self.cap - len(self.queue)
        if room < len(got):
            self.fanout.dropped += len(got) - max(room, 0)
            got = got[: max(room, 0)]
        self.queue += got
        self.wake.set()

    def take(self) -> list[UnwoundSample]:
        out, self.queue = self.queue, []
        self.wake.clear()
        return out

    def close(self) -> None:
        self.closed = True
        self.wake.set()


class StreamFanout:
    """The open stream clients, and the store subscription (``subscribers()``, the store's
    list) that feeds them while there are any."""

    def __init__(self, api: Callable[[], ApiSection], stop: asyncio.Event,
                 subscribers: Callable[[], Subscribers]) -> None:  # fmt: skip
        self._api = api  # the effective [api] section (live keys change on reload)
        self._stop = stop
        self._subscribers = subscribers
        self.clients: set[StreamClient] = set()
        self.dropped = 0  # samples not sent to clients that did not keep up

    def _fanout(self, samples: Sequence[UnwoundSample]) -> None:
        for sc in self.clients:
            sc.offer(samples)

    def _add(self, sc: StreamClient) -> None:
        if not self.clients:
            self._subscribers().append(self._fanout)
        self.clients.add(sc)

    def _drop(self, sc: StreamClient) -> None:
        self.clients.discard(sc)
        subs = self._subscribers()
        if not self.clients and self._fanout in subs:
            subs.remove(self._fanout)

    def close_all(self) -> None:
        for sc in list(self.clients):
            sc.close()

    async def serve(
        self,
        session: HttpSession,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        start: StreamStart,
    ) -> None:
        p = start.params
        sc = StreamClient(p["accept"], self._api().stream_queue, self)
        limit: int | None = p.get("limit")
        seconds: float | None = p.get("seconds")
        line: Callable[[UnwoundSample], bytes] = p.get("line", stream_line)
        loop = asyncio.get_running_loop()
        end = None if seconds is None else loop.time() + seconds
        self._add(sc)
        sent = 0
        try:
            writer.write(session.start_stream(start.content_type, start.headers))
            await asyncio.wait_for(writer.drain(), self._api().request_timeout)
            while not sc.closed and not self._stop.is_set():
                timeout = 1.0 if end is None else min(1.0, end - loop.time())
                if timeout <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(sc.wake.wait(), timeout)
                if reader.at_eof() or writer.is_closing():
                    return
                batch = sc.take()
                if limit is not None:
                    batch = batch[: limit - sent]
                if batch:
                    writer.write(session.stream_data(b"".join(map(line, batch))))
                    sent += len(batch)
                    # A client that cannot take a batch within the timeout is dropped.
                    await asyncio.wait_for(writer.drain(), self._api().request_timeout)
                if limit is not None and sent >= limit:
                    break
            writer.write(session.end_stream())
            await asyncio.wait_for(writer.drain(), 1.0)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            self._drop(sc)
