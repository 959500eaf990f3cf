"""Triton over HTTP/REST (KServe v2 with the binary tensor extension): one aiohttp session with
keep-alive connections. An unedited HTTP request is forwarded as its original body."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from proxy import codec_http
from proxy.backends.base import Backend
from proxy.backends.propagation import forward_headers
from proxy.backends.triton_grpc import contract_from_triton
from proxy.call import Call, Result, Target
from proxy.config import TritonHttpBackend as HttpConfig
from proxy.contract import ModelContract
from proxy.errors import ErrorKind, ProxyError, kind_from_http

_STREAM_ABOVE = 512 * 1024


async def _parts(parts: list[Any]) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


class TritonHttpBackend(Backend):
    protocol = "http"

    def __init__(self, cfg: HttpConfig) -> None:
        self.name = cfg.name
        self.cfg = cfg
        self.timeout_s = cfg.timeout_s
        url = cfg.url if "://" in cfg.url else f"http://{cfg.url}"
        self.base = url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on first use, inside the running loop
            connector = aiohttp.TCPConnector(limit=self.cfg.pool_size, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    async def start(self) -> None:
        _ = self.session

    async def ready(self) -> bool:
        return await self._ok("/v2/health/ready")

    async def model_ready(self, model: str, version: str = "") -> bool:
        return await self._ok(self._model_path(model, version) + "/ready")

    async def _ok(self, path: str) -> bool:
        try:
            async with self.session.get(self.base + path,
                                        timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def metadata(self, model: str, version: str = "") -> ModelContract:
        path = self._model_path(model, version)
        meta = await self._get_json(path, model)
        config = await self._get_json(path + "/config", model)
        return contract_from_triton(
            meta.get("name", model), list(meta.get("versions", [])), meta.get("platform", ""),
            [(t["name"], t["datatype"], tuple(t["shape"])) for t in meta.get("inputs", [])],
            [(t["name"], t["datatype"], tuple(t["shape"])) for t in meta.get("outputs", [])],
            config)

    async def _get_json(self, path: str, model: str) -> dict[str, Any]:
        try:
            async with self.session.get(self.base + path,
                                        timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                body = await r.read()
                if r.status != 200:
                    raise self._status_error(r.status, body)
                return json.loads(body)  # type: ignore[no-any-return]
        except aiohttp.ClientError as exc:
            raise self._transport_error(exc, model) from None

    async def infer(self, call: Call, target: Target) -> Result:
        parts, hlen, forwarded = codec_http.encode_request(call)
        headers = forward_headers(call.headers)
        size = sum(len(p) for p in parts)
        body: Any = parts[0] if len(parts) == 1 else b"".join(parts)
        if size > _STREAM_ABOVE:
            # aiohttp warns (and copies) for large bytes bodies; stream the parts as they are.
            headers["Content-Length"] = str(size)
            body = _parts(parts)
        headers["Accept-Encoding"] = "identity"  # loopback: compression only costs CPU
        headers["Content-Type"] = (codec_http.BINARY_TYPE if hlen is not None
                                   else codec_http.JSON_TYPE)
        if hlen is not None:
            headers[codec_http.HEADER_LENGTH] = str(hlen)
        timeout = self.timeout_for(call)
        url = self.base + self._model_path(target.model, target.version) + "/infer"
        try:
            async with asyncio.timeout(timeout):
                async with self.session.post(url, data=body, headers=headers) as r:
                    data = await r.read()
                    if r.status != 200:
                        raise self._status_error(r.status, data)
                    return codec_http.decode_response(
                        data, r.headers.get(codec_http.HEADER_LENGTH), forwarded)
        except TimeoutError:
            raise self.deadline_error(target, timeout) from None
        except aiohttp.ClientError as exc:
            raise self._transport_error(exc, target.model) from None

    def _status_error(self, status: int, body: bytes) -> ProxyError:
        try:
            message = str(json.loads(body)["error"])
        except (ValueError, KeyError, TypeError):
            message = body.decode("utf-8", "replace")[:500] or f"HTTP {status}"
        return ProxyError(kind_from_http(status), message, origin="backend")

    def _transport_error(self, exc: Exception, model: str) -> ProxyError:
        return ProxyError(ErrorKind.UNAVAILABLE,
                          f"backend '{self.name}' ({self.base}) is unavailable for model "
                          f"'{model}': {type(exc).__name__}: {exc}")

    @staticmethod
    def _model_path(model: str, version: str) -> str:
        return f"/v2/models/{model}" + (f"/versions/{version}" if version else "")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
