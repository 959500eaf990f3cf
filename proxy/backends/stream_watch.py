"""A backend stream's silence, watched: until its first response for one time (the backend's
``timeout_s``), then between responses for another (``stream_idle_timeout_s``).

Guards against two failures of one whole-stream deadline: a long stream that keeps talking (a
decoupled model generating for minutes) cut at ``timeout_s`` in the middle of its answer, and a
stream that goes quiet (a hung model) holding its connection until that deadline. What Envoy
calls the stream idle timeout; the client's own deadline still bounds the whole stream.

The clock stops while a response is handed on: a client slow to take what came is not the
backend's silence. One timer per stream, moved on only when it fires (``loop.time()`` per
response, no timer per response).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class StreamWatch:
    """Calls ``stop`` once the stream has been silent too long (``expired`` says which limit:
    ``"first"`` or ``"idle"``). ``handing_on()`` when a response has come and is being handed
    on, ``reading()`` when the reader asks for the next one, ``close()`` when the stream ends."""

    __slots__ = ("_handle", "_limit", "_loop", "_since", "_started", "_stop", "_waiting",
                 "expired", "first", "idle")

    def __init__(self, first: float, idle: float, stop: Callable[[], object]) -> None:
        self._loop = asyncio.get_running_loop()
        self.first, self.idle = first, idle
        self._stop = stop
        self._limit = first
        self._since = self._loop.time()
        self._waiting = True
        self._started = False
        self.expired: str | None = None
        self._handle = self._loop.call_at(self._since + first, self._check)

    def handing_on(self) -> None:
        self._waiting = False
        if not self._started:  # the timer waits for the first limit: bring it to the idle one
            self._started = True
            self._limit = self.idle
            self._handle.cancel()
            self._handle = self._loop.call_at(self._loop.time() + self.idle, self._check)

    def reading(self) -> None:
        self._since = self._loop.time()
        self._waiting = True

    def close(self) -> None:
        self._handle.cancel()

    def _check(self) -> None:
        now = self._loop.time()
        due = self._since + self._limit
        if not self._waiting:  # a response is with the reader: check again a limit later
            due = max(due, now + self._limit)
        elif now >= due:
            self.expired = "idle" if self._started else "first"
            self._stop()
            return
        self._handle = self._loop.call_at(due, self._check)
