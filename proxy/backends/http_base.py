"""What the HTTP backends share: one keep-alive aiohttp session per backend, made inside the
running loop, TLS (a ``tls`` block, or an ``https://`` url with the system's trust store), health
probes, JSON GETs and the error that names the backend and its address; and, for inference
calls, the lean client of ``http_client`` (``infer_client: httptools``, the default)."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

import aiohttp
import yarl

from proxy.backends.base import Backend
from proxy.backends.http_client import Answer, AnswerTooLarge, HttpPool, Streamed
from proxy.call import Target
from proxy.config.tls import TlsClient, backend_ssl_context
from proxy.errors import ErrorKind, ProxyError, kind_from_http
from proxy.wire.sse import SseEventTooLarge

_T = TypeVar("_T")
_TARGETS_KEPT = 1024  # request targets remembered per backend (one per model and endpoint)


class HttpBackend(Backend):
    def __init__(self, name: str, url: str, timeout_s: float, pool_size: int,
                 auto_decompress: bool = True, tls: TlsClient | None = None,
                 max_message_bytes: int | None = None) -> None:
        self.name = name
        self.max_message_bytes = max_message_bytes
        """The most bytes of one answer (or one streamed event) taken from the server."""
        self.timeout_s = timeout_s
        url = url if "://" in url else f"{'https' if tls else 'http'}://{url}"
        self.base = url.rstrip("/")
        # True: aiohttp's default (TLS with the system's trust store, for https:// only).
        self._ssl: ssl.SSLContext | bool = True if tls is None else backend_ssl_context(tls, name)
        self._pool_size = pool_size
        self._auto_decompress = auto_decompress
        self._session: aiohttp.ClientSession | None = None
        self.pool: HttpPool | None = None
        """The lean client of inference calls; None: they go through the session too."""
        self._targets: dict[str, str] = {}

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on first use, inside the running loop
            connector = aiohttp.TCPConnector(limit=self._pool_size, keepalive_timeout=60,
                                             ssl=self._ssl)
            self._session = aiohttp.ClientSession(connector=connector,
                                                  auto_decompress=self._auto_decompress)
        return self._session

    async def start(self) -> None:
        _ = self.session

    live_path = "/"
    """What ``reach`` asks for: any answer, whatever its status, is a server there."""

    async def reach(self) -> str | None:
        try:
            async with self.session.get(self.base + self.live_path,
                                        timeout=aiohttp.ClientTimeout(total=2.0)):
                return None
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{self.base} did not answer ({type(exc).__name__}: {exc})"

    async def _ok(self, path: str) -> bool:
        try:
            async with self.session.get(self.base + path,
                                        timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _get_json(self, path: str, model: str) -> dict[str, Any]:
        try:
            async with self.session.get(self.base + path,
                                        timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                body = await self._read(r, model)
                if r.status != 200:
                    raise self._status_error(r.status, body)
                return json.loads(body)  # type: ignore[no-any-return]
        except aiohttp.ClientError as exc:
            raise self._transport_error(exc, model) from None

    def _status_error(self, status: int, body: bytes) -> ProxyError:
        """The backend's own error, with its status and text (and body, for fronts of the same
        protocol that return it intact)."""
        message, param = f"HTTP {status}", None
        try:
            err = json.loads(body)["error"]
            message = str(err.get("message", message)) if isinstance(err, dict) else str(err)
            param = err.get("param") if isinstance(err, dict) else None
        except (ValueError, KeyError, TypeError):
            message = body.decode("utf-8", "replace")[:500] or message
        return ProxyError(kind_from_http(status), message, origin="backend", status=status,
                          body=body, param=param)

    async def _read(self, r: aiohttp.ClientResponse, model: str) -> bytes:
        """A session answer's body, at most ``max_message_bytes`` of it: past that (declared,
        or as it arrives) the connection is closed and the call is a bad gateway."""
        limit = self.max_message_bytes
        if limit is None:
            return await r.read()
        if r.content_length is not None and r.content_length > limit:
            r.close()
            raise self.too_large_error(AnswerTooLarge(r.content_length, limit), model)
        parts: list[bytes] = []
        size = 0
        async for chunk in r.content.iter_any():
            size += len(chunk)
            if size > limit:
                r.close()
                raise self.too_large_error(AnswerTooLarge(None, limit), model)
            parts.append(chunk)
        return b"".join(parts)

    def too_large_error(self, exc: AnswerTooLarge | SseEventTooLarge, model: str) -> ProxyError:
        return self.too_large(self.base, str(exc), model, exc.limit, "closed the connection")

    def _transport_error(self, exc: Exception, model: str) -> ProxyError:
        return ProxyError(ErrorKind.UNAVAILABLE,
                          f"backend '{self.name}' ({self.base}) is unavailable for model "
                          f"'{model}': {type(exc).__name__}: {exc}")

    # --- inference calls on the lean client --------------------------------------------------

    def _use_lean_client(self, infer_client: str) -> None:
        if infer_client == "httptools":
            self.pool = HttpPool(self.base, self._pool_size, self._ssl,
                                 max_body=self.max_message_bytes)

    def _lean_head(self, path: str, headers: dict[str, str], length: int) -> bytes:
        """A POST's head to ``path`` (encoded as aiohttp's client encodes a url) for a body
        of ``length`` bytes."""
        assert self.pool is not None
        target = self._targets.get(path)
        if target is None:
            if len(self._targets) >= _TARGETS_KEPT:
                self._targets.clear()
            target = self._targets[path] = yarl.URL(self.base + path).raw_path_qs
        try:
            return self.pool.head("POST", target, headers, length)
        except ValueError as exc:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT, str(exc)) from None

    async def _lean_post(self, head: bytes, body: Iterable[bytes | memoryview], limit_s: float,
                         target: Target) -> Answer:
        assert self.pool is not None
        return await self._within(self.pool.request(head, body), limit_s, target)

    async def _lean_stream(self, head: bytes, body: Iterable[bytes | memoryview],
                           limit_s: float, target: Target) -> Streamed:
        """The deadline bounds the wait for the answer's head; a long stream may run on."""
        assert self.pool is not None
        return await self._within(self.pool.open_stream(head, body), limit_s, target)

    async def _within(self, call: Awaitable[_T], limit_s: float, target: Target) -> _T:
        """``call`` within the deadline; a timeout or a lost connection as the backend's error."""
        try:
            async with asyncio.timeout(limit_s):
                return await call
        except TimeoutError:
            raise self.deadline_error(target, limit_s) from None
        except AnswerTooLarge as exc:
            raise self.too_large_error(exc, target.model) from None
        except OSError as exc:
            raise self._transport_error(exc, target.model) from None

    async def close(self, drain: bool = False) -> None:
        """A call in use on the lean pool (a stream) runs to its end either way: the fronts
        have ended theirs before a stop closes the backends."""
        if self.pool is not None:
            await self.pool.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None
