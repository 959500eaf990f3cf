"""Model config of an in-process ONNX Runtime model, read as Triton clients read it: the HTTP
JSON has every field Triton's ``/config`` has (zero values included), and the gRPC message the
same facts, so a client written against Triton (``max_batch_size``, input ``format``, ``dims``)
works unchanged."""

from __future__ import annotations

import json
import urllib.request

import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2

from tests.support.mmguard import RunningMmguard


def test_config_over_both_protocols(ort_proxy: RunningMmguard) -> None:
    with urllib.request.urlopen(f"http://{ort_proxy.http_url}/v2/models/clip_demo/config",
                                timeout=30) as r:
        cfg = json.loads(r.read())
    assert cfg["name"] == "clip_demo" and cfg["max_batch_size"] == 8
    assert cfg["platform"] == "onnxruntime_onnx"
    pixel = next(i for i in cfg["input"] if i["name"] == "pixel_values")
    assert pixel["dims"] == [3, 224, 224] and pixel["format"] == "FORMAT_NONE"
    assert pixel["data_type"] == "TYPE_FP32" and pixel["optional"] is False
    assert cfg["instance_group"] == [] and cfg["parameters"] == {}  # present, as in Triton's
    with urllib.request.urlopen(f"http://{ort_proxy.http_url}/v2/models/identity_fp32/config",
                                timeout=30) as r:
        identity = json.loads(r.read())
    assert identity["max_batch_size"] == 0 and identity["input"][0]["dims"] == [-1]
    client = grpcclient.InferenceServerClient(ort_proxy.grpc_url)
    try:
        msg = client.get_model_config("clip_demo").config
        assert msg.max_batch_size == 8 and msg.platform == "onnxruntime_onnx"
        pixels = next(i for i in msg.input if i.name == "pixel_values")
        assert list(pixels.dims) == [3, 224, 224]
        assert pixels.format == model_config_pb2.ModelInput.FORMAT_NONE
        assert pixels.data_type == model_config_pb2.TYPE_FP32
    finally:
        client.close()
