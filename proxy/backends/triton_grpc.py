"""Triton over gRPC (KServe v2): pooled grpc.aio channels (TLS with ``tls``), deadlines, metadata
propagated.

Requests and responses cross as bytes: no deserializer is registered for ModelInfer, so an
unedited request is sent exactly as the client sent it and the answer comes back unparsed until
a filter or a front of another protocol needs it.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncIterator
from typing import Any

import grpc

from proxy.backends import shm_handoff
from proxy.backends.base import Backend, RepositoryParameter
from proxy.backends.fingerprint import with_files
from proxy.backends.propagation import forward_metadata
from proxy.backends.shm_handoff import HandoffPool
from proxy.backends.stream_watch import StreamWatch
from proxy.call import Call, LocalReply, Result, StreamItem, Target, Wire
from proxy.config.backends import TritonGrpcBackendConfig
from proxy.config.tls import grpc_channel_credentials
from proxy.contract import ModelContract, TensorSpec, config_from_pb, fingerprint
from proxy.errors import ErrorKind, ProxyError, cancelled_under, kind_from_grpc
from proxy.pb import grpc_service_pb2 as pb
from proxy.pb import grpc_service_pb2_grpc as pb_grpc
from proxy.telemetry import backend_span, traced_stream
from proxy.wire import kserve_grpc
from proxy.wire.answers import answer_source

_OVER_MAX = re.compile(r"(Received|Sent) message larger than max \((\d+) vs\. (\d+)\)")
"""grpc's words for a message over the channel's receive or send bound."""
_SERVICE = "/inference.GRPCInferenceService/"


# Between a backend's return and mmguard's first call that reaches it: at most this (gRPC adds
# up to 20 % jitter). Until then a call fails fast with UNAVAILABLE, which the fallback counts.
RECONNECT_BACKOFF_MAX_MS = 1000


class TritonGrpcBackend(Backend):
    protocol = "grpc"

    def __init__(self, cfg: TritonGrpcBackendConfig) -> None:
        self.name = cfg.name
        self.cfg = cfg
        self.timeout_s = cfg.timeout_s
        self._channels: list[grpc.aio.Channel] = []
        self._next = itertools.cycle(range(cfg.channels))
        pool = cfg.shared_memory_pool
        self.handoff = (HandoffPool(cfg.name, pool.slots, pool.max_slot_bytes)
                        if cfg.shared_memory == "system" else None)

    async def start(self) -> None:
        # Channels bind to the running event loop, so they are made here, not in __init__.
        if self._channels:
            return
        cfg = self.cfg
        options = [
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.keepalive_time_ms", 30_000),
            # A sidecar's model server restarts next door: reconnect within a second, not after
            # gRPC's default backoff (which grows to two minutes).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
        ]
        # A distinct channel arg per channel keeps each on its own HTTP/2 connection.
        if cfg.tls is None:
            self._channels = [grpc.aio.insecure_channel(cfg.url, options=[
                *options, ("mmguard.channel", i)]) for i in range(cfg.channels)]
        else:
            creds, tls_options = grpc_channel_credentials(cfg.tls)
            self._channels = [grpc.aio.secure_channel(cfg.url, creds, options=[
                *options, *tls_options, ("mmguard.channel", i)]) for i in range(cfg.channels)]
        self._infer = [c.unary_unary(_SERVICE + "ModelInfer") for c in self._channels]
        self._stream = [c.stream_stream(_SERVICE + "ModelStreamInfer") for c in self._channels]
        self._stubs = [pb_grpc.GRPCInferenceServiceStub(c)  # type: ignore[no-untyped-call]
                       for c in self._channels]

    async def reach(self) -> str | None:
        try:
            await self._stubs[0].ServerLive(pb.ServerLiveRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return f"{self.cfg.url} did not answer ({exc.code().name}: {exc.details()})"
        return None  # an answer, even an error, comes from a server at that address

    async def ready(self) -> bool:
        try:
            resp = await self._stubs[0].ServerReady(pb.ServerReadyRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return False
        return bool(resp.ready)

    async def model_ready(self, model: str, version: str = "") -> bool:
        try:
            resp = await self._stubs[0].ModelReady(
                pb.ModelReadyRequest(name=model, version=version), timeout=2.0)
        except grpc.aio.AioRpcError:
            return False
        return bool(resp.ready)

    async def metadata(self, model: str, version: str = "") -> ModelContract:
        stub = self._stubs[0]
        try:
            meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name=model, version=version),
                                            timeout=self.timeout_s)
            cfg = await stub.ModelConfig(pb.ModelConfigRequest(name=model, version=version),
                                         timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc, model) from None
        # Our ModelConfig keeps the fields it does not know as unknown fields, so these bytes
        # are the whole config Triton sent; the full schema renders it for HTTP clients.
        raw = cfg.config.SerializeToString()
        contract = contract_from_triton(
            meta.name, list(meta.versions), meta.platform,
            [(t.name, t.datatype, tuple(t.shape)) for t in meta.inputs],
            [(t.name, t.datatype, tuple(t.shape)) for t in meta.outputs],
            config_from_pb(raw), raw)
        contract = with_files(contract, self.cfg.fingerprint_files.get(model, ()))
        if self.handoff is not None:
            self.handoff.contracts[model] = contract
        return contract

    async def infer(self, call: Call, target: Target) -> Result:
        with backend_span(call, "grpc", self.name, target.model, self.cfg.url):
            return await self._infer_once(call, target)

    async def _infer_once(self, call: Call, target: Target) -> Result:
        if self.handoff is not None:
            result = await shm_handoff.grpc_infer(
                self.handoff, call, target, lambda body: self._send(body, call, target),
                self._register)
            if result is not None:
                return result
        body = kserve_grpc.encode_request(call, target.model, target.version)
        resp = await self._send(body, call, target)
        return kserve_grpc.decode_response(resp, answer_source(self.name, target.model))

    async def _send(self, body: bytes, call: Call, target: Target) -> bytes:
        timeout = self.timeout_for(call)
        i = next(self._next)
        try:
            resp: bytes = await self._infer[i](body, timeout=timeout,
                                               metadata=forward_metadata(call.headers))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise self.deadline_error(target, timeout) from None
            raise self._error(exc, target.model) from None
        except asyncio.CancelledError:
            raise self._closed_under(target) from None
        return resp

    def _closed_under(self, target: Target) -> BaseException:
        """grpc cancels the calls of a channel it closes (a reload retired this backend past
        their grace): a ``CancelledError`` that is not this task's own is that, and is said so
        (kept as it was, it would end the client's call without an answer)."""
        if not cancelled_under():
            return asyncio.CancelledError()
        return ProxyError(ErrorKind.UNAVAILABLE,
                          f"backend '{self.name}' ({self.cfg.url}) was closed before it answered "
                          f"model '{target.model}': a config reload replaced it, or mmguard "
                          "is stopping")

    async def _register(self, name: str, key: str, size: int) -> None:
        try:
            await self._stubs[0].SystemSharedMemoryRegister(
                pb.SystemSharedMemoryRegisterRequest(name=name, key=key, byte_size=size),
                timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:  # ours already: a lost answer
                raise

    async def _unregister(self, name: str) -> None:
        await self._stubs[0].SystemSharedMemoryUnregister(
            pb.SystemSharedMemoryUnregisterRequest(name=name), timeout=2.0)

    def stream(self, call: Call, target: Target) -> AsyncIterator[StreamItem]:
        return traced_stream(call, "grpc", self.name, target.model, self.cfg.url,
                             self._stream_once(call, target))

    async def _stream_once(self, call: Call, target: Target) -> AsyncIterator[StreamItem]:
        # One backend stream per request: the request is written and the stream half-closed,
        # so Triton ends it once the model has sent its last response. timeout_s bounds the
        # wait for the first response and stream_idle_timeout_s each silence after it (a
        # decoupled model may talk for minutes); the client's deadline bounds the whole.
        body = kserve_grpc.encode_request(call, target.model, target.version)
        first = self.timeout_for(call)
        whole = call.remaining()
        i = next(self._next)
        rpc = self._stream[i](iter([body]), timeout=whole,
                              metadata=forward_metadata(call.headers))
        watch = StreamWatch(first, self.cfg.stream_idle_timeout_s, rpc.cancel)
        try:
            async for raw in rpc:
                watch.handing_on()
                msg = pb.ModelStreamInferResponse()
                msg.ParseFromString(raw)
                if msg.error_message:
                    yield LocalReply(ErrorKind.INTERNAL, msg.error_message, origin="backend")
                else:
                    yield kserve_grpc.result_from_pb(
                        msg.infer_response,
                        Wire("grpc", msg.infer_response.SerializeToString()),
                        answer_source(self.name, target.model))
                watch.reading()
            if watch.expired is not None:  # grpc ends a call it cancelled without a word
                raise self._silent(watch, target)
        except asyncio.CancelledError:
            if not cancelled_under():
                raise
            if watch.expired is None:  # not the watch's cancel: grpc's, closing the channel
                raise self._closed_under(target) from None
            raise self._silent(watch, target) from None
        except grpc.aio.AioRpcError as exc:
            if watch.expired is not None:
                raise self._silent(watch, target) from None
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise self.deadline_error(target, whole if whole is not None else first) from None
            raise self._error(exc, target.model) from None
        finally:
            watch.close()
            rpc.cancel()

    def _silent(self, watch: StreamWatch, target: Target) -> ProxyError:
        """The error of a stream the watch broke off."""
        if watch.expired == "first":
            return self.deadline_error(target, watch.first)
        return ProxyError(ErrorKind.DEADLINE_EXCEEDED,
                          f"backend '{self.name}' sent nothing on the stream of model "
                          f"'{target.model}' for {watch.idle:g} s after its last response; "
                          "mmguard broke it off (backends[].stream_idle_timeout_s)")

    # --- server metadata and the repository API (forwarded as they are) ---------------------

    async def server_metadata(self) -> dict[str, Any] | None:
        try:
            meta = await self._stubs[0].ServerMetadata(pb.ServerMetadataRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc, "(server metadata)") from None
        return {"name": meta.name, "version": meta.version, "extensions": list(meta.extensions)}

    async def repository_index(self, ready: bool) -> list[dict[str, str]]:
        try:
            resp = await self._stubs[0].RepositoryIndex(pb.RepositoryIndexRequest(ready=ready),
                                                        timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc, "(repository index)") from None
        return [{k: v for k, v in (("name", m.name), ("version", m.version),
                                   ("state", m.state), ("reason", m.reason)) if v}
                for m in resp.models]

    async def repository_load(self, model: str,
                              parameters: dict[str, RepositoryParameter]) -> None:
        req = pb.RepositoryModelLoadRequest(model_name=model)
        _set_repository_parameters(req.parameters, parameters)
        try:  # a load may take long (the model starts): the backend's own timeout, not 2 s
            await self._stubs[0].RepositoryModelLoad(req, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc, model) from None

    async def repository_unload(self, model: str,
                                parameters: dict[str, RepositoryParameter]) -> None:
        req = pb.RepositoryModelUnloadRequest(model_name=model)
        _set_repository_parameters(req.parameters, parameters)
        try:
            await self._stubs[0].RepositoryModelUnload(req, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc, model) from None

    def _error(self, exc: grpc.aio.AioRpcError, model: str) -> ProxyError:
        code = exc.code()
        details = exc.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            return ProxyError(ErrorKind.UNAVAILABLE,
                              f"backend '{self.name}' ({self.cfg.url}) is unavailable for model "
                              f"'{model}': {details}")
        over = _OVER_MAX.search(details) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
        if over is not None and int(over[3]) == self.cfg.max_message_bytes:
            # mmguard's own channel refused the message (Triton itself takes up to 2 GiB)
            if over[1] == "Received":  # the backend's answer is over the operator's bound
                return self.too_large(self.cfg.url, f"an answer of {over[2]} bytes", model,
                                      self.cfg.max_message_bytes, "refused it")
            return ProxyError(ErrorKind.TOO_LARGE,
                              f"the request for model '{model}' is {over[2]} bytes as sent to "
                              f"backend '{self.name}' ({self.cfg.url}); mmguard sends it at most "
                              f"{self.cfg.max_message_bytes} bytes "
                              "(backends[].max_message_bytes)")
        return ProxyError(kind_from_grpc(code), details, origin="backend")

    async def close(self, drain: bool = False) -> None:
        if self.handoff is not None and self._channels:
            await self.handoff.close(self._unregister, within_s=self.timeout_s if drain else 0)
        grace = max(self.timeout_s, self.cfg.stream_idle_timeout_s) if drain else None
        for c in self._channels:  # with a grace, its calls in flight end first
            await c.close(grace=grace)


def _set_repository_parameters(target: Any,
                               parameters: dict[str, RepositoryParameter]) -> None:
    for key, value in parameters.items():
        slot = target[key]
        if isinstance(value, bool):
            slot.bool_param = value
        elif isinstance(value, int):
            slot.int64_param = value
        elif isinstance(value, bytes):
            slot.bytes_param = value
        else:
            slot.string_param = value


def contract_from_triton(name: str, versions: list[str], platform: str,
                         inputs: list[tuple[str, str, tuple[int, ...]]],
                         outputs: list[tuple[str, str, tuple[int, ...]]],
                         config: dict[str, Any], config_pb: bytes = b"") -> ModelContract:
    """Build the contract from Triton's metadata (shapes) and config (batching, optional,
    decoupled). With max_batch_size >= 1 the metadata's leading -1 is the batch dimension."""
    optional = {i["name"] for i in config.get("input", []) if i.get("optional")}
    policy = config.get("model_transaction_policy") or {}
    return ModelContract(
        name=name, versions=tuple(versions), platform=platform or config.get("backend", ""),
        inputs=tuple(TensorSpec(n, d, s, n in optional) for n, d, s in inputs),
        outputs=tuple(TensorSpec(n, d, s) for n, d, s in outputs),
        max_batch_size=int(config.get("max_batch_size", 0) or 0),
        decoupled=bool(policy.get("decoupled", False)),
        fingerprint=fingerprint(config, versions),
        config=config,
        config_pb=config_pb,
    )

