"""A lean HTTP/1.1 client for one backend's hot path: a POST whose whole answer is read, on
keep-alive connections parsed by ``httptools`` (llhttp, the parser aiohttp's own server uses).

Why: aiohttp's client is about half of what a bare aiohttp pass-through spends per request
(``python -m bench.transport_lab``: its server with these connections instead of aiohttp's
client session, 21–45 % less CPU per request). The server side stays aiohttp, with every
listener guard it carries; this client only talks to the backends the operator configured.

What it does, as aiohttp's client did for these calls: at most ``limit`` connections (callers
beyond it wait), idle ones reused unless the backend closed them or they idled ``IDLE_S``,
TLS with the backend's context (SNI and hostname check from the url), chunked or sized
answers. A request that was written is never sent again: a connection lost before its answer
is an error for the caller (a fallback may act on it), since a stateful model (a sequence)
must not see one request twice. A cancelled or timed-out call closes its connection (an
answer may still be on its way). Header names and values that could not be sent as one
header line are refused (``ValueError``), never written."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

import httptools

IDLE_S = 60.0
"""An idle connection older than this is closed rather than reused (aiohttp's keep-alive)."""
_BAD_VALUE = str.maketrans("", "", "\r\n\0")


class Answer(NamedTuple):
    status: int
    headers: Mapping[str, str]
    """Lower-case names; the first of repeated headers, as aiohttp's ``headers.get``."""
    body: bytes


class BackendDisconnected(ConnectionError):
    """The backend closed the connection before the end of its answer."""


class BackendProtocolError(ConnectionError):
    """The backend's answer is not HTTP/1.1 this client can read."""


class _Conn(asyncio.Protocol):
    """One connection, one request at a time; its answer handed to ``waiter``. A byte that
    comes when no request waits, or after its answer, breaks the connection (closed)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Answer] | None = None
        self.lost = False
        self.keep = False
        self.idle_since = 0.0
        self.parser = httptools.HttpResponseParser(self)
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real one follows
            self.headers = {}
            return
        waiter, self.waiter = self.waiter, None
        if waiter is None or waiter.done():  # a second answer to one request
            self.close()
            return
        self.keep = bool(self.parser.should_keep_alive())
        waiter.set_result(Answer(status, self.headers, b"".join(self.chunks)))

    # asyncio's callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # nothing asked: the backend is out of step
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # httptools' parse errors, an upgrade
            self._fail(BackendProtocolError(f"unreadable answer: {type(exc).__name__}: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(BackendDisconnected("the backend closed the connection before the end of "
                                       "its answer" + (f" ({exc})" if exc else "")))

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    async def send(self, head: bytes, body: Iterable[bytes | memoryview]) -> Answer:
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self.headers, self.chunks = {}, []
        waiter: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self.waiter = waiter
        self.transport.writelines((head, *body))
        try:
            return await waiter
        finally:
            self.waiter = None

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class HttpPool:
    """Keep-alive connections to one backend (``base``: scheme://host[:port])."""

    def __init__(self, base: str, limit: int, ssl_context: ssl.SSLContext | bool) -> None:
        u = urlsplit(base)
        self.host = u.hostname or ""
        self.tls = u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.host_header = u.netloc.rpartition("@")[2]
        self._ssl: ssl.SSLContext | None = None
        if self.tls:
            self._ssl = (ssl_context if isinstance(ssl_context, ssl.SSLContext)
                         else ssl.create_default_context())
        self.limit = limit
        self._slots: asyncio.Semaphore | None = None
        self._idle: deque[_Conn] = deque()

    def head(self, method: str, target: str, headers: Mapping[str, str]) -> bytes:
        """The request line and headers; ``ValueError`` for a name or value that cannot be one
        header line (nothing is written then)."""
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.host_header}"]
        for name, value in headers.items():
            if (not name or not name.isascii() or not name.isprintable() or " " in name
                    or ":" in name or value.translate(_BAD_VALUE) != value):
                raise ValueError(f"header {name!r} cannot be sent to the backend: its name or "
                                 "value holds a character a header line cannot")
            lines.append(f"{name}: {value}")
        lines.append("\r\n")
        return "\r\n".join(lines).encode("utf-8", "surrogateescape")

    async def request(self, head: bytes, body: Iterable[bytes | memoryview]) -> Answer:
        if self._slots is None:  # made inside the running loop
            self._slots = asyncio.Semaphore(self.limit)
        async with self._slots:
            conn = self._reuse() or await self._connect()
            return await self._exchange(conn, head, body)

    async def _exchange(self, conn: _Conn, head: bytes, body: Iterable[bytes | memoryview]
                        ) -> Answer:
        try:
            answer = await conn.send(head, body)
        except BaseException:
            conn.close()  # cancelled, timed out or broken: an answer may still be coming
            raise
        if conn.keep and not conn.lost:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
        return answer

    def _reuse(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the least likely to be gone
            if not conn.lost and now - conn.idle_since < IDLE_S:
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            _Conn, self.host, self.port, ssl=self._ssl,
            server_hostname=self.host if self._ssl is not None else None)
        return conn

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
