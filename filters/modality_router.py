"""``modality_router``: choose the serving path from live latency and confidence, and serve
without a modality that is missing or unusable.

Guards against one slow or unreliable path taking all the traffic (GPU memory pressure: +32 %
latency; CPU throttling: +89 %) and against failing a whole request because one modality is
broken. Seed scenario (DMWR): weights = softmax(α·latency score + (1−α)·confidence score) with
α = 0.7; a degraded replica loses traffic and wins it back when it recovers, without flapping.

Each path is a route (its own chain runs). Per path the router keeps an EWMA of latency, a
sliding window for a latency percentile and the error rate, and the confidence read from its
answers. Weights are recomputed at most every ``dwell_s`` (hysteresis) and never fall below
``exploration`` (a recovered path must get traffic to show it has recovered).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from prometheus_client import Gauge
from pydantic import Field, model_validator

from filters.answer_reads import Confidence, confidence_of
from filters.call_keys import UNUSABLE_MODALITIES, touched_by_fault
from filters.outcomes import clients_own
from proxy.call import Api, Call, LocalReply, Reply, Result
from proxy.chain import FilterContext, Next
from proxy.errors import ErrorKind
from proxy.lifecycle import (
    Access,
    AdminAnswer,
    AdminRequest,
    AdminRoute,
    ConfigReferences,
    FilterFactoryBase,
    StateKey,
    Summary,
)
from proxy.pod.state import POD, Shared, decided, share
from proxy.strict import Strict
from proxy.wire.openai import ChatView

Modality = Literal["image", "text"]
_SERVER_ERRORS = ("unavailable", "deadline_exceeded", "internal", "overloaded", "not_found",
                  "bad_gateway")
"""A path's failures: its backend down, slow, failing, shedding, losing the model, or answering
outside its contract (``bad_gateway``, as the fallback counts it); and a call the backend
dropped (``LocalReply.dropped_by_backend``)."""


class PathConfig(Strict):
    route: str
    modalities: tuple[Modality, ...] = ("image", "text")
    """What this path consumes; a path is eligible only if the call has all of them usable."""
    confidence: Confidence | None = None


class RouterConfig(Strict):
    paths: tuple[PathConfig, ...] = Field(min_length=1)
    inputs: dict[str, Modality] = Field(default_factory=dict)
    """v2 input name → the modality it carries (OpenAI calls: image parts and text)."""
    alpha: float = Field(0.7, ge=0, le=1)
    temperature: float = Field(0.1, gt=0)
    latency_tolerance_s: float = Field(0.005, ge=0)
    """Latencies this close count as equally fast (the latency score is (best+tol)/(own+tol))."""
    ewma: float = Field(0.2, gt=0, le=1)
    """Weight of the newest latency in the moving average."""
    window: int = Field(50, ge=2)
    dwell_s: float = Field(2.0, ge=0)
    exploration: float = Field(0.05, ge=0, lt=0.5)
    choice: Literal["weighted", "best"] = "weighted"

    @model_validator(mode="after")
    def _confidence_needs_output(self) -> RouterConfig:
        for p in self.paths:
            if p.confidence and p.confidence.kind != "logprob" and not p.confidence.output:
                raise ValueError(f"path '{p.route}': confidence {p.confidence.kind} needs output")
        return self

    def references(self) -> ConfigReferences:
        """The paths' routes (checked at load)."""
        return ConfigReferences(routes=tuple((f"paths[{i}].route", p.route)
                                             for i, p in enumerate(self.paths)))


@dataclass
class PathStats:
    latency_ewma: float | None = None
    samples: deque[tuple[float, bool]] = field(default_factory=deque)  # (seconds, failed)
    confidence: float | None = None

    def percentile(self, q: float) -> float | None:
        ok = sorted(s for s, failed in self.samples if not failed)
        return ok[min(len(ok) - 1, int(q * len(ok)))] if ok else None

    @property
    def error_rate(self) -> float:
        return sum(f for _, f in self.samples) / len(self.samples) if self.samples else 0.0


