"""``fault``: in-line fault injection on canary traffic, in named experiments that stop themselves.

Where it sits in a chain is where its faults happen: inside ``fallback`` (after it in the list)
an injected abort is what the fallback's levels see, so the degrade path is exercised on canary
calls; outside it, the client sees the fault.

Rules that MUST hold:

- Off unless configured: with no running experiment on the route the filter is one dict lookup.
- Only canary traffic (``call.state[CANARY]``, set by the runtime from ``Config.canary``) is ever
  touched; every other call goes through byte for byte.
- Every injected fault is visible: ``mmguard-fault: <experiment>/<action>`` on the answer, the
  counter ``mmguard_faults_injected_total``, a span event and a log line; an injected refusal is
  counted with code ``injected`` in ``mmguard_requests_total`` and never by a breaker.
- Perturbations are seeded: the same experiment seed and request key (``canary.key``, else the
  request id) give the same perturbation; another seed gives another.
- Which canary calls an experiment (``share``) or an action (``percent``) touches is a keyed draw
  (``FilterContext.share_hash``): stable for retries, not computable by clients.
- Building the filter starts nothing: its experiments start once its runtime serves.
- Experiments stop by themselves: duration over, or a stop condition out on the sliding window
  (checked on every canary answer, so a breach stops it within one window), and at once through
  the admin API (``POST /admin/experiments/stop-all``) or on shutdown. Why it stopped is kept.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from numpy.typing import NDArray
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, model_validator

from filters import chaos_rules, perturb
from proxy.call import CANARY, FAULTS, Call, CallKey, LocalReply, Reply, Result, SseEvent
from proxy.chain import FilterContext, Next
from proxy.clock import Clock
from proxy.config_refs import ConfigReferences
from proxy.errors import STATUS, ErrorKind, kind_from_grpc, kind_from_http
from proxy.tensor import Tensor, decode_bytes_elements, encode_bytes_elements

log = logging.getLogger("mmguard.fault")

SEEN: CallKey[list[str]] = CallKey("fault_experiments")
"""The experiments whose canary population this call belongs to (their windows count it)."""

FLOAT_TYPES = ("FP16", "FP32", "FP64")
INT_TYPES = ("INT32", "INT64")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ActionBase(Strict):
    name: str = ""
    """Names the action in ``mmguard-fault`` and metrics; defaults to its kind."""
    percent: float = Field(100.0, ge=0.0, le=100.0)
    """Share of the experiment's calls that get this action."""
    headers: dict[str, str] = {}
    """Only calls with these headers (``"*"`` = any value) get this action."""

    @property
    def what(self) -> str:
        """The action's kind (each subclass narrows ``kind`` to its literals)."""
        return str(self.__dict__.get("kind", type(self).__name__))

    @property
    def label(self) -> str:
        return self.name or self.what


class Delay(ActionBase):
    kind: Literal["delay"]
    ms: float | None = Field(None, ge=0)
    """A fixed delay."""
    mean_ms: float | None = Field(None, ge=0)
    std_ms: float = Field(0.0, ge=0)
    """Normal(mean_ms, std_ms), cut at 0 (the seeds' 50 ± 15 ms)."""
    min_ms: float | None = Field(None, ge=0)
    max_ms: float | None = Field(None, ge=0)
    """Uniform(min_ms, max_ms)."""

    @model_validator(mode="after")
    def _one_shape(self) -> Delay:
        shapes = [self.ms is not None, self.mean_ms is not None,
                  self.min_ms is not None or self.max_ms is not None]
        if sum(shapes) != 1:
            raise ValueError("give exactly one of: ms; mean_ms (+ std_ms); min_ms + max_ms")
        if shapes[2] and (self.min_ms is None or self.max_ms is None
                          or self.max_ms < self.min_ms):
            raise ValueError("a uniform delay needs min_ms <= max_ms")
        return self


class Abort(ActionBase):
    kind: Literal["abort"]
    http_status: int | None = Field(None, ge=400, le=599)
    grpc_code: str | None = None
    """e.g. UNAVAILABLE; with neither, 503 / UNAVAILABLE."""
    message: str = "fault injected"

    @model_validator(mode="after")
    def _code(self) -> Abort:
        if self.grpc_code is not None:
            import grpc
            if self.grpc_code.upper() not in grpc.StatusCode.__members__:
                raise ValueError(f"grpc_code '{self.grpc_code}' is not a gRPC status code name")
        return self


class InputAction(ActionBase):
    inputs: tuple[str, ...] = ()
    """v2 tensors to perturb; default: every tensor of the kind's type (images: floating point
    tensors of rank >= 3; tokens: INT32/INT64; text: BYTES). OpenAI calls: their images / texts."""


