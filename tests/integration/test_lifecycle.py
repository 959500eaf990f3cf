"""The real process: the embedded default, port 0, SIGHUP reload (bad config refused, good one
applied), SIGTERM exits 0."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from numpy.typing import NDArray
from tritonclient.utils import InferenceServerException

from proxy.pb import grpc_service_pb2 as pb
from tests.conftest import ort_config, triton_routes
from tests.support.process import MmguardProcess
from tests.support.triton import TritonServer
from tests.support.wire import grpc_infer_raw, grpc_request


def _identity(url: str, model: str = "identity_fp32") -> NDArray[Any]:
    client = grpcclient.InferenceServerClient(url)
    x = grpcclient.InferInput("INPUT0", [3], "FP32")
    x.set_data_from_numpy(np.array([1, 2, 3], np.float32))
    out: NDArray[Any] | None = client.infer(model, [x]).as_numpy("OUTPUT0")
    assert out is not None
    return out


def _wait_ready(url: str, model: str, timeout: float = 30) -> None:
    client = grpcclient.InferenceServerClient(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.is_model_ready(model):
                return
        except InferenceServerException:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{model} not ready")


def test_embedded_default_serves_clip_demo_and_demo_command(tmp_path: Path) -> None:
    env_cache = tmp_path / "cache"
    import os
    os.environ["MMGUARD_CACHE_DIR"] = str(env_cache)
    try:
        p = MmguardProcess([], tmp_path / "serve.log")
    finally:
        del os.environ["MMGUARD_CACHE_DIR"]
    try:
        url = f"127.0.0.1:{p.ports['grpc']}"
        _wait_ready(url, "clip_demo")
        demo = subprocess.run([sys.executable, "-m", "proxy.cli", "demo", "--url", url,
                               "--http", f"127.0.0.1:{p.ports['http']}",
                               "--admin", f"http://127.0.0.1:{p.ports['admin']}"],
                              capture_output=True, text=True, timeout=60)
        assert demo.returncode == 0, demo.stdout + demo.stderr
        assert "similarity (image vs text):" in demo.stdout
        assert (env_cache / "models" / "clip_demo" / "1" / "model.onnx").exists()
        providers = p.wait_log("loaded model 'clip_demo'")
        assert providers["providers"] == ["CPUExecutionProvider"]
    finally:
        assert p.stop() == 0


def test_sighup_reload_keeps_old_config_when_new_one_is_bad(tmp_path: Path,
                                                            ort_models: Path) -> None:
    cfg = ort_config(ort_models)
    cfg["models"] = [{"name": "identity_fp32", "backend": "ort"}]
    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = MmguardProcess(["--config", str(path)], tmp_path / "serve.log")
    try:
        url = f"127.0.0.1:{p.ports['grpc']}"
        _wait_ready(url, "identity_fp32")
        path.write_text("models: [{name: x, backend: nowhere}]\nbackends: []\n")
        p.signal(signal.SIGHUP)
        p.wait_log("config reload rejected")
        np.testing.assert_array_equal(_identity(url), [1, 2, 3])  # old config still serves
        cfg["models"] = [{"name": "identity_fp32", "backend": "ort"},
                         {"name": "echo", "backend": "ort", "backend_model": "identity_fp32"}]
        path.write_text(yaml.safe_dump(cfg))
        p.signal(signal.SIGHUP)
        p.wait_log("config reloaded from")
        _wait_ready(url, "echo")
        np.testing.assert_array_equal(_identity(url, "echo"), [1, 2, 3])
    finally:
        assert p.stop() == 0


def test_bad_config_file_refuses_to_start(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("backends: []\nmodels: [{name: m, backend: ghost}]\n")
    r = subprocess.run([sys.executable, "-m", "proxy.cli", "serve", "--config", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "model 'm' names backend 'ghost'" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_stop_cleanly(tmp_path: Path, ort_models: Path, sig: int) -> None:
    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump(ort_config(ort_models)))
    p = MmguardProcess(["--config", str(path)], tmp_path / "serve.log")
    _wait_ready(f"127.0.0.1:{p.ports['grpc']}", "identity_fp32")
    p.signal(sig)
    assert p.proc.wait(30) == 0
    p.wait_log("stopped")
    p.stop()


@pytest.mark.triton
def test_sigterm_drains_in_flight_requests(tmp_path: Path, triton: TritonServer) -> None:
    """A request in flight when SIGTERM arrives still gets its answer; then the process exits 0
    and the port is closed."""
    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump({**triton_routes(triton, ["slow_fp32"]),
                                    "shutdown_grace_s": 10}))
    p = MmguardProcess(["--config", str(path)], tmp_path / "serve.log")
    url = f"127.0.0.1:{p.ports['grpc']}"
    _wait_ready(url, "g_slow_fp32")
    body = grpc_request("g_slow_fp32", [
        ("x", "FP32", [1, 2], np.ones(2, "<f4").tobytes()),
        ("delay_ms", "INT32", [1, 1], np.array([1500], "<i4").tobytes())])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(grpc_infer_raw, url, body, 20)
        time.sleep(0.5)  # the request is now inside Triton
        p.signal(signal.SIGTERM)
        resp, _ = pending.result(20)
    assert pb.ModelInferResponse.FromString(resp).outputs[0].name == "y"
    assert p.proc.wait(30) == 0
    with pytest.raises(grpc.RpcError) as exc:
        grpc_infer_raw(url, body, 2)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    p.stop()


def test_sigterm_drains_the_http_fast_lane(tmp_path: Path, triton: TritonServer) -> None:
    """The same over HTTP, on the fast lane: the infer request in flight gets its answer
    (with ``Connection: close``: the connection ends with the process), an idle keep-alive
    connection is closed at once, and the process exits 0."""
    import json
    import socket

    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump({**triton_routes(triton, ["slow_fp32"]),
                                    "shutdown_grace_s": 10}))
    p = MmguardProcess(["--config", str(path)], tmp_path / "serve.log")
    _wait_ready(f"127.0.0.1:{p.ports['grpc']}", "g_slow_fp32")
    body = json.dumps({"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 1.0]},
        {"name": "delay_ms", "datatype": "INT32", "shape": [1, 1], "data": [1500]}]}).encode()
    request = (b"POST /v2/models/h_slow_fp32/infer HTTP/1.1\r\nHost: a\r\nContent-Type: "
               b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
    with socket.create_connection(("127.0.0.1", p.ports["http"]), timeout=20) as busy, \
            socket.create_connection(("127.0.0.1", p.ports["http"]), timeout=20) as idle:
        quick = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1],
                                        "data": [2.0]}]}).encode()
        idle.sendall((b"POST /v2/models/h_slow_fp32/infer HTTP/1.1\r\nHost: a\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(quick)) + quick)
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")  # on the lane, then idle
        busy.sendall(request)
        time.sleep(0.5)  # the request is now inside Triton
        p.signal(signal.SIGTERM)
        answer = b""
        while chunk := busy.recv(65536):
            answer += chunk
        assert idle.recv(4096) == b""  # closed, with nothing said
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), answer[:300]
    assert b"Connection: close" in head
    assert json.loads(payload)["outputs"][0]["data"] == [1.0, 1.0]
    assert p.proc.wait(30) == 0
    p.stop()
