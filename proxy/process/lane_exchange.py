"""An OpenAI request on the HTTP listener's fast lane, as the OpenAI front sees it
(``proxy.fronts.exchange.Exchange``): the body the lane read, and a server-sent-events stream
written as aiohttp writes one (HTTP/1.1 chunked, the status line and headers with the first
write, a write that waits while the client reads slower than the events come)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Protocol

from proxy.errors import ErrorKind, ProxyError
from proxy.process.lane_wire import answer_head


class Lane(Protocol):
    """What of its connection the exchange uses (``FastLane``)."""

    transport: asyncio.Transport | None
    gone: bool

    def stream_close(self) -> bool:
        """The stream must end its connection (the client asked, or mmguard is draining)."""

    async def drained(self) -> None:
        """Until the transport's buffer is below its high-water mark again."""


class LaneExchange:
    __slots__ = ("_ended", "_head", "closes", "content_length", "headers", "lane", "raw",
                 "streamed")

    def __init__(self, lane: Lane, headers: Mapping[str, str], raw: bytes) -> None:
        self.lane = lane
        self.headers = headers
        self.raw = raw
        self.content_length: int | None = len(raw)
        self.streamed = False
        self._head: bytes | None = None
        self._ended = False
        self.closes = False
        """The stream's head said ``Connection: close``."""

    async def raw_body(self, limit: int, setting: str) -> bytes:
        if len(self.raw) > limit:  # the lane checked the declared length already
            raise ProxyError(ErrorKind.TOO_LARGE, f"request body is over {limit} bytes; this "
                             f"listener accepts at most {limit} bytes ({setting})")
        return self.raw

    def closing(self) -> bool:
        transport = self.lane.transport
        return self.lane.gone or transport is None or transport.is_closing()

    def drop(self) -> None:
        if self.lane.transport is not None:
            self.lane.transport.abort()

    async def stream(self, headers: dict[str, str]) -> None:
        self.streamed = True
        self.closes = self.lane.stream_close()
        self._head = answer_head(200, headers, "Transfer-Encoding: chunked", self.closes)

    async def write(self, data: bytes) -> None:
        if not data or self._ended:
            return
        self._send(b"%x\r\n" % len(data) + data + b"\r\n")
        await self.lane.drained()

    async def end(self, data: bytes = b"") -> None:
        if self._ended:
            return
        self._ended = True
        self._send((b"%x\r\n" % len(data) + data + b"\r\n" if data else b"") + b"0\r\n\r\n")

    def _send(self, data: bytes) -> None:
        transport = self.lane.transport
        if self.closing() or transport is None:
            raise ConnectionResetError("the client's connection is gone")
        if self._head is not None:
            data, self._head = self._head + data, None
        transport.write(data)