class Noise(InputAction):
    kind: Literal["gaussian_noise", "sign_noise"]
    sigma: float = Field(0.08, ge=0)
    """gaussian_noise: σ on [0, 1] pixels (0.08: the seeds' low-light figure)."""
    eps: float = Field(0.03, ge=0)
    """sign_noise: ε (FGSM's shape without gradients)."""
    lo: float = 0.0
    hi: float = 1.0


class Gradient(InputAction):
    kind: Literal["fgsm", "pgd"]
    eps: float = Field(0.03, ge=0)
    steps: int = Field(0, ge=0, le=100)
    """0: 1 for fgsm, 5 for pgd."""
    surrogate: Path
    """A TorchScript file: forward(image) -> the score to push (needs the ``torch`` extra)."""
    mode: Literal["lower", "raise"] = "lower"
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the surrogate's gradients run (cuda: a GPU torch build)."""
    lo: float = 0.0
    hi: float = 1.0


class PatchMask(InputAction):
    kind: Literal["patch_mask"]
    ratio: float = Field(0.25, ge=0, le=1)
    patch: int = Field(16, ge=1)
    tokens: str | None = None
    """A token-id tensor masked from the same seed as the image (a consistent cross-modal mask)."""
    pad_id: int = 0


class TokenDropout(InputAction):
    kind: Literal["token_dropout"]
    p: float = Field(0.15, ge=0, le=1)
    pad_id: int = 0
    keep_first: int = Field(0, ge=0)


class DropModality(InputAction):
    kind: Literal["drop_modality"]
    modality: Literal["image", "text"] | None = None
    """OpenAI calls: drop every image part (``image``); v2 calls: name the ``inputs``."""


class Precision(InputAction):
    kind: Literal["precision"]
    mode: Literal["round", "fp16", "bf16"] = "round"
    decimals: int = Field(3, ge=0, le=10)


class Degrade(InputAction):
    kind: Literal["blur", "darken", "quantise"]
    radius: float = Field(2.0, gt=0)
    factor: float = Field(0.3, ge=0)
    levels: int = Field(8, ge=2)


class TextCorrupt(InputAction):
    kind: Literal["mixed_scripts", "cut_text"]
    share: float = Field(0.3, ge=0, le=1)
    """mixed_scripts: share of Latin letters swapped for look-alikes."""
    keep: float = Field(0.5, ge=0, le=1)
    """cut_text: share of the text kept."""


class OutputFault(ActionBase):
    kind: Literal["nan_output", "truncate_output"]
    outputs: tuple[str, ...] = ()
    """v2 outputs to corrupt; default all. OpenAI answers: the message text."""
    share: float = Field(1.0, ge=0, le=1)
    """nan_output: share of the elements set to NaN."""
    keep: float = Field(0.5, ge=0, le=1)
    """truncate_output: share of each output's payload (or of the text) kept."""
    after_events: int = Field(4, ge=0)
    """truncate_output on a stream: content events kept before the text stops."""


class StreamFault(ActionBase):
    kind: Literal["slow_stream", "cut_stream", "reset"]
    ms: float = Field(100.0, ge=0)
    """slow_stream: delay before each event."""
    after_events: int = Field(2, ge=0)
    """cut_stream / reset of a stream: events passed before the cut."""


Action = Annotated[Delay | Abort | Noise | Gradient | PatchMask | TokenDropout | DropModality
                   | Precision | Degrade | TextCorrupt | OutputFault | StreamFault,
                   Field(discriminator="kind")]


class StopConditions(Strict):
    window_s: float = Field(30.0, gt=0)
    """The sliding window (the seeds: stop when a core SLO is out for 30 s)."""
    min_requests: int = Field(10, ge=1)
    """Judge only with at least this many canary answers in the window."""
    max_error_rate: float | None = Field(0.05, ge=0, le=1)
    """Share of the window's canary calls whose client got an error (injected ones included:
    what the client sees is what the SLO is about)."""
    max_p99_ms: float | None = Field(2000.0, gt=0)
    max_divergence: float | None = Field(None, ge=0, le=1)
    """Share of shadow comparisons on this route that disagreed (needs a ``shadow`` filter)."""
    # chaos (issue 16): the golden rules, see filters/chaos_rules.py
    baseline_calls: int = Field(0, ge=0)
    min_success: float | None = Field(None, ge=0, le=1)
    first_assertion_s: float = Field(15.0, gt=0)


