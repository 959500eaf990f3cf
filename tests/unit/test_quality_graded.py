"""Confidence-graded actions on the trust score (filters/quality/graded.py): below 0.3 refused
with the fallback answer, 0.3-0.7 a seeded share shed to a cheaper route or the cached answer,
at or above 0.7 observed; every band a visible decision."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from filters.fallback.filter import Fallback, FallbackConfig
from filters.quality.filter import Quality, QualityConfig
from filters.quality.graded import GradedConfig, band
from proxy.call import Call, LocalReply, Reply, Result, Target
from proxy.chain import FilterContext
from proxy.clock import ManualClock
from proxy.errors import ErrorKind
from proxy.keys import Store
from proxy.telemetry import Telemetry
from proxy.tensor import Tensor
from tests.support.photos import clean_set

CLEAN = next(c.image for c in clean_set() if c.name == "astronaut")


def lit(exposure: float) -> Call:
    img = np.asarray(np.clip(CLEAN * exposure, 0, 255), np.uint8)
    chw = np.ascontiguousarray((img.transpose(2, 0, 1) / 255.0)[None], np.float32)
    return Call("m", "", [Tensor.from_numpy("pixel_values", chw)], target=Target("b", "m"))


class Backend:
    def __init__(self) -> None:
        self.calls = 0
        self.rerouted: list[str] = []

    async def answer(self, call: Call) -> Reply:
        self.calls += 1
        return Result("m", outputs=[Tensor.from_numpy("OUT", np.array([float(self.calls)],
                                                                      np.float32))])

    async def reroute(self, route: str, call: Call) -> Reply:
        self.rerouted.append(route)
        return Result("m", outputs=[Tensor.from_numpy("OUT", np.array([-1.0], np.float32))])


def build(graded: dict[str, Any], backend: Backend,
          local: Store | None = None, seed: int = 0) -> tuple[Quality, Telemetry]:
    telemetry = Telemetry()
    ctx = FilterContext("m", telemetry, ManualClock(), random.Random(seed), lambda: None,
                        reroute=backend.reroute, local=local if local is not None else Store())
    cfg = QualityConfig.model_validate({"images": {"pixel_values": {}}, "drift": None,
                                        "rules": [], "graded": graded})
    return Quality(cfg, ctx), telemetry


def trust_of(call: Call) -> float:
    scores = call.decisions["mmguard-quality-scores"]
    return float(scores.split("trust=")[1].split()[0])


def test_bands_at_their_edges() -> None:
    cfg = GradedConfig()
    assert [band(cfg, t) for t in (0.0, 0.299, 0.3, 0.699, 0.7, 1.0)] == [
        "refuse", "refuse", "shed", "shed", "observe", "observe"]
    with pytest.raises(ValidationError, match="refuse_below"):
        GradedConfig(refuse_below=0.8, shed_below=0.5)


async def test_a_clean_photo_is_observed_and_served() -> None:
    backend = Backend()
    quality, telemetry = build({}, backend)
    call = lit(1.0)
    reply = await quality(call, backend.answer)
    assert isinstance(reply, Result) and backend.calls == 1 and trust_of(call) >= 0.7
    assert call.decisions["mmguard-quality-graded"].startswith("observe; trust score 1.000")
    assert telemetry.decisions.labels("quality", "m", "graded:observe")._value.get() == 1


async def test_a_very_dark_photo_is_refused_naming_the_trust_score() -> None:
    backend = Backend()
    quality, _ = build({}, backend)
    call = lit(0.05)
    reply = await quality(call, backend.answer)
    assert isinstance(reply, LocalReply) and reply.kind is ErrorKind.UNPROCESSABLE
    assert backend.calls == 0 and trust_of(call) < 0.3
    assert reply.message.startswith("quality: trust score 0.000 (visual=0.000); below 0.3")
    assert call.decisions["mmguard-quality-graded"].startswith("refuse; trust score 0.000")


async def test_a_refusal_serves_the_fallback_filters_cached_answer() -> None:
    backend = Backend()
    local = Store()  # one runtime's: the fallback fills it, quality reads it
    ctx = FilterContext("m", Telemetry(), ManualClock(), random.Random(0), lambda: None,
                        local=local)
    fallback = Fallback(FallbackConfig(), ctx)
    dark = lit(0.05)
    first = await fallback(dark, backend.answer)  # a good answer to this very request, cached
    assert isinstance(first, Result) and backend.calls == 1
    quality, _ = build({}, backend, local)
    again = lit(0.05)
    reply = await quality(again, backend.answer)
    assert isinstance(reply, Result) and backend.calls == 1  # the backend was not asked
    assert reply.outputs[0].numpy().tolist() == [1.0]
    assert again.decisions["mmguard-stale"] == "true"
    assert "served the cached answer, 0.0s old" in again.decisions["mmguard-quality-graded"]


async def test_a_refusal_on_a_v2_route_can_serve_a_static_answer() -> None:
    backend = Backend()
    quality, _ = build({"static_answer": [{"name": "OUT", "datatype": "FP32", "shape": [1],
                                           "data": [0.0]}]}, backend)
    reply = await quality(lit(0.05), backend.answer)
    assert isinstance(reply, Result) and reply.outputs[0].numpy().tolist() == [0.0]


async def test_the_middle_band_sheds_the_configured_share_to_the_cheaper_route() -> None:
    backend = Backend()
    quality, telemetry = build({"shed_share": 0.25, "shed_to": "m-small"}, backend, seed=7)
    outcomes = []
    for _ in range(200):
        call = lit(0.4)
        await quality(call, backend.answer)
        assert 0.3 <= trust_of(call) < 0.7
        outcomes.append(call.decisions["mmguard-quality-graded"].split(";")[0])
    shed = outcomes.count("shed")
    assert shed + outcomes.count("kept") == 200 and 30 <= shed <= 70  # 25 % of 200, seeded
    assert backend.rerouted == ["m-small"] * shed and backend.calls == 200 - shed
    assert telemetry.decisions.labels("quality", "m", "graded:shed")._value.get() == shed


async def test_shedding_with_nowhere_to_go_serves_as_usual_and_says_so() -> None:
    backend = Backend()
    quality, _ = build({"shed_share": 1.0}, backend)
    call = lit(0.4)
    reply = await quality(call, backend.answer)
    assert isinstance(reply, Result) and backend.calls == 1
    assert call.decisions["mmguard-quality-graded"].startswith("shed-unavailable; ")
    assert "no cheaper route and nothing cached" in call.decisions["mmguard-quality-graded"]


async def test_graded_actions_are_off_unless_configured() -> None:
    backend = Backend()
    telemetry = Telemetry()
    ctx = FilterContext("m", telemetry, ManualClock(), random.Random(0), lambda: None)
    quality = Quality(QualityConfig.model_validate({"images": {"pixel_values": {}},
                                                    "drift": None}), ctx)
    call = lit(0.05)
    assert isinstance(await quality(call, backend.answer), Result)  # annotated, served
    assert "mmguard-quality-graded" not in call.decisions
    assert call.decisions["mmguard-quality-exposure"].startswith("annotate; ")
