"""The zero-copy field walk agrees with protobuf's own parser, and refuses broken framing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.errors import ErrorKind, ProxyError
from proxy.pb import grpc_service_pb2 as pb
from proxy.tensor import MAX_PARAMETERS, MAX_RANK, MAX_TENSORS, encode_bytes_elements
from proxy.wire import kserve_grpc, pbwire

raws = st.lists(st.binary(max_size=64), max_size=4)


@given(raws=raws, model=st.text(max_size=20), rid=st.text(max_size=8))
def test_split_then_parse_equals_full_parse(raws: list[bytes], model: str, rid: str) -> None:
    req = pb.ModelInferRequest(model_name=model, id=rid)
    for i, raw in enumerate(raws):
        req.inputs.add(name=f"in{i}", datatype="UINT8", shape=[len(raw)])
        req.raw_input_contents.append(raw)
    req.parameters["k"].int64_param = 7
    body = req.SerializeToString()
    head, slices = pbwire.split(body, 7)
    assert [bytes(s) for s in slices] == raws
    again = pb.ModelInferRequest.FromString(head)
    again.raw_input_contents.extend(bytes(s) for s in slices)
    assert again == req
    call = kserve_grpc.decode_request(body)
    assert [bytes(t.raw) for t in call.inputs] == raws  # type: ignore[arg-type]
    assert all(isinstance(t.raw, memoryview) for t in call.inputs)  # no copy of the payload


@pytest.mark.parametrize("body", [
    b"\x3a\x80",  # field 7, length varint cut
    b"\x3a\x05abc",  # field 7 says 5 bytes, 3 follow
    b"\x0b",  # wire type 3 (groups) is not used by v2
    b"\x00\x01",  # field number 0
    b"\x08" + b"\xff" * 11,  # varint longer than 10 bytes
])
def test_broken_framing_is_invalid_argument(body: bytes) -> None:
    with pytest.raises(ProxyError, match="malformed ModelInferRequest"):
        kserve_grpc.decode_request(body)


def test_backend_garbage_is_caught_before_forwarding() -> None:
    with pytest.raises(ProxyError, match="backend sent a malformed ModelInferResponse"):
        kserve_grpc.decode_response(b"\x32\x7f\x00")


# --- counted before converted: packed varints and typed contents ---------------------------------

uint64s = st.lists(st.integers(0, 2**64 - 1), max_size=30)


@given(uint64s)
def test_packed_varints_are_counted_and_decoded_like_protobuf(values: list[int]) -> None:
    body = memoryview(pb.InferTensorContents(uint64_contents=values).SerializeToString())
    packed = [body[value:end] for _, _, value, end in pbwire.fields(body)]
    assert len(packed) == (1 if values else 0)
    run = packed[0] if packed else memoryview(b"")
    assert pbwire.count_varints(run) == len(values)
    assert pbwire.decode_varints(run).tolist() == values


@pytest.mark.parametrize("packed", [b"\x80", b"\x01\xff", b"\xff" * 10 + b"\x01",
                                    b"\xff" * 9 + b"\x02"])
def test_varints_cut_or_past_64_bits_are_refused(packed: bytes) -> None:
    with pytest.raises(pbwire.WireError):
        pbwire.decode_varints(packed)


TYPED = [  # datatype, contents field, values strategy, numpy dtype
    ("BOOL", "bool_contents", st.booleans(), np.bool_),
    ("INT8", "int_contents", st.integers(-128, 127), np.int8),
    ("INT16", "int_contents", st.integers(-2**15, 2**15 - 1), np.int16),
    ("INT32", "int_contents", st.integers(-2**31, 2**31 - 1), np.int32),
    ("INT64", "int64_contents", st.integers(-2**63, 2**63 - 1), np.int64),
    ("UINT8", "uint_contents", st.integers(0, 255), np.uint8),
    ("UINT16", "uint_contents", st.integers(0, 2**16 - 1), np.uint16),
    ("UINT32", "uint_contents", st.integers(0, 2**32 - 1), np.uint32),
    ("UINT64", "uint64_contents", st.integers(0, 2**64 - 1), np.uint64),
    ("FP32", "fp32_contents", st.floats(width=32, allow_nan=False), np.float32),
    ("FP64", "fp64_contents", st.floats(allow_nan=False), np.float64),
    ("BYTES", "bytes_contents", st.binary(max_size=5), object),
]


def _typed(datatype: str, field: str, values: Sequence[object], shape: list[int] | None = None
           ) -> bytes:
    req = pb.ModelInferRequest(model_name="m")
    tensor = req.inputs.add(name="x", datatype=datatype,
                            shape=[len(values)] if shape is None else shape)
    getattr(tensor.contents, field).extend(values)
    return bytes(req.SerializeToString())


@pytest.mark.parametrize("datatype,field,values,dtype", TYPED, ids=[t[0] for t in TYPED])
@given(data=st.data())
def test_typed_contents_become_the_raw_bytes_protobuf_would_give(
        datatype: str, field: str, values: st.SearchStrategy[object], dtype: object,
        data: st.DataObject) -> None:
    sent = data.draw(st.lists(values, max_size=12))
    call = kserve_grpc.decode_request(_typed(datatype, field, sent))
    (t,) = call.inputs
    got = t.numpy()
    assert got.shape == (len(sent),)
    if datatype == "BYTES":
        assert got.tolist() == sent
    else:
        assert got.tobytes() == np.asarray(sent, dtype=dtype).tobytes()  # type: ignore[call-overload]


def test_unpacked_and_split_contents_merge_like_protobuf() -> None:
    # int64_contents as single varint fields (unpacked), then a packed run, in two `contents`
    # occurrences that protobuf merges into one message.
    first = b"\x18\x05\x18\x7f"  # int64_contents: 5, 127 (unpacked)
    second = b"\x1a\x02\x01\x02"  # int64_contents: [1, 2] (packed)
    tensor = (b"\x0a\x01x" b"\x12\x05INT64" b"\x1a\x01\x04"
              + pbwire.len_field(5, first) + pbwire.len_field(5, second))
    body = pbwire.len_field(5, tensor)
    expected = pb.ModelInferRequest.FromString(body).inputs[0].contents.int64_contents
    (t,) = kserve_grpc.decode_request(body).inputs
    assert t.numpy().tolist() == list(expected) == [5, 127, 1, 2]


@pytest.mark.parametrize("datatype,field,values,says", [
    ("INT64", "int64_contents", [0] * 1000, "shape [1] needs 1 INT64 elements, int64_contents "
                                            "holds 1000"),
    ("FP32", "fp32_contents", [1.0, 2.0], "shape [1] needs 1 FP32 elements, fp32_contents "
                                          "holds 2"),
    ("BYTES", "bytes_contents", [b"", b"a"] * 500, "shape [1] needs 1 BYTES elements, "
                                                   "bytes_contents holds more than 1"),
    ("BYTES", "bytes_contents", [b"a", b"b"], "shape [1] needs 1 BYTES elements, bytes_contents "
                                              "holds 2"),
    ("INT8", "int_contents", [200], "int_contents holds 200, outside the INT8 range [-128, 127]"),
    ("UINT32", "uint_contents", [], "shape [1] needs 1 UINT32 elements, uint_contents holds 0"),
    ("FP32", "int64_contents", [1], "a FP32 tensor's typed contents go in fp32_contents, not "
                                    "int64_contents"),
    ("FP16", "fp32_contents", [1.0], "datatype FP16 cannot be sent in typed contents"),
])
def test_typed_contents_that_do_not_fit_the_shape_are_refused(
        datatype: str, field: str, values: list[object], says: str) -> None:
    with pytest.raises(ProxyError) as err:
        kserve_grpc.decode_request(_typed(datatype, field, values, shape=[1]))
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT
    assert says in err.value.message and "'x'" in err.value.message, err.value.message


def test_every_repeated_field_is_bounded_on_the_wire() -> None:
    many_inputs = pb.ModelInferRequest(model_name="m")
    for _ in range(MAX_TENSORS + 1):
        many_inputs.inputs.add(name="x")
    many_outputs = pb.ModelInferRequest(model_name="m")
    for _ in range(MAX_TENSORS + 1):
        many_outputs.outputs.add(name="y")
    deep = pb.ModelInferRequest(model_name="m")
    deep.inputs.add(name="x", datatype="FP32", shape=[1] * (MAX_RANK + 1))
    params = pb.ModelInferRequest(model_name="m")
    for i in range(MAX_PARAMETERS + 1):
        params.parameters[f"k{i}"].int64_param = i
    out_params = pb.ModelInferRequest(model_name="m")
    o = out_params.outputs.add(name="y")
    for i in range(MAX_PARAMETERS + 1):
        o.parameters[f"k{i}"].bool_param = True
    cases = [
        (many_inputs, f"more than {MAX_TENSORS} inputs"),
        (many_outputs, f"more than {MAX_TENSORS} outputs"),
        (deep, f"more than {MAX_RANK} dims in one input's shape"),
        (params, f"more than {MAX_PARAMETERS} request parameters"),
        (out_params, f"more than {MAX_PARAMETERS} parameters on one requested output"),
    ]
    for req, says in cases:
        with pytest.raises(ProxyError) as err:
            kserve_grpc.decode_request(req.SerializeToString())
        assert err.value.message.startswith(f"the request has {says}; mmguard takes at most")
    with pytest.raises(ProxyError, match=f"more than {kserve_grpc.MAX_FIELDS} protobuf fields"):
        kserve_grpc.decode_request(b"\x1a\x00" * (kserve_grpc.MAX_FIELDS + 1))


@pytest.mark.parametrize("items", [
    [b"ab"] * 5,  # equal lengths: framed by numpy at once
    [b"ab", b"", b"xyz", b"\x42\x00"],  # short ones: one tight walk, framed by numpy
    [b"a" * 200, b"b", b""],  # a length past one varint byte: the general walk
])
def test_bytes_contents_take_every_path_to_the_same_raw_form(items: list[bytes]) -> None:
    (t,) = kserve_grpc.decode_request(_typed("BYTES", "bytes_contents", items)).inputs
    assert bytes(t.raw_bytes()) == encode_bytes_elements(items)
    t.check_payload()
    mixed = _typed("BYTES", "bytes_contents", items)
    # an unknown field inside contents (proto3 keeps and ignores it) sends it the general way
    tensor = pb.ModelInferRequest.FromString(mixed).inputs[0]
    contents = tensor.contents.SerializeToString() + b"\x78\x01"  # field 15, varint 1
    tensor.ClearField("contents")
    body = pbwire.len_field(5, tensor.SerializeToString() + pbwire.len_field(5, contents))
    (again,) = kserve_grpc.decode_request(body).inputs
    assert list(pb.ModelInferRequest.FromString(body).inputs[0].contents.bytes_contents) == items
    assert bytes(again.raw_bytes()) == encode_bytes_elements(items)


def _with_contents(datatype: str, shape: list[int], contents: bytes) -> bytes:
    tensor = pb.ModelInferRequest.InferInputTensor(name="x", datatype=datatype, shape=shape)
    return pbwire.len_field(5, tensor.SerializeToString() + pbwire.len_field(5, contents))


def test_unpacked_fixed_width_contents_and_stray_fields() -> None:
    unpacked = b"".join(b"\x35" + np.float32(v).tobytes() for v in (1.5, -2.0, 3.25))
    (t,) = kserve_grpc.decode_request(_with_contents("FP32", [3], unpacked)).inputs
    assert t.numpy().tolist() == [1.5, -2.0, 3.25]
    strays = b"\x78\x01" * 65  # an unknown field, 65 times: past the walk's slack
    with pytest.raises(ProxyError, match="typed contents hold more than 64 fields besides "
                                         "fp32_contents"):
        kserve_grpc.decode_request(_with_contents("FP32", [3], strays + unpacked))
    with pytest.raises(ProxyError, match="fp32_contents runs past the end"):
        kserve_grpc.decode_request(_with_contents("FP32", [3], unpacked[:-1]))


def test_unpacked_varints_far_past_the_shape_stop_at_the_first_extra() -> None:
    many = b"\x18\x05" * 1_000_000  # int64_contents: 5, a million times, unpacked
    with pytest.raises(ProxyError) as err:
        kserve_grpc.decode_request(_with_contents("INT64", [2], many))
    assert err.value.message == ("[request id: <id_unknown>] input byte size mismatch for input "
                                 "'x' for model ''. Expected 16, got more than 16 (shape [2] "
                                 "needs 2 INT64 elements, int64_contents holds more than 2)")


def test_stream_error_messages_are_bounded() -> None:
    from proxy.errors import MAX_MESSAGE_CHARS

    sent = pb.ModelStreamInferResponse.FromString(kserve_grpc.stream_error("m" * 10**6))
    assert len(sent.error_message) == MAX_MESSAGE_CHARS
    assert sent.error_message.endswith(" more characters]")


def test_a_refused_stream_request_is_named_by_a_bounded_walk() -> None:
    """``kserve_grpc.request_id``: a stream's refused request named by its id (Triton's error
    answer carries it) without a second parse of what was just refused: the id of a request, ""
    for a broken one, and "" for one of more top-level fields than the decode's walk allows."""
    from proxy.pb import grpc_service_pb2 as pb
    from proxy.wire import kserve_grpc

    req = pb.ModelInferRequest(model_name="m", id="req-7")
    req.inputs.add(name="x", datatype="FP32", shape=[1])
    req.raw_input_contents.append(b"\0" * 4)
    body = req.SerializeToString()
    assert kserve_grpc.request_id(body) == "req-7"
    assert kserve_grpc.request_id(body[:-2]) == ""  # the last field runs past the end
    many = b"\x1a\x00" * (kserve_grpc.MAX_FIELDS + 1) + b"\x1a\x01z"  # id "", ... then "z"
    assert kserve_grpc.request_id(many) == ""
