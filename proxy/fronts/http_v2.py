"""The KServe v2 HTTP/REST front (aiohttp): JSON tensors and the binary tensor extension.

Bodies are read once through ``proxy.fronts.body`` (gzip / deflate inflated there, bounded):
over ``max_request_bytes`` — or ``max_json_bytes`` for JSON — they get 413. Big JSON is parsed
and written in a worker thread; answers are compressed when the client's ``Accept-Encoding``
asks, as Triton does. Errors are ``{"error": "..."}`` with the status from
``proxy.errors.STATUS``; filter decisions go out as ``mmguard-*`` response headers. The
repository API and server metadata are the data plane's (``v2`` config).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from proxy import __version__
from proxy.backends.base import RepositoryParameter
from proxy.call import Call, LocalReply, Result
from proxy.engine.dataplane import DataPlane, refused_extension
from proxy.errors import STATUS, ErrorKind, ProxyError, retry_after, unknown_model
from proxy.fronts.body import (
    BodyBounds,
    body_bounds,
    decoded,
    header_deadline,
    read_json,
    read_raw,
)
from proxy.fronts.generate import GenerateFront
from proxy.fronts.openai import OpenAIFront, drop_connection
from proxy.fronts.openai_refusals import compact, speaks_vllm, vllm_miss
from proxy.shm import fronts
from proxy.shm.peer import Connection
from proxy.shm.regions import Budget, SharedMemory, uses_shared_memory
from proxy.tensor import json_bytes
from proxy.wire import kserve_http, kserve_raw

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
log = logging.getLogger("mmguard.http")
DECODE_INLINE_BYTES = 256 * 1024
"""JSON (a body's, an answer's) up to this is parsed (written) on the event loop; bigger in a
worker thread."""
BINARY_DECODE_INLINE_BYTES = 1024 * 1024
"""A binary body above this is decoded in a worker thread too (see grpc_v2.DECODE_INLINE_BYTES:
millions of variable-length BYTES elements take a second to walk)."""


def error_parts(reply: LocalReply, decisions: dict[str, str] | None = None
                ) -> tuple[int, dict[str, str], bytes]:
    """An error answer's status, headers and body (``{"error":"..."}``, as Triton writes it),
    for every HTTP path that answers one."""
    headers = {**(decisions or {}), "mmguard-error-origin": reply.origin}
    if reply.retry_after_s is not None:
        headers["Retry-After"] = retry_after(reply.retry_after_s)
    return STATUS[reply.kind].http, headers, compact({"error": reply.message}).encode()


def error_response(reply: LocalReply, decisions: dict[str, str] | None = None) -> web.Response:
    status, headers, body = error_parts(reply, decisions)
    return web.Response(body=body, status=status, headers=headers,
                        content_type="application/json")


def triton_json(doc: Any, headers: dict[str, str] | None = None) -> web.Response:
    """A KServe v2 answer as Triton's HTTP front writes it: compact JSON, typed
    ``application/json`` (aiohttp's ``json_response`` spaces it and adds a charset)."""
    return web.Response(body=json_bytes(doc), headers=headers, content_type="application/json")


@dataclass(slots=True)
class InferRequest:
    """An infer request as the KServe v2 HTTP front serves it, whichever server read it
    (aiohttp's, or the fast lane's: ``proxy.process.fast_lane``)."""

    model: str
    version: str
    headers: Mapping[str, str]
    """Case-insensitive (a ``CIMultiDictProxy``), the first of repeated names wins."""
    raw: bytes
    """The body as it came (not inflated)."""
    bounds: BodyBounds
    json_part: int | None
    content_type: str
    connection: Callable[[], Connection]


@dataclass(slots=True)
class InferAnswer:
    """What to answer: ``error`` (with the decisions shown), else ``body`` (with its JSON
    header's length when binary), compressed with ``coding`` when the client asked."""

    decisions: dict[str, str]
    error: LocalReply | None = None
    body: bytes = b""
    header_length: int | None = None
    coding: str | None = None

    def headers(self) -> dict[str, str]:
        headers = dict(self.decisions)
        if self.header_length is not None:
            headers[kserve_http.HEADER_LENGTH] = str(self.header_length)
        return headers

    @property
    def content_type(self) -> str:
        return (kserve_http.BINARY_TYPE if self.header_length is not None
                else kserve_http.JSON_TYPE)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        if "%" in request.raw_path and request.raw_path.startswith("/v2"):
            _escaped(request)  # Triton reads a KServe path as it came: aiohttp decodes it
        return await handler(request)
    except ProxyError as err:
        return error_response(LocalReply.from_error(err))
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(LocalReply(ErrorKind.TOO_LARGE, f"request body too large: {exc}"))
    except web.HTTPNotFound:
        if speaks_vllm(request.path):
            return await vllm_miss(request, 404)
        return error_response(LocalReply(ErrorKind.NOT_FOUND,  # Triton's words first
                                         f"Not Found: no such endpoint: {request.method} "
                                         f"{request.path}"))
    except web.HTTPMethodNotAllowed as exc:  # HEAD too: neither server's GET routes take it
        if speaks_vllm(request.path):
            return await vllm_miss(request, 405, frozenset(exc.allowed_methods))
        return web.Response(  # Triton's words first; its 405 has no Allow, RFC 9110 wants one
            body=compact({"error": f"Method Not Allowed: {request.method} is not served on "
                                    f"{request.path}"}).encode(), status=405,
            headers={"mmguard-error-origin": "mmguard",
                     "Allow": ", ".join(sorted(exc.allowed_methods))},
            content_type="application/json", charset="utf-8")


class HttpFront:
    def __init__(self, plane: DataPlane, max_request_bytes: int,
                 max_json_bytes: int | None = None,
                 shm: SharedMemory | None = None) -> None:
        self.plane = plane
        self.shm = shm or SharedMemory()
        self.max_request_bytes = max_request_bytes
        self.max_json_bytes = min(max_json_bytes or max_request_bytes, max_request_bytes)
        self.openai = OpenAIFront(plane, self.max_json_bytes)  # its bodies are JSON
        self.shm_budget = Budget(max_request_bytes, "listeners.http.max_request_bytes")
        self.generate = GenerateFront(plane, self.max_json_bytes, error_response)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes, middlewares=[_errors])
        self.openai.register(app)
        r = app.router
        r.add_get("/v2/health/live", self.live, allow_head=False)
        r.add_get("/v2/health/ready", self.ready, allow_head=False)
        r.add_get("/v2", self.server_metadata, allow_head=False)
        r.add_get("/v2/models/stats", self.stats, allow_head=False)
        r.add_post("/v2/repository/index", self.repository_index)
        r.add_post("/v2/repository/models/{model}/load", self.repository_load)
        r.add_post("/v2/repository/models/{model}/unload", self.repository_unload)
        # Triton's router takes only digits as a version: anything else is its 404 Not Found.
        bases = ("/v2/models/{model}", "/v2/models/{model}/versions/{version:[0-9]+}")
        for base in bases:  # first: aiohttp tries these patterns in order, infer is the hot one
            r.add_post(base + "/infer", self.infer)
        self.generate.register(r, bases)
        for base in bases:
            r.add_get(base, self.model_metadata, allow_head=False)
            r.add_get(base + "/ready", self.model_ready, allow_head=False)
            r.add_get(base + "/config", self.model_config, allow_head=False)
            r.add_get(base + "/stats", self.stats, allow_head=False)
        fronts.add_http_routes(r, self.shm)
        for path, extension in (("/v2/trace/setting", "trace"),
                                ("/v2/models/{model}/trace/setting", "trace"),
                                ("/v2/models/{model}/versions/{version:[0-9]+}/trace/setting",
                                 "trace"), ("/v2/logging", "logging")):
            r.add_route("*", path, _refused(extension))
        return app

    async def live(self, request: web.Request) -> web.Response:
        return _plain(200 if self.plane.live() else 503)

    async def ready(self, request: web.Request) -> web.Response:
        return _plain(200 if await self.plane.ready() else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        meta, source = await self.plane.server_metadata()
        return triton_json(meta, headers={"mmguard-version": __version__,
                                                "mmguard-server-metadata": source})

    # --- the repository API (forwarded when v2.repository_api is on) ------------------------

    async def repository_index(self, request: web.Request) -> web.Response:
        backend = self.plane.repository_backend("repository index",
                                                request.headers.get("Authorization"))
        doc = await self._repository_body(request)
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"'ready' must be true or false, got {ready!r:.60}")
        return triton_json(await backend.repository_index(ready))

    async def repository_load(self, request: web.Request) -> web.Response:
        return await self._repository_change(request, "load")

    async def repository_unload(self, request: web.Request) -> web.Response:
        return await self._repository_change(request, "unload")

    async def _repository_change(self, request: web.Request, action: str) -> web.Response:
        model = request.match_info["model"]
        backend = self.plane.repository_backend(f"repository {action}",
                                                request.headers.get("Authorization"))
        parameters = repository_parameters(await self._repository_body(request))
        log.info("repository: %s of model %r forwarded to backend %r", action, model,
                 backend.name)
        if action == "load":
            await backend.repository_load(model, parameters)
        else:
            await backend.repository_unload(model, parameters)
        return web.Response(status=200)

    async def _repository_body(self, request: web.Request) -> dict[str, Any]:
        doc = await read_json(request, self.max_request_bytes,  # bounded, big ones off the loop
                              "listeners.http.max_request_bytes")
        if not isinstance(doc, dict):
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"the request body must be a JSON object, got "
                             f"{type(doc).__name__}")
        return doc

    async def model_metadata(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        meta = self.plane.contract(model, request.match_info.get("version", "")).metadata_json()
        meta["name"] = model
        return triton_json(meta)

    async def model_ready(self, request: web.Request) -> web.Response:
        ok = await self.plane.model_ready(request.match_info["model"],
                                          request.match_info.get("version", ""))
        return web.Response(status=200 if ok else 503)

    async def model_config(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        cfg = dict(self.plane.contract(model, request.match_info.get("version", ""))
                   .config_json())
        cfg["name"] = model
        return triton_json(cfg)

    async def stats(self, request: web.Request) -> web.Response:
        out = []
        for name, (version, st) in self.plane.model_stats(
                request.match_info.get("model", ""), request.match_info.get("version", "")
        ).items():
            out.append({
                "name": name, "version": version, "last_inference": st.last_inference_ms,
                "inference_count": st.inference_count, "execution_count": st.execution_count,
                "inference_stats": {
                    "success": {"count": st.success_count, "ns": st.success_ns},
                    "fail": {"count": st.fail_count, "ns": st.fail_ns},
                },
            })
        return triton_json({"model_stats": out})

    def infer_bounds(self, headers: Mapping[str, str], declared: int | None
                     ) -> tuple[BodyBounds, int | None]:
        """An infer body's bounds from its headers (and its JSON part's length, for a binary
        body): a pure JSON body by ``max_json_bytes``, a binary one by ``max_request_bytes``
        with its JSON header by ``max_json_bytes``. ``ProxyError`` when they refuse it."""
        header_length = headers.get(kserve_http.HEADER_LENGTH)
        if header_length is None:
            return body_bounds(headers, declared, self.max_json_bytes,
                               "listeners.http.max_json_bytes; send big tensors in binary "
                               "form", exact_coding=True), None
        json_part = kserve_raw.header_length_number(header_length)
        if declared is not None and json_part > declared and "Content-Encoding" not in headers:
            # past the body itself: Triton's 400 (in its words), before any limit of ours
            kserve_raw.header_length_value(header_length, declared)
        if json_part > self.max_json_bytes:
            raise ProxyError(ErrorKind.TOO_LARGE,
                             f"the JSON header of a binary request is {json_part} bytes "
                             f"({kserve_http.HEADER_LENGTH}); this listener accepts at most "
                             f"{self.max_json_bytes} (listeners.http.max_json_bytes)")
        return body_bounds(headers, declared, self.max_request_bytes,
                           exact_coding=True), json_part

    async def infer(self, request: web.Request) -> web.Response:
        try:
            bounds, json_part = self.infer_bounds(request.headers, request.content_length)
            raw = await read_raw(request, bounds.limit, bounds.setting)
        except ProxyError as err:
            self.plane.count_undecoded("http", err)  # refused before the data plane saw it
            raise
        answer = await self.serve_infer(InferRequest(
            request.match_info["model"], request.match_info.get("version", ""),
            request.headers, raw, bounds, json_part, request.content_type,
            lambda: fronts.http_connection(request)))
        if answer.error is not None:
            if answer.error.reset:
                drop_connection(request)
            return error_response(answer.error, answer.decisions)
        response = web.Response(body=answer.body, headers=answer.headers(),
                                content_type=answer.content_type)
        if answer.coding is not None:  # as Triton does; aiohttp compresses big ones off the loop
            response.enable_compression(web.ContentCoding(answer.coding))
        return response

    async def serve_infer(self, req: InferRequest) -> InferAnswer:
        """Decode, run the data plane, encode; ``ProxyError`` for a body that does not
        decode (counted here, refused before the data plane saw it)."""
        try:
            call = await self._decode(req)
        except ProxyError as err:
            self.plane.count_undecoded("http", err)
            raise
        encoded: list[tuple[bytes, int | None]] = []

        async def encode(result: Result) -> None:  # before the call is counted
            encoded.append(await _encoded(call, result))

        reply = await (self.shm.infer(call, req.connection(), self.plane.infer,
                                      self.plane.serves, self.shm_budget, encode)
                       if uses_shared_memory(call) else self.plane.infer(call, encode))
        if isinstance(reply, LocalReply):
            return InferAnswer(call.shown_decisions(), error=reply)
        assert encoded  # an answer (not a refusal) was encoded before it counted
        data, hlen = encoded[-1]
        self.plane.telemetry.count_response_bytes(call.model, "http", len(data))
        return InferAnswer(call.shown_decisions(), body=data, header_length=hlen,
                           coding=answer_coding(req.headers.get("Accept-Encoding", "")))

    async def _decode(self, req: InferRequest) -> Call:
        body = await decoded(req.raw, req.bounds)
        header_length = req.headers.get(kserve_http.HEADER_LENGTH)
        model, version = req.model, req.version
        decode_args = (body, header_length, model, version, req.content_type, True)
        if kserve_raw.is_raw(body, header_length):  # the body is the only input's bytes
            call = kserve_raw.decode_raw_request(body, model, version,
                                                  self.plane.contract(model, version),
                                                  req.content_type)
        elif ((len(body) if req.json_part is None else req.json_part) > DECODE_INLINE_BYTES
                or len(body) > BINARY_DECODE_INLINE_BYTES):
            # Big JSON off the loop; binary tensors are views of the body, decoded in place
            # unless the body is big enough to hold millions of BYTES elements to walk.
            call = await asyncio.to_thread(kserve_http.decode_request, *decode_args)
        else:
            call = kserve_http.decode_request(*decode_args)
        call.headers = {k.lower(): v for k, v in req.headers.items()}
        call.deadline = header_deadline(call.headers)
        return call


_TRITON_MODEL_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([0-9]+))?(?:/(?:infer|generate|"
                                r"generate_stream|ready|config|stats|trace/setting))?")
"""The model paths of Triton's HTTP server, matched as Triton matches them: on the path as it
came, percent-escapes and all."""


def _escaped(request: web.Request) -> None:
    """A KServe v2 path with percent-escapes answered as Triton answers it (it does not decode
    them): a model path names a model whose name is the escaped text (unknown, unless a route
    has that very name), any other path is not one of Triton's (404). aiohttp would decode
    ``identity%5Ffp32`` and serve ``identity_fp32``: the same URL would reach another model
    through mmguard than directly."""
    path = request.raw_path.split("?", 1)[0]
    found = _TRITON_MODEL_PATH.fullmatch(path)
    if found is None:
        raise web.HTTPNotFound()
    if found.group(1) != request.match_info.get("model"):
        raise unknown_model(found.group(1), found.group(2) or "")


def _plain(status: int) -> web.Response:
    """A health answer as Triton sends it: no body, typed ``text/plain``."""
    response = web.Response(status=status)
    response.headers["Content-Type"] = "text/plain"
    return response


def _refused(extension: str) -> Handler:
    """A v2 extension mmguard refuses, with the reason its gRPC front gives too."""
    async def handler(request: web.Request) -> web.StreamResponse:
        raise refused_extension(extension)

    return handler


async def _encoded(call: Call, result: Result) -> tuple[bytes, int | None]:
    """The answer's body and its JSON header's length (None: all JSON); big ones off the
    loop."""
    if _json_answer_bytes(call, result) > DECODE_INLINE_BYTES:
        return await asyncio.to_thread(kserve_http.encode_response, call, result)
    return kserve_http.encode_response(call, result)


def _json_answer_bytes(call: Call, reply: Result) -> int:
    """About how much of an answer is to be written as JSON (the costly part to encode)."""
    if reply.wire is not None and reply.wire.protocol == "http":
        return 0  # forwarded as it came
    binary_all = bool(call.parameters.get("binary_data_output", False))
    asked = {o.name: o.parameters for o in call.outputs}
    return sum(t.nbytes for t in reply.outputs
               if not asked.get(t.name, {}).get("binary_data", binary_all))


def repository_parameters(doc: dict[str, Any]) -> dict[str, RepositoryParameter]:
    """Triton's HTTP load/unload ``parameters``: scalars, and ``file:<path>`` contents in
    base64 (decoded here, so a gRPC backend gets the bytes)."""
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise ProxyError(ErrorKind.INVALID_ARGUMENT, "'parameters' must be an object")
    out: dict[str, RepositoryParameter] = {}
    for key, value in params.items():
        if key.startswith("file:") and isinstance(value, str):
            try:
                out[key] = base64.b64decode(value, validate=True)
            except binascii.Error:
                raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                                 f"parameter '{key:.100}' must be base64") from None
        elif isinstance(value, bool | int | str):
            out[key] = value
        else:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"parameter '{key:.100}' must be a string, number or boolean, got "
                             f"{type(value).__name__}")
    return out


