"""The OpenAI-compatible front (same listener as KServe v2 HTTP), in front of vLLM.

Proxied through the model's filter chain: chat and text completions, ``/v1/responses``,
``/v1/embeddings``, ``/pooling`` and SageMaker's ``/invocations`` (SSE streams forwarded event by
event). Proxied without filters, but with the same content and URL checks: ``/tokenize`` and
``/detokenize``. Answered for the backend: ``/v1/models``, ``/health``, ``/ping``, ``/version``,
``/tokenizer_info`` and stored responses (``/v1/responses/{id}``). Every other vLLM endpoint is
refused with the reason (``proxy.fronts.openai_refusals``).

Remote media follow ``openai`` in the *live* config (read from the runtime on every request, so
a SIGHUP reload applies a new allow-list at once): checked and re-written URLs, and in ``fetch``
mode mmguard's own fetch of allow-listed images, inlined as ``data:`` URLs.

Backend errors go back with their status and body intact (OpenAI clients parse them); mmguard's
own refusals use OpenAI's error shape with the status from ``proxy.errors.STATUS``. An unknown
model is named, but the served models are never listed to the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from aiohttp import web
from prometheus_client import Counter

from proxy.call import Api, Call, LocalReply, Result, SseEvent, SseEvents
from proxy.config.model import OpenAIConfig
from proxy.engine.dataplane import DataPlane
from proxy.errors import STATUS, ErrorKind, ProxyError, retry_after
from proxy.fronts.body import INLINE_JSON_BYTES, BodyBounds, body_bounds, decoded, header_deadline
from proxy.fronts.exchange import AiohttpExchange, Exchange, Plain
from proxy.fronts.media_fetch import FetchBudget, ImageFetcher
from proxy.fronts.openai_answers import AnswerCounts, rename_answer
from proxy.fronts.openai_refusals import register_refusals
from proxy.telemetry.metrics import Observations
from proxy.wire import openai, vllm_words
from proxy.wire.media_urls import HostAllowList
from proxy.wire.openai_parts import UrlSite

log = logging.getLogger("mmguard.openai")
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


_RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")  # nothing that could change the path


def unknown_model_text(model: str) -> str:
    """vLLM's own words for a model it does not serve (its clients match on them), without the
    list of served models that vLLM adds."""
    return f"The model `{model}` does not exist. (mmguard serves no model of that name)"


def error_plain(reply: LocalReply, decisions: dict[str, str] | None = None) -> Plain:
    """An error answer: the backend's own body and status when it sent one, else OpenAI's
    error shape with the status from ``proxy.errors.STATUS``."""
    headers = {**(decisions or {}), "mmguard-error-origin": reply.origin}
    if reply.retry_after_s is not None:
        headers["Retry-After"] = retry_after(reply.retry_after_s)
    if reply.body is not None:  # the backend's own, or vLLM's words (proxy.wire.vllm_words)
        headers["Content-Type"] = "application/json"
        return Plain(reply.status or STATUS[reply.kind].http, headers, reply.body)
    headers["Content-Type"] = "application/json"  # as vLLM's JSONResponse: compact, no charset
    body = json.dumps(openai.error_body(reply.kind, reply.message, reply.param),
                      separators=(",", ":")).encode()
    return Plain(STATUS[reply.kind].http, headers, body)


def model_entry(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """A route's ``/v1/models`` entry as its vLLM lists the model (every field, in its order:
    ``owned_by``, ``parent``, ``permission``), under the route's name, created now as vLLM
    dates each listing."""
    entry = dict(config.get("model_entry") or {"id": name, "object": "model", "created": 0,
                                               "owned_by": "vllm", "root": config.get("root"),
                                               "parent": None,
                                               "max_model_len": config.get("max_model_len")})
    now = int(time.time())
    entry["id"] = name
    if "created" in entry:
        entry["created"] = now
    permissions = entry.get("permission")
    if isinstance(permissions, list):
        entry["permission"] = [{**p, "created": now} if isinstance(p, dict) and "created" in p
                               else p for p in permissions]
    return entry


def openai_error(reply: LocalReply, decisions: dict[str, str] | None = None) -> web.Response:
    return error_plain(reply, decisions).web()


def _refuse(kind: ErrorKind, message: str, param: str | None = None) -> web.Response:
    return openai_error(LocalReply(kind, message, param=param))


class MediaRules:
    """The live ``openai`` config, compiled: the allow-list and the image fetcher."""

    def __init__(self, cfg: OpenAIConfig) -> None:
        self.cfg = cfg
        allow = HostAllowList.of(cfg.image_url_allow_hosts)
        self.policy = openai.MediaPolicy(allow, cfg.remote_images, cfg.fetch.max_images)
        self.fetcher = ImageFetcher(cfg.fetch, allow) if cfg.remote_images == "fetch" else None


class OpenAIFront:
    def __init__(self, plane: DataPlane, max_request_bytes: int) -> None:
        """``max_request_bytes``: the listener's JSON limit (``max_json_bytes``), for bodies
        read and for bodies sent on with fetched images inlined. The ``openai`` config
        (allow-list, remote images) is read from the live runtime on every request, so a
        reload applies it."""
        self.plane = plane
        self.max_request_bytes = max_request_bytes
        self._rules: MediaRules | None = None
        self._retired: set[asyncio.Task[None]] = set()
        self._stream_children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        self._counts = AnswerCounts(plane.telemetry)
        self._media = plane.telemetry.metric(
            Counter, "mmguard_remote_media_total",
            "Remote media URLs in OpenAI requests, by what mmguard did with them.", ["outcome"])

    def register(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/v1/models", self.models, allow_head=False)
        for endpoint in openai.INFERENCE:
            r.add_post(endpoint, self._infer_handler(endpoint))
        r.add_post(openai.TOKENIZE, self.tokenize)
        r.add_post(openai.DETOKENIZE, self.tokenize)
        r.add_get("/health", self.health, allow_head=False)
        r.add_route("*", "/ping", self.health)
        r.add_get("/version", self.version, allow_head=False)
        r.add_get("/tokenizer_info", self.backend_scoped, allow_head=False)
        r.add_get("/v1/responses/{response_id}", self.backend_scoped, allow_head=False)
        r.add_post("/v1/responses/{response_id}/cancel", self.backend_scoped)
        register_refusals(r)
        app.on_cleanup.append(self._close)

    async def _close(self, app: web.Application) -> None:
        if self._rules is not None and self._rules.fetcher is not None:
            await self._rules.fetcher.close()

    def rules(self) -> MediaRules:
        cfg = self.plane.runtime.config.openai
        rules = self._rules
        if rules is None or rules.cfg is not cfg:
            if rules is not None and rules.fetcher is not None:
                task = asyncio.ensure_future(rules.fetcher.retire())
                self._retired.add(task)
                task.add_done_callback(self._retired.discard)
            rules = self._rules = MediaRules(cfg)
        return rules

    def body_bounds(self, headers: Mapping[str, str], declared: int | None) -> BodyBounds:
        """The body's bounds from its headers; ``ProxyError`` when they already refuse it."""
        if declared is not None and declared > self.max_request_bytes:
            raise ProxyError(ErrorKind.TOO_LARGE,
                             f"request body is {declared} bytes; this listener "
                             f"accepts at most {self.max_request_bytes} "
                             "(listeners.http.max_json_bytes)")
        # inflated once, bounded; an OpenAI body is JSON, held to the JSON limit: parsing it
        # holds the interpreter lock, worker thread or not (a 19 MiB body of small messages:
        # 1.4 s), so the 64 MiB body limit would let one request stall every client
        return body_bounds(headers, declared, self.max_request_bytes,
                           "listeners.http.max_json_bytes")

    async def _body(self, ex: Exchange) -> bytes:
        bounds = self.body_bounds(ex.headers, ex.content_length)
        return await decoded(await ex.raw_body(bounds.limit, bounds.setting), bounds)

    async def _decode(self, ex: Exchange, endpoint: str,
                      held: list[FetchBudget]) -> Call:
        """The checked call, its model known and its remote images inlined (fetch mode); what
        was fetched for it is counted in the budget put in ``held``, which the caller releases
        once the call is answered."""
        media = ex.headers.get("Content-Type", "").lower().split(";", 1)[0]
        if media != "application/json":  # vLLM's check, in its words (curl -d sends a form)
            raise vllm_words.media_type()
        rules = self.rules()
        body = await self._body(ex)
        call = (await asyncio.to_thread(openai.parse_request, body, endpoint)  # big JSON off
                if len(body) > INLINE_JSON_BYTES else openai.parse_request(body, endpoint))
        assert call.document is not None
        images: list[UrlSite] = []  # the remote images, found once for policy and fetcher
        try:
            forwarded = openai.apply_url_policy(call.document, rules.policy, images)
            if forwarded:
                call.wire = None  # the URLs as mmguard wrote them, not the client's bytes
                self._media.labels("forwarded").inc(forwarded)
            if not call.model:
                call.model = self._only_route()
            if call.model not in self.plane.runtime.served:
                raise ProxyError(ErrorKind.NOT_FOUND, unknown_model_text(call.model),
                                 param="model")
            fetched = 0 if rules.fetcher is None else await rules.fetcher.inline(
                call, body, self.max_request_bytes, held, images)
        except ProxyError as err:
            if err.kind is not ErrorKind.NOT_FOUND:
                self._media.labels("refused").inc()
                log.debug("remote media refused at %s: %s", err.param, err.message)
            raise
        if fetched:
            self._media.labels("fetched").inc(fetched)
            call.decisions["mmguard-remote-images"] = f"fetched {fetched}, sent inline"
        call.headers = {k.lower(): v for k, v in ex.headers.items()}
        call.deadline = header_deadline(call.headers)  # as the KServe v2 front reads it
        return call

    async def models(self, request: web.Request) -> web.Response:
        runtime = self.plane.runtime
        data = []
        for name, route in runtime.served.items():
            if runtime.backends[route.spec.backend].protocol != "openai":
                continue
            contract = runtime.contracts.get(name)
            if contract is None:
                continue
            data.append(model_entry(name, contract.config))
        return web.Response(body=json.dumps({"object": "list", "data": data},
                                            separators=(",", ":")).encode(),
                            content_type="application/json")

    def _infer_handler(self, endpoint: str) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            ex = AiohttpExchange(request)
            answer = await self.infer(ex, endpoint)
            if answer is None:
                assert ex.response is not None
                return ex.response
            return answer.web()
        return handler

    async def infer(self, ex: Exchange, endpoint: str) -> Plain | None:
        """An inference endpoint's call through the model's chain: its answer, or None when
        it was streamed through ``ex``."""
        held: list[FetchBudget] = []
        try:
            try:
                call = await self._decode(ex, endpoint, held)
            except ProxyError as err:
                self.plane.count_undecoded("openai", err)  # refused before the data plane saw it
                return error_plain(LocalReply.from_error(err))
            try:
                return await self._answer(ex, call)
            except ProxyError as err:  # the data plane counted it
                return error_plain(LocalReply.from_error(err))
        finally:
            for budget in held:
                budget.release()  # the fetched images are no longer held

    async def _answer(self, ex: Exchange, call: Call) -> Plain | None:
        if call.streaming:
            return await self._stream(ex, call)
        bodies: list[bytes] = []

        async def encode(result: Result) -> None:  # before the call is counted
            bodies.append(_renamed(result, call))

        reply = await self.plane.infer(call, encode)
        if isinstance(reply, LocalReply):
            if reply.reset:
                ex.drop()
            return error_plain(reply, call.shown_decisions())
        body = bodies[-1]
        self._counts.count(call.model, _json(body))
        return Plain(200, {**call.shown_decisions(), "Content-Type": "application/json"}, body)

    async def _stream(self, ex: Exchange, call: Call) -> Plain | None:
        items = self.plane.stream(call, by_read=True)
        first = await anext(items, None)
        if first is None or isinstance(first, LocalReply):
            await items.aclose()
            return error_plain(first or LocalReply(ErrorKind.INTERNAL, "empty stream"),
                               call.shown_decisions())
        backend = call.target.backend if call.target else ""
        ttft, inter_token, duration = self._stream_metrics(call.model, backend)
        ttft.observe(time.monotonic() - call.started)
        await ex.stream({**SSE_HEADERS, **call.shown_decisions()})
        rename = call.target is not None and call.target.model != call.model
        item: Any = first
        gaps = Observations(inter_token)
        last = time.monotonic()
        held: list[bytes] = []  # events of one backend read, sent in one write
        try:
            while item is not None:
                if ex.closing():
                    break  # the client went away: stop reading (and so stop the backend)
                if isinstance(item, LocalReply):
                    if item.reset:
                        ex.drop()
                        break
                    held.append(_error_event(item))
                    break
                if isinstance(item, SseEvents):  # what one backend read brought
                    held.append(self._counts.events(call.model, item.raws, rename))
                    if len(item.raws) > 1:  # the client gets them at once: no gap between
                        gaps.repeat(0.0, len(item.raws) - 1)
                    if not item.ended:
                        await ex.write(held[0] if len(held) == 1 else b"".join(held))
                        held.clear()
                elif isinstance(item, SseEvent):  # one by one: a filter wrapped the stream
                    held.append(self._counts.events(call.model, [item.raw], rename))
                    if not item.more:
                        await ex.write(held[0] if len(held) == 1 else b"".join(held))
                        held.clear()
                item = await anext(items, None)
                if item is not None:  # inter-token latency, as the client sees it
                    now = time.monotonic()
                    gaps.add(now - last)
                    last = now
            if not ex.closing():
                # what is still held (the last events, an error event) and the stream's end,
                # in one write
                await ex.end(b"".join(held))
        except ConnectionResetError:  # per request: DEBUG (the metric counts it as cancelled)
            log.debug("client of model %r closed the stream early", call.model)
        finally:
            gaps.flush()
            await items.aclose()
            duration.observe(time.monotonic() - call.started)
        with contextlib.suppress(ConnectionResetError):
            await ex.end()  # when the client left first (a no-op once it was sent)
        return None

    def _stream_metrics(self, model: str, backend: str) -> tuple[Any, Any, Any]:
        """The TTFT, inter-token and stream-duration children of a served model (kept: three
        ``labels()`` per stream were ~10 µs)."""
        found = self._stream_children.get((model, backend))
        if found is None:
            t = self.plane.telemetry
            found = self._stream_children[(model, backend)] = (
                t.ttft.labels(model, backend), t.inter_token.labels(model, backend),
                t.stream_duration.labels(model, backend))
        return found

    # --- endpoints without filters ---------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        endpoint = openai.TOKENIZE if request.path == openai.TOKENIZE else \
            openai.DETOKENIZE
        held: list[FetchBudget] = []
        try:
            return await self._tokenize(request, await self._decode(AiohttpExchange(request),
                                                                    endpoint, held))
        except ProxyError as err:
            return openai_error(LocalReply.from_error(err))
        finally:
            for budget in held:
                budget.release()

    async def _tokenize(self, request: web.Request, call: Call) -> web.Response:
        runtime = self.plane.runtime
        route = runtime.served[call.model]
        backend = runtime.backends[route.spec.backend]
        if not hasattr(backend, "forward"):
            return _refuse(ErrorKind.INVALID_ARGUMENT, f"model '{call.model}' is not served "
                           "over the OpenAI API; it has no /tokenize", "model")
        body = openai.encode_request(call, route.target.model)
        try:
            status, ctype, out = await backend.forward("POST", request.path, body, call.headers)
        except ProxyError as err:
            return openai_error(LocalReply.from_error(err))
        return _passed(status, ctype, out)

    def _only_route(self) -> str:
        """The route a request that names no model is for, as vLLM serves such a request with
        its one model: the only route over the OpenAI API; refused when there are several."""
        runtime = self.plane.runtime
        names = [n for n, r in runtime.served.items()
                 if runtime.backends[r.spec.backend].api is Api.OPENAI]
        if len(names) == 1:
            return names[0]
        raise ProxyError(ErrorKind.INVALID_ARGUMENT, f"'model' is required: mmguard serves "
                         f"{len(names)} models over the OpenAI API", param="model")

    def _openai_backends(self) -> dict[str, Any]:
        runtime = self.plane.runtime
        return {n: b for n, b in runtime.backends.items() if b.api is Api.OPENAI}

    async def health(self, request: web.Request) -> web.Response:
        """vLLM's /health and /ping: 200 with no body when every vLLM backend is healthy."""
        backends = self._openai_backends()
        if not backends:
            ready = await self.plane.ready()
            return web.Response(status=200 if ready else 503)
        states = await asyncio.gather(*(b.ready() for b in backends.values()))
        down = [n for n, ok in zip(backends, states, strict=True) if not ok]
        if down:
            return _refuse(ErrorKind.UNAVAILABLE, f"vLLM backend(s) {', '.join(down)} are not "
                           "healthy")
        return web.Response(status=200)

    def _backend(self, request: web.Request) -> Any:
        """The backend a model-less endpoint is about: the one of ``?model=``, else the only
        vLLM backend; a ``web.Response`` refusal when that is ambiguous."""
        runtime = self.plane.runtime
        model = request.query.get("model")
        if model is not None:
            route = runtime.served.get(model)
            if route is None:
                return _refuse(ErrorKind.NOT_FOUND, unknown_model_text(model), "model")
            backend = runtime.backends[route.spec.backend]
            if backend.protocol != "openai":
                return _refuse(ErrorKind.INVALID_ARGUMENT, f"model '{model}' is not served "
                               f"over the OpenAI API; {request.path} is vLLM's", "model")
            return backend
        backends = list(self._openai_backends().values())
        if len(backends) == 1:
            return backends[0]
        if not backends:
            return _refuse(ErrorKind.NOT_FOUND, f"{request.path}: mmguard has no vLLM backend")
        return _refuse(ErrorKind.INVALID_ARGUMENT, f"{request.path}: mmguard serves "
                       f"{len(backends)} vLLM backends; say which with ?model=<model>", "model")

    async def backend_scoped(self, request: web.Request) -> web.Response:
        backend = self._backend(request)
        if isinstance(backend, web.Response):
            return backend
        path = request.path
        response_id = request.match_info.get("response_id")
        if response_id is not None:
            if not _RESPONSE_ID.fullmatch(response_id):
                return _refuse(ErrorKind.INVALID_ARGUMENT, "a response id is letters, digits, "
                               "'_' and '-' (at most 200)", "response_id")
            path = f"/v1/responses/{response_id}" + (
                "/cancel" if request.method == "POST" else "")
        query = urlencode([(k, v) for k, v in request.query.items() if k != "model"])
        body = await self._body(AiohttpExchange(request)) if request.can_read_body else None
        try:
            status, ctype, out = await backend.forward(
                request.method, path + (f"?{query}" if query else ""), body)
        except ProxyError as err:
            return openai_error(LocalReply.from_error(err))
        return _passed(status, ctype, out)

    async def version(self, request: web.Request) -> web.Response:
        if "model" in request.query or len(self._openai_backends()) <= 1:
            return await self.backend_scoped(request)
        versions: dict[str, str] = {}
        for name, backend in self._openai_backends().items():
            try:
                status, _, out = await backend.forward("GET", "/version")
                versions[name] = json.loads(out).get("version", "") if status == 200 else ""
            except (ProxyError, ValueError, AttributeError):
                versions[name] = ""
        first = next(iter(versions.values()))
        doc = ({"version": first} if len(set(versions.values())) == 1
               else {"version": first, "versions": versions})
        return web.Response(body=json.dumps(doc, separators=(",", ":")).encode(),
                            content_type="application/json")  # as vLLM writes it


def _passed(status: int, ctype: str, body: bytes) -> web.Response:
    return web.Response(body=body, status=status,
                        headers={"Content-Type": ctype or "application/json"})


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
    if doc is None or not rename_answer(doc, call.model):
        return body
    return json.dumps(doc).encode()


def _error_event(reply: LocalReply) -> bytes:
    doc = openai.error_body(reply.kind, reply.message, reply.param)
    return b"data: " + json.dumps(doc).encode() + b"\n\ndata: [DONE]\n\n"
