"""KServe v2 requests for the fuzzers: valid ones built from random tensors, then broken.

``grpc_bodies()`` gives ``ModelInferRequest`` bytes, ``http_bodies()`` a v2 HTTP body and its
``Inference-Header-Content-Length`` (None for plain JSON). About a third of each is valid before
the byte-level mutations, so the decoders' accepting paths are fuzzed as much as their refusals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

from proxy.pb import grpc_service_pb2 as pb
from proxy.tensor import DATATYPES, encode_bytes_elements, itemsize, numpy_dtype
from tests.fuzz.mutations import (
    EDGE_INTS,
    dumps,
    edge_ints,
    hostile_json,
    json_scalars,
    json_values,
    mutated_bytes,
)

NUMERIC = sorted(DATATYPES - {"BYTES"})
WRONG_DATATYPES = ["FLOAT32", "fp32", "TYPE_FP32", "", "BYTES ", "STRING", "INT128", "FP8",
                   "bool", "\u0000"]
INT64 = (-(2**63), 2**63 - 1)


@dataclass
class TensorSpec:
    name: str
    datatype: str
    shape: list[int]
    raw: bytes
    values: list[Any]
    """The elements as JSON values (what a JSON client would send as ``data``)."""


def _json_value(datatype: str, x: Any) -> Any:
    if datatype == "BYTES":
        return x.decode("latin-1")
    if datatype == "BF16":
        return int(x)  # BF16 bits travel as uint16 in JSON here
    return x.item()


@st.composite
def tensors(draw: st.DrawFn) -> TensorSpec:
    datatype = draw(st.sampled_from(sorted(DATATYPES)))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    n = math.prod(shape)
    name = draw(st.sampled_from(["INPUT0", "pixel_values", "input_ids"]) | st.text(max_size=6))
    if datatype == "BYTES":
        items = draw(st.lists(st.binary(max_size=6), min_size=n, max_size=n))
        return TensorSpec(name, datatype, shape, encode_bytes_elements(items),
                          [_json_value(datatype, x) for x in items])
    size = itemsize(datatype) or 1
    raw = draw(st.binary(min_size=n * size, max_size=n * size))
    if datatype == "BOOL":
        raw = bytes(b & 1 for b in raw)
    arr = np.frombuffer(raw, dtype=numpy_dtype(datatype))
    if datatype.startswith("FP"):
        arr = np.nan_to_num(arr)  # JSON has no NaN; the hostile texts add them separately
        raw = arr.tobytes()
    return TensorSpec(name, datatype, shape, raw, [_json_value(datatype, x) for x in arr])


def wrong_shapes() -> st.SearchStrategy[list[int]]:
    """Negative, huge, overflowing or empty shapes, all within int64 (what protobuf can carry)."""
    dims = st.sampled_from([d for d in EDGE_INTS if INT64[0] <= d <= INT64[1]])
    return st.one_of(
        st.lists(dims | st.integers(-3, 5), max_size=4),
        st.sampled_from([[2**32, 2**32], [0, 2**62], [2**62, 0], [0, 2**63 - 1], [-1],
                         [3, -3], [2**31, 2**31, 4], []]))


@st.composite
def broken_bytes_framing(draw: st.DrawFn, raw: bytes) -> bytes:
    """A BYTES payload whose length prefixes lie: past the end, cut, or one element too many."""
    way = draw(st.sampled_from(["past_end", "cut_prefix", "extra", "huge"]))
    if way == "past_end":
        return raw + (draw(st.integers(1, 2**32 - 1))).to_bytes(4, "little") + b"ab"
    if way == "cut_prefix":
        return raw + b"\x01\x00"
    if way == "extra":
        return raw + encode_bytes_elements([b"x"])
    return b"\xff\xff\xff\xff" + raw


@st.composite
def bytes_payloads(draw: st.DrawFn) -> tuple[bytes, int]:
    """(BYTES payload, element count the shape asks for), framed right or wrong."""
    items = draw(st.lists(st.binary(max_size=8), max_size=5))
    raw = encode_bytes_elements(items)
    raw = draw(st.sampled_from([raw, raw]) | mutated_bytes(raw) | broken_bytes_framing(raw)
               | st.binary(max_size=32))
    return raw, draw(st.sampled_from([len(items), len(items)]) | st.integers(0, 8))


# --- gRPC ---------------------------------------------------------------------------------------


def _typed_contents(inp: Any, spec: TensorSpec, field: str) -> None:
    values = getattr(inp.contents, field)
    for v in spec.values:  # values that do not fit the field are left out: a count mismatch
        try:
            values.append(v.encode("latin-1") if isinstance(v, str) else v)
        except (TypeError, ValueError, OverflowError):
            pass


@st.composite
def grpc_requests(draw: st.DrawFn, models: st.SearchStrategy[str] | None = None
                  ) -> pb.ModelInferRequest:
    specs = draw(st.lists(tensors(), min_size=1, max_size=3))
    model = draw(st.text(max_size=12) if models is None else models)
    req = pb.ModelInferRequest(model_name=model, id=draw(st.text(max_size=4)))
    typed = draw(st.booleans()) and draw(st.booleans())
    for spec in specs:
        inp = req.inputs.add(name=spec.name, datatype=spec.datatype, shape=spec.shape)
        if typed:
            field = draw(st.sampled_from(["bool_contents", "int_contents", "int64_contents",
                                          "uint_contents", "uint64_contents", "fp32_contents",
                                          "fp64_contents", "bytes_contents"]))
            _typed_contents(inp, spec, field)
        else:
            req.raw_input_contents.append(spec.raw)
    for _ in range(draw(st.integers(0, 2))):
        _mutate_grpc(draw, req)
    return req


def _mutate_grpc(draw: st.DrawFn, req: pb.ModelInferRequest) -> None:
    i = draw(st.integers(0, len(req.inputs) - 1))
    inp = req.inputs[i]
    way = draw(st.sampled_from(["datatype", "shape", "raw", "framing", "extra_raw", "params",
                                "outputs", "drop_raw"]))
    if way == "datatype":
        inp.datatype = draw(st.sampled_from(WRONG_DATATYPES + sorted(DATATYPES)))
    elif way == "shape":
        del inp.shape[:]
        inp.shape.extend(draw(wrong_shapes()))
    elif way == "raw" and i < len(req.raw_input_contents):
        req.raw_input_contents[i] = draw(mutated_bytes(req.raw_input_contents[i]))
    elif way == "framing" and i < len(req.raw_input_contents):
        inp.datatype = "BYTES"
        req.raw_input_contents[i] = draw(broken_bytes_framing(req.raw_input_contents[i]))
    elif way == "extra_raw":
        req.raw_input_contents.append(draw(st.binary(max_size=8)))
    elif way == "drop_raw" and req.raw_input_contents:
        del req.raw_input_contents[-1]
    elif way == "params":
        key = draw(st.sampled_from(["binary_data_size", "shared_memory_region", "priority"])
                   | st.text(max_size=6))
        p = draw(st.sampled_from([req.parameters, inp.parameters]))[key]
        value = draw(json_scalars())
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int) and INT64[0] <= value <= INT64[1]:
            p.int64_param = value
        elif isinstance(value, float):
            p.double_param = value
        else:
            p.string_param = str(value)
    elif way == "outputs":
        req.outputs.add(name=draw(st.text(max_size=6)))


def grpc_bodies(models: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[bytes]:
    structured = grpc_requests(models).map(lambda r: bytes(r.SerializeToString()))
    return st.one_of(
        st.binary(max_size=256),
        structured,
        structured.flatmap(mutated_bytes),
    )


@st.composite
def grpc_responses(draw: st.DrawFn) -> pb.ModelInferResponse:
    """A backend's answer: the drawn request's tensors as outputs, sometimes with parameters or
    an output whose raw contents are missing, extra or wrong."""
    req = draw(grpc_requests())
    resp = pb.ModelInferResponse(model_name=req.model_name, model_version=draw(
        st.sampled_from(["", "1"])), id=req.id)
    for key, value in req.parameters.items():
        resp.parameters[key].CopyFrom(value)
    for inp in req.inputs:
        resp.outputs.add(name=inp.name, datatype=inp.datatype, shape=inp.shape)
    resp.raw_output_contents.extend(req.raw_input_contents)
    return resp


def grpc_answers() -> st.SearchStrategy[bytes]:
    structured = grpc_responses().map(lambda r: bytes(r.SerializeToString()))
    return st.one_of(st.binary(max_size=256), structured, structured.flatmap(mutated_bytes))


# --- HTTP ---------------------------------------------------------------------------------------


@st.composite
def _json_data(draw: st.DrawFn, spec: TensorSpec) -> Any:
    """The tensor's values as JSON ``data``: flat, nested in its shape, or subtly wrong."""
    values: list[Any] = list(spec.values)
    way = draw(st.sampled_from(["flat", "nested", "flat", "wrong"]))
    if way == "nested" and spec.shape:
        arr = np.empty(len(values), dtype=object)
        arr[:] = values
        return arr.reshape(spec.shape).tolist()
    if way == "wrong":
        extra = draw(st.lists(json_values(4), min_size=1, max_size=3))
        pos = draw(st.integers(0, len(values)))
        return draw(st.sampled_from([values[:pos] + extra + values[pos:], values[:pos],
                                     extra[0], [values]]))
    return values