def answer_coding(accept_encoding: str) -> str | None:
    """The coding to compress an answer with (None: not compressed), chosen from the client's
    ``Accept-Encoding`` as Triton's HTTP front chooses it: of ``identity``, ``gzip`` and
    ``deflate`` named exactly (case and all; a name is what comes before ``;q=``, so
    ``gzip; q=0.5`` names none), the one of the highest weight above 0, the first of equals; a
    weight C's ``stod`` cannot read drops its part. (mmguard took the first listed whatever its
    weight, and any case.)"""
    chosen, weight = "identity", 0.0
    for part in accept_encoding.split(","):
        name = part.lstrip(" ")
        at = name.find(";q=")
        if not name or at == 0:
            continue
        found = 1.0
        if at > 0:
            read = _stod(name[at + 3:])
            if read is None:
                continue
            name, found = name[:at], read
        if name in _CHOSEN_CODINGS and found > weight:
            chosen, weight = name, found
    return None if chosen == "identity" else chosen


_CHOSEN_CODINGS = ("identity", "gzip", "deflate")
_STOD = re.compile(r"[ \t\n\r\f\v]*([+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
                   r"|inf(?:inity)?|nan))", re.IGNORECASE)


def _stod(text: str) -> float | None:
    """What C++'s ``std::stod`` reads from ``text`` (its longest leading number), None where it
    throws (nothing to read, or out of a double's range)."""
    found = _STOD.match(text)
    if found is None:
        return None
    value = float(found.group(1))
    literal = found.group(1).lower().lstrip("+-")
    if math.isinf(value) and not literal.startswith("inf"):
        return None  # overflow: std::out_of_range
    if value == 0 and any(c in "123456789" for c in literal.split("e")[0]):
        return None  # underflow to zero: std::out_of_range
    return value
