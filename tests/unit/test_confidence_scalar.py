"""``confidence_of`` with ``kind: scalar`` (output_drift, modality_router): the mean decides
whether the whole-array finiteness pass is needed, and the answer is what it always was."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from filters.answer_reads import (
    SKETCH,
    Confidence,
    answer_reads,
    confidence_of,
    sketch_positions,
)
from proxy.call import Call, Result
from proxy.tensor import Tensor

CFG = Confidence(kind="scalar", output="y", range=(-1.0, 1.0))


def _result(a: NDArray[Any], datatype: str) -> Result:
    return Result("m", outputs=[Tensor("y", datatype, a.shape, raw=memoryview(a.tobytes()))])


@pytest.mark.parametrize("datatype,dtype", [("FP32", np.float32), ("FP16", np.float16),
                                            ("FP64", np.float64)])
def test_a_finite_output_reads_its_clipped_mean(datatype: str, dtype: type) -> None:
    a: NDArray[Any] = (np.random.default_rng(1).standard_normal((1, 3, 32, 32)) * 0.3
                       ).astype(dtype)
    want = float(np.clip((np.asarray(a, np.float64).mean() + 1.0) / 2.0, 0, 1))
    assert confidence_of(_result(a, datatype), CFG) == want
    assert 0.0 < want < 1.0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_one_non_finite_value_anywhere_reads_zero(bad: float) -> None:
    a: NDArray[np.float32] = np.full((1, 3, 32, 32), 0.5, np.float32)
    a.flat[1234] = bad
    assert confidence_of(_result(a, "FP32"), CFG) == 0.0


def test_finite_fp64_values_whose_sum_overflows_are_not_read_as_non_finite() -> None:
    a = np.full((8,), 1.7e308)  # each finite; their sum is +inf
    assert confidence_of(_result(a, "FP64"), CFG) == 1.0  # and no overflow warning
    a[3] = -np.inf  # and one that is not
    assert confidence_of(_result(a, "FP64"), CFG) == 0.0


def test_a_large_output_reads_a_fixed_sketch_and_every_value_for_finiteness() -> None:
    a: NDArray[np.float32] = np.full((1, 3, 224, 224), 0.5, np.float32)
    on = sketch_positions(a.size, SKETCH)
    off = np.setdiff1d(np.arange(a.size), on)
    assert len(on) == SKETCH and len(off) == a.size - SKETCH
    assert confidence_of(_result(a, "FP32"), CFG) == 0.75
    a.flat[off] = 0.9  # off the sketch's positions: the mean read does not move...
    assert confidence_of(_result(a, "FP32"), CFG) == 0.75
    a.flat[on] = -0.5  # ...on them it does, by what they say
    assert confidence_of(_result(a, "FP32"), CFG) == 0.25
    a.flat[off[777]] = np.nan  # a NaN off the sketch still reads zero: finiteness is whole
    assert confidence_of(_result(a, "FP32"), CFG) == 0.0


def test_softmax_kinds_read_whole_rows_of_a_large_output() -> None:
    logits = np.zeros((1000, 10), np.float32)
    logits[:, 0] = 10.0  # every row sure of class 0
    cfg = Confidence(kind="max_softmax", output="y")
    sure = confidence_of(_result(logits, "FP32"), cfg)
    assert sure is not None and sure > 0.99
    logits[::2, 0] = 0.0  # half the rows uniform: the sketch's evenly spaced rows see it
    half = confidence_of(_result(logits, "FP32"), cfg)
    assert half is not None and abs(half - (sure + 0.1) / 2) < 0.01


def test_one_call_reads_one_answer_once() -> None:
    a: NDArray[np.float32] = np.full((1, 3, 32, 32), 0.5, np.float32)
    first, second = _result(a, "FP32"), _result(a, "FP32")
    call = Call(model="m", version="", inputs=[])
    reads = answer_reads(call, first)
    assert answer_reads(call, first) is reads  # the router, output_drift and fallback share it
    assert confidence_of(first, CFG, call) == 0.75 and reads.finite("y")
    assert answer_reads(call, second) is not reads  # a retry's new answer is read anew
