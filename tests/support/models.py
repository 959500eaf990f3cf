"""Small ONNX models made at test time (deterministic, no torch)."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from proxy.cli.demo_model import ensure_clip_demo

IDENTITY_TYPES = {
    "FP32": TensorProto.FLOAT, "FP16": TensorProto.FLOAT16, "BF16": TensorProto.BFLOAT16,
    "INT64": TensorProto.INT64, "BOOL": TensorProto.BOOL, "BYTES": TensorProto.STRING,
}


def save_graph(model_dir: Path, name: str, graph: onnx.GraphProto) -> None:
    """``graph`` as ``<model_dir>/<name>/1/model.onnx`` (opset 17, IR 8: what the installed
    ONNX Runtime reads)."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = model_dir / name / "1" / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)


def write_identity(model_dir: Path, datatype: str) -> str:
    """``identity_<dtype>``: INPUT0 [-1] → OUTPUT0, the same bytes."""
    name = f"identity_{datatype.lower()}"
    t = IDENTITY_TYPES[datatype]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], name,
        [helper.make_tensor_value_info("INPUT0", t, ["n"])],
        [helper.make_tensor_value_info("OUTPUT0", t, ["n"])])
    save_graph(model_dir, name, graph)
    return name


def ort_repository(model_dir: Path) -> Path:
    """clip_demo plus identity models for every datatype the byte-identity tests use."""
    ensure_clip_demo(model_dir)
    for dt in IDENTITY_TYPES:
        write_identity(model_dir, dt)
    write_text_encoder(model_dir)
    return model_dir


def write_text_encoder(model_dir: Path) -> str:
    """``text_encoder``: input_ids INT64 [batch, seq] (seq symbolic, so ONNX Runtime accepts
    any length) → text_embeds FP32 [batch, 8], the mean of a fixed embedding table's rows."""
    import numpy as np
    from onnx import numpy_helper

    table = np.random.default_rng(7).standard_normal((49408, 8)).astype(np.float32)  # CLIP vocab
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["tok"], axis=0),
         helper.make_node("ReduceMean", ["tok"], ["text_embeds"], axes=[1], keepdims=0)],
        "text_encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("text_embeds", TensorProto.FLOAT, ["batch", 8])],
        initializer=[numpy_helper.from_array(table, "table")])
    save_graph(model_dir, "text_encoder", graph)
    return "text_encoder"


def write_wrong_above_half(model_dir: Path) -> str:
    """``wrong_above_half_fp32``: INPUT0 FP32 [n] → OUTPUT0, the input where it is at most 0.5
    and its negation above: a canary that is wrong on part of the traffic (issue 26)."""
    name = "wrong_above_half_fp32"
    half = helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])
    graph = helper.make_graph(
        [helper.make_node("Greater", ["INPUT0", "half"], ["above"]),
         helper.make_node("Neg", ["INPUT0"], ["negated"]),
         helper.make_node("Where", ["above", "negated", "INPUT0"], ["OUTPUT0"])], name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["n"])], [half])
    save_graph(model_dir, name, graph)
    return name
