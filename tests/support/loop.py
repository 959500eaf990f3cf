"""An asyncio loop in a daemon thread, for servers that tests reach over sockets; and a
hand-written aiohttp server on loopback run from one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Self, TypeVar

from aiohttp import web

T = TypeVar("T")


class BackgroundLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():  # stopped: close it (a loop left open is a
            self.loop.close()            # ResourceWarning whenever the collector finds it)


class LoopbackApp:
    """``with LoopbackApp(make_app) as server:`` serves the application ``make_app`` returns
    (called inside the server's own loop) on 127.0.0.1 at ``server.port``; ``on_stop`` runs in
    that loop before the server is cleaned up (to end handlers that wait on purpose)."""

    def __init__(self, make_app: Callable[[], web.Application],
                 on_stop: Callable[[], None] | None = None) -> None:
        self.make_app, self.on_stop = make_app, on_stop
        self.port = 0
        self._loop: BackgroundLoop | None = None
        self._runner: web.AppRunner | None = None

    async def _start(self) -> int:
        self._runner = web.AppRunner(self.make_app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def _stop(self) -> None:
        if self.on_stop is not None:
            self.on_stop()
        if self._runner is not None:
            await self._runner.cleanup()

    def __enter__(self) -> Self:
        self._loop = BackgroundLoop()
        self.port = self._loop.run(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None
        self._loop.run(self._stop())
        self._loop.close()