class ModalityRouter(Shared):
    """Weights per path from live latency and confidence. In a pod of several workers
    (``proxy.pod.state``) the supervisor keeps the one set of statistics (every worker forwards what
    it measured, ``record``) and sets the weights (``tick``, every ``dwell_s``); the workers
    route by their replica's weights."""

    def __init__(self, cfg: RouterConfig, ctx: FilterContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.stats = {p.route: PathStats() for p in cfg.paths}
        self.cfg = cfg
        self.weights = self.compute()
        self._updated = -math.inf
        self._text = ""  # _weights_text's cache, for the weights in _text_of
        self._text_of: dict[str, float] | None = None
        self.gauge = ctx.telemetry.metric(Gauge, "mmguard_router_weight",
                                          "Share of traffic each path gets.", ["model", "path"])
        ctx.local.setdefault(ROUTERS, dict)[ctx.route] = self
        ctx.on_activate(self._activate)

    def _activate(self) -> None:
        """Once its runtime serves (a rejected reload's router never writes the gauges that
        the serving one keeps): its weights shown, then the pod's taken over."""
        for p in self.cfg.paths:
            self.gauge.labels(self.ctx.route, p.route).set(self.weights[p.route])
        share(self, f"router/{self.ctx.route}")

    # --- weights ----------------------------------------------------------------------------

    def compute(self) -> dict[str, float]:
        """softmax((α·latency + (1−α)·confidence)·(1 − error rate) / T), floored, within each
        group of paths that take the same modalities (those are the alternatives a call
        chooses between; a text-only path competes with text-only paths)."""
        weights: dict[str, float] = {}
        groups: dict[frozenset[str], list[str]] = {}
        for p in self.cfg.paths:
            groups.setdefault(frozenset(p.modalities), []).append(p.route)
        for routes in groups.values():
            weights.update(self._softmax(routes))
        return weights

    def _softmax(self, routes: list[str]) -> dict[str, float]:
        lat = {r: self.stats[r].latency_ewma for r in routes}
        fastest = min((v for v in lat.values() if v), default=None)
        scores = []
        for r in routes:
            s = self.stats[r]
            mine = lat[r]
            tol = self.cfg.latency_tolerance_s  # a few ms apart is "as fast"
            lat_score = (fastest + tol) / (mine + tol) if fastest and mine else 1.0
            conf = s.confidence if s.confidence is not None else 1.0
            score = self.cfg.alpha * lat_score + (1 - self.cfg.alpha) * conf
            scores.append(score * (1 - s.error_rate))
        z = np.exp((np.array(scores) - max(scores)) / self.cfg.temperature)
        w = z / z.sum()
        eps = self.cfg.exploration if len(routes) > 1 else 0.0
        w = eps + (1 - eps * len(w)) * w
        return {r: float(x) for r, x in zip(routes, w, strict=True)}

    def _maybe_update(self) -> bool:
        if POD.is_worker and self.shared_id:
            return False  # the pod's supervisor sets the weights
        now = self.ctx.clock.monotonic()
        if now - self._updated < self.cfg.dwell_s:
            return False  # hysteresis: weights hold for dwell_s, so one slow answer cannot flap
        self._updated = now
        self.weights = self.compute()
        self._publish()
        return True

    def _publish(self) -> None:
        for route, w in self.weights.items():
            self.gauge.labels(self.ctx.route, route).set(w)

    def tick(self) -> bool:
        return self._maybe_update()

    def export_state(self) -> dict[str, Any]:
        """What a worker routes by: the weights (the statistics stay with the supervisor)."""
        return {"weights": self.weights}

    def import_state(self, state: dict[str, Any]) -> None:
        changed = state["weights"] != self.weights
        self.weights = {r: state["weights"].get(r, w) for r, w in self.weights.items()}
        if changed:
            self._publish()

    @decided
    def record(self, route: str, seconds: float, failed: bool, confidence: float | None) -> None:
        s = self.stats[route]
        if not failed:
            a = self.cfg.ewma
            s.latency_ewma = seconds if s.latency_ewma is None else a * seconds + (1 - a) * \
                s.latency_ewma
        s.samples.append((seconds, failed))
        while len(s.samples) > self.cfg.window:
            s.samples.popleft()
        if confidence is not None:
            s.confidence = confidence if s.confidence is None else 0.8 * s.confidence + \
                0.2 * confidence

    def snapshot(self) -> dict[str, Any]:
        return {"weights": self.weights, "paths": {
            r: {"latency_ewma_ms": None if s.latency_ewma is None else s.latency_ewma * 1e3,
                "latency_p90_ms": (p * 1e3 if (p := s.percentile(0.9)) is not None else None),
                "error_rate": s.error_rate, "confidence": s.confidence,
                "samples": len(s.samples)} for r, s in self.stats.items()}}

    # --- one call ---------------------------------------------------------------------------

    async def __call__(self, call: Call, next: Next) -> Reply:
        assert self.ctx.reroute is not None
        present = self._modalities(call)
        unusable = call.state.get(UNUSABLE_MODALITIES) or {}
        usable = {m for m in present if m not in unusable}
        eligible = [p for p in self.cfg.paths if set(p.modalities) <= usable]
        # Paths that use everything the call brings come first; a path that would drop a
        # usable modality is for when nothing else can serve.
        complete = [p for p in eligible if set(p.modalities) == usable]
        eligible = complete or eligible
        if not eligible:
            message = (f"model '{call.model}': no path can serve this call (usable modalities: "
                       f"{sorted(usable) or 'none'}; unusable: {unusable or 'none'})")
            self.ctx.telemetry.decide(call, "router", "no-path", message)
            return LocalReply(ErrorKind.UNPROCESSABLE, message)
        self._maybe_update()
        path = self._choose(eligible)
        dropped = sorted(present - set(path.modalities))
        if dropped:
            self._drop(call, dropped)
            reasons = "; ".join(f"{m}: {unusable.get(m, f'{path.route} does not take it')}"
                                for m in dropped)
            # mmguard-modality-dropped: image; image: <why>
            self.ctx.telemetry.decide(call, "modality", ",".join(dropped), reasons,
                                      header="dropped")
        self.ctx.telemetry.decide(call, "router", path.route, self._weights_text(),
                                  header="path")
        start = time.monotonic()
        reply = await self.ctx.reroute(path.route, call)
        failed = isinstance(reply, LocalReply) and (reply.kind.value in _SERVER_ERRORS
                                                    or reply.dropped_by_backend)
        confidence = None
        if isinstance(reply, Result) and path.confidence is not None:
            confidence = confidence_of(reply, path.confidence, call)
        # a fault's delay or failure is not the path's, nor is the client's own failure (a
        # deadline shorter than the path's usual latency, a version that does not exist)
        if not touched_by_fault(call) and not clients_own(
                call, reply, self.stats[path.route].latency_ewma):
            self.record(path.route, time.monotonic() - start, failed, confidence)
        return reply

    def _weights_text(self) -> str:
        """"weights a=0.50, b=0.50", formatted once per set of weights (they hold for dwell_s)."""
        if self._text_of is not self.weights:
            self._text = "weights " + ", ".join(f"{r}={w:.2f}" for r, w in self.weights.items())
            self._text_of = self.weights
        return self._text

    def _choose(self, eligible: list[PathConfig]) -> PathConfig:
        weights = [self.weights[p.route] for p in eligible]
        if self.cfg.choice == "best" or len(eligible) == 1:
            return eligible[int(np.argmax(weights))]
        return self.ctx.rng.choices(eligible, weights=weights, k=1)[0]

    def _modalities(self, call: Call) -> set[str]:
        if call.api is Api.OPENAI:
            view = ChatView(call)
            return {"text"} | ({"image"} if view.images() else set())
        return {self.cfg.inputs[t.name] for t in call.inputs if t.name in self.cfg.inputs}

    def _drop(self, call: Call, modalities: list[str]) -> None:
        if call.api is Api.OPENAI:
            view = ChatView(call)
            if "image" in modalities:
                for image in reversed(view.images()):
                    view.drop_image(image)
            return
        call.set_inputs([t for t in call.inputs if self.cfg.inputs.get(t.name) not in modalities])


ROUTERS: StateKey[dict[str, ModalityRouter]] = StateKey("routers")
"""Route → its router in this runtime (``FilterContext.local``), for ``GET /admin/routers``."""


async def list_routers(req: AdminRequest) -> AdminAnswer:
    found = req.local.get(ROUTERS) or {}
    return 200, {route: r.snapshot() for route, r in sorted(found.items())}


def _router_rows(route: str, snap: dict[str, Any]) -> list[tuple[str, ...]]:
    paths: dict[str, dict[str, Any]] = snap.get("paths", {})
    rows: list[tuple[str, ...]] = []
    for path, weight in snap.get("weights", {}).items():
        p = paths.get(path, {})
        lat, conf = p.get("latency_ewma_ms"), p.get("confidence")
        rows.append((route, path, f"{weight:.3f}", "-" if lat is None else f"{lat:.1f} ms",
                     f"{p.get('error_rate', 0):.0%}", "-" if conf is None else f"{conf:.3f}"))
    return rows


class ModalityRouterFactory(FilterFactoryBase):
    name = "modality_router"
    config_model = RouterConfig
    admin_routes = (AdminRoute("GET", "/admin/routers", Access.READ, list_routers),)

    async def summary(self, req: AdminRequest) -> Summary:
        _, found = await list_routers(req)
        rows = tuple(r for route, snap in found.items() for r in _router_rows(route, snap))
        return Summary("routers", ("route", "path", "weight", "latency ewma", "error rate",
                                   "confidence"), rows,
                       empty="none (no route uses modality_router)", order=20)

    def build(self, config: RouterConfig, ctx: FilterContext) -> ModalityRouter:
        return ModalityRouter(config, ctx)
