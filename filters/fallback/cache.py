"""The fallback's answer cache (level 3): the last good answer per request key, least recently
used first out, bounded in answers, in bytes and in age.

Guards against the cache itself becoming the outage: it keeps every good answer of its route,
so distinct requests with large answers (an image model's 600 KB output, a segmentation mask)
would hold ``size`` of them, 600 MB for 1000 such answers, past a sidecar's memory limit. The
bytes an entry holds are the bytes it keeps alive (an answer kept as a view into the body it
came in pins that whole body), at most ``max_bytes`` for the route's cache together; an answer
over ``max_entry_bytes`` is not kept at all (and not copied).

An entry may be kept under its request's :class:`~filters.fallback.cache_key.KeyParts`, not yet
digested: the MAC over the request's bytes is then run only when the cache is read (a level
failed, or quality's graded action asks for the last good answer), once per entry, and never for
an entry that leaves unread. Until then the entry also keeps its request's bytes alive, and they
are counted with its answer's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pydantic import Field, model_validator

from filters.fallback.cache_key import KeyParts
from proxy.call import Api, Result, Wire
from proxy.strict import Strict
from proxy.tensor import Payload, Tensor

MiB = 1024 * 1024


class CacheConfig(Strict):
    size: int = Field(1000, ge=1)
    """Answers kept at most."""
    max_bytes: int = Field(64 * MiB, ge=1)
    """The bytes they keep alive, all together (each route's cache its own)."""
    max_entry_bytes: int = Field(4 * MiB, ge=1)
    """A larger answer is not kept (``mmguard_answer_cache_skipped_total``)."""
    ttl_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _entry_fits(self) -> CacheConfig:
        if self.max_entry_bytes > self.max_bytes:
            raise ValueError(f"max_entry_bytes ({self.max_entry_bytes}) is over max_bytes "
                             f"({self.max_bytes}): no answer that size could be kept")
        return self


class AnswerCache:
    """Last good answers by request key: LRU, bounded, with a TTL on the clock."""

    def __init__(self, cfg: CacheConfig, now: Callable[[], float]) -> None:
        self.cfg = cfg
        self.now = now
        self._items: OrderedDict[str | KeyParts, _Entry] = OrderedDict()
        self.bytes = 0
        """What the entries keep alive, together."""
        self.undigested = 0
        """Entries kept under a key not yet digested."""
        self.undigested_bytes = 0
        """The bytes of their requests: what the MACs of the next read will run over."""

    def put(self, key: str | KeyParts, result: Result) -> int | None:
        """Keep ``result`` under ``key``; the bytes it holds, or None when its answer is over
        ``max_entry_bytes`` (not kept). A key not yet digested stays so while the entry and its
        request together are within ``max_entry_bytes``."""
        frozen = _frozen(result, self.cfg.max_entry_bytes)
        if frozen is None:
            return None
        answer, size = frozen
        request = 0
        if isinstance(key, KeyParts):
            if not key.digested:
                request = _held(key.payloads) + sum(
                    len(s) for s in key.segments if type(s) is bytes)
            if key.digested or size + request > self.cfg.max_entry_bytes:
                key, request = key.digest(), 0
            else:
                self.undigested += 1
                self.undigested_bytes += request
        if isinstance(key, str):
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old.size
        self._items[key] = _Entry(self.now(), answer, size + request, request)
        self.bytes += size + request
        while len(self._items) > self.cfg.size or self.bytes > self.cfg.max_bytes:
            gone_key, gone = self._items.popitem(last=False)
            self.bytes -= gone.size
            if isinstance(gone_key, KeyParts):
                self.undigested -= 1
                self.undigested_bytes -= gone.request
        return size + request

    def get(self, key: str | KeyParts) -> tuple[float, Result] | None:
        """The entry (when it was kept, the answer), now the most recently used (a hit keeps it
        from eviction); an expired entry is dropped on sight."""
        digest = key if isinstance(key, str) else key.digest()
        if self.undigested:
            self._digest_all()
        found = self._items.get(digest)
        if found is None:
            return None
        if self.now() - found.at > self.cfg.ttl_s:
            del self._items[digest]
            self.bytes -= found.size
            return None
        self._items.move_to_end(digest)
        return found.at, found.answer

    def _digest_all(self) -> None:
        """Key every entry by its digest, in the order they were used; an expired one is
        dropped unhashed, and of two entries for one request the later is kept. Their requests'
        bytes are let go."""
        now = self.now()
        items: OrderedDict[str | KeyParts, _Entry] = OrderedDict()
        for key, entry in self._items.items():
            if isinstance(key, KeyParts):
                if now - entry.at > self.cfg.ttl_s:
                    continue
                key = key.digest()
                entry = _Entry(entry.at, entry.answer, entry.size - entry.request, 0)
            items.pop(key, None)
            items[key] = entry
        self._items = items
        self.bytes = sum(e.size for e in items.values())
        self.undigested = self.undigested_bytes = 0

    def undigested_keys(self) -> list[KeyParts]:
        """The keys not yet digested (to digest them away from the event loop first)."""
        return [k for k in self._items if isinstance(k, KeyParts)]

    def __len__(self) -> int:
        return len(self._items)


class _Entry(NamedTuple):
    at: float
    answer: Result
    size: int
    """The bytes it keeps alive: its answer's, and its request's while its key is not
    digested."""
    request: int


def _frozen(result: Result, limit: int) -> tuple[Result, int] | None:
    """A copy that owns its bytes (the original may point into a request buffer) and the bytes
    it keeps alive; None, before any copy, when those would be over ``limit``."""
    if result.wire is not None and result.wire.api is Api.OPENAI:
        size = len(result.wire.body)
        if size > limit:
            return None
        return Result(result.model, wire=Wire("openai", bytes(result.wire.body))), size
    raws = [t.raw_bytes() for t in result.outputs]
    size = _held(raws)
    if size > limit:
        return None
    return Result(result.model, result.version, result.id,
                  [Tensor(t.name, t.datatype, t.shape, raw=_immutable(raw))
                   for t, raw in zip(result.outputs, raws, strict=True)],
                  parameters=dict(result.parameters)), size


def _pinned(raw: Payload) -> bytes | None:
    """The ``bytes`` object ``raw`` is a view into (a decoded gRPC or HTTP answer's body), or
    None: such a view cannot change under the cache, so it is kept as it is, pinning that
    body."""
    if isinstance(raw, memoryview) and type(raw.obj) is bytes:
        body: bytes = raw.obj
        return body
    return None


def _immutable(raw: Payload) -> bytes | memoryview:
    """``raw``, or a copy of it where it could change under the cache. A view into a ``bytes``
    object is kept (it saves copying every answer, ~600 KB for an image-sized output, on every
    call); a view into anything else (a shared-memory region, a reused buffer) is copied."""
    if isinstance(raw, bytes) or (isinstance(raw, memoryview) and _pinned(raw) is not None):
        return raw
    return bytes(raw)


def _held(raws: Sequence[Payload]) -> int:
    """The bytes the answer's tensors keep alive once kept: the whole body each view pins
    (once per body), the payload of the others."""
    bodies: dict[int, int] = {}
    own = 0
    for raw in raws:
        body = _pinned(raw)
        if body is not None:
            bodies[id(body)] = len(body)
        else:
            own += memoryview(raw).nbytes
    return own + sum(bodies.values())
