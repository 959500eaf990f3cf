"""Raw tensor bytes cross mmguard unchanged, for every datatype, on every path to ORT."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from proxy.pb import grpc_service_pb2 as pb
from tests.support.mmguard import RunningMmguard
from tests.support.wire import (
    grpc_infer_raw,
    grpc_request,
    http_binary_body,
    http_post,
    split_binary_response,
)


def payload(datatype: str) -> tuple[list[int], bytes]:
    """Bytes that would not survive a lossy conversion: NaN payloads, -0.0, subnormals, max
    ints, odd BF16 bit patterns, BYTES with NULs and empty elements."""
    if datatype == "FP32":
        arr = np.array([np.nan, -0.0, 1e-45, 3.4e38, -1.5], dtype="<f4")
        raw = arr.tobytes()[:-4] + struct.pack("<I", 0x7FC00001)  # a NaN with payload bits
        return [5], raw
    if datatype == "FP16":
        return [4], np.array([0x7E01, 0x8000, 0x0001, 0x7BFF], dtype="<u2").tobytes()
    if datatype == "BF16":
        return [4], np.array([0x3F80, 0x7FC1, 0x0001, 0xFF80], dtype="<u2").tobytes()
    if datatype == "INT64":
        return [3], np.array([2**63 - 1, -(2**63), 0], dtype="<i8").tobytes()
    if datatype == "BOOL":
        return [4], bytes([1, 0, 1, 1])
    items = [b"plain", b"", "héllo\x00".encode(), b"\x01\x02"]
    return [4], b"".join(struct.pack("<I", len(x)) + x for x in items)


DATATYPES = ["FP32", "FP16", "BF16", "INT64", "BOOL", "BYTES"]


@pytest.mark.parametrize("datatype", DATATYPES)
def test_grpc_front_to_onnxruntime_is_byte_identical(ort_proxy: RunningMmguard,
                                                     datatype: str) -> None:
    shape, raw = payload(datatype)
    body = grpc_request(f"identity_{datatype.lower()}", [("INPUT0", datatype, shape, raw)])
    resp_bytes, _ = grpc_infer_raw(ort_proxy.grpc_url, body)
    resp = pb.ModelInferResponse.FromString(resp_bytes)
    assert resp.outputs[0].datatype == datatype
    assert list(resp.outputs[0].shape) == shape
    assert resp.raw_output_contents[0] == raw


@pytest.mark.parametrize("datatype", DATATYPES)
def test_http_binary_front_to_onnxruntime_is_byte_identical(ort_proxy: RunningMmguard,
                                                            datatype: str) -> None:
    shape, raw = payload(datatype)
    body, hlen = http_binary_body([("INPUT0", datatype, shape, raw)], outputs=["OUTPUT0"])
    status, headers, resp = http_post(
        ort_proxy.http_url, f"/v2/models/identity_{datatype.lower()}/infer", body,
        {"Inference-Header-Content-Length": str(hlen), "Content-Type": "application/octet-stream"})
    assert status == 200, resp
    head, tail = split_binary_response(headers, resp)
    assert head["outputs"][0]["parameters"]["binary_data_size"] == len(raw)
    assert tail == raw


def test_non_utf8_bytes_to_onnxruntime_is_a_clear_400(ort_proxy: RunningMmguard) -> None:
    raw = struct.pack("<I", 2) + b"\xff\xfe"
    body, hlen = http_binary_body([("INPUT0", "BYTES", [1], raw)])
    status, _, resp = http_post(ort_proxy.http_url, "/v2/models/identity_bytes/infer", body,
                                {"Inference-Header-Content-Length": str(hlen)})
    assert status == 400
    assert "input 'INPUT0': element 0 is not UTF-8" in resp.decode()
