"""The silent-degradation alarm: image–text similarity over a sliding window of 32 answers.

Guards against the failure that returns 200: under a traffic surge nothing errors, yet the
model's image–text similarity falls (seeds: mean cosine 0.821 at 50 QPS → 0.537 at 320 QPS).
Seeds: alarm when the variance of the last 32 similarity scores exceeds 0.02, or their mean
drops by more than 0.18 from its baseline (the mean of the first ``baseline_size`` scores).

Configured as ``output_drift: {similarity_alarm: {...}}``. Every alarm is visible: the gauge
``mmguard_similarity_alarm{model}`` (1 while on), ``mmguard_similarity_alarms_total{model,
reason}``, the window's figures in ``mmguard_similarity_window{model,stat}``, a WARNING line
when it trips and when it clears, and ``mmguard-degradation: alarm; <why>`` on the answer that
tripped it. ``action``: ``observe`` (default), or send the calls that come while it is on to
``reroute_to`` — ``route_away`` (another replica) or ``degrade`` (a lighter model) — each such
call marked ``mmguard-degradation: routed-away|degraded; ...``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import numpy as np
from prometheus_client import Counter, Gauge
from pydantic import Field, model_validator

from filters.call_keys import touched_by_fault
from proxy.call import Call, Reply, Result
from proxy.chain import FilterContext, Next
from proxy.pod.state import Shared, decided, share
from proxy.strict import Strict

log = logging.getLogger("mmguard.degradation")


class SimilarityAlarmConfig(Strict):

    output: str = "similarity"
    """The v2 output holding the model's image–text similarity (one score per batch item)."""
    window: int = Field(32, ge=2)
    max_variance: float = Field(0.02, gt=0)
    max_drop: float = Field(0.18, gt=0)
    baseline_size: int = Field(32, ge=1)
    """The first this many scores make the baseline mean."""
    action: Literal["observe", "route_away", "degrade"] = "observe"
    reroute_to: str | None = None
    """The route for ``route_away`` / ``degrade``."""

    @model_validator(mode="after")
    def _target(self) -> SimilarityAlarmConfig:
        if self.action != "observe" and not self.reroute_to:
            raise ValueError(f"similarity_alarm action '{self.action}' needs reroute_to (a route)")
        return self


class SimilarityAlarm(Shared):
    """In a pod of several workers (``proxy.pod.state``) the supervisor holds the one window and
    baseline, on every worker's scores (``scored`` is forwarded), and trips or clears the alarm;
    the workers route by their replica's ``on``."""

    def __init__(self, cfg: SimilarityAlarmConfig, ctx: FilterContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.scores: deque[float] = deque(maxlen=cfg.window)
        self.baseline: list[float] = []
        self.baseline_mean: float | None = None
        self.on = False
        self.reason = ""
        t = ctx.telemetry
        self.m_on = t.metric(Gauge, "mmguard_similarity_alarm",
                             "1 while the silent-degradation alarm is on.", ["model"])
        self.m_alarms = t.metric(Counter, "mmguard_similarity_alarms_total",
                                 "Silent-degradation alarms tripped, by why.", ["model", "reason"])
        self.m_window = t.metric(Gauge, "mmguard_similarity_window",
                                 "The similarity window's mean, variance and baseline mean.",
                                 ["model", "stat"])
        self.m_on.labels(ctx.route).set(0)
        for reason in ("variance", "drop"):
            self.m_alarms.labels(ctx.route, reason)
        ctx.on_activate(lambda: share(self, f"alarm/{ctx.route}"))

    def export_state(self) -> dict[str, Any]:
        return {"on": self.on, "reason": self.reason}

    def import_state(self, state: dict[str, Any]) -> None:
        self.on, self.reason = state["on"], state["reason"]

    def _scores(self, reply: Result) -> list[float]:
        for t in reply.outputs:
            if t.name == self.cfg.output:
                values = np.asarray(t.numpy(), dtype=np.float64).reshape(-1)
                return [float(v) for v in values if np.isfinite(v)]
        return []

    def observe(self, call: Call, reply: Reply) -> None:
        if not isinstance(reply, Result) or reply.stream is not None or touched_by_fault(call):
            return
        why = self.scored(self._scores(reply))
        if why:  # the call that tripped it says so (in a pod, the supervisor's log does)
            self.ctx.telemetry.decide(call, "degradation", "alarm", why)

    @decided
    def scored(self, scores: list[float]) -> str:
        """One answer's scores; why the alarm tripped on them ("" when it did not)."""
        for score in scores:
            if self.baseline_mean is None:
                self.baseline.append(score)
                if len(self.baseline) >= self.cfg.baseline_size:
                    self.baseline_mean = float(np.mean(self.baseline))
                    self.m_window.labels(self.ctx.route, "baseline_mean").set(self.baseline_mean)
            self.scores.append(score)
        if self.baseline_mean is None or len(self.scores) < self.cfg.window:
            return ""
        arr = np.asarray(self.scores)
        mean, variance = float(arr.mean()), float(arr.var())
        self.m_window.labels(self.ctx.route, "mean").set(mean)
        self.m_window.labels(self.ctx.route, "variance").set(variance)
        drop = self.baseline_mean - mean
        why, kind = "", ""
        if variance > self.cfg.max_variance:
            why, kind = (f"similarity variance {variance:.4f} > {self.cfg.max_variance:g} over "
                         f"the last {len(arr)} answers"), "variance"
        elif drop > self.cfg.max_drop:
            why, kind = (f"similarity mean {mean:.3f} is {drop:.3f} below its baseline "
                         f"{self.baseline_mean:.3f} (max drop {self.cfg.max_drop:g}) over the "
                         f"last {len(arr)} answers"), "drop"
        if why and not self.on:
            self.on, self.reason = True, why
            self.m_on.labels(self.ctx.route).set(1)
            self.m_alarms.labels(self.ctx.route, kind).inc()
            log.warning("silent-degradation alarm on %r: %s", self.ctx.route, why,
                        extra={"fields": {"model": self.ctx.route, "reason": kind,
                                          "mean": mean, "variance": variance}})
            return why
        if not why and self.on:
            self.on, self.reason = False, ""
            self.m_on.labels(self.ctx.route).set(0)
            log.warning("silent-degradation alarm on %r cleared: similarity mean %.3f, variance "
                        "%.4f", self.ctx.route, mean, variance,
                        extra={"fields": {"model": self.ctx.route, "mean": mean,
                                          "variance": variance}})
        return ""

    async def serve(self, call: Call, next: Next,
                    inner: Callable[[Call, Next], Awaitable[Reply]]) -> Reply:
        """While the alarm is on and an action is set, the call goes to ``reroute_to``."""
        if self.on and self.cfg.action != "observe" and self.ctx.reroute is not None:
            assert self.cfg.reroute_to is not None
            decision = "routed-away" if self.cfg.action == "route_away" else "degraded"
            self.ctx.telemetry.decide(call, "degradation", decision,
                                      f"to '{self.cfg.reroute_to}': {self.reason}")
            return await self.ctx.reroute(self.cfg.reroute_to, call)
        reply = await inner(call, next)
        self.observe(call, reply)
        return reply
