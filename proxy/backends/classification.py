"""Triton's classification extension, for backends that run the model in-process.

A client asks for ``classification: k`` on a requested output and gets, instead of the scores,
the k largest as BYTES ``"score:index"`` — one row per batch entry when the model batches — in
the form Triton answers (seen from Triton 2.51): floats as ``%f``, integers as they are, k cut
to the number of scores, non-numeric outputs refused. Triton computes this for its own
backends; for ONNX Runtime mmguard must, or the request would be answered with the raw scores,
a silent wrong answer. (No labels: an ONNX file has no labels file.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from proxy.errors import ErrorKind, ProxyError
from proxy.tensor import Tensor, encode_bytes_elements

_INTEGERS = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                       "INT64"})
_FLOATS = frozenset({"FP32", "FP64"})


def class_count(name: str, parameters: dict[str, Any]) -> int:
    """The ``classification`` parameter of a requested output (0: not asked for)."""
    k = parameters.get("classification", 0)
    if type(k) is not int or k < 0:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"output '{name}': 'classification' must be a non-negative integer, "
                         f"got {k!r}")
    return k


def classify(t: Tensor, k: int, batched: bool, model: str) -> Tensor:
    """The top ``k`` of ``t`` as Triton's classification output (same name, BYTES)."""
    if t.datatype not in _INTEGERS | _FLOATS:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"model '{model}': class result not available for output '{t.name}' "
                         f"due to unsupported type '{t.datatype}'")
    scores = t.numpy()
    rows = scores.reshape(scores.shape[0] if batched and scores.ndim else 1, -1)
    k = min(k, rows.shape[1])
    # Stable, highest first; float64 keys so unsigned values cannot wrap when negated.
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    show = "{:f}:{}".format if t.datatype in _FLOATS else "{}:{}".format
    items = [show(row[i], int(i)).encode() for row, idx in zip(rows, order, strict=True)
             for i in idx]
    shape = (rows.shape[0], k) if batched and scores.ndim else (k,)
    return Tensor(t.name, "BYTES", shape, raw=encode_bytes_elements(items))
