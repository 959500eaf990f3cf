"""Where a route's chain ends: the call goes to the backend its target names.

The target, not the route: a fallback level or a reroute hands the call on with another
route's target, and the same terminal serves it. A backend that has not started yet answers
UNAVAILABLE with a Retry-After; a streamed call gets the backend's stream as its result; every
unary call's backend latency is observed, and added to the call's ``BACKEND_S`` (the backend's
own timing, ``BACKEND_TIMED_S``, where it keeps one off the event loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from proxy.backends.base import Backend
from proxy.call import BACKEND_S, BACKEND_TIMED_S, Call, LocalReply, Reply, Result
from proxy.clock import Clock
from proxy.errors import ErrorKind, ProxyError
from proxy.telemetry import Telemetry


class Terminal:
    def __init__(self, backends: Mapping[str, Backend], started: Mapping[str, asyncio.Event],
                 telemetry: Telemetry, clock: Clock) -> None:
        self.backends, self.started = backends, started
        self.telemetry, self.clock = telemetry, clock
        self._latency: dict[tuple[str, str], Any] = {}
        """(model, backend) → its latency histogram's child: ``labels()`` takes a lock and
        builds a key on every call."""

    async def __call__(self, call: Call) -> Reply:
        target = call.target
        assert target is not None
        backend = self.backends[target.backend]
        if not self.started[target.backend].is_set():
            return LocalReply(ErrorKind.UNAVAILABLE,
                              f"backend '{target.backend}' is still starting (model "
                              f"'{target.model}'); try again", retry_after_s=1.0)
        if call.streaming:
            return Result(target.model, stream=backend.stream(call, target))
        start = self.clock.monotonic()
        try:
            return await backend.infer(call, target)
        except ProxyError as err:
            return LocalReply.from_error(err)
        finally:
            took = self.clock.monotonic() - start
            # A backend that timed its own work off the loop (BACKEND_TIMED_S) says what the
            # model took; ``took`` also holds the loop's wait to resume this call.
            own = call.state.pop(BACKEND_TIMED_S)
            call.state[BACKEND_S] = (call.state.get(BACKEND_S) or 0.0) + \
                (took if own is None else min(own, took))
            child = self._latency.get((call.model, target.backend))
            if child is None:
                child = self._latency[(call.model, target.backend)] = \
                    self.telemetry.backend_latency.labels(call.model, target.backend)
            child.observe(took)
