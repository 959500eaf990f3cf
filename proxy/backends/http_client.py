"""A lean HTTP/1.1 client for one backend's hot path: a POST whose whole answer is read, on
keep-alive connections parsed by ``httptools`` (llhttp, the parser aiohttp's own server uses).

Why: aiohttp's client is about half of what a bare aiohttp pass-through spends per request
(``python -m bench.transport_lab``: its server with these connections instead of aiohttp's
client session, 21–45 % less CPU per request). The server side stays aiohttp, with every
listener guard it carries; this client only talks to the backends the operator configured.

What it does, as aiohttp's client did for these calls: at most ``limit`` connections (callers
beyond it wait), idle ones reused unless the backend closed them, and closed once they idled
``IDLE_S`` (one sweep timer, not one per call), TLS with the backend's context (SNI and
hostname check from the url), chunked, sized or close-delimited answers, at most ``max_body``
bytes of a whole answer held (a bigger one fails with ``AnswerTooLarge`` and its connection
is closed; a streamed answer is paced instead, see ``Body``). A request that was
written is never sent again: a connection lost before its answer is an error for the caller
(a fallback may act on it), since a stateful model (a sequence) must not see one request
twice. A cancelled or timed-out call closes its connection (an answer may still be on its
way). Header names and values that could not be sent as one header line are refused
(``ValueError``), never written."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import httptools

MAX_HEAD = 64 * 1024
"""The most bytes an answer's status line and headers may take (a head still open past them is
a broken backend: the connection is closed)."""
IDLE_S = 60.0
"""An idle connection older than this is closed rather than reused (aiohttp's keep-alive)."""
_BAD_VALUE = str.maketrans("", "", "\r\n\0")


class Answer(NamedTuple):
    status: int
    headers: Mapping[str, str]
    """Lower-case names; the first of repeated headers, as aiohttp's ``headers.get``."""
    body: bytes


class _Head(NamedTuple):
    status: int
    headers: Mapping[str, str]
    body: Body


class Body:
    """A streamed answer's body as it arrives: one item per socket read (de-chunked). Past
    ``PAUSE_ABOVE`` bytes waiting to be read, the socket is not read until they are."""

    PAUSE_ABOVE = 1 << 20

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self._reads: deque[bytes] = deque()
        self._pending: list[bytes] = []  # this socket read's pieces
        self._waiting = 0
        self._paused = False
        self._wake: asyncio.Future[None] | None = None
        self.ended = False
        self.error: Exception | None = None
        self._idle_s = 0.0
        self._last = 0.0  # time.monotonic() of the last read that brought bytes
        self._watch: asyncio.TimerHandle | None = None

    def _piece(self, data: bytes) -> None:
        self._pending.append(data)

    def watch_idle(self, idle_s: float) -> None:
        """Fail with ``TimeoutError`` (and close the connection) when the backend sends nothing
        for ``idle_s`` while nothing is left to read: one timer for the whole stream, moved on
        only when it fires (a reader that is slow to take what came is not the backend's
        silence)."""
        self._idle_s, self._last = idle_s, time.monotonic()
        self._watch = asyncio.get_running_loop().call_later(idle_s, self._check_idle)

    def _check_idle(self) -> None:
        self._watch = None
        if self.ended or self.error is not None:
            return
        wait = self._last + self._idle_s - time.monotonic()
        if wait > 0 or self._reads:
            self._watch = asyncio.get_running_loop().call_later(
                max(wait, 0.0) or self._idle_s, self._check_idle)
            return
        self._fail(TimeoutError(f"nothing came for {self._idle_s:g} s"))
        self._conn.close()

    def unwatch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _read_done(self) -> None:
        if self._watch is not None:
            self._last = time.monotonic()
        if self._pending:
            data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending = []
            self._reads.append(data)
            self._waiting += len(data)
            if self._waiting > self.PAUSE_ABOVE and not self._paused:
                self._paused = True
                if self._conn.transport is not None:
                    self._conn.transport.pause_reading()
        self._notify()

    def _end(self) -> None:
        self._read_done()
        self.ended = True
        self.unwatch()
        self._notify()

    def _fail(self, exc: Exception) -> None:
        self.unwatch()
        if not self.ended:
            self.error = exc
            self._notify()

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def read(self) -> tuple[bytes, bool]:
        """The next read's bytes, and whether the body ended with them ((b"", True) after
        the end); the connection's error once what came before it has been read."""
        while not self._reads and not self.ended and self.error is None:
            self._wake = asyncio.get_running_loop().create_future()
            try:
                await self._wake
            finally:
                self._wake = None
        if self._reads:
            data = self._reads.popleft()
            self._waiting -= len(data)
            if self._paused and self._waiting <= self.PAUSE_ABOVE // 2:
                self._paused = False
                if self._conn.transport is not None and not self._conn.lost:
                    self._conn.transport.resume_reading()
            return data, self.ended and not self._reads
        if self.error is not None:
            raise self.error
        return b"", True

    async def read_all(self) -> bytes:
        """The rest of the body, whole: at most the connection's ``max_body`` bytes
        (``AnswerTooLarge`` past it; the caller's ``release`` then closes the connection)."""
        parts = []
        size = 0
        limit = self._conn.max_body
        ended = False
        while not ended:
            data, ended = await self.read()
            size += len(data)
            if limit is not None and size > limit:
                raise AnswerTooLarge(None, limit)
            parts.append(data)
        return b"".join(parts)


class AnswerTooLarge(Exception):
    """A whole answer over the client's ``max_body`` (``size``: its declared length, when it
    declared one); its connection is closed, the rest of it never read."""

    def __init__(self, size: int | None, limit: int) -> None:
        self.size, self.limit = size, limit
        super().__init__(f"an answer of {size} bytes" if size is not None
                         else f"an answer of more than {limit} bytes")


class BackendDisconnected(ConnectionError):
    """The backend closed the connection before the end of its answer."""


class BackendProtocolError(ConnectionError):
    """The backend's answer is not HTTP/1.1 this client can read."""


class _Conn(asyncio.Protocol):
    """One connection, one request at a time; its answer handed to ``waiter``. A byte that
    comes when no request waits, or after its answer, breaks the connection (closed)."""

    def __init__(self, max_body: int | None = None,
                 on_lost: Callable[[_Conn], None] | None = None) -> None:
        self.max_body = max_body
        """The most bytes of a whole answer held; None: no bound."""
        self.on_lost = on_lost  # told once the connection is gone (a closing pool waits)
        self.received = 0
        self.head_bytes = 0  # read while the answer's head is still open
        self.in_head = False
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Any] | None = None
        self.streaming = False
        self.body: Body | None = None  # the streamed answer being read
        self.lost = False
        self.keep = False
        self.idle_since = 0.0
        self.parser = httptools.HttpResponseParser(self)
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.to_close = False  # the answer's body ends when the connection does

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self.in_head = False
        status = self.parser.get_status_code()
        if status >= 200:
            # Neither sized nor chunked: the answer runs to the connection's end (HTTP/1.0's
            # way, which aiohttp reads too), and only connection_lost can complete it.
            self.to_close = ("content-length" not in self.headers
                             and "transfer-encoding" not in self.headers
                             and status not in (204, 304))
            if not self.streaming and self.max_body is not None:
                declared = self.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > self.max_body:
                    self._too_large(int(declared))  # refused before a byte of it is read
                    return
        if not self.streaming or status < 200:
            return
        self.keep = bool(self.parser.should_keep_alive())
        waiter, self.waiter = self.waiter, None
        if waiter is None or waiter.done():
            self.close()
            return
        self.body = Body(self)
        waiter.set_result(_Head(status, self.headers, self.body))

    def on_body(self, body: bytes) -> None:
        if self.lost:  # refused (too large) in this very read: the rest is not kept
            return
        if self.body is not None:
            self.body._piece(body)
            return
        self.received += len(body)
        if self.max_body is not None and self.received > self.max_body:
            self._too_large(None)
            return
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real one follows
            self.headers, self.in_head = {}, True
            return
        keep = not self.lost and bool(self.parser.should_keep_alive())
        if self.body is not None:
            self.keep = self.keep and keep
            self.body._end()
            return
        waiter, self.waiter = self.waiter, None
        if waiter is None or waiter.done():  # a second answer to one request
            self.close()
            return
        self.keep = keep
        waiter.set_result(Answer(status, self.headers, b"".join(self.chunks)))

    # asyncio's callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.waiter is None and (self.body is None or self.body.ended):  # nothing asked
            self.close()  # the backend is out of step
            return
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # httptools' parse errors, an upgrade
            self._fail(BackendProtocolError(f"unreadable answer: {type(exc).__name__}: {exc}"))
            self.close()
        if self.in_head and not self.lost:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD:  # httptools holds a header being read whole
                self._fail(BackendProtocolError(f"unreadable answer: its head is still open "
                                                f"after {MAX_HEAD} bytes"))
                self.close()
                return
        if self.body is not None:  # this read's pieces of a streamed body, as one item
            self.body._read_done()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.on_lost is not None:
            self.on_lost(self)
        if self.to_close and exc is None:  # the end of an answer that runs to the close
            self.to_close = False
            self.keep = False
            self.on_message_complete()
            return
        self._fail(BackendDisconnected("the backend closed the connection before the end of "
                                       "its answer" + (f" ({exc})" if exc else "")))

    def _too_large(self, size: int | None) -> None:
        assert self.max_body is not None
        self._fail(AnswerTooLarge(size, self.max_body))
        self.close()

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if self.body is not None:
            self.body._fail(exc)

    async def send(self, head: bytes, body: Iterable[bytes | memoryview],
                   streaming: bool = False) -> Any:
        """The whole ``Answer``, or with ``streaming`` a ``_Head`` once the headers are in."""
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self.headers, self.chunks, self.to_close, self.received = {}, [], False, 0
        self.in_head, self.head_bytes = True, 0
        self.streaming, self.body = streaming, None
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
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

    def __init__(self, base: str, limit: int, ssl_context: ssl.SSLContext | bool,
                 idle_s: float = IDLE_S, max_body: int | None = None) -> None:
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
        self._idle: deque[_Conn] = deque()  # the least recently used first
        self.idle_s = idle_s
        self.max_body = max_body
        """The most bytes of one whole answer (or a streamed one's error body) held."""
        self._sweep: asyncio.TimerHandle | None = None
        self._closing: set[_Conn] = set()  # closed by ``close``, not yet gone
        self._gone: asyncio.Event | None = None  # set when the last of those is
        self.closed = False

    def head(self, method: str, target: str, headers: Mapping[str, str], length: int) -> bytes:
        """The request line and headers, ``Content-Length`` the body's ``length`` (one given
        in ``headers`` is not repeated); ``ValueError`` for a name or value that cannot be one
        header line (nothing is written then)."""
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.host_header}",
                 f"Content-Length: {length}"]
        for name, value in headers.items():
            if name.lower() == "content-length":
                continue
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
            answer: Answer = await conn.send(head, body)
        except BaseException:
            conn.close()  # cancelled, timed out or broken: an answer may still be coming
            raise
        self._done_with(conn, True)
        return answer

    async def open_stream(self, head: bytes, body: Iterable[bytes | memoryview]) -> Streamed:
        """A request whose answer is read as it arrives; ``Streamed.release`` (always) hands
        its connection back, or closes it when its answer was not read to the end."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        await self._slots.acquire()
        try:
            conn = self._reuse() or await self._connect()
            try:
                first: _Head = await conn.send(head, body, streaming=True)
            except BaseException:
                conn.close()
                raise
        except BaseException:
            self._slots.release()
            raise
        return Streamed(self, conn, first)

    def _done_with(self, conn: _Conn, whole: bool) -> None:
        if whole and conn.keep and not conn.lost and not self.closed:
            conn.idle_since = time.monotonic()
            conn.body = None
            self._idle.append(conn)
            if self._sweep is None:
                self._sweep = asyncio.get_running_loop().call_later(self.idle_s, self._expire)
        else:
            conn.close()

    def _expire(self) -> None:
        """Close the connections idle for ``idle_s``; come back while any stays idle."""
        self._sweep = None
        now = time.monotonic()
        while self._idle and (self._idle[0].lost or now - self._idle[0].idle_since >= self.idle_s):
            self._idle.popleft().close()
        if self._idle:
            wait = self._idle[0].idle_since + self.idle_s - now
            self._sweep = asyncio.get_running_loop().call_later(max(wait, 0.01), self._expire)

    def _release(self, conn: _Conn, whole: bool) -> None:
        self._done_with(conn, whole)
        if self._slots is not None:
            self._slots.release()

    def _reuse(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the least likely to be gone
            if not conn.lost and now - conn.idle_since < self.idle_s:
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Conn:
        if not self.closed:
            _, conn = await asyncio.get_running_loop().create_connection(
                lambda: _Conn(self.max_body, self._lost), self.host, self.port, ssl=self._ssl,
                server_hostname=self.host if self._ssl is not None else None)
            if not self.closed:
                return conn
            conn.close()  # the pool closed while it connected
        raise ConnectionResetError("closed: a config reload replaced it, or mmguard is stopping")

    def _lost(self, conn: _Conn) -> None:
        self._closing.discard(conn)
        if self._gone is not None and not self._closing:
            self._gone.set()

    def close(self) -> None:
        """Close the idle connections, open no more; one in use closes when handed back."""
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        while self._idle:
            conn = self._idle.pop()
            if not conn.lost:
                self._closing.add(conn)
            conn.close()

    async def aclose(self, within_s: float = 1.0) -> None:
        """``close``; wait for a TLS goodbye (an ended loop would leak it), then abort."""
        self.close()
        if self._closing:
            self._gone = asyncio.Event()
            try:
                await asyncio.wait_for(self._gone.wait(), within_s)
            except TimeoutError:
                for conn in list(self._closing):  # connected, so each has a transport
                    conn.transport.abort()  # type: ignore[union-attr]
        await asyncio.sleep(0)  # a lost transport lets its socket go on the next turn


class Streamed:
    """A streamed answer: its status, headers and ``body``; ``release`` exactly once."""

    def __init__(self, pool: HttpPool, conn: _Conn, head: _Head) -> None:
        self._pool, self._conn = pool, conn
        self.status, self.headers, self.body = head.status, head.headers, head.body
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.body.unwatch()
            whole = self.body.ended and self.body.error is None  # all of it came
            self._pool._release(self._conn, whole)
