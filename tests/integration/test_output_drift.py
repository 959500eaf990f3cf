"""output_drift over a real Triton model whose answers lose confidence on cue: the gauges stay
near zero while answers look like the baseline, rise when the confidence changes, and the
baseline survives a restart in its file."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.cli.demo_model import tokenize
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.wire import grpc_infer_raw, grpc_request

pytestmark = pytest.mark.triton

DRIFT = {"baseline_size": 40, "window": 20, "every": 5}


def body(i: int) -> bytes:
    px = np.random.default_rng(i).random((1, 3, 224, 224), np.float32)
    return grpc_request("clip", [("pixel_values", "FP32", [1, 3, 224, 224], px.tobytes()),
                                 ("input_ids", "INT64", [1, 77],
                                  tokenize(f"photo {i % 7}")[None, :].tobytes())])


def gauges(m: RunningMmguard) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(m.admin_url + "/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "mmguard_output_drift":
            for s in family.samples:
                out[(s.labels["output"], s.labels["signal"])] = s.value
    return out


@pytest.fixture
def cue(triton: TritonServer) -> Iterator[Any]:
    path = Path(triton.repository) / "clip_demo.cue.json"
    yield lambda values: path.write_text(json.dumps(values))
    path.unlink(missing_ok=True)


def test_confidence_drift_is_seen_and_the_baseline_is_kept(triton: TritonServer, cue: Any,
                                                           tmp_path: Path) -> None:
    baseline = tmp_path / "drift.json"
    cfg = {"backends": [{"kind": "triton_grpc", "name": "triton", "url": triton.grpc_url}],
           "models": [{"name": "clip", "backend": "triton", "backend_model": "clip_demo",
                       "filters": [{"output_drift": {
                           "outputs": {"similarity": {"kind": "scalar", "output": "similarity",
                                                      "range": [-1, 1]}},
                           "drift": {**DRIFT, "baseline_file": str(baseline)}}}]}]}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        for i in range(60):  # 40 for the baseline, 20 like it
            grpc_infer_raw(m.grpc_url, body(i))
        steady = gauges(m)
        assert set(steady) == {("similarity", "confidence"), ("similarity", "cross_entropy")}
        assert steady[("similarity", "confidence")] < 0.05
        cue({"similarity": -0.9})  # the model is now sure of nothing
        for i in range(60, 80):
            grpc_infer_raw(m.grpc_url, body(i))
        drifted = gauges(m)
        assert drifted[("similarity", "confidence")] > 0.3
        assert drifted[("similarity", "cross_entropy")] > 1.0
    doc = json.loads(baseline.read_text())
    assert len(doc["series"]["similarity/confidence"]) == 40
    # a restart reads the baseline back: drift is measured from the first full window
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        for i in range(20):
            grpc_infer_raw(m.grpc_url, body(i))
        assert gauges(m)[("similarity", "confidence")] > 0.3  # still the bad model
