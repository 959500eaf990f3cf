"""proxy.backends.shm_handoff's pool: slot size from the contracts, where each tensor of a call
goes, every reason to go inline, registration once (and again after ``forget``), and cleanup."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from proxy.backends.shm_handoff import MIN_SLOT_BYTES, HandoffPool, contract_bytes
from proxy.call import Call, RequestedOutput
from proxy.contract import ModelContract, TensorSpec
from proxy.tensor import Tensor

PIXELS = ModelContract(
    "clip", ("1",), "python",
    inputs=(TensorSpec("pixel_values", "FP32", (-1, 3, 224, 224)),
            TensorSpec("text", "BYTES", (-1, 1))),
    outputs=(TensorSpec("embeds", "FP32", (-1, 64)), TensorSpec("dyn", "FP32", (-1, -1)),
             TensorSpec("label", "BYTES", (-1, 1))),
    max_batch_size=4)


def call_with(batch: int, outputs: list[RequestedOutput] | None = None) -> Call:
    pixels = Tensor.from_numpy("pixel_values", np.zeros((batch, 3, 224, 224), np.float32))
    text = Tensor.from_numpy("text", np.array([[b"x"]] * batch, dtype=np.object_))
    return Call(model="clip", version="", inputs=[pixels, text], outputs=outputs or [])


async def registered(pool: HandoffPool) -> list[tuple[str, str, int]]:
    seen: list[tuple[str, str, int]] = []

    async def register(name: str, key: str, size: int) -> None:
        seen.append((name, key, size))

    assert await pool.ensure(register)
    assert await pool.ensure(register)  # once
    return seen


def test_slot_size_comes_from_the_fixed_size_tensors_at_max_batch(tmp_path: Path) -> None:
    assert contract_bytes(PIXELS) == 4 * 3 * 224 * 224 * 4 + 4 * 64 * 4
    pool = HandoffPool("t", 2, 64 * 1024 * 1024, tmp_path)
    pool.contracts["clip"] = PIXELS
    seen = asyncio.run(registered(pool))
    assert [size for _, _, size in seen] == [contract_bytes(PIXELS)] * 2
    assert all(key == "/" + name and (tmp_path / name).stat().st_mode & 0o777 == 0o600
               for name, key, _ in seen)
    small = HandoffPool("t", 1, 64 * 1024 * 1024, tmp_path)
    asyncio.run(registered(small))  # no contract yet: the floor
    assert small.all[0].size == MIN_SLOT_BYTES
    capped = HandoffPool("t", 1, 100_000, tmp_path)
    capped.contracts["clip"] = PIXELS
    asyncio.run(registered(capped))
    assert capped.all[0].size == 100_000


def test_where_each_tensor_goes(tmp_path: Path) -> None:
    pool = HandoffPool("t", 1, 64 * 1024 * 1024, tmp_path)
    pool.contracts["clip"] = PIXELS
    asyncio.run(registered(pool))
    call = call_with(2)
    plan = pool.plan(call, "clip")
    assert plan is not None
    pixels = 2 * 3 * 224 * 224 * 4
    assert plan.inputs == {"pixel_values": (0, pixels), "text": (pixels, 10)}
    # Fixed-size outputs in the slot, 64-byte aligned after the inputs; the others inline.
    assert plan.outputs == {"embeds": (pixels + 64, 2 * 64 * 4)}
    assert plan.inline_outputs == [("dyn", {}), ("label", {})]
    slot = bytes(plan.slot.view[pixels:pixels + 10])
    assert slot == bytes(call.inputs[1].raw_bytes())
    assert pool.plan(call_with(1), "clip") is None  # the one slot is taken
    pool.release(plan)
    asked = call_with(1, [RequestedOutput("embeds", {"classification": 3, "binary_data": True})])
    plan = pool.plan(asked, "clip")
    assert plan is not None and plan.outputs == {}
    assert plan.inline_outputs == [("embeds", {"classification": 3})]
    pool.release(plan)
    assert pool.stats == {"shm": 2, "inline_no_free_slot": 1}


def test_every_reason_to_go_inline(tmp_path: Path) -> None:
    pool = HandoffPool("t", 1, 100_000, tmp_path)
    pool.contracts["clip"] = PIXELS
    asyncio.run(registered(pool))
    assert pool.plan(call_with(1), "clip") is None  # 600 KB > the 100 KB slot
    assert pool.plan(call_with(1), "unknown") is None
    streamed = call_with(1)
    streamed.streaming = True
    assert pool.plan(streamed, "clip") is None
    assert pool.stats == {"inline_too_big": 1, "inline_no_contract": 1, "inline_stream": 1}
    assert pool.free  # nothing was taken


def test_registration_failure_stays_inline_and_forget_registers_again(tmp_path: Path) -> None:
    now = [100.0]
    pool = HandoffPool("t", 1, 100_000, tmp_path, retry_s=5.0, clock=lambda: now[0])
    asked: list[str] = []

    async def refuse(name: str, key: str, size: int) -> None:
        asked.append(name)
        raise RuntimeError("Triton cannot open it")

    assert not asyncio.run(pool.ensure(refuse))
    assert pool.stats == {"register_failed": 1}
    now[0] += 4.9  # within the retry delay: inline without asking Triton again
    assert not asyncio.run(pool.ensure(refuse)) and len(asked) == 1
    now[0] += 0.2
    assert not asyncio.run(pool.ensure(refuse)) and len(asked) == 2
    assert pool.stats == {"register_failed": 2}
    now[0] += 5.0
    asyncio.run(registered(pool))
    pool.forget()
    assert not pool.registered
    assert len(asyncio.run(registered(pool))) == 1 and pool.stats["reregister"] == 1


def test_read_checks_the_answer_fits_and_close_removes_everything(tmp_path: Path) -> None:
    pool = HandoffPool("t", 2, 64 * 1024 * 1024, tmp_path)
    pool.contracts["clip"] = PIXELS
    asyncio.run(registered(pool))
    plan = pool.plan(call_with(1), "clip")
    assert plan is not None
    start, size = plan.outputs["embeds"]
    plan.slot.view[start:start + 4] = b"\x01\x02\x03\x04"
    assert pool.read(plan, "embeds", 4) == b"\x01\x02\x03\x04"
    with pytest.raises(ValueError, match="'embeds'"):
        pool.read(plan, "embeds", size + 1)  # an answer larger than its space
    pool.release(plan)
    unregistered: list[str] = []

    async def unregister(name: str) -> None:
        unregistered.append(name)

    asyncio.run(pool.close(unregister))
    assert len(unregistered) == 2 and list(tmp_path.iterdir()) == []
