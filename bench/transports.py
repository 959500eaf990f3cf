"""Bare pass-through proxies on alternative Python transports, for the transport lab.

    python -m bench.transports VARIANT PORT TRITON_GRPC TRITON_HTTP

Each is the floor's pass-through (``bench/passthrough_proxy.py``: bytes in, the same bytes to
Triton, its bytes back; no parsing, filters, metrics or tracing) on another stack:

* ``aiohttp`` / ``aiohttp-uvloop``: aiohttp server + one aiohttp client session, on asyncio's
  default loop / on uvloop (mmguard's HTTP stack today, it runs uvloop);
* ``httptools-uvloop``: a raw ``asyncio.Protocol`` server parsing with ``httptools`` (the C
  parser uvicorn uses), upstream over pooled keep-alive connections parsed the same way, on
  uvloop;
* ``aiohttp-rawclient-uvloop``: the aiohttp server of ``aiohttp-uvloop`` with the raw upstream
  connections of ``httptools-uvloop`` (what the client side alone costs);
* ``httptools-aioclient-uvloop``: the raw server of ``httptools-uvloop`` with the aiohttp client
  session of ``aiohttp-uvloop`` (what the server side alone costs);
* ``granian-rsgi``: not run from here: ``granian --interface rsgi bench.transports:rsgi_app``
  (a Rust HTTP server, hyper + tokio, calling the Python app; aiohttp client upstream, uvloop);
* ``grpc-aio`` / ``grpc-aio-uvloop``: grpc.aio server + one grpc.aio channel, raw bytes (no
  (de)serializers), on the default loop / on uvloop (mmguard's gRPC stack today);
* ``grpc-sync``: grpc's thread-pool server (16 threads) + a blocking channel;
* ``grpc-aio-<tuning>`` (only when named): ``grpc-aio`` with the channel arguments of
  ``GRPC_TUNINGS`` on its server and its channel (optimisation target, TCP read sizes, HTTP/2
  frame size and window, BDP probing, the minimal stack).

HTTP variants forward ``/v2/models/<model without a trailing _h>/infer``; gRPC variants
``ModelInfer``. Prints ``ready`` once the port listens.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HEADER_LENGTH = "Inference-Header-Content-Length"
LIMIT = 256 << 20
GRPC_OPTS = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]
GRPC_SERVICE = "inference.GRPCInferenceService"
HTTP_VARIANTS = ("aiohttp", "aiohttp-uvloop", "httptools-uvloop", "aiohttp-rawclient-uvloop",
                 "httptools-aioclient-uvloop", "granian-rsgi")
_Args = list[tuple[str, int | str]]
_TARGET_THROUGHPUT: _Args = [("grpc.optimization_target", "throughput")]
_BIG_READS: _Args = [("grpc.experimental.tcp_min_read_chunk_size", 256 << 10),
                     ("grpc.experimental.tcp_read_chunk_size", 1 << 20),
                     ("grpc.experimental.tcp_max_read_chunk_size", 4 << 20)]
GRPC_TUNINGS: dict[str, _Args] = {
    "grpc-aio-throughput": _TARGET_THROUGHPUT,
    "grpc-aio-latency": [("grpc.optimization_target", "latency")],
    "grpc-aio-nobdp": [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 8 << 20)],
    "grpc-aio-chunks": _BIG_READS,
    "grpc-aio-minimal": [("grpc.minimal_stack", 1)],
    "grpc-aio-frames": [("grpc.http2.max_frame_size", 4 << 20)],
    "grpc-aio-frames-window": [("grpc.http2.max_frame_size", 4 << 20),
                               ("grpc.http2.lookahead_bytes", 8 << 20)],
    "grpc-aio-both": _TARGET_THROUGHPUT + _BIG_READS,
}
"""grpc.aio with channel arguments (server and channel alike), run only when named: none took
the CPU per request past the noise (bench/README.md, "eleventh pass")."""
GRPC_VARIANTS = ("grpc-aio", "grpc-aio-uvloop", "grpc-sync")
GRPC_ALL = (*GRPC_VARIANTS, *GRPC_TUNINGS)


def _upstream_path(path: bytes) -> bytes:
    """/v2/models/X_h/infer → /v2/models/X/infer (the bench's HTTP routes are renamed)."""
    head, _, tail = path.rpartition(b"/")
    return head.removesuffix(b"_h") + b"/" + tail


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()


# --- HTTP: aiohttp -----------------------------------------------------------------------------

async def serve_aiohttp(port: int, triton_http: str) -> None:
    from aiohttp import ClientSession, TCPConnector, web

    session = ClientSession(connector=TCPConnector(limit=64, keepalive_timeout=60),
                            auto_decompress=False)

    async def infer(request: web.Request) -> web.Response:
        body = await request.read()
        path = _upstream_path(request.path.encode()).decode()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json"),
                   "Accept-Encoding": "identity"}
        if HEADER_LENGTH in request.headers:
            headers[HEADER_LENGTH] = request.headers[HEADER_LENGTH]
        async with session.post(f"http://{triton_http}{path}", data=body, headers=headers) as r:
            data = await r.read()
            out = {HEADER_LENGTH: r.headers[HEADER_LENGTH]} if HEADER_LENGTH in r.headers else {}
            return web.Response(body=data, status=r.status, headers=out,
                                content_type=r.headers.get("Content-Type", "application/json"))

    await _serve_aiohttp_app(port, infer)
    await session.close()


