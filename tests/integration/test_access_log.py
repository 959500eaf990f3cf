"""Nothing per request in the logs at INFO: decisions stay in headers, metrics and spans (and a
DEBUG line); an optional sampled access log (telemetry.access_log_sample) writes one INFO line
per sampled request, decisions included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from proxy.cli.demo import image, infer_http
from proxy.cli.demo_model import tokenize
from tests.conftest import ort_config
from tests.support.process import MmguardProcess

REQUESTS = 20


def serve_and_call(tmp_path: Path, ort_models: Path, telemetry: dict[str, object]) -> list[
        dict[str, object]]:
    cfg = ort_config(ort_models, telemetry=telemetry)
    # every request gets decisions: quality scores it, the router picks a path
    cfg["models"] = [{"name": "clip_demo", "backend": "ort", "filters": [
        {"quality": {"images": {"pixel_values": {}}, "drift": None}},
        {"modality_router": {"paths": [{"route": "a"}], "dwell_s": 0,
                             "inputs": {"pixel_values": "image", "input_ids": "text"}}}]},
        {"name": "a", "backend": "ort", "backend_model": "clip_demo"}]
    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = MmguardProcess(["--config", str(path)], tmp_path / "serve.log")
    try:
        p.wait_log("mmguard serving")
        http = f"127.0.0.1:{p.ports['http']}"
        import time
        deadline = time.monotonic() + 60
        while infer_http(http, "clip_demo", image("clean"), tokenize("x")[None, :]).status \
                != 200:
            assert time.monotonic() < deadline, "never answered"
            time.sleep(0.2)
        start = len(p.records())
        for i in range(REQUESTS):
            answer = infer_http(http, "clip_demo", image("clean", seed=i),
                                tokenize(f"a red bus {i}")[None, :].astype(np.int64))
            assert answer.status == 200
            assert "mmguard-router-path" in answer.mmguard  # the decision is still in the answer
        return p.records()[start:]
    finally:
        assert p.stop() == 0


def test_no_log_line_per_request_at_info(tmp_path: Path, ort_models: Path) -> None:
    lines = serve_and_call(tmp_path, ort_models, {"log_level": "info"})
    per_request = [r for r in lines if r.get("level") == "info"]
    assert per_request == [], per_request[:3]


def test_the_sampled_access_log_writes_one_line_per_sampled_request(
        tmp_path: Path, ort_models: Path) -> None:
    lines = serve_and_call(tmp_path, ort_models, {"log_level": "info",
                                                  "access_log_sample": 1.0})
    access = [r for r in lines if r.get("logger") == "mmguard.access"]
    assert len(access) == REQUESTS
    first = access[0]
    assert first["level"] == "info" and first["code"] == "ok" and first["model"] == "clip_demo"
    assert first["front"] == "http" and isinstance(first["duration_ms"], float)
    decisions = first["decisions"]
    assert isinstance(decisions, dict) and "mmguard-router-path" in decisions
    # nothing else per request: every other INFO line is not about a request
    assert [r for r in lines if r.get("level") == "info" and r not in access] == []
