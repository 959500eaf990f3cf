"""``confidence_of`` with ``kind: scalar`` (output_drift, modality_router): the mean decides
whether the whole-array finiteness pass is needed, and the answer is what it always was."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from filters.modality_router import Confidence, confidence_of
from proxy.call import Result
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
