"""``shadow`` in a real runtime: the client gets production's answer, the canary's is compared
off the request path, and the verdict's counts are what the admin route shows."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from filters.shadow import ShadowFactory
from filters.shadow.copies import Copy, Sent, paired_latency
from filters.shadow.filter import SHADOWS
from proxy.call import Call, LocalReply, Result, Target
from proxy.clock import ManualClock
from proxy.errors import ErrorKind, ProxyError
from proxy.keys import Store
from proxy.lifecycle import AdminRequest
from proxy.tensor import Tensor
from tests.support.chain_harness import ChainHarness, echo, x

SHADOWED = {"models": [{"name": "prod", "filters": [{"shadow": {"canary": "cand",
                                                                "percent": 100}}]},
                       {"name": "cand"}]}


def drifting(call: Call, target: Target) -> Result:
    """Production echoes; the canary answers the negation (it disagrees on every call)."""
    arr = call.inputs[0].numpy()
    out = arr if target.model == "prod" else -arr
    return Result(target.model, outputs=[Tensor.from_numpy("x", np.ascontiguousarray(out))])


async def compared(h: ChainHarness, n: int) -> None:
    shadow = (h.runtime.local.get(SHADOWS) or {})["prod"]
    for _ in range(1000):
        if shadow.state.compared >= n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{shadow.state.compared} of {n} copies compared")


async def list_shadows(h: ChainHarness) -> dict[str, dict[str, object]]:
    async def no_body() -> object:
        raise ValueError
    route = next(r for r in ShadowFactory().admin_routes if r.path == "/admin/shadows")
    status, body = await route.handler(AdminRequest({}, h.runtime.state, h.runtime.local,
                                                    no_body))
    assert status == 200
    return dict(body)


async def test_the_client_gets_production_and_a_disagreeing_canary_is_counted() -> None:
    async with ChainHarness.open(SHADOWED, answer=drifting) as h:
        replies = [await h.infer("prod", [x(value=float(i + 1))]) for i in range(3)]
        await compared(h, 3)
        snapshot = (await list_shadows(h))["prod"]
    for i, reply in enumerate(replies):
        assert isinstance(reply, Result)
        assert float(reply.outputs[0].numpy()[0, 0]) == float(i + 1)  # production's, unchanged
    assert snapshot["canary"] == "cand" and snapshot["compared"] == 3
    assert snapshot["mirrored"] == 3
    asked = sorted(c.target.model for c in h.backend.calls if c.target)
    assert asked == ["cand"] * 3 + ["prod"] * 3


async def test_an_agreeing_canary_is_counted_as_agreeing() -> None:
    async with ChainHarness.open(SHADOWED) as h:  # echo: both answer alike
        for i in range(2):
            await h.infer("prod", [x(value=float(i))])  # two requests (a replay is one)
        await compared(h, 2)
        shadow = (h.runtime.local.get(SHADOWS) or {})["prod"]
    assert shadow.state.verdict.snapshot()["agreement"] == 1.0


async def test_after_drain_the_live_shadows_workers_end() -> None:
    async with ChainHarness.open(SHADOWED) as h:
        await h.infer("prod")
        await compared(h, 1)
        shadow = (h.runtime.local.get(SHADOWS) or {})["prod"]
        assert shadow.workers
        await ShadowFactory().after_drain(h.runtime.state)
        assert shadow.workers == []
        await ShadowFactory().after_drain(Store())  # a process without shadows: nothing to do


LANES = {"models": [
    {"name": "prod", "filters": [{"shadow": {"canary": "cand", "percent": 100, "workers": 1}}]},
    {"name": "cand", "filters": [{"fault": {"experiments": [{
        "name": "slow", "actions": [{"kind": "delay", "ms": 60000, "percent": 50}],
        "stop": {"max_error_rate": None, "max_p99_ms": None}}]}}]}]}


def hold_delays(h: ChainHarness, gate: asyncio.Event) -> None:
    """Every injected delay lasts until the test sets ``gate``."""
    async def held(seconds: float) -> None:
        await gate.wait()
    h.clock.sleep = held  # type: ignore[method-assign]


async def test_a_delayed_copy_never_holds_the_lane_of_clean_ones() -> None:
    # one worker; half the copies are delayed, and their delay lasts until the test ends it:
    # every clean copy is still compared, none queued behind a delayed one
    gate = asyncio.Event()
    async with ChainHarness.open(LANES) as h:
        hold_delays(h, gate)
        for i in range(12):
            await h.infer("prod", [x(value=float(i + 1))])
        shadow = (h.runtime.local.get(SHADOWS) or {})["prod"]
        for _ in range(1000):
            if shadow.state.compared + len(shadow.waiting) >= 12:
                break
            await asyncio.sleep(0)
        snap = shadow.snapshot()
        gate.set()  # the delays end: those copies are compared too, and left out of the verdict
        await compared(h, 12)
        after = shadow.snapshot()
    assert 0 < snap["waiting"] < 12  # the delayed copies wait off the lane ...
    assert snap["compared"] == 12 - snap["waiting"]  # ... and every clean one was compared
    assert snap["queued"] == 0 and snap["samples"] == snap["compared"]
    assert after["excluded"] == snap["waiting"] and after["samples"] == snap["samples"]


class TimedBackend:
    """Answers after advancing the harness's clock: production's model takes 10 ms, the
    canary's 13 ms (30 % slower), measured by the terminal on the injected clock."""

    def __init__(self) -> None:
        self.clock: ManualClock | None = None

    def __call__(self, call: Call, target: Target) -> Result:
        assert self.clock is not None
        self.clock.advance(0.013 if target.model == "cand" else 0.010)
        return echo(call, target)


