"""The zero-copy field walk agrees with protobuf's own parser, and refuses broken framing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy import codec_grpc, pbwire
from proxy.errors import ProxyError
from proxy.pb import grpc_service_pb2 as pb

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
    call = codec_grpc.decode_request(body)
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
        codec_grpc.decode_request(body)


def test_backend_garbage_is_caught_before_forwarding() -> None:
    with pytest.raises(ProxyError, match="backend sent a malformed ModelInferResponse"):
        codec_grpc.decode_response(b"\x32\x7f\x00")
