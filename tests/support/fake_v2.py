"""A hand-written KServe v2 server (HTTP and gRPC) for what no real server can be made to show:
it records the headers it receives (trace propagation) and, on cue, stalls, hangs, garbles its
answer or answers bytes that do not parse. It speaks the real wire protocol and serves one
identity model, ``echo`` (INPUT0 FP32 [-1] → OUTPUT0).

``bad_answer`` cues an answer that parses but whose bytes do not fit its shape (see
``BAD_ANSWERS``), on both protocols, in the binary and the JSON form."""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

import grpc
import numpy as np
from aiohttp import web

from proxy.pb import grpc_service_pb2 as pb
from proxy.pb import model_config_pb2 as mc
from tests.support.loop import BackgroundLoop

SERVICE = "inference.GRPCInferenceService"
# Answers that are not a v2 response: a protobuf field that runs past the end of the message,
# a JSON object cut in the middle.
MALFORMED_GRPC = b"\x0a\x7fecho"
MALFORMED_HTTP = b'{"model_name": "echo", "outputs": [{"name": "OUTPUT0", "datat'
BAD_ANSWERS = {
    "short": "OUTPUT0 one element (4 bytes) short of its shape",
    "long": "OUTPUT0 4 bytes longer than its shape",
    "json-short": "OUTPUT0 as JSON data with one element missing (HTTP)",
    "bytes-cut": "OUTPUT0 as BYTES whose last length prefix runs past the payload",
    "bytes-count": "OUTPUT0 as BYTES with one element fewer than its shape",
    "raw-count": "two outputs declared, one raw_output_contents (gRPC)",
    "binary-extra": "a binary part 4 bytes longer than the outputs declare (HTTP)",
}
META = {"name": "echo", "versions": ["1"], "platform": "fake",
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1]}]}


