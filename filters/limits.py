"""``limits``: request size, batch size and concurrency per model.

Guards against one client or one burst taking the model server down: an oversized payload, a
batch larger than the route allows, or more concurrent requests than the backend can queue.
Seed scenario: a traffic surge (50 → 320 QPS) that silently degrades answers instead of failing —
past ``max_in_flight`` the caller gets 429 / RESOURCE_EXHAUSTED with Retry-After, at once.
"""

from __future__ import annotations

from pydantic import Field

from proxy.call import Call, LocalReply, Reply
from proxy.chain import FilterContext, Next
from proxy.errors import ErrorKind
from proxy.lifecycle import FilterFactoryBase
from proxy.pod.counters import InFlight
from proxy.strict import Strict


class LimitsConfig(Strict):
    max_request_bytes: int | None = Field(None, gt=0)
    """Tensor payload bytes per request; above → 413 / RESOURCE_EXHAUSTED."""
    max_batch: int | None = Field(None, gt=0)
    """Leading dimension of every input; above → 413 / RESOURCE_EXHAUSTED."""
    max_in_flight: int | None = Field(None, gt=0)
    """Concurrent requests on this model; above → 429 / RESOURCE_EXHAUSTED + Retry-After."""
    retry_after_s: float = Field(1.0, gt=0)


class Limits:
    def __init__(self, cfg: LimitsConfig, ctx: FilterContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        # Route-wide: in a pod of several workers, the pod's count (proxy.pod.counters).
        self.in_flight = InFlight(ctx.route)

    def _reject(self, call: Call, kind: ErrorKind, decision: str, message: str,
                retry_after: float | None = None) -> LocalReply:
        self.ctx.telemetry.decide(call, "limits", decision, message)
        return LocalReply(kind, message, retry_after_s=retry_after)

    async def __call__(self, call: Call, next: Next) -> Reply:
        cfg = self.cfg
        if cfg.max_request_bytes is not None and call.nbytes > cfg.max_request_bytes:
            return self._reject(call, ErrorKind.TOO_LARGE, "reject-size",
                                f"model '{call.model}': request tensors are {call.nbytes} bytes; "
                                f"the limit is {cfg.max_request_bytes}")
        if cfg.max_batch is not None:
            for t in call.inputs:
                if t.shape and t.shape[0] > cfg.max_batch:
                    return self._reject(call, ErrorKind.TOO_LARGE, "reject-batch",
                                        f"model '{call.model}': input '{t.name}' has batch "
                                        f"{t.shape[0]}; the limit is {cfg.max_batch}")
        if cfg.max_in_flight is None:
            return await next(call)
        now = self.in_flight.enter()
        if now > cfg.max_in_flight:
            self.in_flight.leave()
            return self._reject(call, ErrorKind.OVERLOADED, "reject-overload",
                                f"model '{call.model}' has {now - 1} requests in flight; "
                                f"the limit is {cfg.max_in_flight}", cfg.retry_after_s)
        try:
            return await next(call)
        finally:
            self.in_flight.leave()


class LimitsFactory(FilterFactoryBase):
    name = "limits"
    config_model = LimitsConfig

    def build(self, config: LimitsConfig, ctx: FilterContext) -> Limits:
        return Limits(config, ctx)
