"""The fallback's answer cache is what its docstring says: least recently *used* goes first
(a hit refreshes an entry), bounded in answers, in the bytes they keep alive and in age; an
answer over its entry bound is neither kept nor copied."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from filters.fallback.filter import AnswerCache, CacheConfig
from proxy.call import Result, Wire
from proxy.tensor import Tensor


def answer(size: int, body: bytes | None = None) -> Result:
    """A v2 answer whose one output is ``size`` bytes: a view into ``body`` (the decoded
    answer's bytes, as a backend's answer arrives) when given, else bytes of its own."""
    raw: bytes | memoryview = memoryview(body)[:size] if body is not None else bytes(size)
    return Result("m", outputs=[Tensor("y", "UINT8", (size,), raw=raw)])


def test_a_hit_keeps_an_entry_from_eviction_and_expiry_drops_it() -> None:
    now = [0.0]
    cache = AnswerCache(CacheConfig(size=2, ttl_s=10), lambda: now[0])
    cache.put("a", Result("m"))
    cache.put("b", Result("m"))
    assert cache.get("a") is not None  # "a" is now the most recently used
    cache.put("c", Result("m"))  # evicts the least recently used: "b", not "a"
    assert cache.get("b") is None
    assert cache.get("a") is not None and cache.get("c") is not None
    now[0] = 11.0
    assert cache.get("a") is None  # expired: not served, and dropped
    assert "a" not in cache._items


def test_the_bytes_kept_alive_are_bounded_least_recently_used_first() -> None:
    cache = AnswerCache(CacheConfig(max_bytes=2500, max_entry_bytes=1000), lambda: 0.0)
    for key in "abc":
        assert cache.put(key, answer(800)) == 800
    assert cache.bytes == 2400 and len(cache) == 3
    assert cache.get("a") is not None  # a hit: "b" is now the least recently used
    assert cache.put("d", answer(800)) == 800  # 3200 > 2500: "b" goes
    assert cache.get("b") is None and len(cache) == 3 and cache.bytes == 2400
    assert cache.put("a", answer(100)) == 100  # a key kept again counts once, its new size
    assert cache.bytes == 1700 and len(cache) == 3


def test_an_answer_over_the_entry_bound_is_not_kept_nor_copied() -> None:
    cache = AnswerCache(CacheConfig(max_bytes=10_000, max_entry_bytes=1000), lambda: 0.0)
    assert cache.put("big", answer(1001)) is None
    assert cache.get("big") is None and cache.bytes == 0
    openai = Result("m", wire=Wire("openai", b"x" * 1001))
    assert cache.put("chat", openai) is None and len(cache) == 0
    assert cache.put("chat", Result("m", wire=Wire("openai", b"{}"))) == 2


def test_a_view_into_an_answers_body_counts_the_whole_body_it_pins() -> None:
    """A decoded answer's outputs are views into its body: keeping one keeps the body alive,
    so the entry holds the body's bytes (once, however many outputs point into it)."""
    body = bytes(5000)
    two = Result("m", outputs=[Tensor("y", "UINT8", (100,), raw=memoryview(body)[:100]),
                               Tensor("z", "UINT8", (100,), raw=memoryview(body)[100:200])])
    cache = AnswerCache(CacheConfig(max_bytes=8000, max_entry_bytes=6000), lambda: 0.0)
    assert cache.put("k", two) == 5000
    kept = cache.get("k")
    assert kept is not None
    raw = kept[1].outputs[0].raw_bytes()
    assert isinstance(raw, memoryview) and raw.obj is body  # not copied
    assert cache.put("k2", answer(100, bytes(7000))) is None  # pins 7000: over the entry bound


def test_a_view_into_a_reused_buffer_is_copied_and_counts_its_payload() -> None:
    shared = bytearray(np.arange(300, dtype=np.uint8).tobytes())
    result = Result("m", outputs=[Tensor("y", "UINT8", (300,), raw=memoryview(shared))])
    cache = AnswerCache(CacheConfig(), lambda: 0.0)
    assert cache.put("k", result) == 300
    shared[:] = bytes(300)  # the buffer is reused: the kept answer does not change
    kept = cache.get("k")
    assert kept is not None
    assert bytes(kept[1].outputs[0].raw_bytes()) == np.arange(300, dtype=np.uint8).tobytes()


def test_an_entry_bound_over_the_cache_bound_is_refused_at_load() -> None:
    with pytest.raises(ValidationError, match=r"max_entry_bytes \(2000\) is over max_bytes "
                                              r"\(1000\)"):
        CacheConfig(max_bytes=1000, max_entry_bytes=2000)
