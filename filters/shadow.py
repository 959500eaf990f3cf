"""``shadow``: work in progress (a pass-through until it lands)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from proxy.call import Call, Reply
from proxy.chain import FilterContext, Next


class ShadowConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Shadow:
    def __init__(self, cfg: ShadowConfig, ctx: FilterContext) -> None:
        self.cfg = cfg

    async def __call__(self, call: Call, next: Next) -> Reply:
        return await next(call)


class ShadowFactory:
    name = "shadow"
    config_model = ShadowConfig

    def build(self, config: ShadowConfig, ctx: FilterContext) -> Shadow:
        return Shadow(config, ctx)
