"""Triton over HTTP/REST (KServe v2 with the binary tensor extension): infer calls on the lean
keep-alive client of ``http_client`` (or the aiohttp session, ``infer_client: aiohttp``), every
other call on the aiohttp session. An unedited HTTP request is forwarded as its original body."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from proxy.backends import shm_handoff
from proxy.backends.base import RepositoryParameter
from proxy.backends.fingerprint import with_files
from proxy.backends.http_base import HttpBackend
from proxy.backends.propagation import forward_headers
from proxy.backends.shm_handoff import HandoffPool
from proxy.backends.triton_grpc import contract_from_triton
from proxy.call import Call, Result, Target
from proxy.config.backends import TritonHttpBackendConfig
from proxy.contract import ModelContract
from proxy.telemetry import backend_span
from proxy.wire import kserve_http
from proxy.wire.answers import answer_source

_STREAM_ABOVE = 512 * 1024


async def _parts(parts: list[Any]) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


class TritonHttpBackend(HttpBackend):
    protocol = "http"

    def __init__(self, cfg: TritonHttpBackendConfig) -> None:
        # Answers are forwarded as they came, so they are never decompressed on the way.
        super().__init__(cfg.name, cfg.url, cfg.timeout_s, cfg.pool_size, auto_decompress=False,
                         tls=cfg.tls, max_message_bytes=cfg.max_message_bytes)
        self.cfg = cfg
        pool = cfg.shared_memory_pool
        self.handoff = (HandoffPool(cfg.name, pool.slots, pool.max_slot_bytes)
                        if cfg.shared_memory == "system" else None)
        self._use_lean_client(cfg.infer_client)

    live_path = "/v2/health/live"

    async def ready(self) -> bool:
        return await self._ok("/v2/health/ready")

    async def model_ready(self, model: str, version: str = "") -> bool:
        return await self._ok(self._model_path(model, version) + "/ready")

    async def _metadata(self, model: str, version: str) -> ModelContract:
        path = self._model_path(model, version)
        meta = await self._get_json(path, model)
        config = await self._get_json(path + "/config", model)
        return contract_from_triton(
            meta.get("name", model), list(meta.get("versions", [])), meta.get("platform", ""),
            [(t["name"], t["datatype"], tuple(t["shape"])) for t in meta.get("inputs", [])],
            [(t["name"], t["datatype"], tuple(t["shape"])) for t in meta.get("outputs", [])],
            config)

    async def infer(self, call: Call, target: Target) -> Result:
        with backend_span(call, "http", self.name, target.model, self.base):
            return await self._infer_once(call, target)

    async def _infer_once(self, call: Call, target: Target) -> Result:
        if self.handoff is not None:
            result = await shm_handoff.http_infer(
                self.handoff, call, target,
                lambda body, hlen: self._post_infer(call, target, body, hlen, len(body)),
                self._register)
            if result is not None:
                return result
        parts, hlen, forwarded = kserve_http.encode_request(call)
        size = sum(len(p) for p in parts)
        body: Any = parts  # the lean client writes the parts as they are
        if self.pool is None:
            body = parts[0] if len(parts) == 1 else b"".join(parts)
            if size > _STREAM_ABOVE:
                # aiohttp warns (and copies) for large bytes bodies; stream the parts.
                body = _parts(parts)
        data, answer_hlen = await self._post_infer(call, target, body, hlen, size)
        return kserve_http.decode_response(data, answer_hlen, forwarded,
                                          answer_source(self.name, target.model))

    async def _post_infer(self, call: Call, target: Target, body: Any, hlen: int | None,
                          size: int) -> tuple[bytes, str | None]:
        """POST an infer body; the answer's bytes and its header length, or the error."""
        headers = forward_headers(call.headers)
        headers["Content-Length"] = str(size)
        headers["Accept-Encoding"] = "identity"  # loopback: compression only costs CPU
        headers["Content-Type"] = (kserve_http.BINARY_TYPE if hlen is not None
                                   else kserve_http.JSON_TYPE)
        if hlen is not None:
            headers[kserve_http.HEADER_LENGTH] = str(hlen)
        timeout = self.timeout_for(call)
        if self.pool is not None:
            return await self._post_lean(target, body, headers, timeout, size)
        url = self.base + self._model_path(target.model, target.version) + "/infer"
        try:
            async with asyncio.timeout(timeout):
                async with self.session.post(url, data=body, headers=headers) as r:
                    data = await self._read(r, target.model)
                    if r.status != 200:
                        raise self._status_error(r.status, data)
                    return data, r.headers.get(kserve_http.HEADER_LENGTH)
        except TimeoutError:
            raise self.deadline_error(target, timeout) from None
        except aiohttp.ClientError as exc:
            raise self._transport_error(exc, target.model) from None

    async def _post_lean(self, target: Target, body: Any, headers: dict[str, str],
                         limit_s: float, size: int) -> tuple[bytes, str | None]:
        head = self._lean_head(self._model_path(target.model, target.version) + "/infer",
                               headers, size)
        answer = await self._lean_post(head, (body,) if isinstance(body, bytes | memoryview)
                                       else body, limit_s, target)
        if answer.status != 200:
            raise self._status_error(answer.status, answer.body)
        return answer.body, answer.headers.get(kserve_http.HEADER_LENGTH.lower())

    async def _register(self, name: str, key: str, size: int) -> None:
        body = json.dumps({"key": key, "offset": 0, "byte_size": size}).encode()
        async with self.session.post(f"{self.base}/v2/systemsharedmemory/region/{name}/register",
                                     data=body, timeout=aiohttp.ClientTimeout(
                                         total=self.timeout_s)) as r:
            data = await self._read(r, f"(shared memory region {name})")
            if r.status != 200 and b"already in manager" not in data:  # ours: a lost answer
                raise self._status_error(r.status, data)

    async def _unregister(self, name: str) -> None:
        async with self.session.post(
                f"{self.base}/v2/systemsharedmemory/region/{name}/unregister",
                timeout=aiohttp.ClientTimeout(total=2.0)) as r:
            await self._read(r, f"(shared memory region {name})")

    async def metadata(self, model: str, version: str = "") -> ModelContract:
        contract = with_files(await self._metadata(model, version),
                              self.cfg.fingerprint_files.get(model, ()))
        if self.handoff is not None:
            self.handoff.contracts[model] = contract
        return contract

    async def close(self, drain: bool = False) -> None:
        if self.handoff is not None and self._session is not None:
            try:
                await self.handoff.close(self._unregister,
                                         within_s=self.timeout_s if drain else 0)
            except aiohttp.ClientError:
                pass
        await super().close(drain)

    # --- server metadata and the repository API (forwarded as they are) ---------------------

    async def server_metadata(self) -> dict[str, Any] | None:
        return await self._get_json("/v2", "(server metadata)")

    async def repository_index(self, ready: bool) -> list[dict[str, str]]:
        data = await self._post_repository("/v2/repository/index", {"ready": ready},
                                           "(repository index)")
        index = json.loads(data) if data else []
        return [{k: str(v) for k, v in m.items()} for m in index]

    async def repository_load(self, model: str,
                              parameters: dict[str, RepositoryParameter]) -> None:
        await self._post_repository(f"/v2/repository/models/{model}/load",
                                    _repository_body(parameters), model)

    async def repository_unload(self, model: str,
                                parameters: dict[str, RepositoryParameter]) -> None:
        await self._post_repository(f"/v2/repository/models/{model}/unload",
                                    _repository_body(parameters), model)

    async def _post_repository(self, path: str, body: dict[str, Any], model: str) -> bytes:
        try:
            async with self.session.post(self.base + path, json=body,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)
                                         ) as r:
                data = await self._read(r, model)
                if r.status != 200:
                    raise self._status_error(r.status, data)
                return data
        except aiohttp.ClientError as exc:
            raise self._transport_error(exc, model) from None

    @staticmethod
    def _model_path(model: str, version: str) -> str:
        return f"/v2/models/{model}" + (f"/versions/{version}" if version else "")


def _repository_body(parameters: dict[str, RepositoryParameter]) -> dict[str, Any]:
    """Triton's HTTP form: file contents (``file:<path>``) travel base64-encoded."""
    if not parameters:
        return {}
    return {"parameters": {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v
                           for k, v in parameters.items()}}
