"""What the HTTP listener's fast lane writes on the wire, as aiohttp writes it: an answer's
status line and headers (``Date``, ``Server: mmguard``, the framing, ``Connection: close`` when
the connection ends with it), a body compressed as aiohttp compresses it, and a request's media
type as aiohttp's ``request.content_type`` reads it."""

from __future__ import annotations

import email.utils
import functools
import http
import time
import zlib

from aiohttp.helpers import parse_content_type

COMPRESS_INLINE_BYTES = 64 * 1024
"""An answer compressed on the event loop at most; a bigger one in a worker thread."""
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_REASONS = {s.value: s.phrase for s in http.HTTPStatus}


def answer_head(status: int, headers: dict[str, str], framing: str, close: bool) -> bytes:
    """The status line and headers; a header whose name or value holds a line break is left
    out (it would end the head early)."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}", framing,
             f"Date: {_date()}", "Server: mmguard"]
    lines += [f"{k}: {v}" for k, v in headers.items() if _safe(k) and _safe(v)]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


@functools.lru_cache(maxsize=64)
def mime(raw: str | None) -> str:
    """The media type as aiohttp's ``request.content_type`` reads it (its default too)."""
    return "application/octet-stream" if raw is None else parse_content_type(raw)[0]


def compress(body: bytes, coding: str) -> bytes:
    squeeze = zlib.compressobj(wbits=_WBITS[coding])
    return squeeze.compress(body) + squeeze.flush()


def _safe(text: str) -> bool:
    return "\r" not in text and "\n" not in text


_DATE: list[int | str] = [0, ""]


def _date() -> str:
    now = int(time.time())
    if _DATE[0] != now:
        _DATE[:] = [now, email.utils.formatdate(now, usegmt=True)]
    return str(_DATE[1])
