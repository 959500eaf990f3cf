"""What each HTTP listener (the KServe v2 / OpenAI one and the admin one) enforces before any front
sees a request, so that no client can hold the proxy's descriptors, memory or handlers.

What MUST hold (every refusal counted in ``mmguard_listener_refusals_total{listener, limit}``):

- Open connections are capped (``max_connections``). At the cap a new connection takes the place
  of the oldest one that has no request in progress — an idle keep-alive connection or one still
  dripping its headers — so a flood of slow clients cannot lock good clients out; when every
  open connection has a request in progress the new one gets 503 and is closed.
- Headers are complete within ``header_timeout_s`` of the connection's start or its previous
  answer (aiohttp's keep-alive timer, which also fires while a request line or header is still
  arriving); TLS handshakes have as long.
- A body arrives within ``body_timeout_s`` and, after a 5 s start, at ``min_body_bytes_per_s``
  or more; otherwise 408 and the connection is closed.
- Header bytes in all, concurrent requests and (admin) body size, as before: see each guard.
- A request aiohttp's parser refuses is answered and logged by mmguard (``malformed``).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from aiohttp.web_protocol import RequestHandler

from proxy.call import LocalReply
from proxy.errors import ErrorKind
from proxy.fronts.http_v2 import error_response
from proxy.process import malformed

RATE_GRACE_S = 5.0
"""A body's first seconds are not held to the minimum rate (TCP slow start, a client's pause)."""


class ConnectionCap:
    """``max_connections`` of one listener: admits, evicts or refuses each new connection."""

    def __init__(self, limit: int, listener: str, refused: Any) -> None:
        self.limit = limit
        self.listener = listener
        self.refused = refused
        self.busy: set[Any] = set()
        """Connections with a request in progress (kept by ``middleware``, and by the fast
        lane's connections themselves)."""
        self._opened: dict[Any, None] = {}  # insertion order: oldest first
        self.lanes: set[Any] = set()
        """Connections open on the fast lane (``proxy.process.fast_lane``)."""
        self._handler_cls = malformed.handler_class(listener, refused)

    def handler(self, server: web.Server) -> RequestHandler:
        """A new aiohttp handler for one connection (parser errors answered by mmguard)."""
        return malformed.adopt(server(), self._handler_cls)

    def protocol_factory(self, server: web.Server,
                         lane: Callable[[], asyncio.Protocol] | None = None) -> Any:
        def admit() -> asyncio.BaseProtocol:
            live = set(server.connections) | self.lanes
            for handler in [h for h in self._opened if h not in live]:
                del self._opened[handler]
            if len(live) >= self.limit and not self._evict_one(live):
                self.refused.labels(self.listener, "max_connections").inc()
                return _Refused(self.limit, self.listener)
            if lane is not None:
                connection = lane()
                self.lanes.add(connection)
            else:
                connection = self.handler(server)
            self._opened[connection] = None
            return connection

        return admit

    def handed_over(self, lane: Any, handler: asyncio.BaseProtocol) -> None:
        """A lane connection now served by aiohttp: the same place in the cap's count."""
        self.lanes.discard(lane)
        self._opened.pop(lane, None)
        self._opened[handler] = None

    def lane_closed(self, lane: Any) -> None:
        self.lanes.discard(lane)
        self._opened.pop(lane, None)
        self.busy.discard(lane)

    async def drain_lanes(self, grace_s: float) -> None:
        """At shutdown: idle lane connections close now; a request in progress has up to
        ``grace_s`` to be answered (its connection closes after), then the rest close."""
        for lane in list(self.lanes):
            lane.closing = True
            if not lane.busy:
                lane.force_close()
        deadline = asyncio.get_running_loop().time() + grace_s
        while any(lane.busy for lane in self.lanes):
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for lane in list(self.lanes):
            lane.force_close()

    def _evict_one(self, live: set[Any]) -> bool:
        for handler in self._opened:
            if handler in live and handler not in self.busy:
                del self._opened[handler]
                self.refused.labels(self.listener, "max_connections_evicted").inc()
                handler.force_close()
                return True
        return False

    def middleware(self) -> Middleware:
        @web.middleware
        async def in_progress(request: web.Request, handler: Handler) -> web.StreamResponse:
            protocol = request.protocol
            self.busy.add(protocol)
            try:
                return await handler(request)
            finally:
                self.busy.discard(protocol)

        return in_progress


class _Refused(asyncio.Protocol):
    """A connection over the cap: one 503 and closed, before anything of it is read."""

    def __init__(self, limit: int, listener: str) -> None:
        body = json.dumps({"error": f"listeners.{listener}.max_connections ({limit}) connections "
                                    f"are open and each has a request in progress; retry "
                                    f"later"}).encode()
        self.answer = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                       b"Retry-After: 1\r\nmmguard-error-origin: proxy\r\nConnection: close\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not its subclasses
        transport.write(self.answer)
        # Closing with the client's request unread would reset the connection before the
        # client reads the answer: say we are done, drop what comes, close within a second.
        if transport.can_write_eof():
            transport.write_eof()
        asyncio.get_running_loop().call_later(_REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the transport closes itself


_REFUSED_LINGER_S = 1.0


class CappedSite(web.TCPSite):
    """A TCP site whose connections pass ``ConnectionCap`` and whose TLS handshakes are timed."""

    __slots__ = ("_cap", "_grace_s", "_handshake_timeout_s", "_lane", "_reuse")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, cap: ConnectionCap,
                 ssl_context: ssl.SSLContext | None, handshake_timeout_s: float,
                 reuse_port: bool = False, lane: Callable[[], asyncio.Protocol] | None = None,
                 grace_s: float = 0.0, backlog: int = 128) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context, reuse_port=reuse_port,
                         backlog=backlog)
        self._reuse = reuse_port
        self._cap = cap
        self._handshake_timeout_s = handshake_timeout_s
        self._lane = lane
        self._grace_s = grace_s

    async def stop(self) -> None:
        await super().stop()  # no new connection
        await self._cap.drain_lanes(self._grace_s)

    async def start(self) -> None:
        self._runner._reg_site(self)  # what BaseSite.start does
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._cap.protocol_factory(server, self._lane), self._host, self._port,
            ssl=self._ssl_context,
            backlog=self._backlog, reuse_port=self._reuse,
            ssl_handshake_timeout=self._handshake_timeout_s if self._ssl_context else None)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port


