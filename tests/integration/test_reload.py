"""Reloads of a real ``mmguard serve`` process: on a file change (no signal), on SIGHUP, and
through ``POST /admin/reload`` (token required); a reload whose replaced backend cannot start
is rejected and changes nothing live — the old runtime serves and the new config's fault
experiment never starts; a pod told where its config is (``MMGUARD_CONFIG``) and not finding it
refuses to start rather than serve the demo."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.test_tls import make_pki, peer_serial, tls_config
from tests.support.adversary import PROBE_BODY, PROBE_PATH, http_call, serve
from tests.support.models import write_identity
from tests.support.process import MmguardProcess
from tests.support.triton import TritonServer

TOKEN = "reload-test-token"


def _repo(path: Path) -> Path:
    write_identity(path, "FP32")
    return path


def _config(model_dir: Path, experiment: str, **extra: Any) -> dict[str, Any]:
    fault = {"fault": {"experiments": [{"name": experiment, "actions": [
        {"kind": "delay", "ms": 0}]}]}}
    return {"backends": [{"kind": "onnxruntime", "name": "ort", "model_dir": str(model_dir)}],
            "models": [{"name": "identity_fp32", "backend": "ort", "filters": [fault]}],
            "canary": {"headers": {"x-canary": "1"}},
            "listeners": {"http": {"trust_canary_headers": True},
                          "admin": {"token_env": "MMGUARD_TEST_ADMIN_TOKEN"}},
            "watch_config_s": 0.5, **extra}


@pytest.fixture
def token_env() -> Iterator[None]:
    os.environ["MMGUARD_TEST_ADMIN_TOKEN"] = TOKEN
    try:
        yield
    finally:
        del os.environ["MMGUARD_TEST_ADMIN_TOKEN"]


def _count(proc: MmguardProcess, text: str) -> int:
    return sum(text in str(rec.get("msg", "")) for rec in proc.records())


def _wait_count(proc: MmguardProcess, text: str, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _count(proc, text) < count:
        assert time.monotonic() < deadline, (f"no {count} log lines with {text!r}:\n"
                                             + proc.log_path.read_text()[-3000:])
        time.sleep(0.1)


def _experiments(proc: MmguardProcess) -> dict[str, str]:
    _, _, body = http_call(proc.ports["admin"], "GET", "/admin/experiments")
    return {e["name"]: e["state"] for e in json.loads(body)}


def _reloads(proc: MmguardProcess) -> dict[str, float]:
    _, _, body = http_call(proc.ports["admin"], "GET", "/metrics")
    return {m[1]: float(m[2]) for m in re.finditer(
        r'mmguard_config_reloads_total\{result="(\w+)"\} (\S+)', body.decode())}


def _infer(proc: MmguardProcess, model: str = "identity_fp32") -> tuple[int, dict[str, str]]:
    status, headers, _ = http_call(proc.ports["http"], "POST", f"/v2/models/{model}/infer",
                                   PROBE_BODY, {"x-canary": "1"})
    return status, headers


def _write(path: Path, cfg: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg))
    tmp.replace(path)  # as an editor or a ConfigMap update: the file is swapped whole


def test_a_changed_file_reloads_without_a_signal(tmp_path: Path, token_env: None) -> None:
    models = _repo(tmp_path / "models")
    with serve(tmp_path, _config(models, "first")) as proc:
        assert _infer(proc)[1]["mmguard-fault"].startswith("first/delay")
        cfg = _config(models, "second")
        cfg["models"].append({"name": "echo", "backend": "ort", "backend_model": "identity_fp32"})
        _write(tmp_path / "mmguard.yaml", cfg)
        _wait_count(proc, "config reloaded from", 1, timeout=30)
        assert _infer(proc, "echo")[0] == 200
        assert _infer(proc)[1]["mmguard-fault"].startswith("second/delay")
        assert _experiments(proc) == {"first": "stopped", "second": "running"}
        assert _count(proc, "config reload: ") >= 1  # says which file changed
        time.sleep(2)  # nothing changed since: no second reload
        assert _count(proc, "config reloaded from") == 1


def test_a_reload_whose_replaced_backend_cannot_start_changes_nothing(
        tmp_path: Path, token_env: None) -> None:
    models = _repo(tmp_path / "models")
    broken = tmp_path / "broken"
    (broken / "identity_fp32" / "1").mkdir(parents=True)
    (broken / "identity_fp32" / "1" / "model.onnx").write_bytes(b"not an onnx model")
    with serve(tmp_path, _config(models, "old")) as proc:
        before = _reloads(proc)
        _write(tmp_path / "mmguard.yaml", _config(broken, "new"))  # files exist; ORT fails
        _wait_count(proc, "config reload rejected", 1, timeout=60)
        rec = next(r for r in proc.records() if "config reload rejected" in str(r["msg"]))
        assert "replaced backends ['ort'] did not start within 10 s" in str(rec["msg"])
        assert rec["level"] == "error"
        status, headers = _infer(proc)
        assert status == 200 and headers["mmguard-fault"].startswith("old/delay")
        assert _experiments(proc) == {"old": "running"}  # 'new' was never started
        after = _reloads(proc)
        assert after["rejected"] - before.get("rejected", 0) == 1
        assert after.get("applied", 0) == before.get("applied", 0)


def test_admin_reload_needs_the_token_and_says_what_happened(tmp_path: Path,
                                                              token_env: None) -> None:
    models = _repo(tmp_path / "models")
    cfg = _config(models, "a", watch_config_s=0)
    with serve(tmp_path, cfg) as proc:
        admin = proc.ports["admin"]
        status, _, body = http_call(admin, "POST", "/admin/reload")
        assert status == 401 and json.loads(body)["error"] == "this needs the admin token"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        status, _, body = http_call(admin, "POST", "/admin/reload", headers=auth)
        assert status == 200 and json.loads(body)["applied"] is True
        cfg["models"][0]["filters"] = [{"fallback": {"degrade_to": ["nowhere"]}}]
        _write(tmp_path / "mmguard.yaml", cfg)
        status, _, body = http_call(admin, "POST", "/admin/reload", headers=auth)
        answer = json.loads(body)
        assert status == 409 and answer["applied"] is False
        assert "degrade_to[0]: names route 'nowhere'" in answer["message"]
        assert "the old config keeps serving" in answer["message"]
        assert _infer(proc)[0] == 200


def test_sighup_reload_still_works(tmp_path: Path, token_env: None) -> None:
    models = _repo(tmp_path / "models")
    cfg = _config(models, "a", watch_config_s=0)
    with serve(tmp_path, cfg) as proc:
        cfg["models"].append({"name": "echo", "backend": "ort", "backend_model": "identity_fp32"})
        _write(tmp_path / "mmguard.yaml", cfg)
        proc.signal(signal.SIGHUP)
        _wait_count(proc, "config reloaded from", 1)
        deadline = time.monotonic() + 30
        while _infer(proc, "echo")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_a_config_asked_for_and_missing_refuses_to_start(tmp_path: Path) -> None:
    env = {**os.environ, "MMGUARD_CONFIG": str(tmp_path / "nowhere.yaml")}
    r = subprocess.run([sys.executable, "-m", "proxy.cli", "serve", "--http-port", "0",
                        "--grpc-port", "0", "--admin-port", "0"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1
    assert f"{tmp_path / 'nowhere.yaml'} is invalid:\n  cannot read" in r.stderr
    assert PROBE_PATH not in r.stdout  # it never served


def test_rotated_certificates_are_served_without_a_signal(tmp_path: Path,
                                                          ort_models: Path) -> None:
    """cert-manager rewrites the mounted Secret; the watch sees it and every listener's new
    connections get the new certificate, with no SIGHUP."""
    pki = make_pki(tmp_path / "pki")
    files = tmp_path / "tls"
    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump({**tls_config(ort_models, pki, files=files),
                                    "watch_config_s": 0.5}))
    p = MmguardProcess(["--config", str(path)], tmp_path / "serve.log")
    try:
        assert peer_serial(p.ports["http"], pki) == pki.serials["server"]
        for name, suffix in (("listener.pem", "pem"), ("listener.key", "key")):
            shutil.copy(pki.dir / f"server2.{suffix}", files / f"{name}.new")
            (files / f"{name}.new").replace(files / name)
        p.wait_log("TLS certificates reloaded", timeout=30)
        second = pki.serials["server2"]
        assert peer_serial(p.ports["http"], pki) == second
        assert peer_serial(p.ports["admin"], pki) == second
        assert peer_serial(p.ports["grpc"], pki, grpc_port=True) == second
        assert "listener.pem" in str(p.wait_log("config reload: ")["msg"])
    finally:
        assert p.stop() == 0


def _triton_infer(proc: MmguardProcess, model: str) -> int:
    """The status of one infer of Triton's identity_fp32 (batched: [1, 2]) through ``model``."""
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2],
                                   "data": [1.0, 2.0]}]}).encode()
    status, _, answer = http_call(proc.ports["http"], "POST", f"/v2/models/{model}/infer", body)
    assert status == 200, answer
    return status


