"""The silent-degradation alarm on a real Triton whose similarity output drifts on cue
(clip_demo's cue file): nothing errors, the answers keep coming, and the alarm trips once the
window's mean is 0.18 below its baseline — a metric, a decision header on the answer that
tripped it, a log line — and then sends the calls to the configured route (ONNX Runtime)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy.cli.demo_model import tokenize
from proxy.pb import grpc_service_pb2 as pb
from tests.conftest import ort_config
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.wire import grpc_infer_raw, grpc_request

BODY = grpc_request("clip", [
    ("pixel_values", "FP32", [1, 3, 224, 224],
     np.random.default_rng(5).random((1, 3, 224, 224), np.float32).tobytes()),
    ("input_ids", "INT64", [1, 77], tokenize("a photo of a dog")[None, :].tobytes())])


@pytest.fixture
def cue(triton: TritonServer) -> Iterator[Any]:
    path = Path(triton.repository) / "clip_demo.cue.json"

    def set_cue(values: dict[str, Any]) -> None:
        path.write_text(json.dumps(values))

    yield set_cue
    path.unlink(missing_ok=True)


def similarity(body: bytes) -> float:
    r = pb.ModelInferResponse.FromString(body)
    i = [o.name for o in r.outputs].index("similarity")
    return float(np.frombuffer(r.raw_output_contents[i], np.float32)[0])


@pytest.mark.triton
def test_the_alarm_trips_on_a_drifting_similarity_and_routes_away(
        ort_models: Path, triton: TritonServer, cue: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = ort_config(ort_models)
    cfg["backends"].append({"kind": "triton_grpc", "name": "triton", "url": triton.grpc_url})
    cfg["models"] = [
        {"name": "clip", "backend": "triton", "backend_model": "clip_demo",
         "filters": [{"output_drift": {"similarity_alarm": {
             "action": "route_away", "reroute_to": "clip_backup"}}}]},
        {"name": "clip_backup", "backend": "ort", "backend_model": "clip_demo"}]
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        clean = [similarity(grpc_infer_raw(m.grpc_url, BODY)[0]) for _ in range(32)]
        base = clean[0]
        assert all(s == base for s in clean)  # a steady baseline: no alarm
        metrics = urllib.request.urlopen(m.admin_url + "/metrics").read().decode()
        assert 'mmguard_similarity_alarm{model="clip"} 0.0' in metrics
        cue({"similarity": base - 0.2})  # the replica degrades silently: answers, lower scores
        headers = []
        for _ in range(40):
            body, trailers = grpc_infer_raw(m.grpc_url, BODY)
            headers.append(dict(trailers).get("mmguard-degradation", ""))
        tripped = [i for i, h in enumerate(headers) if h.startswith("alarm;")]
        # 0.2 lower on k of 32 scores: the mean is 0.18 below after k = 29 (variance stays
        # under 0.02: at most 0.25 · 0.2² = 0.01)
        assert tripped == [28], headers
        assert "below its baseline" in headers[28] and "max drop 0.18" in headers[28]
        assert all(h == "" for h in headers[:28])
        assert all(h.startswith("routed-away; to 'clip_backup'") for h in headers[29:])
        # routed away: the backup (ONNX Runtime, the same model) answers, undegraded
        body, _ = grpc_infer_raw(m.grpc_url, BODY)
        assert abs(similarity(body) - base) < 1e-5
        metrics = urllib.request.urlopen(m.admin_url + "/metrics").read().decode()
        assert 'mmguard_similarity_alarm{model="clip"} 1.0' in metrics
        assert 'mmguard_similarity_alarms_total{model="clip",reason="drop"} 1.0' in metrics
        lines = [r for r in caplog.records if r.name == "mmguard.degradation"]
        assert len(lines) == 1 and lines[0].levelname == "WARNING"
        assert "below its baseline" in lines[0].getMessage()