def body_deadline(timeout_s: float, min_rate: int, listener: str, refused: Any) -> Middleware:
    """A body must be in within ``timeout_s`` and, after ``RATE_GRACE_S``, arrive at
    ``min_rate`` bytes/s; else 408 and the connection closed (the handler's read fails)."""

    @web.middleware
    async def body_deadline(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.body_exists or request.content.is_eof():
            return await handler(request)  # no body, or all of it in already: nothing to watch
        watch = _BodyWatch(request.content, timeout_s, min_rate, listener)
        try:
            response = await handler(request)
        except Exception:
            if watch.tripped is None:
                raise
            response = web.Response()  # replaced below: the slow body is the cause
        finally:
            watch.cancel()
        if watch.tripped is None:
            return response
        refused.labels(listener, watch.tripped).inc()
        return _refusal(408, watch.message)

    return body_deadline


class _SlowBody(Exception):
    """Set on a request's body stream when it is too slow: the front's read raises it."""


class _BodyWatch:
    def __init__(self, content: Any, timeout_s: float, min_rate: int, listener: str) -> None:
        self.content = content
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.listener = listener
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.tripped: str | None = None
        self.message = ""
        self._handle: asyncio.TimerHandle | None = self.loop.call_later(1.0, self._check)

    def _check(self) -> None:
        self._handle = None
        if self.content.is_eof():
            return
        slow = slow_body(self.loop.time() - self.start, int(self.content.total_bytes),
                         self.timeout_s, self.min_rate, self.listener)
        if slow is not None:
            self._trip(*slow)
        else:
            self._handle = self.loop.call_later(1.0, self._check)

    def _trip(self, limit: str, message: str) -> None:
        self.tripped, self.message = limit, message
        self.content.set_exception(_SlowBody(message))

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def slow_body(elapsed: float, got: int, timeout_s: float, min_rate: int,
              listener: str) -> tuple[str, str] | None:
    """Whether a body ``elapsed`` seconds after its headers, ``got`` bytes in, is too slow:
    (the limit it broke, the message), or None."""
    if elapsed >= timeout_s:
        return "body_timeout_s", (f"the request body was not complete after "
                                  f"listeners.{listener}.body_timeout_s ({timeout_s:g} s; "
                                  f"{got} bytes came)")
    if min_rate and elapsed >= RATE_GRACE_S and got < min_rate * elapsed:
        return "min_body_bytes_per_s", (f"the request body arrives at {got / elapsed:.0f} "
                                        f"bytes/s, under listeners.{listener}."
                                        f"min_body_bytes_per_s ({min_rate})")
    return None


def header_budget(limit: int, listener: str, refused: Any) -> Middleware:
    """All headers together within ``limit`` bytes (aiohttp bounds only each line)."""

    @web.middleware
    async def header_budget(request: web.Request, handler: Handler) -> web.StreamResponse:
        size = sum(len(k) + len(v) + 4 for k, v in request.raw_headers)  # "k: v\r\n"
        if size <= limit:
            return await handler(request)
        refused.labels(listener, "max_header_bytes").inc()
        return _refusal(431, f"request headers are {size} bytes, over "
                             f"listeners.{listener}.max_header_bytes ({limit})")

    return header_budget


class InFlight:
    """Requests in progress on one listener, against ``max_concurrent_requests`` (counted by
    aiohttp's middleware and by the fast lane alike)."""

    __slots__ = ("count", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0


def concurrency_limit(in_flight: InFlight, listener: str, refused: Any) -> Middleware:
    """At most ``in_flight.limit`` requests at once; health probes always pass (an
    orchestrator must not restart a busy proxy)."""
    limit = in_flight.limit

    @web.middleware
    async def concurrency_limit(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v2/health/"):
            return await handler(request)
        if in_flight.count >= limit:
            refused.labels(listener, "max_concurrent_requests").inc()
            return error_response(LocalReply(
                ErrorKind.OVERLOADED, f"listeners.{listener}.max_concurrent_requests ({limit}) "
                f"requests are in progress; retry later", retry_after_s=1.0))
        in_flight.count += 1
        try:
            return await handler(request)
        finally:
            in_flight.count -= 1

    return concurrency_limit


def body_limit(limit: int, listener: str, refused: Any) -> Middleware:
    """Bodies must declare their length, within ``limit``; refused before a byte is read."""

    @web.middleware
    async def body_limit(request: web.Request, handler: Handler) -> web.StreamResponse:
        length = request.content_length
        if request.body_exists and length is None:
            refused.labels(listener, "max_request_bytes").inc()
            return _refusal(411, "a request body needs a Content-Length here")
        if length is not None and length > limit:
            refused.labels(listener, "max_request_bytes").inc()
            return _refusal(413, f"request body is {length} bytes, over "
                                 f"listeners.{listener}.max_request_bytes ({limit})")
        return await handler(request)

    return body_limit


def _refusal(status: int, message: str) -> web.Response:
    response = web.json_response({"error": message}, status=status,
                                 headers={"mmguard-error-origin": "proxy"})
    response.force_close()  # whatever the client still sends is not read
    return response
