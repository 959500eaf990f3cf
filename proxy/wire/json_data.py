"""A v2 input's JSON ``data`` read as Triton's HTTP front reads it.

Triton flattens any nesting (ragged rows and empty ones included) and holds only the element
count to the shape; it casts each double to the datatype (an FP32 element past float32's range
is ±inf). Python's numpy would refuse a ragged list ("inhomogeneous shape"), wrap an integer
out of range, and cut 1.5 to 1: each is decided here as Triton decides it, or refused.

What MUST hold: the elements are counted before anything is built from them (a shape of [1]
with a million numbers is refused after ``2 × count + 1024`` of them), without recursion.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from proxy.errors import ErrorKind, ProxyError
from proxy.tensor import Tensor, itemsize


def _bad(message: str) -> ProxyError:
    return ProxyError(ErrorKind.INVALID_ARGUMENT, message)


def elements(t: Tensor) -> list[Any]:
    """The elements of 'data' in order, whatever its nesting (Triton flattens it, ragged rows
    and empty ones included, and holds only their count to the shape's), counted before any
    conversion: a shape of [1] with a million numbers is refused without building them all."""
    assert t.data is not None
    count = t.elements
    limit = 2 * count + 1024  # exact counts for small mistakes, a bound for huge lists
    found = _flat_elements(t.data, limit)
    held = len(found)
    if held == count:
        return found
    exact = held <= limit
    got = f"{held}" if exact else f"more than {limit}"
    size = itemsize(t.datatype)
    if size is None:
        raise _bad(f"{_SHAPE_MISMATCH} (input '{t.name}': shape needs {count} BYTES elements, "
                  f"got {got} in 'data')")
    got_bytes = f"{held * size}" if exact else f"more than {limit * size}"
    raise _bad(f"{_SHAPE_MISMATCH} (input '{t.name}': {t.datatype} shape {list(t.shape)} needs "
              f"{count * size} bytes, got {got_bytes}: {got} elements in 'data')")


_SHAPE_MISMATCH = "Unable to parse 'data': Shape does not match true shape of 'data' field"
"""Triton's words (with HTTP 500 there; a client's mistake is 400 here, as on Triton's gRPC)."""


def _flat_elements(data: list[Any], limit: int) -> list[Any]:
    """The leaves of a (possibly nested) JSON list, in order, up to ``limit + 1`` of them;
    without recursion (the nesting is as deep as the parser allowed)."""
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                stack.append(iter(x))
                break
            out.append(x)
            if len(out) > limit:
                return out
        else:
            stack.pop()
    return out


def convert(t: Tensor) -> None:
    """``t.data`` (flat) converted as Triton converts it; an FP32 element past float32's range
    becomes ±inf, as Triton's cast of the double makes it."""
    try:
        if t.datatype in _INT_RANGES:
            _check_int_range(t)
        if t.datatype == "FP32":
            with np.errstate(over="ignore"):
                raw = np.asarray(t.data, dtype=np.float64).astype(np.float32).tobytes()
        else:
            raw = t.to_raw()
    except (ValueError, TypeError, OverflowError) as exc:
        raise _bad(f"input '{t.name}': data does not fit {t.datatype}: {exc}") from None
    t.raw, t.data = raw, None  # check_payload then reports any count mismatch exactly


_INT_RANGES = {dt: (int(np.iinfo(t).min), int(np.iinfo(t).max)) for dt, t in (
    ("INT8", np.int8), ("INT16", np.int16), ("INT32", np.int32), ("INT64", np.int64),
    ("UINT8", np.uint8), ("UINT16", np.uint16), ("UINT32", np.uint32), ("UINT64", np.uint64))}


def _check_int_range(t: Tensor) -> None:
    """numpy 1.x wraps an out-of-range integer (256 → 0 for UINT8) with only a warning, and cuts
    1.5 to 1: the model would get another value than the client sent. Refuse both instead."""
    lo, hi = _INT_RANGES[t.datatype]
    arr = np.asarray(t.data)
    if arr.dtype.kind == "f":
        fractional = ~(np.isfinite(arr) & (arr == np.floor(arr)))
        if fractional.any():  # numpy would cut 1.5 to 1
            raise ValueError(f"{float(arr[fractional].flat[0])!r} is not a whole number")
    values = arr.reshape(-1).tolist() if arr.dtype.kind not in "iuf" else None
    if values is not None:  # an object array: nulls, strings, bools, or ints past 64 bits
        for x in values:
            if not isinstance(x, int) or isinstance(x, bool):
                raise ValueError(f"{x!r} is not an integer")
    if arr.size:
        low, high = (min(values), max(values)) if values is not None else (
            int(arr.min()), int(arr.max()))
        if low < lo or high > hi:
            raise ValueError(f"{low if low < lo else high} is outside [{lo}, {hi}]")