def test_a_reload_that_points_triton_backends_at_no_server_changes_nothing(
        tmp_path: Path, token_env: None, triton: TritonServer) -> None:
    # a gRPC channel and an HTTP session open without a server: the replaced backends must
    # answer at their new address before the swap, or the old ones keep serving
    cfg = {"backends": [{"kind": "triton_grpc", "name": "tg", "url": triton.grpc_url},
                        {"kind": "triton_http", "name": "th", "url": triton.http_url}],
           "models": [{"name": "g", "backend": "tg", "backend_model": "identity_fp32"},
                      {"name": "h", "backend": "th", "backend_model": "identity_fp32"}],
           "listeners": {"admin": {"token_env": "MMGUARD_TEST_ADMIN_TOKEN"}},
           "watch_config_s": 0}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serve(tmp_path, cfg) as proc:
        assert _triton_infer(proc, "g") == _triton_infer(proc, "h") == 200
        dead = json.loads(json.dumps(cfg))
        dead["backends"][0]["url"] = "127.0.0.1:1"
        dead["backends"][1]["url"] = "127.0.0.1:1"
        _write(tmp_path / "mmguard.yaml", dead)
        status, _, body = http_call(proc.ports["admin"], "POST", "/admin/reload", headers=auth)
        answer = json.loads(body)
        assert status == 409 and answer["applied"] is False, answer
        assert "replaced backends" in answer["message"], answer
        assert "tg: 127.0.0.1:1 did not answer (UNAVAILABLE" in answer["message"], answer
        assert "th: http://127.0.0.1:1 did not answer" in answer["message"], answer
        assert _triton_infer(proc, "g") == _triton_infer(proc, "h") == 200
        # replaced by backends that answer (a changed timeout, the same server): applied
        moved = json.loads(json.dumps(cfg))
        for backend in moved["backends"]:
            backend["timeout_s"] = 7
        _write(tmp_path / "mmguard.yaml", moved)
        status, _, body = http_call(proc.ports["admin"], "POST", "/admin/reload", headers=auth)
        assert status == 200 and json.loads(body)["applied"] is True, body
        assert _triton_infer(proc, "g") == _triton_infer(proc, "h") == 200
