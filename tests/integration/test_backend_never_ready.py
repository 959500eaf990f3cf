"""A real ``mmguard serve`` whose Triton never comes up: its backend and route have readiness
series at 0 from start-up, ``mmguard status`` names them with why, the shipped
``MmguardBackendNotReady`` alert fires on the series this mmguard exports (promtool), and the
log says it once at WARNING, not a line every retry."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.support.process import MmguardProcess
from tests.support.tools import promtool

ROOT = Path(__file__).resolve().parents[2]


def _dead_port() -> int:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metrics(admin: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as r:
        return bytes(r.read()).decode()


def _alert_fires_on(value: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    """promtool, on the shipped rules, with ``mmguard_backend_ready`` held at ``value`` (what
    the running mmguard exports) for 5 minutes."""
    subprocess.run([sys.executable, str(ROOT / "scripts/check_deploy.py"), "rules",
                    str(ROOT / "deploy/prometheus/alerts.yaml"), str(tmp / "rules.yaml")],
                   check=True)
    series = 'mmguard_backend_ready{namespace="ml",pod="p1",backend="triton"}'
    test = {"rule_files": ["rules.yaml"], "evaluation_interval": "30s", "tests": [{
        "interval": "30s",
        "input_series": [{"series": series, "values": f"{value}x10"}],
        "alert_rule_test": [{"alertname": "MmguardBackendNotReady", "eval_time": "3m",
                             "exp_alerts": [{"exp_labels": {
                                 "severity": "critical", "namespace": "ml", "pod": "p1",
                                 "backend": "triton"}, "exp_annotations": {
                                 "summary": "Backend triton not ready in p1",
                                 "description": "mmguard's readiness is 503 while this lasts; "
                                 "the pod takes no traffic. `mmguard status` in the pod says "
                                 "why (start failure, contract unknown)."}}]}]}]}
    (tmp / "never_ready_test.yaml").write_text(yaml.safe_dump(test))
    return subprocess.run([promtool(), "test", "rules", "never_ready_test.yaml"], cwd=tmp,
                          capture_output=True, text=True)


def test_a_triton_that_never_starts_is_seen_everywhere(tmp_path: Path) -> None:
    config = {"backends": [{"kind": "triton_http", "name": "triton",
                            "url": f"127.0.0.1:{_dead_port()}", "timeout_s": 1}],
              "models": [{"name": "clip", "backend": "triton"}]}
    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = MmguardProcess(["--config", str(path)], tmp_path / "serve.log")
    try:
        admin = proc.ports["admin"]
        deadline = time.monotonic() + 30
        text = ""
        while time.monotonic() < deadline:
            text = _metrics(admin)
            if 'mmguard_route_ready{backend="triton",model="clip"} 0.0' in text:
                break
            time.sleep(0.2)
        assert 'mmguard_backend_ready{backend="triton"} 0.0' in text
        assert 'mmguard_route_ready{backend="triton",model="clip"} 0.0' in text
        status = subprocess.run(
            [sys.executable, "-m", "proxy.cli", "status", "--admin",
             f"http://127.0.0.1:{admin}"], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert "NOT READY" in status.stdout.splitlines()[0]
        assert "backends: triton NOT READY" in status.stdout
        assert "route clip: contract unknown:" in status.stdout, status.stdout
        time.sleep(8)  # a few retries (0.2 s, doubling to 5 s): one line, not one per retry
        warnings = [r for r in proc.records()
                    if "contract of model 'clip' not available yet" in str(r.get("msg"))]
        assert [r["level"] for r in warnings] == ["warning"], warnings
    finally:
        proc.stop()
    promtool = _alert_fires_on("0", tmp_path)
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr
    # and the same test with the value a ready backend exports must fail: it is a real check
    assert _alert_fires_on("1", tmp_path).returncode != 0


def _readyz(admin: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


def test_a_pod_gives_its_workers_reasons(tmp_path: Path) -> None:
    """``--workers 2``: the supervisor serves no data, yet its ``/readyz`` (and so ``mmguard
    status``) says which backend and route are not ready and why, as the workers see them,
    and which worker is not ready."""
    config = {"backends": [{"kind": "triton_http", "name": "triton",
                            "url": f"127.0.0.1:{_dead_port()}", "timeout_s": 1}],
              "models": [{"name": "clip", "backend": "triton"}]}
    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = MmguardProcess(["--config", str(path), "--workers", "2"], tmp_path / "serve.log")
    try:
        admin = proc.ports["admin"]
        deadline = time.monotonic() + 60
        status, doc = _readyz(admin)
        while len([w for w in doc.get("workers", []) if w["pid"]]) < 2 or "clip" not in \
                doc.get("routes", {}):
            assert time.monotonic() < deadline, doc
            time.sleep(0.2)
            status, doc = _readyz(admin)
        assert status == 503
        assert doc["backends"]["triton"]["ready"] is False
        assert str(doc["backends"]["triton"]["why"]).startswith("worker "), doc
        route = doc["routes"]["clip"]
        assert route["ready"] is False and route["backend"] == "triton"
        assert "contract unknown" in str(route["why"]), route
        assert all(w["ready"] is False and w["why"] for w in doc["workers"]), doc["workers"]
        cli = subprocess.run(
            [sys.executable, "-m", "proxy.cli", "status", "--admin",
             f"http://127.0.0.1:{admin}"], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert "route clip: worker " in cli.stdout and "contract unknown" in cli.stdout, \
            cli.stdout
    finally:
        proc.stop()
