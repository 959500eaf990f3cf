"""``output_drift`` in a real chain: answers go through untouched, and once the baseline is in,
answers that are less sure move the drift gauge off zero."""

from __future__ import annotations

import numpy as np

from proxy.call import Call, Result, Target
from proxy.tensor import Tensor
from tests.support.chain_harness import ChainHarness, contract_for

WATCHED = {"models": [{"name": "m", "filters": [{"output_drift": {
    "outputs": {"score": {"kind": "scalar", "output": "score"}},
    "drift": {"baseline_size": 8, "window": 8, "every": 1}}}]}]}
CONTRACTS = {"m": contract_for("m", {"x": ("FP32", (-1, 3))}, {"score": ("FP32", (1,))})}


def sure_then_unsure(call: Call, target: Target) -> Result:
    """Confidence 0.9 while the input is positive, 0.1 after (the caller decides which)."""
    score = 0.9 if float(call.inputs[0].numpy()[0, 0]) > 0 else 0.1
    return Result(target.model, outputs=[Tensor.from_numpy("score",
                                                           np.array([score], np.float32))])


def drift(h: ChainHarness) -> float | None:
    return h.telemetry.registry.get_sample_value(
        "mmguard_output_drift", {"model": "m", "output": "score", "signal": "confidence"})


def x(value: float) -> Tensor:
    return Tensor.from_numpy("x", np.full((1, 3), value, dtype=np.float32))


async def test_less_sure_answers_move_the_drift_and_pass_unchanged() -> None:
    async with ChainHarness.open(WATCHED, answer=sure_then_unsure, contracts=CONTRACTS) as h:
        for _ in range(16):  # the baseline, then a window just like it
            reply = await h.infer("m", [x(1.0)])
        steady = drift(h)
        for _ in range(8):
            reply = await h.infer("m", [x(-1.0)])
        moved = drift(h)
    assert isinstance(reply, Result)
    assert float(reply.outputs[0].numpy()[0]) == np.float32(0.1)  # the backend's, untouched
    assert steady == 0.0
    assert moved is not None and moved > 0.5  # W1 between 0.9 and 0.1 is 0.8
