"""The embedded default: what ``mmguard serve`` runs with no config at all — the ``clip_demo``
model on in-process ONNX Runtime (written on first use into the model cache), behind the guard
chain mmguard is for, so that the first run shows it (``mmguard demo`` walks through it):

- ``shape_guard``: a text longer than the 77 tokens the model reads is refused with the counts
  (the demo model takes ``input_ids`` of any width here, so the guard sees the whole text);
- ``quality``: NaN / inf pixels are refused; a dark image is answered and annotated;
- ``fallback``: a breaker, and a cache of last good answers;
- ``shadow``: every call mirrored to ``clip_demo_canary`` (the same model: they agree) and the
  answers compared, so ``mmguard status`` has a verdict to show;
- ``fault``: a small experiment (gaussian noise, σ 0.02) on canary-marked calls only.

Why the listeners bind 127.0.0.1 and trust the ``x-canary`` header here, and only here: a
client that sets canary headers opts itself into fault injection, which no untrusted client may
do (proxy/engine/canary.py strips them unless the listener trusts them). On loopback the only
clients are processes of this machine, and the model is a demo with no one else's traffic, so
letting
``mmguard demo`` send ``x-canary: 1`` harms no one. A config file is needed to serve the
network; its listeners trust nothing unless it says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from proxy.cli.demo_model import CLIP_DEMO, CONTEXT_LENGTH, default_model_dir, ensure_clip_demo
from proxy.config.model import Config, parse_config

CLIP_DEMO_CANARY = f"{CLIP_DEMO}_canary"
CANARY_HEADER = "x-canary"
FAULT_EXPERIMENT = "demo-noise"
LOOPBACK = "127.0.0.1"


def embedded_filters() -> list[dict[str, Any]]:
    """The guard chain of the embedded ``clip_demo`` route, outermost first."""
    return [
        {"limits": {"max_batch": 8, "max_in_flight": 64}},
        {"shape_guard": {"on_batch": "split", "inputs": {"input_ids": {
            # any width reaches the guard, which counts the tokens up to the last non-pad id
            "dims": [-1, -1], "max_tokens": CONTEXT_LENGTH, "pad_token_id": 0}}}},
        {"quality": {"images": {"pixel_values": {"layout": "NCHW", "range": [0.0, 1.0]}},
                     "rules": [{"signal": "finite", "below": 1.0, "action": "reject"},
                               # the calibrated default (docs/quality.md: flags no clean
                               # photo, document, screenshot or illustration)
                               {"signal": "exposure", "below": 0.6, "action": "annotate"}],
                     "drift": None}},
        {"fallback": {"breaker": {"failure_rate": 0.5, "minimum_calls": 10,
                                  "wait_in_open_s": 10},
                      "cache": {"size": 256, "ttl_s": 300}}},
        {"shadow": {"canary": CLIP_DEMO_CANARY, "percent": 100}},
        {"fault": {"experiments": [{
            "name": FAULT_EXPERIMENT, "seed": 7,
            "actions": [{"kind": "gaussian_noise", "sigma": 0.02, "percent": 100}],
            "stop": {"window_s": 30, "min_requests": 20, "max_error_rate": 0.05}}]}},
    ]


def embedded_config(model_dir: Path | None = None) -> Config:
    model_dir = model_dir or default_model_dir()
    ensure_clip_demo(model_dir)
    return parse_config({
        "listeners": {"http": {"host": LOOPBACK, "trust_canary_headers": True},
                      "grpc": {"host": LOOPBACK, "trust_canary_headers": True}},
        "canary": {"headers": {CANARY_HEADER: "1"}},
        "backends": [{"kind": "onnxruntime", "name": "embedded", "model_dir": str(model_dir),
                      "models": [CLIP_DEMO], "max_batch_size": {CLIP_DEMO: 8}}],
        "models": [{"name": CLIP_DEMO, "backend": "embedded", "filters": embedded_filters()},
                   {"name": CLIP_DEMO_CANARY, "backend": "embedded", "backend_model": CLIP_DEMO,
                    "filters": [{"limits": {"max_batch": 8, "max_in_flight": 64}}]}],
    }, "embedded default")
