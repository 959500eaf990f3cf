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

from proxy.pod.state import POD, Role

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
        if POD.role is not Role.SINGLE:  # which process of the pod said it
            out["worker"] = POD.index if POD.role is Role.WORKER else "supervisor"
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


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message``, with ``[worker N]`` in a pod's worker."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = redact(super().format(record))
        if POD.role is Role.WORKER:
            return f"[worker {POD.index}] {line}"
        if POD.role is Role.SUPERVISOR:
            return f"[supervisor] {line}"
        return line


class _WriteAfterLeaving(logging.Filter):
    """grpc.aio logs a streaming answer written after its client left (cancelled, past its
    deadline) at ERROR, with a traceback: ``ExecuteBatchError raised in core by servicer
    method``. That is the client's leaving, which the call's count already says (``cancelled``
    / ``deadline_exceeded``); at ERROR any client could write a line per stream it abandons.
    DEBUG here."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("ExecuteBatchError raised in core"):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info = record.exc_text = None
            return logging.getLogger("mmguard").isEnabledFor(logging.DEBUG)
        return True


_WRITE_AFTER_LEAVING = _WriteAfterLeaving()


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("mmguard")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    for name in LIBRARY_LOGGERS:  # their warnings and errors, redacted, in mmguard's format
        lib = logging.getLogger(name)
        lib.handlers[:] = [handler]
        lib.setLevel(max(logging.WARNING, root.level))
        lib.propagate = False
    logging.getLogger("grpc._cython.cygrpc").addFilter(_WRITE_AFTER_LEAVING)  # once: a set


REPEAT_SUMMARY_S = 60.0
"""How often a failure that keeps repeating is logged again (as one summary line)."""


class RepeatedFailure:
    """A failure that repeats on every retry (a backend down, a contract not available): the
    first at WARNING, then one WARNING summary per ``interval_s`` while it lasts (attempts and
    the last error), and one INFO line when it ends. A dead backend retried every 5 s writes a
    line a minute, not twelve. Time is passed in (a ``Clock``'s monotonic seconds)."""

    def __init__(self, logger: logging.Logger, what: str, fields: dict[str, Any],
                 interval_s: float = REPEAT_SUMMARY_S) -> None:
        self.logger, self.what, self.fields, self.interval_s = logger, what, fields, interval_s
        self.since: float | None = None
        self.reported = 0.0
        self.attempts = 0
        self.unreported = 0

    def failed(self, now: float, detail: str) -> None:
        self.attempts += 1
        if self.since is None:
            self.since, self.reported, self.attempts, self.unreported = now, now, 1, 0
            self.logger.warning("%s: %s", self.what, detail,
                                extra={"fields": {**self.fields, "attempts": 1}})
            return
        self.unreported += 1
        if now - self.reported < self.interval_s:
            return
        self.logger.warning(
            "%s: still failing after %.0fs (%d attempts, %d since the last line): %s",
            self.what, now - self.since, self.attempts, self.unreported, detail,
            extra={"fields": {**self.fields, "attempts": self.attempts,
                              "failing_s": round(now - self.since, 1)}})
        self.reported, self.unreported = now, 0

    def recovered(self, now: float) -> None:
        if self.since is None:
            return
        self.logger.info("%s: recovered after %.0fs (%d failed attempts)", self.what,
                         now - self.since, self.attempts,
                         extra={"fields": {**self.fields, "attempts": self.attempts}})
        self.since = None
