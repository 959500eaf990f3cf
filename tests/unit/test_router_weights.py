"""The router's weight maths on an injected clock and a seeded RNG."""

from __future__ import annotations

import random

import numpy as np

from filters.modality_router import ModalityRouter, RouterConfig
from proxy.call import Call, LocalReply, Reply, Target
from proxy.chain import FilterContext
from proxy.clock import ManualClock
from proxy.errors import ErrorKind
from proxy.telemetry import Telemetry
from proxy.tensor import Tensor


def router(**kw: object) -> tuple[ModalityRouter, ManualClock]:
    clock = ManualClock()
    cfg = RouterConfig.model_validate({"paths": [{"route": "a"}, {"route": "b"}], **kw})
    ctx = FilterContext("m", Telemetry(), clock, random.Random(3), lambda: None)
    return ModalityRouter(cfg, ctx), clock


def test_the_faster_path_gets_the_weight() -> None:
    r, _ = router()
    for _ in range(10):
        r.record("a", 0.010, False, None)
        r.record("b", 0.030, False, None)
    w = r.compute()
    assert w["a"] > 0.9 and w["b"] < 0.1 and abs(sum(w.values()) - 1) < 1e-9


def test_exploration_floor_keeps_a_slow_path_alive() -> None:
    r, _ = router(exploration=0.05)
    for _ in range(10):
        r.record("a", 0.001, False, None)
        r.record("b", 10.0, False, None)
    assert r.compute()["b"] >= 0.05


def test_low_confidence_and_errors_cost_weight() -> None:
    r, _ = router(alpha=0.5)
    for _ in range(10):
        r.record("a", 0.01, False, 0.9)
        r.record("b", 0.01, False, 0.2)
    assert r.compute()["a"] > r.compute()["b"]
    r2, _ = router()
    for i in range(10):
        r2.record("a", 0.01, i % 2 == 0, None)  # half of a's calls fail
        r2.record("b", 0.01, False, None)
    assert r2.compute()["b"] > 0.9


def test_weights_hold_for_the_dwell_time() -> None:
    r, clock = router(dwell_s=5)
    r._maybe_update()
    first = dict(r.weights)
    for _ in range(10):
        r.record("a", 0.001, False, None)
        r.record("b", 1.0, False, None)
    clock.advance(4)
    r._maybe_update()
    assert r.weights == first  # no flap inside the dwell
    clock.advance(1.5)
    r._maybe_update()
    assert r.weights["a"] > 0.9


def test_weighted_choice_follows_the_weights_with_a_seeded_rng() -> None:
    r, _ = router()
    r.weights = {"a": 0.8, "b": 0.2}
    picks = [r._choose(list(r.cfg.paths)).route for _ in range(2000)]
    share = picks.count("a") / len(picks)
    assert 0.76 < share < 0.84
    again, _ = router()
    again.weights = {"a": 0.8, "b": 0.2}
    assert [again._choose(list(again.cfg.paths)).route for _ in range(2000)] == picks


async def test_a_path_fails_on_what_its_backend_did_not_on_what_the_client_did() -> None:
    """A path's error rate counts its backend's failures, an answer outside its contract
    (bad gateway) and a call its backend dropped (its own CANCELLED) among them; a refusal of
    the client's input or a cancellation mmguard made are not the path's doing."""
    replies = [LocalReply(ErrorKind.BAD_GATEWAY, "garbled", origin="backend"),
               LocalReply(ErrorKind.CANCELLED, "Locally cancelled", origin="backend"),
               LocalReply(ErrorKind.UNAVAILABLE, "down", origin="backend"),
               LocalReply(ErrorKind.INVALID_ARGUMENT, "bad input", origin="backend"),
               LocalReply(ErrorKind.CANCELLED, "the call was cancelled")]
    async def reroute(route: str, call: Call) -> Reply:
        return replies[len(r.stats["a"].samples)]

    cfg = RouterConfig.model_validate({"paths": [{"route": "a", "modalities": ["text"]}],
                                       "inputs": {"ids": "text"}})
    r = ModalityRouter(cfg, FilterContext("m", Telemetry(), ManualClock(), random.Random(3),
                                          lambda: None, reroute=reroute))
    for _ in replies:
        call = Call(model="m", version="", target=Target("b", "m"),
                    inputs=[Tensor.from_numpy("ids", np.zeros((1, 4), np.int64))])
        await r(call, reroute_unused)
    assert [failed for _, failed in r.stats["a"].samples] == [True, True, True, False, False]


async def reroute_unused(call: Call) -> Reply:
    raise AssertionError("the router reroutes; it never calls next")