async def test_pairs_are_judged_on_the_backends_time_not_the_copys_path() -> None:
    timed = TimedBackend()
    async with ChainHarness.open(SHADOWED, answer=timed) as h:
        timed.clock = h.clock
        for i in range(4):
            await h.infer("prod", [x(value=float(i + 1))])
        await compared(h, 4)
        shadow = (h.runtime.local.get(SHADOWS) or {})["prod"]
        pairs = [(s.primary_s, s.canary_s)
                 for s in shadow.state.verdict._samples]
    assert len(pairs) == 4
    for primary, canary in pairs:  # exactly the models' times: the path around them is not
        assert primary == pytest.approx(0.010) and canary == pytest.approx(0.013)


def test_a_pair_without_backend_time_on_either_side_falls_back_to_both_whole_paths() -> None:
    call = Call(model="prod", version="", inputs=[x()])
    item = Copy(call, Result("prod"), 0.020, None, False, None,  # type: ignore[arg-type]
                primary_backend_s=0.010)
    assert paired_latency(item, Sent(Result("cand"), 0.030, None, [], 0.012)) == (0.010, 0.012)
    assert paired_latency(item, Sent(Result("cand"), 0.030, "a", [], None)) == (0.020, 0.030)
    item.primary_backend_s = None
    assert paired_latency(item, Sent(Result("cand"), 0.030, None, [], 0.012)) == (0.020, 0.030)


async def test_the_gauges_are_rebuilt_at_most_every_interval_and_land_on_the_last_pair() -> None:
    """The verdict's snapshot runs in the loop that times the backends' answers: not after
    every pair (docs/canary.md, "Where the pair's noise comes from"), yet the last one shows."""
    from filters.shadow.filter import GAUGES_EVERY_S
    async with ChainHarness.open(SHADOWED) as h:
        await h.infer("prod", [x(value=-1.0)])
        await compared(h, 1)
        shadow = (h.runtime.local.get(SHADOWS) or {})["prod"]
        built = []
        snapshot = shadow.state.verdict.snapshot

        def counted() -> dict[str, object]:
            built.append(1)
            return snapshot()

        shadow.state.verdict.snapshot = counted  # type: ignore[method-assign]
        started = asyncio.get_running_loop().time()
        for i in range(30):
            await h.infer("prod", [x(value=float(i))])
        await compared(h, 31)
        rebuilt_in_burst = len(built)
        intervals = (asyncio.get_running_loop().time() - started) / GAUGES_EVERY_S
        await asyncio.sleep(GAUGES_EVERY_S * 2)  # the trailing rebuild
        samples = shadow.m_evidence.labels("prod", "cand", "agreement", "samples")._value.get()
    assert rebuilt_in_burst <= intervals + 2, (rebuilt_in_burst, intervals)
    assert samples == 31


BACKLOG = {"models": [
    {"name": "prod", "filters": [{"shadow": {"canary": "cand", "percent": 100, "workers": 1,
                                             "queue_size": 2}}]},
    {"name": "cand", "filters": [{"fault": {"experiments": [{
        "name": "slow", "actions": [{"kind": "delay", "ms": 60000, "percent": 50}],
        "stop": {"max_error_rate": None, "max_p99_ms": None}}]}}]}]}


