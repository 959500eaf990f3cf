"""The shared memory calls of both v2 fronts, in Triton's request and answer shapes.

gRPC ``SystemSharedMemoryRegister/Status/Unregister`` and HTTP ``/v2/systemsharedmemory/...``
call into ``proxy.shm.regions.SharedMemory`` with the caller's socket address; the fronts add these
with one line each. CUDA shared memory is refused at registration (UNIMPLEMENTED / 501): mmguard
opens no CUDA context, so it cannot open a client's CUDA IPC handle. Status and unregister of CUDA
regions answer truthfully that there are none, as a Triton without GPUs does. """

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web
from google.protobuf.message import Message

from proxy.errors import STATUS, ErrorKind, ProxyError
from proxy.pb import grpc_service_pb2 as pb
from proxy.shm.peer import Connection, Peer
from proxy.shm.regions import SharedMemory
from proxy.tensor import json_bytes
from proxy.wire.numbers import json_loads

HttpHandler = Callable[[web.Request], Awaitable[web.Response]]
_CUDA_WHY = ("CUDA shared memory is not supported by mmguard: it opens no CUDA context, so it "
             "cannot map a client's CUDA IPC handle (and this host may have no CUDA device); "
             "use system shared memory or send tensors inline")


def http_connection(request: web.Request) -> Connection:
    return connection_of(request.transport)


def connection_of(transport: asyncio.BaseTransport | None) -> Connection:
    """A client's connection from its transport (either HTTP server's)."""
    peer, local = (transport.get_extra_info(k) if transport else None
                   for k in ("peername", "sockname"))
    return Connection(_address(peer), _address(local) or ("", 0))


def _address(name: object) -> Peer | None:
    if isinstance(name, tuple) and len(name) >= 2:
        return str(name[0]), int(name[1])
    return None


# --- gRPC ---------------------------------------------------------------------------------------


