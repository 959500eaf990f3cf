"""What one client does, or a fault does to one call, changes nothing another client gets:
through real sockets and the in-process ONNX Runtime, a faulted canary answer is never cached
and served to a production client as its last good answer; a version that does not exist
neither opens the route's breaker nor reaches a lighter level; a client's own one-microsecond
deadline and a fault on canary calls move no router weight (red team, round 3).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from onnx import TensorProto, helper

from tests.conftest import ort_config
from tests.support.mmguard import RunningMmguard
from tests.support.models import save_graph, write_identity

TOKEN = "isolation-token"
X = [1.3, 2.7, 0.4]


def _infer(m: RunningMmguard, model: str, values: list[float], version: str = "",
           headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    doc = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [len(values)],
                       "data": values}]}
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    req = urllib.request.Request(f"http://{m.http_url}{path}", data=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


def _admin(m: RunningMmguard, path: str, post: bool = False) -> Any:
    req = urllib.request.Request(m.admin_url + path, method="POST" if post else "GET",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _canary_config(ort_models: Path, models: list[dict[str, Any]]) -> dict[str, Any]:
    cfg = ort_config(ort_models)
    cfg["models"] = models
    cfg["canary"] = {"headers": {"x-canary": "1"}}
    cfg["listeners"] = {"http": {"trust_canary_headers": True}, "admin": {"token": TOKEN}}
    return cfg


def test_a_faulted_canary_answer_is_never_served_to_another_client(ort_models: Path) -> None:
    rounding = {"name": "round", "actions": [{"kind": "precision", "mode": "round",
                                              "decimals": 0, "inputs": ["INPUT0"]}]}
    cfg = _canary_config(ort_models, [{
        "name": "idf", "backend": "ort", "backend_model": "identity_fp32",
        "filters": [{"fallback": {}}, {"fault": {"experiments": [rounding]}}]}])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        status, _, clean = _infer(m, "idf", X)
        assert status == 200
        status, headers, faulted = _infer(m, "idf", X, headers={"x-canary": "1"})
        assert status == 200 and faulted["outputs"][0]["data"] == [1.0, 3.0, 0.0]
        assert "mmguard-fault" in headers  # the canary's own copy was changed, and said so
        assert _admin(m, "/admin/breakers/idf/idf/open", post=True)["state"] == "forced_open"
        status, headers, stale = _infer(m, "idf", X)  # a production client, L1 closed to it
    assert status == 200 and headers["mmguard-stale"] == "true"
    assert stale["outputs"] == clean["outputs"]  # the last good answer, not the canary's


def test_a_version_that_does_not_exist_is_the_clients_own_error(ort_models: Path) -> None:
    cfg = _canary_config(ort_models, [
        {"name": "idf", "backend": "ort", "backend_model": "identity_fp32", "filters": [
            {"fallback": {"degrade_to": ["light"], "cache": None,
                          "breaker": {"minimum_calls": 3, "failure_rate": 0.5}}}]},
        {"name": "light", "backend": "ort", "backend_model": "identity_fp32",
         "internal": True}])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        for _ in range(6):
            status, headers, doc = _infer(m, "idf", X, version="9")
            assert status == 404, doc  # not the lighter model's 200, not a breaker's 503
            assert doc["error"].startswith("Request for unknown model: ")
            assert "mmguard-fallback-level" not in headers
        breaker = next(b for b in _admin(m, "/admin/breakers") if b["level"] == "idf")
        assert breaker["state"] == "closed", breaker
        status, headers, doc = _infer(m, "idf", X)
    assert status == 200 and "mmguard-fallback-level" not in headers


def _write_renamed(model_dir: Path) -> str:
    """``light_renamed``: INPUT0 → OUT_LIGHT (a lighter model that names its output its own way)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUT_LIGHT"])], "light_renamed",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("OUT_LIGHT", TensorProto.FLOAT, ["n"])])
    save_graph(model_dir, "light_renamed", graph)
    return "light_renamed"


