"""The KServe v2 gRPC front (``inference.GRPCInferenceService``), wire-compatible with Triton.

ModelInfer and ModelStreamInfer take and give raw bytes (no generated (de)serializers), so an
unedited request and answer cross mmguard without being re-encoded. Decisions made by filters go
out as trailing metadata (``mmguard-*``); errors are encoded through ``proxy.errors.STATUS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from proxy import codec_grpc, shm_fronts
from proxy.call import Call, LocalReply, Result, StreamItem
from proxy.dataplane import DataPlane
from proxy.errors import STATUS, ErrorKind, ProxyError
from proxy.pb import grpc_service_pb2 as pb
from proxy.shm import SharedMemory, uses_shared_memory

SERVICE = "inference.GRPCInferenceService"
STREAM_QUEUE = 8
"""Answers of one ModelStreamInfer stream that may wait for a client that does not read."""
_UNIMPLEMENTED = {
    "RepositoryIndex": "mmguard is a sidecar proxy: it does not manage the model repository; "
                       "ask the model server directly",
    "RepositoryModelLoad": "mmguard does not load models; load them on the model server",
    "RepositoryModelUnload": "mmguard does not unload models; unload them on the model server",
    "TraceSetting": "trace settings are mmguard config (telemetry.otlp_endpoint), not an RPC",
    "LogSettings": "log settings are mmguard config (telemetry.log_level), not an RPC",
}


def client_headers(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k.lower(): v for k, v in (context.invocation_metadata() or ())
            if isinstance(v, str)}


async def abort(context: grpc.aio.ServicerContext, reply: LocalReply,
                decisions: dict[str, str]) -> None:
    trailers = [*decisions.items(), ("mmguard-error-origin", reply.origin)]
    if reply.retry_after_s is not None:
        trailers.append(("retry-after", str(max(1, round(reply.retry_after_s)))))
    context.set_trailing_metadata(tuple(trailers))
    await context.abort(STATUS[reply.kind].grpc, reply.message)


class GrpcFront:
    def __init__(self, plane: DataPlane, shm: SharedMemory | None = None) -> None:
        self.plane = plane
        self.shm = shm or SharedMemory()

    def handler(self) -> grpc.GenericRpcHandler:
        typed: dict[str, tuple[Callable[..., Awaitable[Message]], type[Message]]] = {
            "ServerLive": (self.server_live, pb.ServerLiveRequest),
            "ServerReady": (self.server_ready, pb.ServerReadyRequest),
            "ModelReady": (self.model_ready, pb.ModelReadyRequest),
            "ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest),
            "ModelMetadata": (self.model_metadata, pb.ModelMetadataRequest),
            "ModelConfig": (self.model_config, pb.ModelConfigRequest),
            "ModelStatistics": (self.model_statistics, pb.ModelStatisticsRequest),
        }
        methods: dict[str, grpc.RpcMethodHandler] = {
            name: grpc.unary_unary_rpc_method_handler(
                _typed(fn), request_deserializer=req.FromString,
                response_serializer=lambda m: m.SerializeToString())
            for name, (fn, req) in typed.items()
        }
        methods["ModelInfer"] = grpc.unary_unary_rpc_method_handler(self.model_infer)
        methods["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
            self.model_stream_infer)
        methods.update(shm_fronts.grpc_methods(self.shm))
        for name, why in _UNIMPLEMENTED.items():
            methods[name] = grpc.unary_unary_rpc_method_handler(_unimplemented(name, why))
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    # --- health and metadata ----------------------------------------------------------------

    async def server_live(self, req: pb.ServerLiveRequest, ctx: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.plane.live())

    async def server_ready(self, req: pb.ServerReadyRequest, ctx: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self.plane.ready())

    async def model_ready(self, req: pb.ModelReadyRequest, ctx: Any) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=await self.plane.model_ready(req.name, req.version))

    async def server_metadata(self, req: Any, ctx: Any) -> pb.ServerMetadataResponse:
        meta = self.plane.server_metadata()
        return pb.ServerMetadataResponse(name=str(meta["name"]), version=str(meta["version"]),
                                         extensions=list(meta["extensions"]))  # type: ignore

    async def model_metadata(self, req: pb.ModelMetadataRequest,
                             ctx: Any) -> pb.ModelMetadataResponse:
        c = self.plane.contract(req.name)
        resp = pb.ModelMetadataResponse(name=req.name, versions=list(c.versions),
                                        platform=c.platform)
        for spec, out in ((c.inputs, resp.inputs), (c.outputs, resp.outputs)):
            for t in spec:
                out.add(name=t.name, datatype=t.datatype, shape=list(t.dims))
        return resp

    async def model_config(self, req: pb.ModelConfigRequest, ctx: Any) -> pb.ModelConfigResponse:
        # The whole config as Triton's ModelConfig bytes: fields proxy/pb does not declare stay
        # unknown fields and go out intact.
        resp = pb.ModelConfigResponse()
        resp.config.MergeFromString(self.plane.contract(req.name).config_bytes())
        resp.config.name = req.name
        return resp

    async def model_statistics(self, req: pb.ModelStatisticsRequest,
                               ctx: Any) -> pb.ModelStatisticsResponse:
        resp = pb.ModelStatisticsResponse()
        for name, st in self.plane.model_stats(req.name).items():
            s = resp.model_stats.add(name=name, version=req.version,
                                     last_inference=st.last_inference_ms,
                                     inference_count=st.inference_count,
                                     execution_count=st.execution_count)
            s.inference_stats.success.count = st.success_count
            s.inference_stats.success.ns = st.success_ns
            s.inference_stats.fail.count = st.fail_count
            s.inference_stats.fail.ns = st.fail_ns
        return resp

    # --- inference --------------------------------------------------------------------------

    async def model_infer(self, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            call = codec_grpc.decode_request(body, shared_memory=True)
        except ProxyError as err:
            await abort(context, LocalReply.from_error(err), {})
            return b""
        call.headers = client_headers(context)
        remaining = context.time_remaining()
        if remaining is not None:
            call.deadline = time.monotonic() + remaining
        reply = await (self.shm.infer(call, self.shm.grpc_connection(context.peer()),
                                      self.plane.infer)
                       if uses_shared_memory(call) else self.plane.infer(call))
        if isinstance(reply, LocalReply):
            await abort(context, reply, call.decisions)
            return b""
        try:
            out = codec_grpc.encode_response(call, reply)
        except ProxyError as err:
            await abort(context, LocalReply.from_error(err), call.decisions)
            return b""
        if call.decisions:
            context.set_trailing_metadata(tuple(call.decisions.items()))
        self.plane.telemetry.response_bytes.labels(call.model, "grpc").inc(len(out))
        return out

    async def model_stream_infer(self, requests: AsyncIterator[bytes],
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """A client's requests reach the backend strictly in the order sent: the next one is
        read (and its chain run) only once the backend has answered the previous one in full
        (a decoupled model: up to its final response). That is what sequence models need
        (START, then the rest of a correlation id, in order) and it bounds a stream to one
        request in flight; responses go out in the backend's order. A client that sends
        faster than the backend answers, or never reads, is pushed back on: at most
        ``STREAM_QUEUE`` answers wait for it, then no more requests are read and HTTP/2 flow
        control stops the sender. Errors are stream messages with ``error_message``, as Triton
        sends them, and the stream stays open."""
        headers = client_headers(context)
        out: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=STREAM_QUEUE)

        async def pump() -> None:
            try:
                async for body in requests:
                    try:
                        call = codec_grpc.decode_request(body)
                    except ProxyError as err:
                        await out.put(codec_grpc.stream_error(err.message))
                        continue
                    call.headers = headers
                    # Closed here, not by the garbage collector: a cancelled stream cancels
                    # its backend call at once.
                    async with contextlib.aclosing(self.plane.stream(call)) as items:
                        async for item in items:
                            await out.put(_stream_item(call, item))
            except asyncio.CancelledError:
                raise  # the stream is gone: no end marker, nobody reads it
            except BaseException:
                await out.put(None)
                raise
            await out.put(None)

        reader = asyncio.create_task(pump())
        try:
            while (msg := await out.get()) is not None:
                yield msg
            await reader  # a failure of the pump surfaces as the stream's status
        finally:
            if not reader.done():
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)


def _stream_item(call: Call, item: StreamItem) -> bytes:
    if isinstance(item, LocalReply):
        return codec_grpc.stream_error(item.message)
    if not isinstance(item, Result):
        return codec_grpc.stream_error(f"model '{call.model}' streams server-sent events; "
                                       "call it through the OpenAI front")
    try:
        return codec_grpc.stream_response(codec_grpc.encode_response(call, item))
    except ProxyError as err:
        return codec_grpc.stream_error(err.message)


def _typed(fn: Callable[[Any, Any], Awaitable[Message]]) -> Callable[..., Awaitable[Message]]:
    async def handler(req: Any, context: grpc.aio.ServicerContext) -> Message:
        try:
            return await fn(req, context)
        except ProxyError as err:
            await abort(context, LocalReply.from_error(err), {})
            raise  # unreachable: abort raises

    return handler


def _unimplemented(name: str, why: str) -> Callable[[bytes, Any], Awaitable[bytes]]:
    async def handler(body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await abort(context, LocalReply(ErrorKind.UNIMPLEMENTED, f"{name}: {why}"), {})
        return b""

    return handler
