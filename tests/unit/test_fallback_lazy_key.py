"""The answer cache's MAC runs only when the cache is read: a call's key is kept undigested
(its request's bytes referenced, and counted) until a level fails or the last good answer is
asked for; an entry that leaves unread is never hashed. The digest is the same key either way,
and a payload that could change later is hashed at once."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from filters.fallback import cache_key as module
from filters.fallback.cache import AnswerCache, CacheConfig
from filters.fallback.cache_key import cache_key, key_parts
from filters.fallback.filter import Fallback, FallbackConfig
from proxy.call import Call, LocalReply, Reply, Result, Target
from proxy.chain import FilterContext, Next, compose
from proxy.clock import ManualClock
from proxy.errors import ErrorKind
from proxy.telemetry import Telemetry
from proxy.tensor import Tensor

SHAPE = (1, 3, 8, 8)
NBYTES = 4 * 3 * 8 * 8


def request_body(i: int) -> bytes:
    """A request as it arrives: the tensor's bytes inside a larger body (its header around)."""
    pixels = np.full(SHAPE, float(i), np.float32).tobytes()
    return b"{header}" + pixels + b"\n"


def call_for(i: int, body: bytes | None = None) -> Call:
    body = request_body(i) if body is None else body
    raw = memoryview(body)[8:8 + NBYTES]  # a view into the body, as a decoded request's input
    return Call(model="m", version="1", inputs=[Tensor("x", "FP32", SHAPE, raw=raw)],
                target=Target("b", "m"))


def answer(n: int = 64) -> Result:
    return Result("m", outputs=[Tensor("y", "UINT8", (n,), raw=bytes(n))])


@pytest.fixture
def macs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Every MAC run (each digest starts one), as whether it ran on this thread, the event
    loop's."""
    here = threading.get_ident()
    runs: list[bool] = []
    real = module.blake3  # type: ignore[attr-defined]

    def counting(*args: object, **kwargs: object) -> object:
        runs.append(threading.get_ident() == here)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "blake3", counting)
    yield runs


def flaky() -> tuple[Fallback, Next, list[bool]]:
    """The fallback filter before a backend that answers x[0] * 2 while ``healthy[0]``, and
    UNAVAILABLE after."""
    healthy = [True]

    async def terminal(c: Call) -> Reply:
        if not healthy[0]:
            return LocalReply(ErrorKind.UNAVAILABLE, "backend down")
        x = np.frombuffer(c.inputs[0].raw_bytes(), np.float32)
        return Result("m", "1", "", [Tensor("y", "FP32", (1,), raw=(x[:1] * 2).tobytes())])

    ctx = FilterContext("m", Telemetry(), ManualClock(), random.Random(1), lambda: None)
    fallback = Fallback(FallbackConfig.model_validate({"breaker": {"minimum_calls": 1000}}),
                        ctx)
    return fallback, compose([("fallback", fallback)], terminal), healthy


def big(i: int, shape: tuple[int, ...] = (1, 3, 100, 100)) -> Call:
    """A request of 120 KB (twelve of them are past 1 MiB) whose pixels are all ``i``."""
    body = np.full(shape, float(i), np.float32).tobytes()
    return Call(model="m", version="1", target=Target("b", "m"),
                inputs=[Tensor("x", "FP32", shape, raw=memoryview(body))])


def first_value(reply: Reply) -> float:
    assert isinstance(reply, Result)
    return float(np.frombuffer(reply.outputs[0].raw_bytes(), np.float32)[0])


def test_the_digest_is_the_key_whichever_way_it_is_taken() -> None:
    """Kept undigested (a view into an immutable body) or hashed at once (a numpy array's
    buffer, which a filter could write to): the same request has the same key."""
    lazy = key_parts(call_for(3))
    assert not lazy.digested
    eager_call = call_for(3)
    eager_call.inputs[0] = Tensor.from_numpy("x", np.full(SHAPE, 3.0, np.float32))
    eager = key_parts(eager_call)
    assert eager.digested  # a writable buffer: hashed as it is now
    assert lazy.digest() == eager.digest() == cache_key(call_for(3))
    assert lazy.digest() != cache_key(call_for(4))


def test_a_payload_that_can_change_is_hashed_as_it_was() -> None:
    shared = bytearray(request_body(5))
    c = call_for(5)
    c.inputs[0] = Tensor("x", "FP32", SHAPE, raw=memoryview(shared)[8:8 + NBYTES])
    parts = key_parts(c)
    assert parts.digested and parts.payloads == []  # nothing of the buffer is kept
    shared[8:8 + NBYTES] = bytes(NBYTES)  # the buffer is reused for another request
    assert parts.digest() == cache_key(call_for(5))


def test_an_entry_keeps_its_request_alive_until_keyed(macs: list[bool]) -> None:
    cache = AnswerCache(CacheConfig(max_bytes=10_000, max_entry_bytes=1000), lambda: 0.0)
    body = request_body(1)
    parts = key_parts(call_for(1, body))
    assert cache.put(parts, answer(64)) == 64 + len(body) + parts_head(parts)
    assert cache.undigested == 1 and len(macs) == 0
    assert cache.bytes == 64 + len(body) + parts_head(parts)
    found = cache.get(key_parts(call_for(1)))  # another copy of the same request
    assert found is not None and found[1].outputs[0].raw_bytes() == bytes(64)
    assert len(macs) == 2  # the lookup's own key and the kept entry's, once each
    assert cache.undigested == 0 and cache.bytes == 64 and parts.payloads == []
    assert cache.get(cache_key(call_for(1))) is not None and len(macs) == 3  # no entry again


