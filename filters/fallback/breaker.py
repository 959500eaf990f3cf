"""A circuit breaker with resilience4j's semantics, on an injected clock.

CLOSED records outcomes in a sliding window (the last N calls, or the calls of the last N
seconds). Once the window holds ``minimum_calls``, a failure rate or a slow-call rate at or
above its threshold opens the breaker. OPEN refuses calls for ``wait_in_open_s``, then lets
``permitted_in_half_open`` calls through (HALF_OPEN); their outcomes close the breaker again or
re-open it. FORCED_OPEN and FORCED_CLOSED are set by an operator and stay until reset.

In a pod of several workers (``proxy.pod.state``) the breaker is decided once, by the supervisor, on
every worker's outcomes: a worker forwards ``record`` and reads its replica; the wait in open
ends on the supervisor's clock (``tick``); the half-open probes are shared out over the workers,
so the pod lets ``permitted_in_half_open`` through, not that many per worker.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from proxy.clock import Clock
from proxy.pod.state import POD, Shared, decided, permits_share


class State(enum.IntEnum):  # the value is the gauge's value
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2
    FORCED_OPEN = 3
    FORCED_CLOSED = 4


@dataclass(frozen=True)
class BreakerSettings:
    window: Literal["count", "time"] = "count"
    window_size: int = 20  # calls, or seconds
    minimum_calls: int = 5
    failure_rate: float = 0.5
    slow_call_s: float = 5.0
    slow_call_rate: float = 1.0
    wait_in_open_s: float = 10.0
    permitted_in_half_open: int = 3


@dataclass(frozen=True)
class Outcome:
    at: float
    failed: bool
    slow: bool


class Breaker(Shared):
    def __init__(self, settings: BreakerSettings, clock: Clock,
                 on_change: Callable[[State, State, str], None] | None = None,
                 on_import: Callable[[State], None] | None = None) -> None:
        self.s = settings
        self._on_import = on_import
        """A replica took a new state from the pod's supervisor (gauges; the log is the
        supervisor's)."""
        self.clock = clock
        self.state = State.CLOSED
        self._window: deque[Outcome] = deque()
        self._failed = 0
        self._slow = 0
        """Failed and slow outcomes in ``_window``, kept as it changes: ``record`` reads the
        rates in O(1), not by summing a window that a time window can make thousands long."""
        self._opened_at = 0.0
        self._half_open_left = 0
        self._half_open_outcomes: list[Outcome] = []
        self._on_change = on_change
        self.reason = ""

    def _move(self, state: State, reason: str) -> None:
        old, self.state, self.reason = self.state, state, reason
        if state in (State.OPEN, State.FORCED_OPEN):
            self._opened_at = self.clock.monotonic()
        if state == State.HALF_OPEN:
            self._half_open_left = self.s.permitted_in_half_open
            self._half_open_outcomes = []
        if state == State.CLOSED:
            self._window.clear()
            self._failed = self._slow = 0
        if self._on_change and old != state:
            self._on_change(old, state, reason)

    def allow(self) -> bool:
        """May a call go through now? (HALF_OPEN hands out its permits one by one.)"""
        if self.state in (State.CLOSED, State.FORCED_CLOSED):
            return True
        if self.state == State.FORCED_OPEN:
            return False
        if self.state == State.OPEN:
            if self.clock.monotonic() - self._opened_at < self.s.wait_in_open_s:
                return False
            if POD.is_worker and self.shared_id:
                return False  # the supervisor moves it to half-open (tick), for the whole pod
            self._move(State.HALF_OPEN, f"{self.s.wait_in_open_s:g}s in open passed")
        if self._half_open_left <= 0:
            return False
        self._half_open_left -= 1
        return True

    def retry_after_s(self) -> float:
        if self.state != State.OPEN:
            return self.s.wait_in_open_s
        return max(0.0, self.s.wait_in_open_s - (self.clock.monotonic() - self._opened_at))

    @decided
    def record(self, failed: bool, duration_s: float) -> None:
        outcome = Outcome(self.clock.monotonic(), failed, duration_s >= self.s.slow_call_s)
        if self.state == State.HALF_OPEN:
            self._half_open_outcomes.append(outcome)
            if len(self._half_open_outcomes) >= self.s.permitted_in_half_open:
                rate, slow = _rates(self._half_open_outcomes)
                if rate >= self.s.failure_rate or slow >= self.s.slow_call_rate:
                    self._move(State.OPEN, f"half-open probes: failure rate {rate:.0%}, slow "
                               f"{slow:.0%}")
                else:
                    self._move(State.CLOSED, f"half-open probes passed ({rate:.0%} failed)")
            return
        if self.state != State.CLOSED:
            return
        self._window.append(outcome)
        self._failed += outcome.failed
        self._slow += outcome.slow
        self._trim()
        n = len(self._window)
        if n < self.s.minimum_calls:
            return
        rate, slow = self._failed / n, self._slow / n
        if rate >= self.s.failure_rate:
            self._move(State.OPEN, f"failure rate {rate:.0%} over the last {len(self._window)} "
                       f"calls (threshold {self.s.failure_rate:.0%})")
        elif slow >= self.s.slow_call_rate:
            self._move(State.OPEN, f"slow-call rate {slow:.0%} over the last "
                       f"{len(self._window)} calls (calls over {self.s.slow_call_s:g}s; "
                       f"threshold {self.s.slow_call_rate:.0%})")

    def _trim(self) -> None:
        if self.s.window == "count":
            while len(self._window) > self.s.window_size:
                self._drop_oldest()
        else:
            horizon = self.clock.monotonic() - self.s.window_size
            while self._window and self._window[0].at < horizon:
                self._drop_oldest()

    def _drop_oldest(self) -> None:
        gone = self._window.popleft()
        self._failed -= gone.failed
        self._slow -= gone.slow

    @decided
    def force(self, action: Literal["open", "close", "reset"]) -> None:
        if action == "open":
            self._move(State.FORCED_OPEN, "forced open by an operator")
        elif action == "close":
            self._move(State.FORCED_CLOSED, "forced closed by an operator")
        else:
            self._move(State.CLOSED, "reset by an operator")

    # --- a pod's one breaker (proxy.pod.state) ----------------------------------------------------

    def tick(self) -> bool:
        if (self.state == State.OPEN
                and self.clock.monotonic() - self._opened_at >= self.s.wait_in_open_s):
            self._move(State.HALF_OPEN, f"{self.s.wait_in_open_s:g}s in open passed")
            return True
        return False

    def export_state(self) -> dict[str, object]:
        """What ``allow`` reads (the window of outcomes stays with the supervisor)."""
        return {"state": self.state, "reason": self.reason, "opened_at": self._opened_at}

    def import_state(self, state: dict[str, Any]) -> None:
        old = self.state
        new = State(state["state"])
        self.reason = str(state["reason"])
        self._opened_at = float(state["opened_at"])
        if new == State.HALF_OPEN and old != State.HALF_OPEN:  # this worker's part of the probes
            self._half_open_left = permits_share(self.s.permitted_in_half_open)
        self.state = new
        if old != new and self._on_import is not None:
            self._on_import(new)

    def snapshot(self) -> dict[str, object]:
        rate, slow = _rates(self._window) if self._window else (0.0, 0.0)
        return {"state": self.state.name.lower(), "reason": self.reason,
                "calls_in_window": len(self._window), "failure_rate": round(rate, 4),
                "slow_call_rate": round(slow, 4),
                "retry_after_s": round(self.retry_after_s(), 3)}


def _rates(outcomes: deque[Outcome] | list[Outcome]) -> tuple[float, float]:
    n = len(outcomes)
    if n == 0:
        return 0.0, 0.0
    return sum(o.failed for o in outcomes) / n, sum(o.slow for o in outcomes) / n
