"""``limits`` in a real chain over the in-memory backend: size, batch and concurrency refusals
name the limit, and a refused call never reaches the backend."""

from __future__ import annotations

import asyncio

from proxy.call import Call, LocalReply, Result, Target
from proxy.errors import ErrorKind
from tests.support.chain_harness import ChainHarness, echo, x


def limits(**cfg: object) -> dict[str, object]:
    return {"models": [{"name": "m", "filters": [{"limits": cfg}]}]}


async def test_a_batch_over_the_limit_is_refused_before_the_backend() -> None:
    async with ChainHarness.open(limits(max_batch=2)) as h:
        ok = await h.infer("m", [x(rows=2)])
        refused = await h.infer("m", [x(rows=3)])
    assert isinstance(ok, Result)
    assert isinstance(refused, LocalReply) and refused.kind is ErrorKind.TOO_LARGE
    assert "batch 3; the limit is 2" in refused.message
    assert len(h.backend.calls) == 1  # only the call within the limit


async def test_request_bytes_over_the_limit_are_refused() -> None:
    async with ChainHarness.open(limits(max_request_bytes=12)) as h:
        ok = await h.infer("m", [x(rows=1)])  # 3 x FP32 = 12 bytes
        refused = await h.infer("m", [x(rows=2)])
    assert isinstance(ok, Result)
    assert isinstance(refused, LocalReply) and refused.kind is ErrorKind.TOO_LARGE
    assert "24 bytes; the limit is 12" in refused.message


async def test_past_max_in_flight_the_caller_is_told_when_to_retry() -> None:
    release, holding = asyncio.Event(), asyncio.Event()

    async def slow(call: Call, target: Target) -> Result:
        holding.set()
        await release.wait()
        return echo(call, target)

    async with ChainHarness.open(limits(max_in_flight=1, retry_after_s=2.5), answer=slow) as h:
        first = asyncio.create_task(h.infer("m"))
        await asyncio.wait_for(holding.wait(), 10)  # the first call holds the only slot
        refused = await h.infer("m")
        release.set()
        assert isinstance(await first, Result)
        after = await h.infer("m")  # the slot is free again
    assert isinstance(refused, LocalReply) and refused.kind is ErrorKind.OVERLOADED
    assert refused.retry_after_s == 2.5 and "1 requests in flight" in refused.message
    assert isinstance(after, Result)
