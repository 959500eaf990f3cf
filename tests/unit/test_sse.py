"""Server-sent events end at a blank line whatever the line ends (LF, CRLF, CR), however the
bytes are cut into chunks; a backend's stream reads the same read by read or event by event."""

from __future__ import annotations

import random
from collections.abc import AsyncGenerator

import pytest

from proxy.call import LocalReply, SseEvent, SseEvents, SseStream
from proxy.errors import ErrorKind
from proxy.wire.sse import SseEventTooLarge, SseSplitter

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


class _WholeBufferSplitter:
    """The splitter as it was before events were held in pieces (the whole pending buffer
    joined to each chunk): the reference the pieces must agree with."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data, held = self.pending + chunk, b""
        if b"\r" in data:
            if data.endswith(b"\r"):
                data, held = data[:-1], b"\r"
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n\n" not in data:
            self.pending = data + held
            return []
        *events, rest = data.split(b"\n\n")
        self.pending = rest + held
        return [e + b"\n\n" for e in events if e.strip()]

    def end(self) -> list[bytes]:
        if not self.pending.endswith(b"\r"):
            return []
        pending, self.pending = self.pending[:-1] + b"\n", b""
        return self.feed(pending)


@pytest.mark.parametrize("seed", range(40))
def test_events_held_in_pieces_split_as_the_whole_buffer_did(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = [b"a", b"b", b":", b" ", b"\n", b"\r", b"\r\n", b"data: ", b"{}"]
    stream = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 400)))
    new, old = SseSplitter(), _WholeBufferSplitter()
    got_new: list[bytes] = []
    got_old: list[bytes] = []
    i = 0
    while i < len(stream):
        step = rng.choice([1, 1, 2, 3, 5, 17, 64])
        got_new += new.feed(stream[i:i + step])
        got_old += old.feed(stream[i:i + step])
        assert new.pending == old.pending
        i += step
    got_new += new.end()
    got_old += old.end()
    assert got_new == got_old
    assert new.pending == old.pending


def test_an_event_that_does_not_end_within_the_limit_is_refused() -> None:
    split = SseSplitter(limit=1000)
    assert split.feed(b"data: 1\n\n" + b"x" * 600) == [b"data: 1\n\n"]
    with pytest.raises(SseEventTooLarge, match="more than 1000 bytes"):
        for _ in range(10):
            split.feed(b"y" * 100)
    ok = SseSplitter(limit=1000)  # many events, each under the limit: no refusal
    for _ in range(50):
        assert ok.feed(b"data: " + b"z" * 900 + b"\n\n") == [b"data: " + b"z" * 900 + b"\n\n"]


def test_the_events_before_a_huge_one_in_the_same_read_are_handed_on_first() -> None:
    split = SseSplitter(limit=1000)  # one read: an event, then a huge open one
    assert split.feed(b"data: 1\n\n" + b"x" * 1001) == [b"data: 1\n\n"]
    with pytest.raises(SseEventTooLarge):
        split.feed(b"more")
    split = SseSplitter(limit=1000)  # the same, and the stream ended with that read
    assert split.feed(b"data: 1\n\n" + b"x" * 1001) == [b"data: 1\n\n"]
    with pytest.raises(SseEventTooLarge):
        split.end()


def test_an_event_over_the_limit_that_comes_whole_in_one_read_is_refused() -> None:
    assert SseSplitter(limit=1000).feed(b"data: " + b"x" * 994 + b"\n\n") == [
        b"data: " + b"x" * 994 + b"\n\n"]  # exactly the limit
    with pytest.raises(SseEventTooLarge):
        SseSplitter(limit=1000).feed(b"data: " + b"x" * 995 + b"\n\ndata: 2\n\n")
    split = SseSplitter(limit=1000)  # what came before it is handed on, nothing after it
    assert split.feed(b"data: 1\n\ndata: " + b"x" * 995 + b"\n\ndata: 2\n\n") == [
        b"data: 1\n\n"]
    with pytest.raises(SseEventTooLarge, match="more than 1000 bytes"):
        split.end()