async def _serve_aiohttp_app(port: int, infer: Any) -> None:
    """An aiohttp server whose one route is ``infer``, until signalled."""
    from aiohttp import web

    app = web.Application(client_max_size=LIMIT)
    app.router.add_post("/v2/models/{model}/infer", infer)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await _until_signalled()
    await runner.cleanup()


async def serve_aiohttp_rawclient(port: int, triton_http: str) -> None:
    from aiohttp import web

    host, _, up_port = triton_http.rpartition(":")
    upstream = _Pool(host, int(up_port))

    async def infer(request: web.Request) -> web.Response:
        body = await request.read()
        length = request.headers.get(HEADER_LENGTH)
        status, answer = await upstream.forward(
            _upstream_path(request.path.encode()),
            request.headers.get("Content-Type", "application/json").encode(),
            length.encode() if length is not None else None, body)
        h = answer.headers
        out = ({HEADER_LENGTH: h[b"inference-header-content-length"].decode()}
               if b"inference-header-content-length" in h else {})
        return web.Response(body=b"".join(answer.body), status=status, headers=out,
                            content_type=h.get(b"content-type", b"application/json").decode())

    await _serve_aiohttp_app(port, infer)


# --- HTTP: a raw protocol with httptools ---------------------------------------------------------

class _Message:
    """One HTTP/1.1 message as httptools reports it."""

    def __init__(self) -> None:
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.done = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


class _Upstream(asyncio.Protocol):
    """One keep-alive connection to Triton: one request at a time, its answer parsed."""

    def __init__(self) -> None:
        import httptools

        self.httptools = httptools
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, _Message]] | None = None
        self.message = _Message()
        self.parser = httptools.HttpResponseParser(self.message)
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc or ConnectionError("upstream closed"))

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)
        if self.message.done and self.waiter is not None:
            message, self.message = self.message, _Message()
            status = self.parser.get_status_code()
            self.parser = self.httptools.HttpResponseParser(self.message)
            self.waiter.set_result((status, message))

    async def send(self, head: bytes, body: bytes) -> tuple[int, _Message]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.writelines((head, body))
        return await self.waiter


