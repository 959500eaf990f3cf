"""The binary tensor extension's raw form through mmguard's in-process ONNX Runtime: the shape
deduced from the model's one input, every output in binary, Triton's texts on refusal."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.mmguard import RunningMmguard
from tests.support.wire import http_post

RAW = {"Inference-Header-Content-Length": "0"}


@pytest.mark.parametrize("datatype,dtype", [("FP32", np.float32), ("INT64", np.int64),
                                            ("BOOL", np.bool_)])
def test_raw_body_is_the_one_input(ort_proxy: RunningMmguard, datatype: str,
                                   dtype: type) -> None:
    model = f"identity_{datatype.lower()}"
    x = (np.arange(5) % 2).astype(dtype).tobytes()
    status, headers, body = http_post(ort_proxy.http_url, f"/v2/models/{model}/infer", x, RAW)
    assert status == 200, body
    hlen = int(headers["Inference-Header-Content-Length"])
    head = json.loads(body[:hlen])
    assert head["model_name"] == model
    assert head["outputs"] == [{"name": "OUTPUT0", "datatype": datatype, "shape": [5],
                                "parameters": {"binary_data_size": len(x)}}]
    assert body[hlen:] == x


@pytest.mark.parametrize("model,body,says", [
    ("clip_demo", bytes(64), "[request id: <id_unknown>] Raw request must only have 1 input "
                             "(found 1) to be deduced but got 2 inputs in 'clip_demo' model "
                             "configuration"),
    ("identity_bytes", b"427", "[request id: <id_unknown>] For BYTE datatype raw input 'INPUT0', "
                               "the model must have input shape [1]"),
    ("identity_fp32", bytes(6), "[request id: <id_unknown>] input byte size mismatch for input "
                                "'raw_input' for model 'identity_fp32'. Expected 4, got 6"),
])
def test_raw_refusals(ort_proxy: RunningMmguard, model: str, body: bytes, says: str) -> None:
    status, _, answer = http_post(ort_proxy.http_url, f"/v2/models/{model}/infer", body, RAW)
    assert status == 400, answer
    assert json.loads(answer)["error"] == says
