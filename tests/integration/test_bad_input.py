"""Bad input gets the right code and a message naming what was expected and what came, and the
proxy keeps serving: every test ends with a good request through the same proxy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ort_config
from tests.support.mmguard import RunningMmguard
from tests.support.wire import grpc_infer_raw, grpc_request, http_binary_body, http_post

SMALL = ("INPUT0", "FP32", [4], np.arange(4, dtype="<f4").tobytes())


@pytest.fixture(scope="module")
def proxy(ort_models: Path) -> Iterator[RunningMmguard]:
    cfg = ort_config(ort_models, listeners={"http": {"max_request_bytes": 1_000_000},
                                            "grpc": {"max_request_bytes": 1_000_000}})
    cfg["models"] = [*cfg["models"],
                     {"name": "limited", "backend": "ort", "backend_model": "identity_fp32",
                      "filters": [{"limits": {"max_request_bytes": 64, "max_batch": 4}}]}]
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        yield m


def still_serving(proxy: RunningMmguard) -> None:
    out, _ = grpc_infer_raw(proxy.grpc_url, grpc_request("identity_fp32", [SMALL]))
    assert SMALL[3] in out
    status, _, _ = http_post(proxy.http_url, "/v2/models/identity_fp32/infer",
                             *_binary_args([SMALL]))
    assert status == 200


def _binary_args(tensors: list[tuple[str, str, list[int], bytes]]) -> tuple[bytes, dict[str, str]]:
    body, hlen = http_binary_body(tensors)
    return body, {"Inference-Header-Content-Length": str(hlen)}


def _grpc_error(proxy: RunningMmguard, body: bytes) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        grpc_infer_raw(proxy.grpc_url, body)
    return exc.value


def test_unknown_model_is_not_found(proxy: RunningMmguard) -> None:
    err = _grpc_error(proxy, grpc_request("no_such_model", [SMALL]))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details() == "Request for unknown model: 'no_such_model' is not found"
    status, _, body = http_post(proxy.http_url, "/v2/models/no_such_model/infer",
                                *_binary_args([SMALL]))
    assert status == 404 and "no_such_model" in json.loads(body)["error"]
    with pytest.raises(InferenceServerException, match="Request for unknown model"):
        httpclient.InferenceServerClient(proxy.http_url).get_model_metadata("no_such_model")
    still_serving(proxy)


def test_raw_size_mismatch_names_input_expected_and_got(proxy: RunningMmguard) -> None:
    short = ("INPUT0", "FP32", [4], b"\0" * 12)
    err = _grpc_error(proxy, grpc_request("identity_fp32", [short]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    said = ("[request id: <id_unknown>] input byte size mismatch for input 'INPUT0' for model "
            "'identity_fp32'. Expected 16, got 12 (FP32 shape [4])")  # Triton's words first
    assert err.details() == said
    status, headers, body = http_post(proxy.http_url, "/v2/models/identity_fp32/infer",
                                      *_binary_args([short]))
    assert status == 400
    assert json.loads(body) == {"error": said}
    assert headers["mmguard-error-origin"] == "mmguard"  # found before the backend
    still_serving(proxy)


def test_broken_bytes_framing_is_invalid_argument(proxy: RunningMmguard) -> None:
    broken = ("INPUT0", "BYTES", [1], b"\x10\x00\x00\x00abc")
    err = _grpc_error(proxy, grpc_request("identity_bytes", [broken]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == ("incomplete string data for inference input 'INPUT0', expecting "
                             "string of length 16 but only 3 bytes available")
    still_serving(proxy)


def test_malformed_protobuf_json_and_header_length(proxy: RunningMmguard) -> None:
    err = _grpc_error(proxy, b"\x0a\xff\xff\xff\xff\x0f garbage")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed ModelInferRequest" in err.details()
    status, _, body = http_post(proxy.http_url, "/v2/models/identity_fp32/infer", b"{not json")
    assert status == 400 and "malformed JSON" in json.loads(body)["error"]
    good, hlen = http_binary_body([SMALL])
    # Triton's words: a header length past the body; one that reads as 0 (as C atoi reads
    # "abc") is the raw form, whose one input here gets bytes that do not fit it.
    for bad_len, expect in (("999999", "inference header size should be in range (0, "),
                            ("abc", "input byte size mismatch for input 'raw_input'"),
                            ("9" * 5000, "at most 19 ASCII digits"),
                            (str(hlen - 3), "malformed JSON")):
        status, _, body = http_post(proxy.http_url, "/v2/models/identity_fp32/infer", good,
                                    {"Inference-Header-Content-Length": bad_len})
        assert status == 400, body
        assert expect in json.loads(body)["error"]
    status, _, body = http_post(proxy.http_url, "/v2/models/identity_fp32/infer",
                                good + b"extra", {"Inference-Header-Content-Length": str(hlen)})
    assert status == 400 and "inputs declare 16" in json.loads(body)["error"]
    status, _, body = http_post(proxy.http_url, "/v2/models/identity_fp32/infer",
                                json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32",
                                                        "shape": [2], "data": [1, 2, 3]}]})
                                .encode())
    assert status == 400 and "needs 8 bytes, got 12" in json.loads(body)["error"]
    still_serving(proxy)


def test_payload_over_listener_limit_is_413_and_resource_exhausted(proxy: RunningMmguard) -> None:
    big = ("INPUT0", "FP32", [300_000], b"\0" * 1_200_000)
    err = _grpc_error(proxy, grpc_request("identity_fp32", [big]))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status, _, body = http_post(proxy.http_url, "/v2/models/identity_fp32/infer",
                                *_binary_args([big]))
    assert status == 413
    assert "accepts at most 1000000" in json.loads(body)["error"]
    still_serving(proxy)


def test_limits_filter_size_and_batch(proxy: RunningMmguard) -> None:
    big = ("INPUT0", "FP32", [32], b"\0" * 128)
    err = _grpc_error(proxy, grpc_request("limited", [big]))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == "model 'limited': request tensors are 128 bytes; the limit is 64"
    trailers = dict(err.trailing_metadata())
    assert trailers["mmguard-limits"].startswith("reject-size")
    status, headers, body = http_post(proxy.http_url, "/v2/models/limited/infer",
                                      *_binary_args([("INPUT0", "FP32", [5], b"\0" * 20)]))
    assert status == 413
    assert "has batch 5; the limit is 4" in json.loads(body)["error"]
    assert headers["mmguard-limits"].startswith("reject-batch")
    out, _ = grpc_infer_raw(proxy.grpc_url, grpc_request("limited", [SMALL]))
    assert SMALL[3] in out  # the renamed route reaches identity_fp32
    still_serving(proxy)


def test_wrong_shape_from_onnxruntime_passes_through(proxy: RunningMmguard) -> None:
    client = grpcclient.InferenceServerClient(proxy.grpc_url)
    px = grpcclient.InferInput("pixel_values", [1, 3, 256, 256], "FP32")
    px.set_data_from_numpy(np.zeros((1, 3, 256, 256), np.float32))
    ids = grpcclient.InferInput("input_ids", [1, 77], "INT64")
    ids.set_data_from_numpy(np.zeros((1, 77), np.int64))
    with pytest.raises(InferenceServerException) as exc:
        client.infer("clip_demo", [px, ids])
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "Got invalid dimensions for input: pixel_values" in exc.value.message()
    still_serving(proxy)
