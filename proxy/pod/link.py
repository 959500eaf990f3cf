"""A worker's end of the pod's control link (``proxy.pod.state``, ``proxy.process.supervisor``).

It says hello, takes the whole control state before the worker serves, then the changes as the
supervisor sends them; it forwards the worker's observations (``POD.forward``), its readiness,
and runs the reloads the supervisor orders. When the supervisor's socket closes, the supervisor
is gone: the worker stops (drains) by itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from proxy.pod.state import POD, encode, read_message

log = logging.getLogger("mmguard.pod")

FIRST_STATE_S = 10.0
"""How long a starting worker waits for the pod's state before it serves without it."""

SOCKET_ENV = "MMGUARD_POD_SOCKET"
"""The supervisor's control socket, named to each worker it starts."""


class WorkerLink:
    def __init__(self, path: str, reload: Callable[[], Awaitable[Any]]) -> None:
        self.path = path
        self._reload = reload
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._first = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(self.path)
        self.send(("hello", POD.index, os.getpid()))
        POD.connected(self.send)
        self._task = asyncio.create_task(self._read(reader))
        try:
            await asyncio.wait_for(self._first.wait(), FIRST_STATE_S)
        except TimeoutError:
            log.error("worker %d: no state from the supervisor within %g s; serving with "
                      "what this worker built", POD.index, FIRST_STATE_S)

    def send(self, message: Any) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(encode(message))

    def status(self, ready: bool, readiness: dict[str, Any] | None = None) -> None:
        """The worker's readiness, and each of its backends and routes with why not (the
        pod's ``/readyz`` gives them)."""
        self.send(("status", ready, readiness or {}))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await read_message(reader)
                if message[0] == "state":
                    POD.adopt(message[1])
                    self._first.set()
                elif message[0] == "reload":
                    task = asyncio.create_task(self._reload_now())
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("worker %d: the link to the supervisor failed", POD.index)
        POD.connected(None)
        log.error("worker %d: the supervisor is gone; stopping", POD.index)
        os.kill(os.getpid(), signal.SIGTERM)

    async def _reload_now(self) -> None:
        outcome = await self._reload()
        self.send(("reloaded", bool(outcome.applied), str(outcome.message)))
        self.send(("sync",))  # the new runtime's replicas take the pod's state

    async def close(self) -> None:
        POD.connected(None)
        if self._task is not None:
            self._task.cancel()
        if self._writer is not None:
            self._writer.close()
