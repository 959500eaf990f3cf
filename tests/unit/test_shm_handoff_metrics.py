"""The hand-off pool's counts on a Telemetry registry: every series at 0 once bound, the slot
gauges follow registration, use and restarts, and a late "unknown region" answer from before a
re-registration does not forget the slots registered since."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from proxy.backends.shm_handoff import INLINE_REASONS, HandoffPool
from proxy.call import Call
from proxy.contract import ModelContract, TensorSpec
from proxy.telemetry import Telemetry
from proxy.tensor import Tensor

SMALL = ModelContract("small", ("1",), "python",
                      inputs=(TensorSpec("x", "FP32", (-1, 16)),),
                      outputs=(TensorSpec("y", "FP32", (-1, 16)),), max_batch_size=8)


def value(telemetry: Telemetry, name: str, **labels: str) -> float | None:
    return telemetry.registry.get_sample_value(name, {"backend": "t", **labels})


async def accept(name: str, key: str, size: int) -> None:
    return None


def small_call() -> Call:
    return Call(model="small", version="",
                inputs=[Tensor.from_numpy("x", np.ones((1, 16), np.float32))])


def test_every_series_starts_at_zero_and_follows_the_pool(tmp_path: Path) -> None:
    telemetry = Telemetry()
    pool = HandoffPool("t", 3, 1 << 20, tmp_path)
    pool.bind(telemetry)
    pool.contracts["small"] = SMALL
    for reason in INLINE_REASONS:
        assert value(telemetry, "mmguard_shm_handoff_inline_total", reason=reason) == 0
    for result in ("ok", "failed"):
        assert value(telemetry, "mmguard_shm_handoff_registrations_total", result=result) == 0
    assert value(telemetry, "mmguard_shm_handoff_slots") == 0
    assert asyncio.run(pool.ensure(accept))
    assert value(telemetry, "mmguard_shm_handoff_slots") == 3
    assert value(telemetry, "mmguard_shm_handoff_slot_bytes") == pool.all[0].size
    plans = [pool.plan(small_call(), "small") for _ in range(4)]
    assert plans[3] is None and all(p is not None for p in plans[:3])
    assert value(telemetry, "mmguard_shm_handoff_slots_in_use") == 3
    assert value(telemetry, "mmguard_shm_handoff_calls_total") == 3
    assert value(telemetry, "mmguard_shm_handoff_inline_total", reason="no_free_slot") == 1
    for p in plans[:3]:
        assert p is not None
        pool.release(p)
    assert value(telemetry, "mmguard_shm_handoff_slots_in_use") == 0
    asyncio.run(pool.close(lambda name: accept(name, "", 0)))
    assert value(telemetry, "mmguard_shm_handoff_slots") == 0


def test_a_late_refusal_from_before_a_reregistration_changes_nothing(tmp_path: Path) -> None:
    telemetry = Telemetry()
    pool = HandoffPool("t", 2, 1 << 20, tmp_path)
    pool.bind(telemetry)
    pool.contracts["small"] = SMALL
    assert asyncio.run(pool.ensure(accept))
    first, second = pool.plan(small_call(), "small"), pool.plan(small_call(), "small")
    assert first is not None and second is not None
    pool.forget(first.generation)  # Triton restarted: the first answer says so
    assert not pool.registered
    assert value(telemetry, "mmguard_shm_handoff_slots") == 0
    assert asyncio.run(pool.ensure(accept))  # the next call registers them again
    pool.forget(second.generation)  # the other call in flight then says the same, later
    assert pool.registered and pool.stats["reregister"] == 1
    assert value(telemetry, "mmguard_shm_handoff_reregistrations_total") == 1
    assert value(telemetry, "mmguard_shm_handoff_registrations_total", result="ok") == 2
    assert value(telemetry, "mmguard_shm_handoff_slots") == 2
