"""A canary's latency is judged on each side's time in its backend (``BACKEND_S``). For the
in-process ONNX Runtime backend that is the time the run took in its worker thread (with the
pool's queue), not the time until the event loop got round to resuming the call: a loop held
by other work must not read as a slower model. A real ONNX Runtime session, a real loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from proxy.backends.onnxruntime import OnnxRuntimeBackend
from proxy.call import BACKEND_S, BACKEND_TIMED_S, Call, Result, Target
from proxy.clock import SystemClock
from proxy.config.backends import OnnxRuntimeBackendConfig
from proxy.engine.terminal import Terminal
from proxy.telemetry import Telemetry
from proxy.tensor import Tensor
from tests.support.models import write_identity

HELD_S = 1.0  # the loop is held this long right after the call is handed to the pool


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Terminal, str]]:
    """A terminal in front of a real ONNX Runtime session of ``identity_fp32``."""
    model = write_identity(tmp_path, "FP32")
    backend = OnnxRuntimeBackend(OnnxRuntimeBackendConfig(kind="onnxruntime", name="ort",
                                                          model_dir=tmp_path, device="cpu"))
    await backend.start()
    started = asyncio.Event()
    started.set()
    try:
        yield Terminal({"ort": backend}, {"ort": started}, Telemetry(), SystemClock()), model
    finally:
        await backend.close()


async def test_a_held_event_loop_is_not_counted_as_the_models_time(
        served: tuple[Terminal, str]) -> None:
    terminal, model = served
    values = np.arange(8, dtype=np.float32)
    calls = []
    for hold in (False, True, True):
        call = Call(model, "", [Tensor.from_numpy("INPUT0", values)])
        call.target = Target("ort", model)
        if hold:  # runs in the loop as soon as the call awaits its worker: holds the loop
            asyncio.get_running_loop().call_soon(time.sleep, HELD_S)
        began = time.monotonic()
        reply = await terminal(call)
        waited = time.monotonic() - began
        assert isinstance(reply, Result)
        assert reply.outputs[0].numpy().tolist() == values.tolist()
        calls.append((call.state.get(BACKEND_S), waited))
        assert BACKEND_TIMED_S not in call.state  # read once by the terminal, then gone
    for backend_s, waited in calls[1:]:
        assert waited >= HELD_S  # the caller did wait for the loop ...
        assert backend_s is not None and backend_s < HELD_S / 2, calls  # ... the model not
    assert calls[0][0] is not None and calls[0][0] <= calls[0][1]


async def test_a_second_try_adds_its_own_time(served: tuple[Terminal, str]) -> None:
    """Two tries of one call (a retry, a fallback level) sum: each try's own time once."""
    terminal, model = served
    call = Call(model, "", [Tensor.from_numpy("INPUT0", np.ones(4, np.float32))])
    call.target = Target("ort", model)
    await terminal(call)
    first = call.state.get(BACKEND_S)
    await terminal(call)
    second = call.state.get(BACKEND_S)
    assert first is not None and second is not None and second > first