class FakeV2:
    """Run it with ``with FakeV2() as fake:`` (its own loop thread) or ``await fake.start()``."""

    def __init__(self) -> None:
        self._loop: BackgroundLoop | None = None
        self.headers: list[dict[str, str]] = []
        self.delay_s = 0.0
        self.garble = False  # answer with one element's bytes missing (a broken backend)
        self.bad_answer = ""  # a key of BAD_ANSWERS: an answer whose bytes do not fit
        self.malformed = False  # answer with bytes that are not a v2 response at all
        self.hang = False  # take infer calls and answer none of them until stop()
        self.fail_http = 0  # answer HTTP infer with this status and Triton's {"error": ...}
        self.fail_grpc: grpc.StatusCode | None = None  # abort gRPC infer with this code
        self.grow = 1  # OUTPUT0 is the input repeated this many times (an answer bigger than
        # its request, valid: the last dimension grows with it)
        self._stopping: asyncio.Event | None = None
        self.http_port = self.grpc_port = 0
        self._runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None

    async def start(self) -> None:
        self._stopping = asyncio.Event()

        async def ok(request: web.Request) -> web.Response:
            return web.Response()

        async def meta(request: web.Request) -> web.Response:
            return web.json_response(META)

        async def config(request: web.Request) -> web.Response:
            return web.json_response({"name": "echo", "max_batch_size": 0})

        app = web.Application()
        app.router.add_get("/v2/health/ready", ok)
        app.router.add_get("/v2/models/echo", meta)
        app.router.add_get("/v2/models/echo/ready", ok)
        app.router.add_get("/v2/models/echo/config", config)
        app.router.add_post("/v2/models/echo/infer", self._http_infer)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._grpc = grpc.aio.server()
        self._grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "ServerReady": _unary(lambda req, ctx: pb.ServerReadyResponse(ready=True),
                                  pb.ServerReadyRequest),
            "ModelReady": _unary(lambda req, ctx: pb.ModelReadyResponse(ready=True),
                                 pb.ModelReadyRequest),
            "ModelMetadata": _unary(self._grpc_meta, pb.ModelMetadataRequest),
            "ModelConfig": _unary(lambda req, ctx: pb.ModelConfigResponse(
                config=mc.ModelConfig(name="echo")), pb.ModelConfigRequest),
            "ModelInfer": grpc.unary_unary_rpc_method_handler(
                self._grpc_infer, request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=lambda m: m if isinstance(m, bytes)
                else m.SerializeToString()),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                self._grpc_stream, request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=lambda m: m.SerializeToString()),
        }),))
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        await self._grpc.start()

    def __enter__(self) -> FakeV2:
        self._loop = BackgroundLoop()
        self._loop.run(self.start())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None
        self._loop.run(self.stop())
        self._loop.close()

    async def stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()  # hung calls end, so stopping does not wait on them
        if self._grpc:
            await self._grpc.stop(0)
        if self._runner:
            await self._runner.cleanup()

    async def _http_infer(self, request: web.Request) -> web.Response:
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        await asyncio.sleep(self.delay_s)
        await self._hung()
        if self.fail_http:
            return web.json_response({"error": f"fake failure {self.fail_http}"},
                                     status=self.fail_http)
        if self.malformed:
            return web.Response(body=MALFORMED_HTTP, content_type="application/json")
        body = await request.read()
        hlen = request.headers.get("Inference-Header-Content-Length")
        head = json.loads(body[: int(hlen)] if hlen else body)
        inp = head["inputs"][0]
        cue = self.bad_answer or ("short" if self.garble else "")
        out: dict[str, Any] = {"model_name": "echo", "outputs": [
            {"name": "OUTPUT0", "datatype": "FP32", "shape": inp["shape"]}]}
        if cue.startswith("bytes-"):
            out["outputs"][0]["datatype"] = "BYTES"
            return _binary_answer(out, _bad_bytes(cue, inp["shape"]))
        if cue == "json-short" or not hlen:
            data = inp["data"] if "data" in inp else list(
                np.frombuffer(body[int(hlen or 0):], np.float32).tolist())
            out["outputs"][0]["data"] = data[:-1] if cue == "json-short" else data
            return web.json_response(out)
        raw = body[int(hlen):]
        if self.grow > 1:
            out["outputs"][0]["shape"] = [*inp["shape"][:-1], inp["shape"][-1] * self.grow]
            raw = raw * self.grow
        raw = raw[:-4] if cue == "short" else raw + bytes(4) if cue == "long" else raw
        extra = bytes(4) if cue == "binary-extra" else b""
        return _binary_answer(out, raw, extra)

    async def _hung(self) -> None:
        if self.hang and self._stopping is not None:
            await self._stopping.wait()

    def _grpc_meta(self, req: Any, ctx: Any) -> pb.ModelMetadataResponse:
        r = pb.ModelMetadataResponse(name="echo", versions=["1"], platform="fake")
        r.inputs.add(name="INPUT0", datatype="FP32", shape=[-1])
        r.outputs.add(name="OUTPUT0", datatype="FP32", shape=[-1])
        return r

    async def _grpc_stream(self, requests: Any,
                           ctx: grpc.aio.ServicerContext) -> Any:
        """Each request's answer (bad on cue, as ModelInfer's) as one stream message."""
        async for req in requests:
            resp = await self._grpc_infer(req, ctx)
            if isinstance(resp, bytes):
                resp = pb.ModelInferResponse.FromString(resp)
            yield pb.ModelStreamInferResponse(infer_response=resp)

    async def _grpc_infer(self, req: pb.ModelInferRequest,
                          ctx: grpc.aio.ServicerContext) -> pb.ModelInferResponse | bytes:
        self.headers.append({k: v for k, v in ctx.invocation_metadata() or ()
                             if isinstance(v, str)})
        await asyncio.sleep(self.delay_s)
        await self._hung()
        if self.fail_grpc is not None:
            await ctx.abort(self.fail_grpc, f"fake failure {self.fail_grpc.name}")
        if self.malformed:
            return MALFORMED_GRPC
        cue = self.bad_answer or ("short" if self.garble else "")
        resp = pb.ModelInferResponse(model_name="echo")
        shape = list(req.inputs[0].shape)
        if cue.startswith("bytes-"):
            resp.outputs.add(name="OUTPUT0", datatype="BYTES", shape=shape)
            resp.raw_output_contents.append(_bad_bytes(cue, shape))
            return resp
        raw = req.raw_input_contents[0]
        if self.grow > 1:
            shape, raw = [*shape[:-1], shape[-1] * self.grow], raw * self.grow
        resp.outputs.add(name="OUTPUT0", datatype="FP32", shape=shape)
        resp.raw_output_contents.append(
            raw[:-4] if cue == "short" else raw + bytes(4) if cue == "long" else raw)
        if cue == "raw-count":
            resp.outputs.add(name="OUTPUT1", datatype="FP32", shape=shape)
        return resp


def _bad_bytes(cue: str, shape: list[int]) -> bytes:
    """BYTES elements for ``shape`` with broken framing."""
    count = int(np.prod(shape))
    items = [struct.pack("<I", 3) + b"abc"] * count
    if cue == "bytes-cut":
        items[-1] = struct.pack("<I", 9) + b"abc"  # declares 9 bytes, 3 follow
    else:
        items = items[:-1]
    return b"".join(items)


def _binary_answer(out: dict[str, Any], raw: bytes, extra: bytes = b"") -> web.Response:
    entry = out["outputs"][0]
    entry["parameters"] = {"binary_data_size": len(raw)}
    text = json.dumps(out).encode()
    return web.Response(body=text + raw + extra, headers={
        "Inference-Header-Content-Length": str(len(text))})


def _unary(fn: Any, req_type: Any) -> grpc.RpcMethodHandler:
    async def handler(req: Any, ctx: Any) -> Any:
        return fn(req, ctx)

    return grpc.unary_unary_rpc_method_handler(
        handler, request_deserializer=req_type.FromString,
        response_serializer=lambda m: m.SerializeToString())
