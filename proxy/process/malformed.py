"""Malformed HTTP requests, answered and logged by mmguard itself.

Seed scenario (issue 26): a header line ending in a bare LF got 400 from aiohttp's parser, and
aiohttp's ``aiohttp.server`` logger wrote a traceback quoting the raw line: the admin token and
a client's ``Authorization`` header ended up in the log (500 such requests: +272 KB of log), and
the 400's body echoed the raw line back.

Rules that MUST hold, for every listener served by aiohttp (the v2 / OpenAI one, the admin one):

- A request aiohttp's parser refuses (``HttpProcessingError``: bad request line, bad header,
  bare LF, overlong line, Content-Length overflow, ...) gets a JSON 400 (or the parser's own 4xx)
  naming what was wrong in one line, never the client's bytes; it is counted in
  ``mmguard_listener_refusals_total{limit="malformed"}`` and logged at DEBUG in one bounded line
  with no raw bytes (a line per request at INFO would be a log flood on demand).
- A client that drops its connection while its body arrives (a slow client cut, an evicted
  connection) is one DEBUG line, not aiohttp's ERROR traceback per request (a log flood on
  demand).
- Anything else aiohttp would log (a bug of ours) goes to mmguard's own logger, whose lines are
  redacted (``proxy.telemetry.logs.redact``), never to Python's bare stderr printer.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("mmguard.http")

MAX_REASON_CHARS = 120


def reason(exc: HttpProcessingError) -> str:
    """What the parser found wrong, in words: the first line of its message (the lines after it
    quote the client's bytes), printable and bounded."""
    first = (exc.message or "").strip().splitlines()[0:1]
    text = first[0] if first else type(exc).__name__
    text = re.split(r"""\s*b['"]|\s+when reading""", text)[0].rstrip(":. ").strip()
    text = "".join(c if c.isprintable() and c.isascii() else "?" for c in text)
    return text[:MAX_REASON_CHARS] or type(exc).__name__


def handler_class(listener: str, refused: Any) -> type[RequestHandler]:
    """A ``RequestHandler`` whose parser errors are answered and logged as above."""

    class MalformedSafe(RequestHandler):
        __slots__ = ()

        def handle_error(self, request: Any, status: int = 500,
                         exc: BaseException | None = None,
                         message: str | None = None) -> web.StreamResponse:
            if isinstance(exc, ConnectionError):  # the client left while its body came in
                log.debug("client connection lost during a request on listener %r: %s",
                          listener, type(exc).__name__)
                if request.writer.output_size > 0:
                    raise ConnectionError("the client's connection is gone")
                gone = web.Response(status=400)  # never reaches anyone: the connection is gone
                gone.force_close()
                return gone
            if not isinstance(exc, HttpProcessingError):
                return super().handle_error(request, status, exc, message)
            why = reason(exc)
            code = exc.code if 400 <= exc.code < 500 else 400
            refused.labels(listener, "malformed").inc()
            log.debug("malformed HTTP request refused on listener %r: %d %s", listener, code,
                      why, extra={"fields": {"listener": listener, "status": code,
                                             "reason": why}})
            if request.writer.output_size > 0:
                raise ConnectionError("an answer was already sent; closing the connection")
            body = json.dumps({"error": f"malformed HTTP request: {why}"})
            resp = web.Response(status=code, text=body, content_type="application/json",
                                headers={"mmguard-error-origin": "proxy"})
            resp.force_close()
            return resp

    MalformedSafe.__name__ = MalformedSafe.__qualname__ = f"MalformedSafe_{listener}"
    return MalformedSafe


def adopt(handler: RequestHandler, cls: type[RequestHandler]) -> RequestHandler:
    """``handler`` (made by aiohttp's ``Server``, with the runner's settings) as ``cls``: the
    same object and slots, with ``handle_error`` replaced. aiohttp has no public hook for its
    parser errors' answer; a subclass with no slots of its own shares the layout."""
    handler.__class__ = cls
    return handler
