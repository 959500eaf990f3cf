"""The remote image fetcher a reload replaces: the calls that took it before the reload still
fetch with it, and it is closed once the last of them is done (not under them, and not left
open). A real aiohttp image host on loopback; mmguard's own fetcher."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from proxy.config.model import RemoteImageFetch
from proxy.fronts.media_fetch import FetchBudget, ImageFetcher
from proxy.wire import openai
from proxy.wire.media_urls import HostAllowList


class SlowHost:
    """``/a.png``: half of its 2,000 bytes, then the rest once ``gate`` is set."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.halfway = asyncio.Event()

    async def image(self, request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"Content-Type": "image/png"})
        answer.content_length = 2000
        await answer.prepare(request)
        await answer.write(b"x" * 1000)
        self.halfway.set()
        await self.gate.wait()
        await answer.write(b"y" * 1000)
        return answer


@asynccontextmanager
async def slow_host() -> AsyncIterator[tuple[SlowHost, int]]:
    host = SlowHost()
    app = web.Application()
    app.router.add_get("/a.png", host.image)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield host, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        host.gate.set()
        await runner.cleanup()


async def inline(fetcher: ImageFetcher, port: int) -> tuple[int, str]:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{port}/a.png"}}]}]}
    ).encode()
    call = openai.parse_request(body, openai.CHAT)
    held: list[FetchBudget] = []
    try:
        count = await fetcher.inline(call, body, 16 << 20, held)
    finally:
        for budget in held:
            budget.release()
    assert call.document is not None
    url = call.document["messages"][0]["content"][0]["image_url"]["url"]
    return count, url


async def test_a_retired_fetcher_finishes_the_fetch_in_flight_then_closes() -> None:
    async with slow_host() as (host, port):
        fetcher = ImageFetcher(RemoteImageFetch(), HostAllowList.of((f"127.0.0.1:{port}",)))
        fetching = asyncio.create_task(inline(fetcher, port))
        await asyncio.wait_for(host.halfway.wait(), 10)
        session = fetcher.session()
        await fetcher.retire()  # a reload, half way through the image
        assert not session.closed, "the session was closed under a call still fetching with it"
        host.gate.set()
        count, url = await asyncio.wait_for(fetching, 10)
        assert count == 1 and url.startswith("data:image/png;base64,")
        assert session.closed, "the retired fetcher's session outlived its last call"


async def test_a_call_that_took_the_old_fetcher_before_the_reload_fetches_then_closes_it(
        ) -> None:
    """Its body was still arriving at the reload: it fetches with the fetcher it took, and the
    session that opens for it is closed once it is done (not left open for good)."""
    async with slow_host() as (host, port):
        fetcher = ImageFetcher(RemoteImageFetch(), HostAllowList.of((f"127.0.0.1:{port}",)))
        await fetcher.retire()  # nothing in flight: closed at once
        made: list[aiohttp.ClientSession] = []
        opened = fetcher.session

        def spied() -> aiohttp.ClientSession:
            made.append(session := opened())
            return session

        fetcher.session = spied  # type: ignore[method-assign]
        host.gate.set()
        count, _ = await asyncio.wait_for(inline(fetcher, port), 10)
        assert count == 1 and made
        assert all(s.closed for s in made), "the late call's session was left open"