class _Pool:
    """Keep-alive raw upstream connections, one request at a time each."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[_Upstream] = []

    async def forward(self, path: bytes, content_type: bytes, header_length: bytes | None,
                      body: bytes) -> tuple[int, _Message]:
        head = [b"POST " + path + b" HTTP/1.1", b"Host: " + self.host.encode(),
                b"Content-Length: " + str(len(body)).encode(), b"Content-Type: " + content_type,
                b"Accept-Encoding: identity"]
        if header_length is not None:
            head.append(b"Inference-Header-Content-Length: " + header_length)
        up = None
        while self.idle and up is None:
            candidate = self.idle.pop()
            up = None if candidate.lost else candidate
        if up is None:
            _, up = await asyncio.get_running_loop().create_connection(_Upstream, self.host,
                                                                       self.port)
        answer = await up.send(b"\r\n".join(head) + b"\r\n\r\n", body)
        self.idle.append(up)
        return answer


def _answer_head(status: int, length: int, content_type: bytes, header_length: bytes | None
                 ) -> bytes:
    out = [b"HTTP/1.1 %d OK" % status, b"Content-Length: " + str(length).encode(),
           b"Content-Type: " + content_type]
    if header_length is not None:
        out.append(b"Inference-Header-Content-Length: " + header_length)
    return b"\r\n".join(out) + b"\r\n\r\n"


class _RawServer(asyncio.Protocol):
    """A raw server connection parsing with httptools; each whole request to ``_forward``."""

    def __init__(self) -> None:
        import httptools

        self.httptools = httptools
        self.transport: asyncio.Transport | None = None
        self.message = _Message()
        self.parser = httptools.HttpRequestParser(self.message)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)
        if self.message.done:
            message, self.message = self.message, _Message()
            self.parser = self.httptools.HttpRequestParser(self.message)
            asyncio.ensure_future(self._forward(message))  # noqa: RUF006 - ends on its own

    async def _forward(self, message: _Message) -> None:
        raise NotImplementedError

    def _answer(self, head: bytes, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines((head, data))


class _AioclientDownstream(_RawServer):
    """The raw server, forwarding through an aiohttp client session."""

    def __init__(self, session: Any, upstream: str) -> None:
        super().__init__()
        self.session, self.upstream = session, upstream

    async def _forward(self, message: _Message) -> None:
        h = message.headers
        headers = {"Content-Type": h.get(b"content-type", b"application/json").decode(),
                   "Accept-Encoding": "identity"}
        if b"inference-header-content-length" in h:
            headers[HEADER_LENGTH] = h[b"inference-header-content-length"].decode()
        url = f"http://{self.upstream}{_upstream_path(message.url).decode()}"
        async with self.session.post(url, data=b"".join(message.body), headers=headers) as r:
            data = await r.read()
            length = r.headers.get(HEADER_LENGTH)
            head = _answer_head(r.status, len(data),
                                r.headers.get("Content-Type", "application/json").encode(),
                                length.encode() if length is not None else None)
        self._answer(head, data)


async def serve_httptools_aioclient(port: int, triton_http: str) -> None:
    from aiohttp import ClientSession, TCPConnector

    session = ClientSession(connector=TCPConnector(limit=64, keepalive_timeout=60),
                            auto_decompress=False)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _AioclientDownstream(session, triton_http),
                                      "127.0.0.1", port)
    await _until_signalled()
    server.close()
    await session.close()


class _Downstream(_RawServer):
    """The raw server, forwarding over the raw upstream connections."""

    def __init__(self, pool: _Pool) -> None:
        super().__init__()
        self.pool = pool

    async def _forward(self, message: _Message) -> None:
        h = message.headers
        status, answer = await self.pool.forward(
            _upstream_path(message.url), h.get(b"content-type", b"application/json"),
            h.get(b"inference-header-content-length"), b"".join(message.body))
        data = b"".join(answer.body)
        self._answer(_answer_head(status, len(data),
                                  answer.headers.get(b"content-type", b"application/json"),
                                  answer.headers.get(b"inference-header-content-length")), data)


async def serve_httptools(port: int, triton_http: str) -> None:
    host, _, up_port = triton_http.rpartition(":")
    pool = _Pool(host, int(up_port))
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Downstream(pool), "127.0.0.1", port)
    await _until_signalled()
    server.close()


# --- HTTP: granian's RSGI ------------------------------------------------------------------------

_rsgi_session: Any = None


async def rsgi_app(scope: Any, protocol: Any) -> None:
    """granian --interface rsgi bench.transports:rsgi_app (TRITON_HTTP in the environment)."""
    global _rsgi_session
    from aiohttp import ClientSession, TCPConnector

    if _rsgi_session is None:
        _rsgi_session = ClientSession(connector=TCPConnector(limit=64, keepalive_timeout=60),
                                      auto_decompress=False)
    body = await protocol()
    headers = {"Content-Type": scope.headers.get("content-type", "application/json"),
               "Accept-Encoding": "identity"}
    hlen = scope.headers.get("inference-header-content-length")
    if hlen is not None:
        headers[HEADER_LENGTH] = hlen
    path = _upstream_path(scope.path.encode()).decode()
    async with _rsgi_session.post(f"http://{os.environ['TRITON_HTTP']}{path}", data=body,
                                  headers=headers) as r:
        data = await r.read()
        out = [("content-type", r.headers.get("Content-Type", "application/json"))]
        if HEADER_LENGTH in r.headers:
            out.append((HEADER_LENGTH.lower(), r.headers[HEADER_LENGTH]))
        protocol.response_bytes(r.status, out, data)


# --- gRPC ------------------------------------------------------------------------------------

async def serve_grpc_aio(port: int, triton_grpc: str, extra: _Args | None = None) -> None:
    import grpc

    opts = [*GRPC_OPTS, *(extra or [])]
    channel = grpc.aio.insecure_channel(triton_grpc, options=opts)
    upstream = channel.unary_unary(f"/{GRPC_SERVICE}/ModelInfer")

    async def model_infer(body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return await upstream(body, timeout=30)  # type: ignore[no-any-return]  # untyped
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
            return b""

    handler = grpc.method_handlers_generic_handler(
        GRPC_SERVICE, {"ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer)})
    server = grpc.aio.server(options=opts)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await _until_signalled()
    await server.stop(0)
    await channel.close()


def serve_grpc_sync(port: int, triton_grpc: str) -> None:
    import threading

    import grpc

    channel = grpc.insecure_channel(triton_grpc, options=GRPC_OPTS)
    upstream = channel.unary_unary(f"/{GRPC_SERVICE}/ModelInfer")

    def model_infer(body: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return upstream(body, timeout=30)  # type: ignore[no-any-return]  # untyped
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details() or "")
            return b""

    handler = grpc.method_handlers_generic_handler(
        GRPC_SERVICE, {"ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer)})
    server = grpc.server(ThreadPoolExecutor(max_workers=16), options=GRPC_OPTS)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print("ready", flush=True)
    stop.wait()
    server.stop(0)


def main(argv: list[str]) -> None:
    variant, port, triton_grpc, triton_http = argv[0], int(argv[1]), argv[2], argv[3]
    if variant == "grpc-sync":
        serve_grpc_sync(port, triton_grpc)
        return
    if variant in GRPC_TUNINGS:
        asyncio.run(serve_grpc_aio(port, triton_grpc, GRPC_TUNINGS[variant]))
        return
    coro = {"aiohttp": lambda: serve_aiohttp(port, triton_http),
            "aiohttp-uvloop": lambda: serve_aiohttp(port, triton_http),
            "httptools-uvloop": lambda: serve_httptools(port, triton_http),
            "aiohttp-rawclient-uvloop": lambda: serve_aiohttp_rawclient(port, triton_http),
            "httptools-aioclient-uvloop": lambda: serve_httptools_aioclient(port, triton_http),
            "grpc-aio": lambda: serve_grpc_aio(port, triton_grpc),
            "grpc-aio-uvloop": lambda: serve_grpc_aio(port, triton_grpc)}[variant]()
    if variant.endswith("uvloop"):
        import uvloop

        uvloop.run(coro)
    else:
        asyncio.run(coro)


if __name__ == "__main__":
    main(sys.argv[1:])
