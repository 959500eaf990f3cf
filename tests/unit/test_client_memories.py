"""Each named client's memory across its unary requests (``proxy/engine/clients.py``): given
only where the listener names the client header, the same memory for one client, bounded by
count and by idleness, and closed when forgotten."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pydantic import ValidationError

from proxy.call import STREAM_MEMORY, Call, StreamMemory
from proxy.clock import ManualClock
from proxy.config.listeners import GrpcListener, HttpListener
from proxy.engine.clients import ClientMemories


def call(front: str = "grpc", **headers: str) -> Call:
    c = Call("m", "", [], headers=dict(headers))
    c.front = front
    return c


def memories(clock: ManualClock | None = None, **kwargs: float) -> ClientMemories:
    return ClientMemories({"grpc": "x-client-id", "http": None, "openai": None},
                          clock or ManualClock(), **kwargs)  # type: ignore[arg-type]


def test_one_client_gets_one_memory_and_nothing_else_gets_any() -> None:
    m = memories()
    a1, a2, b = call(**{"x-client-id": "a"}), call(**{"x-client-id": "a"}), \
        call(**{"x-client-id": "b"})
    for c in (a1, a2, b):
        m.attach(c)
    assert a1.state[STREAM_MEMORY] is a2.state[STREAM_MEMORY]
    assert b.state[STREAM_MEMORY] is not a1.state[STREAM_MEMORY]
    assert a1.state[STREAM_MEMORY].owner == "the client"
    unnamed, elsewhere = call(), call("http", **{"x-client-id": "a"})
    m.attach(unnamed)
    m.attach(elsewhere)  # the HTTP listener names no client header: the header means nothing
    assert STREAM_MEMORY not in unnamed.state and STREAM_MEMORY not in elsewhere.state
    streamed = call(**{"x-client-id": "a"})
    stream = streamed.state[STREAM_MEMORY] = StreamMemory()
    m.attach(streamed)
    assert streamed.state[STREAM_MEMORY] is stream  # a stream keeps its own
    assert len(m) == 2


def test_past_the_cap_the_least_recently_seen_client_is_forgotten_and_released() -> None:
    released: list[str] = []
    m = memories(max_clients=2)
    def release(name: str) -> Callable[[], None]:
        return lambda: released.append(name)

    for i, client in enumerate(("a", "b", "a", "c")):  # b is the least recently seen at c
        c = call(**{"x-client-id": client})
        m.attach(c)
        c.state[STREAM_MEMORY].put(f"k{i}", client, release(f"{client}{i}"))
    assert released == ["b1"] and len(m) == 2
    m.close()
    assert sorted(released) == ["a0", "a2", "b1", "c3"] and len(m) == 0


def test_a_client_unseen_for_idle_s_is_forgotten() -> None:
    clock = ManualClock()
    released: list[str] = []
    m = memories(clock, idle_s=60.0)
    first = call(**{"x-client-id": "a"})
    m.attach(first)
    first.state[STREAM_MEMORY].put("k", 1, lambda: released.append("a"))
    clock.advance(59.0)
    m.attach(call(**{"x-client-id": "b"}))
    assert released == []
    clock.advance(2.0)
    again = call(**{"x-client-id": "a"})
    m.attach(again)
    assert released == ["a"] and again.state[STREAM_MEMORY] is not first.state[STREAM_MEMORY]
    assert again.state[STREAM_MEMORY].get("k") is None


@pytest.mark.parametrize("listener", [GrpcListener, HttpListener])
def test_the_client_header_is_a_lower_case_header_name(listener: type[HttpListener]) -> None:
    assert listener.model_validate({"client_header": "x-client-id"}).client_header == \
        "x-client-id"
    assert listener.model_validate({}).client_header is None
    for bad in ("X-Client-Id", "x client", "", "x-client-id:"):
        with pytest.raises(ValidationError) as exc:
            listener.model_validate({"client_header": bad})
        assert "client_header" in str(exc.value), exc.value
