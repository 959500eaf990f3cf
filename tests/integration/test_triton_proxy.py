"""tritonclient → mmguard → a real Triton, over mmguard's gRPC and HTTP backends."""

from __future__ import annotations

import json
import queue
import re
import struct
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from proxy.cli.demo_model import tokenize
from proxy.pb import grpc_service_pb2 as pb
from tests.conftest import triton_routes
from tests.integration.test_byte_identity import DATATYPES
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.wire import (
    grpc_infer_raw,
    grpc_request,
    http_binary_body,
    http_post,
    split_binary_response,
)

pytestmark = pytest.mark.triton
MODELS = ["clip_demo", "pixel_identity", "slow_fp32", "fail_fp32", "decoupled_counter",
          *(f"identity_{d.lower()}" for d in DATATYPES)]


@pytest.fixture(scope="module")
def proxy(triton: TritonServer) -> Iterator[RunningMmguard]:
    cfg = triton_routes(triton, MODELS)
    cfg["backends"].append({"kind": "triton_grpc", "name": "down",
                            "url": "127.0.0.1:1", "timeout_s": 2})
    cfg["models"].append({"name": "nowhere", "backend": "down",
                          "backend_model": "identity_fp32"})
    with RunningMmguard(cfg) as m:
        for name in [f"{p}_{x}" for p in "gh" for x in MODELS]:
            _wait_contract(m, name)
        yield m


def _wait_contract(m: RunningMmguard, name: str) -> None:
    import time
    assert m.server is not None
    for _ in range(300):
        if name in m.server.plane.runtime.contracts:
            return
        time.sleep(0.05)
    raise TimeoutError(name)


def _clip_inputs(mod, binary: bool = True):  # type: ignore[no-untyped-def]
    px = np.random.default_rng(1).random((2, 3, 224, 224), dtype=np.float32)
    ids = np.stack([tokenize("a red bus"), tokenize("two cats")])
    inputs = [mod.InferInput("pixel_values", [2, 3, 224, 224], "FP32"),
              mod.InferInput("input_ids", [2, 77], "INT64")]
    kw = {"binary_data": binary} if mod is httpclient else {}
    inputs[0].set_data_from_numpy(px, **kw)
    inputs[1].set_data_from_numpy(ids, **kw)
    return inputs


@pytest.mark.parametrize("route", ["g_clip_demo", "h_clip_demo"])
@pytest.mark.parametrize("front", ["grpc", "http", "http-json"])
def test_clip_demo_through_mmguard_equals_direct_triton(
        proxy: RunningMmguard, triton: TritonServer, route: str, front: str) -> None:
    direct = grpcclient.InferenceServerClient(triton.grpc_url).infer(
        "clip_demo", _clip_inputs(grpcclient))
    if front == "grpc":
        got = grpcclient.InferenceServerClient(proxy.grpc_url).infer(route,
                                                                     _clip_inputs(grpcclient))
    else:
        got = httpclient.InferenceServerClient(proxy.http_url).infer(
            route, _clip_inputs(httpclient, binary=front == "http"))
    for name in ("image_embeds", "text_embeds", "similarity"):
        np.testing.assert_array_equal(got.as_numpy(name), direct.as_numpy(name))


def _identity_payload(datatype: str) -> tuple[list[int], bytes]:
    from tests.integration.test_byte_identity import payload
    shape, raw = payload(datatype)
    if datatype == "BYTES":  # Triton's strings may carry any bytes, not only UTF-8
        raw += struct.pack("<I", 3) + b"\xff\x00\xfe"
        shape = [shape[0] + 1]
    return [1, *shape], raw


@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("backend", ["g", "h"])
def test_byte_identity_grpc_front(proxy: RunningMmguard, datatype: str, backend: str) -> None:
    shape, raw = _identity_payload(datatype)
    route = f"{backend}_identity_{datatype.lower()}"
    resp = pb.ModelInferResponse.FromString(grpc_infer_raw(
        proxy.grpc_url, grpc_request(route, [("INPUT0", datatype, shape, raw)]))[0])
    assert resp.model_name == route
    assert list(resp.outputs[0].shape) == shape and resp.outputs[0].datatype == datatype
    assert resp.raw_output_contents[0] == raw


@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("backend", ["g", "h"])
def test_byte_identity_http_binary_front(proxy: RunningMmguard, datatype: str,
                                         backend: str) -> None:
    shape, raw = _identity_payload(datatype)
    body, hlen = http_binary_body([("INPUT0", datatype, shape, raw)], outputs=["OUTPUT0"])
    status, headers, resp = http_post(
        proxy.http_url, f"/v2/models/{backend}_identity_{datatype.lower()}/infer", body,
        {"Inference-Header-Content-Length": str(hlen)})
    assert status == 200, resp
    _, tail = split_binary_response(headers, resp)
    assert tail == raw


