"""An in-process harness: the real config parser, runtime, filter chains and data plane over an
in-memory terminal (``FunctionBackend``, a ``Backend`` that answers from a function), with an
injected ``ManualClock`` and seeded filter randomness.

What it is for: the filters' and the runtime's logic, in milliseconds and deterministically. It
is the fast tier's counterpart of the integration tier (real Triton / ORT / vLLM over loopback),
not a replacement: nothing here speaks a wire protocol.

    async with ChainHarness.open({"models": [{"name": "m", "filters": [{"limits": {...}}]}]}) as h:
        reply = await h.infer("m", [Tensor.from_numpy("x", array)])
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from proxy.backends.base import Backend
from proxy.call import CANARY, Call, Reply, Result, Target
from proxy.clock import ManualClock
from proxy.config.model import parse_config
from proxy.contract import ModelContract, TensorSpec
from proxy.engine.dataplane import DataPlane
from proxy.engine.runtime import Runtime
from proxy.errors import ErrorKind, ProxyError
from proxy.telemetry import Telemetry
from proxy.tensor import Tensor

Answer = Callable[[Call, Target], Result | Awaitable[Result]]
BACKEND = "mem"


def echo(call: Call, target: Target) -> Result:
    """Answers every input back as an output of the same name (what the tests compare with)."""
    return Result(target.model, outputs=list(call.inputs))


def contract_for(name: str, inputs: dict[str, tuple[str, tuple[int, ...]]],
                 outputs: dict[str, tuple[str, tuple[int, ...]]] | None = None,
                 max_batch_size: int = 0) -> ModelContract:
    """A contract: ``{"x": ("FP32", (-1, 3))}`` per input (and output; the inputs when none)."""
    def specs(d: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(n, dt, dims) for n, (dt, dims) in d.items())
    return ModelContract(name, ("1",), "in-memory", specs(inputs), specs(outputs or inputs),
                         max_batch_size=max_batch_size, fingerprint=f"mem-{name}")


@dataclass
class FunctionBackend(Backend):
    """A backend that answers from a function; it knows the contracts it is given."""

    answer: Answer = echo
    contracts: dict[str, ModelContract] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    name: str = BACKEND
    protocol: str = "inprocess"
    timeout_s: float = 30.0

    async def ready(self) -> bool:
        return True

    async def model_ready(self, model: str, version: str = "") -> bool:
        return model in self.contracts

    async def metadata(self, model: str, version: str = "") -> ModelContract:
        if model not in self.contracts:
            raise ProxyError(ErrorKind.NOT_FOUND, f"in-memory backend has no model '{model}'")
        return self.contracts[model]

    async def infer(self, call: Call, target: Target) -> Result:
        self.calls.append(call)
        found = self.answer(call, target)
        return await found if inspect.isawaitable(found) else found

    async def close(self, drain: bool = False) -> None:
        return None


@dataclass
class ChainHarness:
    runtime: Runtime
    plane: DataPlane
    backend: FunctionBackend
    clock: ManualClock
    telemetry: Telemetry
    last: Call | None = None
    """The last call ``infer`` made (its ``decisions`` are what the answer's headers carry)."""

    @classmethod
    @asynccontextmanager
    async def open(cls, doc: dict[str, Any], answer: Answer = echo,
                   contracts: dict[str, ModelContract] | None = None,
                   seed: int = 0) -> AsyncIterator[ChainHarness]:
        """A served runtime for ``doc`` (a config document; every model on the in-memory
        backend unless it names one), activated, with its contracts learned."""
        doc = {"backends": [{"kind": "onnxruntime", "name": BACKEND, "model_dir": "."}], **doc}
        doc["models"] = [{"backend": BACKEND, **m} for m in doc["models"]]
        config = parse_config(doc, "the harness's config")
        clock, telemetry = ManualClock(), Telemetry()
        known = contracts if contracts is not None else {
            m.name: contract_for(m.name, {"x": ("FP32", (-1, 3))}) for m in config.models}
        backend = FunctionBackend(answer=answer, contracts=known)
        runtime = Runtime(config, telemetry, clock, {BACKEND: backend}, seed=seed)
        runtime.activate()
        runtime._started[BACKEND].set()  # an in-memory backend has nothing to start
        for name in runtime.routes:  # contracts at once, not after a watcher's first poll
            if name in known:
                runtime.contracts[name] = known[name]
        harness = cls(runtime, DataPlane(runtime, telemetry), backend, clock, telemetry)
        try:
            yield harness
        finally:
            await runtime.close()

    async def infer(self, model: str, inputs: list[Tensor] | None = None, *,
                    canary: bool = False, headers: dict[str, str] | None = None,
                    request_id: str = "") -> Reply:
        """Through the data plane, as a front hands it a call (``canary`` marks it so)."""
        call = Call(model=model, version="", inputs=inputs if inputs is not None else [x()],
                    headers=dict(headers or {}), id=request_id)
        if canary:
            call.state[CANARY] = True
        self.last = call
        return await self.plane.infer(call)

    def decision(self, name: str) -> str | None:
        """A decision header of the last call (``mmguard-fault``, ...)."""
        return self.last.decisions.get(name) if self.last is not None else None


def x(rows: int = 1, value: float = 1.0) -> Tensor:
    """The default contract's input: FP32 ``[rows, 3]``."""
    return Tensor.from_numpy("x", np.full((rows, 3), value, dtype=np.float32))
