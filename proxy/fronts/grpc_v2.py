"""The KServe v2 gRPC front (``inference.GRPCInferenceService``), wire-compatible with Triton.

ModelInfer and ModelStreamInfer take and give raw bytes (no generated (de)serializers), so an
unedited request and answer cross mmguard without being re-encoded. Decisions made by filters go
out as trailing metadata (``mmguard-*``); errors are encoded through ``proxy.errors.STATUS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from proxy import __version__
from proxy.backends.base import RepositoryParameter
from proxy.call import (
    STREAM_MEMORY,
    Call,
    Finish,
    LocalReply,
    Result,
    StreamItem,
    StreamMemory,
)
from proxy.config.listeners import GrpcListener
from proxy.engine.dataplane import DataPlane, refused_extension
from proxy.errors import STATUS, ErrorKind, ProxyError, retry_after
from proxy.pb import grpc_service_pb2 as pb
from proxy.shm import fronts
from proxy.shm.peer import Connection
from proxy.shm.regions import Budget, SharedMemory, Stream, uses_shared_memory
from proxy.wire import kserve_grpc

SERVICE = "inference.GRPCInferenceService"
log = logging.getLogger("mmguard.grpc")
STREAM_QUEUE = 8
"""Messages of one ModelStreamInfer stream that may wait for a client that does not read (an
answer waits in it until gRPC takes it, and only then counts)."""
STREAM_IN_FLIGHT = 8
"""Requests of one ModelStreamInfer stream at the backend at once (decoupled ones stream on)."""
_REFUSED = {"TraceSetting": "trace", "LogSettings": "logging"}
"""RPCs of the v2 extensions mmguard refuses (the HTTP front refuses them with the same text)."""


DECODE_INLINE_BYTES = 1024 * 1024
"""Requests above this are decoded in a worker thread. Decoding is bounded by the shape, yet a
shape-matched body of millions of variable-length BYTES elements still takes a second or more
to walk; a 600 KB image tensor (raw bytes: slices, no walk) stays on the loop."""


async def decode(body: bytes, shared_memory: bool = False) -> Call:
    if len(body) > DECODE_INLINE_BYTES:
        return await asyncio.to_thread(kserve_grpc.decode_request, body, shared_memory)
    return kserve_grpc.decode_request(body, shared_memory)


def client_headers(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k.lower(): v for k, v in (context.invocation_metadata() or ())
            if isinstance(v, str)}


async def abort(context: grpc.aio.ServicerContext, reply: LocalReply,
                decisions: dict[str, str]) -> None:
    trailers = [*decisions.items(), ("mmguard-error-origin", reply.origin)]
    if reply.retry_after_s is not None:
        trailers.append(("retry-after", retry_after(reply.retry_after_s)))
    context.set_trailing_metadata(tuple(trailers))
    await context.abort(STATUS[reply.kind].grpc, reply.message)


class GrpcFront:
    def __init__(self, plane: DataPlane, shm: SharedMemory | None = None,
                 max_request_bytes: int = GrpcListener().max_request_bytes,
                 max_stream_bytes: int | None = None,
                 max_streams_bytes: int = GrpcListener().max_streams_bytes) -> None:
        self.plane = plane
        self.shm = shm or SharedMemory()
        self.shm_budget = Budget(max_request_bytes, "listeners.grpc.max_request_bytes")
        self.stream_bytes = max_stream_bytes or max_request_bytes
        self.streams_held = _Held(max_streams_bytes)
        """Every stream's requests in flight and answers not taken, together."""

    def handler(self) -> grpc.GenericRpcHandler:
        typed: dict[str, tuple[Callable[..., Awaitable[Message]], type[Message]]] = {
            "ServerLive": (self.server_live, pb.ServerLiveRequest),
            "ServerReady": (self.server_ready, pb.ServerReadyRequest),
            "ModelReady": (self.model_ready, pb.ModelReadyRequest),
            "ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest),
            "ModelMetadata": (self.model_metadata, pb.ModelMetadataRequest),
            "ModelConfig": (self.model_config, pb.ModelConfigRequest),
            "ModelStatistics": (self.model_statistics, pb.ModelStatisticsRequest),
            "RepositoryIndex": (self.repository_index, pb.RepositoryIndexRequest),
            "RepositoryModelLoad": (self.repository_load, pb.RepositoryModelLoadRequest),
            "RepositoryModelUnload": (self.repository_unload, pb.RepositoryModelUnloadRequest),
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
        methods.update(fronts.grpc_methods(self.shm))
        for name, extension in _REFUSED.items():
            methods[name] = grpc.unary_unary_rpc_method_handler(_refused(extension))
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    # --- health and metadata ----------------------------------------------------------------

    async def server_live(self, req: pb.ServerLiveRequest, ctx: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.plane.live())

    async def server_ready(self, req: pb.ServerReadyRequest, ctx: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self.plane.ready())

    async def model_ready(self, req: pb.ModelReadyRequest, ctx: Any) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=await self.plane.model_ready(req.name, req.version))

    async def server_metadata(self, req: Any, ctx: Any) -> pb.ServerMetadataResponse:
        meta, source = await self.plane.server_metadata()
        await ctx.send_initial_metadata((("mmguard-version", __version__),
                                         ("mmguard-server-metadata", source)))
        return pb.ServerMetadataResponse(name=meta["name"], version=meta["version"],
                                         extensions=meta["extensions"])

    # --- the repository API (forwarded when v2.repository_api is on) ------------------------

    async def repository_index(self, req: pb.RepositoryIndexRequest,
                               ctx: Any) -> pb.RepositoryIndexResponse:
        backend = self.plane.repository_backend("RepositoryIndex", _authorization(ctx))
        resp = pb.RepositoryIndexResponse()
        for m in await backend.repository_index(req.ready):
            resp.models.add(**m)
        return resp

    async def repository_load(self, req: pb.RepositoryModelLoadRequest,
                              ctx: Any) -> pb.RepositoryModelLoadResponse:
        backend = self.plane.repository_backend("RepositoryModelLoad", _authorization(ctx))
        log.info("repository: load of model %r forwarded to backend %r", req.model_name,
                 backend.name)
        await backend.repository_load(req.model_name, _repository_parameters(req.parameters))
        return pb.RepositoryModelLoadResponse()

    async def repository_unload(self, req: pb.RepositoryModelUnloadRequest,
                                ctx: Any) -> pb.RepositoryModelUnloadResponse:
        backend = self.plane.repository_backend("RepositoryModelUnload", _authorization(ctx))
        log.info("repository: unload of model %r forwarded to backend %r", req.model_name,
                 backend.name)
        await backend.repository_unload(req.model_name, _repository_parameters(req.parameters))
        return pb.RepositoryModelUnloadResponse()

    async def model_metadata(self, req: pb.ModelMetadataRequest,
                             ctx: Any) -> pb.ModelMetadataResponse:
        c = self.plane.contract(req.name, req.version)
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
        resp.config.MergeFromString(self.plane.contract(req.name, req.version).config_bytes())
        resp.config.name = req.name
        return resp

    async def model_statistics(self, req: pb.ModelStatisticsRequest,
                               ctx: Any) -> pb.ModelStatisticsResponse:
        resp = pb.ModelStatisticsResponse()
        for name, (version, st) in self.plane.model_stats(req.name, req.version).items():
            s = resp.model_stats.add(name=name, version=version,
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
            call = await decode(body, shared_memory=True)
        except ProxyError as err:
            self.plane.count_undecoded("grpc", err)
            await abort(context, LocalReply.from_error(err), {})
            return b""
        call.headers = client_headers(context)
        remaining = context.time_remaining()
        if remaining is not None:
            call.deadline = time.monotonic() + remaining
        encoded: list[bytes] = []  # not on the Result: a cached one is shared between calls

        async def encode(result: Result) -> None:  # before the call is counted
            encoded.append(kserve_grpc.encode_response(call, result))

        reply = await (self.shm.infer(call, self.shm.grpc_connection(context.peer()),
                                      self.plane.infer, self.plane.serves, self.shm_budget,
                                      encode)
                       if uses_shared_memory(call) else self.plane.infer(call, encode))
        if isinstance(reply, LocalReply):
            await abort(context, reply, call.shown_decisions())
            return b""
        out = encoded[-1]  # an answer (not a refusal) was encoded before it counted
        if decisions := call.shown_decisions():
            context.set_trailing_metadata(tuple(decisions.items()))
        self.plane.telemetry.count_response_bytes(call.model, "grpc", len(out))
        return out

    async def model_stream_infer(self, requests: AsyncIterator[bytes],
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """A client's requests reach the backend strictly in the order sent (see
        ``_OrderedStream``); responses go out in the backend's order, decoupled ones
        interleaved as they come. Errors are stream messages with ``error_message``, as Triton
        sends them, and the stream stays open."""
        out: asyncio.Queue[Outgoing | None] = asyncio.Queue(maxsize=STREAM_QUEUE)
        remaining = context.time_remaining()  # the stream's deadline is each request's
        stream = _OrderedStream(self.plane, client_headers(context), out,
                                _StreamMemory(self.shm, self.shm.grpc_connection(context.peer()),
                                              self.plane.serves, self.shm_budget),
                                None if remaining is None else time.monotonic() + remaining,
                                _Held(self.stream_bytes, self.streams_held))
        reader = asyncio.create_task(stream.run(requests))
        try:
            while (entry := await out.get()) is not None:
                msg, delivered = entry
                yield msg  # handed to gRPC: only now is its answer counted (``_delivering``)
                if delivered is not None and not delivered.done():
                    delivered.set_result(None)
            await reader  # a failure of the pump surfaces as the stream's status
        finally:
            if not reader.done():
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)


class _OrderedStream:
    """One client stream's requests, each run through the chain and sent to the backend in
    the order the client sent them.

    The next request is read only once the backend has shown it holds the previous one: that
    request's first response (or its end) came back. Sequence models get their requests in
    order (START, then the rest of a correlation id); a decoupled request keeps streaming while
    the next ones go ahead. Bounded: at most ``STREAM_IN_FLIGHT`` requests in flight and
    ``STREAM_QUEUE`` answers waiting for the client; past that no more requests are read and
    HTTP/2 flow control stops a client that sends faster than the backend answers, or never
    reads. Everything is cancelled (backend calls included) when the client goes."""

    def __init__(self, plane: DataPlane, headers: dict[str, str],
                 out: asyncio.Queue[Outgoing | None], shm: _StreamMemory,
                 deadline: float | None, held: _Held) -> None:
        self.plane = plane
        self.headers = headers
        self.out = out
        self.shm = shm
        self.deadline = deadline
        self.held = held
        self.slots = asyncio.Semaphore(STREAM_IN_FLIGHT)
        self.running: set[asyncio.Task[None]] = set()
        self.memory = StreamMemory()  # what filters keep for the stream's later requests

    async def run(self, requests: AsyncIterator[bytes]) -> None:
        try:
            async for body in requests:
                try:
                    call = await decode(body, shared_memory=True)
                except ProxyError as err:
                    # Triton names the request by its id only, before it knows the model
                    await self.out.put((kserve_grpc.stream_error(
                        err.message, "", kserve_grpc.request_id(body)), None))
                    continue
                call.headers = self.headers
                call.deadline = self.deadline
                call.state[STREAM_MEMORY] = self.memory
                await self.slots.acquire()
                # no wait between taking the bytes and the task that gives them back
                if not await self.held.take(len(body)):  # the listener's streams hold enough
                    self.slots.release()
                    refused = self.held.refusal(len(body))
                    self.plane.count_undecoded("grpc", refused)
                    await self.out.put((kserve_grpc.stream_error(refused.message, call.model,
                                                                 call.id), None))
                    continue
                reached = asyncio.Event()
                task = asyncio.create_task(self._answer(call, reached, len(body)))
                self.running.add(task)
                task.add_done_callback(self.running.discard)
                await reached.wait()
            await asyncio.gather(*self.running)
        except asyncio.CancelledError:
            raise  # the stream is gone: no end marker, nobody reads it
        except BaseException:
            await self.out.put(None)
            raise
        finally:
            for task in self.running:
                task.cancel()
            await asyncio.gather(*self.running, return_exceptions=True)
            self.memory.close()
        await self.out.put(None)

    async def _answer(self, call: Call, reached: asyncio.Event, size: int) -> None:
        try:
            # Closed here, not by the garbage collector: a cancelled stream cancels its
            # backend call at once.
            deliver = _delivering(call, self.out, self.held, reached)
            items_of = (self.shm.items(call, self.plane.stream, deliver)
                        if uses_shared_memory(call) else self.plane.stream(call, deliver))
            async with contextlib.aclosing(items_of) as items:
                async for item in items:
                    reached.set()
                    if not isinstance(item, Result):  # an answer went out as it was counted
                        await self.out.put((_stream_item(call, item), None))
        finally:
            reached.set()
            self.slots.release()
            self.held.give(size)


@dataclass(frozen=True)
class _StreamMemory:
    """What a stream's requests need to use system shared memory: the registry, the stream's
    connection (one client for all its requests) and the unary calls' bounds."""

    shm: SharedMemory
    connection: Connection
    serves: Callable[[str], bool]
    budget: Budget

    def items(self, call: Call, stream: Stream, deliver: Finish
              ) -> AsyncGenerator[StreamItem, None]:
        return self.shm.stream(call, self.connection, stream, self.serves, self.budget, deliver)


Outgoing = tuple[bytes, "asyncio.Future[None] | None"]
"""A stream message for the client, and what to resolve once gRPC has taken it."""


def _delivering(call: Call, out: asyncio.Queue[Outgoing | None], held: _Held,
                reached: asyncio.Event) -> Finish:
    """Each answer of a stream encoded as its message and handed to the client, before the
    data plane counts it: an answer still queued when the client leaves (or its deadline
    passes) is counted as the client saw it, cancelled, never as ok. Held (``_Held``) until
    gRPC takes it. The backend has shown it holds the request (``reached``) once an answer
    came, not once the client took it: the next request goes ahead meanwhile."""
    async def deliver(result: Result) -> None:
        reached.set()
        result.encoded = msg = kserve_grpc.stream_response(kserve_grpc.encode_response(call,
                                                                                    result))
        taken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        held.hold(len(msg))
        try:
            await out.put((msg, taken))
            await taken
        finally:
            held.give(len(msg))
    return deliver


class _Held:
    """The bytes a stream holds (its requests in flight, the answers its client has not
    taken), within ``limit``, and within its listener's (``within``) for all streams. A
    stream past its own limit reads no more requests until its answers free some (HTTP/2
    flow control then holds the client back): a client that sends 32 MiB requests and never
    reads took 2.5 GB before, 8 requests and 8 answers at a time, each copied on its way."""

    def __init__(self, limit: int, within: _Held | None = None) -> None:
        self.limit, self.within = limit, within
        self.held = 0
        self._freed = asyncio.Event()

    async def take(self, n: int) -> bool:
        """Room for a request of ``n`` bytes: waits for this stream's answers while it holds
        any; False (refuse it) when it holds none and the listener's streams hold too much."""
        while self.held and (self.held + n > self.limit or self._over(n)):
            self._freed.clear()
            await self._freed.wait()
        if self._over(n):
            return False
        self.hold(n)
        return True

    def _over(self, n: int) -> bool:
        return self.within is not None and self.within.held + n > self.within.limit

    def hold(self, n: int) -> None:
        self.held += n
        if self.within is not None:
            self.within.held += n

    def give(self, n: int) -> None:
        self.held -= n
        if self.within is not None:
            self.within.held -= n
        self._freed.set()

    def refusal(self, n: int) -> ProxyError:
        assert self.within is not None
        return ProxyError(ErrorKind.OVERLOADED, f"the streams of this listener hold "
                          f"{self.within.held} bytes of requests and answers not yet taken; a "
                          f"request of {n} bytes would pass listeners.grpc.max_streams_bytes "
                          f"({self.within.limit}): retry it once answers are read")


def _stream_item(call: Call, item: StreamItem) -> bytes:
    """A stream item that is not an answer (those go out as they are counted): an error
    message, as Triton sends one in the stream."""
    if isinstance(item, LocalReply):
        return kserve_grpc.stream_error(item.message, call.model, call.id)
    return kserve_grpc.stream_error(f"model '{call.model}' streams server-sent events; "
                                   "call it through the OpenAI front", call.model, call.id)


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    return client_headers(context).get("authorization")


def _repository_parameters(params: Any) -> dict[str, RepositoryParameter]:
    out: dict[str, RepositoryParameter] = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        out[key] = getattr(p, which) if which else ""
    return out


def _typed(fn: Callable[[Any, Any], Awaitable[Message]]) -> Callable[..., Awaitable[Message]]:
    async def handler(req: Any, context: grpc.aio.ServicerContext) -> Message:
        try:
            return await fn(req, context)
        except ProxyError as err:
            await abort(context, LocalReply.from_error(err), {})
            raise  # unreachable: abort raises

    return handler


def _refused(extension: str) -> Callable[[bytes, Any], Awaitable[bytes]]:
    async def handler(body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await abort(context, LocalReply.from_error(refused_extension(extension)), {})
        return b""

    return handler