def test_decoupled_model_streams_every_response_in_order(proxy: RunningMmguard) -> None:
    client = grpcclient.InferenceServerClient(proxy.grpc_url)
    got: queue.Queue[object] = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put(error or result))
    try:
        for count, rid in ((5, "a"), (3, "b")):
            x = grpcclient.InferInput("count", [1], "INT32")
            x.set_data_from_numpy(np.array([count], np.int32))
            client.async_stream_infer("g_decoupled_counter", [x], request_id=rid)
        items = [got.get(timeout=10) for _ in range(8)]
    finally:
        client.stop_stream()
    by_id: dict[str, list[int]] = {}
    for item in items:
        assert isinstance(item, grpcclient.InferResult), item
        rid = item.get_response().id
        out = item.as_numpy("value")
        assert out is not None
        by_id.setdefault(rid, []).append(int(out[0]))
    assert by_id == {"a": [0, 1, 2, 3, 4], "b": [0, 1, 2]}


def test_stream_errors_are_stream_messages_and_the_stream_goes_on(proxy: RunningMmguard) -> None:
    client = grpcclient.InferenceServerClient(proxy.grpc_url)
    got: queue.Queue[object] = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put(error or result))
    try:
        bad = grpcclient.InferInput("count", [1], "INT32")
        bad.set_data_from_numpy(np.array([1], np.int32))
        client.async_stream_infer("no_such_model", [bad])
        first = got.get(timeout=10)
        assert isinstance(first, InferenceServerException)
        assert "Request for unknown model: 'no_such_model' is not found" in str(first)
        client.async_stream_infer("g_decoupled_counter", [bad])
        second = got.get(timeout=10)
        assert isinstance(second, grpcclient.InferResult)
    finally:
        client.stop_stream()


@pytest.mark.parametrize("route", ["g_pixel_identity", "h_pixel_identity"])
def test_tritons_own_shape_error_passes_through(proxy: RunningMmguard, route: str) -> None:
    raw = np.zeros((1, 3, 256, 256), "<f4").tobytes()
    with pytest.raises(grpc.RpcError) as exc:
        grpc_infer_raw(proxy.grpc_url,
                       grpc_request(route, [("pixel_values", "FP32", [1, 3, 256, 256], raw)]))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unexpected shape for input 'pixel_values'" in exc.value.details()
    assert dict(exc.value.trailing_metadata())["mmguard-error-origin"] == "backend"
    body, hlen = http_binary_body([("pixel_values", "FP32", [1, 3, 256, 256], raw)])
    status, headers, resp = http_post(proxy.http_url, f"/v2/models/{route}/infer", body,
                                      {"Inference-Header-Content-Length": str(hlen)})
    assert status == 400
    assert "unexpected shape for input 'pixel_values'" in json.loads(resp)["error"]
    assert headers["mmguard-error-origin"] == "backend"


@pytest.mark.parametrize("route", ["g_fail_fp32", "h_fail_fp32"])
def test_model_failure_keeps_code_and_text(proxy: RunningMmguard, route: str) -> None:
    client = grpcclient.InferenceServerClient(proxy.grpc_url)
    x = grpcclient.InferInput("x", [1, 2], "FP32")
    x.set_data_from_numpy(np.ones((1, 2), np.float32))
    with pytest.raises(InferenceServerException) as exc:
        client.infer(route, [x])
    assert exc.value.status() == "StatusCode.INTERNAL"
    assert "deliberate failure from fail_fp32" in exc.value.message()


def _slow(delay_ms: int) -> list[tuple[str, str, list[int], bytes]]:
    return [("x", "FP32", [1, 2], np.ones(2, "<f4").tobytes()),
            ("delay_ms", "INT32", [1, 1], np.array([delay_ms], "<i4").tobytes())]


@pytest.mark.parametrize("route", ["g_slow_fp32", "h_slow_fp32"])
def test_backend_slower_than_deadline(proxy: RunningMmguard, route: str) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        grpc_infer_raw(proxy.grpc_url, grpc_request(route, _slow(3000)), timeout=0.4)
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    body, hlen = http_binary_body(_slow(3000))
    status, _, resp = http_post(proxy.http_url, f"/v2/models/{route}/infer", body,
                                {"Inference-Header-Content-Length": str(hlen),
                                 "mmguard-timeout-ms": "300"})
    assert status == 504
    backend = "triton-grpc" if route.startswith("g") else "triton-http"
    message = json.loads(resp)["error"]
    match = re.fullmatch(rf"backend '{backend}' did not answer model 'slow_fp32' within (\d+) ms",
                         message)
    assert match is not None, message
    assert 100 <= int(match.group(1)) <= 300  # the time that was left of the client's 300 ms
    out, _ = grpc_infer_raw(proxy.grpc_url, grpc_request(route, _slow(10)))  # still serving
    assert pb.ModelInferResponse.FromString(out).outputs[0].name == "y"


