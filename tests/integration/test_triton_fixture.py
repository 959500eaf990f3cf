"""The real-Triton fixture (tests/support/triton.py), checked directly with tritonclient.

One tritonserver for the whole module; every model is called over gRPC and HTTP with no proxy
in between, and the answers are checked for values, shapes and datatypes.
"""

from __future__ import annotations

import json
import os
import queue
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from _pytest.mark.structures import ParameterSet  # what pytest.param returns; not re-exported
from numpy.typing import NDArray
from tritonclient.utils import InferenceServerException

from proxy.cli.demo_model import ensure_clip_demo, tokenize
from tests.support.triton import MODEL_NAMES, TritonServer, write_model_repository

PROTOCOLS = ("grpc", "http")

# (tritonclient.grpc or tritonclient.http, its InferenceServerClient); tritonclient is untyped.
Proto = tuple[Any, Any]
# What _stream collects per response: (monotonic time, InferResult or None, error or None).
StreamItem = tuple[float, Any, Any]


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_clip_demo(tmp_path_factory.mktemp("onnx"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, onnx_path: Path) -> Iterator[TritonServer]:
    root = tmp_path_factory.mktemp("triton")
    repo = write_model_repository(root / "models", onnx_path)
    srv = TritonServer(repo, root / "work")
    srv.start()
    pgid = srv.pid
    try:
        yield srv
    finally:
        srv.stop()
    # stop() must leave nothing behind: neither the server nor any Python-backend stub.
    assert pgid is not None  # set by start()
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


@pytest.fixture(scope="module")
def grpc_client(server: TritonServer) -> Iterator[Any]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def http_client(server: TritonServer) -> Iterator[Any]:
    client = httpclient.InferenceServerClient(server.http_url)
    yield client
    client.close()


@pytest.fixture(params=PROTOCOLS)
def proto(request: pytest.FixtureRequest, grpc_client: Any, http_client: Any) -> Proto:
    """(module, client) for one protocol; tests run once per protocol."""
    if request.param == "grpc":
        return grpcclient, grpc_client
    return httpclient, http_client


def infer(
    proto: Proto,
    model: str,
    inputs: dict[str, tuple[NDArray[Any], str]],
    outputs: list[str] | None = None,
    **kwargs: Any,
) -> Any:
    """Build InferInputs from {name: (array, triton_dtype)} and call ``infer`` on ``proto``."""
    module, client = proto
    infer_inputs = []
    for name, (array, dtype) in inputs.items():
        tensor = module.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        infer_inputs.append(tensor)
    requested = None
    if outputs is not None:
        requested = [module.InferRequestedOutput(name) for name in outputs]
    return client.infer(model, infer_inputs, outputs=requested, **kwargs)


def output_meta(result: Any, name: str) -> tuple[str, list[int]]:
    """(datatype, shape) of an output as the server reported it, for either protocol."""
    out = result.get_output(name)
    if isinstance(out, dict):  # HTTP: JSON header
        return out["datatype"], list(out["shape"])
    return out.datatype, list(out.shape)


def error_of(excinfo: pytest.ExceptionInfo[InferenceServerException]) -> tuple[str, str]:
    exc = excinfo.value
    assert isinstance(exc, InferenceServerException)
    return str(exc.status()), exc.message()


# -- server ----------------------------------------------------------------------------------


@pytest.mark.triton
def test_server_is_up_with_every_model_ready(
    server: TritonServer, grpc_client: Any, http_client: Any
) -> None:
    assert server.grpc_url.startswith("127.0.0.1:") and server.http_url.startswith("127.0.0.1:")
    assert server.log_path.is_file()
    assert server.metrics_url is None
    assert grpc_client.is_server_live() and grpc_client.is_server_ready()
    assert http_client.is_server_live() and http_client.is_server_ready()
    index = {m["name"]: m["state"] for m in server.repository_index()}
    assert index == {name: "READY" for name in MODEL_NAMES}
    for name in MODEL_NAMES:
        assert grpc_client.is_model_ready(name)
        assert http_client.is_model_ready(name)


@pytest.mark.triton
def test_unknown_model_is_not_found(grpc_client: Any, http_client: Any) -> None:
    x = np.zeros((1, 4), np.float32)
    with pytest.raises(InferenceServerException) as excinfo:
        infer((grpcclient, grpc_client), "no_such_model", {"x": (x, "FP32")})
    assert error_of(excinfo)[0] == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as excinfo:
        infer((httpclient, http_client), "no_such_model", {"x": (x, "FP32")})
    assert error_of(excinfo)[0] == "404"


@pytest.mark.triton
def test_metadata_adds_leading_batch_dim(grpc_client: Any, http_client: Any) -> None:
    grpc_meta = grpc_client.get_model_metadata("identity_bf16", as_json=True)
    http_meta = http_client.get_model_metadata("identity_bf16")
    for meta in (grpc_meta, http_meta):
        assert meta["inputs"][0]["name"] == "INPUT0"
        assert meta["inputs"][0]["datatype"] == "BF16"
        assert [int(d) for d in meta["inputs"][0]["shape"]] == [-1, -1]
    clip = http_client.get_model_metadata("clip_demo")
    shapes = {t["name"]: (t["datatype"], t["shape"]) for t in clip["inputs"] + clip["outputs"]}
    assert shapes == {
        "pixel_values": ("FP32", [-1, 3, 224, 224]),
        "input_ids": ("INT64", [-1, 77]),
        "image_embeds": ("FP32", [-1, 64]),
        "text_embeds": ("FP32", [-1, 64]),
        "similarity": ("FP32", [-1, 1]),
    }
    counter = http_client.get_model_metadata("decoupled_counter")
    assert counter["inputs"][0]["shape"] == [1]  # max_batch_size 0: no batch dim added
    config = http_client.get_model_config("decoupled_counter")
    assert config["max_batch_size"] == 0
    assert config["model_transaction_policy"]["decoupled"] is True


# -- identity models ------------------------------------------------------------------------


def _identity_cases() -> list[ParameterSet]:
    rng = np.random.default_rng(7)
    fp32 = rng.standard_normal((2, 5)).astype(np.float32)
    fp32.view(np.uint32)[0, 0] = 0x7FC12345  # a NaN with a payload: must survive bit for bit
    fp32[1, 0] = -0.0
    fp16 = rng.standard_normal((3, 4)).astype(np.float16)
    fp16[0, 0] = np.inf
    # BF16: raw bit patterns (1.0, -2.0, +inf, NaN w/ payload, -0, smallest subnormal, max) sent
    # as ml_dtypes.bfloat16, which tritonclient maps to "BF16".
    bf16_bits = np.array([[0x3F80, 0xC000, 0x7F80, 0x7FC1, 0x8000, 0x0001, 0x7F7F]], np.uint16)
    int64 = np.array([[np.iinfo(np.int64).min, -1, 0, 1, np.iinfo(np.int64).max]], np.int64)
    boolean = np.array([[True, False, True], [False, False, True]])
    strings = np.array(
        [[b"hello", b"", b"\x00\xff\x00 binary", "héllo".encode()]], dtype=np.object_
    )
    cases = [
        ("identity_fp32", "FP32", fp32),
        ("identity_fp16", "FP16", fp16),
        ("identity_bf16", "BF16", bf16_bits.view(ml_dtypes.bfloat16)),
        ("identity_int64", "INT64", int64),
        ("identity_bool", "BOOL", boolean),
        ("identity_bytes", "BYTES", strings),
    ]
    return [pytest.param(*case, id=case[0]) for case in cases]


@pytest.mark.triton
@pytest.mark.parametrize("model,dtype,data", _identity_cases())
def test_identity_is_byte_exact(proto: Proto, model: str, dtype: str, data: NDArray[Any]) -> None:
    result = infer(proto, model, {"INPUT0": (data, dtype)})
    assert output_meta(result, "OUTPUT0") == (dtype, list(data.shape))
    out = result.as_numpy("OUTPUT0")
    assert out.shape == data.shape
    assert out.dtype == data.dtype
    if dtype == "BYTES":
        assert out.tolist() == data.tolist()
    else:
        assert out.tobytes() == data.tobytes()


@pytest.mark.triton
def test_bf16_raw_bytes_over_grpc(server: TritonServer) -> None:
    """BF16 without numpy help: a hand-built ModelInferRequest with raw_input_contents."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    bits = np.array([[0x3F80, 0x4049, 0xFF80, 0x7FC1, 0x0001]], np.uint16)
    request = service_pb2.ModelInferRequest(model_name="identity_bf16")
    request.inputs.add(name="INPUT0", datatype="BF16", shape=[1, 5])
    request.raw_input_contents.append(bits.tobytes())
    with grpc.insecure_channel(server.grpc_url) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request, timeout=10
        )
    assert response.model_name == "identity_bf16"
    assert response.outputs[0].name == "OUTPUT0"
    assert response.outputs[0].datatype == "BF16"
    assert list(response.outputs[0].shape) == [1, 5]
    assert response.raw_output_contents[0] == bits.tobytes()


@pytest.mark.triton
def test_bf16_raw_bytes_over_http_binary_body(server: TritonServer) -> None:
    """BF16 via the HTTP binary-tensor extension by hand (Inference-Header-Content-Length)."""
    bits = np.array([[0x3F80, 0xC000, 0x7FC1]], np.uint16)
    raw = bits.tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1, 3],
                    "datatype": "BF16",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/identity_bf16/infer",
        data=header + raw,
        method="POST",
        headers={
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(header)),
        },
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        header_len = int(response.headers["Inference-Header-Content-Length"])
        body = response.read()
    meta = json.loads(body[:header_len])
    assert meta["outputs"][0]["datatype"] == "BF16"
    assert meta["outputs"][0]["shape"] == [1, 3]
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == len(raw)
    assert body[header_len:] == raw


# -- pixel_identity / small_fp32 ------------------------------------------------------------


@pytest.mark.triton
def test_pixel_identity_roundtrip(proto: Proto) -> None:
    pixels = np.random.default_rng(1).random((2, 3, 224, 224), dtype=np.float32)
    result = infer(proto, "pixel_identity", {"pixel_values": (pixels, "FP32")})
    assert output_meta(result, "pixel_out") == ("FP32", [2, 3, 224, 224])
    out = result.as_numpy("pixel_out")
    assert out.dtype == np.float32
    assert out.tobytes() == pixels.tobytes()


@pytest.mark.triton
def test_pixel_identity_rejects_wrong_shape(proto: Proto) -> None:
    pixels = np.zeros((1, 3, 256, 256), np.float32)
    with pytest.raises(InferenceServerException) as excinfo:
        infer(proto, "pixel_identity", {"pixel_values": (pixels, "FP32")})
    status, message = error_of(excinfo)
    assert status == ("StatusCode.INVALID_ARGUMENT" if proto[0] is grpcclient else "400")
    assert "unexpected shape for input 'pixel_values'" in message
    assert "Expected [-1,3,224,224], got [1,3,256,256]" in message


@pytest.mark.triton
def test_pixel_identity_rejects_batch_over_max(proto: Proto) -> None:
    pixels = np.zeros((9, 3, 224, 224), np.float32)
    with pytest.raises(InferenceServerException) as excinfo:
        infer(proto, "pixel_identity", {"pixel_values": (pixels, "FP32")})
    status, message = error_of(excinfo)
    assert status == ("StatusCode.INVALID_ARGUMENT" if proto[0] is grpcclient else "400")
    assert "inference request batch-size must be <= 8 for 'pixel_identity'" in message


@pytest.mark.triton
def test_small_fp32_doubles(proto: Proto) -> None:
    x = np.arange(3 * 16, dtype=np.float32).reshape(3, 16) - 7.5
    result = infer(proto, "small_fp32", {"x": (x, "FP32")})
    assert output_meta(result, "y") == ("FP32", [3, 16])
    y = result.as_numpy("y")
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, x * 2)


@pytest.mark.triton
def test_small_fp32_rejects_wrong_dim(proto: Proto) -> None:
    with pytest.raises(InferenceServerException) as excinfo:
        infer(proto, "small_fp32", {"x": (np.zeros((1, 17), np.float32), "FP32")})
    status, message = error_of(excinfo)
    assert status == ("StatusCode.INVALID_ARGUMENT" if proto[0] is grpcclient else "400")
    assert "unexpected shape for input 'x'" in message


@pytest.mark.triton
def test_wrong_datatype_is_rejected(proto: Proto) -> None:
    with pytest.raises(InferenceServerException) as excinfo:
        infer(proto, "small_fp32", {"x": (np.zeros((1, 16), np.float64), "FP64")})
    status, message = error_of(excinfo)
    assert status == ("StatusCode.INVALID_ARGUMENT" if proto[0] is grpcclient else "400")
    assert "FP64" in message and "FP32" in message


# -- clip_demo --------------------------------------------------------------------------------


@pytest.mark.triton
def test_clip_demo_matches_onnxruntime(proto: Proto, onnx_path: Path) -> None:
    import onnxruntime as ort

    rng = np.random.default_rng(3)
    pixels = rng.random((2, 3, 224, 224), dtype=np.float32)
    ids = np.stack([tokenize("a photo of a cat"), tokenize("a diagram of a proxy")])
    result = infer(
        proto, "clip_demo", {"pixel_values": (pixels, "FP32"), "input_ids": (ids, "INT64")}
    )

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    want_img, want_txt, want_sim = session.run(
        ["image_embeds", "text_embeds", "similarity"], {"pixel_values": pixels, "input_ids": ids}
    )
    assert want_sim.shape == (2,)

    assert output_meta(result, "image_embeds") == ("FP32", [2, 64])
    assert output_meta(result, "text_embeds") == ("FP32", [2, 64])
    assert output_meta(result, "similarity") == ("FP32", [2, 1])  # dims [1] + reshape []
    img, txt, sim = (result.as_numpy(n) for n in ("image_embeds", "text_embeds", "similarity"))
    assert img.dtype == txt.dtype == sim.dtype == np.float32
    np.testing.assert_allclose(img, want_img, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(txt, want_txt, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(sim.reshape(-1), want_sim, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.linalg.norm(img, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(sim.reshape(-1), (img * txt).sum(axis=1), rtol=1e-5, atol=1e-6)


@pytest.mark.triton
def test_clip_demo_requires_both_inputs(proto: Proto) -> None:
    pixels = np.zeros((1, 3, 224, 224), np.float32)
    with pytest.raises(InferenceServerException) as excinfo:
        infer(proto, "clip_demo", {"pixel_values": (pixels, "FP32")})
    status, message = error_of(excinfo)
    assert status == ("StatusCode.INVALID_ARGUMENT" if proto[0] is grpcclient else "400")
    assert "input_ids" in message


# -- slow_fp32 --------------------------------------------------------------------------------


@pytest.mark.triton
def test_slow_fp32_sleeps_for_delay_ms(proto: Proto) -> None:
    x = np.array([[1.5, -2.0, 3.25]], np.float32)
    began = time.monotonic()
    result = infer(
        proto, "slow_fp32", {"x": (x, "FP32"), "delay_ms": (np.array([[300]], np.int32), "INT32")}
    )
    elapsed = time.monotonic() - began
    assert 0.3 <= elapsed < 2.0
    assert output_meta(result, "y") == ("FP32", [1, 3])
    np.testing.assert_array_equal(result.as_numpy("y"), x)


@pytest.mark.triton
def test_slow_fp32_without_delay_is_fast(proto: Proto) -> None:
    x = np.ones((2, 4), np.float32)
    began = time.monotonic()
    result = infer(proto, "slow_fp32", {"x": (x, "FP32")})
    assert time.monotonic() - began < 0.5
    np.testing.assert_array_equal(result.as_numpy("y"), x)


@pytest.mark.triton
def test_slow_fp32_grpc_deadline_cancels_the_backend(
    server: TritonServer, grpc_client: Any
) -> None:
    before = server.log_text().count("slow_fp32: cancelled after")
    x = np.ones((1, 2), np.float32)
    began = time.monotonic()
    with pytest.raises(InferenceServerException) as excinfo:
        infer(
            (grpcclient, grpc_client),
            "slow_fp32",
            {"x": (x, "FP32"), "delay_ms": (np.array([[3000]], np.int32), "INT32")},
            client_timeout=0.3,
        )
    assert time.monotonic() - began < 1.0
    assert error_of(excinfo)[0] == "StatusCode.DEADLINE_EXCEEDED"
    # Triton passes the gRPC cancellation to the Python model, which stops sleeping early.
    deadline = time.monotonic() + 5
    while server.log_text().count("slow_fp32: cancelled after") == before:
        assert time.monotonic() < deadline, "the backend never saw the cancellation"
        time.sleep(0.05)
    # ... and the instance is free again at once (not after the 3 s sleep).
    began = time.monotonic()
    result = infer((grpcclient, grpc_client), "slow_fp32", {"x": (x, "FP32")})
    assert time.monotonic() - began < 1.0
    np.testing.assert_array_equal(result.as_numpy("y"), x)


# -- fail_fp32 --------------------------------------------------------------------------------


@pytest.mark.triton
def test_fail_fp32_error_passes_through(proto: Proto) -> None:
    with pytest.raises(InferenceServerException) as excinfo:
        infer(proto, "fail_fp32", {"x": (np.ones((1, 3), np.float32), "FP32")})
    status, message = error_of(excinfo)
    assert status == ("StatusCode.INTERNAL" if proto[0] is grpcclient else "500")
    assert "deliberate failure from fail_fp32" in message


# -- decoupled_counter -----------------------------------------------------------------------


def _stream(
    client: Any, count: int, *, empty_final: bool = False
) -> tuple[float, list[StreamItem]]:
    """Run one decoupled_counter request over gRPC streaming; return [(t, result, error)]."""
    received: queue.Queue[StreamItem] = queue.Queue()
    client.start_stream(
        callback=lambda result, error: received.put((time.monotonic(), result, error))
    )
    try:
        tensor = grpcclient.InferInput("count", [1], "INT32")
        tensor.set_data_from_numpy(np.array([count], np.int32))
        began = time.monotonic()
        client.async_stream_infer(
            "decoupled_counter", [tensor], request_id="r1", enable_empty_final_response=empty_final
        )
        items: list[StreamItem] = []
        while True:
            item = received.get(timeout=10)
            items.append(item)
            final = (
                item[1] is not None
                and item[1].get_response().parameters["triton_final_response"].bool_param
            )
            if item[2] is not None or final or (not empty_final and len(items) == count):
                break
    finally:
        client.stop_stream()
    return began, items


@pytest.mark.triton
def test_decoupled_counter_streams_in_order(grpc_client: Any) -> None:
    count = 6
    began, items = _stream(grpc_client, count)
    assert [error for _, _, error in items] == [None] * count
    values = []
    for _, result, _ in items:
        assert result.get_response().model_name == "decoupled_counter"
        assert result.get_response().id == "r1"
        assert result.get_output("value").datatype == "INT32"
        assert list(result.get_output("value").shape) == [1]
        value = result.as_numpy("value")
        assert value.dtype == np.int32 and value.shape == (1,)
        values.append(int(value[0]))
    assert values == list(range(count))
    # 10 ms apart: the responses arrive spread out, not in one burst at the end.
    times = [t for t, _, _ in items]
    assert times[-1] - times[0] >= 0.045
    assert times[-1] - began < 2.0


@pytest.mark.triton
def test_decoupled_counter_final_flag(grpc_client: Any) -> None:
    _, items = _stream(grpc_client, 3, empty_final=True)
    assert len(items) == 4
    flags = [r.get_response().parameters["triton_final_response"].bool_param for _, r, _ in items]
    assert flags == [False, False, False, True]
    assert [int(r.as_numpy("value")[0]) for _, r, _ in items[:3]] == [0, 1, 2]
    assert items[3][1].as_numpy("value") is None  # the FINAL response carries no tensor

    _, only_final = _stream(grpc_client, 0, empty_final=True)
    assert len(only_final) == 1
    assert only_final[0][1].get_response().parameters["triton_final_response"].bool_param
    assert only_final[0][1].as_numpy("value") is None


@pytest.mark.triton
def test_decoupled_counter_negative_count_is_an_error(grpc_client: Any) -> None:
    _, items = _stream(grpc_client, -1)
    assert len(items) == 1
    _, result, error = items[0]
    assert result is None
    assert "count must be >= 0, got -1" in error.message()


@pytest.mark.triton
def test_decoupled_counter_over_http_generate_stream(server: TritonServer) -> None:
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/decoupled_counter/generate_stream",
        data=json.dumps({"count": [4]}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [
            json.loads(line[len(b"data: ") :]) for line in response if line.startswith(b"data: ")
        ]
    assert [event["value"] for event in events] == [0, 1, 2, 3]
    assert all(event["model_name"] == "decoupled_counter" for event in events)


# -- repository API (explicit model control) -------------------------------------------------


@pytest.mark.triton
def test_unload_and_reload_a_model(server: TritonServer, grpc_client: Any) -> None:
    x = np.ones((1, 16), np.float32)
    server.unload_model("small_fp32")
    deadline = time.monotonic() + 10
    while server.model_ready("small_fp32"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(InferenceServerException) as excinfo:
        infer((grpcclient, grpc_client), "small_fp32", {"x": (x, "FP32")})
    assert "small_fp32" in error_of(excinfo)[1]
    server.load_model("small_fp32")
    assert server.model_ready("small_fp32")
    result = infer((grpcclient, grpc_client), "small_fp32", {"x": (x, "FP32")})
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)


@pytest.mark.triton
def test_reload_with_config_override(server: TritonServer, http_client: Any) -> None:
    """load_model(name, config=...) swaps the config in place.

    A plain load_model(name) afterwards does NOT bring config.pbtxt back (Triton reloads only
    when the model's files changed); unload + load does.
    """
    x3 = np.ones((3, 16), np.float32)
    config = http_client.get_model_config("small_fp32")
    assert config["max_batch_size"] == 8
    config["max_batch_size"] = 2
    try:
        server.load_model("small_fp32", config=config)
        assert http_client.get_model_config("small_fp32")["max_batch_size"] == 2
        with pytest.raises(InferenceServerException) as excinfo:
            infer((httpclient, http_client), "small_fp32", {"x": (x3, "FP32")})
        assert "batch-size must be <= 2 for 'small_fp32'" in error_of(excinfo)[1]
        server.load_model("small_fp32")
        assert http_client.get_model_config("small_fp32")["max_batch_size"] == 2
    finally:
        server.unload_model("small_fp32")
        server.load_model("small_fp32")
    assert http_client.get_model_config("small_fp32")["max_batch_size"] == 8
    result = infer((httpclient, http_client), "small_fp32", {"x": (x3, "FP32")})
    np.testing.assert_array_equal(result.as_numpy("y"), x3 * 2)


def test_a_wedged_server_is_restarted_on_its_ports(tmp_path: Path) -> None:
    import signal
    repo = write_model_repository(tmp_path / "repo", ensure_clip_demo(tmp_path / "onnx"))
    with TritonServer(repo, tmp_path / "work", load_models=["small_fp32"],
                      stop_timeout=2) as own:
        assert own.ensure_healthy(within_s=5) is None  # answering: nothing to do
        ports = (own.grpc_port, own.http_port)
        assert own.pid is not None  # the with block started it
        os.kill(own.pid, signal.SIGSTOP)  # wedged: alive, answers nothing
        wait_stopped(own.pid)
        why = own.ensure_healthy(within_s=2)
        assert why is not None and "did not answer /v2/health/ready for 2 s" in why
        assert (own.grpc_port, own.http_port) == ports
        assert own.model_ready("small_fp32")

        assert own.restart_if_ended() is None  # running: nothing to do, nothing sent
        for check in (own.restart_if_ended, lambda: own.ensure_healthy(within_s=60)):
            assert own.pid is not None and own.process is not None
            os.kill(own.pid, signal.SIGSEGV)  # as Triton 2.51 does on a cancellation race
            own.process.wait(timeout=30)
            began = time.monotonic()
            why = check()
            assert why is not None and "ended (killed by SIGSEGV)" in why, why
            # at once, not after ``within_s`` of asking a server that is gone for its health
            waited = time.monotonic() - began - (own.start_seconds or 0)
            assert waited < 30, f"{waited:.1f} s before the restart"
            assert (own.grpc_port, own.http_port) == ports
            assert own.model_ready("small_fp32")


def wait_stopped(pid: int, within_s: float = 10.0) -> None:
    """Wait until every thread of ``pid`` is stopped. SIGSTOP starts the group stop only when
    the thread it was given to runs; on a busy machine the other threads (the HTTP server's)
    can answer a probe before that."""
    tasks = Path(f"/proc/{pid}/task")
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        states = []
        for task in tasks.iterdir():
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue  # a thread that just ended
            states.append(stat[stat.rindex(")") + 2])
        if states and all(s in "tT" for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} not stopped within {within_s} s of SIGSTOP")
