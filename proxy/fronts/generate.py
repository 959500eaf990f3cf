"""Triton's generate extension on the KServe v2 HTTP front: ``POST /v2/models/<m>[/versions/<v>]/
generate`` (one JSON answer) and ``.../generate_stream`` (server-sent events, one per response),
read and answered as Triton reads and answers them, through the same data plane and filter
chain as ``infer`` (a guard a client could step around by changing the path is no guard).

What MUST hold (``tests/conformance/test_triton_generate.py`` runs each case against Triton
itself and through mmguard, with the same assertions):

- The request's top-level keys are read in their order: a key that names an input of the model
  becomes that input (a value or a flat array, its shape the model's dims with the element
  count spread over the dynamic ones, as Triton spreads it); any other key a request parameter
  (a string, an integer, a boolean or a number, nothing else); ``parameters`` an object whose
  keys are read the same way; ``id`` the request's id (and a parameter too, as Triton has it).
- The answer is one JSON object whose keys are in byte order: ``id`` (when the request had
  one), ``model_name``, ``model_version``, the response's parameters and each output by name,
  a one-element output as its value, any other as a flat array.
- ``generate`` on a model that answers other than once: 200 and Triton's ``error`` object.
- The model's own failure is a 400 (Triton's generate answers every failure of an inference with
  400, where its ``infer`` keeps the error's code: 500 for an INTERNAL one); the backend out of
  reach, overloaded or late keeps its status, as do mmguard's own refusals.
  ``generate_stream``: a refusal before the model ran (mmguard's, or the backend's checks of
  the request itself) is a JSON error; then each response is a ``data:`` event, and an error
  is an ``{"error": ...}`` event (with the error's status when it is the first word).

The infer protocol's reserved parameter names (``sequence_id``, ``priority``, ``timeout``,
``binary_data_output`` ...) keep their infer meaning here: mmguard hands the backend an infer
request, where Triton's generate would pass them to the model as plain parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from aiohttp import web

from proxy.call import Call, Finish, LocalReply, Result, StreamItem
from proxy.contract import ModelContract, TensorSpec
from proxy.engine.dataplane import DataPlane
from proxy.errors import ErrorKind, ProxyError
from proxy.fronts.body import INLINE_JSON_BYTES, body_bounds, header_deadline, read_raw
from proxy.tensor import json_bytes
from proxy.wire import kserve_http
from proxy.wire.json_floats import FLOAT_TYPES, Spliced
from proxy.wire.numbers import json_loads

log = logging.getLogger("mmguard.http")

NESTED = "parameters"
"""The one key whose object is read key by key, as the request's own keys are."""
ONE_ANSWER = ("generate expects model to produce exactly 1 response, use generate stream for "
              "model that generates various number of responses")
"""Triton's words (with its 200) when ``generate`` meets a model that answered other than once."""
SSE_TYPE = "text/event-stream; charset=utf-8"
FINAL_FLAG = "triton_final_response"
"""What Triton's gRPC stream adds to a decoupled model's responses: no part of the answer (its
generate never writes it)."""
_NO_ID = "<id_unknown>"


def _internal(message: str) -> ProxyError:
    """What Triton's JSON reader refuses, in its words: Triton answers 500, mmguard 400 (a
    client's mistake, as on ``infer``: docs/triton-compat.md)."""
    return ProxyError(ErrorKind.INVALID_ARGUMENT, message)


def _parse(body: bytes) -> dict[str, Any]:
    try:
        doc = json_loads(body, first_wins=True)  # as Triton's reader reads it (proxy.wire.numbers)
    except (ValueError, UnicodeDecodeError) as exc:
        what = "The document is empty." if not body.strip() else str(exc)
        raise _internal(f"failed to parse the request JSON buffer: {what}") from None
    except RecursionError:
        raise _internal("failed to parse the request JSON buffer: the JSON in the request body "
                        "is nested too deeply") from None
    if not isinstance(doc, dict):
        raise _internal("attempt to get members for non-object")
    return doc


_REACH = frozenset({ErrorKind.UNAVAILABLE, ErrorKind.OVERLOADED, ErrorKind.DEADLINE_EXCEEDED,
                    ErrorKind.CANCELLED, ErrorKind.BAD_GATEWAY})
"""A backend's failures that are not its model's answer: they keep their own status."""


_REFUSED = frozenset({ErrorKind.INVALID_ARGUMENT, ErrorKind.NOT_FOUND})
"""A backend's refusals of the request itself (Triton's core checks inputs, shapes and sizes
before any model runs): answered as JSON, as Triton answers them before its stream starts."""


def _ran(reply: LocalReply) -> bool:
    """Whether ``reply`` is the model's own failure (Triton's generate: 400, and an error event
    on ``generate_stream``)."""
    return (reply.origin == "backend" and reply.kind not in _REACH
            and reply.kind not in _REFUSED)