class ExperimentConfig(Strict):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")
    actions: tuple[Action, ...] = Field(min_length=1)
    headers: dict[str, str] = {}
    """Within canary traffic, only calls with these headers."""
    share: float = Field(1.0, ge=0, le=1)
    """Blast radius: the share of the matching canary calls the experiment touches (stable by
    request key)."""
    max_active_faults: int | None = Field(None, ge=1)
    """At most this many calls under a fault at once (Envoy's max_active_faults)."""
    duration_s: float | None = Field(None, gt=0)
    """Stops by itself after this long; None: until a stop condition or an operator stops it."""
    seed: int = 0
    stop: StopConditions = StopConditions()


class FaultConfig(Strict):
    experiments: tuple[ExperimentConfig, ...] = ()
    """Experiments started with the config (again on each reload that changes them)."""

    @model_validator(mode="after")
    def _unique(self) -> FaultConfig:
        names = [e.name for e in self.experiments]
        if len(set(names)) != len(names):
            raise ValueError(f"experiment names must be unique: {names}")
        return self

    def references(self) -> ConfigReferences:
        """Experiment names (process-wide) and surrogate files (checked at load)."""
        return ConfigReferences(
            unique_names=tuple(("experiment", e.name) for e in self.experiments),
            files=tuple((f"experiments[{i}].actions[{j}].surrogate", a.surrogate)
                        for i, e in enumerate(self.experiments)
                        for j, a in enumerate(e.actions) if isinstance(a, Gradient)))


# --- experiments ----------------------------------------------------------------------------


@dataclass
class Experiment:
    cfg: ExperimentConfig
    route: str
    clock: Clock
    source: str  # config | api
    started: float = 0.0
    started_wall: float = 0.0
    state: str = "running"  # running | stopped | finished
    stop_reason: str = ""
    stopped_wall: float | None = None
    active: int = 0
    matched: int = 0
    injected: dict[str, int] = field(default_factory=dict)
    skipped: int = 0
    window: deque[tuple[float, bool, float]] = field(default_factory=deque)
    divergence: deque[tuple[float, bool]] = field(default_factory=deque)
    rules: chaos_rules.RuleState = field(default_factory=chaos_rules.RuleState)  # chaos

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def running(self) -> bool:
        return self.state == "running"

    def _trim(self, now: float) -> None:
        edge = now - self.cfg.stop.window_s
        while self.window and self.window[0][0] < edge:
            self.window.popleft()
        while self.divergence and self.divergence[0][0] < edge:
            self.divergence.popleft()

    def record(self, ok: bool, latency_s: float) -> str:
        """One canary answer; returns why the experiment must stop now ("" to go on)."""
        now = self.clock.monotonic()
        self.window.append((now, ok, latency_s))
        return self.check(now)

    def record_divergence(self, agree: bool) -> str:
        now = self.clock.monotonic()
        self.divergence.append((now, agree))
        return self.check(now)

    def check(self, now: float | None = None) -> str:
        now = self.clock.monotonic() if now is None else now
        stop = self.cfg.stop
        if self.cfg.duration_s is not None and now - self.started >= self.cfg.duration_s:
            return f"duration {self.cfg.duration_s:g} s is over"
        self._trim(now)
        why = chaos_rules.check(self, now)  # chaos (issue 16): baseline, success, 15 s rule
        if why:
            return why
        n = len(self.window)
        if n >= stop.min_requests:
            errors = sum(1 for _, ok, _ in self.window if not ok)
            rate = errors / n
            if stop.max_error_rate is not None and rate > stop.max_error_rate:
                return (f"error rate {rate:.3f} > {stop.max_error_rate:g} over the last "
                        f"{stop.window_s:g} s ({errors} of {n} canary calls)")
            if stop.max_p99_ms is not None:
                p99 = float(np.quantile([lat for _, _, lat in self.window], 0.99)) * 1000
                if p99 > stop.max_p99_ms:
                    return (f"p99 latency {p99:.0f} ms > {stop.max_p99_ms:g} ms over the last "
                            f"{stop.window_s:g} s ({n} canary calls)")
        m = len(self.divergence)
        if stop.max_divergence is not None and m >= stop.min_requests:
            rate = sum(1 for _, agree in self.divergence if not agree) / m
            if rate > stop.max_divergence:
                return (f"divergence from production {rate:.3f} > {stop.max_divergence:g} over "
                        f"the last {stop.window_s:g} s ({m} shadow comparisons)")
        return ""

    def snapshot(self) -> dict[str, Any]:
        now = self.clock.monotonic()
        self._trim(now)
        n = len(self.window)
        lat = [x for _, _, x in self.window]
        return {
            "name": self.name, "route": self.route, "source": self.source, "state": self.state,
            "stop_reason": self.stop_reason, "started": self.started_wall,
            "stopped": self.stopped_wall, "running_s": round(now - self.started, 3),
            "matched": self.matched, "injected": dict(self.injected), "skipped": self.skipped,
            "active_faults": self.active,
            "window": {"calls": n,
                       "error_rate": (sum(1 for _, ok, _ in self.window if not ok) / n
                                      if n else None),
                       "p99_ms": float(np.quantile(lat, 0.99)) * 1000 if lat else None,
                       "divergence": (sum(1 for _, a in self.divergence if not a)
                                      / len(self.divergence) if self.divergence else None)},
            "config": self.cfg.model_dump(mode="json"),
            **chaos_rules.snapshot(self),  # chaos (issue 16)
        }


