"""The classification extension: ask for ``class_count=k`` on an output and Triton answers the k
largest values as BYTES ``"score:index"`` (``"score:index:label"`` when the output has a labels
file), per batch entry. Through mmguard the request parameter must reach Triton whichever
protocol each hop speaks; dropped on the way, the client gets the raw scores with a 200."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from numpy.typing import NDArray

from tests.conformance.conftest import Target

LABELS = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
          "truck"]
SCORES = np.array([0.1, 0.5, 0.2, 0.9, 0.0, 0.3, 0.05, 0.6, 0.7, 0.15], np.float32)


def top(scores: NDArray[Any], k: int, labels: list[str] | None) -> list[str]:
    """What the extension must answer, worked out here from the scores (not from any server)."""
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[:k]
    return [f"{float(scores[i]):f}:{i}" + (f":{labels[i]}" if labels else "") for i in order]


def text(values: Any) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in np.asarray(values).reshape(-1)]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_http_class_count_with_labels(target: Target, binary: bool) -> None:
    client = httpclient.InferenceServerClient(target.http_url)
    try:
        x = httpclient.InferInput("x", [10], "FP32")
        x.set_data_from_numpy(SCORES, binary_data=binary)
        out = httpclient.InferRequestedOutput("probs", binary_data=binary, class_count=3)
        result = client.infer("classify_fp32", [x], outputs=[out])
        got = result.as_numpy("probs")
        assert got.shape == (3,)
        assert text(got) == top(SCORES, 3, LABELS)
        assert result.get_output("probs")["datatype"] == "BYTES"
    finally:
        client.close()


def test_grpc_class_count_with_labels(target: Target) -> None:
    client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        x = grpcclient.InferInput("x", [10], "FP32")
        x.set_data_from_numpy(SCORES)
        out = grpcclient.InferRequestedOutput("probs", class_count=3)
        result = client.infer("classify_fp32", [x], outputs=[out])
        assert result.as_numpy("probs").shape == (3,)
        assert text(result.as_numpy("probs")) == top(SCORES, 3, LABELS)
        assert result.get_output("probs").datatype == "BYTES"
    finally:
        client.close()


def test_batched_class_count_without_labels(target: Target) -> None:
    """No labels file: ``score:index``, one row per batch entry ([batch, k])."""
    batch = np.stack([SCORES, SCORES[::-1].copy()])
    for module in (grpcclient, httpclient):
        url = target.grpc_url if module is grpcclient else target.http_url
        client: Any = module.InferenceServerClient(url)
        try:
            x = module.InferInput("INPUT0", [2, 10], "FP32")
            x.set_data_from_numpy(batch)
            out = module.InferRequestedOutput("OUTPUT0", class_count=2)
            got = client.infer("identity_fp32", [x], outputs=[out]).as_numpy("OUTPUT0")
            assert got.shape == (2, 2), module.__name__
            assert [text(row) for row in got] == [top(r, 2, None) for r in batch]
        finally:
            client.close()


def test_without_class_count_the_scores_come_back(target: Target) -> None:
    """The same output without the extension: the raw FP32 scores, unchanged."""
    client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        x = grpcclient.InferInput("x", [10], "FP32")
        x.set_data_from_numpy(SCORES)
        got = client.infer("classify_fp32", [x],
                           outputs=[grpcclient.InferRequestedOutput("probs")]).as_numpy("probs")
        assert got.dtype == np.float32 and got.tobytes() == SCORES.tobytes()
    finally:
        client.close()


async def test_aio_clients_class_count(target: Target) -> None:
    g = grpcaio.InferenceServerClient(target.grpc_url)
    h = httpaio.InferenceServerClient(target.http_url)
    try:
        gx = grpcaio.InferInput("x", [10], "FP32")
        gx.set_data_from_numpy(SCORES)
        gr = await g.infer("classify_fp32", [gx],
                           outputs=[grpcaio.InferRequestedOutput("probs", class_count=4)])
        hx = httpaio.InferInput("x", [10], "FP32")
        hx.set_data_from_numpy(SCORES)
        hr = await h.infer("classify_fp32", [hx],
                           outputs=[httpaio.InferRequestedOutput("probs", class_count=4)])
        assert text(gr.as_numpy("probs")) == text(hr.as_numpy("probs")) == top(SCORES, 4, LABELS)
    finally:
        await g.close()
        await h.close()


def test_http_class_count_zero_means_none(target: Target) -> None:
    """Triton's HTTP front reads ``classification: 0`` as no classification (the raw scores);
    through a gRPC backend mmguard passed the 0 on and Triton's gRPC front refused it (400)."""
    import json
    import urllib.request

    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [10],
                                   "data": SCORES.tolist()}],
                       "outputs": [{"name": "probs", "parameters": {"classification": 0}}]})
    req = urllib.request.Request(f"http://{target.http_url}/v2/models/classify_fp32/infer",
                                 body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        out = json.loads(resp.read())["outputs"][0]
    assert out["datatype"] == "FP32" and out["shape"] == [10]
    np.testing.assert_allclose(out["data"], SCORES.tolist())
