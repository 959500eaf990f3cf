"""The chaos golden rules on fault experiments: a baseline before any injection, the success
SLO (injected refusals are the experiment, not the system failing), the first assertion within
15 s of the first injection, and every stop naming its SLO with the figures."""

from __future__ import annotations

import random
from typing import Any

from filters.fault import SEEN, ExperimentConfig, ExperimentRegistry, Fault, FaultConfig, rules
from proxy.call import CANARY, Call, LocalReply, Reply, Result
from proxy.chain import FilterContext
from proxy.clock import ManualClock
from proxy.errors import ErrorKind
from proxy.telemetry import Telemetry


def make(clock: ManualClock, **stop: Any) -> tuple[ExperimentRegistry, Any]:
    reg = ExperimentRegistry(clock, Telemetry())
    cfg = ExperimentConfig.model_validate({
        "name": "e", "actions": [{"kind": "delay", "ms": 1}],
        "stop": {"window_s": 30, "min_requests": 4, "max_error_rate": None, "max_p99_ms": None,
                 **stop}})
    return reg, reg.start(cfg, "m", "config")


def observe(reg: ExperimentRegistry, reply: Reply) -> None:
    call = Call("m", "", [])
    call.state[SEEN] = ["e"]
    reg.observe(call, reply, 0.01)


def test_injected_refusals_do_not_count_against_the_success_slo() -> None:
    clock = ManualClock()
    reg, exp = make(clock, min_success=0.995)
    for _ in range(20):
        observe(reg, LocalReply(ErrorKind.UNAVAILABLE, "injected", injected="e/abort"))
        observe(reg, Result("m"))
    assert exp.running
    observe(reg, LocalReply(ErrorKind.INTERNAL, "the backend broke"))
    assert exp.running  # one failure in 21 own calls is no evidence against 99.5 %
    for _ in range(10):
        observe(reg, LocalReply(ErrorKind.INTERNAL, "the backend broke"))
        if not exp.running:
            break
    assert exp.state == "stopped"
    assert exp.stop_reason.startswith("success ")
    assert "< 99.5% over the last 30 s" in exp.stop_reason
    assert "injected refusals not counted; bounds " in exp.stop_reason
    assert "false-stop rate 0.01" in exp.stop_reason
    assert exp.snapshot()["stop_slo"] == "success"


def test_the_first_assertion_runs_within_15_s_of_the_first_injection() -> None:
    clock = ManualClock()
    reg, exp = make(clock, min_requests=50, max_p99_ms=2000)
    rules.injected(exp, clock.monotonic())
    call = Call("m", "", [])
    call.state[SEEN] = ["e"]
    reg.observe(call, Result("m"), 3.0)  # 3 s: p99 out, but 1 of 50 answers
    assert exp.running
    clock.advance(15)
    reg.observe(call, Result("m"), 3.0)
    assert exp.state == "stopped"
    # two of two calls at 3 s: the p99's distribution-free lower bound is past 2 s
    assert exp.stop_reason.startswith("p99 latency ≥ 29")
    assert ("ms > 2000 ms over the last 30 s (2 canary calls; distribution-free lower bound, "
            "false-stop rate 0.01; first assertion 15 s after") in exp.stop_reason
    snap = exp.snapshot()
    assert snap["stop_slo"] == "p99" and snap["first_assertion_after_injection_s"] == 15.0


def test_one_stall_among_fast_calls_never_stops_on_p99() -> None:
    clock = ManualClock()
    reg, exp = make(clock, min_requests=5, max_p99_ms=2000)
    call = Call("m", "", [])
    call.state[SEEN] = ["e"]
    for latency in (0.05, 0.05, 3.0, 0.05, 0.05, 0.05):  # the old rule: p99 of 5 = the stall
        reg.observe(call, Result("m"), latency)
    assert exp.running
    for _ in range(20):  # the canary really is slow: most calls past 2 s
        reg.observe(call, Result("m"), 2.5)
    assert exp.state == "stopped" and exp.stop_reason.startswith("p99 latency ≥ ")


def test_alpha_is_shared_by_every_configured_stop_condition() -> None:
    # four conditions at 0.01 each would stop an experiment whose SLO holds up to 4 % of the
    # time; the stop's alpha is the chance of a false stop on any of them
    clock = ManualClock()
    reg, exp = make(clock, max_error_rate=0.5, max_p99_ms=2000, min_success=0.4,
                    max_divergence=0.5)
    assert rules.level(exp.cfg.stop) == 0.0025
    assert rules.rate_above(13, 13, 0.5, 0.01)  # enough at 0.01 ...
    for _ in range(13):
        observe(reg, LocalReply(ErrorKind.UNAVAILABLE, "injected", injected="e/abort"))
    assert exp.running  # ... not at its share
    for _ in range(5):
        observe(reg, LocalReply(ErrorKind.UNAVAILABLE, "injected", injected="e/abort"))
        if not exp.running:
            break
    assert exp.stop_reason.startswith("error rate 1.000 > 0.5")
    assert exp.stop_reason.endswith("false-stop rate 0.0025)")
    _, alone = make(ManualClock(), max_error_rate=0.5)
    assert rules.level(alone.cfg.stop) == 0.01


async def test_a_baseline_comes_before_any_injection() -> None:
    clock = ManualClock()
    ctx = FilterContext(route="m", telemetry=Telemetry(), clock=clock, rng=random.Random(0),
                        contract=lambda: None)
    cfg = FaultConfig.model_validate({"experiments": [{
        "name": "e", "actions": [{"kind": "delay", "ms": 5}],
        "stop": {"baseline_calls": 5, "max_error_rate": None, "max_p99_ms": None}}]})
    fault = Fault(cfg, ctx)

    async def backend(call: Call) -> Reply:
        return Result(call.model)

    marks = []
    for i in range(8):
        call = Call("m", "", [], id=f"r{i}")
        call.state[CANARY] = True
        await fault(call, backend)
        marks.append(call.decisions.get("mmguard-fault", ""))
    assert marks[:5] == [""] * 5
    assert all(m.startswith("e/delay") for m in marks[5:])
    snap = fault.registry.experiments["e"].snapshot()
    assert snap["baseline"] == {"calls": 5, "of": 5, "done": True}
    assert snap["injected"] == {"delay": 3}
