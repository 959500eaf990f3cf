"""A mirrored copy of a request: what the shadow's lanes carry, how a copy is made from the
call (a snapshot the inner filters cannot edit, a fresh canary call under its own deadline) and
how an answer is read for the comparison (status code, streamed text, arrays)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray
from opentelemetry.trace import SpanContext

from proxy.call import CANARY, Call, Reply, Result, SseEvent, document_copy
from proxy.chain import Next
from proxy.keys import Store


@dataclass
class Copy:
    call: Call
    primary: Reply
    primary_latency_s: float
    primary_text: str | None  # streams: the assembled text
    noise: bool
    resend: Next
    primary_faults: tuple[str, ...] = ()  # faults on production's answer: that copy is not judged
    cause: SpanContext | None = None  # the request's span: the copy's trace links to it
    primary_backend_s: float | None = None  # production's time in its backend (BACKEND_S)
    held: int = 0  # the bytes it keeps alive while it waits (``held_bytes``), once queued

    def held_bytes(self) -> int:
        """What the copy keeps alive until it is compared: its request's inputs (or OpenAI
        document) and production's answer (its outputs, or its body)."""
        size = sum(t.nbytes for t in self.call.inputs)
        if self.call.document is not None and self.call.wire is not None:
            size += len(self.call.wire.body)
        if isinstance(self.primary, Result):
            size += (len(self.primary.wire.body) if self.primary.wire is not None
                     else sum(t.nbytes for t in self.primary.outputs))
        return size


class HeldBytes:
    """The bytes the copies not yet compared keep alive, together (``queue_max_bytes``): taken
    when a copy is queued, freed when its comparison task is done, however it ends."""

    def __init__(self) -> None:
        self.total = 0

    def take(self, size: int, limit: int) -> bool:
        if self.total + size > limit:
            return False
        self.total += size
        return True

    def freer(self, size: int) -> Callable[[object], None]:
        def free(_: object) -> None:
            self.total -= size
        return free


@dataclass
class Sent:
    """A copy's answer from the canary (or production again, for the noise floor)."""
    reply: Reply
    latency_s: float  # its whole path: the route's chain, the terminal, the backend
    text: str | None  # streams: the assembled text
    faults: list[str]
    backend_s: float | None  # its time in the backend (BACKEND_S); None for a stream


def paired_latency(item: Copy, sent: Sent) -> tuple[float, float]:
    """Production's and the canary's latency for one pair, measured alike on both sides.

    The backends' own time where both sides have it (every unary call): the question is
    whether the canary's model is slower, and the copy's path to it (a lane that waits for a
    free worker, the canary route's filters, an event loop busy with production's next
    request) is mmguard's, not the model's. Measured on a busy 2-core machine, that path added
    as much noise as a 30 % regression of a 3 ms model. A stream has no backend time at the
    terminal (its body arrives later): then both sides' whole paths."""
    if item.primary_backend_s is not None and sent.backend_s is not None:
        return item.primary_backend_s, sent.backend_s
    return item.primary_latency_s, sent.latency_s



def freeing(leave: Callable[[], None]) -> Callable[[asyncio.Task[None]], None]:
    return lambda _task: leave()


def snapshot(call: Call) -> Call:
    """The request as it is now, safe from the edits inner filters make to the call."""
    return replace(call, inputs=list(call.inputs), headers=dict(call.headers),
                   document=document_copy(call.document) if call.document else None,
                   outputs=list(call.outputs), parameters=dict(call.parameters),
                   state=Store(), decisions={},
                   target=replace(call.target) if call.target is not None else None)


def fresh(call: Call, timeout_s: float) -> Call:
    out = replace(call, inputs=list(call.inputs), headers=dict(call.headers),
                  document=document_copy(call.document) if call.document else None,
                  state=Store(), decisions={}, started=time.monotonic(),
                  deadline=time.monotonic() + timeout_s)
    out.state[CANARY] = True  # a mirrored copy is canary traffic
    return out


def code(reply: Reply) -> str:
    return "ok" if isinstance(reply, Result) else reply.kind.value


def stream_text(event: SseEvent) -> list[str]:
    doc = event.json()
    if doc is None:
        return []
    out = []
    for choice in doc.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(text, str):
            out.append(text)
    return out


def arrays(reply: Result) -> dict[str, NDArray[Any]]:
    return {t.name: np.asarray(t.numpy()) for t in reply.outputs}
