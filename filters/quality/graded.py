"""Confidence-graded actions on the trust score: refuse, shed or observe.

Guards against the two ways a quality guard fails an operator: acting on every small doubt (it
gets switched off) and never acting (bad answers go through). The seeds' IQE bands: below 0.3
the request is refused with the fallback answer; from 0.3 to 0.7 a configured share is shed to a
cheaper path or to the cached answer; at or above 0.7 it is only observed (a span event, a
counter). Every band is a decision like any other: the ``mmguard-quality-graded`` header /
trailer, the ``mmguard_filter_decisions_total`` counter, a span event.

"The fallback answer" and "the cached answer" are the ``fallback`` filter's: its last good answer
to the same request (it publishes a lookup per route in the runtime's admin objects); a static
answer configured here serves v2 routes when nothing is cached. With neither, a refusal is a 422
naming the trust score and the threshold, and a shed request goes on to its own backend (and says
so).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import Field, model_validator

from filters.fallback.admin import CACHED_ANSWERS
from filters.fallback.filter import StaticTensor
from proxy.call import Api, Call, LocalReply, Reply, Result
from proxy.chain import FilterContext
from proxy.errors import ErrorKind
from proxy.strict import Strict
from proxy.tensor import Tensor

Band = Literal["refuse", "shed", "observe"]


class GradedConfig(Strict):
    refuse_below: float = Field(0.3, ge=0.0, le=1.0)
    """Trust below this: refused, with the cached or static answer when there is one."""
    shed_below: float = Field(0.7, ge=0.0, le=1.0)
    """Trust from refuse_below up to this: a share is shed."""
    shed_share: float = Field(0.5, ge=0.0, le=1.0)
    """Share of the middle band that is shed (drawn from the filter's seeded rng)."""
    shed_to: str | None = None
    """A route (a cheaper model) that serves the shed share; unset: the cached answer."""
    static_answer: tuple[StaticTensor, ...] | None = None
    """v2 routes: the answer a refusal serves when nothing is cached."""

    @model_validator(mode="after")
    def _check(self) -> GradedConfig:
        if self.refuse_below > self.shed_below:
            raise ValueError(f"refuse_below ({self.refuse_below:g}) must not be above "
                             f"shed_below ({self.shed_below:g})")
        return self


def band(cfg: GradedConfig, trust: float) -> Band:
    if trust < cfg.refuse_below:
        return "refuse"
    return "shed" if trust < cfg.shed_below else "observe"


class GradedActions:
    """Applies a route's bands to one scored request."""

    def __init__(self, cfg: GradedConfig, ctx: FilterContext,
                 decide: Callable[[Call, str, str, str], None]) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.decide = decide

    async def _cached(self, call: Call) -> tuple[float, Result] | None:
        lookup = (self.ctx.local.get(CACHED_ANSWERS) or {}).get(self.ctx.route)
        return await lookup(call) if lookup is not None else None

    async def apply(self, call: Call, trust: float, detail: str,
                    next: Callable[[Call], Awaitable[Reply]]) -> Reply:
        which = band(self.cfg, trust)
        if which == "observe":
            self.decide(call, "graded", "observe", f"{detail}; at or above {self.cfg.shed_below:g}")
            return await next(call)
        if which == "refuse":
            return await self._refuse(call, detail)
        if self.ctx.rng.random() >= self.cfg.shed_share:
            self.decide(call, "graded", "kept", f"{detail}; below {self.cfg.shed_below:g}, not in "
                        f"the shed share {self.cfg.shed_share:g}")
            return await next(call)
        return await self._shed(call, detail, next)

    async def _refuse(self, call: Call, detail: str) -> Reply:
        why = f"{detail}; below {self.cfg.refuse_below:g}"
        cached = await self._cached(call)
        if cached is not None:
            self.decide(call, "graded", "refuse", f"{why}; served the cached answer, "
                        f"{cached[0]:.1f}s old")
            call.decisions["mmguard-stale"] = "true"
            return cached[1]
        if self.cfg.static_answer is not None and call.api is Api.KSERVE_V2:
            self.decide(call, "graded", "refuse", f"{why}; served the static answer")
            call.decisions["mmguard-stale"] = "true"
            return Result(call.model, "", call.id, [_tensor(s) for s in self.cfg.static_answer])
        self.decide(call, "graded", "refuse", why)
        return LocalReply(ErrorKind.UNPROCESSABLE, f"quality: {why}, the input is too poor to "
                          "answer")

    async def _shed(self, call: Call, detail: str,
                    next: Callable[[Call], Awaitable[Reply]]) -> Reply:
        why = f"{detail}; below {self.cfg.shed_below:g}, in the shed share {self.cfg.shed_share:g}"
        if self.cfg.shed_to is not None and self.ctx.reroute is not None:
            self.decide(call, "graded", "shed", f"{why}; served by route '{self.cfg.shed_to}'")
            return await self.ctx.reroute(self.cfg.shed_to, call)
        cached = await self._cached(call)
        if cached is not None:
            self.decide(call, "graded", "shed", f"{why}; served the cached answer, "
                        f"{cached[0]:.1f}s old")
            call.decisions["mmguard-stale"] = "true"
            return cached[1]
        self.decide(call, "graded", "shed-unavailable", f"{why}; no cheaper route and nothing "
                    "cached: served as usual")
        return await next(call)


def _tensor(s: StaticTensor) -> Tensor:
    t = Tensor(s.name, s.datatype, s.shape, data=s.data)
    t.raw_bytes()
    return t


def trust_detail(trust: float, parts: dict[str, Any]) -> str:
    shown = " ".join(f"{k}={v:.3f}" for k, v in parts.items() if v is not None)
    return f"trust score {trust:.3f} ({shown})"
