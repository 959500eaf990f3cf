"""``fault``: work in progress (a pass-through until it lands)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from proxy.call import Call, Reply
from proxy.chain import FilterContext, Next


class FaultConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Fault:
    def __init__(self, cfg: FaultConfig, ctx: FilterContext) -> None:
        self.cfg = cfg

    async def __call__(self, call: Call, next: Next) -> Reply:
        return await next(call)


class FaultFactory:
    name = "fault"
    config_model = FaultConfig

    def build(self, config: FaultConfig, ctx: FilterContext) -> Fault:
        return Fault(config, ctx)
