"""``StreamWatch``: a backend stream broken off by its silence (the first response's wait, then
each gap), never by a reader slow to take what came (on a real event loop and its timers)."""

from __future__ import annotations

import asyncio

from proxy.backends.stream_watch import StreamWatch


async def watched(first: float, idle: float) -> tuple[StreamWatch, list[str]]:
    stopped: list[str] = []
    watch = StreamWatch(first, idle, lambda: stopped.append("stop"))
    return watch, stopped


def seen(watch: StreamWatch, stopped: list[str]) -> tuple[str | None, list[str]]:
    return watch.expired, list(stopped)


async def test_no_first_response_in_time_stops_the_stream_as_first() -> None:
    watch, stopped = await watched(0.05, 10.0)
    await asyncio.sleep(0.2)
    assert seen(watch, stopped) == ("first", ["stop"])


async def test_a_gap_past_the_idle_limit_stops_it_even_when_the_first_wait_was_long() -> None:
    watch, stopped = await watched(10.0, 0.05)  # the timer first waits 10 s: brought forward
    watch.handing_on()
    watch.reading()
    await asyncio.sleep(0.3)
    assert seen(watch, stopped) == ("idle", ["stop"])


async def test_a_slow_reader_is_not_the_backends_silence() -> None:
    watch, stopped = await watched(10.0, 0.2)
    watch.handing_on()
    await asyncio.sleep(0.6)  # the response sits with the reader three idle limits
    assert seen(watch, stopped) == (None, [])
    watch.reading()  # the reader is back: the clock runs from now
    assert seen(watch, stopped) == (None, [])
    await asyncio.sleep(0.6)  # (the loop's timers run in order: the watch's fire first)
    assert seen(watch, stopped) == ("idle", ["stop"])


async def test_a_stream_that_keeps_talking_outlives_both_limits() -> None:
    watch, stopped = await watched(1.0, 1.0)
    for _ in range(12):  # 12 responses 0.15 s apart: 1.8 s, longer than either limit
        await asyncio.sleep(0.15)
        watch.handing_on()
        watch.reading()
    watch.close()
    await asyncio.sleep(1.2)  # closed: nothing fires after the stream's end
    assert seen(watch, stopped) == (None, [])
