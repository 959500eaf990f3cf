"""Canary eligibility (``canary.eligible``): only calls whose published scores meet every
condition enter the canary share; a call without the score never does; operator-selected calls
(trusted headers) are not filtered; each call is judged once and counted."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.call import CANARY, CANARY_ELIGIBLE, CANARY_POPULATION, Call, publish_scores
from proxy.config.model import ConfigError, parse_config
from proxy.engine.canary import CanaryMatcher
from proxy.share import ShareHash
from proxy.telemetry import Telemetry

BASE = {"backends": [{"kind": "triton_grpc", "name": "t", "url": "127.0.0.1:8001"}],
        "models": [{"name": "m", "backend": "t"}]}


def matcher(canary: dict[str, Any], trust: bool = False) -> tuple[CanaryMatcher, Telemetry]:
    cfg = parse_config({**BASE, "canary": canary,
                        "listeners": {"grpc": {"trust_canary_headers": trust}}})
    telemetry = Telemetry()
    return CanaryMatcher(cfg, ShareHash(b"secret"), telemetry), telemetry


def call(i: int, headers: dict[str, str] | None = None) -> Call:
    c = Call("m", "", [], headers={"x-request-id": f"r{i}", **(headers or {})})
    c.front = "grpc"
    return c


ALIGNED = {"share": 1.0, "eligible": [{"score": "quality.alignment", "at_least": 0.85}]}


def test_only_calls_that_meet_the_condition_become_canary() -> None:
    m, telemetry = matcher(ALIGNED)
    marks = []
    for i, alignment in enumerate((0.9, 0.5, 0.85, 0.849)):
        c = call(i)
        assert m.mark(c) is False  # nothing is canary before its scores are known
        assert c.state[CANARY_ELIGIBLE] is False
        assert c.state[CANARY_POPULATION] == "quality.alignment >= 0.85"
        publish_scores(c, {"quality.alignment": alignment, "quality.trust": 0.3})
        marks.append((c.state[CANARY], c.state[CANARY_ELIGIBLE]))
    assert marks == [(True, True), (False, False), (True, True), (False, False)]
    get = telemetry.registry.get_sample_value
    assert get("mmguard_canary_eligibility_calls_total", {"model": "m"}) == 4
    assert get("mmguard_canary_eligibility_judged_total", {"model": "m", "eligible": "true"}) == 2


def test_eligible_calls_outside_the_share_stay_out() -> None:
    m, _ = matcher({**ALIGNED, "share": 0.3})
    canary = 0
    for i in range(400):
        c = call(i)
        m.mark(c)
        publish_scores(c, {"quality.alignment": 0.95})
        assert c.state[CANARY_ELIGIBLE] is True
        canary += c.state[CANARY]
    assert 80 < canary < 160  # the share of the eligible, chosen by the keyed hash


def test_a_call_without_the_score_is_never_canary_and_is_judged_once() -> None:
    m, telemetry = matcher({"share": 1.0, "eligible": [
        {"score": "quality.alignment", "at_least": 0.85},
        {"score": "quality.sharpness", "at_least": 0.5}]})
    c = call(1)
    m.mark(c)
    publish_scores(c, {"quality.sharpness": 1.0})  # alignment still missing: not judged yet
    assert c.state[CANARY] is False and c.state[CANARY_ELIGIBLE] is False
    publish_scores(c, {"quality.alignment": 0.9})
    assert c.state[CANARY] is True
    publish_scores(c, {"quality.alignment": 0.1})  # judged once: a later score changes nothing
    assert c.state[CANARY] is True
    assert telemetry.registry.get_sample_value(
        "mmguard_canary_eligibility_judged_total", {"model": "m", "eligible": "true"}) == 1


def test_below_bounds_and_trusted_headers() -> None:
    m, _ = matcher({"share": 1.0, "headers": {"x-canary": "1"},
                    "eligible": [{"score": "quality.trust", "below": 0.5}]}, trust=True)
    low, high, chosen = call(1), call(2), call(3, {"x-canary": "1"})
    for c in (low, high, chosen):
        m.mark(c)
    publish_scores(low, {"quality.trust": 0.2})
    publish_scores(high, {"quality.trust": 0.9})
    publish_scores(chosen, {"quality.trust": 0.9})
    assert low.state[CANARY] and not high.state[CANARY]
    assert chosen.state[CANARY]  # the operator's header: not filtered by eligibility


def test_without_eligibility_nothing_changes() -> None:
    m, telemetry = matcher({"share": 1.0})
    c = call(1)
    assert m.mark(c) is True and CANARY_ELIGIBLE not in c.state
    publish_scores(c, {"quality.alignment": 0.0})
    assert c.state[CANARY] is True
    assert telemetry.registry.get_sample_value("mmguard_canary_eligibility_calls_total",
                                               {"model": "m"}) is None


def test_eligibility_config_is_validated() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config({**BASE, "canary": {"share": 0.1, "eligible": [
            {"score": "quality.alignment"}]}})
    assert "exactly one of at_least and below" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        parse_config({**BASE, "canary": {"eligible": [{"score": "alignment", "at_least": 0.8}]}})
    assert "canary.eligible[0].score" in str(exc.value)