def parts_head(parts: module.KeyParts) -> int:
    return sum(len(s) for s in parts.segments if type(s) is bytes)


def test_an_entry_that_leaves_unread_is_never_hashed(macs: list[bool]) -> None:
    now = [0.0]
    cache = AnswerCache(CacheConfig(size=3, ttl_s=10), lambda: now[0])
    kept = [key_parts(call_for(i)) for i in range(5)]
    for parts in kept:
        cache.put(parts, answer())
    assert len(cache) == 3 and cache.undigested == 3 and len(macs) == 0  # two evicted, unhashed
    now[0] = 5.0
    cache.put(key_parts(call_for(5)), answer())  # evicts #2
    now[0] = 12.0  # #3 and #4 expired; #5 not
    assert cache.get(key_parts(call_for(5))) is not None
    assert [p.digested for p in kept] == [False] * 5  # evicted or expired: never hashed
    assert len(macs) == 2 and len(cache) == 1 and cache.undigested == 0


def test_the_later_of_two_entries_for_one_request_is_served() -> None:
    cache = AnswerCache(CacheConfig(), lambda: 0.0)
    cache.put(key_parts(call_for(7)), answer(8))
    cache.put(key_parts(call_for(8)), answer(8))
    cache.put(key_parts(call_for(7)), answer(16))  # the same request, answered again
    assert len(cache) == 3  # not known to be the same until keyed
    found = cache.get(cache_key(call_for(7)))
    assert found is not None and len(found[1].outputs[0].raw_bytes()) == 16
    assert len(cache) == 2 and cache.bytes == 8 + 16


def test_a_request_too_large_to_keep_alive_is_hashed_at_once(macs: list[bool]) -> None:
    cache = AnswerCache(CacheConfig(max_bytes=4000, max_entry_bytes=400), lambda: 0.0)
    parts = key_parts(call_for(2))  # its body (777 bytes) with the answer: over 400
    assert cache.put(parts, answer(64)) == 64
    assert parts.digested and len(macs) == 1 and cache.undigested == 0 and cache.bytes == 64
    assert cache.put(key_parts(call_for(2)), answer(500)) is None  # the answer itself too large
    assert len(macs) == 1  # refused before any hashing


async def test_healthy_calls_run_no_mac_and_a_failure_is_served_from_the_cache(
        macs: list[bool]) -> None:
    """Through the fallback filter: 40 good answers cost no MAC; when the backend fails, the
    first failed call keys what the cache holds (once) and is served its request's last good
    answer, marked stale; the next failed call runs one MAC, its own."""
    fallback, run, healthy = flaky()
    for i in range(40):
        assert isinstance(await run(call_for(i)), Result)
    assert fallback.cache is not None and fallback.cache.undigested == 40
    assert len(macs) == 0
    healthy[0] = False
    again = call_for(17)
    served = await run(again)
    assert isinstance(served, Result) and again.decisions.get("mmguard-stale") == "true"
    assert first_value(served) == 34.0
    assert len(macs) == 41 and fallback.cache.undigested == 0
    held = fallback.m_cache_bytes._value.get()  # the gauge says what is held once keyed
    assert held == fallback.cache.bytes == 40 * 4  # 40 answers of 4 bytes, no request
    missed = await run(call_for(99))
    assert isinstance(missed, LocalReply) and "no level could answer" in missed.message
    assert len(macs) == 42


async def test_a_large_read_is_keyed_in_a_worker_thread(macs: list[bool]) -> None:
    """Past 1 MiB of requests to key, the MACs of a read run in a worker thread (as quality
    measures a large image), not on the event loop; failed calls arriving meanwhile wait for
    that one run and are each served their own request's answer."""
    fallback, run, healthy = flaky()
    for i in range(12):
        assert isinstance(await run(big(i)), Result)
    assert fallback.cache is not None and fallback.cache.undigested_bytes > 1 << 20
    assert macs == []
    healthy[0] = False
    calls = [big(i) for i in (0, 5, 11)]
    unseen = big(0, (1, 3, 400, 400))  # 1.9 MB, never answered
    *served, missed = await asyncio.gather(*(run(c) for c in [*calls, unseen]))
    for c, reply, i in zip(calls, served, (0, 5, 11), strict=True):
        assert isinstance(reply, Result) and c.decisions.get("mmguard-stale") == "true"
        assert first_value(reply) == 2.0 * i
    assert isinstance(missed, LocalReply) and "no level could answer" in missed.message
    # off the loop: the twelve entries, the first failed call's own key, and the 1.9 MB key
    # of a call that waited on that run; on it, the two small keys of the other two that did
    assert macs.count(False) == 14 and macs.count(True) == 2
    assert fallback.cache.undigested == 0


async def test_quality_asking_for_the_last_good_answer_keys_a_large_read_off_the_loop(
        macs: list[bool]) -> None:
    """Quality's graded actions read the same cache (``cached_answer``): the same rule."""
    fallback, run, _ = flaky()
    for i in range(12):
        assert isinstance(await run(big(i)), Result)
    found = await fallback.cached_answer(big(5))
    assert found is not None and first_value(found[1]) == 10.0
    assert macs.count(False) == 13 and macs.count(True) == 0