STOP_CAUSES = ("operator", "duration", "slo", "config", "action-failed", "canary-abort",
               "shutdown")
"""Every ``cause`` label of mmguard_experiment_stops_total."""


class ExperimentRegistry:
    """Every experiment of the process (it outlives config reloads), by name."""

    def __init__(self, clock: Clock, telemetry: Any) -> None:
        self.clock = clock
        self.experiments: dict[str, Experiment] = {}
        self.m_state = telemetry.metric(Gauge, "mmguard_experiment_running",
                                        "1 while a fault experiment runs.",
                                        ["experiment", "route"])
        self.m_stops = telemetry.metric(Counter, "mmguard_experiment_stops_total",
                                        "Fault experiments stopped, by why.",
                                        ["experiment", "route", "cause"])

    def running(self, route: str) -> list[Experiment]:
        return [e for e in self.experiments.values() if e.route == route and e.running]

    def start(self, cfg: ExperimentConfig, route: str, source: str) -> Experiment:
        old = self.experiments.get(cfg.name)
        if old is not None and old.running and old.route != route:
            raise ValueError(f"experiment '{cfg.name}' already runs on route '{old.route}'")
        exp = Experiment(cfg, route, self.clock, source, started=self.clock.monotonic(),
                         started_wall=self.clock.wall())
        self.experiments[cfg.name] = exp
        self.m_state.labels(cfg.name, route).set(1)
        for cause in STOP_CAUSES:  # at 0 from the start: a single stop must show in increase()
            self.m_stops.labels(cfg.name, route, cause)
        log.warning("experiment %r started on route %r (%s): %s", cfg.name, route, source,
                    ", ".join(a.label for a in cfg.actions),
                    extra={"fields": {"experiment": cfg.name, "route": route}})
        return exp

    def stop(self, name: str, reason: str, cause: str = "operator",
             state: str = "stopped") -> Experiment | None:
        exp = self.experiments.get(name)
        if exp is None or not exp.running:
            return exp
        exp.state = state
        exp.stop_reason = reason
        exp.stopped_wall = self.clock.wall()
        self.m_state.labels(name, exp.route).set(0)
        self.m_stops.labels(name, exp.route, cause).inc()
        log.warning("experiment %r on route %r stopped: %s", name, exp.route, reason,
                    extra={"fields": {"experiment": name, "route": exp.route,
                                      "cause": cause, "reason": reason}})
        return exp

    def stop_all(self, reason: str, cause: str = "operator") -> list[str]:
        stopped = [n for n, e in self.experiments.items() if e.running]
        for name in stopped:
            self.stop(name, reason, cause)
        return stopped

    def auto_stop(self, exp: Experiment, why: str) -> None:
        if why.startswith("duration"):
            self.stop(exp.name, why, "duration", state="finished")
        else:
            self.stop(exp.name, why, "slo")

    def observe(self, call: Call, reply: Reply, latency_s: float) -> None:
        """A canary call's final answer (what its client got): feed the windows."""
        names = call.state.get(SEEN)
        if not names:
            return
        ok = not isinstance(reply, LocalReply)
        for name in names:
            exp = self.experiments.get(name)
            if exp is not None and exp.running:
                chaos_rules.record(exp, not ok and not getattr(reply, "injected", None),
                                   self.clock.monotonic())  # chaos (issue 16)
                why = exp.record(ok, latency_s)
                if why:
                    self.auto_stop(exp, why)

    def observe_divergence(self, route: str, agree: bool) -> None:
        """A shadow comparison on ``route`` (from the ``shadow`` filter)."""
        for exp in self.running(route):
            why = exp.record_divergence(agree)
            if why:
                self.auto_stop(exp, why)

    def snapshot(self) -> list[dict[str, Any]]:
        return [e.snapshot() for e in sorted(self.experiments.values(), key=lambda e: e.name)]

    def retire(self, in_config: set[str]) -> None:
        """After a reload: stop the config's experiments that the new config no longer has."""
        for exp in list(self.experiments.values()):
            if exp.source == "config" and exp.running and exp.name not in in_config:
                self.stop(exp.name, "removed from the config", "config")


