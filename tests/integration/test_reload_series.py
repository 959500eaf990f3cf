"""A reload that removes a backend and a route, and moves a route to another backend, in a real
``mmguard serve`` process: their gauge series go from ``/metrics`` (readiness, jitter, a
filter's gauge), so no alert fires on, and no dashboard shows, a backend or route that no
longer exists; what stays keeps reading true, and counters keep their totals."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_reload import (
    _config,
    _infer,
    _repo,
    _wait_count,
    _write,
    token_env,  # noqa: F401 - the admin token's fixture
)
from tests.support.adversary import http_call, serve
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
