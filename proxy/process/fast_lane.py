"""The HTTP listener's fast lane: KServe v2 infer requests and the OpenAI inference endpoints
(chat, completions, responses, embeddings, pooling, invocations: streamed or not) served on a
bare asyncio protocol, everything else on aiohttp, on the same port and connection.

Why: aiohttp's request and response objects, its stream reader and its writer are most of an
HTTP request's CPU in mmguard (``bench/README.md``, "The transport lab": a bare protocol
serves the same pass-through for 0.17–0.57× of aiohttp's CPU). The inference requests are the
ones that carry the traffic, so they alone take the short road.

What MUST hold:

- **Nothing changes for a client** but the CPU: the same checks in the same order and the same
  answers, byte for byte in status, headers (but ``Date``) and body, as the aiohttp path; both
  call ``HttpFront.infer_bounds`` and ``HttpFront.serve_infer`` (KServe v2), or
  ``OpenAIFront.body_bounds`` and ``OpenAIFront.infer`` through an exchange
  (``proxy.fronts.exchange``; the lane's is ``proxy.process.lane_exchange``: an SSE stream
  chunked as aiohttp chunks it, a write that waits while the client reads slower).
- **Only the plain case is taken.** A connection starts on the lane; each request's head is
  parsed by httptools (llhttp). A request the lane does not take whole — any method, path,
  HTTP version or framing but ``POST /v2/models/<m>[/versions/<v>]/infer`` or ``POST`` to an
  OpenAI inference endpoint over HTTP/1.1 with
  one ``Content-Length`` and no ``Transfer-Encoding`` or upgrade; a head the parser refuses;
  a line or a head over ``max_header_bytes``; a body the headers already refuse (encoding,
  length); ``max_concurrent_requests`` reached — is handed, with every byte read of it, to
  aiohttp's handler, which keeps the connection from then on and answers as it always did.
- **Every listener guard holds on the lane**: the connection cap (a lane connection is counted,
  evicted when idle, busy while its request is in progress), ``header_timeout_s`` (from the
  connection's start or its previous answer, silent close, as aiohttp's keep-alive timer),
  ``body_timeout_s`` and ``min_body_bytes_per_s`` (408 with the same message, counted), the
  shared in-flight count, and draining at shutdown (in-flight requests finish within the
  grace; idle connections close at once).
- A client that pipelines its next request gets it read after the answer, in order.

``listeners.http.fast_lane: false`` serves everything on aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import httptools
from aiohttp.tcp_helpers import tcp_keepalive
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.call import LocalReply
from proxy.errors import ErrorKind, ProxyError
from proxy.fronts.body import BodyBounds
from proxy.fronts.http_v2 import HttpFront, InferAnswer, InferRequest, error_parts
from proxy.process import listeners as guard
from proxy.process.lane_exchange import LaneExchange
from proxy.process.lane_wire import COMPRESS_INLINE_BYTES, answer_head, compress, mime
from proxy.shm.fronts import connection_of
from proxy.wire import openai

log = logging.getLogger("mmguard.http")

_INFER = re.compile(r"/v2/models/([^/?#%{}]+)(?:/versions/([0-9]+))?/infer(?:\?[^#]*)?")
"""What aiohttp's router sends to the infer handler, less percent-escapes (aiohttp decodes
them; the lane hands such paths over rather than decode them differently)."""
_OPENAI = frozenset(openai.INFERENCE)
"""The OpenAI endpoints whose calls go through the model's chain (chat, completions, ...)."""


@dataclass(slots=True)
class LaneSettings:
    """One listener's lane: its front, its guards, and how to hand a connection to aiohttp."""

    front: HttpFront
    listener: str
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    min_body_bytes_per_s: int
    refused: Any
    cap: guard.ConnectionCap
    in_flight: guard.InFlight | None
    handoff: Callable[[], asyncio.Protocol]
    """A new aiohttp handler for a connection the lane gives up."""
    served: Any
    """``mmguard_http_fast_lane_requests_total{outcome="served"}``."""
    handed_over: Any


