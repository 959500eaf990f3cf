"""Checks of deploy/ that need more than a YAML parser, for scripts/ci_ops.sh.

    python scripts/check_deploy.py rules deploy/prometheus/alerts.yaml OUT.yaml
        the PrometheusRule's spec as a plain Prometheus rules file (for promtool)
    python scripts/check_deploy.py fleet-promql OUT.yaml
        the PromQL of deploy/fleet/*, template variables filled in, as recording rules, so
        `promtool check rules` parses every query
    python scripts/check_deploy.py known-fields CRS.json scripts/crd/node_modules
        no unknown field in those kinds (their .d.ts declarations name every field)
    python scripts/check_deploy.py configmaps OUT_DIR FILE...
        every mmguard config (a ``*.yaml`` key of a ConfigMap) in FILEs (rendered overlays,
        KServe manifests), written as it is to OUT_DIR for `mmguard check-config --offline`
    python scripts/check_deploy.py pod-policy FILE...
        each rendered overlay in FILEs: every Deployment has a PodDisruptionBudget whose
        selector matches its pods (and no other Deployment's), and its pods run under the
        RuntimeDefault seccomp profile
    python scripts/check_deploy.py crds OUT.json FILE...
        every custom resource in FILEs: PodMonitor, PrometheusRule and AnalysisTemplate go to
        OUT.json for the CRD-schema validator (scripts/crd/validate.mjs); KServe's
        InferenceService is checked here against KServe's API types (the kserve package's
        generated models) and the strict core schemas (kubernetes-validate), plus Knative's
        Serverless restrictions; Flagger's MetricTemplate and Canary, for which no registry
        package ships a schema, structurally (known fields only, the required ones present).
        Exit 1 on any finding.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
FOR_NODE = {("monitoring.coreos.com/v1", "PodMonitor"),
            ("monitoring.coreos.com/v1", "PrometheusRule"),
            ("argoproj.io/v1alpha1", "AnalysisTemplate")}

# Flagger's CRD fields (flagger.app/v1beta1), as its openAPIV3Schema (artifacts/flagger/crd.yaml
# in Flagger's repository) declares them for these parts; anything else is a typo Flagger would
# drop or refuse.
_METRIC_TEMPLATE_SPEC = {"provider", "query"}
_PROVIDER = {"type", "address", "secretRef", "insecureSkipVerify", "region", "headers"}
_PROVIDER_TYPES = {"prometheus", "influxdb", "datadog", "externalmetrics", "stackdriver",
                   "cloudwatch", "newrelic", "graphite", "dynatrace", "keptn", "splunk"}
_CANARY_SPEC = {"provider", "metricsServer", "targetRef", "autoscalerRef", "ingressRef",
                "routeRef", "upstreamRef", "service", "skipAnalysis", "analysis",
                "progressDeadlineSeconds", "revertOnDeletion", "suspend"}
_ANALYSIS = {"interval", "iterations", "mirror", "mirrorWeight", "maxWeight", "stepWeight",
             "stepWeights", "stepWeightPromotion", "threshold", "primaryReadyThreshold",
             "canaryReadyThreshold", "alerts", "metrics", "webhooks", "match", "sessionAffinity"}
_CANARY_METRIC = {"name", "interval", "threshold", "thresholdRange", "query", "templateRef",
                  "templateVariables"}
_INTERVAL = re.compile(r"^[0-9]+(m|s)")


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]


def _unknown(where: str, got: dict[str, Any], known: set[str]) -> list[str]:
    return [f"{where}: unknown field {k!r}" for k in sorted(set(got) - known)]


def check_metric_template(doc: dict[str, Any]) -> list[str]:
    where = f"MetricTemplate {doc['metadata']['name']}"
    spec = doc.get("spec") or {}
    out = _unknown(where + " spec", spec, _METRIC_TEMPLATE_SPEC)
    provider = spec.get("provider") or {}
    out += _unknown(where + " spec.provider", provider, _PROVIDER)
    if provider.get("type") not in _PROVIDER_TYPES:
        out.append(f"{where}: spec.provider.type {provider.get('type')!r} is not a Flagger "
                   "provider")
    if not isinstance(spec.get("query"), str) or not spec["query"].strip():
        out.append(f"{where}: spec.query must be a non-empty string")
    return out


def check_canary(doc: dict[str, Any]) -> list[str]:
    where = f"Canary {doc['metadata']['name']}"
    spec = doc.get("spec") or {}
    out = _unknown(where + " spec", spec, _CANARY_SPEC)
    for key in ("targetRef", "analysis"):
        if key not in spec:
            out.append(f"{where}: spec.{key} is required")
    analysis = spec.get("analysis") or {}
    out += _unknown(where + " spec.analysis", analysis, _ANALYSIS)
    for i, m in enumerate(analysis.get("metrics") or []):
        out += _unknown(f"{where} spec.analysis.metrics[{i}]", m, _CANARY_METRIC)
        if "name" not in m:
            out.append(f"{where}: spec.analysis.metrics[{i}].name is required")
        if "interval" in m and not _INTERVAL.match(str(m["interval"])):
            out.append(f"{where}: metrics[{i}].interval {m['interval']!r} is not a duration")
        out += _unknown(f"{where} metrics[{i}].thresholdRange", m.get("thresholdRange") or {},
                        {"min", "max"})
    return out


def check_inference_service(doc: dict[str, Any]) -> list[str]:
    """KServe v1beta1: a predictor with containers; in Serverless mode, what Knative's webhook
    refuses (container lifecycle hooks, a pod-level terminationGracePeriodSeconds, more than
    one serving port, probes on another port than the serving one)."""
    meta = doc["metadata"]
    where = f"InferenceService {meta['name']}"
    mode = (meta.get("annotations") or {}).get("serving.kserve.io/deploymentMode", "Serverless")
    predictor = (doc.get("spec") or {}).get("predictor") or {}
    containers = predictor.get("containers") or []
    out = [] if containers else [f"{where}: spec.predictor.containers is empty"]
    if not any(c.get("name") == "kserve-container" for c in containers):
        out.append(f"{where}: no container named kserve-container (KServe's predictor)")
    if mode != "Serverless":
        return out
    if "terminationGracePeriodSeconds" in predictor:
        out.append(f"{where}: Serverless: Knative rejects a pod-level "
                   "terminationGracePeriodSeconds")
    ports = [p for c in containers for p in c.get("ports") or []]
    if len(ports) > 1:
        out.append(f"{where}: Serverless: Knative allows one serving port, found {len(ports)}")
    for c in containers:
        if "lifecycle" in c:
            out.append(f"{where}: Serverless: container {c['name']} has lifecycle hooks")
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            port = ((c.get(probe) or {}).get("httpGet") or {}).get("port")
            serving = {p.get("containerPort") for p in c.get("ports") or []} | \
                {p.get("name") for p in c.get("ports") or []}
            if port is not None and port not in serving:
                out.append(f"{where}: Serverless: {c['name']}.{probe} probes port {port}, not "
                           "the serving port")
    return out


# --- KServe's API types, from the kserve package's generated models -------------------------
# The KServe SDK (pip kserve, installed --no-deps: only its model files are read, with ast, never
# imported) carries every field of every v1beta1 type (`openapi_types`, `attribute_map`), and
# kubernetes-validate carries the strict JSON schemas of the core types they embed (V1Container,
# V1Volume...). Together: an InferenceService with an unknown or mistyped field is a finding.

def _kserve_types() -> dict[str, tuple[dict[str, str], dict[str, str]]]:
    import ast
    import importlib.util

    spec = importlib.util.find_spec("kserve")  # finding does not import the package
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the kserve package is needed: pip install --no-deps kserve")
    types: dict[str, tuple[dict[str, str], dict[str, str]]] = {}
    for path in (Path(spec.submodule_search_locations[0]) / "models").glob("v1beta1_*.py"):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ClassDef):
                continue
            found: dict[str, dict[str, str]] = {}
            for item in node.body:
                if (isinstance(item, ast.Assign) and len(item.targets) == 1
                        and isinstance(item.targets[0], ast.Name)
                        and item.targets[0].id in ("openapi_types", "attribute_map")):
                    found[item.targets[0].id] = ast.literal_eval(item.value)
            if len(found) == 2:
                types[node.name] = (found["openapi_types"], found["attribute_map"])
    return types


def _core_schemas() -> dict[str, Any]:
    import importlib.util

    spec = importlib.util.find_spec("kubernetes_validate")
    assert spec is not None and spec.submodule_search_locations
    root = Path(spec.submodule_search_locations[0]) / "kubernetes-json-schema"
    strict = sorted(root.glob("v*-local-strict"))[-1]
    defs: dict[str, Any] = json.loads((strict / "_definitions.json").read_text())
    return defs


class KserveSchema:
    def __init__(self) -> None:
        self.types = _kserve_types()
        self.core = _core_schemas()

    def check(self, value: Any, type_: str, where: str) -> list[str]:
        if type_.startswith("list["):
            if not isinstance(value, list):
                return [f"{where}: expected a list, got {type(value).__name__}"]
            return [f for i, v in enumerate(value) for f in self.check(v, type_[5:-1],
                                                                         f"{where}[{i}]")]
        if type_.startswith("dict("):
            inner = type_[5:-1].split(", ", 1)[1]
            if not isinstance(value, dict):
                return [f"{where}: expected a mapping"]
            return [f for k, v in value.items() for f in self.check(v, inner, f"{where}.{k}")]
        simple: dict[str, type | tuple[type, ...]] = {"str": str, "int": int, "bool": bool,
                                                      "float": (int, float)}
        if type_ in simple:
            ok = isinstance(value, simple[type_]) and not (type_ == "int"
                                                          and isinstance(value, bool))
            return [] if ok else [f"{where}: expected {type_}, got {value!r}"]
        if type_ == "object":
            return []
        if type_ in self.types:
            fields, names = self.types[type_]
            if not isinstance(value, dict):
                return [f"{where}: expected an object ({type_})"]
            by_json = {j: attr for attr, j in names.items()}
            out = []
            for key, v in value.items():
                attr = by_json.get(key)
                if attr is None:
                    out.append(f"{where}: unknown field {key!r} ({type_})")
                else:
                    out += self.check(v, fields[attr], f"{where}.{key}")
            return out
        return self._core(value, type_, where)

    def _core(self, value: Any, type_: str, where: str) -> list[str]:
        import jsonschema  # type: ignore[import-untyped]  # kubernetes-validate's dependency

        name = type_[2:] if type_.startswith("V1") else type_
        candidates = [k for k in self.core["$defs"] if k.endswith(f".v1.{name}")]
        if type_.startswith("K8sIoApi"):  # K8sIoApiAppsV1DeploymentStrategy and the like
            candidates = [k for k in self.core["$defs"]
                          if k.replace(".", "").lower() == f"io{type_}".lower()]
        if not candidates:
            return [f"{where}: no schema for type {type_}"]
        preferred = sorted(candidates, key=lambda k: ("core.v1" not in k, k))[0]
        schema = {"$defs": self.core["$defs"], "$ref": f"#/$defs/{preferred}"}
        errors = jsonschema.Draft202012Validator(schema).iter_errors(value)
        return [f"{where}{''.join(f'.{p}' for p in e.absolute_path)}: {e.message}"
                for e in errors]


_KSERVE: KserveSchema | None = None


def check_inference_service_schema(doc: dict[str, Any]) -> list[str]:
    global _KSERVE
    _KSERVE = _KSERVE or KserveSchema()
    where = f"InferenceService {doc['metadata']['name']}"
    body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
    out = _KSERVE.check(body.get("spec", {}), "V1beta1InferenceServiceSpec", where + " spec")
    out += _KSERVE.check(doc["metadata"], "V1ObjectMeta", where + " metadata")
    return out + check_inference_service(doc)


_CHECKS = {("flagger.app/v1beta1", "MetricTemplate"): check_metric_template,
           ("flagger.app/v1beta1", "Canary"): check_canary,
           ("serving.kserve.io/v1beta1", "InferenceService"): check_inference_service_schema}


def crds(out_json: Path, files: list[Path]) -> int:
    for_node: list[dict[str, Any]] = []
    findings: list[str] = []
    for path in files:
        for doc in _docs(path):
            key = (doc.get("apiVersion", ""), doc.get("kind", ""))
            if key in FOR_NODE:
                for_node.append(doc)
            elif key in _CHECKS:
                found = _CHECKS[key](doc)
                findings += [f"{path}: {f}" for f in found]
                how = ("KServe API types + strict core schemas" if key[1] == "InferenceService"
                       else "structural")
                if not found:
                    print(f"{path}: {key[1]} {doc['metadata']['name']}: ok ({how})")
    out_json.write_text(json.dumps(for_node))
    for f in findings:
        print(f)
    return 1 if findings else 0


# --- unknown fields in the operators' kinds ------------------------------------------------
# The npm validators (scripts/crd/validate.mjs) check types and required fields but let unknown
# fields through; the same packages' type declarations (.d.ts, generated from the same Go types)
# name every field, so a typo (`podMetricEndpoints`) is caught here.

_ROOTS = {"PodMonitor": "IPodMonitor", "PrometheusRule": "IPrometheusRule",
          "AnalysisTemplate": "IAnalysisTemplate"}
_INTERFACE = re.compile(r"^export interface (I\w+)(?: extends ([\w, ]+))? \{$(.*?)^\}",
                        re.M | re.S)
_PROP = re.compile(r'^    "(\w+)"\??: (.+?);?$', re.M)  # "x": {  opens a map type
_ALIAS = re.compile(r"export type \{ (I\w+) as (I\w+)")


def _declarations(node_modules: Path) -> tuple[dict[str, tuple[list[str], dict[str, str]]],
                                                dict[str, str]]:
    interfaces: dict[str, tuple[list[str], dict[str, str]]] = {}
    aliases: dict[str, str] = {}
    for path in node_modules.rglob("*.d.ts"):
        text = path.read_text()
        for name, bases, body in _INTERFACE.findall(text):
            props = dict(_PROP.findall(body))
            interfaces[name] = ([b.strip() for b in bases.split(",") if b.strip()], props)
        for real, alias in _ALIAS.findall(text):
            aliases[alias] = real
    return interfaces, aliases


class KnownFields:
    def __init__(self, node_modules: Path) -> None:
        self.interfaces, self.aliases = _declarations(node_modules)

    def fields(self, name: str) -> dict[str, str] | None:
        name = self.aliases.get(name, name)
        found = self.interfaces.get(name)
        if found is None:
            return None
        bases, props = found
        out: dict[str, str] = {"apiVersion": "string", "kind": "string"} if "TypeMeta" in bases \
            else {}
        for base in bases:
            out.update(self.fields(base) or {})
        out.update(props)
        return out

    def check(self, value: Any, type_: str, where: str) -> list[str]:
        type_ = type_.replace(" | null", "").strip()
        if type_.startswith("Array<") and type_.endswith(">"):
            return [f for i, v in enumerate(value if isinstance(value, list) else [])
                    for f in self.check(v, type_[6:-1], f"{where}[{i}]")]
        fields = self.fields(type_) if re.fullmatch(r"I\w+", type_) else None
        if fields is None or not isinstance(value, dict):
            return []  # a scalar, a union or a map: the schema validator judged it
        out = [f"{where}: unknown field {k!r}" for k in value if k not in fields]
        for k, v in value.items():
            if k in fields:
                out += self.check(v, fields[k], f"{where}.{k}")
        return out


def known_fields(crs_json: Path, node_modules: Path) -> int:
    checker = KnownFields(node_modules)
    missing = [r for r in _ROOTS.values() if checker.fields(r) is None]
    if missing:
        print(f"no type declarations for {missing} under {node_modules}")
        return 1
    findings = []
    for doc in json.loads(crs_json.read_text()):
        where = f"{doc['kind']} {doc['metadata']['name']}"
        findings += checker.check(doc, _ROOTS[doc["kind"]], where)
    for f in findings:
        print(f)
    print(f"known fields: {len(findings)} findings")
    return 1 if findings else 0


def rules(alerts: Path, out: Path) -> int:
    (rule,) = [d for d in _docs(alerts) if d.get("kind") == "PrometheusRule"]
    out.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return 0


_FILL = {"{{ namespace }}": "ml", "{{ target }}": "mmguard-clip", "{{ interval }}": "5m",
         "{{ variables.canary_route }}": "clip_canary", "{{args.namespace}}": "ml",
         "{{args.canary-hash}}": "abc123", "{{args.canary-route}}": "clip_canary"}


def fleet_queries() -> dict[str, str]:
    """Every PromQL query in deploy/fleet, by a name saying where it is from."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "deploy" / "fleet").glob("*.yaml")):
        for doc in _docs(path):
            if doc.get("kind") == "MetricTemplate":
                found[f"flagger_{doc['metadata']['name']}"] = doc["spec"]["query"]
            elif doc.get("kind") == "AnalysisTemplate":
                for m in doc["spec"]["metrics"]:
                    found[f"argo_{doc['metadata']['name']}_{m['name']}"] = \
                        m["provider"]["prometheus"]["query"]
    return found