def grpc_methods(shm: SharedMemory) -> dict[str, grpc.RpcMethodHandler]:
    def client(ctx: grpc.aio.ServicerContext) -> int:
        return shm.client(shm.grpc_connection(ctx.peer()))

    async def register(req: pb.SystemSharedMemoryRegisterRequest,
                       ctx: Any) -> pb.SystemSharedMemoryRegisterResponse:
        shm.register(client(ctx), req.name, req.key, req.offset, req.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def status(req: pb.SystemSharedMemoryStatusRequest,
                     ctx: Any) -> pb.SystemSharedMemoryStatusResponse:
        resp = pb.SystemSharedMemoryStatusResponse()
        for region in shm.status(client(ctx), req.name):
            resp.regions[region.name].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(**region.status()))
        return resp

    async def unregister(req: pb.SystemSharedMemoryUnregisterRequest,
                         ctx: Any) -> pb.SystemSharedMemoryUnregisterResponse:
        shm.unregister(client(ctx), req.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def cuda_register(req: Any, ctx: Any) -> Message:
        raise ProxyError(ErrorKind.UNIMPLEMENTED, _CUDA_WHY)

    async def cuda_status(req: pb.CudaSharedMemoryStatusRequest,
                          ctx: Any) -> pb.CudaSharedMemoryStatusResponse:
        if req.name:
            raise ProxyError(ErrorKind.NOT_FOUND,
                             f"Unable to find cuda shared memory region: '{req.name}'")
        return pb.CudaSharedMemoryStatusResponse()

    async def cuda_unregister(req: Any, ctx: Any) -> pb.CudaSharedMemoryUnregisterResponse:
        return pb.CudaSharedMemoryUnregisterResponse()

    typed: dict[str, tuple[Callable[[Any, Any], Awaitable[Message]], type[Message]]] = {
        "SystemSharedMemoryRegister": (register, pb.SystemSharedMemoryRegisterRequest),
        "SystemSharedMemoryStatus": (status, pb.SystemSharedMemoryStatusRequest),
        "SystemSharedMemoryUnregister": (unregister, pb.SystemSharedMemoryUnregisterRequest),
        "CudaSharedMemoryRegister": (cuda_register, pb.CudaSharedMemoryRegisterRequest),
        "CudaSharedMemoryStatus": (cuda_status, pb.CudaSharedMemoryStatusRequest),
        "CudaSharedMemoryUnregister": (cuda_unregister, pb.CudaSharedMemoryUnregisterRequest),
    }
    return {name: grpc.unary_unary_rpc_method_handler(
                _refusals(shm, name, fn), request_deserializer=req_type.FromString,
                response_serializer=lambda m: m.SerializeToString())
            for name, (fn, req_type) in typed.items()}


def _refusals(shm: SharedMemory, rpc: str,
              fn: Callable[[Any, Any], Awaitable[Message]]) -> Callable[..., Awaitable[Message]]:
    operation = ("cuda_" if rpc.startswith("Cuda") else "") + rpc.rsplit("Memory", 1)[1].lower()

    async def handler(req: Any, context: grpc.aio.ServicerContext) -> Message:
        try:
            return await fn(req, context)
        except ProxyError as err:
            shm.refused(operation, err)
            context.set_trailing_metadata((("mmguard-error-origin", err.origin),))
            await context.abort(STATUS[err.kind].grpc, err.message)
            raise  # unreachable: abort raises

    return handler


# --- HTTP ---------------------------------------------------------------------------------------


def add_http_routes(router: web.UrlDispatcher, shm: SharedMemory) -> None:
    """Triton's routes; refusals raise ``ProxyError`` for the front's error middleware."""
    base = "/v2/systemsharedmemory"

    async def register(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        owner = shm.client(http_connection(request))  # off, or not this client's: no body read
        doc = await _json_object(request)
        key, offset, size = doc.get("key"), doc.get("offset", 0), doc.get("byte_size")
        if size is None:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             "Shared memory register request has no 'byte_size' field")
        if not isinstance(key, str):
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"region '{name}': 'key' must be a string, got {key!r}")
        shm.register(owner, name, key, offset, size)
        return web.Response()

    async def status(request: web.Request) -> web.Response:
        owner = shm.client(http_connection(request))
        regions = shm.status(owner, request.match_info.get("name", ""))
        return web.Response(body=json_bytes([r.status() for r in regions]),
                            content_type="application/json")  # compact, as Triton writes it

    async def unregister(request: web.Request) -> web.Response:
        owner = shm.client(http_connection(request))
        shm.unregister(owner, request.match_info.get("name", ""))
        return web.Response()

    def counted(operation: str, handler: HttpHandler) -> HttpHandler:
        async def run(request: web.Request) -> web.Response:
            try:
                return await handler(request)
            except ProxyError as err:
                shm.refused(operation, err)
                raise

        return run

    router.add_post(base + "/region/{name}/register", counted("register", register))
    router.add_get(base + "/status", counted("status", status), allow_head=False)
    router.add_get(base + "/region/{name}/status", counted("status", status), allow_head=False)
    router.add_post(base + "/unregister", counted("unregister", unregister))
    router.add_post(base + "/region/{name}/unregister", counted("unregister", unregister))
    router.add_post("/v2/cudasharedmemory/region/{name}/register", _cuda_register)
    router.add_get("/v2/cudasharedmemory/status", _cuda_status, allow_head=False)
    router.add_get("/v2/cudasharedmemory/region/{name}/status", _cuda_status, allow_head=False)
    router.add_post("/v2/cudasharedmemory/unregister", _cuda_unregister)
    router.add_post("/v2/cudasharedmemory/region/{name}/unregister", _cuda_unregister)


CONTROL_BODY_BYTES = 64 * 1024
"""The most a registration body may have (Triton's is ~100 bytes): read and parsed on the loop
only up to this, whatever the listener's ``max_request_bytes``."""


async def _json_object(request: web.Request) -> dict[str, Any]:
    too_large = ProxyError(ErrorKind.TOO_LARGE, f"a shared memory registration body is at most "
                                                f"{CONTROL_BODY_BYTES} bytes")
    if request.content_length is not None and request.content_length > CONTROL_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in request.content.iter_chunked(CONTROL_BODY_BYTES):
        body += chunk
        if len(body) > CONTROL_BODY_BYTES:  # chunked: stop at the limit, not at the end
            raise too_large
    try:
        doc = json_loads(body or b"{}", first_wins=True)  # as Triton reads a repeated key
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"failed to parse the request JSON buffer: {exc}") from None
    except RecursionError:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         "failed to parse the request JSON buffer: nested too deeply") from None
    if not isinstance(doc, dict):
        raise ProxyError(ErrorKind.INVALID_ARGUMENT, "the request body must be a JSON object")
    return doc


async def _cuda_register(request: web.Request) -> web.Response:
    raise ProxyError(ErrorKind.UNIMPLEMENTED, _CUDA_WHY)


async def _cuda_status(request: web.Request) -> web.Response:
    name = request.match_info.get("name")
    if name:
        raise ProxyError(ErrorKind.NOT_FOUND, f"Unable to find cuda shared memory region: "
                                              f"'{name}'")
    return web.Response(body=b"[]", content_type="application/json")


async def _cuda_unregister(request: web.Request) -> web.Response:
    return web.Response()
