"""Running experiments: the process-wide registry, their windows and why each stopped.

In a pod of several workers (``proxy.pod.state``) the registry is decided by the supervisor: it
starts and stops experiments (config, admin API, its clock), and judges the stop windows on every
worker's answers; a worker forwards what it saw (``tally``, ``outcome``, ``observe_divergence``) and
reads its replica to choose the calls. ``active`` (faults in flight, for
``max_active_faults``) is each worker's own.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import Counter, Gauge

from filters.fault import rules
from filters.fault.config import (
    SEEN,
    ExperimentConfig,
)
from proxy.call import Call, LocalReply, Reply
from proxy.chain import FilterContext
from proxy.clock import Clock
from proxy.lifecycle import StateKey
from proxy.pod.state import Shared, decided, share, supervisor_only

log = logging.getLogger("mmguard.fault")


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
    rules: rules.RuleState = field(default_factory=rules.RuleState)  # chaos

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
        why = rules.check(self, now)  # the golden rules: baseline, success, 15 s
        if why:
            return why
        if len(self.window) >= stop.min_requests:
            why = rules.judged_window(self)
            if why:
                return why
        m = len(self.divergence)
        if stop.max_divergence is not None and m >= stop.min_requests:
            bad = sum(1 for _, agree in self.divergence if not agree)
            if rules.rate_above(bad, m, stop.max_divergence, rules.level(stop)):
                return (f"divergence from production {bad / m:.3f} > {stop.max_divergence:g} "
                        f"over the last {stop.window_s:g} s ({m} shadow comparisons; "
                        f"{rules.rate_bounds(bad, m, rules.level(stop))})")
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
            **rules.snapshot(self),  # the golden rules' figures, for the report
        }


STOP_CAUSES = ("operator", "duration", "slo", "config", "action-failed", "canary-abort",
               "shutdown")
"""Every ``cause`` label of mmguard_experiment_stops_total."""


class ExperimentRegistry(Shared):
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
        # What alerts read: totals whose every child exists at 0 from start-up, so that an
        # experiment that starts and stops between two scrapes still shows in increase()
        # (the per-experiment children above first appear when it starts).
        self.m_started_all = telemetry.metric(Counter, "mmguard_fault_experiments_started_total",
                                              "Fault experiments started (every one).", [])
        self.m_stopped_all = telemetry.metric(Counter, "mmguard_fault_experiments_stopped_total",
                                              "Fault experiments stopped (every one), by why.",
                                              ["cause"])
        for cause in STOP_CAUSES:
            self.m_stopped_all.labels(cause)

    def running(self, route: str) -> list[Experiment]:
        return [e for e in self.experiments.values() if e.route == route and e.running]

    @supervisor_only
    def start(self, cfg: ExperimentConfig, route: str, source: str) -> Experiment:
        old = self.experiments.get(cfg.name)
        if old is not None and old.running and old.route != route:
            raise ValueError(f"experiment '{cfg.name}' already runs on route '{old.route}'")
        exp = Experiment(cfg, route, self.clock, source, started=self.clock.monotonic(),
                         started_wall=self.clock.wall())
        self.experiments[cfg.name] = exp
        self.m_state.labels(cfg.name, route).set(1)
        self.m_started_all.inc()
        for cause in STOP_CAUSES:  # at 0 from the start: a single stop must show in increase()
            self.m_stops.labels(cfg.name, route, cause)
        # Started by the config it serves: expected, INFO (a correct start logs no WARNING);
        # started through the admin API: someone injects faults into live traffic, WARNING.
        log.log(logging.INFO if source == "config" else logging.WARNING,
                "experiment %r started on route %r (%s): %s", cfg.name, route, source,
                    ", ".join(a.label for a in cfg.actions),
                    extra={"fields": {"experiment": cfg.name, "route": route}})
        return exp

    @supervisor_only
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
        self.m_stopped_all.labels(cause).inc()
        log.warning("experiment %r on route %r stopped: %s", name, exp.route, reason,
                    extra={"fields": {"experiment": name, "route": exp.route,
                                      "cause": cause, "reason": reason}})
        return exp

    @supervisor_only
    def stop_all(self, reason: str, cause: str = "operator") -> list[str]:
        stopped = [n for n, e in self.experiments.items() if e.running]
        for name in stopped:
            self.stop(name, reason, cause)
        return stopped

    @supervisor_only
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
        self.outcome(list(names), ok, not ok and not getattr(reply, "injected", None), latency_s)

    @decided
    def outcome(self, names: list[str], ok: bool, failed_on_its_own: bool,
                latency_s: float) -> None:
        """What a canary call's client got, for the experiments that matched it."""
        for name in names:
            exp = self.experiments.get(name)
            if exp is not None and exp.running:
                rules.record(exp, failed_on_its_own,
                                   self.clock.monotonic())  # the baseline is judged on the clock
                why = exp.record(ok, latency_s)
                if why:
                    self.auto_stop(exp, why)

    @decided
    def tally(self, name: str, matched: int = 0, skipped: int = 0, baseline: int = 0,
              injected: str | None = None, at: float | None = None) -> None:
        """A call the experiment matched: observed for the baseline, skipped, or injected."""
        exp = self.experiments.get(name)
        if exp is None:
            return
        exp.matched += matched
        exp.skipped += skipped
        exp.rules.baseline_seen += baseline
        if injected is not None:
            exp.injected[injected] = exp.injected.get(injected, 0) + 1
            rules.injected(exp, self.clock.monotonic() if at is None else at)

    @decided
    def action_failed(self, name: str, reason: str) -> None:
        """A broken action stops its experiment, in every worker."""
        self.stop(name, reason, "action-failed")

    @decided
    def observe_divergence(self, route: str, agree: bool) -> None:
        """A shadow comparison on ``route`` (from the ``shadow`` filter)."""
        for exp in self.running(route):
            why = exp.record_divergence(agree)
            if why:
                self.auto_stop(exp, why)

    def snapshot(self) -> list[dict[str, Any]]:
        return [e.snapshot() for e in sorted(self.experiments.values(), key=lambda e: e.name)]

    # --- a pod's one registry (proxy.pod.state) ---------------------------------------------------

    def tick(self) -> bool:
        """Durations end on the supervisor's clock, calls or none."""
        stopped = False
        for exp in list(self.experiments.values()):
            if exp.running and (why := exp.check()):
                self.auto_stop(exp, why)
                stopped = True
        return stopped

    def export_state(self) -> dict[str, dict[str, Any]]:
        """What a worker chooses calls with: each experiment's config, state and baseline
        count (the windows and counters stay with the supervisor, whose admin API shows them)."""
        return {name: {"cfg": exp.cfg, "route": exp.route, "source": exp.source,
                       "started": exp.started, "started_wall": exp.started_wall,
                       "state": exp.state, "stop_reason": exp.stop_reason,
                       "stopped_wall": exp.stopped_wall,
                       "rules": rules.RuleState(exp.rules.baseline_seen,
                                                      exp.rules.first_injection)}
                for name, exp in self.experiments.items()}

    def import_state(self, state: dict[str, dict[str, Any]]) -> None:
        old = self.experiments
        self.experiments = {}
        for name, fields in state.items():
            exp = Experiment(clock=self.clock, **fields)
            if name in old:
                exp.active = old[name].active  # this worker's faults in flight
            self.experiments[name] = exp

    @supervisor_only
    def retire(self, in_config: set[str]) -> None:
        """After a reload: stop the config's experiments that the new config no longer has."""
        for exp in list(self.experiments.values()):
            if exp.source == "config" and exp.running and exp.name not in in_config:
                self.stop(exp.name, "removed from the config", "config")


EXPERIMENTS: StateKey[ExperimentRegistry] = StateKey("experiments")
"""The process's experiments (``FilterContext.state``: they outlive reloads)."""
FAULT_ROUTES: StateKey[set[str]] = StateKey("fault_routes")
"""The routes whose chain has a fault filter (``FilterContext.local``: per runtime)."""


def registry(ctx: FilterContext) -> ExperimentRegistry:
    """The process's registry (made, empty, on first use; kept across reloads)."""
    return ctx.state.setdefault(EXPERIMENTS, lambda: _shared(ExperimentRegistry(ctx.clock,
                                                                            ctx.telemetry)))


def _shared(reg: ExperimentRegistry) -> ExperimentRegistry:
    share(reg, "experiments")
    return reg