def fleet_promql(out: Path) -> int:
    rules_ = []
    for name, query in fleet_queries().items():
        for k, v in _FILL.items():
            query = query.replace(k, v)
        if "{{" in query:
            print(f"{name}: a template variable is not filled in: {query}")
            return 1
        rules_.append({"record": "fleet:" + re.sub(r"[^a-z0-9_]", "_", name.lower()),
                       "expr": query})
    out.write_text(yaml.safe_dump({"groups": [{"name": "fleet", "rules": rules_}]}))
    return 0


def pod_policy(files: list[Path]) -> int:
    findings: list[str] = []
    for path in files:
        docs = _docs(path)
        deployments = [d for d in docs if d.get("kind") == "Deployment"]
        budgets = [d for d in docs if d.get("kind") == "PodDisruptionBudget"]
        for dep in deployments:
            where = f"{path.name}: Deployment {dep['metadata']['name']}"
            pod = dep["spec"]["template"]
            labels = pod["metadata"].get("labels", {})
            covering = [b for b in budgets if b["spec"]["selector"].get("matchLabels")
                        and b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
            if len(covering) != 1:
                findings.append(f"{where}: {len(covering)} PodDisruptionBudgets select its "
                                f"pods (labels {labels}); expected one")
            profile = (pod["spec"].get("securityContext") or {}).get("seccompProfile") or {}
            if profile.get("type") != "RuntimeDefault":
                findings.append(f"{where}: pod securityContext.seccompProfile is {profile}, "
                                "expected {type: RuntimeDefault}")
    for f in findings:
        print(f)
    print(f"pod policy: {len(findings)} findings")
    return 1 if findings else 0


def configmaps(out: Path, files: list[Path]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for path in files:
        for doc in _docs(path):
            if doc.get("kind") != "ConfigMap":
                continue
            for key, text in (doc.get("data") or {}).items():
                if key.endswith((".yaml", ".yml")):
                    n += 1
                    name = f"{path.stem}--{doc['metadata']['name']}--{key}"
                    (out / re.sub(r"[^A-Za-z0-9_.-]", "_", name)).write_text(text)
    print(f"configmaps: {n} mmguard configs")
    return 0 if n else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["rules"] and len(argv) == 3:
        return rules(Path(argv[1]), Path(argv[2]))
    if argv[:1] == ["fleet-promql"] and len(argv) == 2:
        return fleet_promql(Path(argv[1]))
    if argv[:1] == ["known-fields"] and len(argv) == 3:
        return known_fields(Path(argv[1]), Path(argv[2]))
    if argv[:1] == ["pod-policy"] and len(argv) >= 2:
        return pod_policy([Path(a) for a in argv[1:]])
    if argv[:1] == ["configmaps"] and len(argv) >= 3:
        return configmaps(Path(argv[1]), [Path(a) for a in argv[2:]])
    if argv[:1] == ["crds"] and len(argv) >= 3:
        return crds(Path(argv[1]), [Path(a) for a in argv[2:]])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
