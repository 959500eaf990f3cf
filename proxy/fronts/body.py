"""Reading an HTTP request body exactly once, bounded, with its ``Content-Encoding`` undone.

The HTTP listener runs aiohttp with ``auto_decompress`` off, so the bytes read here are the
bytes the client sent and each body is inflated once, here (inflating what aiohttp had already
inflated was the bug: every gzip body got 400 "not a gzipped file").

What MUST hold:
- Never more than ``limit`` bytes of body in memory: the raw body is read chunk by chunk and
  refused (413) as soon as it passes the limit; a compressed body is inflated in bounded steps
  (``max_length``) and refused as soon as its output passes the limit — a 1 KiB gzip bomb costs
  at most ``limit`` bytes and a few milliseconds, never the gigabytes it would inflate to.
- Large inflations do not hold the event loop: the first ``INLINE_INFLATE_BYTES`` of output are
  made on the loop (a small body never pays for a thread hop); the rest in a worker thread
  (zlib releases the GIL while it works).
- A JSON body is parsed on the loop only when small (``INLINE_JSON_BYTES``); a bigger one in a
  worker thread, whatever endpoint it came to (a 57 MiB body posted to a shared-memory register
  endpoint was parsed on the loop before the 501: a 1.48 s stall; that endpoint now reads at
  most 64 KiB, and only from a client allowed to register).
- A body that is not valid for its encoding is a 400 that says so (Triton 2.51 answers a
  corrupt gzip body with 200 and empty tensors); an encoding we do not speak is a 501, as
  Triton's; the 413 messages name the setting that sets the limit.

And what bounds a request's time over HTTP, read alike by every HTTP front (KServe v2 and
OpenAI: the OpenAI front ignored it, and answered 200 long after the client's deadline):
``mmguard-timeout-ms`` (``header_deadline``).
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from proxy.errors import ErrorKind, ProxyError
from proxy.wire.numbers import json_loads

TIMEOUT_HEADER = "mmguard-timeout-ms"


def header_deadline(headers: Mapping[str, str]) -> float | None:
    """The deadline (``time.monotonic()``) a request's ``mmguard-timeout-ms`` sets (lower-cased
    ``headers``), None without it; a value that is not a positive number of milliseconds is
    the client's mistake (400)."""
    value = headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = -1
    if not math.isfinite(ms) or ms <= 0:  # nan compares false both ways; inf never expires
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"{TIMEOUT_HEADER} must be a positive number of milliseconds, got "
                         f"{value!r}")
    return time.monotonic() + ms / 1000


INLINE_INFLATE_BYTES = 1024 * 1024
"""Output inflated on the event loop before the rest moves to a worker thread."""
_STEP = 256 * 1024
"""Inflated per zlib call: the most one step can overshoot the limit by."""
_ENCODINGS = ("gzip", "deflate", "identity")
INLINE_JSON_BYTES = 64 * 1024
"""JSON parsed on the event loop at most; bigger bodies are parsed in a worker thread."""


def _too_large(what: str, limit: int, setting: str) -> ProxyError:
    return ProxyError(ErrorKind.TOO_LARGE,
                      f"{what}; this listener accepts at most {limit} bytes ({setting})")


def content_encoding(headers: Mapping[str, str], exact: bool = False) -> str:
    """The body's encoding; 501 (in Triton's words) for one we do not decode, or a stack of
    them. ``exact``: the name as Triton's HTTP front matches it, case and all (``GZIP`` is
    not one of its codings); else read case-insensitively (the OpenAI front, as aiohttp)."""
    given = (headers.get("Content-Encoding") or "identity").strip()
    encoding = given if exact else given.lower()
    if encoding not in _ENCODINGS:
        raise ProxyError(ErrorKind.UNIMPLEMENTED,
                         f"Unsupported compression type: Content-Encoding {given!r}; this "
                         f"endpoint accepts gzip, deflate or identity")
    return encoding


@dataclass(frozen=True, slots=True)
class BodyBounds:
    """What a body may be, known from the headers alone: checked before a byte of it is read."""

    limit: int
    setting: str
    encoding: str


def body_bounds(headers: Mapping[str, str], declared: int | None, limit: int,
                setting: str = "listeners.http.max_request_bytes",
                exact_coding: bool = False) -> BodyBounds:
    """The body's bounds from its headers; ``ProxyError`` (501, 413) when they already refuse
    it: an encoding we do not decode, a declared length over ``limit``. ``exact_coding``: as
    ``content_encoding``'s ``exact`` (the KServe v2 front)."""
    encoding = content_encoding(headers, exact_coding)
    if declared is not None and declared > limit:
        raise _too_large(f"request body is {declared} bytes", limit, setting)
    return BodyBounds(limit, setting, encoding)


