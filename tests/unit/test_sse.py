"""Server-sent events end at a blank line whatever the line ends (LF, CRLF, CR), however the
bytes are cut into chunks; a backend's stream reads the same read by read or event by event."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import pytest

from proxy.call import LocalReply, SseEvent, SseEvents, SseStream
from proxy.errors import ErrorKind
from proxy.wire.sse import SseSplitter

EVENTS = [b'data: {"a":1}', b'event: x\ndata: {"b":2}', b"data: [DONE]"]


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_every_line_end_and_every_cut(eol: bytes, size: int) -> None:
    stream = b"".join(e.replace(b"\n", eol) + eol + eol for e in EVENTS)
    split = SseSplitter()
    got: list[bytes] = []
    for i in range(0, len(stream), size):
        got += split.feed(stream[i:i + size])
    got += split.end()
    assert got == [e + b"\n\n" for e in EVENTS]
    assert split.pending == b""
    assert [SseEvent(g).data for g in got] == [b'{"a":1}', b'{"b":2}', b"[DONE]"]


def test_a_cut_event_stays_pending() -> None:
    split = SseSplitter()
    assert split.feed(b'data: {"a":1}\r\n\r\ndata: {"b"') == [b'data: {"a":1}\n\n']
    assert split.pending == b'data: {"b"'


def _reads() -> AsyncGenerator[SseEvents | LocalReply, None]:
    async def reads() -> AsyncGenerator[SseEvents | LocalReply, None]:
        yield SseEvents([b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"])
        yield SseEvents([])  # a read that brought no whole event
        yield SseEvents([b"data: 4\n\n"])
        yield SseEvents([b"data: 5\n\n", b"data: [DONE]\n\n"], ended=True)
        yield LocalReply(ErrorKind.UNAVAILABLE, "gone")
    return reads()


async def test_event_by_event_each_says_whether_more_of_its_read_follows() -> None:
    got = [item async for item in SseStream(_reads())]
    assert [(e.raw, e.more) for e in got if isinstance(e, SseEvent)] == [
        (b"data: 1\n\n", True), (b"data: 2\n\n", True), (b"data: 3\n\n", False),
        (b"data: 4\n\n", False),
        (b"data: 5\n\n", True), (b"data: [DONE]\n\n", True)]  # the end came in that read
    assert isinstance(got[-1], LocalReply) and got[-1].message == "gone"
    assert len(got) == 7


async def test_read_by_read_the_same_bytes_in_the_backend_reads() -> None:
    stream = SseStream(_reads())
    got = [item async for item in stream.reads()]
    assert [(b"".join(r.raws), r.ended) for r in got if isinstance(r, SseEvents) and r.raws] == [
        (b"data: 1\n\ndata: 2\n\ndata: 3\n\n", False), (b"data: 4\n\n", False),
        (b"data: 5\n\ndata: [DONE]\n\n", True)]
    assert isinstance(got[-1], LocalReply)


async def test_closing_a_stream_mid_read_closes_the_backend_reads() -> None:
    closed: list[bool] = []

    async def reads() -> AsyncGenerator[SseEvents | LocalReply, None]:
        try:
            yield SseEvents([b"data: 1\n\n", b"data: 2\n\n"])
            yield SseEvents([b"data: 3\n\n"])
        finally:
            closed.append(True)

    stream = SseStream(reads())
    first = await anext(stream)
    assert isinstance(first, SseEvent) and first.raw == b"data: 1\n\n" and first.more
    await stream.aclose()
    assert closed == [True]
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
