"""Server-sent events end at a blank line whatever the line ends (LF, CRLF, CR), however the
bytes are cut into chunks."""

from __future__ import annotations

import pytest

from proxy.call import SseEvent
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
