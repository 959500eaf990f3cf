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

from proxy.cli.demo_model import tokenize
from proxy.cli.main import main as cli_main
from proxy.config.model import Config, parse_config
from tests.conftest import ort_config
from tests.support.mmguard import RunningMmguard
from tests.support.wire import grpc_infer_raw, grpc_request

DEPLOY = Path(__file__).parents[2] / "deploy"
PROMTOOL_TESTS = DEPLOY / "prometheus" / "tests"
YAMLS = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml")
               and PROMTOOL_TESTS not in p.parents)
TOKEN_FILE = "/var/run/secrets/mmguard/admin-token"
IMAGE = re.compile(r"[a-z0-9.-]+\.[a-z]+(:[0-9]+)?/[a-z0-9/_.-]+:[\w.-]+")
"""An image with a registry host (a dot in its first part), a path and a tag."""
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
    """The ConfigMap's mmguard config; the admin token file (a Secret in the pod) is stood in
    for by a readable, non-empty file here (this module)."""
    cm = find("ConfigMap", path)
    return parse_config(yaml.safe_load(cm["data"]["mmguard.yaml"].replace(TOKEN_FILE,
                                                                            __file__)))


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
def test_every_configmap_config_passes_check_config(where: str, text: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """As shipped, unmodified: offline, everything but the pod's own files is checked (and
    named as not checked); without --offline the missing Secret file is what fails."""
    file = tmp_path / "mmguard.yaml"
    file.write_text(text)
    assert cli_main(["check-config", "--offline", str(file)]) == 0
    out = capsys.readouterr().out
    assert f"offline, not checked: token_file {TOKEN_FILE}" in out
    assert cli_main(["check-config", str(file)]) == 1
    assert f"token_file: cannot read {TOKEN_FILE}" in capsys.readouterr().err
    # and with the Secret's file where the pod has it, the full check passes
    token = tmp_path / "admin-token"
    token.write_text("s3cret-token\n")
    file.write_text(text.replace(TOKEN_FILE, str(token)))
    assert cli_main(["check-config", str(file)]) == 0


@pytest.mark.parametrize("where,text", mmguard_configs(), ids=[w for w, _ in mmguard_configs()])
def test_every_config_reads_the_admin_token_from_a_secret_file(where: str, text: str) -> None:
    """Every config that opens the admin API to the pod network guards it with a token, and
    the token is never in the ConfigMap itself."""
    admin = yaml.safe_load(text)["listeners"]["admin"]
    assert admin["host"] == "0.0.0.0"
    assert admin.get("token_file") == TOKEN_FILE, where
    assert "token" not in admin


def pods_that_run_mmguard() -> list[tuple[str, dict[str, Any]]]:
    out = [("k8s/base", find("Deployment", DEPLOY / "k8s/base/deployment.yaml")["spec"]
            ["template"]["spec"])]
    for name in ("inferenceservice.yaml", "inferenceservice-serverless.yaml"):
        out.append((name, find("InferenceService", DEPLOY / "kserve" / name)["spec"]
                    ["predictor"]))
    return out


@pytest.mark.parametrize("where,pod", pods_that_run_mmguard(), ids=lambda x: str(x)[:30])
def test_the_admin_token_secret_is_mounted_where_the_config_reads_it(
        where: str, pod: dict[str, Any]) -> None:
    mm = container(pod, "mmguard")
    mount = next(m for m in mm["volumeMounts"] if m["mountPath"] == str(Path(TOKEN_FILE).parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "mmguard-admin-token"
    assert {"key": "admin-token", "path": Path(TOKEN_FILE).name} in volume["secret"]["items"]
    assert "optional" not in volume["secret"]  # no Secret, no pod: never an open admin API


@pytest.mark.parametrize("where,pod", pods_that_run_mmguard(), ids=lambda x: str(x)[:30])
def test_every_image_names_its_registry(where: str, pod: dict[str, Any]) -> None:
    for c in pod["containers"]:
        assert IMAGE.fullmatch(c["image"]), (where, c["name"], c["image"])


def test_the_serverless_kserve_variant_is_what_knative_accepts() -> None:
    raw = find("InferenceService", DEPLOY / "kserve/inferenceservice.yaml")
    serverless = find("InferenceService", DEPLOY / "kserve/inferenceservice-serverless.yaml")
    mode = "serving.kserve.io/deploymentMode"
    assert raw["metadata"]["annotations"][mode] == "RawDeployment"
    assert serverless["metadata"]["annotations"][mode] == "Serverless"
    pred = serverless["spec"]["predictor"]
    assert "terminationGracePeriodSeconds" not in pred
    assert all("lifecycle" not in c for c in pred["containers"])
    assert sum(len(c.get("ports", [])) for c in pred["containers"]) == 1
    mm = container(pred, "mmguard")
    for probe in ("readinessProbe", "livenessProbe"):  # Knative allows the serving port only
        assert mm[probe]["httpGet"]["port"] == mm["ports"][0]["containerPort"]
    cfg = config_of(DEPLOY / "kserve/inferenceservice-serverless.yaml")
    assert mm["ports"][0]["containerPort"] == cfg.listeners.http.port
    # Knative gives the pod the revision timeout (300 s default) to drain; mmguard's is shorter
    assert cfg.shutdown_grace_s < 300


def test_the_shared_memory_overlay_mounts_dev_shm_in_both_containers() -> None:
    patch = find("Deployment", DEPLOY / "k8s/overlays/shared-memory/shm-patch.yaml")
    pod = patch["spec"]["template"]["spec"]
    mm = container(pod, "mmguard")
    assert {"name": "dshm", "mountPath": "/dev/shm"} in mm["volumeMounts"]
    (volume,) = pod["volumes"]
    assert volume["emptyDir"]["medium"] == "Memory"
    base = find("Deployment", DEPLOY / "k8s/base/deployment.yaml")["spec"]["template"]["spec"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(base, "triton")["volumeMounts"]


def test_the_release_label_is_one_kustomize_value() -> None:
    k = yaml.safe_load((DEPLOY / "k8s/base/kustomization.yaml").read_text())
    (rep,) = k["replacements"]
    assert rep["source"] == {"kind": "ConfigMap", "name": "mmguard-monitoring",
                             "fieldPath": "data.release"}
    kinds = {t["select"]["kind"] for t in rep["targets"]}
    assert kinds == {"PodMonitor", "PrometheusRule"}
    assert all(t["fieldPaths"] == ["metadata.labels.release"] for t in rep["targets"])
    settings = find("ConfigMap", DEPLOY / "k8s/base/monitoring.yaml")
    assert settings["metadata"]["annotations"]["config.kubernetes.io/local-config"] == "true"


def test_the_image_pins_every_runtime_dependency() -> None:
    """deploy/requirements.lock pins (==) every dependency pyproject.toml names for the image."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r).name for r in project["dependencies"]
              + project["optional-dependencies"]["cpu"]]
    lock = {}
    for line in (DEPLOY / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            lock[re.sub(r"[-_.]+", "-", name).lower()] = version
    for name in wanted:
        assert lock.get(re.sub(r"[-_.]+", "-", name).lower()), f"{name} is not pinned"
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "--requirement requirements.lock" in dockerfile and "--no-deps ." in dockerfile
    assert re.search(r"pip install --no-cache-dir pip==[0-9.]+", dockerfile)
    ignore = (DEPLOY.parent / ".dockerignore").read_text().split()
    assert ignore[ignore.index("**") + 1:].count("!deploy/requirements.lock") == 1


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
    assert IMAGE.fullmatch(mm["image"]) and "/mmguard:" in mm["image"]
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
        elif isinstance(o, str) and ("mmguard_" in o or "mmguard:" in o):
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
                              "drift": {"baseline_size": 2, "window": 2, "every": 1},
                              "similarity_alarm": {}}}]},
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
            "mmguard_breaker_status", "mmguard_fallback_answers_total",
            "mmguard_filter_decisions_total", "mmguard_input_drift", "mmguard_router_weight",
            "mmguard_tokens_total", "mmguard_time_to_first_token_seconds_bucket"} <= used


def test_every_alert_metric_is_exported(exported: tuple[set[str], RunningMmguard]) -> None:
    names, _ = exported
    used = {n for e in alert_exprs() for n in METRIC.findall(e)}
    assert used and used <= names, sorted(used - names)
    assert {"mmguard_requests_total", "mmguard_request_duration_seconds_bucket",
            "mmguard_breaker_status", "mmguard_input_drift", "mmguard_fallback_answers_total",
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


# --- one definition of an error, states that aggregate, the series mmguard exports ------------

CODE_FILTER = re.compile(r'code!~"([^"]+)"')


def recording_rules() -> dict[str, str]:
    rule = find("PrometheusRule", DEPLOY / "prometheus" / "alerts.yaml")
    return {r["record"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]
            if "record" in r}


def test_one_definition_of_an_error_for_rules_dashboard_and_fleet() -> None:
    from proxy.errors import ErrorKind

    rules = recording_rules()
    defs = {m for e in rules.values() for m in CODE_FILTER.findall(e)}
    (definition,) = defs  # every recording rule uses the same code regex
    not_errors = set(definition.split("|"))
    assert not_errors <= {k.value for k in ErrorKind} | {"ok", "injected"}
    assert {"unavailable", "deadline_exceeded", "internal", "overloaded"}.isdisjoint(not_errors)
    # the alerts read the recording rules, never a regex of their own
    assert not any(CODE_FILTER.search(e) for e in alert_exprs() if e not in rules.values())
    # the dashboard reads the same recording rule, and names no code list of its own
    used = " ".join(dashboard_exprs())
    assert "mmguard:request_error_ratio:rate5m" in used and not CODE_FILTER.search(used)
    assert set(re.findall(r"mmguard:[a-z0-9_:]+", used)) <= set(rules)
    # the fleet templates repeat it (they select canary pods, which the rules do not group by)
    fleet = [q for p in sorted((DEPLOY / "fleet").glob("*.yaml")) for d in docs(p)
             for q in _queries(d)]
    assert fleet and {m for q in fleet for m in CODE_FILTER.findall(q)} == {definition}


def _queries(d: dict[str, Any]) -> list[str]:
    if d.get("kind") == "MetricTemplate":
        return [d["spec"]["query"]]
    if d.get("kind") == "AnalysisTemplate":
        return [m["provider"]["prometheus"]["query"] for m in d["spec"]["metrics"]]
    return []


def test_error_ratios_fall_back_to_zero_when_a_track_has_no_errors() -> None:
    for name, expr in recording_rules().items():
        if name.startswith("mmguard:request_error_ratio:"):
            assert "or 0 * sum by (namespace, track, model) (rate(mmguard_requests_total" in expr


def test_states_are_never_aggregated_as_numbers() -> None:
    """A numeric state gauge (0 closed, 1 open, 3 forced open...) means nothing once max()ed or
    summed across pods: the panels and alerts read the one-hot *_status gauges."""
    used = dashboard_exprs() + alert_exprs()
    assert not any(re.search(r"mmguard_(breaker_state|shadow_verdict)\b(?!_)", e) for e in used)
    assert any("mmguard_breaker_status" in e for e in used)
    assert any("mmguard_shadow_verdict_status" in e for e in used)


def test_the_metrics_page_has_process_metrics_zeroes_and_no_created_series(
        exported: tuple[set[str], RunningMmguard]) -> None:
    _, m = exported
    text = urllib.request.urlopen(m.admin_url + "/metrics", timeout=10).read().decode()
    assert "_created" not in text
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes",
                 "process_open_fds"):
        assert re.search(rf"^{name} [0-9.e+]+$", text, re.M), name
    # known label values exist at 0 before their first event, so increase() sees the first one
    assert 'mmguard_config_reloads_total{result="rejected"} 0.0' in text
    assert re.search(r'mmguard_experiment_stops_total\{cause="slo",experiment="noop",'
                     r'route="clip_b"\} 0.0', text)
    assert 'mmguard_fallback_answers_total{level="3",model="guarded"} 0.0' in text
    # one-hot: exactly one state at 1 per breaker
    states = re.findall(r'mmguard_breaker_status\{level="clip_b",model="guarded",'
                        r'state="(\w+)"\} ([01])\.0', text)
    assert len(states) == 5 and [s for s, v in states if v == "1"] == ["closed"]


def test_every_alert_has_a_promtool_case_that_fires_and_one_that_stays_quiet() -> None:
    """deploy/prometheus/tests: scripts/ci_ops.sh runs them with `promtool test rules`; this
    keeps them complete as alerts are added."""
    rule = find("PrometheusRule", DEPLOY / "prometheus" / "alerts.yaml")
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    fires: set[str] = set()
    quiet: set[str] = set()
    for path in sorted(PROMTOOL_TESTS.glob("*_test.yaml")):
        suite = yaml.safe_load(path.read_text())
        assert suite["rule_files"] == ["mmguard-rules.yaml"]
        for case in suite["tests"]:
            for t in case.get("alert_rule_test", []):
                (fires if t["exp_alerts"] else quiet).add(t["alertname"])
    assert alerts - fires == set(), "no promtool case where these fire"
    assert alerts - quiet == set(), "no promtool case where these stay quiet"
    assert (fires | quiet) <= alerts
