"""One OpenAI request's connection as the OpenAI front uses it, whichever server read it:
aiohttp's (``AiohttpExchange``) or the HTTP listener's fast lane (``proxy.process.fast_lane``).

The front reads the body through it, answers with a ``Plain`` (status, headers, body) or
streams server-sent events through it, and asks it whether the client is still there. Both
servers put the same bytes on the wire (``tests/integration/test_fast_lane.py`` compares them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from proxy.fronts.body import read_raw


@dataclass(slots=True)
class Plain:
    """A whole answer: its status, its headers (``Content-Type`` among them), its body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def web(self) -> web.Response:
        return web.Response(body=self.body, status=self.status, headers=self.headers)


class Exchange(Protocol):
    headers: Mapping[str, str]
    """Case-insensitive; the first of repeated names wins."""
    content_length: int | None

    async def raw_body(self, limit: int, setting: str) -> bytes:
        """The body as it came (not inflated), refused past ``limit`` (naming ``setting``)."""

    def closing(self) -> bool:
        """The client's connection is gone, or going."""

    def drop(self) -> None:
        """An injected "connection reset": the connection drops with no answer."""

    async def stream(self, headers: dict[str, str]) -> None:
        """Start a 200 stream with these headers; they leave with the first write."""

    async def write(self, data: bytes) -> None: ...

    async def end(self, data: bytes = b"") -> None:
        """The last bytes and the stream's end (a no-op once ended)."""


class SseResponse(web.StreamResponse):
    """A stream whose status line and headers leave with its first write (aiohttp holds them
    until then): the front starts the response only once the first event is in hand and
    writes it at once, so sending the headers on their own would cost one more socket write,
    and one more wake-up of the client, per stream. The bytes on the wire are the same. (An
    aiohttp without this switch sends the headers at once, as before.)"""

    _send_headers_immediately = False


class AiohttpExchange:
    """An OpenAI request read by aiohttp's server; a stream is an ``SseResponse``."""

    __slots__ = ("content_length", "headers", "request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.headers: Mapping[str, str] = request.headers
        self.content_length = request.content_length
        self.response: SseResponse | None = None

    async def raw_body(self, limit: int, setting: str) -> bytes:
        return await read_raw(self.request, limit, setting)

    def closing(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    def drop(self) -> None:
        if self.request.transport is not None:
            self.request.transport.abort()

    async def stream(self, headers: dict[str, str]) -> None:
        self.response = SseResponse(headers=headers)
        await self.response.prepare(self.request)

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def end(self, data: bytes = b"") -> None:
        assert self.response is not None
        await self.response.write_eof(data)