async def test_delayed_copies_past_the_queue_size_are_dropped_not_waited_for() -> None:
    """At most ``queue_size`` faulted copies wait off the lane; more are dropped (counted as
    ``fault-backlog``: never judged, so nothing is lost) and every clean copy is compared."""
    gate = asyncio.Event()
    async with ChainHarness.open(BACKLOG) as h:
        hold_delays(h, gate)
        for i in range(16):
            await h.infer("prod", [x(value=float(i + 1))])
            for _ in range(20):  # the lane takes each copy before the next call
                await asyncio.sleep(0)
        shadow = (h.runtime.local.get(SHADOWS) or {})["prod"]
        dropped = shadow.m_dropped.labels("prod", "cand", "fault-backlog")
        for _ in range(1000):
            if shadow.state.compared + len(shadow.waiting) + dropped._value.get() >= 16:
                break
            await asyncio.sleep(0)
        snap = shadow.snapshot()
        backlog = int(dropped._value.get())
        gate.set()
        await compared(h, snap["compared"] + snap["waiting"])
    assert snap["waiting"] == 2 and backlog >= 1  # 16 calls, half delayed: more than 2
    assert snap["compared"] + snap["waiting"] + backlog == 16
    assert snap["queued"] == 0 and snap["samples"] == snap["compared"]


NOISY = {"models": [
    {"name": "prod", "filters": [
        {"shadow": {"canary": "cand", "percent": 100, "noise_floor_percent": 100}},
        {"fault": {"experiments": [{
            "name": "chaos", "actions": [{"kind": "abort", "http_status": 503,
                                          "grpc_code": "UNAVAILABLE", "percent": 50}],
            "stop": {"max_error_rate": None, "max_p99_ms": None}}]}}]},
    {"name": "cand"}]}


async def test_a_noise_floor_copy_a_fault_touched_is_not_the_floor() -> None:
    """A fault on production's route aborts some of the floor's copies (they go through the
    rest of production's chain as canary traffic): those are counted, never judged, so the
    floor stays production's own agreement (1 here: both models answer alike)."""
    async with ChainHarness.open(NOISY) as h:
        for i in range(12):
            await h.infer("prod", [x(value=float(i + 1))])
        await compared(h, 12)
        shadow = (h.runtime.local.get(SHADOWS) or {})["prod"]
        for _ in range(1000):
            snap = shadow.snapshot()
            if snap["noise_samples"] + snap["excluded"] >= 12:
                break
            await asyncio.sleep(0)
    assert snap["excluded"] >= 1 and snap["noise_samples"] >= 1, snap
    assert snap["noise_samples"] + snap["excluded"] == 12
    assert snap["self_agreement"] == 1.0 and snap["agreement"] == 1.0


def shedding(call: Call, target: Target) -> Result:
    """The canary's route sheds every call, as mmguard's ``limits`` does under load."""
    if target.model == "cand":
        raise ProxyError(ErrorKind.OVERLOADED, "too many calls in flight on 'cand'")
    return echo(call, target)


async def test_a_copy_shed_on_the_canarys_route_is_counted_not_judged() -> None:
    """A client that loads the canary's route must not turn its load into disagreements."""
    async with ChainHarness.open(SHADOWED, answer=shedding) as h:
        for i in range(4):
            await h.infer("prod", [x(value=float(i + 1))])
        shadow = (h.runtime.local.get(SHADOWS) or {})["prod"]
        for _ in range(1000):
            if shadow.state.unjudged.get("canary-overload", 0) >= 4:
                break
            await asyncio.sleep(0)
        snap = shadow.snapshot()
    assert snap["unjudged"]["canary-overload"] == 4 and snap["samples"] == 0


async def test_a_shadows_canary_is_not_served_to_clients_unless_the_route_says_so() -> None:
    async with ChainHarness.open(SHADOWED) as h:
        reply = await h.infer("cand", [x(value=1.0)])
        assert isinstance(reply, LocalReply) and reply.kind is ErrorKind.NOT_FOUND
        assert "cand" not in h.runtime.served and "cand" in h.runtime.routes
    open_canary = {"models": [SHADOWED["models"][0], {"name": "cand", "internal": False}]}
    async with ChainHarness.open(open_canary) as h:
        assert isinstance(await h.infer("cand", [x(value=1.0)]), Result)


async def test_a_replay_is_queued_but_never_counted_as_mirrored() -> None:
    """The header can only say ``queued`` (the replay check runs off the request path); the
    counters say what was sent: one copy of three identical requests."""
    async with ChainHarness.open(SHADOWED) as h:
        for _ in range(3):
            await h.infer("prod", [x(value=5.0)])
            assert h.decision("mmguard-shadow") == "queued; to 'cand'"
        shadow = (h.runtime.local.get(SHADOWS) or {})["prod"]
        for _ in range(1000):
            if shadow.state.compared + shadow.state.unjudged.get("replay", 0) >= 3:
                break
            await asyncio.sleep(0)
        snap = shadow.snapshot()
        sent = shadow.m_mirrored.labels("prod", "cand")._value.get()
    assert (snap["mirrored"], snap["compared"], snap["unjudged"]["replay"], sent) == (1, 1, 2, 1)
    assert sorted(c.target.model for c in h.backend.calls if c.target) == ["cand"] + ["prod"] * 3
