from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.demo_model import ensure_clip_demo
from tests.support.mmguard import RunningMmguard
from tests.support.models import IDENTITY_TYPES, ort_repository
from tests.support.triton import TritonServer, triton_available, write_model_repository


@pytest.fixture(scope="session")
def ort_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ort_repository(tmp_path_factory.mktemp("ort_models"))


def ort_config(model_dir: Path, **extra: object) -> dict[str, object]:
    identities = [f"identity_{d.lower()}" for d in IDENTITY_TYPES]
    cfg: dict[str, object] = {
        "backends": [{"kind": "onnxruntime", "name": "ort", "model_dir": str(model_dir),
                      "max_batch_size": {"clip_demo": 8}}],
        "models": [{"name": "clip_demo", "backend": "ort"},
                   *({"name": n, "backend": "ort"} for n in identities)],
    }
    cfg.update(extra)
    return cfg


@pytest.fixture(scope="module")
def ort_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningMmguard]:
    models = ort_repository(tmp_path_factory.mktemp("ort_proxy_models"))
    with RunningMmguard(ort_config(models)) as m:
        m.wait_ready()
        yield m


@pytest.fixture(scope="session")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """One real Triton for the session. Missing binary = a loud failure, never a skip."""
    ok, why = triton_available()
    if not ok:
        pytest.fail(f"real Triton is required for this test and cannot run here: {why}")
    root = tmp_path_factory.mktemp("triton")
    onnx_path = ensure_clip_demo(root / "onnx")
    repo = write_model_repository(root / "repo", onnx_path)
    with TritonServer(repo, root / "work") as server:
        yield server


def triton_routes(triton: TritonServer, models: list[str]) -> dict[str, object]:
    """Every model twice: ``g_<m>`` through the gRPC backend, ``h_<m>`` through HTTP."""
    return {
        "backends": [{"kind": "triton_grpc", "name": "triton-grpc", "url": triton.grpc_url},
                     {"kind": "triton_http", "name": "triton-http", "url": triton.http_url}],
        "models": [*({"name": f"g_{m}", "backend": "triton-grpc", "backend_model": m}
                     for m in models),
                   *({"name": f"h_{m}", "backend": "triton-http", "backend_model": m}
                     for m in models)],
    }
