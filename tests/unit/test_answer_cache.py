"""The fallback's answer cache is what its docstring says: least recently *used* goes first
(a hit refreshes an entry), bounded, and an expired entry is gone."""

from __future__ import annotations

from filters.fallback.filter import AnswerCache, CacheConfig
from proxy.call import Result


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
