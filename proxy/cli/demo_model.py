"""The embedded demo model, ``clip_demo``: a tiny CLIP-shaped dual encoder built without torch.

It exists so that ``mmguard serve`` with no config serves a real multimodal model on in-process
ONNX Runtime, and so tests and benchmarks have the same model on every backend. The weights are
drawn from a fixed seed, so the file is byte-identical on every machine; it is written on first
use into the model cache rather than shipped (the text embedding table alone is ~12 MB).

Contract (what MUST hold, tests rely on it):
    inputs   pixel_values FP32 [-1, 3, 224, 224], input_ids INT64 [-1, 77]
    outputs  image_embeds FP32 [-1, 64], text_embeds FP32 [-1, 64] (both L2-normalised),
             similarity FP32 [-1] = cosine of row i's image and text embeddings.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

CLIP_DEMO = "clip_demo"
EMBED_DIM = 64
VOCAB_SIZE = 49408
CONTEXT_LENGTH = 77
IMAGE_SIZE = 224
_SEED = 20261130
_POOL = 28  # 224 / 28 = 8 → 3 × 8 × 8 pooled features


def default_model_dir() -> Path:
    """Where the embedded default keeps its generated model repository."""
    root = os.environ.get("MMGUARD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "mmguard"
    )
    return Path(root) / "models"


def build_clip_demo() -> bytes:
    """Serialise the demo model. Deterministic: the same bytes on every call and machine."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(_SEED)
    pooled = 3 * (IMAGE_SIZE // _POOL) ** 2
    w_img = (rng.standard_normal((pooled, EMBED_DIM)) / np.sqrt(pooled)).astype(np.float32)
    table = rng.standard_normal((VOCAB_SIZE, EMBED_DIM)).astype(np.float32)
    w_txt = (rng.standard_normal((EMBED_DIM, EMBED_DIM)) / np.sqrt(EMBED_DIM)).astype(np.float32)

    inits = [
        numpy_helper.from_array(w_img, "w_img"),
        numpy_helper.from_array(table, "token_table"),
        numpy_helper.from_array(w_txt, "w_txt"),
        numpy_helper.from_array(np.array([1e-6], dtype=np.float32), "eps"),
    ]
    nodes = [
        helper.make_node("AveragePool", ["pixel_values"], ["pooled"],
                         kernel_shape=[_POOL, _POOL], strides=[_POOL, _POOL]),
        helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "w_img"], ["img_raw"]),
        helper.make_node("ReduceL2", ["img_raw"], ["img_norm"], axes=[1], keepdims=1),
        helper.make_node("Add", ["img_norm", "eps"], ["img_den"]),
        helper.make_node("Div", ["img_raw", "img_den"], ["image_embeds"]),
        helper.make_node("Gather", ["token_table", "input_ids"], ["tok"], axis=0),
        helper.make_node("ReduceMean", ["tok"], ["txt_mean"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["txt_mean", "w_txt"], ["txt_raw"]),
        helper.make_node("ReduceL2", ["txt_raw"], ["txt_norm"], axes=[1], keepdims=1),
        helper.make_node("Add", ["txt_norm", "eps"], ["txt_den"]),
        helper.make_node("Div", ["txt_raw", "txt_den"], ["text_embeds"]),
        helper.make_node("Mul", ["image_embeds", "text_embeds"], ["prod"]),
        helper.make_node("ReduceSum", ["prod"], ["similarity"], keepdims=0,
                         noop_with_empty_axes=0),
    ]
    # ReduceSum takes axes as an input from opset 13 on.
    inits.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "sum_axes"))
    nodes[-1].input.append("sum_axes")

    graph = helper.make_graph(
        nodes,
        CLIP_DEMO,
        inputs=[
            helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT,
                                          ["batch", 3, IMAGE_SIZE, IMAGE_SIZE]),
            helper.make_tensor_value_info("input_ids", TensorProto.INT64,
                                          ["batch", CONTEXT_LENGTH]),
        ],
        outputs=[
            helper.make_tensor_value_info("image_embeds", TensorProto.FLOAT, ["batch", EMBED_DIM]),
            helper.make_tensor_value_info("text_embeds", TensorProto.FLOAT, ["batch", EMBED_DIM]),
            helper.make_tensor_value_info("similarity", TensorProto.FLOAT, ["batch"]),
        ],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="mmguard", producer_version="1")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def ensure_clip_demo(model_dir: Path | None = None) -> Path:
    """Write ``clip_demo/1/model.onnx`` under ``model_dir`` unless an identical file is there."""
    model_dir = model_dir or default_model_dir()
    path = model_dir / CLIP_DEMO / "1" / "model.onnx"
    data = build_clip_demo()
    if path.exists() and _sha256(path.read_bytes()) == _sha256(data):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".onnx.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # atomic: a concurrent reader never sees half a model
    return path


def tokenize(text: str) -> NDArray[np.int64]:
    """A stand-in tokenizer for the demo: word hashes, 0-padded to 77 ids. Not CLIP's BPE."""
    ids = [1 + zlib.crc32(w.encode()) % (VOCAB_SIZE - 1) for w in text.lower().split()]
    out = np.zeros(CONTEXT_LENGTH, dtype=np.int64)
    out[: min(len(ids), CONTEXT_LENGTH)] = ids[:CONTEXT_LENGTH]
    return out


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
