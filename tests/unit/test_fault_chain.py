"""``fault`` in a real runtime: only canary calls are touched, every fault is marked, and the
experiment's admin routes (declared by the filter, token rule applied by ``proxy.process.admin``)
act on the registry the runtime keeps across reloads."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from filters.fault import FaultFactory
from filters.fault.registry import EXPERIMENTS
from proxy.call import LocalReply, Result
from proxy.config.model import ConfigError, parse_config
from proxy.errors import ErrorKind
from proxy.lifecycle import Access, AdminRequest
from tests.support.chain_harness import ChainHarness

ABORT = {"kind": "abort", "grpc_code": "unavailable", "message": "injected outage"}


def faulty(*actions: dict[str, Any]) -> dict[str, Any]:
    return {"models": [{"name": "m", "filters": [
        {"fault": {"experiments": [{"name": "outage", "seed": 3, "actions": list(actions)}]}}]}]}


def admin(h: ChainHarness, **params: str) -> AdminRequest:
    async def no_body() -> Any:
        raise ValueError("no body")
    return AdminRequest(params=params, state=h.runtime.state, local=h.runtime.local,
                        read_json=no_body)


async def test_only_canary_calls_get_the_fault_and_it_is_marked() -> None:
    async with ChainHarness.open(faulty(ABORT)) as h:
        clean = await h.infer("m")
        assert h.decision("mmguard-fault") is None
        hit = await h.infer("m", canary=True)
        assert h.decision("mmguard-fault") == "outage/abort; abort"
    assert isinstance(clean, Result)
    assert isinstance(hit, LocalReply) and hit.kind is ErrorKind.UNAVAILABLE
    assert hit.injected == "outage/abort" and "injected outage" in hit.message
    assert len(h.backend.calls) == 1  # the aborted canary call never reached the backend


async def test_stop_all_through_the_filters_admin_route_ends_the_faults() -> None:
    routes = {(r.method, r.path): r for r in FaultFactory().admin_routes}
    stop_all = routes[("POST", "/admin/experiments/stop-all")]
    assert stop_all.access is Access.REDUCES_RISK  # the kill switch: open without a token
    assert routes[("POST", "/admin/experiments")].access is Access.MUTATES
    async with ChainHarness.open(faulty(ABORT)) as h:
        status, body = await stop_all.handler(admin(h))
        after = await h.infer("m", canary=True)
        registry = h.runtime.state.get(EXPERIMENTS)
    assert (status, body) == (200, {"stopped": ["outage"]})
    assert isinstance(after, Result)
    assert registry is not None and registry.experiments["outage"].state == "stopped"


async def test_starting_on_a_route_without_the_filter_is_refused_with_how_to_add_it() -> None:
    routes = {(r.method, r.path): r for r in FaultFactory().admin_routes}
    start = routes[("POST", "/admin/experiments")]
    doc = {"models": [{"name": "m", "filters": [{"fault": {}}]}, {"name": "plain"}]}
    async with ChainHarness.open(doc) as h:
        async def body() -> Any:
            return {"route": "plain", "experiment": {"name": "e", "actions": [ABORT]}}
        request = AdminRequest(params={}, state=h.runtime.state, local=h.runtime.local,
                               read_json=body)
        status, answer = await start.handler(request)
    assert status == 409 and "route 'plain' has no fault filter" in answer["error"]


async def test_the_same_seed_and_request_give_the_same_delay() -> None:
    delay = {"kind": "delay", "min_ms": 1, "max_ms": 500}
    waits = []
    for _ in range(2):
        async with ChainHarness.open(faulty(delay)) as h:
            start = h.clock.monotonic()
            reply = await h.infer("m", canary=True, request_id="req-7")
            waits.append(h.clock.monotonic() - start)
            assert (h.decision("mmguard-fault") or "").startswith("outage/delay; delay ")
        assert isinstance(reply, Result)
    assert waits[0] == waits[1] and 0.001 <= waits[0] <= 0.5


async def test_the_kill_switch_ends_a_delay_already_in_progress() -> None:
    """A call sleeping in an injected delay when the experiment stops goes on at once as a
    clean call (it waited 20 s after stop-all: only new calls were spared)."""
    routes = {(r.method, r.path): r for r in FaultFactory().admin_routes}
    stop_all = routes[("POST", "/admin/experiments/stop-all")]
    async with ChainHarness.open(faulty({"kind": "delay", "ms": 30000})) as h:
        h.clock.sleep = asyncio.sleep  # type: ignore[method-assign,assignment]  # real waits
        loop = asyncio.get_running_loop()
        started = loop.time()
        call = asyncio.ensure_future(h.infer("m", canary=True))
        await asyncio.sleep(0.2)
        assert not call.done()  # sleeping in the delay
        status, _ = await stop_all.handler(admin(h))
        reply = await asyncio.wait_for(call, 5)
        took = loop.time() - started
    assert status == 200 and isinstance(reply, Result)
    assert took < 5  # generous: the stop is looked at every 50 ms
    assert len(h.backend.calls) == 1  # the call went on to the backend


async def test_a_delay_past_ten_minutes_or_infinite_is_refused() -> None:
    for ms in (600_001, float("inf"), 1e309):
        doc = faulty({"kind": "delay", "ms": ms})
        doc["backends"] = [{"kind": "onnxruntime", "name": "b", "model_dir": "."}]
        doc["models"][0]["backend"] = "b"
        with pytest.raises(ConfigError) as err:
            parse_config(doc, "test")
        assert "actions[0].delay.ms" in str(err.value), err.value