async def decoded(raw: bytes, bounds: BodyBounds) -> bytes:
    """A body as it came, undone from its ``Content-Encoding`` within its bounds."""
    if bounds.encoding == "identity":
        return raw
    return await inflate(raw, bounds.encoding, bounds.limit, bounds.setting)


async def read_body(request: web.Request, limit: int,
                    setting: str = "listeners.http.max_request_bytes") -> bytes:
    """The request's body, decoded from its ``Content-Encoding``, at most ``limit`` bytes
    (raises ``ProxyError`` TOO_LARGE naming ``setting``, or INVALID_ARGUMENT)."""
    bounds = body_bounds(request.headers, request.content_length, limit, setting)
    return await decoded(await read_raw(request, limit, setting), bounds)


async def read_raw(request: web.Request, limit: int, setting: str) -> bytes:
    if request.content.is_eof():  # all in already (a small body): no iterator to step through
        data = request.content.read_nowait()
        if len(data) > limit:
            raise _too_large(f"request body is over {limit} bytes", limit, setting)
        return data
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(_STEP):
        size += len(chunk)
        if size > limit:  # a chunked body declares no length: stop at the limit, not the end
            raise _too_large(f"request body is over {limit} bytes", limit, setting)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def inflate(raw: bytes, encoding: str, limit: int, setting: str) -> bytes:
    """``raw`` inflated (gzip, or deflate as zlib or raw deflate, as aiohttp and browsers
    accept), at most ``limit`` bytes out; the bulk of a large one in a worker thread."""
    # RFC 1950: a zlib stream's first byte has compression method 8 in its low nibble; some
    # clients send raw deflate under "deflate" anyway.
    if encoding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    else:
        wbits = zlib.MAX_WBITS if raw[:1] and raw[0] & 0x0F == 8 else -zlib.MAX_WBITS
    state = _Inflation(zlib.decompressobj(wbits), raw, encoding, limit, setting)
    state.run(INLINE_INFLATE_BYTES)
    if not state.done:
        await asyncio.to_thread(state.run, limit + 1)
    return state.result()


class _Inflation:
    """One body's inflation, resumable: ``run`` stops after ``budget`` bytes of output."""

    def __init__(self, d: zlib._Decompress, raw: bytes, encoding: str, limit: int,
                 setting: str) -> None:
        self.d = d
        self.pending = raw
        self.encoding = encoding
        self.limit = limit
        self.setting = setting
        self.out = bytearray()
        self.done = not raw

    def run(self, budget: int) -> None:
        made = 0
        try:
            while not self.done and made < budget:
                piece = self.d.decompress(self.pending, _STEP)
                self.pending = self.d.unconsumed_tail
                self.out += piece
                made += len(piece)
                if len(self.out) > self.limit:
                    raise _too_large(f"the {self.encoding} request body inflates past "
                                     f"{self.limit} bytes", self.limit, self.setting)
                if self.d.eof:
                    self.done = True
                elif not piece and not self.pending:
                    raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                                     f"request body is not valid {self.encoding}: it ends "
                                     f"before the compressed stream does")
        except zlib.error as exc:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"request body is not valid {self.encoding}: {exc}") from None

    def result(self) -> bytes:
        out = bytes(self.out)
        self.out = bytearray()  # the copy above is the one kept
        return out


async def read_json(request: web.Request, limit: int, setting: str) -> Any:
    """The body (bounded and inflated as ``read_body``) parsed as JSON, off the loop when
    large; an empty body is ``{}``. 400 naming the parse error."""
    body = await read_body(request, limit, setting)
    if not body.strip():
        return {}
    return await parse_json(body)


async def parse_json(body: bytes) -> Any:
    """``json.loads`` on the loop for a small body, in a worker thread for a big one; 400
    naming the parse error. A KServe v2 body: a repeated key keeps its first value, as Triton
    reads it (``proxy.wire.numbers``)."""
    try:
        if len(body) > INLINE_JSON_BYTES:
            return await asyncio.to_thread(json_loads, body, True)
        return json_loads(body, first_wins=True)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"failed to parse the request JSON buffer: {exc}") from None
    except RecursionError:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         "the JSON in the request body is nested too deeply") from None
