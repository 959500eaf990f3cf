"""A small ModelInferRequest / ModelInferResponse is parsed whole by protobuf, and that parse is
kept only where it is exactly what the zero-copy walk gives (``kserve_grpc.WHOLE_PARSE_BYTES``).
Each case here is one way a body can differ from its canonical form: the fast path either reads
it as the walk does or steps aside, and the decoder's answer (the call, the answer, or the
refusal and its text) is the walk's either way."""

from __future__ import annotations

import numpy as np
import pytest

from proxy.pb import grpc_service_pb2 as pb
from proxy.tensor import MAX_PARAMETERS, MAX_RANK, MAX_TENSORS
from proxy.wire import kserve_grpc, pbwire
from tests.fuzz.properties import grpc_outcome, walk_only


def _request(raw_len: int = 64, **params: int) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="small_fp32")
    inp = req.inputs.add(name="x", datatype="UINT8", shape=[1, raw_len])
    for key, value in params.items():
        inp.parameters[key].int64_param = value
    req.outputs.add(name="y")
    req.raw_input_contents.append(bytes(range(256)) * (raw_len // 256) + bytes(raw_len % 256))
    return req


def _tag(number: int, wire_type: int) -> bytes:
    return pbwire.encode_varint(number << 3 | wire_type)


def _same_as_walk(body: bytes, whole: bool) -> None:
    parsed = kserve_grpc._parse_whole(body, pb.ModelInferRequest, kserve_grpc._request_fits)
    assert (parsed is not None) is whole
    assert grpc_outcome(kserve_grpc.decode_request, body) == walk_only(
        grpc_outcome, kserve_grpc.decode_request, body)


def test_the_bounds_hold_at_the_size_parsed_whole() -> None:
    # every repeated element takes two bytes at least: no count over its bound fits
    smallest_bound = min(MAX_PARAMETERS, MAX_TENSORS, kserve_grpc.MAX_FIELDS)
    assert 2 * (smallest_bound + 1) > kserve_grpc.WHOLE_PARSE_BYTES


@pytest.mark.parametrize("raw_len", [0, 16, 127, 128, 300, 1800])
def test_a_client_request_is_parsed_whole_and_its_payload_is_a_slice_of_the_body(
        raw_len: int) -> None:
    body = _request(raw_len, priority=2).SerializeToString()
    _same_as_walk(body, whole=len(body) <= kserve_grpc.WHOLE_PARSE_BYTES)
    call = kserve_grpc.decode_request(body)
    raw = call.inputs[0].raw
    assert isinstance(raw, memoryview) and raw.obj is body  # no copy, the walk's form
    assert bytes(raw) == _request(raw_len).raw_input_contents[0]
    assert call.inputs[0].parameters == {"priority": 2}


def test_the_size_bound_is_inclusive() -> None:
    sizes = {len(_request(n).SerializeToString()): n for n in range(1700, 2100)}
    at, over = kserve_grpc.WHOLE_PARSE_BYTES, kserve_grpc.WHOLE_PARSE_BYTES + 1
    assert at in sizes and over in sizes
    _same_as_walk(_request(sizes[at]).SerializeToString(), whole=True)
    _same_as_walk(_request(sizes[over]).SerializeToString(), whole=False)


def test_a_parameter_key_sent_twice_merges_as_the_walk_merges_it() -> None:
    req = _request()
    req.parameters["k"].int64_param = 2
    first = pb.ModelInferRequest(parameters={"k": pb.InferParameter(int64_param=1)})
    body = first.SerializeToString() + req.SerializeToString()  # protobuf keeps the last
    _same_as_walk(body, whole=True)
    assert kserve_grpc.decode_request(body).parameters == {"k": 2}


def test_a_sequence_request_in_the_clients_parameter_order_is_parsed_whole() -> None:
    """tritonclient's sequence parameters in an order of their own, not protobuf's sorted one.
    (The body is put together entry by entry: the order a map serializes in is its hash
    table's, which can come out sorted by chance.)"""
    head = pb.ModelInferRequest(model_name="seq", id="r1").SerializeToString()
    entries = []
    for key, value in (("sequence_id", 5), ("sequence_start", True), ("sequence_end", False),
                       ("priority", 2)):
        one = pb.ModelInferRequest()
        if isinstance(value, bool):
            one.parameters[key].bool_param = value
        else:
            one.parameters[key].int64_param = value
        entries.append(one.SerializeToString())
    tail = pb.ModelInferRequest(raw_input_contents=[b"\x01\x00\x00\x00"])
    tail.inputs.add(name="x", datatype="INT32", shape=[1, 1])
    body = head + b"".join(entries) + tail.SerializeToString()
    assert body != pb.ModelInferRequest.FromString(body).SerializeToString(deterministic=True)
    _same_as_walk(body, whole=True)
    assert kserve_grpc.decode_request(body).parameters == {
        "sequence_id": 5, "sequence_start": True, "sequence_end": False, "priority": 2}


def test_a_known_field_sent_with_another_wire_type_takes_the_walk() -> None:
    body = _tag(1, 0) + b"\x07" + _request().SerializeToString()  # model_name as a varint
    _same_as_walk(body, whole=False)


def test_an_unknown_group_field_is_refused_as_the_walk_refuses_it() -> None:
    group = _tag(20, 3) + _tag(1, 0) + b"\x01" + _tag(20, 4)
    body = _request().SerializeToString() + group
    _same_as_walk(body, whole=False)
    outcome = grpc_outcome(kserve_grpc.decode_request, body)
    assert outcome[0] == "refused" and "unsupported wire type 3" in outcome[2], outcome


def test_an_unknown_field_takes_the_walk() -> None:
    _same_as_walk(_request().SerializeToString() + _tag(30, 0) + b"\x05", whole=False)


def test_an_unpacked_shape_is_read_as_the_walk_reads_it() -> None:
    req = _request()
    inp = req.inputs[0]
    unpacked = (_tag(1, 2) + bytes([len(inp.name)]) + inp.name.encode()
                + _tag(2, 2) + bytes([len(inp.datatype)]) + inp.datatype.encode()
                + b"".join(_tag(3, 0) + pbwire.encode_varint(d) for d in inp.shape))
    body = (_tag(1, 2) + bytes([len(req.model_name)]) + req.model_name.encode()
            + pbwire.len_field(5, unpacked)
            + pbwire.len_field(6, req.outputs[0].SerializeToString())
            + pbwire.len_field(7, req.raw_input_contents[0]))
    _same_as_walk(body, whole=True)
    assert kserve_grpc.decode_request(body).inputs[0].shape == (1, 64)


def test_fields_out_of_order_take_the_walk() -> None:
    req = _request()
    body = req.SerializeToString()
    raw = pbwire.len_field(7, req.raw_input_contents[0])
    assert body.endswith(raw)
    _same_as_walk(raw + body[:-len(raw)], whole=False)


def test_bytes_that_look_like_a_payload_at_the_end_take_the_walk() -> None:
    """The payload first, and an output name that ends like a raw field of the same length:
    the tail is not the payload, so the walk finds it."""
    raw = b"\x01\x02\x03\x04"
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="x", datatype="UINT8", shape=[4])
    req.outputs.add(name="y:\x04wxyz")  # ':' is 0x3a, raw_input_contents' tag
    body = pbwire.len_field(7, raw) + req.SerializeToString()
    assert body.endswith(b"\x3a\x04wxyz")
    _same_as_walk(body, whole=False)
    assert bytes(kserve_grpc.decode_request(body).inputs[0].raw or b"") == raw


def test_a_length_written_long_takes_the_walk() -> None:
    req = _request(4)
    body = req.SerializeToString()
    raw = req.raw_input_contents[0]
    padded = body[:-len(raw) - 1] + b"\x84\x00" + raw  # 4 as a two-byte varint
    _same_as_walk(padded, whole=False)


def test_a_shape_over_the_rank_is_refused_with_the_walks_text() -> None:
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="x", datatype="UINT8", shape=[1] * (MAX_RANK + 1))
    req.raw_input_contents.append(b"\x00")
    body = req.SerializeToString()
    _same_as_walk(body, whole=False)
    outcome = grpc_outcome(kserve_grpc.decode_request, body)
    assert outcome[0] == "refused" and f"more than {MAX_RANK} dims" in outcome[2], outcome


