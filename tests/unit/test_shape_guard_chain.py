"""``shape_guard`` against the contract the runtime learned: a request the model would
silently cut is refused, naming the input, what came and what the contract says."""

from __future__ import annotations

import numpy as np

from proxy.call import LocalReply, Result
from proxy.errors import ErrorKind
from proxy.tensor import Tensor
from tests.support.chain_harness import ChainHarness, contract_for, x

GUARDED = {"models": [{"name": "m", "filters": [{"shape_guard": {}}]}]}


async def test_a_request_that_fits_the_contract_goes_through_unchanged() -> None:
    async with ChainHarness.open(GUARDED) as h:
        reply = await h.infer("m", [x(rows=4, value=0.5)])
    assert isinstance(reply, Result)
    np.testing.assert_array_equal(reply.outputs[0].numpy(),
                                  np.full((4, 3), 0.5, dtype=np.float32))


async def test_a_wrong_fixed_dimension_is_refused_before_the_backend() -> None:
    wrong = Tensor.from_numpy("x", np.zeros((1, 4), dtype=np.float32))
    async with ChainHarness.open(GUARDED) as h:
        reply = await h.infer("m", [wrong])
    assert isinstance(reply, LocalReply) and reply.kind is ErrorKind.INVALID_ARGUMENT
    assert "'x'" in reply.message and "3" in reply.message and "4" in reply.message
    assert h.backend.calls == []


async def test_a_batch_above_max_batch_size_is_refused() -> None:
    contracts = {"m": contract_for("m", {"x": ("FP32", (-1, 3))}, max_batch_size=2)}
    async with ChainHarness.open(GUARDED, contracts=contracts) as h:
        fits = await h.infer("m", [x(rows=2)])
        too_big = await h.infer("m", [x(rows=3)])
    assert isinstance(fits, Result)
    assert isinstance(too_big, LocalReply)
    assert "3" in too_big.message and "2" in too_big.message
    assert len(h.backend.calls) == 1