@pytest.mark.parametrize("asked", [["OUTPUT0"], []], ids=["outputs-asked", "all-outputs"])
def test_a_lighter_level_that_answers_other_outputs_is_skipped(
        tmp_path: Path, asked: list[str]) -> None:
    models = tmp_path / "models"
    write_identity(models, "FP32")
    cfg = _canary_config(models, [
        {"name": "idf", "backend": "ort", "backend_model": "identity_fp32", "filters": [
            {"fallback": {"degrade_to": ["light"], "cache": None}}]},
        {"name": "light", "backend": "ort", "backend_model": _write_renamed(models),
         "internal": True}])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        assert _admin(m, "/admin/breakers/idf/idf/open", post=True)["state"] == "forced_open"
        doc = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [3], "data": X}],
               "outputs": [{"name": n} for n in asked]}
        req = urllib.request.Request(f"http://{m.http_url}/v2/models/idf/infer",
                                     data=json.dumps(doc).encode())
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        with err.value:
            message = json.loads(err.value.read())["error"]
    assert err.value.code == 503  # no level could answer, not a 400 of the client's nor OUT_LIGHT
    assert "L2 'light': cannot adapt: it has no output(s) ['OUTPUT0']" in message


def _router_config(ort_models: Path, fault_on_a: bool) -> dict[str, Any]:
    abort = {"name": "abort-a", "actions": [{"kind": "abort", "http_status": 503}]}
    path_a: dict[str, Any] = {"name": "a", "backend": "ort", "backend_model": "identity_fp32",
                              "internal": True,
                              "filters": [{"fault": {"experiments": [abort]}}] if fault_on_a
                              else []}
    return _canary_config(ort_models, [
        {"name": "front", "backend": "ort", "backend_model": "identity_fp32", "filters": [
            {"modality_router": {"paths": [{"route": "a", "modalities": ["text"]},
                                           {"route": "b", "modalities": ["text"]}],
                                 "inputs": {"INPUT0": "text"}, "dwell_s": 0}}]},
        path_a,
        {"name": "b", "backend": "ort", "backend_model": "identity_fp32", "internal": True}])


@pytest.mark.parametrize("who", ["client-deadline", "canary-fault"])
def test_no_client_and_no_fault_moves_the_routers_weights(ort_models: Path, who: str) -> None:
    with RunningMmguard(_router_config(ort_models, who == "canary-fault")) as m:
        m.wait_ready()
        for _ in range(3):
            assert _infer(m, "front", X)[0] == 200
        headers = ({"mmguard-timeout-ms": "0.001"} if who == "client-deadline"
                   else {"x-canary": "1"})
        statuses = [_infer(m, "front", X, headers=headers)[0] for _ in range(20)]
        assert set(statuses) - {200} <= {504, 503} and set(statuses) != {200}, statuses
        paths = _admin(m, "/admin/routers")["front"]["paths"]
    assert {route: p["error_rate"] for route, p in paths.items()} == {"a": 0.0, "b": 0.0}


def test_answers_of_other_levels_are_counted_as_theirs(ort_models: Path) -> None:
    """An L3 answer is the cache's, not a success of the route's backend: counted under
    ``backend="(cache)"``, and the model's statistics count one execution for the one time the
    model ran (red team, round 3: four ``ok`` for ``ort`` and ``execution_count`` 4)."""
    cfg = _canary_config(ort_models, [{"name": "idf", "backend": "ort",
                                       "backend_model": "identity_fp32",
                                       "filters": [{"fallback": {}}]}])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        assert _infer(m, "idf", X)[0] == 200
        _admin(m, "/admin/breakers/idf/idf/open", post=True)
        for _ in range(3):
            status, headers, _ = _infer(m, "idf", X)
            assert status == 200 and headers["mmguard-stale"] == "true"
        metrics = urllib.request.urlopen(m.admin_url + "/metrics", timeout=10).read().decode()
        req = urllib.request.urlopen(f"http://{m.http_url}/v2/models/idf/stats", timeout=10)
        stats = json.loads(req.read())["model_stats"][0]
    assert ('mmguard_requests_total{backend="ort",code="ok",front="http",model="idf"} 1.0'
            in metrics)
    assert ('mmguard_requests_total{backend="(cache)",code="ok",front="http",model="idf"} 3.0'
            in metrics)
    assert stats["execution_count"] == 1 and stats["inference_stats"]["success"]["count"] == 4
