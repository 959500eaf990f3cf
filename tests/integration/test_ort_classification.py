"""The classification extension on the in-process ONNX Runtime backend: ``class_count`` gets
the top-k as ``"score:index"`` strings in Triton's form, not the raw scores."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from numpy.typing import NDArray
from tritonclient.utils import InferenceServerException

from tests.support.mmguard import RunningMmguard


def top(scores: NDArray[Any], k: int) -> list[str]:
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[:k]
    return [f"{float(scores[i]):f}:{i}" for i in order]


def test_top_k_over_grpc_and_http(ort_proxy: RunningMmguard) -> None:
    x = np.array([0.25, -1.5, 3.0, 0.5, 2.0], np.float32)
    g = grpcclient.InferenceServerClient(ort_proxy.grpc_url)
    h = httpclient.InferenceServerClient(ort_proxy.http_url)
    try:
        for module, client in ((grpcclient, g), (httpclient, h)):
            inp = module.InferInput("INPUT0", [5], "FP32")
            inp.set_data_from_numpy(x)
            out = module.InferRequestedOutput("OUTPUT0", class_count=3)
            got = client.infer("identity_fp32", [inp], outputs=[out]).as_numpy("OUTPUT0")
            assert got.shape == (3,)
            assert [v.decode() if isinstance(v, bytes) else v for v in got] == top(x, 3)
        # k is cut to the number of scores, as Triton does; integers print as integers.
        inp = grpcclient.InferInput("INPUT0", [3], "INT64")
        inp.set_data_from_numpy(np.array([5, -7, 9], np.int64))
        got = g.infer("identity_int64", [inp],
                      outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=9)])
        assert list(got.as_numpy("OUTPUT0")) == [b"9:2", b"5:0", b"-7:1"]
    finally:
        g.close()
        h.close()


def test_batched_model_gives_one_row_per_entry(ort_proxy: RunningMmguard) -> None:
    rng = np.random.default_rng(5)
    g = grpcclient.InferenceServerClient(ort_proxy.grpc_url)
    try:
        pixels = grpcclient.InferInput("pixel_values", [2, 3, 224, 224], "FP32")
        pixels.set_data_from_numpy(rng.random((2, 3, 224, 224), np.float32))
        ids = grpcclient.InferInput("input_ids", [2, 77], "INT64")
        ids.set_data_from_numpy(np.ones((2, 77), np.int64))
        plain = g.infer("clip_demo", [pixels, ids],
                        outputs=[grpcclient.InferRequestedOutput("image_embeds")])
        ranked = g.infer("clip_demo", [pixels, ids],
                         outputs=[grpcclient.InferRequestedOutput("image_embeds", class_count=4)])
        embeds = plain.as_numpy("image_embeds")
        got = ranked.as_numpy("image_embeds")
        assert got.shape == (2, 4)
        assert [[v.decode() for v in row] for row in got] == [top(r, 4) for r in embeds]
    finally:
        g.close()


def test_non_numeric_output_is_refused_like_triton(ort_proxy: RunningMmguard) -> None:
    g = grpcclient.InferenceServerClient(ort_proxy.grpc_url)
    try:
        inp = grpcclient.InferInput("INPUT0", [2], "FP16")
        inp.set_data_from_numpy(np.array([1, 2], np.float16))
        with pytest.raises(InferenceServerException) as err:
            g.infer("identity_fp16", [inp],
                    outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=1)])
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "unsupported type 'FP16'" in (err.value.message() or "")
        assert "'OUTPUT0'" in (err.value.message() or "")
    finally:
        g.close()
