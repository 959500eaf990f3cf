"""The in-process ONNX Runtime backend a reload replaces (closed with ``drain``): the calls
queued on its worker threads when it closes still run and are answered (they were cancelled,
and each such call ended without an answer). A real ONNX Runtime session."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from proxy.backends.onnxruntime import OnnxRuntimeBackend
from proxy.call import Call, Result, Target
from proxy.config.backends import OnnxRuntimeBackendConfig
from proxy.errors import ErrorKind, ProxyError
from proxy.tensor import Tensor
from tests.support.models import write_identity


async def test_calls_queued_when_the_backend_closes_are_still_answered(tmp_path: Path) -> None:
    model = write_identity(tmp_path, "FP32")
    backend = OnnxRuntimeBackend(OnnxRuntimeBackendConfig(
        kind="onnxruntime", name="ort", model_dir=tmp_path, device="cpu", threads=1))
    await backend.start()
    values = np.arange(1 << 18, dtype=np.float32)  # 1 MiB each: a queue forms on one thread

    async def one(i: int) -> Result:
        call = Call(model, "", [Tensor.from_numpy("INPUT0", values + i)])
        return await backend.infer(call, Target("ort", model))

    calls = [asyncio.ensure_future(one(i)) for i in range(24)]
    await asyncio.sleep(0)  # every call handed to the pool
    await backend.close(drain=True)  # a reload retired it while they wait
    answers = await asyncio.gather(*calls, return_exceptions=True)
    failed = [a for a in answers if not isinstance(a, Result)]
    assert not failed, f"{len(failed)} of 24 queued calls were not answered: {failed[0]!r}"
    for i, answer in enumerate(answers):
        assert isinstance(answer, Result)
        np.testing.assert_array_equal(answer.outputs[0].numpy(), values + i)
    late = Call(model, "", [Tensor.from_numpy("INPUT0", values)])
    with pytest.raises(ProxyError) as err:  # a call that took the old runtime, after the close
        await backend.infer(late, Target("ort", model))
    assert err.value.kind is ErrorKind.UNAVAILABLE
    assert err.value.message == (f"backend 'ort' was closed before model '{model}' ran: a "
                                 "config reload replaced it, or mmguard is stopping")
