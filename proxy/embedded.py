"""The embedded default: what ``mmguard serve`` runs with no config at all — the ``clip_demo``
model on in-process ONNX Runtime, written on first use into the model cache."""

from __future__ import annotations

from pathlib import Path

from proxy.config import Config, parse_config
from proxy.demo_model import CLIP_DEMO, default_model_dir, ensure_clip_demo


def embedded_config(model_dir: Path | None = None) -> Config:
    model_dir = model_dir or default_model_dir()
    ensure_clip_demo(model_dir)
    return parse_config({
        "backends": [{"kind": "onnxruntime", "name": "embedded", "model_dir": str(model_dir),
                      "models": [CLIP_DEMO], "max_batch_size": {CLIP_DEMO: 8}}],
        "models": [{"name": CLIP_DEMO, "backend": "embedded"}],
    }, "embedded default")
