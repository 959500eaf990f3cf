"""The OpenAI-compatible front (same listener as KServe v2 HTTP): chat and text completions,
SSE streaming forwarded event by event, /v1/models, /tokenize and /detokenize.

Backend errors go back with their status and body intact (OpenAI clients parse them); mmguard's
own refusals use OpenAI's error shape with the status from ``proxy.errors.STATUS``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

from aiohttp import web

from proxy import openai_api
from proxy.call import Call, LocalReply, Result, SseEvent
from proxy.dataplane import DataPlane
from proxy.errors import STATUS, ErrorKind, ProxyError, retry_after
from proxy.fronts.body import read_body

log = logging.getLogger("mmguard.openai")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def openai_error(reply: LocalReply, decisions: dict[str, str] | None = None) -> web.Response:
    headers = {**(decisions or {}), "mmguard-error-origin": reply.origin}
    if reply.retry_after_s is not None:
        headers["Retry-After"] = retry_after(reply.retry_after_s)
    if reply.body is not None and reply.origin == "backend":
        return web.Response(body=reply.body, status=reply.status or STATUS[reply.kind].http,
                            headers=headers, content_type="application/json")
    return web.json_response(openai_api.error_body(reply.kind, reply.message, reply.param),
                             status=STATUS[reply.kind].http, headers=headers)


class OpenAIFront:
    def __init__(self, plane: DataPlane, max_request_bytes: int,
                 image_url_allow_hosts: tuple[str, ...]) -> None:
        self.plane = plane
        self.max_request_bytes = max_request_bytes
        self.allowed_hosts = frozenset(h.lower() for h in image_url_allow_hosts)

    def register(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/v1/models", self.models)
        r.add_post(openai_api.CHAT, self.chat)
        r.add_post(openai_api.COMPLETIONS, self.completions)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.tokenize)

    async def _body(self, request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > self.max_request_bytes:
            raise ProxyError(ErrorKind.TOO_LARGE,
                             f"request body is {request.content_length} bytes; this listener "
                             f"accepts at most {self.max_request_bytes}")
        return await read_body(request, self.max_request_bytes)  # inflated once, bounded

    async def models(self, request: web.Request) -> web.Response:
        runtime = self.plane.runtime
        data = []
        for name, route in runtime.routes.items():
            if runtime.backends[route.spec.backend].protocol != "openai":
                continue
            contract = runtime.contracts.get(name)
            if contract is None:
                continue
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "mmguard",
                         "root": contract.config.get("root"),
                         "max_model_len": contract.context_length})
        return web.json_response({"object": "list", "data": data})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, openai_api.CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, openai_api.COMPLETIONS)

    async def _infer(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        try:
            call = openai_api.decode_request(await self._body(request), endpoint,
                                             self.allowed_hosts)
        except ProxyError as err:
            return openai_error(LocalReply.from_error(err))
        call.headers = {k.lower(): v for k, v in request.headers.items()}
        if call.streaming:
            return await self._stream(request, call)
        reply = await self.plane.infer(call)
        if isinstance(reply, LocalReply):
            if reply.reset:
                drop_connection(request)
            return openai_error(reply, call.decisions)
        body = _renamed(reply, call)
        self._account_usage(call, _json(body))
        return web.Response(body=body, headers=call.decisions, content_type="application/json")

    async def _stream(self, request: web.Request, call: Call) -> web.StreamResponse:
        items = self.plane.stream(call)
        first = await anext(items, None)
        if first is None or isinstance(first, LocalReply):
            await items.aclose()
            return openai_error(first or LocalReply(ErrorKind.INTERNAL, "empty stream"),
                                call.decisions)
        backend = call.target.backend if call.target else ""
        self.plane.telemetry.ttft.labels(call.model, backend).observe(
            time.monotonic() - call.started)
        resp = web.StreamResponse(headers={**SSE_HEADERS, **call.decisions})
        await resp.prepare(request)
        rename = call.target is not None and call.target.model != call.model
        item: Any = first
        gap = self.plane.telemetry.inter_token.labels(call.model, backend)
        last = time.monotonic()
        try:
            while item is not None:
                if request.transport is None or request.transport.is_closing():
                    break  # the client went away: stop reading (and so stop the backend)
                if isinstance(item, LocalReply):
                    if item.reset:
                        drop_connection(request)
                        break
                    await resp.write(_error_event(item))
                    break
                if isinstance(item, SseEvent):
                    doc = item.json()
                    if doc is not None:
                        self._account_usage(call, doc)
                    if rename and doc is not None and "model" in doc:
                        doc["model"] = call.model
                        await resp.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
                    else:
                        await resp.write(item.raw)
                item = await anext(items, None)
                if item is not None:  # inter-token latency, as the client sees it
                    now = time.monotonic()
                    gap.observe(now - last)
                    last = now
        except ConnectionResetError:
            log.info("client of model %r closed the stream early", call.model)
        finally:
            await items.aclose()
            self.plane.telemetry.stream_duration.labels(call.model, backend).observe(
                time.monotonic() - call.started)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    def _account_usage(self, call: Call, doc: dict[str, Any] | None) -> None:
        if not doc:
            return
        t = self.plane.telemetry
        usage = doc.get("usage")
        if isinstance(usage, dict):
            for kind in ("prompt_tokens", "completion_tokens"):
                if isinstance(usage.get(kind), int):
                    t.tokens.labels(call.model, kind.removesuffix("_tokens")).inc(usage[kind])
        for choice in doc.get("choices") or []:
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            if reason:
                t.finish_reasons.labels(call.model, str(reason)).inc()

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            doc = json.loads(body)
            model = doc["model"]
        except (ValueError, KeyError, TypeError):
            return openai_error(LocalReply(ErrorKind.INVALID_ARGUMENT,
                                           "the body must be JSON with a 'model'", param="model"))
        runtime = self.plane.runtime
        route = runtime.routes.get(model)
        backend = runtime.backends[route.spec.backend] if route else None
        if route is None or not hasattr(backend, "tokenize"):
            return openai_error(LocalReply(ErrorKind.NOT_FOUND,
                                           f"model '{model}' is not an OpenAI model served by "
                                           "mmguard", param="model"))
        target = route.target
        if target.model != model:
            body = json.dumps({**doc, "model": target.model}).encode()
        try:
            status, out = await backend.tokenize(request.path, body,  # type: ignore[union-attr]
                                                 {k.lower(): v for k, v in request.headers.items()})
        except ProxyError as err:
            return openai_error(LocalReply.from_error(err))
        return web.Response(body=out, status=status, content_type="application/json")


def drop_connection(request: web.Request) -> None:
    """An injected "connection reset": the client sees its connection drop with no answer."""
    if request.transport is not None:
        request.transport.abort()


def _json(body: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _renamed(result: Result, call: Call) -> bytes:
    assert result.wire is not None
    body = result.wire.body
    if call.target is None or call.target.model == call.model:
        return body
    doc = _json(body)
    if doc is None:
        return body
    doc["model"] = call.model
    return json.dumps(doc).encode()


def _error_event(reply: LocalReply) -> bytes:
    doc = openai_api.error_body(reply.kind, reply.message, reply.param)
    return b"data: " + json.dumps(doc).encode() + b"\n\ndata: [DONE]\n\n"
