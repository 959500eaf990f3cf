"""The binary tensor extension's raw form, and the other body forms it describes, direct and
through mmguard (both Triton backends), byte for byte.

Raw form: ``Inference-Header-Content-Length: 0`` and a body of only the one input's bytes; the
answer has every output in binary. The behaviours are those upstream's ``qa/L0_http/
http_test.py`` checks (raw binary, a longer one, chunked transfer, a model with more than one
input, a BYTES input that is not one element), written here against our test repository.
"""

from __future__ import annotations

import gzip
import http.client
import json

import numpy as np
import pytest

from tests.conformance.conftest import Target
from tests.support.wire import http_post

RAW = {"Inference-Header-Content-Length": "0"}


def _answer(head: dict[str, object], payload: bytes) -> bytes:
    return json.dumps(head, separators=(",", ":")).encode() + payload


def _y(model: str, out: str, datatype: str, shape: list[int], payload: bytes) -> bytes:
    """Triton's binary answer, byte for byte: model, version, the output with its size."""
    return _answer({"model_name": model, "model_version": "1", "outputs": [
        {"name": out, "datatype": datatype, "shape": shape,
         "parameters": {"binary_data_size": len(payload)}}]}, payload)


def _check(target: Target, model: str, body: bytes, want: bytes,
           headers: dict[str, str] | None = None) -> None:
    status, got_headers, answer = http_post(target.http_url, f"/v2/models/{model}/infer", body,
                                            {**RAW, **(headers or {})})
    assert status == 200, answer
    assert answer == want
    assert int(got_headers["Inference-Header-Content-Length"]) == want.index(b"}]}") + 3


def test_raw_binary_fixed_shape(target: Target) -> None:
    """small_fp32: x FP32 [16], batching: the body is deduced as [1, 16]."""
    x = np.arange(16, dtype=np.float32)
    _check(target, "small_fp32", x.tobytes(),
           _y("small_fp32", "y", "FP32", [1, 16], (2 * x).tobytes()))


@pytest.mark.parametrize("count", [8, 32])
def test_raw_binary_variable_dim(target: Target, count: int) -> None:
    """identity_fp32: INPUT0 FP32 [-1]: the variable dim is sized by the body (upstream's
    test_raw_binary and test_raw_binary_longer)."""
    x = np.arange(count, dtype=np.float32).tobytes()
    _check(target, "identity_fp32", x, _y("identity_fp32", "OUTPUT0", "FP32", [1, count], x))


def test_raw_binary_under_a_content_type_and_gzip(target: Target) -> None:
    """A raw body that arrives compressed is the input's bytes once inflated."""
    x = np.arange(8, dtype=np.int64).tobytes()
    _check(target, "identity_int64", gzip.compress(x),
           _y("identity_int64", "OUTPUT0", "INT64", [1, 8], x),
           {"Content-Encoding": "gzip", "Content-Type": "application/octet-stream"})


def test_raw_binary_chunked(target: Target) -> None:
    """Upstream's test_content_encoding_chunked_manually: the body in chunked transfer coding."""
    x = np.arange(8, dtype=np.float32).tobytes()
    host, port = target.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest("POST", "/v2/models/identity_fp32/infer")
        conn.putheader("Inference-Header-Content-Length", "0")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        conn.send(f"{len(x):X}\r\n".encode() + x + b"\r\n0\r\n\r\n")
        r = conn.getresponse()
        answer = r.read()
    finally:
        conn.close()
    assert r.status == 200, answer
    assert answer == _y("identity_fp32", "OUTPUT0", "FP32", [1, 8], x)


@pytest.mark.parametrize("model,body,says", [
    ("clip_demo", bytes(64), "[request id: <id_unknown>] Raw request must only have 1 input "
                             "(found 1) to be deduced but got 2 inputs in 'clip_demo' model "
                             "configuration"),
    ("identity_bytes", b"427", "[request id: <id_unknown>] For BYTE datatype raw input 'INPUT0', "
                               "the model must have input shape [1]"),
    ("small_fp32", bytes(60), "[request id: <id_unknown>] input byte size mismatch for input "
                              "'raw_input' for model 'small_fp32'. Expected 64, got 60"),
    ("small_fp32", b"", "[request id: <id_unknown>] input byte size mismatch for input "
                        "'raw_input' for model 'small_fp32'. Expected 64, got 0"),
    ("no_such_model", bytes(4), "Request for unknown model: 'no_such_model' is not found"),
])
def test_raw_binary_refusals(target: Target, model: str, body: bytes, says: str) -> None:
    """Upstream's test_multi_inputs and test_byte_too_many_elements, a body that does not fit,
    an unknown model: the same status, Triton's text."""
    status, _, answer = http_post(target.http_url, f"/v2/models/{model}/infer", body, RAW)
    assert status == (404 if model == "no_such_model" else 400), answer
    assert answer == json.dumps({"error": says}, separators=(",", ":")).encode()  # Triton's bytes


@pytest.mark.parametrize("value,status", [("abc", 400), ("+0", 400), ("999", 400), ("-1", 400)])
def test_header_length_read_as_triton_reads_it(target: Target, value: str, status: int) -> None:
    """Triton reads the header as C's atoi does: "abc" and "+0" are 0, the raw form (and this
    body does not fit small_fp32); a length outside the body is refused in its words."""
    status_got, _, answer = http_post(target.http_url, "/v2/models/small_fp32/infer",
                                      bytes(12), {"Inference-Header-Content-Length": value})
    assert status_got == status, answer
    error = json.loads(answer)["error"]
    if value in ("999", "-1"):
        assert error.startswith(f"inference header size should be in range (0, 12), got: "
                                f"{value}")
    else:
        assert error.startswith("[request id: <id_unknown>] input byte size mismatch for input "
                                "'raw_input' for model 'small_fp32'. Expected 64, got 12")


def test_json_and_binary_forms_with_binary_data_output(target: Target) -> None:
    """A JSON header with a binary input, ``binary_data_output`` for every output: the answer
    is Triton's bytes."""
    x = np.arange(16, dtype=np.float32)
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16],
                                   "parameters": {"binary_data_size": 64}}],
                       "parameters": {"binary_data_output": True}}).encode()
    status, _, answer = http_post(
        target.http_url, "/v2/models/small_fp32/infer", head + x.tobytes(),
        {"Inference-Header-Content-Length": str(len(head))})
    assert status == 200, answer
    assert answer == _y("small_fp32", "y", "FP32", [1, 16], (2 * x).tobytes())


def test_json_input_with_a_binary_output(target: Target) -> None:
    """JSON data in, one output asked for in binary by its own ``binary_data``."""
    x = list(range(16))
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16],
                                   "data": x}],
                       "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
    status, _, answer = http_post(target.http_url, "/v2/models/small_fp32/infer", body)
    assert status == 200, answer
    want = (2 * np.array(x, dtype=np.float32)).tobytes()
    assert answer == _y("small_fp32", "y", "FP32", [1, 16], want)


def test_header_only_binary_body_is_json(target: Target) -> None:
    """``Inference-Header-Content-Length`` equal to the body: all JSON, a JSON answer."""
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16],
                                   "data": [1.0] * 16}]}).encode()
    status, _, answer = http_post(target.http_url, "/v2/models/small_fp32/infer", body,
                                  {"Inference-Header-Content-Length": str(len(body))})
    assert status == 200, answer
    assert json.loads(answer)["outputs"][0]["data"] == [2.0] * 16
