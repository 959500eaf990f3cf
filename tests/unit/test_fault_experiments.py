"""An experiment's sliding window, duration and stop conditions on an injected clock."""

from __future__ import annotations

from typing import Any

import pytest

from filters.fault import Experiment, ExperimentConfig, ExperimentRegistry
from proxy.call import Call, LocalReply, Result
from proxy.clock import ManualClock
from proxy.errors import ErrorKind
from proxy.telemetry import Telemetry


def make(clock: ManualClock, **stop: Any) -> tuple[ExperimentRegistry, Experiment]:
    reg = ExperimentRegistry(clock, Telemetry())
    cfg = ExperimentConfig.model_validate({
        "name": "e", "actions": [{"kind": "delay", "ms": 1}],
        "stop": {"window_s": 30, "min_requests": 4, "max_error_rate": 0.25, "max_p99_ms": None,
                 **stop}})
    return reg, reg.start(cfg, "m", "config")


def observe(reg: ExperimentRegistry, ok: bool, latency_s: float = 0.01) -> None:
    call = Call("m", "", [])
    from filters.fault import SEEN
    call.state[SEEN] = ["e"]
    reply = Result("m") if ok else LocalReply(ErrorKind.UNAVAILABLE, "x")
    reg.observe(call, reply, latency_s)


def test_needs_min_requests_then_stops_on_the_breaching_answer() -> None:
    clock = ManualClock()
    reg, exp = make(clock)
    for _ in range(3):
        observe(reg, False)  # 3 errors: below min_requests, no judgement yet
    assert exp.running
    observe(reg, True)  # 3 of 4: the rate's lower bound is not above 0.25 yet
    assert exp.running
    for _ in range(20):  # errors keep coming: now it is evidence
        observe(reg, False)
        if not exp.running:
            break
    assert exp.state == "stopped"
    n = len(exp.window)
    assert exp.stop_reason.startswith(f"error rate {(n - 1) / n:.3f} > 0.25 over the last 30 s "
                                      f"({n - 1} of {n} canary calls; bounds ")
    assert exp.stop_reason.endswith("false-stop rate 0.01)") and n < 15


def test_old_answers_leave_the_window() -> None:
    clock = ManualClock()
    reg, exp = make(clock)
    observe(reg, False)
    observe(reg, False)
    clock.now += 31  # both errors are now outside the 30 s window
    for _ in range(4):
        observe(reg, True)
    assert exp.running and len(exp.window) == 4
    observe(reg, False)  # 1 of 5 = 0.2: within 0.25
    assert exp.running


def test_p99_and_duration() -> None:
    clock = ManualClock()
    reg, exp = make(clock, max_error_rate=None, max_p99_ms=100)
    for _ in range(3):
        observe(reg, True, 0.5)
    assert exp.running
    observe(reg, True, 0.5)  # 4 of 4 at 500 ms: the p99's lower bound is past 100 ms
    assert exp.stop_reason.startswith("p99 latency ≥ 49")
    assert "ms > 100 ms over the last 30 s (4 canary calls; distribution-free" in exp.stop_reason
    clock2 = ManualClock()
    reg2 = ExperimentRegistry(clock2, Telemetry())
    exp2 = reg2.start(ExperimentConfig.model_validate(
        {"name": "d", "duration_s": 60, "actions": [{"kind": "delay", "ms": 1}]}), "m", "api")
    clock2.now += 59.9
    assert exp2.check() == ""
    clock2.now += 0.1
    reason = exp2.check()
    reg2.auto_stop(exp2, reason)
    assert exp2.state == "finished" and exp2.stop_reason == "duration 60 s is over"


def test_divergence_from_the_shadow_stops_it() -> None:
    clock = ManualClock()
    reg, exp = make(clock, max_error_rate=None, max_divergence=0.5)
    for agree in (True, False, False, True):
        reg.observe_divergence("m", agree)
    assert exp.running  # 2 of 4 = 0.5: not above
    reg.observe_divergence("m", False)
    assert exp.running  # 3 of 5: above, but no evidence it is
    for _ in range(30):
        reg.observe_divergence("m", False)
        if not exp.running:
            break
    assert exp.stop_reason.startswith("divergence from production 0.")
    assert "> 0.5 over the last 30 s" in exp.stop_reason and "bounds" in exp.stop_reason
    reg.observe_divergence("other-route", False)  # another route's comparisons: not this one


@pytest.mark.parametrize("bad, where", [
    ({"kind": "delay"}, "exactly one of"),
    ({"kind": "delay", "min_ms": 5, "max_ms": 1}, "min_ms <= max_ms"),
    ({"kind": "abort", "grpc_code": "NOPE"}, "not a gRPC status code"),
    ({"kind": "gaussian_noise", "sigma": -1}, "greater than or equal to 0"),
    ({"kind": "warp"}, "does not match any of the expected tags"),
])
def test_bad_actions_are_refused_with_a_reason(bad: dict[str, Any], where: str) -> None:
    from pydantic import ValidationError
    with pytest.raises(ValidationError) as exc:
        ExperimentConfig.model_validate({"name": "x", "actions": [bad]})
    assert where in str(exc.value)


def test_the_totals_alerts_read_exist_at_zero_and_count_a_blink() -> None:
    """An experiment that starts and stops between two scrapes: the totals the alert reads
    had their children at 0 before it started, so increase() sees the stop."""
    telemetry = Telemetry()
    reg = ExperimentRegistry(ManualClock(), telemetry)
    value = telemetry.registry.get_sample_value
    assert value("mmguard_fault_experiments_started_total") == 0
    assert value("mmguard_fault_experiments_stopped_total", {"cause": "slo"}) == 0
    cfg = ExperimentConfig.model_validate({"name": "blink",
                                           "actions": [{"kind": "delay", "ms": 1}]})
    reg.start(cfg, "m", "config")
    reg.stop("blink", "SLO out", "slo")
    assert value("mmguard_fault_experiments_started_total") == 1
    assert value("mmguard_fault_experiments_stopped_total", {"cause": "slo"}) == 1
    assert value("mmguard_fault_experiments_stopped_total", {"cause": "operator"}) == 0
