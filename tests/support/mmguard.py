"""Run a real mmguard ``Server`` on ephemeral localhost ports in a background thread.

The server gets its own event loop, so tests can use tritonclient's sync clients (which block)
as well as async clients on the test's own loop, all over real sockets.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from proxy.config.model import Config, parse_config
from proxy.process.server import Ports, Server
from proxy.telemetry import Telemetry
from tests.support.loop import BackgroundLoop

T = TypeVar("T")


class RunningMmguard:
    def __init__(self, config: Config | dict[str, Any], config_path: Path | None = None) -> None:
        self.config = config if isinstance(config, Config) else parse_config(config)
        self.config_path = config_path
        self.telemetry = Telemetry()
        self.server: Server | None = None
        self._loop: BackgroundLoop | None = None

    def __enter__(self) -> RunningMmguard:
        self._loop = BackgroundLoop()
        async def make() -> Server:  # inside the loop: clients bind to the running loop
            return Server(self.config, self.config_path, Ports(0, 0, 0), telemetry=self.telemetry)

        self.server = self.run(make())
        self.run(self.server.start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        assert self._loop is not None
        return self._loop.run(coro, timeout)

    def stop(self) -> None:
        if self.server is not None:
            self.run(self.server.stop())
            self.server = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def wait_ready(self, timeout: float = 60) -> None:
        assert self.server is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.run(self.server.refresh_health()):
                return
            time.sleep(0.05)
        raise TimeoutError(f"mmguard not ready after {timeout}s")

    @property
    def http_url(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.http_port}"

    @property
    def grpc_url(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.grpc_port}"

    @property
    def admin_url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.admin_port}"
