"""The floor for a Python asyncio proxy: bare grpc.aio and aiohttp pass-through, nothing else.

    python -m bench.passthrough_proxy GRPC_PORT HTTP_PORT TRITON_GRPC TRITON_HTTP

Same transport stack as mmguard (grpc.aio server + one grpc.aio channel; aiohttp server + one
aiohttp client session), same message-size limits, but no parsing, no filters, no metrics, no
tracing: ModelInfer bytes go to Triton and back untouched; an HTTP body is forwarded to
``/v2/models/<model without a trailing _h>/infer``. ``python -m bench.proxy --floor`` measures it
next to mmguard, so that mmguard's own cost can be told apart from the cost of the stack it runs
on.
Prints ``ready`` once both ports listen.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import grpc
from aiohttp import ClientSession, TCPConnector, web

HEADER_LENGTH = "Inference-Header-Content-Length"
LIMIT = 256 << 20


async def serve(grpc_port: int, http_port: int, triton_grpc: str, triton_http: str) -> None:
    opts = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]
    channel = grpc.aio.insecure_channel(triton_grpc, options=opts)
    upstream = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

    async def model_infer(body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            # grpc has no type information here (ignore_missing_imports): the answer is Any
            return await upstream(body, timeout=30)  # type: ignore[no-any-return]
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
            return b""

    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {"ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer)})
    server = grpc.aio.server(options=opts)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await server.start()

    session = ClientSession(connector=TCPConnector(limit=64, keepalive_timeout=60),
                            auto_decompress=False)

    async def infer(request: web.Request) -> web.Response:
        body = await request.read()
        model = request.match_info["model"].removesuffix("_h")
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json"),
                   "Accept-Encoding": "identity"}
        if HEADER_LENGTH in request.headers:
            headers[HEADER_LENGTH] = request.headers[HEADER_LENGTH]
        async with session.post(f"http://{triton_http}/v2/models/{model}/infer", data=body,
                                headers=headers) as r:
            data = await r.read()
            out = {HEADER_LENGTH: r.headers[HEADER_LENGTH]} if HEADER_LENGTH in r.headers else {}
            return web.Response(body=data, status=r.status, headers=out,
                                content_type=r.headers.get("Content-Type", "application/json"))

    app = web.Application(client_max_size=LIMIT)
    app.router.add_post("/v2/models/{model}/infer", infer)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", http_port).start()
    print("ready", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await server.stop(0)
    await session.close()
    await channel.close()


if __name__ == "__main__":
    g, h, tg, th = sys.argv[1:5]
    asyncio.run(serve(int(g), int(h), tg, th))