def _wrong_json_shape() -> st.SearchStrategy[Any]:
    return st.one_of(wrong_shapes(), st.lists(edge_ints(), max_size=3),
                     st.lists(json_scalars(), max_size=3), json_scalars())


@st.composite
def http_docs(draw: st.DrawFn) -> tuple[dict[str, Any], list[bytes]]:
    """A v2 request document and the binary chunks its inputs declare, in order."""
    specs = draw(st.lists(tensors(), min_size=1, max_size=3))
    binary = draw(st.booleans())
    inputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for spec in specs:
        item: dict[str, Any] = {"name": spec.name, "datatype": spec.datatype,
                                "shape": spec.shape}
        if binary and draw(st.integers(0, 4)):
            item["parameters"] = {"binary_data_size": len(spec.raw)}
            chunks.append(spec.raw)
        else:
            item["data"] = draw(_json_data(spec))
        inputs.append(item)
    doc: dict[str, Any] = {"inputs": inputs}
    if draw(st.booleans()):
        doc["outputs"] = [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]
    for _ in range(draw(st.integers(0, 2))):
        _mutate_http(draw, doc, chunks)
    return doc, chunks


def _mutate_http(draw: st.DrawFn, doc: dict[str, Any], chunks: list[bytes]) -> None:
    inputs = doc["inputs"]
    items = [x for x in inputs if isinstance(x, dict)] if isinstance(inputs, list) else []
    way = draw(st.sampled_from(["datatype", "shape", "size", "item_key", "doc_key", "chunk",
                                "framing", "output"]))
    if not items:  # an earlier mutation replaced the inputs themselves
        items, way = [{}], "doc_key"
    item = draw(st.sampled_from(items))
    if way == "datatype":
        item["datatype"] = draw(st.sampled_from(WRONG_DATATYPES + sorted(DATATYPES))
                                | json_scalars())
    elif way == "shape":
        item["shape"] = draw(_wrong_json_shape())
    elif way == "size":
        size = draw(st.sampled_from([-1, 0, 2**31, 2**64, 10**30, 1.5, "4", True, None])
                    | st.integers(0, 64))
        if not isinstance(item.get("parameters"), dict):
            item["parameters"] = {}
        item["parameters"]["binary_data_size"] = size
    elif way == "item_key":
        key = draw(st.sampled_from(["name", "data", "parameters", "shape", "datatype"]))
        item[key] = draw(json_values(6))
    elif way == "doc_key":
        key = draw(st.sampled_from(["inputs", "outputs", "parameters", "id"]))
        doc[key] = draw(json_values(6))
    elif way == "output":
        doc["outputs"] = [{"name": draw(st.text(max_size=6) | json_scalars()),
                           "parameters": draw(json_values(4))}]
    elif way == "chunk" and chunks:
        i = draw(st.integers(0, len(chunks) - 1))
        chunks[i] = draw(mutated_bytes(chunks[i]))
    elif way == "framing" and chunks:
        i = draw(st.integers(0, len(chunks) - 1))
        chunks[i] = draw(broken_bytes_framing(chunks[i]))


@st.composite
def http_bodies(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """(body, Inference-Header-Content-Length header or None)."""
    way = draw(st.sampled_from(["arbitrary", "structured", "structured", "hostile", "mutated"]))
    if way == "arbitrary":
        body = draw(st.binary(max_size=256))
        hlen = draw(st.none() | st.integers(-2, len(body) + 2).map(str))
        return body, hlen
    doc, chunks = draw(http_docs())
    head = draw(hostile_json(doc)) if way == "hostile" else dumps(doc)
    if way == "mutated":
        head = draw(mutated_bytes(head))
    if not chunks and draw(st.integers(0, 3)) > 0:
        return head, None
    length = len(head)
    header = draw(st.just(str(length)) | st.sampled_from(
        [str(length - 1), str(length + 1), "-1", "0", " 12", "1e3", "0x10", "", "abc",
         str(2**64), "٣"]))
    return head + b"".join(chunks), header
