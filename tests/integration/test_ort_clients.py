"""tritonclient (gRPC sync + aio, HTTP JSON + binary) → mmguard → in-process ONNX Runtime."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from numpy.typing import NDArray

from proxy.cli.demo_model import tokenize
from tests.support.mmguard import RunningMmguard


def _inputs(mod, batch: int = 2, binary: bool | None = None):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(batch)
    px = rng.random((batch, 3, 224, 224), dtype=np.float32)
    ids = np.stack([tokenize(f"caption number {i}") for i in range(batch)])
    inputs = [mod.InferInput("pixel_values", list(px.shape), "FP32"),
              mod.InferInput("input_ids", list(ids.shape), "INT64")]
    kw = {} if binary is None else {"binary_data": binary}
    inputs[0].set_data_from_numpy(px, **kw)
    inputs[1].set_data_from_numpy(ids, **kw)
    return inputs, px, ids


def _direct(ort_proxy: RunningMmguard, px: NDArray[Any], ids: NDArray[Any]) -> list[NDArray[Any]]:
    cfg = ort_proxy.config.backends[0]
    path = cfg.model_dir / "clip_demo" / "1" / "model.onnx"  # type: ignore[union-attr]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return list(sess.run(None, {"pixel_values": px, "input_ids": ids}))


def test_grpc_sync_infer_matches_direct_onnxruntime(ort_proxy: RunningMmguard) -> None:
    client = grpcclient.InferenceServerClient(ort_proxy.grpc_url)
    inputs, px, ids = _inputs(grpcclient)
    result = client.infer("clip_demo", inputs)
    img, txt, sim = _direct(ort_proxy, px, ids)
    np.testing.assert_array_equal(result.as_numpy("image_embeds"), img)
    np.testing.assert_array_equal(result.as_numpy("text_embeds"), txt)
    np.testing.assert_array_equal(result.as_numpy("similarity"), sim)
    assert result.get_response().model_name == "clip_demo"


async def test_grpc_aio_client(ort_proxy: RunningMmguard) -> None:
    client = grpcaio.InferenceServerClient(ort_proxy.grpc_url)
    try:
        assert await client.is_server_live()
        assert await client.is_server_ready()
        assert await client.is_model_ready("clip_demo")
        inputs, px, ids = _inputs(grpcaio, batch=3)
        result = await client.infer("clip_demo", inputs,
                                    outputs=[grpcaio.InferRequestedOutput("similarity")])
        assert result.as_numpy("image_embeds") is None  # only what was asked for
        np.testing.assert_array_equal(result.as_numpy("similarity"),
                                      _direct(ort_proxy, px, ids)[2])
    finally:
        await client.close()


@pytest.mark.parametrize("binary", [True, False])
def test_http_infer_json_and_binary(ort_proxy: RunningMmguard, binary: bool) -> None:
    client = httpclient.InferenceServerClient(ort_proxy.http_url)
    inputs, px, ids = _inputs(httpclient, binary=binary)
    outputs = [httpclient.InferRequestedOutput("similarity", binary_data=binary),
               httpclient.InferRequestedOutput("text_embeds", binary_data=binary)]
    result = client.infer("clip_demo", inputs, outputs=outputs)
    _, txt, sim = _direct(ort_proxy, px, ids)
    np.testing.assert_allclose(result.as_numpy("similarity"), sim, rtol=0, atol=0)
    np.testing.assert_array_equal(result.as_numpy("text_embeds"), txt)
    described = {o["name"]: o for o in result.get_response()["outputs"]}
    assert ("binary_data_size" in described["similarity"].get("parameters", {})) is binary
    assert ("data" in described["similarity"]) is not binary


def test_metadata_config_and_statistics_on_both_fronts(ort_proxy: RunningMmguard) -> None:
    http = httpclient.InferenceServerClient(ort_proxy.http_url)
    grpcc = grpcclient.InferenceServerClient(ort_proxy.grpc_url)
    meta = http.get_model_metadata("clip_demo")
    assert meta["inputs"] == [
        {"name": "pixel_values", "datatype": "FP32", "shape": [-1, 3, 224, 224]},
        {"name": "input_ids", "datatype": "INT64", "shape": [-1, 77]}]
    assert [o["name"] for o in meta["outputs"]] == ["image_embeds", "text_embeds", "similarity"]
    gmeta = grpcclient.InferenceServerClient(ort_proxy.grpc_url).get_model_metadata(
        "clip_demo", as_json=True)
    assert gmeta["inputs"][0]["shape"] == ["-1", "3", "224", "224"]  # proto3 JSON int64 strings
    cfg = grpcc.get_model_config("clip_demo").config
    assert cfg.max_batch_size == 8
    assert list(cfg.input[0].dims) == [3, 224, 224]  # batch dim left out, as Triton does
    assert http.get_model_config("clip_demo")["max_batch_size"] == 8
    assert http.get_server_metadata()["name"] == "mmguard"
    before = grpcc.get_inference_statistics("clip_demo").model_stats[0].inference_stats
    grpcc.infer("clip_demo", _inputs(grpcclient, batch=2)[0])
    after = grpcc.get_inference_statistics("clip_demo").model_stats[0]
    assert after.inference_stats.success.count == before.success.count + 1
    assert http.get_inference_statistics("clip_demo")["model_stats"][0]["name"] == "clip_demo"


def test_grpc_health_service(ort_proxy: RunningMmguard) -> None:
    with grpc.insecure_channel(ort_proxy.grpc_url) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "inference.GRPCInferenceService"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_repository_and_shared_memory_rpcs_say_why(ort_proxy: RunningMmguard) -> None:
    client = grpcclient.InferenceServerClient(ort_proxy.grpc_url)
    from tritonclient.utils import InferenceServerException
    with pytest.raises(InferenceServerException) as exc:
        client.load_model("clip_demo")
    assert "UNIMPLEMENTED" in str(exc.value) and "v2.repository_api" in str(exc.value)
    with pytest.raises(InferenceServerException) as exc:
        client.get_system_shared_memory_status()
    # Off unless configured (docs/shared-memory.md): the refusal says how to turn it on.
    assert "UNIMPLEMENTED" in str(exc.value) and "shared_memory.system" in str(exc.value)


def test_admin_metrics_count_requests(ort_proxy: RunningMmguard) -> None:
    import urllib.request
    client = grpcclient.InferenceServerClient(ort_proxy.grpc_url)
    client.infer("clip_demo", _inputs(grpcclient, batch=1)[0])
    body = urllib.request.urlopen(ort_proxy.admin_url + "/metrics", timeout=5).read().decode()
    line = next(ln for ln in body.splitlines() if ln.startswith("mmguard_requests_total{")
                and 'front="grpc"' in ln and 'model="clip_demo"' in ln and 'code="ok"' in ln)
    assert float(line.rsplit(" ", 1)[1]) >= 1
    assert "mmguard_request_duration_seconds_bucket" in body
    with urllib.request.urlopen(ort_proxy.admin_url + "/healthz", timeout=5) as health:
        assert health.status == 200
