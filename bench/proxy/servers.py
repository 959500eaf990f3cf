"""The servers ``python -m bench.proxy`` starts: a real Triton, mmguard routing to it and to
in-process ONNX Runtime (the identity models written here), nginx in front of the same Triton,
and the bare Python pass-through (``--floor``). Each is its own process, stopped with the
bench (and sent SIGTERM if the bench dies: ``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import os
import shutil
import signal
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    MmguardProcess,
    free_ports,
    http_status,
    pdeathsig,
    stop_process,
)
from bench.proxy.cases import CASES, ORT_IN, ORT_OUT
from tests.support.triton import TritonServer

NGINX_TEMPLATE = ROOT / "bench" / "nginx.conf.template"


def write_ort_models(model_dir: Path) -> dict[str, Path]:
    """FP32 identity ONNX models with fixed inner dims: [batch,3,224,224] and [batch,16]."""
    import onnx
    from onnx import TensorProto, helper

    paths: dict[str, Path] = {}
    for case in CASES:
        dims: list[str | int | None] = ["batch", *case.shape[1:]]
        graph = helper.make_graph(
            [helper.make_node("Identity", [ORT_IN], [ORT_OUT])], case.ort_model,
            [helper.make_tensor_value_info(ORT_IN, TensorProto.FLOAT, dims)],
            [helper.make_tensor_value_info(ORT_OUT, TensorProto.FLOAT, dims)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        path = model_dir / case.ort_model / "1" / "model.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, path)
        paths[case.ort_model] = path
    return paths


def start_triton(root: Path) -> TritonServer:
    from proxy.cli.demo_model import ensure_clip_demo
    from tests.support.triton import triton_available, write_model_repository

    ok, why = triton_available()
    if not ok:
        raise SystemExit(f"cannot start Triton: {why}")
    onnx_path = ensure_clip_demo(root / "clip")
    repo = write_model_repository(root / "models", onnx_path)
    keep = {c.triton_model for c in CASES}
    for entry in repo.iterdir():  # only the two benchmarked models: fewer stubs, faster start
        if entry.is_dir() and entry.name not in keep:
            shutil.rmtree(entry)
    server = TritonServer(repo, root / "work")
    server.start()
    return server


class Mmguard(MmguardProcess):
    def __init__(self, root: Path, triton: TritonServer, ort_dir: Path, ort_threads: int,
                 log_level: str) -> None:
        routes: list[dict[str, Any]] = []
        for c in CASES:
            routes.append({"name": c.triton_model, "backend": "triton_grpc"})
            routes.append({"name": c.http_route, "backend": "triton_http",
                           "backend_model": c.triton_model})
            routes.append({"name": c.ort_model, "backend": "ort"})
        super().__init__(root, {
            "listeners": {"http": {"host": "127.0.0.1"}, "grpc": {"host": "127.0.0.1"},
                          "admin": {"host": "127.0.0.1"}},
            "backends": [
                {"kind": "triton_grpc", "name": "triton_grpc", "url": triton.grpc_url},
                {"kind": "triton_http", "name": "triton_http", "url": f"http://{triton.http_url}"},
                {"kind": "onnxruntime", "name": "ort", "model_dir": str(ort_dir),
                 "models": [c.ort_model for c in CASES], "threads": ort_threads,
                 "intra_op_threads": 1, "device": "cpu"},
            ],
            "models": routes,
            "telemetry": {"log_level": log_level},
            "shutdown_grace_s": 1.0,
        })


class Nginx:
    def __init__(self, root: Path, triton: TritonServer) -> None:
        self.prefix = root / "nginx"
        self.prefix.mkdir(parents=True, exist_ok=True)
        self.conf = self.prefix / "nginx.conf"
        self.triton = triton
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}
        self.binary = shutil.which("nginx")

    def start(self, attempts: int = 3) -> None:
        assert self.binary is not None
        for attempt in range(1, attempts + 1):
            http, grpc_ = free_ports(2)
            self.ports = {"http": http, "grpc": grpc_}
            user = "user root root;" if os.geteuid() == 0 else ""
            text = string.Template(NGINX_TEMPLATE.read_text()).substitute(
                user_line=user, prefix=str(self.prefix), http_port=http, grpc_port=grpc_,
                triton_http_port=self.triton.http_port, triton_grpc_port=self.triton.grpc_port)
            self.conf.write_text(text)
            log = open(self.prefix / "stdout.log", "ab")  # noqa: SIM115 - closed below
            try:
                self.proc = subprocess.Popen(
                    [self.binary, "-c", str(self.conf), "-p", str(self.prefix)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=pdeathsig)
            finally:
                log.close()
            deadline = time.monotonic() + 20
            url = f"http://127.0.0.1:{http}/v2/health/ready"
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if http_status(url) == 200:
                    return
                time.sleep(0.1)
            err = (self.prefix / "error.log")
            tail = err.read_text(errors="replace")[-3000:] if err.exists() else ""
            self.stop()
            if "address already in use" in tail.lower() and attempt < attempts:
                continue
            raise RuntimeError(f"nginx did not start; error.log tail:\n{tail}")

    def pids(self) -> list[int]:
        if self.proc is None:
            return []
        out = [self.proc.pid]
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
            out += [int(p) for p in children.split()]
        except OSError:
            pass
        return out

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout=10)  # SIGTERM: nginx's fast shutdown
        self.proc = None


class Floor:
    """``python -m bench.passthrough_proxy``: a bare grpc.aio/aiohttp pass-through
    (``--floor``)."""

    def __init__(self, root: Path, triton: TritonServer) -> None:
        self.log_path = root / "passthrough.log"
        self.triton = triton
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}

    def start(self, attempts: int = 3) -> None:
        for attempt in range(1, attempts + 1):
            grpc_, http = free_ports(2)
            self.ports = {"grpc": grpc_, "http": http}
            log = open(self.log_path, "ab")  # noqa: SIM115 - closed below
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "bench.passthrough_proxy", str(grpc_), str(http),
                     self.triton.grpc_url, self.triton.http_url], cwd=ROOT,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
                    preexec_fn=pdeathsig)
            finally:
                log.close()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.proc.poll() is None:
                if "ready" in self.log_path.read_text(errors="replace"):
                    return
                time.sleep(0.1)
            tail = self.log_path.read_text(errors="replace")[-3000:]
            self.stop()
            if "address already in use" in tail.lower() and attempt < attempts:
                continue
            raise RuntimeError(f"pass-through proxy did not start; log tail:\n{tail}")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout=10)
        self.proc = None
