from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.mmguard import RunningMmguard
from tests.support.models import IDENTITY_TYPES, ort_repository


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
