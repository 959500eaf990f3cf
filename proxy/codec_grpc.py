"""KServe v2 protobuf ↔ ``Call`` / ``Result``, raw to raw.

Requests arrive as bytes (the gRPC front registers no deserializer) and are parsed once; the
original bytes stay on the call, so an unedited call to a gRPC backend is forwarded as it came.
A route that serves a model under another name rewrites ``model_name`` by appending the field:
proto3 keeps the last value of a scalar field, so no re-encoding of the tensors is needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from proxy import pbwire
from proxy.call import Call, Decoded, RequestedOutput, Result, Wire
from proxy.errors import ErrorKind, ProxyError
from proxy.pb import grpc_service_pb2 as pb
from proxy.tensor import Tensor, encode_bytes_elements, numpy_dtype

_RAW_INPUTS = 7  # ModelInferRequest.raw_input_contents
_RAW_OUTPUTS = 6  # ModelInferResponse.raw_output_contents
_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


def decode_request(body: bytes, shared_memory: bool = False) -> Call:
    """``shared_memory``: an input in a region becomes an empty placeholder that
    ``proxy.shm`` fills (otherwise it is refused)."""
    req = pb.ModelInferRequest()
    try:
        head, raws = pbwire.split(body, _RAW_INPUTS)
        req.ParseFromString(head)
    except (DecodeError, pbwire.WireError) as exc:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"malformed ModelInferRequest: {exc}") from None
    in_regions = sum(1 for inp in req.inputs if "shared_memory_region" in inp.parameters)
    if raws and len(raws) != len(req.inputs) - in_regions:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"request has {len(req.inputs) - in_regions} inputs outside shared "
                         f"memory but {len(raws)} raw_input_contents; they must match one to one")
    inputs = []
    next_raw = 0
    for inp in req.inputs:
        params = params_from_pb(inp.parameters)
        shape = tuple(inp.shape)
        if "shared_memory_region" in params:
            _refuse_shared_memory(inp.name, shared_memory)
            inputs.append(Tensor(inp.name, inp.datatype, shape, raw=b"", parameters=params))
            continue
        if raws:
            t = Tensor(inp.name, inp.datatype, shape, raw=raws[next_raw], parameters=params)
            next_raw += 1
        elif inp.HasField("contents"):
            t = Tensor(inp.name, inp.datatype, shape, raw=_contents_to_raw(inp), parameters=params)
        else:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"input '{inp.name}' has no data (neither raw_input_contents nor "
                             "contents)")
        t.check_payload()
        inputs.append(t)
    return Call(
        model=req.model_name, version=req.model_version, id=req.id, inputs=inputs,
        outputs=[RequestedOutput(o.name, params_from_pb(o.parameters)) for o in req.outputs],
        parameters=params_from_pb(req.parameters), front="grpc", wire=Wire("grpc", body),
    )


def encode_request(call: Call, model: str, version: str) -> bytes:
    if call.wire is not None and call.wire.protocol == "grpc":
        body = call.wire.body
        if model != call.model:
            body += _string_field(1, model)
        if version != call.version:
            body += _string_field(2, version)
        return body
    req = pb.ModelInferRequest(model_name=model, model_version=version, id=call.id)
    params_to_pb(req.parameters, call.parameters)
    for t in call.inputs:
        inp = req.inputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        params_to_pb(inp.parameters, {k: v for k, v in t.parameters.items()
                                      if k != "binary_data_size"})
        req.raw_input_contents.append(bytes(t.raw_bytes()))
    for o in call.outputs:
        out = req.outputs.add(name=o.name)
        params_to_pb(out.parameters, {k: v for k, v in o.parameters.items()
                                      if k not in ("binary_data", "classification")})
    return bytes(req.SerializeToString())


def decode_response(body: bytes, source: str = "backend") -> Result:
    """The answer as a lazily decoded ``Result``: its framing is checked now (cheap, no copy),
    its fields are parsed only if someone reads them. ``source`` names the sender in errors
    (e.g. "backend 'triton' (model 'clip')")."""
    try:
        head, raws = pbwire.split(body, _RAW_OUTPUTS)
    except pbwire.WireError as exc:
        raise ProxyError(ErrorKind.INTERNAL, f"{source} sent a malformed ModelInferResponse: "
                         f"{exc}", origin="backend") from None

    def decode() -> Decoded:
        resp = pb.ModelInferResponse()
        try:
            resp.ParseFromString(head)
        except DecodeError as exc:
            raise ProxyError(ErrorKind.INTERNAL,
                             f"{source} sent a malformed ModelInferResponse: {exc}",
                             origin="backend") from None
        return _decoded(resp, raws)

    return Result(wire=Wire("grpc", body), decode=decode)


def result_from_pb(resp: pb.ModelInferResponse, wire: Wire | None) -> Result:
    return Result(wire=wire, decode=lambda: _decoded(resp, list(resp.raw_output_contents)))


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
    return b"\x12" + _varint(len(infer_response)) + infer_response


def stream_error(message: str) -> bytes:
    return bytes(pb.ModelStreamInferResponse(error_message=message).SerializeToString())


def params_from_pb(params: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(p, which)
    return out


def params_to_pb(target: Any, params: dict[str, Any]) -> None:
    for key, value in params.items():
        p = target[key]
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int):
            p.int64_param = value
        elif isinstance(value, float):
            p.double_param = value
        else:
            p.string_param = str(value)


def _contents_to_raw(tensor: Any) -> bytes:
    """Typed ``contents`` (rare: tritonclient always sends raw) → raw bytes, via numpy."""
    field = _CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"input '{tensor.name}': datatype {tensor.datatype} cannot be sent in "
                         "typed contents; use raw_input_contents")
    values = getattr(tensor.contents, field)
    if tensor.datatype == "BYTES":
        return encode_bytes_elements(list(values))
    return np.asarray(values, dtype=numpy_dtype(tensor.datatype)).tobytes()


def _refuse_shared_memory(name: str, allowed: bool) -> None:
    if not allowed:
        raise ProxyError(ErrorKind.UNIMPLEMENTED,
                         f"input '{name}' uses shared memory, which mmguard serves on ModelInfer "
                         "and HTTP infer only (not on ModelStreamInfer)")


def _string_field(number: int, value: str) -> bytes:
    data = value.encode()
    return _varint((number << 3) | 2) + _varint(len(data)) + data


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