def test_backend_down_is_unavailable_naming_the_backend(proxy: RunningMmguard) -> None:
    one = ("INPUT0", "FP32", [1, 1], b"\0\0\0\0")
    with pytest.raises(grpc.RpcError) as exc:
        grpc_infer_raw(proxy.grpc_url, grpc_request("nowhere", [one]))
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "backend 'down' (127.0.0.1:1) is unavailable" in exc.value.details()
    body, hlen = http_binary_body([one])
    status, _, resp = http_post(proxy.http_url, "/v2/models/nowhere/infer", body,
                                {"Inference-Header-Content-Length": str(hlen)})
    assert status == 503 and "backend 'down'" in json.loads(resp)["error"]
    ready = httpclient.InferenceServerClient(proxy.http_url)
    assert ready.is_model_ready("g_identity_fp32") and not ready.is_model_ready("nowhere")


def test_metadata_and_config_come_from_triton(proxy: RunningMmguard) -> None:
    for route in ("g_clip_demo", "h_clip_demo"):
        meta = httpclient.InferenceServerClient(proxy.http_url).get_model_metadata(route)
        assert meta["name"] == route
        assert meta["inputs"][0] == {"name": "pixel_values", "datatype": "FP32",
                                     "shape": [-1, 3, 224, 224]}
        cfg = grpcclient.InferenceServerClient(proxy.grpc_url).get_model_config(route).config
        assert cfg.name == route and cfg.max_batch_size == 8 and cfg.backend == "python"
        assert list(cfg.input[0].dims) == [3, 224, 224]
        assert cfg.parameters["onnx_path"].string_value.endswith("model.onnx")
    decoupled = grpcclient.InferenceServerClient(proxy.grpc_url).get_model_config(
        "h_decoupled_counter").config
    assert decoupled.model_transaction_policy.decoupled


@pytest.mark.parametrize("route", ["g_clip_demo", "h_clip_demo"])
def test_renamed_route_config_differs_from_tritons_only_in_name(
        proxy: RunningMmguard, triton: TritonServer, route: str) -> None:
    """A route serving a model under another name: config and metadata are Triton's own, over
    both protocols, with the route's name in place of the model's and nothing else changed."""
    want = json.loads(http_get(triton.http_url, "/v2/models/clip_demo/config"))
    got = json.loads(http_get(proxy.http_url, f"/v2/models/{route}/config"))
    assert got == {**want, "name": route} and list(got) == list(want)
    want_meta = json.loads(http_get(triton.http_url, "/v2/models/clip_demo"))
    assert json.loads(http_get(proxy.http_url, f"/v2/models/{route}")) == \
        {**want_meta, "name": route}
    direct = grpcclient.InferenceServerClient(triton.grpc_url)
    client = grpcclient.InferenceServerClient(proxy.grpc_url)
    try:
        expected = direct.get_model_config("clip_demo").config
        expected.name = route
        assert client.get_model_config(route).config == expected
        meta = direct.get_model_metadata("clip_demo")
        meta.name = route
        assert client.get_model_metadata(route) == meta
    finally:
        direct.close()
        client.close()


def http_get(url: str, path: str) -> bytes:
    with urllib.request.urlopen(f"http://{url}{path}", timeout=30) as r:
        body: bytes = r.read()
        return body


def test_max_in_flight_gives_429_with_retry_after(triton: TritonServer) -> None:
    cfg = triton_routes(triton, ["slow_fp32"])
    cfg["models"] = [{"name": "one_at_a_time", "backend": "triton-grpc",
                      "backend_model": "slow_fp32",
                      "filters": [{"limits": {"max_in_flight": 1, "retry_after_s": 2}}]}]
    import concurrent.futures
    import time
    with RunningMmguard(cfg) as m:
        _wait_contract(m, "one_at_a_time")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(grpc_infer_raw, m.grpc_url,
                                grpc_request("one_at_a_time", _slow(1000)), 10)
            time.sleep(0.3)
            with pytest.raises(grpc.RpcError) as exc:
                grpc_infer_raw(m.grpc_url, grpc_request("one_at_a_time", _slow(0)))
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "has 1 requests in flight; the limit is 1" in exc.value.details()
            assert dict(exc.value.trailing_metadata())["retry-after"] == "2"
            body, hlen = http_binary_body(_slow(0))
            status, headers, _ = http_post(m.http_url, "/v2/models/one_at_a_time/infer", body,
                                           {"Inference-Header-Content-Length": str(hlen)})
            assert status == 429 and headers["Retry-After"] == "2"
            assert headers["mmguard-limits"].startswith("reject-overload")
            first.result(10)
        out, _ = grpc_infer_raw(m.grpc_url, grpc_request("one_at_a_time", _slow(0)))
        assert pb.ModelInferResponse.FromString(out).outputs[0].name == "y"


def test_one_model_has_one_fingerprint_through_either_backend(proxy: RunningMmguard) -> None:
    """The config both backends learn is the same document (Triton's HTTP form), so a version
    fuse (``expect_fingerprint``) means the same through a gRPC and an HTTP backend."""
    assert proxy.server is not None
    contracts = proxy.server.plane.runtime.contracts
    for model in ("clip_demo", "identity_bytes", "slow_fp32"):
        grpc_side, http_side = contracts[f"g_{model}"], contracts[f"h_{model}"]
        assert grpc_side.config == http_side.config
        assert grpc_side.fingerprint == http_side.fingerprint
