"""Logs: JSON lines on stderr (with the current span's trace id), or plain text.

Rules that MUST hold: a log line never holds a secret. Every line mmguard writes — its own and
the libraries' it carries (aiohttp, asyncio, grpc: their records go through the same handler,
never Python's bare last-resort printer) — passes ``redact``: every secret the config named
(``register_secret``: the admin token, the canary secret) and the value of every credential
header (``Authorization``, ``Proxy-Authorization``, ``Cookie``, API-key headers, a ``Bearer`` or
``Basic`` credential anywhere) and a URL's user information are replaced by ``<redacted>``,
and each line is bounded (``MAX_LINE_CHARS``). Malformed client requests are logged by mmguard
itself, in one line, without the raw bytes (``proxy.process.malformed``).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

from opentelemetry import trace

MAX_LINE_CHARS = 16_384
"""The longest log line (a traceback included); longer lines are cut and say so."""

LIBRARY_LOGGERS = ("aiohttp", "asyncio", "grpc")
"""Loggers of libraries that see client input: written through mmguard's handler."""

_SECRETS: set[str] = set()
_CREDENTIAL_HEADER = re.compile(
    r"(?i)\b((?:proxy-)?authorization|cookie|set-cookie|x-api-key|api-key|x-auth-token"
    r"|x-admin-token)(['\"]?\s*[:=,]\s*['\"]?)[^\r\n'\",}]*")
_CREDENTIAL = re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]+")
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"]+@")


def register_secret(value: str) -> None:
    """A secret read from the config: never written to the log (also as JSON escapes it)."""
    if len(value) >= 4:  # a shorter one would redact ordinary words
        _SECRETS.add(value)
        _SECRETS.add(json.dumps(value)[1:-1])


def redact(text: str) -> str:
    """``text`` with every registered secret and every credential header's value replaced,
    then bounded to ``MAX_LINE_CHARS``."""
    for secret in _SECRETS:
        if secret in text:
            text = text.replace(secret, "<redacted>")
    text = _CREDENTIAL_HEADER.sub(r"\1\2<redacted>", text)
    text = _CREDENTIAL.sub(r"\1\2<redacted>", text)
    text = _URL_USERINFO.sub(r"\1<redacted>@", text)  # http://user:password@host
    if len(text) > MAX_LINE_CHARS:
        text = text[:MAX_LINE_CHARS] + f" ... [cut: {len(text) - MAX_LINE_CHARS} characters]"
    return text


class _Redacting(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(self._line(record))

    def _line(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            out["trace_id"] = format(span.trace_id, "032x")
            out["span_id"] = format(span.span_id, "016x")
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         _Redacting("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("mmguard")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    for name in LIBRARY_LOGGERS:  # their warnings and errors, redacted, in mmguard's format
        lib = logging.getLogger(name)
        lib.handlers[:] = [handler]
        lib.setLevel(max(logging.WARNING, root.level))
        lib.propagate = False