@dataclass(frozen=True, slots=True)
class _Taken:
    """A request's head the lane serves."""

    model: str
    version: str
    headers: CIMultiDictProxy[str]
    keep_alive: bool
    length: int
    expect: bool
    bounds: BodyBounds
    json_part: int | None
    endpoint: str | None = None
    """The OpenAI endpoint; None for a KServe v2 infer."""


@dataclass(slots=True)
class _Head:
    """What llhttp's callbacks give of a head (its method and version are the parser's)."""

    url: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    complete: bool = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.complete = True


class FastLane(asyncio.Protocol):
    """One client connection while it is on the lane (see the module's rules)."""

    def __init__(self, lane: LaneSettings) -> None:
        self.lane = lane
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.raw = bytearray()  # the current request's bytes until its head is taken
        self.pending = b""  # bytes past the request being served (a pipelined next one)
        self.body: list[bytes] | None = None  # while its body comes in
        self.need = 0
        self.got = 0
        self.request: _Taken | None = None
        self.serving = False
        self.closing = False  # draining: the answer in progress is the connection's last
        self.gone = False
        self.handed = False
        self.eof = False  # the client sends no more
        self.refused = False  # a too-slow body was answered 408; the connection is closing
        self._timer: asyncio.TimerHandle | None = None
        self._body_start = 0.0
        self._task: asyncio.Task[None] | None = None
        self._drain: asyncio.Future[None] | None = None  # while the transport's buffer is full

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not its subclasses
        tcp_keepalive(self.transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # answered 408 and closing: the rest of its body is dropped unread
        if self.serving or self.pending:
            self.pending += data  # read after the answer: HTTP/1.1 answers in order
            if self.transport is not None:
                self.transport.pause_reading()
        elif self.body is not None:
            self._body_data(data)
        else:
            self._read_head(data)

    def eof_received(self) -> bool:
        # The client sends no more. HTTP/1.1 has no half-close: as aiohttp, nginx and Envoy
        # read it, the client left, and a call it was waiting for is cancelled
        # (connection_lost, once the transport has closed itself).
        self.eof = True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self.resume_writing()  # a stream waiting for the client to read: it never will
        self._cancel_timer()
        if self.body is not None:  # left while its body came in: nothing of it is served
            self.body = None
            self._release()
        elif self.serving and self._task is not None and not self._task.done():
            # left while served: its call is cancelled, as grpc.aio cancels a call whose client
            # left, so the backend stops (its connection closes) and the call counts as
            # cancelled
            self._task.cancel()
        self.lane.cap.lane_closed(self)

    def force_close(self) -> None:
        """Evicted at the cap, or closed idle while draining."""
        if self.transport is not None:
            self.transport.close()

    @property
    def busy(self) -> bool:
        return self.body is not None or self.serving

    # --- the head ----------------------------------------------------------------------------

    def _await_head(self) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(self.lane.header_timeout_s, self.force_close)

    def _read_head(self, data: bytes) -> None:
        if self.raw:  # a head in pieces
            self.raw += data
            data = bytes(self.raw)
        end = data.find(b"\r\n\r\n")
        if end < 0:
            if not self.raw:
                self.raw += data
            if len(data) > self.lane.max_header_bytes or b"\n\n" in data:
                self._hand_over()  # aiohttp's parser says what is wrong with it
            return
        taken = self._take(data[:end + 4])
        if taken is None:
            if not self.raw:
                self.raw += data
            self._hand_over()
            return
        rest = data[end + 4:]
        self.raw = bytearray()
        self._cancel_timer()
        self.request = taken
        self.need = taken.length
        if self.lane.in_flight is not None:
            self.lane.in_flight.count += 1
        self.lane.cap.busy.add(self)
        self.body, self.got = [], 0
        self._body_start = self.loop.time()
        if taken.expect and len(rest) < self.need and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._body_data(rest)

    def _take(self, head: bytes) -> _Taken | None:
        """The head of a request the lane serves whole; None: aiohttp's to serve."""
        got = _Head()
        parser = httptools.HttpRequestParser(got)
        try:
            parser.feed_data(head)
        except httptools.HttpParserError:
            return None
        if (not got.complete or parser.get_method() != b"POST"
                or parser.get_http_version() != "1.1" or parser.should_upgrade()):
            return None
        url = got.url.decode("latin-1")
        match = _INFER.fullmatch(url)
        endpoint = url.partition("?")[0] if match is None else None
        limit = self.lane.max_header_bytes
        if (match is None and endpoint not in _OPENAI) or head.index(b"\r\n") > limit:
            return None
        headers: CIMultiDict[str] = CIMultiDict()
        size = 0
        for name, value in got.headers:
            size += len(name) + len(value) + 4  # "k: v\r\n", as the header budget counts
            if len(name) + len(value) + 2 > limit:
                return None
            headers.add(name.decode("utf-8", "surrogateescape"),
                        value.decode("utf-8", "surrogateescape"))
        lengths = headers.getall("Content-Length", [])
        expect = headers.get("Expect", "").lower()
        if (size > limit or len(lengths) != 1
                or not (lengths[0].isascii() and lengths[0].isdigit())
                or "Transfer-Encoding" in headers or expect not in ("", "100-continue")):
            return None
        in_flight = self.lane.in_flight
        if in_flight is not None and in_flight.count >= in_flight.limit:
            return None  # aiohttp's guard refuses it, and counts it
        view = CIMultiDictProxy(headers)
        length = int(lengths[0])
        try:
            if match is None:
                bounds, json_part = self.lane.front.openai.body_bounds(view, length), None
            else:
                bounds, json_part = self.lane.front.infer_bounds(view, length)
        except ProxyError:
            return None  # aiohttp refuses it the same way, with the body read or not
        keep_alive = parser.should_keep_alive()
        if match is None:
            return _Taken("", "", view, keep_alive, length, expect == "100-continue", bounds,
                          None, endpoint)
        return _Taken(match[1], match[2] or "", view, keep_alive, length,
                      expect == "100-continue", bounds, json_part)

    def _hand_over(self) -> None:
        """aiohttp's handler takes the connection, with every byte read of the request."""
        self._cancel_timer()
        transport = self.transport
        if transport is None or self.handed or self.gone:
            return
        self.handed = True
        self.lane.handed_over.inc()
        handler = self.lane.handoff()
        self.lane.cap.handed_over(self, handler)
        transport.set_protocol(handler)
        handler.connection_made(transport)
        data, self.raw = bytes(self.raw), bytearray()
        if data:
            handler.data_received(data)

    # --- the body ----------------------------------------------------------------------------

    def _body_data(self, data: bytes) -> None:
        assert self.body is not None
        if data:
            self.body.append(data)
            self.got += len(data)
        if self.got < self.need:
            if self._timer is None:
                self._timer = self.loop.call_later(1.0, self._watch_body)
            return
        self._cancel_timer()
        whole = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body = None
        if len(whole) > self.need:
            self.pending = whole[self.need:]
            whole = whole[:self.need]
            if self.transport is not None:
                self.transport.pause_reading()
        self.serving = True
        self.lane.served.inc()
        self._task = self.loop.create_task(self._serve(whole))  # held: a bare task may be GC'd
        self._task.add_done_callback(self._served)

    def _served(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() and self.serving:  # its client left (before it even started, too)
            self._done(keep_alive=False)

    def _watch_body(self) -> None:
        self._timer = None
        if self.body is None:
            return
        slow = guard.slow_body(self.loop.time() - self._body_start, self.got,
                               self.lane.body_timeout_s, self.lane.min_body_bytes_per_s,
                               self.lane.listener)
        if slow is None:
            self._timer = self.loop.call_later(1.0, self._watch_body)
            return
        limit, message = slow
        self.lane.refused.labels(self.lane.listener, limit).inc()
        self.refused = True
        self.body = None
        self._release()
        self._write(408, {"mmguard-error-origin": "proxy"},  # as guard's refusals write it
                    json.dumps({"error": message}).encode(), "application/json; charset=utf-8",
                    close=True)
        transport = self.transport
        if transport is not None:  # as for a connection over the cap: say so, drop the rest
            if transport.can_write_eof():
                transport.write_eof()
            self.loop.call_later(1.0, transport.close)

    # --- the answer --------------------------------------------------------------------------

    async def _serve(self, raw: bytes) -> None:
        taken = self.request
        assert taken is not None
        keep_alive = taken.keep_alive
        transport = self.transport
        try:
            if taken.endpoint is not None:
                await self._serve_openai(taken, raw)
                return
            try:
                answer = await self.lane.front.serve_infer(InferRequest(
                    taken.model, taken.version, taken.headers, raw, taken.bounds,
                    taken.json_part, mime(taken.headers.get("Content-Type")),
                    lambda: connection_of(transport)))
            except ProxyError as err:
                answer = InferAnswer({}, error=LocalReply.from_error(err))
            await self._answer(answer, keep_alive)
        except Exception:  # a bug of ours: the client gets a 500, the log says what
            log.exception("fast lane: a request failed")
            _, _, body = error_parts(LocalReply(ErrorKind.INTERNAL, "internal error in mmguard",
                                                "proxy"))
            self._write(500, {"mmguard-error-origin": "proxy"}, body,
                        "application/json", close=True)
            self._done(keep_alive=False)

    async def _serve_openai(self, taken: _Taken, raw: bytes) -> None:
        assert taken.endpoint is not None
        ex = LaneExchange(self, taken.headers, raw)
        try:
            plain = await self.lane.front.openai.infer(ex, taken.endpoint)
        except Exception:
            if not ex.streamed:
                raise  # answered 500 by the caller
            log.exception("fast lane: an OpenAI stream failed")  # its head is out: cut it
            if self.transport is not None:
                self.transport.abort()
            self._done(keep_alive=False)
            return
        if plain is None:  # streamed: its head said whether the connection ends with it
            self._done(keep_alive=not ex.closes)
            return
        close = not taken.keep_alive or self.closing
        headers = dict(plain.headers)
        content_type = headers.pop("Content-Type", "application/json")
        self._write(plain.status, headers, plain.body, content_type, close)
        self._done(keep_alive=not close)

    # --- what the OpenAI exchange uses (proxy.process.lane_exchange) -------------------------

    def stream_close(self) -> bool:
        taken = self.request
        return self.closing or taken is None or not taken.keep_alive

    async def drained(self) -> None:
        if self._drain is not None:
            await asyncio.shield(self._drain)

    def pause_writing(self) -> None:
        if self._drain is None:
            self._drain = self.loop.create_future()

    def resume_writing(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    async def _answer(self, answer: InferAnswer, keep_alive: bool) -> None:
        close = not keep_alive or self.closing
        if answer.error is not None:
            if answer.error.reset and self.transport is not None:
                self.transport.abort()  # an injected "connection reset": no answer at all
                self._done(keep_alive=False)
                return
            status, headers, body = error_parts(answer.error, answer.decisions)
            self._write(status, headers, body, "application/json", close)
        else:
            headers, body = answer.headers(), answer.body
            if answer.coding is not None:
                body = (await asyncio.to_thread(compress, body, answer.coding)
                        if len(body) > COMPRESS_INLINE_BYTES else compress(body, answer.coding))
                headers["Content-Encoding"] = answer.coding
            self._write(200, headers, body, answer.content_type, close)
        self._done(keep_alive=not close)

    def _write(self, status: int, headers: dict[str, str], body: bytes, content_type: str,
               close: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return  # the client left: nothing to say (aiohttp drops it the same way)
        head = answer_head(status, {"Content-Type": content_type, **headers},
                         f"Content-Length: {len(body)}", close)
        if len(body) < 16384:
            transport.write(head + body)
        else:
            transport.writelines((head, body))

    def _done(self, keep_alive: bool) -> None:
        self.serving = False
        self.request = None
        self._release()
        transport = self.transport
        if transport is None or self.gone:
            return
        if not keep_alive or self.closing or self.eof:
            transport.close()
            return
        self._await_head()
        data, self.pending = self.pending, b""
        transport.resume_reading()
        if data:
            self.data_received(data)

    def _release(self) -> None:
        self.lane.cap.busy.discard(self)
        if self.lane.in_flight is not None:
            self.lane.in_flight.count -= 1

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
