"""What a client cannot use to steer a canary verdict: a replay, or a failure it caused itself.

Seed scenario (issue 26): a canary wrong whenever ``input[0] > 0.5`` was aborted by honest
traffic; one client replaying one mirrored request 250 times with an easy input turned the
verdict to ``promote``. And a client sending ``mmguard-timeout-ms: 0.001`` made production answer
504 while the mirrored copy, under its own deadline, succeeded: two such calls aborted a good
canary.

Rules that MUST hold:

- **A request counts once.** The key is the request's *content* (the model, the inputs'
  names, datatypes, shapes and bytes, the outputs asked for; an OpenAI body less the fields
  that never change an answer), never an id the client chooses: ids are free, so keying on them
  would let one input be counted as often as the client renames it. JSON and binary encodings,
  HTTP and gRPC of one request are one key. The digest is keyed with the deployment's share
  secret, so no client can craft a collision that hides someone else's request.
- **Bounded memory.** ``RecentKeys`` remembers the last ``capacity`` keys (at least the verdict's
  window): a key judged longer ago than that has left the window whose evidence it was.
- **Load is not an answer.** A copy mmguard's own admission sheds on the canary's route
  (``limits``: 429 / RESOURCE_EXHAUSTED) is counted (``canary-overload``), never judged: a
  client flooding a canary route it can reach would otherwise abort a good release.
- **A failure the client caused is not the canary's.** When production fails because of the
  request itself (a deadline shorter than the copy's, a cancellation, its input refused, load
  shed) the copy would be judged against an answer the canary never had a fair chance to
  match, or that the client chose: such calls are not mirrored, and are counted by reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from typing import Any

from proxy.call import Call, LocalReply, Reply
from proxy.errors import ErrorKind

IGNORED_FIELDS = frozenset({"user", "metadata", "stream", "stream_options", "store",
                            "service_tier", "request_id", "priority"})
"""OpenAI body fields that never change an answer (ids, delivery, bookkeeping)."""

INPUT_REFUSALS = frozenset({ErrorKind.INVALID_ARGUMENT, ErrorKind.UNPROCESSABLE,
                            ErrorKind.TOO_LARGE, ErrorKind.NOT_FOUND,
                            ErrorKind.UNAUTHENTICATED, ErrorKind.PERMISSION_DENIED})
"""Production refused the request itself: what the client sent decided it."""

HASH_INLINE_BYTES = 64 * 1024
"""Requests whose tensors are bigger are hashed off the event loop."""

UNJUDGED_REASONS = ("replay", "deadline", "cancelled", "input-refused", "overload",
                    "canary-overload")
"""Why a call's copy was not judged (``mmguard_shadow_unjudged_total{reason}``)."""


def content_key(call: Call, secret: bytes) -> int:
    """A 64-bit keyed digest of what decides the answer to ``call`` (see the module)."""
    h = hashlib.blake2b(digest_size=8, key=hashlib.sha256(b"shadow-replay\0" + secret).digest())
    h.update(f"{call.model}\0{call.version}\0{call.endpoint}\0".encode())
    if call.document is not None:
        doc = {k: v for k, v in call.document.items() if k not in IGNORED_FIELDS}
        h.update(json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode())
    for t in call.inputs:
        h.update(f"\0{t.name}\0{t.datatype}\0{list(t.shape)}\0".encode())
        h.update(_payload(t.raw, t.data, t.to_raw))
    for out in call.outputs:
        h.update(f"\0out\0{out.name}\0{out.parameters.get('classification', '')}".encode())
    return int.from_bytes(h.digest(), "big")


async def content_key_of(call: Call, secret: bytes) -> int:
    """``content_key``, in a worker thread for a big request (hashing 600 KB takes ~1-7 ms,
    which would hold the event loop)."""
    size = max(call.nbytes, len(call.wire.body) if call.wire is not None else 0)
    if size > HASH_INLINE_BYTES:  # an OpenAI body's images are in its wire form
        return await asyncio.to_thread(content_key, call, secret)
    return content_key(call, secret)


def _payload(raw: Any, data: Any, to_raw: Any) -> Any:
    if raw is not None:
        return raw  # bytes or a memoryview over them: hashed without a copy
    try:  # a JSON tensor as its raw bytes: one key for both encodings
        return bytes(to_raw())
    except (ValueError, OverflowError, TypeError):
        return json.dumps(data, default=str).encode()


def client_caused(call: Call, primary: Reply, copy_timeout_s: float) -> str | None:
    """Why production's failure on ``call`` was the client's doing (a reason of
    ``UNJUDGED_REASONS``), or None: a success, or a failure that is evidence."""
    if not isinstance(primary, LocalReply) or primary.injected:
        return None  # injected faults are excluded where they are judged (``touched``)
    kind = primary.kind
    if kind is ErrorKind.DEADLINE_EXCEEDED:
        budget = None if call.deadline is None else call.deadline - call.started
        # A copy with more time than production had is no fair match for its timeout.
        return "deadline" if budget is not None and budget < copy_timeout_s else None
    if kind is ErrorKind.CANCELLED and not primary.dropped_by_backend:
        return "cancelled"  # the client left; a backend that cancels is failing: evidence
    if kind is ErrorKind.OVERLOADED:
        return "overload"
    if kind in INPUT_REFUSALS:
        return "input-refused"
    return None


def shed_here(canary: Reply) -> bool:
    """The copy was shed by mmguard's own admission on the canary's route (``limits``): that
    says how loaded the route is, which any caller of it decides (a client too, where the
    route is not internal), not how the canary answers. A backend's own overload is evidence."""
    return (isinstance(canary, LocalReply) and canary.kind is ErrorKind.OVERLOADED
            and canary.origin == "mmguard" and not canary.injected)


class RecentKeys:
    """The last ``capacity`` keys seen, oldest forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def add(self, key: int) -> bool:
        """Remember ``key``; False when it was already there (a replay)."""
        if key in self._keys:
            return False
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return True

    def clear(self) -> None:
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)
