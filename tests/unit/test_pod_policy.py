"""The base manifests carry a PodDisruptionBudget that selects the Deployment's pods and a pod
seccomp profile of RuntimeDefault (scripts/ci_ops.sh checks each rendered overlay too, with
`scripts/check_deploy.py pod-policy`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

BASE = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base"


def _one(kind: str) -> dict[str, Any]:
    names = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    found = [d for n in names if n.endswith(".yaml") and (BASE / n).is_file()
             for d in yaml.safe_load_all((BASE / n).read_text()) if d and d["kind"] == kind]
    assert len(found) == 1, (kind, len(found))
    return dict(found[0])


def test_a_disruption_budget_selects_the_pods_and_lets_a_drain_proceed() -> None:
    pdb, deployment = _one("PodDisruptionBudget"), _one("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # one at a time, and never "no pod may go" for a one-replica overlay (canary)
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": pdb["spec"]["selector"]}


def test_pods_run_under_the_runtime_default_seccomp_profile() -> None:
    pod = _one("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in pod["containers"]:  # no container opts out
        assert "seccompProfile" not in (c.get("securityContext") or {}), c["name"]