def infer_document(doc: dict[str, Any], contract: ModelContract, model: str) -> dict[str, Any]:
    """The KServe v2 infer request a generate request to ``model`` (served under
    ``contract``) means."""
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise _internal("Unable to parse 'id': attempt to access JSON non-string as string")
    out = _Converted(contract, request_id or "")
    for key, value in doc.items():
        if key == NESTED:
            if contract.input(NESTED) is not None:
                raise ProxyError(ErrorKind.INVALID_ARGUMENT, f"Keyword '{NESTED}' for nested "
                                 "schema also given as input tensor name")
            if not isinstance(value, dict):
                raise _internal(f"Expected JSON object for keyword: '{NESTED}': attempt to "
                                "access JSON non-object as object")
            try:
                for inner, inner_value in value.items():
                    out.add(inner, inner_value)
            except ProxyError as err:
                raise ProxyError(err.kind, f"Converting keyword: '{NESTED}': {err.message}",
                                 origin=err.origin) from None
        else:
            out.add(key, value)
    if not out.inputs:  # Triton's core refuses it so; mmguard's infer reader has no words for it
        required = [t.name for t in contract.inputs if not t.optional]
        raise ProxyError(ErrorKind.INVALID_ARGUMENT, f"[request id: {out.request_id}] expected "
                         f"{len(required)} inputs but got 0 inputs for model '{model}'. "
                         f"Got input(s) [], but missing required input(s) "
                         f"[{','.join(repr(n) for n in required)}]. Please "
                         "provide all required input(s).")
    infer: dict[str, Any] = {"inputs": out.inputs}
    if request_id is not None:
        infer["id"] = request_id
    if out.parameters:
        infer["parameters"] = out.parameters
    return infer


class _Converted:
    """The inputs and parameters read so far, in the request's order."""

    def __init__(self, contract: ModelContract, request_id: str) -> None:
        self.contract = contract
        self.request_id = request_id or _NO_ID
        self.inputs: list[dict[str, Any]] = []
        self.parameters: dict[str, Any] = {}

    def add(self, key: str, value: Any) -> None:
        spec = self.contract.input(key)
        if spec is None:
            if isinstance(value, (dict, list)) or value is None:
                raise ProxyError(ErrorKind.INVALID_ARGUMENT, f"parameter '{key}' has invalid "
                                 "type. It should be either 'int', 'bool', or 'string'.")
            self.parameters[key] = value
            return
        if any(i["name"] == key for i in self.inputs):
            raise ProxyError(ErrorKind.INVALID_ARGUMENT, f"[request id: {self.request_id}] "
                             f"input '{key}' already exists in request")
        data = value if isinstance(value, list) else [value]
        if any(isinstance(v, list) for v in data):
            raise _internal("Unable to parse 'data': Shape does not match true shape of 'data' "
                            "field")
        shape = spread(spec, len(data))
        self.inputs.append({"name": key, "datatype": spec.datatype, "shape": shape,
                            "data": data})


def spread(spec: TensorSpec, count: int) -> list[int]:
    """The shape of ``count`` elements for an input of ``spec``'s dims, as Triton makes it:
    the fixed dims divide the count (innermost first), the innermost dynamic one takes what is
    left, every other dynamic one is 1; refused when that does not come out even."""
    dims = list(spec.dims)
    if count == 0:  # Triton takes an empty value without looking at the dims; so does mmguard
        return [0 if i == len(dims) - 1 else max(d, 1) for i, d in enumerate(dims)] or [0]
    left = count
    for d in reversed(dims):
        if d != -1:
            if d <= 0 or left % d:
                raise _cannot_convert(spec.name)
            left //= d
    for i in range(len(dims) - 1, -1, -1):
        if dims[i] == -1:
            dims[i] = left
            left = 1
    if left != 1:
        raise _cannot_convert(spec.name)
    return dims


def _cannot_convert(name: str) -> ProxyError:
    return ProxyError(ErrorKind.INVALID_ARGUMENT,
                      f"The schema can not convert input '{name}' to tensor with proper shape")


def answer_document(call: Call, result: Result) -> bytes:
    """A response as Triton's generate writes it: its keys in byte order, compact."""
    fields: dict[str, Any] = {"model_name": call.model, "model_version": result.version}
    if call.id or result.id:
        fields["id"] = call.id or result.id
    for key, value in result.parameters.items():
        if key != FINAL_FLAG and isinstance(value, (bool, int, float, str)):
            fields[key] = value
    floats = Spliced()  # float outputs written as Triton writes them (json_floats)
    for t in result.outputs:
        if t.datatype in kserve_http.NO_JSON_OUTPUT:
            raise kserve_http.bad(f"sending {t.datatype} data via JSON is not supported. "
                                  f"Please use the binary data format for output "
                                  f"(output '{t.name}' is {t.datatype})")
        if t.datatype in FLOAT_TYPES:
            values = t.numpy().reshape(-1)
            fields[t.name] = floats.stand_in(values, alone=values.size == 1)
            continue
        listed = t.to_list()
        fields[t.name] = listed[0] if len(listed) == 1 else listed
    return floats.into(json_bytes({k: fields[k] for k in sorted(fields,
                                                                key=lambda k: k.encode())}))


def _read_call(body: bytes, contract: ModelContract, model: str, version: str) -> Call:
    """The infer call a generate request's body means (pure: may run in a worker thread)."""
    infer = json_bytes(infer_document(_parse(body), contract, model))
    return kserve_http.decode_request(infer, None, model, version, "application/json")


