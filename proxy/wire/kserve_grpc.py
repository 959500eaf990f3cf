"""KServe v2 protobuf ↔ ``Call`` / ``Result``, raw to raw.

Requests arrive as bytes (the gRPC front registers no deserializer) and are parsed once; the
original bytes stay on the call, so an unedited call to a gRPC backend is forwarded as it came.
A route that serves a model under another name rewrites ``model_name`` by appending the field:
proto3 keeps the last value of a scalar field, so no re-encoding of the tensors is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from proxy.call import Call, Decoded, RequestedOutput, Result, Wire
from proxy.errors import ErrorKind, ProxyError, bounded
from proxy.pb import grpc_service_pb2 as pb
from proxy.tensor import (
    MAX_PARAMETERS,
    MAX_RANK,
    MAX_TENSORS,
    Payload,
    Tensor,
)
from proxy.wire import pbwire, typed_contents
from proxy.wire.answers import answer_error, output_problem
from proxy.wire.kserve_raw import check_byte_size

_RAW_INPUTS = 7  # ModelInferRequest.raw_input_contents
_RAW_OUTPUTS = 6  # ModelInferResponse.raw_output_contents


def decode_request(body: bytes, shared_memory: bool = False) -> Call:
    """``shared_memory``: an input in a region becomes an empty placeholder that
    ``proxy.shm.regions`` fills (otherwise it is refused)."""
    parsed = _parse_whole(body, pb.ModelInferRequest, _request_fits)
    if parsed is not None:
        req, raws = parsed
        return _call_from(req, raws, {}, body, shared_memory)
    req = pb.ModelInferRequest()
    try:
        head, raws, contents = _split_request(body)
        req.ParseFromString(head)
    except pbwire.FieldLimit as exc:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT, f"the request has {exc}; mmguard takes "
                         f"at most {exc.limit}") from None
    except (DecodeError, pbwire.WireError) as exc:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"malformed ModelInferRequest: {exc}") from None
    return _call_from(req, raws, contents, body, shared_memory)


def _call_from(req: pb.ModelInferRequest, raws: list[memoryview],
               contents: dict[int, list[memoryview]], body: bytes, shared_memory: bool) -> Call:
    in_regions = sum(1 for inp in req.inputs if "shared_memory_region" in inp.parameters)
    if raws and len(raws) < len(req.inputs) - in_regions:  # more: Triton reads the first ones
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"request has {len(req.inputs) - in_regions} inputs outside shared "
                         f"memory but {len(raws)} raw_input_contents; each needs one")
    inputs = []
    next_raw = 0
    for i, inp in enumerate(req.inputs):
        params = params_from_pb(inp.parameters)
        shape = tuple(inp.shape)
        if "shared_memory_region" in params:
            _refuse_shared_memory(inp.name, shared_memory)
            inputs.append(Tensor(inp.name, inp.datatype, shape, raw=b"", parameters=params))
            continue
        t = Tensor(inp.name, inp.datatype, shape, parameters=params)
        if raws:
            if i in contents:
                raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                                 f"contents field must not be specified when using "
                                 f"raw_input_contents for '{inp.name}' for model "
                                 f"'{req.model_name}'")
            t.raw = raws[next_raw]
            next_raw += 1
            check_byte_size(t, req.model_name, req.id)
            t.check_payload((req.model_name, req.id))
        elif i in contents:
            # the element count the contents are held to must be a real one
            t.check_shape((req.model_name, req.id))
            # Counted against the shape while converted: the raw form fits it by construction.
            t.raw = typed_contents.contents_to_raw(t.name, t.datatype, t.shape, contents[i],
                                                   req.model_name, req.id)
        else:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"unable to find data for input tensor '{inp.name}' for model "
                             f"'{req.model_name}' in request. (It has neither "
                             "raw_input_contents nor contents.)")
        inputs.append(t)
    return Call(
        model=req.model_name, version=req.model_version, id=req.id, inputs=inputs,
        outputs=[_requested(o) for o in req.outputs],
        parameters=request_params(req.parameters), front="grpc", wire=Wire("grpc", body),
    )


def _requested(o: Any) -> RequestedOutput:
    """An output asked for; ``classification`` read as Triton's gRPC front reads it (a positive
    int64_param: its HTTP front reads 0 as "none", so the meanings differ across protocols)."""
    if "classification" in o.parameters:
        p = o.parameters["classification"]
        if p.WhichOneof("parameter_choice") != "int64_param":
            raise ProxyError(ErrorKind.INVALID_ARGUMENT, "invalid value type for "
                             "'classification' parameter, expected int64_param")
        if p.int64_param <= 0:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             "invalid value for 'classification' parameter, expected >= 0")
    return RequestedOutput(o.name, params_from_pb(o.parameters))


WHOLE_PARSE_BYTES = 2048
"""A message up to this size (a small request or answer) is first parsed whole by protobuf
(~2 µs with its checks, against ~8 µs for the walk below). Its parse is kept only when it is
provably what the walk would give. The walk refuses what protobuf refuses and, besides, a group
or a field number 0 (protobuf keeps a group as an unknown field), and hands everything else but
the payloads to protobuf, so duplicates merge alike. Hence the conditions: no unknown field
anywhere (dropping them leaves the size as it was), no shape over ``MAX_RANK`` dims, no input
with typed contents, and every raw payload found, in order, at the message's end (where protobuf
writes its last field). Anything else (any error included) takes the walk, so refusals and their
texts are the walk's. Each repeated element takes at least two bytes on the wire, so at this
size no other count can pass its bound (``MAX_PARAMETERS``, ``MAX_TENSORS``, ``MAX_FIELDS``)."""

M = TypeVar("M", pb.ModelInferRequest, pb.ModelInferResponse)


def _parse_whole(body: bytes, kind: type[M], fits: Callable[[M], bool]
                 ) -> tuple[M, list[memoryview]] | None:
    """``body`` parsed whole, and its raw tensor contents (the message's last field) as slices
    of it; None where the walk must decide (see ``WHOLE_PARSE_BYTES``)."""
    if len(body) > WHOLE_PARSE_BYTES:
        return None
    msg = kind()
    try:
        msg.ParseFromString(body)
    except DecodeError:
        return None
    if not fits(msg):
        return None
    size = msg.ByteSize()
    msg.DiscardUnknownFields()  # recursive: a group, or a known field of another wire type
    if msg.ByteSize() != size:
        return None
    if isinstance(msg, pb.ModelInferRequest):
        raw, tag = msg.raw_input_contents, _RAW_INPUTS << 3 | pbwire.LEN
    else:
        raw, tag = msg.raw_output_contents, _RAW_OUTPUTS << 3 | pbwire.LEN
    view = memoryview(body)
    slices: list[memoryview] = []
    end = len(body)
    for payload in reversed(raw):
        start = end - len(payload)
        head = bytes((tag,)) + pbwire.encode_varint(len(payload))
        if start < len(head) or body[start - len(head):start] != head or (
                view[start:end] != payload):
            return None  # not at the end in order: the walk finds them
        slices.append(view[start:end])
        end = start - len(head)
    slices.reverse()
    return msg, slices


def _request_fits(req: pb.ModelInferRequest) -> bool:
    """No shape over ``MAX_RANK`` dims and no typed contents (the walk takes those apart)."""
    return all(len(inp.shape) <= MAX_RANK and not inp.HasField("contents")
               for inp in req.inputs)


def _response_fits(resp: pb.ModelInferResponse) -> bool:
    return True  # the walk of an answer holds no counts


# ModelInferRequest fields, and those of its InferInputTensor / InferRequestedOutputTensor.
_PARAMETERS, _INPUTS, _OUTPUTS = 4, 5, 6
_INPUT_SHAPE, _INPUT_PARAMETERS, _INPUT_CONTENTS = 3, 4, 5
_OUTPUT_PARAMETERS = 2
MAX_FIELDS = 50_000
"""The most protobuf fields one request may hold outside its tensor payloads (walking one costs
a microsecond or two: the walk stays under ~0.1 s however the body is built)."""
_LIMITS = {_PARAMETERS: (MAX_PARAMETERS, "request parameters"), _INPUTS: (MAX_TENSORS, "inputs"),
           _OUTPUTS: (MAX_TENSORS, "outputs"), _RAW_INPUTS: (MAX_TENSORS, "raw_input_contents")}


def _split_request(body: bytes) -> tuple[bytes, list[memoryview], dict[int, list[memoryview]]]:
    """The request without its payloads (to parse), ``raw_input_contents`` as slices, and each
    input's typed ``contents`` as slices by input index. Every repeated field is counted against
    its bound on the wire, before protobuf builds anything from it."""
    view = memoryview(body)
    budget = pbwire.Budget(MAX_FIELDS, "protobuf fields outside its tensor payloads")
    seen = dict.fromkeys(_LIMITS, 0)
    rest: list[bytes | memoryview] = []
    raws: list[memoryview] = []
    contents: dict[int, list[memoryview]] = {}
    for number, start, value, end in pbwire.fields(view, budget):
        if number in seen:
            seen[number] += 1
            limit, what = _LIMITS[number]
            if seen[number] > limit:
                raise pbwire.FieldLimit(limit, what)
        is_message = pbwire.wire_type_at(view, start) == pbwire.LEN
        if number == _RAW_INPUTS:
            raws.append(view[value:end])
        elif number == _INPUTS and is_message:
            pieces, stripped = _input_without_contents(view[value:end], budget)
            if pieces:
                contents[seen[_INPUTS] - 1] = pieces
                rest.append(pbwire.len_field(_INPUTS, stripped))
            else:
                rest.append(view[start:end])
        else:
            if number == _OUTPUTS and is_message:
                _count_output_fields(view[value:end], budget)
            rest.append(view[start:end])
    return b"".join(rest), raws, contents


def _input_without_contents(tensor: memoryview, budget: pbwire.Budget
                            ) -> tuple[list[memoryview], bytes]:
    """An InferInputTensor's ``contents`` values, and the tensor without them; its shape and
    parameters are counted against their bounds."""
    pieces: list[memoryview] = []
    rest: list[memoryview] = []
    dims = params = 0
    for number, start, value, end in pbwire.fields(tensor, budget):
        packed = pbwire.wire_type_at(tensor, start) == pbwire.LEN
        if number == _INPUT_CONTENTS and packed:
            pieces.append(tensor[value:end])
            continue
        if number == _INPUT_SHAPE:
            dims += pbwire.count_varints(tensor[value:end]) if packed else 1
            if dims > MAX_RANK:
                raise pbwire.FieldLimit(MAX_RANK, "dims in one input's shape")
        elif number == _INPUT_PARAMETERS:
            params += 1
            if params > MAX_PARAMETERS:
                raise pbwire.FieldLimit(MAX_PARAMETERS, "parameters on one input")
        rest.append(tensor[start:end])
    return pieces, b"".join(rest) if pieces else b""


def _count_output_fields(output: memoryview, budget: pbwire.Budget) -> None:
    params = 0
    for number, _, _, _ in pbwire.fields(output, budget):
        params += number == _OUTPUT_PARAMETERS
        if params > MAX_PARAMETERS:
            raise pbwire.FieldLimit(MAX_PARAMETERS, "parameters on one requested output")


def encode_request(call: Call, model: str, version: str) -> bytes:
    if call.wire is not None and call.wire.protocol == "grpc":
        body = call.wire.body
        if model != call.model:
            body += _string_field(1, model)
        if version != call.version:
            body += _string_field(2, version)
        return body
    req = pb.ModelInferRequest(model_name=model, model_version=version, id=call.id)
    params_to_pb(req.parameters, _without(call.parameters, HTTP_ONLY_PARAMETERS))
    for t in call.inputs:
        inp = req.inputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        params_to_pb(inp.parameters, _without(t.parameters, HTTP_ONLY_PARAMETERS))
        req.raw_input_contents.append(bytes(t.raw_bytes()))
    for o in call.outputs:
        # Everything else crosses: ``classification`` (the extension), custom parameters. An
        # HTTP ``classification: 0`` means none (Triton's HTTP front); gRPC refuses 0, so it
        # does not cross.
        out = req.outputs.add(name=o.name)
        params = _without(o.parameters, HTTP_ONLY_PARAMETERS)
        if type(params.get("classification")) is int and params["classification"] == 0:
            params = _without(params, frozenset({"classification"}))
        params_to_pb(out.parameters, params)
    return bytes(req.SerializeToString())


HTTP_ONLY_PARAMETERS = frozenset({"binary_data", "binary_data_output", "binary_data_size"})
"""Parameters of the HTTP binary tensor extension: they say how the HTTP body is laid out, so
they do not cross to gRPC (where every tensor is raw); the HTTP front answers in the form the
client asked for from the call's own parameters."""


def _without(params: dict[str, Any], names: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k not in names}


def decode_response(body: bytes, source: str = "backend") -> Result:
    """The answer as a ``Result`` that keeps its wire form. The small head (everything but the
    tensor bytes) is parsed now, so every output's length is checked against its shape before
    the answer goes anywhere (``proxy.wire.answers``); the tensor bytes are neither parsed nor
    copied.
    ``source`` names the sender in errors (``backend 'triton' for model 'clip'``)."""
    parsed = _parse_whole(body, pb.ModelInferResponse, _response_fits)
    if parsed is not None:
        resp, raws = parsed
        _check_response(resp, raws, source)
        return Result(wire=Wire("grpc", body), decode=lambda: _decoded(resp, raws))
    resp = pb.ModelInferResponse()
    try:
        head, raws = pbwire.split(body, _RAW_OUTPUTS)
        resp.ParseFromString(head)
    except (DecodeError, pbwire.WireError) as exc:
        raise ProxyError(ErrorKind.BAD_GATEWAY, f"{source} sent a malformed ModelInferResponse: "
                         f"{exc}", origin="backend") from None
    _check_response(resp, raws, source)
    return Result(wire=Wire("grpc", body), decode=lambda: _decoded(resp, raws))


def result_from_pb(resp: pb.ModelInferResponse, wire: Wire | None,
                   source: str = "backend") -> Result:
    raws: list[Any] = list(resp.raw_output_contents)
    _check_response(resp, raws, source)
    return Result(wire=wire, decode=lambda: _decoded(resp, raws))


def _check_response(resp: pb.ModelInferResponse, raws: list[Any], source: str) -> None:
    if raws and len(raws) != len(resp.outputs):
        raise answer_error(source, f"{len(resp.outputs)} outputs but {len(raws)} "
                           "raw_output_contents; they must match one to one")
    for i, o in enumerate(resp.outputs):
        if i < len(raws):
            problem = output_problem(o.name, o.datatype, tuple(o.shape), raws[i])
        else:  # typed contents (no server we know sends them): checked after conversion
            try:
                problem = output_problem(o.name, o.datatype, tuple(o.shape),
                                         _contents_to_raw(o))
            except ProxyError as err:
                problem = err.message.replace("input", "output", 1)
        if problem is not None:
            raise answer_error(source, problem)


def _decoded(resp: pb.ModelInferResponse, raws: list[Any]) -> Decoded:
    outputs = []
    for i, o in enumerate(resp.outputs):
        raw = raws[i] if i < len(raws) else _contents_to_raw(o)
        outputs.append(Tensor(o.name, o.datatype, tuple(o.shape), raw=raw,
                              parameters=params_from_pb(o.parameters)))
    return Decoded(resp.model_name, resp.model_version, resp.id,
                   params_from_pb(resp.parameters), outputs)


def encode_response(call: Call, result: Result) -> bytes:
    if result.wire is not None and result.wire.protocol == "grpc":
        body = result.wire.body
        renamed = call.target is not None and call.target.model != call.model
        return body + _string_field(1, call.model) if renamed else body
    return bytes(response_pb(call, result).SerializeToString())


def response_pb(call: Call, result: Result) -> pb.ModelInferResponse:
    resp = pb.ModelInferResponse(model_name=call.model, model_version=result.version,
                                 id=call.id or result.id)
    params_to_pb(resp.parameters, result.parameters)
    for t in result.outputs:
        resp.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        resp.raw_output_contents.append(bytes(t.raw_bytes()))
    return resp


def stream_response(infer_response: bytes) -> bytes:
    """``ModelStreamInferResponse{infer_response}`` around already-encoded response bytes."""
    return b"\x12" + pbwire.encode_varint(len(infer_response)) + infer_response


def stream_error(message: str, model: str = "", request_id: str = "") -> bytes:
    """A stream's error answer, naming the request it answers as Triton's does (its id and
    model in ``infer_response``): a client with several requests in flight tells them apart."""
    out = pb.ModelStreamInferResponse(error_message=bounded(message))
    if model or request_id:
        out.infer_response.model_name = model
        out.infer_response.id = request_id
    return bytes(out.SerializeToString())


def request_id(body: bytes) -> str:
    """The id of a request that was refused while decoding ("" when its fields cannot be
    walked): its top-level fields only, bounded as the decode's walk is, never a second parse
    of what was just refused (it may be large, or made of millions of fields)."""
    found = b""
    view = memoryview(body)
    try:
        for number, tag, value, end in pbwire.fields(view, pbwire.Budget(MAX_FIELDS)):
            if number == 3 and pbwire.wire_type_at(view, tag) == pbwire.LEN:
                found = body[value:end]  # ModelInferRequest.id; the last one wins, as protobuf's
    except pbwire.WireError:
        return ""
    try:
        return found.decode()
    except UnicodeDecodeError:
        return ""


def params_from_pb(params: Any) -> dict[str, Any]:
    if not params:
        return {}
    out: dict[str, Any] = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(p, which)
    return out


_CUSTOM_KINDS = (("int64_param", "bool_param", "string_param", "double_param"),
                 "int64_param, bool_param, or string_param")
RESERVED_PARAMETERS = {
    "sequence_id": (("int64_param", "string_param"), "int64_param or string_param"),
    "sequence_start": (("bool_param",), "bool_param"),
    "sequence_end": (("bool_param",), "bool_param"),
    "priority": (("int64_param", "uint64_param"), "int64_param or uint64_param"),
    "timeout": (("int64_param",), "int64_param"),
    "triton_enable_empty_final_response": (("bool_param",), "bool_param"),
}
"""The request parameters Triton's gRPC front reads itself, with the kinds it takes (any other
key is the model's, of ``_CUSTOM_KINDS``; Triton's text names no double_param, but takes it)."""


def request_params(params: Any) -> dict[str, Any]:
    """A request's parameters, refused as Triton's gRPC front refuses them, whatever backend
    follows: a ``triton_http`` backend would read them by its HTTP front's rules (a
    ``uint64_param`` or an unset value passed, a string ``priority`` an INTERNAL error)."""
    for key, p in params.items():
        if key.startswith("triton_") and key not in RESERVED_PARAMETERS:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             "parameter keys starting with 'triton_' are reserved for Triton "
                             "usage. Only the following keys starting with 'triton_' are "
                             "allowed: triton_enable_empty_final_response")
        kinds, words = RESERVED_PARAMETERS.get(key, _CUSTOM_KINDS)
        which = p.WhichOneof("parameter_choice")
        if which not in kinds:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT, f"invalid value type for '{key}' "
                             f"parameter, expected {words}. (got "
                             f"{which or 'no value'})")
        if key == "priority" and which == "int64_param" and p.int64_param < 0:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             "invalid value for 'priority', expected value >= 0.")
    return params_from_pb(params)


def params_to_pb(target: Any, params: dict[str, Any]) -> None:
    for key, value in params.items():
        p = target[key]
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int) and value >= 2**63:  # a priority may be a uint64
            p.uint64_param = value
        elif isinstance(value, int):
            p.int64_param = value
        elif isinstance(value, float):
            p.double_param = value
        else:
            p.string_param = str(value)


def _contents_to_raw(tensor: Any) -> Payload:
    """An output's typed ``contents`` (no server we know sends them) → raw bytes: counted
    against the shape and converted by numpy, as a request's are (``typed_contents``)."""
    return typed_contents.contents_to_raw(tensor.name, tensor.datatype, tuple(tensor.shape),
                                          [memoryview(tensor.contents.SerializeToString())])


def _refuse_shared_memory(name: str, allowed: bool) -> None:
    if not allowed:
        raise ProxyError(ErrorKind.UNIMPLEMENTED,
                         f"input '{name}' uses shared memory, which mmguard serves on ModelInfer "
                         "and HTTP infer only (not on ModelStreamInfer)")


def _string_field(number: int, value: str) -> bytes:
    data = value.encode()
    return pbwire.encode_varint((number << 3) | 2) + pbwire.encode_varint(len(data)) + data
