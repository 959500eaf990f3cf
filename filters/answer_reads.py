"""What filters read off an answer, read once per call: whether its values are finite, and its
confidence as ``modality_router`` and ``output_drift`` read it.

Guards against a full chain paying for one answer several times: the router, output_drift and
fallback's NaN check each used to walk the whole answer (a float64 copy of a 602 KB identity
answer for each confidence, a finiteness pass for each), ~0.4 ms per call together. Now:

- **finite** is checked over every element, exactly, once per answer and output (a NaN anywhere
  still reads confidence 0 and still fails fallback's ``nan_is_failure``);
- **confidence** is read from a fixed-size sketch of the answer: at most ``SKETCH`` values,
  evenly spaced (``scalar``: elements; ``max_softmax`` / ``entropy``: whole rows of the last
  axis, at least one), in the output's own dtype, widened to float64 only for the sketch. An
  answer of ``SKETCH`` values or fewer is read whole, so small model outputs (class logits,
  scores) read exactly as before; a larger one reads the same positions on every call, so its
  drift baseline and windows compare like with like.

The reads of one answer are kept on the call (its attempts share ``call.state``), keyed by the
answer object itself: a retried or rerouted call that brings another answer reads that one anew.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from proxy.call import Call, CallKey, Result
from proxy.strict import Strict

SKETCH = 4096
"""The most values a confidence reads from one output."""

_FLOATS = ("FP16", "FP32", "FP64")


class Confidence(Strict):
    kind: Literal["max_softmax", "entropy", "scalar", "logprob"]
    """max_softmax / entropy of a named output's last axis; a named scalar output; or vLLM's
    mean token logprob (exp of it) when the request asked for logprobs."""
    output: str | None = None
    range: tuple[float, float] = (0.0, 1.0)
    """scalar: the output's [worst, best]; mapped onto [0, 1] (a cosine: [-1, 1])."""


class AnswerReads:
    """One answer's reads, each made once."""

    __slots__ = ("_arrays", "_confidence", "_finite", "result")

    def __init__(self, result: Result) -> None:
        self.result = result
        self._arrays: dict[str, NDArray[Any]] = {}
        self._finite: dict[str, bool] = {}
        self._confidence: dict[Confidence, float | None] = {}

    def array(self, name: str) -> NDArray[Any] | None:
        """The output as an array (a zero-copy view of raw bytes); None when there is none."""
        found = self._arrays.get(name)
        if found is None:
            out = self.result.output(name)
            if out is None:
                return None
            found = self._arrays[name] = out.numpy()
        return found

    def finite(self, name: str) -> bool:
        """Every value of a float output finite (True for other datatypes). Raises what
        decoding the output raises (``ProxyError``, ``ValueError``) for unreadable bytes."""
        found = self._finite.get(name)
        if found is None:
            out = self.result.output(name)
            if out is None or out.datatype not in _FLOATS:
                found = True
            else:
                x = self.array(name)
                found = x is None or bool(np.isfinite(x).all())
            self._finite[name] = found
        return found

    def all_finite(self) -> bool:
        return all(self.finite(t.name) for t in self.result.outputs)

    def confidence(self, cfg: Confidence) -> float | None:
        """The answer's confidence in [0, 1] as ``cfg`` reads it (None when it cannot)."""
        if cfg not in self._confidence:
            self._confidence[cfg] = self._read(cfg)
        return self._confidence[cfg]

    def _read(self, cfg: Confidence) -> float | None:
        if cfg.kind == "logprob":
            return _logprob(self.result)
        name = cfg.output or ""
        x = self.array(name)
        if x is None or x.size == 0:
            return None
        if not self.finite(name):
            return 0.0
        if cfg.kind == "scalar":
            lo, hi = cfg.range
            sample = _elements(x)
            if x.dtype == np.float64:  # finite FP64 values may sum past the range (to ±inf)
                with np.errstate(over="ignore"):
                    total = float(np.add.reduce(sample, dtype=np.float64))
            else:  # FP16 / FP32 / integers: a float64 sum of 4096 of them cannot overflow
                total = float(np.add.reduce(sample, dtype=np.float64))
            if math.isnan(total):  # FP64 sums that overflowed both ways: no mean to read
                return None
            return min(max((total / sample.size - lo) / (hi - lo), 0.0), 1.0)
        values = np.asarray(_rows(x), dtype=np.float64)
        p = np.exp(values - values.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        if cfg.kind == "max_softmax":
            return float(p.max(axis=-1).mean())
        entropy = -(p * np.log(np.clip(p, 1e-12, 1))).sum(axis=-1)
        return float((1 - entropy / math.log(p.shape[-1])).mean()) if p.shape[-1] > 1 else 1.0


_READS: CallKey[AnswerReads] = CallKey("answer_reads")


def answer_reads(call: Call, result: Result) -> AnswerReads:
    """``result``'s reads, shared by every filter of ``call`` (and of its attempts)."""
    found = call.state.get(_READS)
    if found is None or found.result is not result:
        found = AnswerReads(result)
        call.state.put(_READS, found)
    return found


def confidence_of(result: Result, cfg: Confidence, call: Call | None = None) -> float | None:
    """The answer's confidence in [0, 1] as ``cfg`` reads it (None when it cannot); read once
    per call when the call is given."""
    reads = answer_reads(call, result) if call is not None else AnswerReads(result)
    return reads.confidence(cfg)


def _elements(x: NDArray[Any]) -> NDArray[Any]:
    """At most ``SKETCH`` evenly spaced elements (all of them when there are no more)."""
    flat = x.reshape(-1)
    return flat if flat.size <= SKETCH else flat[sketch_positions(flat.size, SKETCH)]


def _rows(x: NDArray[Any]) -> NDArray[Any]:
    """Whole rows of the last axis, evenly spaced, at most ``SKETCH`` values (at least one row)."""
    rows = x.reshape(-1, x.shape[-1] if x.ndim else 1)
    take = max(1, SKETCH // rows.shape[1])
    return rows if rows.shape[0] <= take else rows[sketch_positions(rows.shape[0], take)]


@functools.lru_cache(maxsize=64)
def sketch_positions(size: int, take: int) -> NDArray[np.intp]:
    """``take`` positions spread evenly over ``size`` (not a fixed stride: a stride would alias
    with a periodic layout, every other row, one channel of an interleaved image)."""
    positions = np.linspace(0, size - 1, take).astype(np.intp)
    positions.flags.writeable = False
    return positions


def _logprob(result: Result) -> float | None:
    if result.wire is None or result.wire.protocol != "openai":
        return None
    doc = json.loads(result.wire.body)
    lps = [t.get("logprob") for c in doc.get("choices") or []
           for t in ((c.get("logprobs") or {}).get("content") or [])]
    lps = [x for x in lps if isinstance(x, (int, float))]
    return float(math.exp(sum(lps) / len(lps))) if lps else None
