"""``ModelContract``: what a backend really accepts and returns, learned from the backend.

Backends build it once at start-up (and again when the model changes); the fronts render model
metadata and config from it, and filters (shape guard, router, fallback) read it. Nobody else
re-discovers a model's interface.

A Triton model config MUST reach a client in the form Triton itself gives that protocol, because
clients read it (Triton's image_client.py reads ``max_batch_size``, the input ``format`` and
``dims``): over HTTP the JSON that Triton's ``/config`` returns — every field of the schema in
declaration order, zero values and empty lists included, 64-bit integers as numbers — and over
gRPC the ``ModelConfig`` message. Both are rendered here, through the full schema that
tritonclient ships (mmguard's own ``proxy/pb`` holds only the fields it reads), so a config from
either backend protocol is rendered for either front without losing a field.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from tritonclient.grpc import model_config_pb2 as triton_config

from proxy.errors import ErrorKind, ProxyError


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
    config_pb: bytes = field(default=b"", compare=False)  # the ModelConfig a gRPC backend sent

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)

    def statistics_version(self, model: str, asked: str) -> str:
        """The version a statistics entry of ``model`` names, as Triton writes it: ``asked``
        (refused, as Triton refuses it, when the backend has no such version), else the
        latest."""
        if asked and self.versions and asked not in self.versions:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT, "requested model version is not "
                             f"available for model '{model}'")
        return asked or max(self.versions, key=lambda v: (len(v), v), default="")

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
        """Triton's model-config object as its HTTP ``/config`` renders it; the backend's own
        when it has one."""
        if self.config:
            return self.config
        return config_to_json(self._config_message())

    def config_bytes(self) -> bytes:
        """The same config as a serialized Triton ``ModelConfig`` (what gRPC ``ModelConfig``
        returns): a gRPC backend's own bytes, else the JSON form parsed into the full schema."""
        if self.config_pb:
            return self.config_pb
        if self.config:
            msg = json_format.ParseDict(self.config, triton_config.ModelConfig(),
                                        ignore_unknown_fields=True)
            return bytes(msg.SerializeToString())
        return bytes(self._config_message().SerializeToString())

    def _config_message(self) -> Message:
        """A config for a model that has none of its own (ONNX Runtime in-process)."""
        batch = self.max_batch_size > 0
        msg = triton_config.ModelConfig(name=self.name, platform=self.platform,
                                        max_batch_size=self.max_batch_size)
        msg.version_policy.latest.num_versions = 1
        for t in self.inputs:
            msg.input.add(name=t.name, data_type=_cfg_enum(t.datatype),
                          dims=list(t.dims[1:] if batch else t.dims), optional=t.optional)
        for t in self.outputs:
            msg.output.add(name=t.name, data_type=_cfg_enum(t.datatype),
                           dims=list(t.dims[1:] if batch else t.dims))
        if self.decoupled:
            msg.model_transaction_policy.decoupled = True
        return msg


def config_from_pb(raw: bytes) -> dict[str, Any]:
    """A serialized ``ModelConfig`` → Triton's HTTP JSON form of it."""
    return config_to_json(triton_config.ModelConfig.FromString(raw))


def config_to_json(msg: Message) -> dict[str, Any]:
    """A protobuf message as Triton's HTTP server prints a model config: fields in declaration
    order; repeated fields, maps and scalars always (zero values included), a message or a oneof
    member only when set; enums by name; 64-bit integers as JSON numbers (protobuf's own JSON
    printer writes them as strings, which broke clients reading ``dims``)."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.is_repeated:
            entry = f.message_type
            if entry is not None and entry.GetOptions().map_entry:
                vf = entry.fields_by_name["value"]
                out[f.name] = {str(k): _json_value(vf, v) for k, v in value.items()}
            else:
                out[f.name] = [_json_value(f, v) for v in value]
        elif not f.has_presence or msg.HasField(f.name):
            out[f.name] = _json_value(f, value)
    return out


def _json_value(f: FieldDescriptor, value: Any) -> Any:
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        return config_to_json(value)
    if f.type == FieldDescriptor.TYPE_ENUM:
        named = f.enum_type.values_by_number.get(value)
        return named.name if named is not None else value
    if f.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode()
    if f.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return _json_number(value, f.type == FieldDescriptor.TYPE_FLOAT)
    return value  # int64 included: a JSON number, as Triton writes it


def _json_number(value: float, single: bool) -> float | int | str:
    """A float as protobuf's C++ printer writes it: the shortest text that reads back (for a
    float field, as a 32-bit float: 0.1, not 0.10000000149011612), whole numbers without a
    fraction (0, not 0.0)."""
    if not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if single:
        value = float(str(np.float32(value)))
    if value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def fingerprint(*parts: Any) -> str:
    """SHA-256 over a canonical JSON rendering of ``parts``."""
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _cfg_enum(datatype: str) -> int:
    name = "TYPE_" + ("STRING" if datatype == "BYTES" else datatype)
    return int(triton_config.DataType.Value(name))


def _spec_json(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "datatype": t.datatype, "shape": list(t.dims)}