async def _document(call: Call, result: Result) -> bytes:
    """``answer_document``, in a worker thread for a large answer."""
    if sum(t.nbytes for t in result.outputs) > INLINE_JSON_BYTES:
        return await asyncio.to_thread(answer_document, call, result)
    return answer_document(call, result)


class GenerateFront:
    """The two generate routes of one HTTP front (``HttpFront.app`` adds them)."""

    def __init__(self, plane: DataPlane, max_json_bytes: int,
                 respond: Callable[[LocalReply, dict[str, str] | None], web.Response]) -> None:
        self.plane = plane
        self.max_json_bytes = max_json_bytes
        self.respond = respond
        """The front's error answer (``http_v2.error_response``)."""

    def register(self, router: web.UrlDispatcher, bases: tuple[str, ...]) -> None:
        for base in bases:
            router.add_post(base + "/generate", self.generate)
            router.add_post(base + "/generate_stream", self.generate_stream)

    async def _call(self, request: web.Request) -> tuple[Call, bool]:
        """The call a generate request means, and whether its model is decoupled."""
        model = request.match_info["model"]
        version = request.match_info.get("version", "")
        try:
            contract = self.plane.contract(model, version)
            if request.headers.get("Content-Encoding", "identity") not in ("identity", ""):
                # matched as Triton matches it, case and all
                raise ProxyError(ErrorKind.INVALID_ARGUMENT, "Unsupported content-encoding, "
                                 "only 'identity' is supported.")
            setting = "listeners.http.max_json_bytes"
            body_bounds(request.headers, request.content_length, self.max_json_bytes, setting)
            body = await read_raw(request, self.max_json_bytes, setting)
            args = (body, contract, model, version)
            # read, converted and read again as an infer request: off the loop when large
            call = (await asyncio.to_thread(_read_call, *args) if len(body) > INLINE_JSON_BYTES
                    else _read_call(*args))
            call.headers = {k.lower(): v for k, v in request.headers.items()}
            call.deadline = header_deadline(call.headers)
            call.endpoint = request.path.rsplit("/", 1)[1]  # generate | generate_stream
        except ProxyError as err:
            self.plane.count_undecoded("http", err)  # refused before the data plane saw it
            raise
        return call, contract.decoupled

    async def _answers(self, call: Call, decoupled: bool, finish: Finish
                       ) -> AsyncGenerator[StreamItem, None]:
        """The call's answers: one (or its refusal) from a model that answers once, each
        response as it comes from a decoupled one."""
        if not decoupled:
            yield await self.plane.infer(call, finish)
            return
        async with contextlib.aclosing(self.plane.stream(call, finish)) as items:
            async for item in items:
                yield item

    async def generate(self, request: web.Request) -> web.Response:
        call, decoupled = await self._call(request)
        answers: list[Result] = []

        async def encode(result: Result) -> None:  # each answer, before it is counted
            result.encoded = await _document(call, result)
            answers.append(result)

        async with contextlib.aclosing(self._answers(call, decoupled, encode)) as items:
            async for item in items:
                if isinstance(item, LocalReply):
                    if _ran(item):
                        return web.Response(body=json_bytes({"error": item.message}), status=400,
                                            content_type="application/json",
                                            headers=call.shown_decisions())
                    return self.respond(item, call.shown_decisions())
        if len(answers) != 1 or answers[0].encoded is None:
            body = json_bytes({"error": ONE_ANSWER})  # Triton's 200, as it sends it
        else:
            body = answers[0].encoded
            self.plane.telemetry.count_response_bytes(call.model, "http", len(body))
        return web.Response(body=body, content_type="application/json",
                            headers=call.shown_decisions())

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        call, decoupled = await self._call(request)

        async def encode(result: Result) -> None:
            result.encoded = b"data: " + await _document(call, result) + b"\n\n"
            self.plane.telemetry.count_response_bytes(call.model, "http", len(result.encoded))

        response: web.StreamResponse | None = None
        async with contextlib.aclosing(self._answers(call, decoupled, encode)) as items:
            try:
                async for item in items:
                    if response is None:
                        if isinstance(item, LocalReply) and not _ran(item):
                            return self.respond(item, call.shown_decisions())  # model never ran
                        response = web.StreamResponse(
                            status=400 if isinstance(item, LocalReply) else 200,
                            headers=call.shown_decisions())
                        response.content_type = SSE_TYPE
                        await response.prepare(request)
                    if isinstance(item, LocalReply):
                        await response.write(b"data: " + json_bytes({"error": item.message})
                                             + b"\n\n")
                        break
                    if isinstance(item, Result) and item.encoded is not None:
                        await response.write(item.encoded)
            except ConnectionResetError:  # per request: DEBUG (the metric counts it)
                log.debug("client of model %r left its generate stream", call.model)
                return response or web.StreamResponse()
        if response is None:  # a decoupled model that sent nothing at all
            response = web.StreamResponse(headers=call.shown_decisions())
            response.content_type = SSE_TYPE
            await response.prepare(request)
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response
