"""The runtime, the data plane and the admin listener over the in-memory backend: routing
refusals name what is served, a route's timeout bounds the call, observers see canary answers
only, and the token rule of every filter's admin routes is the one in ``proxy.process.admin``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.call import Call, LocalReply, Result, Target
from proxy.config.model import parse_config
from proxy.engine.runtime import Runtime
from proxy.errors import ErrorKind
from proxy.process.admin import admin_app
from tests.support.chain_harness import BACKEND, ChainHarness, echo

TWO = {"models": [{"name": "a", "version": "2"}, {"name": "b", "timeout_s": 0.05}]}
FILTERED = {"models": [{"name": "m", "filters": [
    {"fallback": {}}, {"fault": {"experiments": [{"name": "e", "actions": [
        {"kind": "abort", "http_status": 503, "message": "x"}]}]}}]}]}


async def test_an_unknown_model_or_version_is_refused() -> None:
    async with ChainHarness.open(TWO) as h:
        unknown = await h.infer("zzz")
        wrong_version = await h.plane.infer(Call("a", "7", []))
    assert isinstance(unknown, LocalReply) and unknown.kind is ErrorKind.NOT_FOUND
    # Triton's words, with no model list to callers
    assert unknown.message == "Request for unknown model: 'zzz' is not found"
    assert isinstance(wrong_version, LocalReply)
    assert wrong_version.message.startswith("Request for unknown model: 'a' version 7 is not "
                                            "found")
    assert "mmguard serves version '2'" in wrong_version.message


async def test_a_routes_timeout_becomes_the_calls_deadline() -> None:
    async def slow(call: Call, target: Target) -> Result:
        if target.model == "b":
            remaining = call.remaining()
            assert remaining is not None and remaining <= 0.05
        return echo(call, target)

    async with ChainHarness.open(TWO, answer=slow) as h:
        assert isinstance(await h.infer("b"), Result)
        assert isinstance(await h.infer("a"), Result)
    deadlines = [c.deadline for c in h.backend.calls]
    assert deadlines[0] is not None and deadlines[1] is None


async def test_observers_see_canary_answers_only() -> None:
    seen: list[tuple[str, bool]] = []
    faulty = {"models": [{"name": "m", "filters": FILTERED["models"][0]["filters"][1:]}]}
    async with ChainHarness.open(faulty) as h:
        h.runtime.observers.append(lambda call, reply, s: seen.append(
            (call.model, isinstance(reply, Result))))
        await h.infer("m")
        await h.infer("m", canary=True)
    assert seen == [("m", False)]  # the canary call, aborted by the experiment


AdminClient = TestClient[web.Request, web.Application]


@asynccontextmanager
async def admin(h: ChainHarness, token: str | None) -> AsyncIterator[AdminClient]:
    client: AdminClient = TestClient(TestServer(admin_app(h.plane, token), host="127.0.0.1"))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def test_the_token_rule_is_the_same_for_every_filters_routes() -> None:
    async with ChainHarness.open(FILTERED) as h, admin(h, None) as open_port:
        assert (await open_port.get("/admin/breakers")).status == 200  # READ: open
        forced = await open_port.post("/admin/breakers/m/m/open")
        assert forced.status == 403  # MUTATES without a configured token
        stop = await open_port.post("/admin/experiments/stop-all")
        assert stop.status == 200  # REDUCES_RISK: the kill switch is open without a token
    async with ChainHarness.open(FILTERED) as h, admin(h, "s3cret") as locked:
        assert (await locked.post("/admin/experiments/stop-all")).status == 401
        ok = await locked.post("/admin/breakers/m/m/open",
                               headers={"Authorization": "Bearer s3cret"})
        assert ok.status == 200 and (await ok.json())["state"] == "forced_open"
        assert (await locked.get("/admin/routers")).status == 200  # no router: empty, not 404
        assert await (await locked.get("/admin/routers")).json() == {}


async def test_a_runtime_changes_the_experiments_only_once_activated() -> None:
    from filters.fault.registry import EXPERIMENTS
    without = parse_config({"backends": [{"kind": "onnxruntime", "name": BACKEND,
                                          "model_dir": "."}],
                            "models": [{"name": "m", "backend": BACKEND}]})
    async with ChainHarness.open(FILTERED) as h:
        registry = h.runtime.state.get(EXPERIMENTS)
        assert registry is not None and registry.experiments["e"].state == "running"
        new = Runtime(without, h.telemetry, h.clock, h.runtime.backends, store=h.runtime.state)
        assert registry.experiments["e"].state == "running"  # built, not serving: unchanged
        new.activate()  # the new config has no experiment 'e': it ends
        assert registry.experiments["e"].state == "stopped"
        await new.stop_watching()


async def test_a_runtime_counts_each_call_until_its_answer_or_its_streams_end() -> None:
    """``Runtime.calls``: what keeps a runtime a reload retired open (server ``_retire``). Every
    way a call ends gives its place back: an answer, a refusal, a cancel, a stream to its end
    and a stream its client left."""
    import asyncio

    release, holding = asyncio.Event(), asyncio.Event()
    pieces = asyncio.Event()

    async def events(call: Call, target: Target) -> AsyncIterator[Result]:
        for _ in range(3):
            await pieces.wait()
            yield Result(target.model)

    async def answer(call: Call, target: Target) -> Result:
        if call.headers.get("mode") == "hold":
            holding.set()
            await release.wait()
        return echo(call, target)

    async with ChainHarness.open(TWO, answer=answer) as h:
        h.backend.stream = events  # type: ignore[method-assign]  # a decoupled model's
        rt = h.runtime
        assert isinstance(await h.infer("a"), Result) and rt.calls == 0
        assert isinstance(await h.infer("zzz"), LocalReply) and rt.calls == 0
        held = asyncio.create_task(h.infer("a", headers={"mode": "hold"}))
        await holding.wait()
        assert rt.calls == 1
        idle = asyncio.create_task(rt.idle())
        await asyncio.sleep(0.01)
        assert not idle.done()  # a call is in it
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await asyncio.wait_for(idle, 1)
        assert rt.calls == 0
        for leave_early in (False, True):
            call = Call("a", "", [], streaming=True)
            items = h.plane.stream(call)
            pieces.set()
            first = await anext(items)
            assert isinstance(first, Result) and rt.calls == 1  # in it until the stream ends
            if leave_early:
                await items.aclose()
            else:
                assert len([i async for i in items]) == 2
            assert rt.calls == 0
