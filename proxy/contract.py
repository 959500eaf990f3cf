"""``ModelContract``: what a backend really accepts and returns, learned from the backend.

Backends build it once at start-up (and again when the model changes); the fronts render model
metadata and config from it, and filters (shape guard, router, fallback) read it. Nobody else
re-discovers a model's interface.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    dims: tuple[int, ...]  # full shape as the metadata shows it; -1 = dynamic
    optional: bool = False


@dataclass(frozen=True, slots=True)
class ModelContract:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int = 0  # > 0: the leading -1 of every dim list is the batch dimension
    decoupled: bool = False
    context_length: int | None = None  # vLLM max_model_len, a text encoder's token limit
    accepts_images: bool | None = None  # None: not known
    fingerprint: str = ""
    config: dict[str, Any] = field(default_factory=dict, compare=False)  # Triton-style, JSON form

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)

    def metadata_json(self) -> dict[str, Any]:
        """The v2 model-metadata object."""
        return {
            "name": self.name,
            "versions": list(self.versions),
            "platform": self.platform,
            "inputs": [_spec_json(t) for t in self.inputs],
            "outputs": [_spec_json(t) for t in self.outputs],
        }

    def config_json(self) -> dict[str, Any]:
        """Triton's model-config object; the backend's own when it has one."""
        if self.config:
            return self.config
        batch = self.max_batch_size > 0

        def dims(t: TensorSpec) -> list[int]:
            return list(t.dims[1:] if batch else t.dims)

        return {
            "name": self.name,
            "platform": self.platform,
            "max_batch_size": self.max_batch_size,
            "input": [{"name": t.name, "data_type": "TYPE_" + _cfg_type(t.datatype),
                       "dims": dims(t), "optional": t.optional} for t in self.inputs],
            "output": [{"name": t.name, "data_type": "TYPE_" + _cfg_type(t.datatype),
                        "dims": dims(t)} for t in self.outputs],
            "model_transaction_policy": {"decoupled": self.decoupled},
        }


def fingerprint(*parts: Any) -> str:
    """SHA-256 over a canonical JSON rendering of ``parts``."""
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def config_datatype(cfg_type: str) -> str:
    """Triton config type (``TYPE_FP32``, ``TYPE_STRING``) → v2 datatype (``FP32``, ``BYTES``)."""
    t = cfg_type.removeprefix("TYPE_")
    return "BYTES" if t == "STRING" else t


def _cfg_type(datatype: str) -> str:
    return "STRING" if datatype == "BYTES" else datatype


def _spec_json(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "datatype": t.datatype, "shape": list(t.dims)}
