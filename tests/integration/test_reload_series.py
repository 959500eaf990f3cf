"""A reload that removes a backend and a route, and moves a route to another backend, in a real
``mmguard serve`` process: their gauge series go from ``/metrics`` (readiness, jitter, a
filter's gauge), so no alert fires on, and no dashboard shows, a backend or route that no
longer exists; what stays keeps reading true, and counters keep their totals."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from filters.fallback.admin import BREAKERS
from filters.fallback.breaker import State
from tests.integration.test_reload import (
    _config,
    _infer,
    _repo,
    _wait_count,
    _write,
    token_env,  # noqa: F401 - the admin token's fixture
)
from tests.support.adversary import http_call, serve
from tests.support.mmguard import RunningMmguard
from tests.support.process import MmguardProcess


def _series(proc: MmguardProcess, metric: str) -> dict[str, float]:
    """``{labels: value}`` of one metric on the admin port's ``/metrics``, its labels in name
    order (``a="x",b="y"``)."""
    _, _, body = http_call(proc.ports["admin"], "GET", "/metrics")
    return {",".join(sorted(m[1].split(","))): float(m[2]) for m in re.finditer(
        rf"^{metric}\{{([^}}]*)\}} (\S+)$", body.decode(), re.MULTILINE)}


def _wait_series(proc: MmguardProcess, metric: str, want: dict[str, float]) -> None:
    deadline = time.monotonic() + 60
    while (got := _series(proc, metric)) != want:
        assert time.monotonic() < deadline, (metric, got, want)
        time.sleep(0.1)


def _with_routes(models: Path) -> dict[str, Any]:
    cfg = _config(models, "kept", watch_config_s=0.5, shutdown_grace_s=0.5)
    cfg["backends"].append({"kind": "onnxruntime", "name": "spare", "model_dir": str(models)})
    cfg["models"] += [
        {"name": "echo", "backend": "spare", "backend_model": "identity_fp32",
         "filters": [{"fault": {"experiments": [{"name": "gone", "actions": [
             {"kind": "delay", "ms": 0}]}]}}]},
        {"name": "moved", "backend": "spare", "backend_model": "identity_fp32"}]
    return cfg


@pytest.mark.usefixtures("token_env")
def test_a_reload_deletes_the_series_of_what_it_removed(tmp_path: Path) -> None:
    models = _repo(tmp_path / "models")
    cfg = _with_routes(models)
    with serve(tmp_path, cfg) as proc:
        for route in ("identity_fp32", "echo", "moved"):
            assert _infer(proc, route)[0] == 200
        _wait_series(proc, "mmguard_backend_ready", {'backend="ort"': 1, 'backend="spare"': 1})
        _wait_series(proc, "mmguard_route_ready", {
            'backend="ort",model="identity_fp32"': 1, 'backend="spare",model="echo"': 1,
            'backend="spare",model="moved"': 1})
        assert _series(proc, "mmguard_experiment_running") == {
            'experiment="kept",route="identity_fp32"': 1, 'experiment="gone",route="echo"': 1}
        assert set(_series(proc, "mmguard_latency_jitter_coefficient")) == {
            'model="identity_fp32"', 'model="echo"', 'model="moved"'}

        cfg["backends"] = [b for b in cfg["backends"] if b["name"] != "spare"]
        cfg["models"] = [m for m in cfg["models"] if m["name"] != "echo"]
        cfg["models"][-1]["backend"] = "ort"  # moved: spare -> ort
        _write(tmp_path / "mmguard.yaml", cfg)
        _wait_count(proc, "config reloaded from", 1)
        assert _infer(proc, "moved")[0] == 200

        _wait_series(proc, "mmguard_backend_ready", {'backend="ort"': 1})
        _wait_series(proc, "mmguard_route_ready", {
            'backend="ort",model="identity_fp32"': 1, 'backend="ort",model="moved"': 1})
        _wait_series(proc, "mmguard_experiment_running",
                     {'experiment="kept",route="identity_fp32"': 1})
        assert set(_series(proc, "mmguard_latency_jitter_coefficient")) == {
            'model="identity_fp32"', 'model="moved"'}
        # counters keep what they counted: echo's answer happened
        assert _series(proc, "mmguard_requests_total").get(
            'backend="spare",code="ok",front="http",model="echo"') == 1
        # the old runtime closed (a readiness pass it was running may write): nothing came back
        _wait_count(proc, "the previous runtime retired", 1)
        assert set(_series(proc, "mmguard_backend_ready")) == {'backend="ort"'}
        assert set(_series(proc, "mmguard_route_ready")) == {
            'backend="ort",model="identity_fp32"', 'backend="ort",model="moved"'}


def _gauges(m: RunningMmguard) -> dict[str, dict[str, float]]:
    body = urllib.request.urlopen(m.admin_url + "/metrics", timeout=10).read().decode()
    found: dict[str, dict[str, float]] = {}
    for name in ("mmguard_breaker_state", "mmguard_breaker_status", "mmguard_router_weight",
                 "mmguard_backend_ready", "mmguard_route_ready"):
        found[name] = {m_[1]: float(m_[2]) for m_ in re.finditer(
            rf"^{name}\{{([^}}]*)\}} (\S+)$", body, re.MULTILINE)}
    return found


def test_a_rejected_reload_writes_nothing_over_the_serving_series(tmp_path: Path) -> None:
    """A reload whose replaced backend cannot start is rejected: the serving runtime's breaker
    (forced open), router weights (learned) and readiness (ready) read on ``/metrics`` as
    before it, not as the candidate that was built and thrown away (red team, round 3: every
    breaker read closed, every weight 0.5 and every backend and route not ready)."""
    models = _repo(tmp_path / "models")
    broken = tmp_path / "broken" / "identity_fp32" / "1"
    broken.mkdir(parents=True)
    (broken / "model.onnx").write_bytes(b"not an onnx model")

    def config(model_dir: Path) -> dict[str, Any]:
        return {"backends": [{"kind": "onnxruntime", "name": "ort",
                              "model_dir": str(model_dir)}],
                "models": [
                    {"name": "identity_fp32", "backend": "ort", "filters": [{"fallback": {}}]},
                    {"name": "other", "backend": "ort", "backend_model": "identity_fp32"},
                    {"name": "routed", "backend": "ort", "backend_model": "identity_fp32",
                     "filters": [{"modality_router": {
                         "paths": [{"route": "identity_fp32", "modalities": ["text"]},
                                   {"route": "other", "modalities": ["text"]}],
                         "inputs": {"INPUT0": "text"}, "dwell_s": 0}}]}]}

    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump(config(models)))
    with RunningMmguard(config(models), config_path=path) as m:
        m.wait_ready()
        assert m.server is not None
        m.server.backend_start_s = 1.0
        breakers = m.server.plane.runtime.local.get(BREAKERS)
        assert breakers is not None
        breaker = breakers[("identity_fp32", "identity_fp32")]

        async def force_open() -> None:  # on the server's loop, as the admin API does it
            breaker.force("open")

        m.run(force_open())
        doc = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1],
                                      "data": [1.0]}]}).encode()
        for _ in range(8):  # the router learns the first path fails (its breaker is open)
            http_call(int(m.http_url.rsplit(":", 1)[1]), "POST", "/v2/models/routed/infer",
                      doc, {"Content-Type": "application/json"})
        before = _gauges(m)
        assert float(State.FORCED_OPEN) in before["mmguard_breaker_state"].values()
        assert set(before["mmguard_router_weight"].values()) != {0.5}
        path.write_text(yaml.safe_dump(config(tmp_path / "broken")))
        outcome = m.run(m.server.reload())
        assert not outcome.applied, outcome.message
        after = _gauges(m)
    assert after == before
