"""Is a backend's answer readable? Every output's bytes must fit its shape and datatype.

A backend that sends an FP32 [256] output as 1020 bytes, or BYTES elements whose length prefixes
run past the payload, has sent an answer no client can read correctly; forwarded as a 200 it
becomes a silent wrong answer (a client's ``as_numpy`` reads garbage or fails far from the
cause). So every answer is checked where it is decoded, on every path — gRPC and HTTP backends,
binary and JSON tensors, forwarded unchanged or re-encoded, ONNX Runtime too — before any filter
or front sees it. The check reads lengths only: no tensor is copied or converted.

A failed check is ``INTERNAL`` with ``origin="backend"``, naming the backend, the model and the
output, so the fallback filter counts it as the backend failing and moves to its next level.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from proxy.errors import ErrorKind, ProxyError
from proxy.tensor import DATATYPES, Payload, Tensor, check_bytes_elements, itemsize


def answer_source(backend: str, model: str) -> str:
    """Who sent an answer, as the errors about it name them."""
    return f"backend '{backend}' for model '{model}'"


def answer_error(source: str, message: str) -> ProxyError:
    """``source`` names the sender: ``backend 'triton' for model 'clip'``."""
    return ProxyError(ErrorKind.BAD_GATEWAY, f"{source} answered outside its contract: {message}",
                      origin="backend")


def check_outputs(outputs: Iterable[Tensor], source: str) -> None:
    """Raise INTERNAL unless every output's payload matches its shape × datatype."""
    for t in outputs:
        problem = output_problem(t.name, t.datatype, t.shape, t.raw, t.data)
        if problem is not None:
            raise answer_error(source, problem)


def output_problem(name: str, datatype: str, shape: tuple[int, ...], raw: Payload | None,
                   data: list[Any] | None = None) -> str | None:
    """Why this output cannot be read, or None when it fits. On every answer's path: the
    common case (a fixed-size datatype that fits) is a few lookups and one multiplication."""
    size = _ITEMSIZE.get(datatype, -1)
    if size == -1:
        return f"output '{name}' has unknown datatype {datatype!r}"
    if shape and min(shape) < 0:
        return f"output '{name}' has shape {list(shape)} with a negative dim"
    elements = math.prod(shape)
    if raw is None:
        count = _leaves(data or [])
        if count != elements:
            return (f"output '{name}': {datatype} shape {list(shape)} needs {elements} "
                    f"elements, the JSON data has {count}")
        return None
    if size is not None:
        if len(raw) != elements * size:
            return (f"output '{name}': {datatype} shape {list(shape)} needs {elements * size} "
                    f"bytes, got {len(raw)}")
        return None
    return _bytes_problem(name, raw, elements)


_ITEMSIZE: dict[str, int | None] = {dt: itemsize(dt) for dt in DATATYPES}


def _bytes_problem(name: str, raw: Payload, elements: int) -> str | None:
    """BYTES framing: exactly ``elements`` length-prefixed items (the inputs' own check, whose
    cost is bounded by the shape, never by what the payload claims)."""
    try:
        check_bytes_elements(raw, elements, name)
    except ProxyError as err:
        return f"output '{name}': " + err.message.removeprefix(f"input '{name}': ")
    return None


def _leaves(data: list[Any]) -> int:
    """Elements of a (possibly nested) JSON list, without building a flat copy."""
    count, stack = 0, [data]
    while stack:
        for x in stack.pop():
            if isinstance(x, list):
                stack.append(x)
            else:
                count += 1
    return count
