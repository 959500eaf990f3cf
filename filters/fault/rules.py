"""The chaos golden rules for fault experiments, on top of ``fault``'s stop conditions.

Seeds: observability in place and baselined before injecting; the experiment stops by itself
when a core SLO is out for its window (30 s: success < 99.5 % or p99 > 2 s); assertions run
within 15 s of the first injection. ``fault``'s ``StopConditions`` already judge the error rate
(what clients got, injected errors included), p99 and divergence once ``min_requests`` answers
are in. This module adds, as ``stop`` options:

- ``baseline_calls``: the first this many matching canary calls are observed without any fault
  (the experiment's state says ``baseline`` until then);
- ``min_success``: the share of the window's calls that did not fail on their own (an error the
  experiment injected is the experiment, not the system failing) — below it, the SLO is out;
- ``first_assertion_s``: once this long has passed since the first injection, the conditions
  are judged on whatever answers the window holds (at least one), not only after
  ``min_requests``; the moment of the first assertion is kept.

Every stop reason starts with the figure it is about, and ``slo_of`` names it (``error_rate``,
``p99``, ``success``, ``divergence``, ``duration``) for the admin API.

A stop is a statistic, not a threshold on a few calls: a rate stops the experiment only when
its confidence-sequence bound (``filters.compare.sequential``, at the stop's ``alpha``) is past
the limit, and a p99 only when its distribution-free lower bound is — a p99 of five calls is
their maximum, and one scheduler stall must not stop an experiment. The stop's ``alpha`` is the
chance of stopping an experiment whose SLO holds on *any* condition, so each configured
condition tests at its share (``level``), as the release verdict splits its ``alpha``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from filters.compare.sequential import (
    LogHistogram,
    lower_bound,
    prior_around,
    quantile_bounds,
    rejects,
    upper_bound,
)

_RATE = prior_around(0.05, 0.5)
_TAIL = prior_around(0.99)


def level(stop: Any) -> float:
    """Each condition's false-stop rate: ``alpha`` split evenly over the configured ones."""
    conditions = (stop.max_error_rate, stop.max_p99_ms, stop.min_success, stop.max_divergence)
    return float(stop.alpha) / max(1, sum(c is not None for c in conditions))


def rate_above(bad: int, n: int, limit: float, alpha: float) -> bool:
    """The share ``bad / n`` is shown above ``limit`` (its lower bound is)."""
    return n > 0 and bad > limit * n and rejects(bad, n, limit, alpha, _RATE)


def rate_below(good: int, n: int, limit: float, alpha: float) -> bool:
    """The share ``good / n`` is shown below ``limit`` (its upper bound is)."""
    return n > 0 and good < limit * n and rejects(good, n, limit, alpha, _RATE)


def rate_bounds(k: int, n: int, alpha: float) -> str:
    return (f"bounds {lower_bound(k, n, alpha, _RATE):.3f} to "
            f"{upper_bound(k, n, alpha, _RATE):.3f}, false-stop rate {alpha:g}")


def p99_lower_ms(latencies_s: list[float], alpha: float) -> float | None:
    """The distribution-free lower bound of the calls' p99 (ms); None when the calls cannot
    bound it yet."""
    h = LogHistogram()
    for x in latencies_s:
        h.add(x * 1000)
    return quantile_bounds(h, 0.99, alpha, _TAIL).lower


@dataclass
class RuleState:
    """Per experiment: the baseline count, the first injection and first assertion, and the
    window of (time, failed on its own) for ``min_success``."""

    baseline_seen: int = 0
    first_injection: float | None = None
    first_assertion: float | None = None
    own: deque[tuple[float, bool]] = field(default_factory=deque)


def in_baseline(exp: Any) -> bool:
    """This matching call is part of the baseline: observe it, inject nothing (the caller
    counts it: ``baseline_seen``)."""
    st: RuleState = exp.rules
    return bool(st.baseline_seen < exp.cfg.stop.baseline_calls)


def injected(exp: Any, now: float) -> None:
    st: RuleState = exp.rules
    if st.first_injection is None:
        st.first_injection = now


def record(exp: Any, failed_on_its_own: bool, now: float) -> None:
    exp.rules.own.append((now, failed_on_its_own))


def check(exp: Any, now: float) -> str:
    """The added conditions (and the early assertion); "" when all hold."""
    stop = exp.cfg.stop
    st: RuleState = exp.rules
    edge = now - stop.window_s
    while st.own and st.own[0][0] < edge:
        st.own.popleft()
    n = len(exp.window)
    early = (st.first_injection is not None and n >= 1 and n < stop.min_requests
             and now - st.first_injection >= stop.first_assertion_s)
    judged = n >= stop.min_requests or early
    if judged and st.first_assertion is None and st.first_injection is not None:
        st.first_assertion = now
    if not judged:
        return ""
    own = len(st.own)
    if stop.min_success is not None and own:
        good = own - sum(1 for _, bad in st.own if bad)
        if rate_below(good, own, stop.min_success, level(stop)):
            return (f"success {good / own:.3%} < {stop.min_success:.1%} over the last "
                    f"{stop.window_s:g} s ({own} canary calls, injected refusals not counted; "
                    f"{rate_bounds(good, own, level(stop))})")
    if early:  # fault's own checks wait for min_requests; past first_assertion_s, not so
        return judged_window(exp, f"; first assertion {stop.first_assertion_s:g} s after the "
                                  f"first injection")
    return ""


def judged_window(exp: Any, note: str = "") -> str:
    """The error-rate and p99 stops over the window's canary calls, as statistics."""
    stop = exp.cfg.stop
    n, lv = len(exp.window), level(stop)
    errors = sum(1 for _, ok, _ in exp.window if not ok)
    if stop.max_error_rate is not None and rate_above(errors, n, stop.max_error_rate, lv):
        return (f"error rate {errors / n:.3f} > {stop.max_error_rate:g} over the last "
                f"{stop.window_s:g} s ({errors} of {n} canary calls; "
                f"{rate_bounds(errors, n, lv)}{note})")
    if stop.max_p99_ms is not None and n:
        low = p99_lower_ms([lat for _, _, lat in exp.window], lv)
        if low is not None and low > stop.max_p99_ms:
            return (f"p99 latency ≥ {low:.0f} ms > {stop.max_p99_ms:g} ms over the last "
                    f"{stop.window_s:g} s ({n} canary calls; distribution-free lower bound, "
                    f"false-stop rate {lv:g}{note})")
    return ""


_SLOS = (("error rate", "error_rate"), ("p99 latency", "p99"), ("success", "success"),
         ("divergence", "divergence"), ("duration", "duration"))


def slo_of(reason: str) -> str | None:
    return next((name for prefix, name in _SLOS if reason.startswith(prefix)), None)


def snapshot(exp: Any) -> dict[str, Any]:
    st: RuleState = exp.rules
    want = exp.cfg.stop.baseline_calls
    return {"baseline": {"calls": min(st.baseline_seen, want), "of": want,
                         "done": st.baseline_seen >= want},
            "first_injection_s": (None if st.first_injection is None
                                  else round(st.first_injection - exp.started, 3)),
            "first_assertion_after_injection_s": (
                None if st.first_assertion is None or st.first_injection is None
                else round(st.first_assertion - st.first_injection, 3)),
            "stop_slo": slo_of(exp.stop_reason) if exp.stop_reason else None}
