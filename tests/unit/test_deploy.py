"""deploy/: manifests parse, every mmguard config in them is valid, probes and ports match what
mmguard serves, the shutdown timing fits, and every metric the dashboard and the alert rules
name is one a real running mmguard exports (read from its /metrics, not from a list)."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.cli import main as cli_main
from proxy.config import Config, parse_config
from proxy.demo_model import tokenize
from tests.conftest import ort_config
from tests.support.mmguard import RunningMmguard
from tests.support.wire import grpc_infer_raw, grpc_request

DEPLOY = Path(__file__).parents[2] / "deploy"
YAMLS = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
METRIC = re.compile(r"mmguard_[a-z0-9_]+")


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_docs() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in YAMLS:
        for d in docs(path):
            yield path, d


def mmguard_configs() -> list[tuple[str, str]]:
    """(where, YAML text) of every mmguard config held in a ConfigMap under deploy/."""
    found = []
    for path, d in all_docs():
        if d.get("kind") == "ConfigMap":
            for key, text in d.get("data", {}).items():
                if key.endswith((".yaml", ".yml")):
                    found.append((f"{path.relative_to(DEPLOY)}:{key}", text))
    return found


def find(kind: str, path: Path) -> dict[str, Any]:
    (found,) = [d for d in docs(path) if d.get("kind") == kind]
    assert isinstance(found, dict)
    return dict(found)


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return dict(found)


def port_number(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (found,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    return int(found)


def config_of(path: Path) -> Config:
    cm = find("ConfigMap", path)
    return parse_config(yaml.safe_load(cm["data"]["mmguard.yaml"]))


def pre_stop_sleep(c: dict[str, Any]) -> float:
    cmd = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return float(cmd[1]) if cmd[:1] == ["sleep"] else 0.0


# --- manifests --------------------------------------------------------------------------------

def test_the_expected_assets_exist() -> None:
    names = {str(p.relative_to(DEPLOY)) for p in YAMLS}
    assert {"k8s/base/kustomization.yaml", "k8s/base/deployment.yaml",
            "k8s/base/configmap.yaml", "k8s/base/service.yaml", "k8s/base/podmonitor.yaml",
            "k8s/overlays/production/kustomization.yaml",
            "k8s/overlays/canary/kustomization.yaml", "kserve/inferenceservice.yaml",
            "prometheus/alerts.yaml"} <= names
    assert (DEPLOY / "grafana" / "mmguard-dashboard.json").is_file()


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses(path: Path) -> None:
    parsed = docs(path)
    assert parsed
    for d in parsed:
        assert isinstance(d, dict)
        assert "kind" in d and ("apiVersion" in d or d["kind"] == "Kustomization"), path


def test_kustomizations_name_files_that_exist() -> None:
    for path in DEPLOY.rglob("kustomization.yaml"):
        k = yaml.safe_load(path.read_text())
        for ref in k.get("resources", []):
            assert (path.parent / ref).exists(), f"{path}: {ref}"
        for patch in k.get("patches", []):
            if "path" in patch:
                assert (path.parent / patch["path"]).is_file(), f"{path}: {patch['path']}"


def test_there_are_mmguard_configs_in_base_canary_and_kserve() -> None:
    where = [w for w, _ in mmguard_configs()]
    assert any(w.startswith("k8s/base/") for w in where)
    assert any(w.startswith("k8s/overlays/canary/") for w in where)
    assert any(w.startswith("kserve/") for w in where)


@pytest.mark.parametrize("where,text", mmguard_configs(), ids=[w for w, _ in mmguard_configs()])
def test_every_configmap_config_passes_check_config(where: str, text: str,
                                                    tmp_path: Path) -> None:
    cfg = parse_config(yaml.safe_load(text), where)
    assert cfg.models
    file = tmp_path / "mmguard.yaml"
    file.write_text(text)
    assert cli_main(["check-config", str(file)]) == 0


def test_the_canary_is_labelled_and_has_its_own_config() -> None:
    k = yaml.safe_load((DEPLOY / "k8s/overlays/canary/kustomization.yaml").read_text())
    assert any(lab["pairs"].get("track") == "canary" for lab in k["labels"])
    patch = find("ConfigMap", DEPLOY / "k8s/overlays/canary/configmap-patch.yaml")
    base = find("ConfigMap", DEPLOY / "k8s/base/configmap.yaml")
    assert patch["metadata"]["name"] == base["metadata"]["name"]
    assert patch["data"]["mmguard.yaml"] != base["data"]["mmguard.yaml"]


def test_the_sidecar_pod_runs_triton_and_mmguard() -> None:
    dep = find("Deployment", DEPLOY / "k8s/base/deployment.yaml")
    pod = dep["spec"]["template"]["spec"]
    triton = container(pod, "triton")
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:[\w.]+-py3", triton["image"])
    assert any(m["mountPath"] == "/models" for m in triton["volumeMounts"])
    mm = container(pod, "mmguard")
    assert mm["image"] == "mmguard:latest"
    assert mm["args"] == ["serve", "--config", "/etc/mmguard/mmguard.yaml"]
    # the image's entrypoint is the bare CLI, so args begin with the subcommand
    assert 'ENTRYPOINT ["mmguard"]' in (DEPLOY / "Dockerfile").read_text()
    mount = next(m for m in mm["volumeMounts"] if m["mountPath"] == "/etc/mmguard")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = find("ConfigMap", DEPLOY / "k8s/base/configmap.yaml")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    for c in (triton, mm):
        assert c["resources"]["requests"] and c["resources"]["limits"]
    # mmguard reaches Triton's gRPC port over localhost
    cfg = config_of(DEPLOY / "k8s/base/configmap.yaml")
    assert {b.url for b in cfg.backends if b.kind == "triton_grpc"} == {"127.0.0.1:8001"}


def test_probes_and_ports_match_the_config() -> None:
    """Readiness on the HTTP listener, liveness on the admin listener (bound to 0.0.0.0: the
    kubelet probes the pod IP), in the Deployment and in the KServe example."""
    deployment = find("Deployment", DEPLOY / "k8s/base/deployment.yaml")
    isvc = find("InferenceService", DEPLOY / "kserve/inferenceservice.yaml")
    cases = [(deployment["spec"]["template"]["spec"], "mmguard",
              DEPLOY / "k8s/base/configmap.yaml"),
             (isvc["spec"]["predictor"], "mmguard", DEPLOY / "kserve/inferenceservice.yaml")]
    for pod, name, cfg_path in cases:
        mm, cfg = container(pod, name), config_of(cfg_path)
        ready, live = mm["readinessProbe"]["httpGet"], mm["livenessProbe"]["httpGet"]
        assert ready["path"] == "/v2/health/ready"
        assert port_number(mm, ready["port"]) == cfg.listeners.http.port
        assert live["path"] == "/healthz"
        assert port_number(mm, live["port"]) == cfg.listeners.admin.port
        assert cfg.listeners.admin.host == "0.0.0.0"
        declared = {p["containerPort"] for p in mm["ports"]}
        assert cfg.listeners.http.port in declared


def test_service_exposes_data_ports_but_not_admin() -> None:
    svc = find("Service", DEPLOY / "k8s/base/service.yaml")
    dep = find("Deployment", DEPLOY / "k8s/base/deployment.yaml")
    mm = container(dep["spec"]["template"]["spec"], "mmguard")
    cfg = config_of(DEPLOY / "k8s/base/configmap.yaml")
    targets = {port_number(mm, p["targetPort"]) for p in svc["spec"]["ports"]}
    assert targets == {cfg.listeners.http.port, cfg.listeners.grpc.port}
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_podmonitor_scrapes_the_admin_metrics_port() -> None:
    pm = find("PodMonitor", DEPLOY / "k8s/base/podmonitor.yaml")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    dep = find("Deployment", DEPLOY / "k8s/base/deployment.yaml")
    mm = container(dep["spec"]["template"]["spec"], "mmguard")
    cfg = config_of(DEPLOY / "k8s/base/configmap.yaml")
    ep = next(e for e in pm["spec"]["podMetricsEndpoints"] if e["path"] == "/metrics"
              and port_number(mm, e["port"]) == cfg.listeners.admin.port)
    assert ep
    assert pm["spec"]["selector"]["matchLabels"].items() <= \
        dep["spec"]["template"]["metadata"]["labels"].items()


def test_termination_grace_outlasts_the_drain() -> None:
    """The kubelet's SIGKILL must come after mmguard's preStop + shutdown_grace_s, and Triton
    must keep serving until mmguard has drained, for every config the pod may run."""
    dep = find("Deployment", DEPLOY / "k8s/base/deployment.yaml")
    pod = dep["spec"]["template"]["spec"]
    mm, triton = container(pod, "mmguard"), container(pod, "triton")
    configs = [config_of(DEPLOY / "k8s/base/configmap.yaml"),
               config_of(DEPLOY / "k8s/overlays/canary/configmap-patch.yaml")]
    isvc = find("InferenceService", DEPLOY / "kserve/inferenceservice.yaml")["spec"]["predictor"]
    cases = [(pod, mm, triton, c) for c in configs]
    cases.append((isvc, container(isvc, "mmguard"), container(isvc, "kserve-container"),
                  config_of(DEPLOY / "kserve/inferenceservice.yaml")))
    for spec, m, t, cfg in cases:
        drain = pre_stop_sleep(m) + cfg.shutdown_grace_s
        assert spec["terminationGracePeriodSeconds"] > cfg.shutdown_grace_s
        assert spec["terminationGracePeriodSeconds"] > drain
        assert pre_stop_sleep(t) >= drain


# --- metrics named in the dashboard and the alert rules ---------------------------------------

def dashboard_exprs() -> list[str]:
    out: list[str] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)
        elif isinstance(o, str) and "mmguard_" in o:
            out.append(o)

    walk(json.loads((DEPLOY / "grafana" / "mmguard-dashboard.json").read_text()))
    return out


def alert_exprs() -> list[str]:
    rule = find("PrometheusRule", DEPLOY / "prometheus" / "alerts.yaml")
    return [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]


SMALL_DRIFT = {"baseline_size": 2, "window": 2, "every": 1}


@pytest.fixture(scope="module")
def exported(ort_models: Path) -> Iterator[tuple[set[str], RunningMmguard]]:
    """The series names a real mmguard exports, with every filter that has metrics in use.
    Queryable names: counters as <name>_total, histograms as _bucket/_count/_sum, gauges bare."""
    cfg = ort_config(ort_models)
    inputs = {"pixel_values": "image", "input_ids": "text"}
    cfg["models"] = [
        {"name": "guarded", "backend": "ort", "backend_model": "clip_demo", "filters": [
            {"limits": {"max_in_flight": 8, "max_batch": 8}},
            {"shape_guard": {"on_batch": "split"}},
            {"quality": {"images": {"pixel_values": {}}, "drift": SMALL_DRIFT}},
            {"fallback": {"degrade_to": ["clip_b"]}},
            {"output_drift": {"outputs": {"similarity": {"kind": "scalar", "output": "similarity",
                                                         "range": [-1, 1]}},
                              "drift": {"baseline_size": 2, "window": 2, "every": 1}}}]},
        {"name": "routed", "backend": "ort", "backend_model": "clip_demo", "filters": [
            {"modality_router": {"paths": [{"route": "clip_a"}, {"route": "clip_b"}],
                                 "inputs": inputs, "dwell_s": 0}}]},
        {"name": "clip_a", "backend": "ort", "backend_model": "clip_demo", "filters": [
            {"shadow": {"canary": "clip_b"}}]},
        {"name": "clip_b", "backend": "ort", "backend_model": "clip_demo", "filters": [
            {"fault": {"experiments": [{"name": "noop", "actions": [{"kind": "delay",
                                                                      "ms": 0}]}]}}]},
    ]
    cfg["canary"] = {"share": 1.0}  # every call is canary: the experiment's metrics appear
    rng = np.random.default_rng(0)
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        for i in range(4):
            for route in ("guarded", "routed"):
                px = rng.random((1, 3, 224, 224), np.float32)
                grpc_infer_raw(m.grpc_url, grpc_request(route, [
                    ("pixel_values", "FP32", [1, 3, 224, 224], px.tobytes()),
                    ("input_ids", "INT64", [1, 77], tokenize(f"a red bus {i}")[None, :]
                     .tobytes())]))
        text = urllib.request.urlopen(m.admin_url + "/metrics", timeout=10).read().decode()
        names: set[str] = set()
        for family in text_string_to_metric_families(text):
            if family.type == "counter":
                names.add(family.name + "_total")
            elif family.type == "histogram":
                names.update(family.name + s for s in ("_bucket", "_count", "_sum"))
            else:
                names.add(family.name)
        yield names, m


def test_the_running_mmguard_exports_every_filter_metric(
        exported: tuple[set[str], RunningMmguard]) -> None:
    names, _ = exported
    assert {"mmguard_requests_total", "mmguard_request_duration_seconds_bucket",
            "mmguard_breaker_state", "mmguard_fallback_answers_total", "mmguard_input_drift",
            "mmguard_router_weight", "mmguard_filter_decisions_total",
            "mmguard_time_to_first_token_seconds_bucket"} <= names


def test_every_dashboard_metric_is_exported(exported: tuple[set[str], RunningMmguard]) -> None:
    names, _ = exported
    used = {n for e in dashboard_exprs() for n in METRIC.findall(e)}
    assert used and used <= names, sorted(used - names)
    # the panels the dashboard promises
    assert {"mmguard_requests_total", "mmguard_request_duration_seconds_bucket",
            "mmguard_backend_duration_seconds_bucket", "mmguard_requests_in_flight",
            "mmguard_breaker_state", "mmguard_fallback_answers_total",
            "mmguard_filter_decisions_total", "mmguard_input_drift", "mmguard_router_weight",
            "mmguard_tokens_total", "mmguard_time_to_first_token_seconds_bucket"} <= used


def test_every_alert_metric_is_exported(exported: tuple[set[str], RunningMmguard]) -> None:
    names, _ = exported
    used = {n for e in alert_exprs() for n in METRIC.findall(e)}
    assert used and used <= names, sorted(used - names)
    assert {"mmguard_requests_total", "mmguard_request_duration_seconds_bucket",
            "mmguard_breaker_state", "mmguard_input_drift", "mmguard_fallback_answers_total",
            "mmguard_backend_ready"} <= used


def test_alert_thresholds_follow_the_seeds() -> None:
    rule = find("PrometheusRule", DEPLOY / "prometheus" / "alerts.yaml")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert alerts["MmguardInputDriftWarning"]["expr"].strip().endswith("> 0.15")
    assert alerts["MmguardInputDriftCritical"]["expr"].strip().endswith("> 0.28")
    assert "mmguard_backend_ready == 0" in alerts["MmguardBackendNotReady"]["expr"]
    assert 'level="3"' in alerts["MmguardFallbackLevel3High"]["expr"]
    for a in alerts.values():
        assert a["labels"]["severity"] in ("critical", "warning", "info")


def test_the_probe_paths_answer_on_a_running_mmguard(
        exported: tuple[set[str], RunningMmguard]) -> None:
    _, m = exported
    status, _, _ = http_get(f"http://{m.http_url}/v2/health/ready")
    assert status == 200
    status, _, body = http_get(f"{m.admin_url}/healthz")
    assert status == 200 and json.loads(body) == {"live": True}


def http_get(url: str) -> tuple[int, dict[str, str], bytes]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, dict(r.headers), r.read()