def registry(ctx: FilterContext) -> ExperimentRegistry:
    """The process's registry (made on first use, kept across reloads)."""
    found = ctx.store.get("experiments")
    if found is None:
        found = ctx.store["experiments"] = ExperimentRegistry(ctx.clock, ctx.telemetry)
        ctx.store.setdefault("observers", {})["experiments"] = found.observe
    assert isinstance(found, ExperimentRegistry)
    return found


# --- the filter -----------------------------------------------------------------------------


def _headers_match(want: dict[str, str], have: dict[str, str]) -> bool:
    return all(k.lower() in have and (v == "*" or have[k.lower()] == v) for k, v in want.items())


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Fault:
    def __init__(self, cfg: FaultConfig, ctx: FilterContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.registry = registry(ctx)
        self.m_injected = ctx.telemetry.metric(
            Counter, "mmguard_faults_injected_total",
            "Faults injected into canary calls (never counted as the backend's failures).",
            ["model", "experiment", "action"])
        ctx.admin.setdefault("config_experiments", set()).update(e.name for e in cfg.experiments)
        for exp in cfg.experiments:  # at 0 from the start, so increase() sees the first
            for action in exp.actions:
                self.m_injected.labels(ctx.route, exp.name, action.label)
        ctx.on_activate(self._start_experiments)
        ctx.admin.setdefault("fault_routes", set()).add(ctx.route)

    def _start_experiments(self) -> None:
        for exp in self.cfg.experiments:  # a reload restarts only what changed
            old = self.registry.experiments.get(exp.name)
            if old is None or old.cfg != exp or old.route != self.ctx.route:
                self.registry.start(exp, self.ctx.route, "config")

    async def __call__(self, call: Call, next: Next) -> Reply:
        if not call.state.get(CANARY):
            return await next(call)
        running = self.registry.running(self.ctx.route)
        if not running:
            return await next(call)
        chosen: list[tuple[Experiment, int, ActionBase]] = []
        shares = self.ctx.share_hash
        key = shares.request_key(call)
        for exp in running:
            why = exp.check()
            if why:
                self.registry.auto_stop(exp, why)
                continue
            if not _headers_match(exp.cfg.headers, call.headers):
                continue
            if exp.cfg.share < 1 and not shares.in_share(f"experiment:{exp.name}", key,
                                                         exp.cfg.share):
                continue
            exp.matched += 1
            seen = call.state.get(SEEN)
            if seen is None:
                call.state[SEEN] = seen = []
            seen.append(exp.name)
            if chaos_rules.in_baseline(exp):  # chaos (issue 16): observed, not injected
                continue
            if exp.cfg.max_active_faults is not None and exp.active >= exp.cfg.max_active_faults:
                exp.skipped += 1
                self.ctx.telemetry.decide(call, "fault", "skipped", f"{exp.name}: "
                                          f"{exp.active} faults active (max "
                                          f"{exp.cfg.max_active_faults})")
                continue
            for i, action in enumerate(exp.cfg.actions):
                if not _headers_match(action.headers, call.headers):
                    continue
                if action.percent < 100 and not shares.in_share(
                        f"action:{exp.cfg.seed}:{exp.name}:{i}", key, action.percent / 100):
                    continue
                chosen.append((exp, i, action))
        if not chosen:
            return await next(call)
        exps = {id(e): e for e, _, _ in chosen}.values()
        for exp in exps:
            exp.active += 1
        try:
            return await self._inject(call, next, chosen)
        finally:
            for exp in exps:
                exp.active -= 1

    def _mark(self, call: Call, exp: Experiment, action: ActionBase, detail: str) -> str:
        tag = f"{exp.name}/{action.label}"
        faults = call.state.get(FAULTS)
        if faults is None:
            call.state[FAULTS] = faults = []
        faults.append(tag)
        exp.injected[action.label] = exp.injected.get(action.label, 0) + 1
        chaos_rules.injected(exp, self.ctx.clock.monotonic())  # chaos (issue 16)
        self.m_injected.labels(call.model, exp.name, action.label).inc()
        previous = call.decisions.get("mmguard-fault")
        self.ctx.telemetry.decide(call, "fault", tag, detail, experiment=exp.name,
                                  action=action.label)
        if previous:  # several faults on one call: keep them all in the header
            call.decisions["mmguard-fault"] = f"{previous}, {call.decisions['mmguard-fault']}"
        return tag

    async def _inject(self, call: Call, next: Next,
                      chosen: list[tuple[Experiment, int, ActionBase]]) -> Reply:
        shares = self.ctx.share_hash
        key = shares.request_key(call)
        after: list[tuple[Experiment, int, ActionBase]] = []
        for exp, i, action in chosen:
            if isinstance(action, Delay):
                seconds = self._delay_s(action, _seed(exp.cfg.seed, exp.name, i, key))
                self._mark(call, exp, action, f"delay {seconds * 1000:.0f} ms")
                await self.ctx.clock.sleep(seconds)
            elif isinstance(action, Abort):
                tag = self._mark(call, exp, action, "abort")
                return _abort(action, tag)
            elif isinstance(action, StreamFault) and action.kind == "reset" and not call.streaming:
                tag = self._mark(call, exp, action, "connection reset")
                return LocalReply(ErrorKind.UNAVAILABLE, f"connection reset ({tag})",
                                  injected=tag, reset=True)
            elif isinstance(action, InputAction):
                rng_seed = _seed(exp.cfg.seed, exp.name, i, key)
                try:
                    detail = self._perturb_input(call, action, rng_seed)
                except Exception as exc:  # a broken action stops its experiment, not the call
                    self.registry.stop(exp.name, f"action '{action.label}' failed: "
                                       f"{type(exc).__name__}: {exc}", "action-failed")
                    continue
                if detail:
                    self._mark(call, exp, action, detail)
            else:
                after.append((exp, i, action))
        reply = await next(call)
        if isinstance(reply, LocalReply):
            return reply
        for exp, _, action in after:
            if isinstance(action, OutputFault) and reply.stream is None:
                detail = _corrupt_output(reply, action)
                if detail:
                    self._mark(call, exp, action, detail)
            elif isinstance(action, StreamFault) and reply.stream is not None:
                tag = self._mark(call, exp, action, _stream_detail(action))
                reply.stream = self._faulty_stream(reply.stream, action, tag)
            elif isinstance(action, OutputFault) and reply.stream is not None:
                tag = self._mark(call, exp, action, f"{action.kind} on the stream's text")
                reply.stream = _corrupt_stream(reply.stream, action)
        return reply

    def _delay_s(self, a: Delay, seed: int) -> float:
        rng = np.random.default_rng(seed)
        if a.ms is not None:
            ms = a.ms
        elif a.mean_ms is not None:
            ms = max(0.0, float(rng.normal(a.mean_ms, a.std_ms)))
        else:
            assert a.min_ms is not None and a.max_ms is not None
            ms = float(rng.uniform(a.min_ms, a.max_ms))
        return ms / 1000

    async def _faulty_stream(self, items: AsyncIterator[Any], a: StreamFault,
                             tag: str) -> AsyncIterator[Any]:
        n = 0
        async for item in items:
            if a.kind == "slow_stream":
                await self.ctx.clock.sleep(a.ms / 1000)
            elif n >= a.after_events:
                if a.kind == "cut_stream":
                    yield LocalReply(ErrorKind.UNAVAILABLE, f"stream cut after {n} events "
                                     f"({tag})", injected=tag)
                else:
                    yield LocalReply(ErrorKind.UNAVAILABLE, f"connection reset after {n} "
                                     f"events ({tag})", injected=tag, reset=True)
                return
            yield item
            n += 1

    # --- inputs -------------------------------------------------------------------------------

    def _perturb_input(self, call: Call, a: InputAction, seed: int) -> str:
        if call.document is not None:
            return _perturb_openai(call, a, seed)
        return _perturb_tensors(call, a, seed)


def _stream_detail(a: StreamFault) -> str:
    if a.kind == "slow_stream":
        return f"slow stream: +{a.ms:g} ms per event"
    return f"{a.kind.replace('_', ' ')} after {a.after_events} events"


def _abort(a: Abort, tag: str) -> LocalReply:
    import grpc
    if a.grpc_code is not None:
        kind = kind_from_grpc(grpc.StatusCode[a.grpc_code.upper()])
    elif a.http_status is not None:
        kind = kind_from_http(a.http_status)
    else:
        kind = ErrorKind.UNAVAILABLE
    status = a.http_status if a.http_status is not None else STATUS[kind].http
    return LocalReply(kind, f"{a.message} ({tag})", status=status, injected=tag)


def _is_image(t: Tensor) -> bool:
    return t.datatype in FLOAT_TYPES and len(t.shape) >= 3


def _targets(call: Call, a: InputAction, pick: Callable[[Tensor], bool]) -> list[Tensor]:
    if a.inputs:
        return [t for t in call.inputs if t.name in a.inputs]
    return [t for t in call.inputs if pick(t)]


def _image_op(a: InputAction, rng: np.random.Generator) -> Callable[[NDArray[Any]], NDArray[Any]]:
    if isinstance(a, Noise):
        if a.kind == "gaussian_noise":
            return lambda x: perturb.gaussian_noise(x, a.sigma, rng, a.lo, a.hi)
        return lambda x: perturb.sign_noise(x, a.eps, rng, a.lo, a.hi)
    if isinstance(a, Gradient):
        surrogate = _surrogate(str(a.surrogate), a.mode, a.device)
        steps = a.steps or (1 if a.kind == "fgsm" else 5)
        return lambda x: perturb.fgsm(x, a.eps, surrogate, steps=steps, lo=a.lo, hi=a.hi)
    if isinstance(a, PatchMask):
        return lambda x: perturb.patch_mask(x, a.ratio, a.patch, rng)[0]
    if isinstance(a, Precision):
        return lambda x: perturb.precision_collapse(x, a.mode, a.decimals)
    if isinstance(a, Degrade):
        if a.kind == "blur":
            return lambda x: perturb.blur(x, a.radius)
        if a.kind == "darken":
            return lambda x: perturb.darken(x, a.factor)
        return lambda x: perturb.quantise(x, a.levels)
    raise ValueError(f"{a.label} is not an image perturbation")


_SURROGATES: dict[tuple[str, str, str], Any] = {}


def _surrogate(path: str, mode: Literal["lower", "raise"], device: str) -> Any:
    found = _SURROGATES.get((path, mode, device))
    if found is None:
        found = _SURROGATES[(path, mode, device)] = perturb.load_surrogate(path, mode=mode,
                                                                           device=device)
    return found


def _perturb_tensors(call: Call, a: InputAction, seed: int) -> str:
    rng = np.random.default_rng(seed)
    if isinstance(a, DropModality):
        names = set(a.inputs)
        kept = [t for t in call.inputs if t.name not in names]
        if len(kept) == len(call.inputs):
            return ""
        call.set_inputs(kept)
        return f"dropped {sorted(names & {t.name for t in call.inputs} or names)}"
    out = list(call.inputs)
    touched: list[str] = []
    if isinstance(a, PatchMask) and a.tokens:
        images = _targets(call, a, _is_image)
        ids = call.input(a.tokens)
        if images and ids is not None:
            img, tok = perturb.shared_mask(seed, images[0].numpy(), ids.numpy(), a.ratio,
                                           a.patch, pad_id=a.pad_id)
            _replace(out, images[0], img)
            _replace(out, ids, tok)
            call.set_inputs(out)
            return (f"patch mask {a.ratio:g} on '{images[0].name}' and '{ids.name}' "
                    f"(patch {a.patch}, one seed)")
    if isinstance(a, TokenDropout):  # token ids lose tokens; text loses words
        for t in _targets(call, a, lambda t: t.datatype in (*INT_TYPES, "BYTES")):
            if t.datatype in INT_TYPES:
                _replace(out, t, perturb.token_dropout(t.numpy(), a.p, rng, pad_id=a.pad_id,
                                                       keep_first=a.keep_first))
            elif t.datatype == "BYTES":
                texts = [x.decode("utf-8", "replace") for x in _bytes_items(t)]
                _replace_bytes(out, t, [perturb.word_dropout(x, a.p, rng) for x in texts])
            else:
                continue
            touched.append(t.name)
    elif isinstance(a, TextCorrupt):
        for t in _targets(call, a, lambda t: t.datatype == "BYTES"):
            texts = [x.decode("utf-8", "replace") for x in _bytes_items(t)]
            _replace_bytes(out, t, [_corrupt_text(x, a, rng) for x in texts])
            touched.append(t.name)
    else:
        pick = (lambda t: t.datatype in FLOAT_TYPES) if isinstance(a, Precision) else _is_image
        op = _image_op(a, rng)
        for t in _targets(call, a, pick):
            if t.datatype not in FLOAT_TYPES:
                continue
            _replace(out, t, op(t.numpy()))
            touched.append(t.name)
    if not touched:
        return ""
    call.set_inputs(out)
    return f"{a.what} on {touched}"


def _corrupt_text(text: str, a: TextCorrupt, rng: np.random.Generator) -> str:
    if a.kind == "mixed_scripts":
        return str(perturb.mixed_scripts(text, a.share, rng))
    return str(perturb.cut_text(text, a.keep))


def _bytes_items(t: Tensor) -> list[bytes]:
    return decode_bytes_elements(t.raw_bytes(), t.elements, t.name)


def _replace(out: list[Tensor], old: Tensor, arr: NDArray[Any]) -> None:
    i = next(j for j, t in enumerate(out) if t.name == old.name)
    out[i] = Tensor.from_numpy(old.name, np.ascontiguousarray(arr).astype(arr.dtype),
                               old.datatype)


def _replace_bytes(out: list[Tensor], old: Tensor, texts: list[str]) -> None:
    i = next(j for j, t in enumerate(out) if t.name == old.name)
    out[i] = Tensor(old.name, "BYTES", old.shape,
                    raw=encode_bytes_elements([x.encode() for x in texts]))


def _perturb_openai(call: Call, a: InputAction, seed: int) -> str:
    from proxy.openai_api import ChatView
    view = ChatView(call)
    rng = np.random.default_rng(seed)
    if isinstance(a, DropModality):
        if a.modality == "image":
            images = view.images()
            for image in reversed(images):
                view.drop_image(image)
            return f"dropped {len(images)} image(s)" if images else ""
        return ""
    if isinstance(a, (TokenDropout, TextCorrupt)):
        texts = view.texts()
        for i, text in enumerate(texts):
            new = (perturb.word_dropout(text, a.p, rng) if isinstance(a, TokenDropout)
                   else _corrupt_text(text, a, rng))
            view.replace_text(i, new)
        return f"{a.what} on {len(texts)} text(s)" if texts else ""
    op = _image_op(a, rng)
    count = 0
    for image in view.images():
        if not image.url.startswith("data:"):
            continue
        pixels = image.array().astype(np.float32).transpose(2, 0, 1)[None] / 255.0
        changed = op(pixels)
        part = view.doc["messages"][image.message]["content"][image.part]
        part["image_url"] = {"url": _png_data_url(changed[0])}
        count += 1
    if count:
        call.wire = None
    return f"{a.what} on {count} image(s)" if count else ""


def _png_data_url(chw: NDArray[Any]) -> str:
    from PIL import Image
    hwc = (np.clip(chw.transpose(1, 2, 0), 0, 1) * 255 + 0.5).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(hwc).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# --- outputs --------------------------------------------------------------------------------


def _corrupt_output(reply: Result, a: OutputFault) -> str:
    if reply.wire is not None and reply.wire.protocol == "openai":
        return _corrupt_openai_answer(reply, a)
    outs = list(reply.outputs)
    touched = []
    for j, t in enumerate(outs):
        if a.outputs and t.name not in a.outputs:
            continue
        if a.kind == "nan_output":
            if t.datatype not in FLOAT_TYPES:
                continue
            arr = np.array(t.numpy(), copy=True)
            flat = arr.reshape(-1)
            count = max(1, math.ceil(flat.size * a.share)) if flat.size else 0
            flat[:count] = np.nan
            outs[j] = Tensor.from_numpy(t.name, arr, t.datatype)
        else:
            raw = bytes(t.raw_bytes())
            outs[j] = Tensor(t.name, t.datatype, t.shape, raw=raw[:int(len(raw) * a.keep)])
        touched.append(t.name)
    if not touched:
        return ""
    reply.set_outputs(outs)
    return f"{a.what} on {touched}"


def _corrupt_openai_answer(reply: Result, a: OutputFault) -> str:
    import json

    from proxy.call import Wire
    assert reply.wire is not None
    doc = json.loads(reply.wire.body)
    touched = 0
    for choice in doc.get("choices") or []:
        msg = choice.get("message") if isinstance(choice, dict) else None
        key, holder = (("content", msg) if isinstance(msg, dict) else ("text", choice))
        text = holder.get(key) if isinstance(holder, dict) else None
        if isinstance(text, str):
            holder[key] = text[:int(len(text) * a.keep)] if a.kind == "truncate_output" else ""
            touched += 1
    if not touched:
        return ""
    reply.wire = Wire("openai", json.dumps(doc).encode(), content_type="application/json")
    return f"{a.kind} on {touched} choice(s)"


async def _corrupt_stream(items: AsyncIterator[Any], a: OutputFault) -> AsyncIterator[Any]:
    """truncate_output on a stream: text after ``after_events`` content events is dropped while
    the stream still ends normally (finish reason, usage, [DONE]) — a silently cut answer.
    nan_output has no meaning for text: it passes the stream unchanged."""
    import json
    n = 0
    async for item in items:
        if a.kind == "truncate_output" and isinstance(item, SseEvent) and not item.done:
            doc = item.json()
            if doc is not None:
                for choice in doc.get("choices") or []:
                    delta = choice.get("delta") if isinstance(choice, dict) else None
                    if isinstance(delta, dict) and delta.get("content"):
                        n += 1
                        if n > a.after_events:
                            delta["content"] = ""
                if n > a.after_events:
                    item = SseEvent(b"data: " + json.dumps(doc).encode() + b"\n\n")
        yield item


class FaultFactory:
    name = "fault"
    config_model = FaultConfig

    def build(self, config: FaultConfig, ctx: FilterContext) -> Fault:
        return Fault(config, ctx)

