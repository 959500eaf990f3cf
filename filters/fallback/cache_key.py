"""The answer cache's key: a keyed BLAKE3 MAC over everything that decides the answer.

Guards against one client being served another's cached answer. The key covers the model, its
version, the request's parameters, every input (name, datatype, shape, parameters and every
payload byte) and the requested outputs; an OpenAI call, its document (less the fields that only
shape the transport: ``stream``, ``stream_options``, ``user``). Every field is length-prefixed,
so no two different requests encode to the same bytes.

The MAC key is a per-process secret drawn at import and never leaves the process: a client that
knows the scheme still cannot compute another request's key, let alone aim a crafted request at
another client's entry. BLAKE3 because it is the price of the L3 cache: over a 602 KB tensor it
takes ~0.10–0.14 ms against SHA-256's ~0.5 ms (one thread, ``bench/chain_profile.py``).

Even so the MAC was the largest part of the full chain's cost through the transport (~0.29 ms of
a 602 KB request that is no longer in the core's cache), paid on every call for an answer served
only when every level fails. So a call's key is taken apart (:func:`key_parts`: the small fields
encoded, the payloads referenced as they lie) and the MAC over them is run only when the cache
needs the digest (:meth:`KeyParts.digest`): when it is looked up, or when what it holds must be
keyed (``filters/fallback/cache.py``). A payload that could change under the cache (a view into
a shared-memory region or a reused buffer) is hashed at once, as before.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from typing import Any

from blake3 import blake3

from proxy.call import Call

_SECRET = os.urandom(32)
"""This process's MAC key: answers are cached per process, so nothing else ever needs it."""

_LENGTH = struct.Struct("<Q")


class KeyParts:
    """What decides a call's answer, ready to be MACed: ``segments`` in order (the encoded small
    fields and each payload as it lies), and the ``payloads`` among them; :meth:`digest` runs
    the MAC once. Compared by identity (a cache holds it as a key until it is digested)."""

    __slots__ = ("_digest", "_secret", "payloads", "segments")

    def __init__(self, segments: list[bytes | memoryview], payloads: list[memoryview],
                 secret: bytes) -> None:
        self.segments = segments
        self.payloads = payloads
        self._secret = secret
        self._digest: str | None = None

    @property
    def digested(self) -> bool:
        return self._digest is not None

    def digest(self) -> str:
        """The keyed digest (hex); computed on the first call, and the payloads let go. Safe
        from two threads at once (the fallback keys a large read in a worker thread): the
        digest is set before the segments are let go, and a run that found them gone keeps
        the digest already set."""
        if self._digest is None:
            segments = self.segments
            h = blake3(key=self._secret)
            for segment in segments:
                h.update(segment)
            digest = h.hexdigest()
            if self._digest is None:
                self._digest = digest
                self.segments = []
                self.payloads = []
        assert self._digest is not None
        return self._digest


def cache_key(call: Call, secret: bytes = _SECRET) -> str:
    """The keyed digest (hex) of everything in ``call`` that decides its answer."""
    return key_parts(call, secret).digest()


def key_parts(call: Call, secret: bytes = _SECRET) -> KeyParts:
    """``call``'s key, not yet MACed; digested at once when a payload could change later."""
    # The small fields go into one buffer between payloads: one MAC update per input instead of
    # one per field (each update has a fixed cost of ~1-2 µs).
    head = bytearray()
    segments: list[bytes | memoryview] = []
    payloads: list[memoryview] = []

    def field(data: bytes) -> None:
        head.extend(_LENGTH.pack(len(data)))
        head.extend(data)

    field(call.model.encode())
    field(call.version.encode())
    if call.document is not None:  # an OpenAI call: its document says it all
        field(b"openai")
        doc = {k: v for k, v in call.document.items()
               if k not in ("stream", "stream_options", "user")}
        field(_canonical(doc))
        return KeyParts([bytes(head)], [], secret)
    field(b"kserve_v2")
    field(_canonical(call.parameters) if call.parameters else b"{}")
    field(_canonical([[o.name, o.parameters] for o in call.outputs]) if call.outputs else b"[]")
    head.extend(_LENGTH.pack(len(call.inputs)))
    stable = True
    for t in call.inputs:
        raw = memoryview(t.raw_bytes()).cast("B")  # its length in bytes, whatever the view
        field(_canonical([t.name, t.datatype, list(t.shape), t.parameters]) if t.parameters
              else _bare_spec(t.name, t.datatype, tuple(t.shape)))
        head.extend(_LENGTH.pack(len(raw)))
        segments.append(bytes(head))
        segments.append(raw)
        payloads.append(raw)
        stable = stable and raw.readonly and type(raw.obj) is bytes
        head.clear()
    segments.append(bytes(head))
    parts = KeyParts(segments, payloads, secret)
    if not stable:
        parts.digest()  # a shared-memory region or a reused buffer: hashed as it is now
    return parts


@functools.lru_cache(maxsize=256)
def _bare_spec(name: str, datatype: str, shape: tuple[int, ...]) -> bytes:
    """An input without parameters, as ``_canonical`` encodes it: the same few tensor specs
    arrive on every call of a route, so each is encoded once, not per call."""
    return _canonical([name, datatype, list(shape), {}])


def _canonical(value: Any) -> bytes:
    """One encoding per value: sorted keys, no whitespace; what JSON cannot say, by its repr."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr).encode()
