"""fallback's retry, retry budget, hedging and static answer, with an injected clock and RNG
around a terminal that fails or stalls on cue (the real-server sequence is in integration)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import numpy as np

from filters.fallback.filter import Fallback, FallbackConfig
from proxy.call import Call, LocalReply, Reply, Result, Target
from proxy.chain import FilterContext, Next, compose
from proxy.clock import ManualClock
from proxy.errors import ErrorKind
from proxy.telemetry import Telemetry
from proxy.tensor import Tensor


def chain(cfg: dict[str, object], terminal: Next) -> tuple[Next, ManualClock]:
    clock = ManualClock()
    ctx = FilterContext("m", Telemetry(), clock, random.Random(1), lambda: None)
    f = Fallback(FallbackConfig.model_validate(cfg), ctx)
    return compose([("fallback", f)], terminal), clock


def call(i: int = 0) -> Call:
    x = np.full(2, i, np.float32)
    return Call(model="m", version="", inputs=[Tensor.from_numpy("x", x)], target=Target("b", "m"))


def ok(value: float = 1.0) -> Result:
    return Result("m", "1", "", [Tensor.from_numpy("y", np.full(2, value, np.float32))])


def scripted(replies: list[Callable[[], Reply]]) -> tuple[Next, list[int]]:
    calls: list[int] = []

    async def terminal(c: Call) -> Reply:
        calls.append(1)
        return replies[min(len(calls), len(replies)) - 1]()

    return terminal, calls


async def test_retry_after_a_transient_failure_with_jittered_backoff() -> None:
    terminal, calls = scripted([lambda: LocalReply(ErrorKind.UNAVAILABLE, "blip"), ok])
    run, clock = chain({"retries": {"attempts": 3, "backoff_base_s": 0.1}, "cache": None},
                       terminal)
    c = call()
    before = clock.now
    reply = await run(c)
    assert isinstance(reply, Result) and len(calls) == 2
    assert 0.05 <= clock.now - before <= 0.15  # base 100 ms, jitter 0.5-1.5x, no real sleep
    assert c.decisions["mmguard-fallback-retry"].startswith("retry; try 2 after")


async def test_client_errors_are_not_retried_nor_counted() -> None:
    terminal, calls = scripted([lambda: LocalReply(ErrorKind.INVALID_ARGUMENT, "bad input")])
    run, _ = chain({"retries": {"attempts": 3}, "breaker": {"minimum_calls": 1}}, terminal)
    for _ in range(3):
        reply = await run(call())
        assert isinstance(reply, LocalReply) and reply.kind is ErrorKind.INVALID_ARGUMENT
    assert len(calls) == 3  # one try each, and the breaker never opened


async def test_retry_budget_caps_concurrent_retries() -> None:
    gate = asyncio.Event()

    async def terminal(c: Call) -> Reply:
        await gate.wait()
        return LocalReply(ErrorKind.UNAVAILABLE, "down")

    run, _ = chain({"retries": {"attempts": 2, "budget": 0.0, "min_concurrent_retries": 1,
                                "backoff_base_s": 10}, "cache": None,
                    "breaker": {"minimum_calls": 100}}, terminal)
    calls = [call(i) for i in range(4)]
    tasks = [asyncio.ensure_future(run(c)) for c in calls]
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(*tasks)
    exhausted = [c for c in calls
                 if c.decisions.get("mmguard-fallback-retry", "").startswith("retry-budget")]
    assert len(exhausted) == 3  # only one retry allowed in flight at a time


async def test_hedge_takes_the_faster_try() -> None:
    slow = asyncio.Event()
    tries = []

    async def terminal(c: Call) -> Reply:
        tries.append(1)
        if len(tries) == 1:
            await slow.wait()  # the first try stalls
            return ok(1.0)
        return ok(2.0)

    run, _ = chain({"hedge_after_s": 0.01, "cache": None}, terminal)
    c = call()
    reply = await run(c)
    assert isinstance(reply, Result) and reply.outputs[0].numpy()[0] == 2.0
    assert c.decisions["mmguard-fallback-hedge"].startswith("hedge; no answer after 10 ms")


async def test_nan_answers_count_as_failures_and_static_answer_is_last() -> None:
    terminal, _ = scripted([lambda: ok(float("nan"))])
    run, _ = chain({"cache": None, "static_answer": [
        {"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [0, 0]}]}, terminal)
    c = call()
    reply = await run(c)
    assert isinstance(reply, Result)
    assert reply.outputs[0].numpy().tolist() == [[0.0, 0.0]]
    assert c.decisions["mmguard-stale"] == "true"
    assert "non-finite values" in c.decisions["mmguard-fallback-level"]


async def test_cache_serves_the_last_good_answer_within_its_ttl() -> None:
    replies: list[Callable[[], Reply]] = [ok, lambda: LocalReply(ErrorKind.UNAVAILABLE, "down")]
    terminal, _ = scripted(replies)
    run, clock = chain({"cache": {"size": 10, "ttl_s": 60}}, terminal)
    assert isinstance(await run(call(7)), Result)
    c = call(7)
    stale = await run(c)
    assert isinstance(stale, Result) and c.decisions["mmguard-stale"] == "true"
    other = await run(call(8))  # never answered: nothing cached for it
    assert isinstance(other, LocalReply) and other.kind is ErrorKind.UNAVAILABLE
    assert other.retry_after_s is not None
    clock.advance(61)
    expired = await run(call(7))
    assert isinstance(expired, LocalReply)


async def test_a_call_the_backend_cancelled_is_its_failure_and_falls_back() -> None:
    """Triton cancels its in-flight requests as it shuts down: the client, still there, gets
    the cached answer (marked stale), not the backend's CANCELLED; a CANCELLED mmguard made
    itself is passed on as it is."""
    replies: list[Reply] = [ok(3.0)]
    terminal, calls = scripted([lambda: replies[-1]])
    run, _ = chain({"breaker": {"minimum_calls": 100}}, terminal)
    assert isinstance(await run(call(1)), Result)
    replies.append(LocalReply(ErrorKind.CANCELLED, "Locally cancelled by application!",
                              origin="backend"))
    c = call(1)
    reply = await run(c)
    assert isinstance(reply, Result) and c.decisions.get("mmguard-stale") == "true"
    assert reply.outputs[0].numpy().tolist() == [3.0, 3.0]
    assert "L1 'm': CANCELLED Locally cancelled" in c.decisions["mmguard-fallback-level"]
    replies.append(LocalReply(ErrorKind.CANCELLED, "the call was cancelled"))
    mine = await run(call(1))
    assert isinstance(mine, LocalReply) and mine.kind is ErrorKind.CANCELLED
    assert len(calls) == 3


async def test_a_client_that_leaves_a_hedged_call_ends_both_tries() -> None:
    """Both tries stall; the client leaves: neither keeps its backend call running for nobody
    (asyncio.wait does not cancel what it waits on)."""
    stalled: list[int] = []
    both = asyncio.Event()
    ended: list[str] = []

    async def terminal(c: Call) -> Reply:
        stalled.append(1)
        if len(stalled) == 2:
            both.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise
        return ok(0.0)

    run, _ = chain({"hedge_after_s": 0.01, "cache": None}, terminal)
    client = asyncio.ensure_future(run(call()))
    await asyncio.wait_for(both.wait(), 10)
    client.cancel()
    await asyncio.gather(client, return_exceptions=True)
    await asyncio.sleep(0)
    assert ended == ["cancelled", "cancelled"], "a hedged try outlived its client"
