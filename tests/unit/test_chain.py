"""The onion: order, short-circuit, retry with another target, and the never-leak guard."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from proxy.call import Call, LocalReply, Reply, Result, Target
from proxy.chain import Next, compose
from proxy.errors import STATUS, ErrorKind, ProxyError, kind_from_grpc, kind_from_http


def make_call() -> Call:
    return Call(model="m", version="", inputs=[], target=Target("a", "m"))


async def test_filters_wrap_in_order_and_see_the_result() -> None:
    seen: list[str] = []

    def tag(name: str):  # type: ignore[no-untyped-def]
        async def f(call: Call, next: Next) -> Reply:
            seen.append(f"{name}>")
            result = await next(call)
            seen.append(f"<{name}")
            return result
        return f

    async def terminal(call: Call) -> Reply:
        seen.append("backend")
        return Result("m")

    chain = compose([("outer", tag("outer")), ("inner", tag("inner"))], terminal)
    assert isinstance(await chain(make_call()), Result)
    assert seen == ["outer>", "inner>", "backend", "<inner", "<outer"]


async def test_local_reply_short_circuits() -> None:
    called = []

    async def refuse(call: Call, next: Next) -> Reply:
        return LocalReply(ErrorKind.UNPROCESSABLE, "no")

    async def terminal(call: Call) -> Reply:
        called.append(1)
        return Result("m")

    reply = await compose([("refuse", refuse)], terminal)(make_call())
    assert isinstance(reply, LocalReply) and reply.kind is ErrorKind.UNPROCESSABLE
    assert called == []


async def test_a_filter_may_call_next_again_with_another_target() -> None:
    async def fallback(call: Call, next: Next) -> Reply:
        first = await next(call)
        if isinstance(first, LocalReply):
            call.target = Target("b", "m")
            return await next(call)
        return first

    async def terminal(call: Call) -> Reply:
        assert call.target is not None
        if call.target.backend == "a":
            return LocalReply(ErrorKind.UNAVAILABLE, "a is down")
        return Result("m", version="from-b")

    reply = await compose([("fallback", fallback)], terminal)(make_call())
    assert isinstance(reply, Result) and reply.version == "from-b"


async def test_exceptions_never_leak() -> None:
    async def broken(call: Call, next: Next) -> Reply:
        raise KeyError("oops")

    async def refusing(call: Call, next: Next) -> Reply:
        raise ProxyError(ErrorKind.TOO_LARGE, "too big")

    async def terminal(call: Call) -> Reply:
        return Result("m")

    reply = await compose([("broken", broken)], terminal)(make_call())
    assert isinstance(reply, LocalReply) and reply.kind is ErrorKind.INTERNAL
    assert "filter 'broken' failed: KeyError" in reply.message
    reply = await compose([("refusing", refusing)], terminal)(make_call())
    assert isinstance(reply, LocalReply) and reply.kind is ErrorKind.TOO_LARGE


async def test_a_cancel_under_the_call_is_an_answer_and_the_calls_own_cancel_is_kept() -> None:
    """A library that cancels what the call awaits (grpc, closing a channel) raises a
    CancelledError the call's task never got: let through, no answer is ever sent and the
    client waits for its deadline; it is an INTERNAL answer. The call's own cancel (the client
    left) still ends it."""
    loop = asyncio.get_running_loop()
    pending: asyncio.Future[Reply] = loop.create_future()

    async def backend(call: Call) -> Reply:
        return await pending

    chain = compose([], backend)
    task = asyncio.ensure_future(chain(make_call()))
    await asyncio.sleep(0)
    pending.cancel()  # by someone else, not the task
    reply = await task
    assert isinstance(reply, LocalReply) and reply.kind is ErrorKind.INTERNAL
    assert "was cancelled although the call was not" in reply.message
    waiting = asyncio.ensure_future(chain(make_call()))  # awaits a fresh pending future
    pending = loop.create_future()
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


def test_one_table_round_trips_backend_codes() -> None:
    assert set(STATUS) == set(ErrorKind)
    for kind, status in STATUS.items():
        if kind in (ErrorKind.UNPROCESSABLE, ErrorKind.TOO_LARGE, ErrorKind.BAD_GATEWAY):
            assert kind_from_http(status.http) is kind
            continue  # two kinds share a gRPC code; the HTTP status tells them apart
        if kind is ErrorKind.ALREADY_EXISTS:  # shares 400 with INVALID_ARGUMENT, as in Triton
            assert kind_from_grpc(status.grpc) is kind
            assert kind_from_http(status.http) is ErrorKind.INVALID_ARGUMENT
            continue
        assert kind_from_grpc(status.grpc) is kind
        assert kind_from_http(status.http) is kind
    assert STATUS[ErrorKind.OVERLOADED] == (429, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert kind_from_http(418) is ErrorKind.INVALID_ARGUMENT
    assert kind_from_http(502) is ErrorKind.BAD_GATEWAY
    assert kind_from_http(500) is ErrorKind.INTERNAL


async def test_a_cancel_under_a_stream_is_its_last_word_and_the_calls_own_cancel_is_kept(
        ) -> None:
    """The same for a backend stream the front reads: its last item is an INTERNAL reply
    (the client's stream ends with an error instead of hanging)."""
    from proxy.engine.dataplane import _last_word

    loop = asyncio.get_running_loop()
    pending: asyncio.Future[Reply] = loop.create_future()

    async def backend() -> AsyncIterator[Reply]:
        yield Result("m")
        yield await pending

    async def read() -> list[Reply]:
        return [item async for item in _last_word(backend())]  # type: ignore[misc]

    task = asyncio.ensure_future(read())
    await asyncio.sleep(0.01)
    pending.cancel()
    items = await task
    assert isinstance(items[0], Result) and len(items) == 2
    last = items[1]
    assert isinstance(last, LocalReply) and last.kind is ErrorKind.INTERNAL
    assert "cancelled although the call was not" in last.message
    pending = loop.create_future()
    task = asyncio.ensure_future(read())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