def test_typed_contents_take_the_walk() -> None:
    req = pb.ModelInferRequest(model_name="m")
    inp = req.inputs.add(name="x", datatype="INT32", shape=[2])
    inp.contents.int_contents.extend([1, 2])
    body = req.SerializeToString()
    _same_as_walk(body, whole=False)
    assert np.frombuffer(bytes(kserve_grpc.decode_request(body).inputs[0].raw or b""),
                         dtype=np.int32).tolist() == [1, 2]


def test_a_truncated_body_is_refused_with_the_walks_text() -> None:
    body = _request().SerializeToString()[:-5]
    _same_as_walk(body, whole=False)
    assert grpc_outcome(kserve_grpc.decode_request, body)[0] == "refused"


def test_a_triton_answer_is_parsed_whole_and_checked() -> None:
    resp = pb.ModelInferResponse(model_name="small_fp32", model_version="1")
    resp.outputs.add(name="y", datatype="FP32", shape=[1, 16])
    resp.outputs.add(name="z", datatype="INT64", shape=[2])
    resp.raw_output_contents.extend([np.arange(16, dtype=np.float32).tobytes(),
                                     np.arange(2, dtype=np.int64).tobytes()])
    body = resp.SerializeToString()
    assert kserve_grpc._parse_whole(body, pb.ModelInferResponse,
                                    kserve_grpc._response_fits) is not None
    result = kserve_grpc.decode_response(body)
    assert grpc_outcome(kserve_grpc.decode_response, body) == walk_only(
        grpc_outcome, kserve_grpc.decode_response, body)
    y = result.output("y")
    assert y is not None and isinstance(y.raw, memoryview) and y.raw.obj is body
    short = resp
    short.raw_output_contents[0] = b"\x00" * 60  # 4 bytes short of its shape
    body = short.SerializeToString()
    outcome = grpc_outcome(kserve_grpc.decode_response, body)
    assert outcome == walk_only(grpc_outcome, kserve_grpc.decode_response, body)
    assert outcome[0] == "refused", outcome
