"""Logs: JSON lines on stderr (with the current span's trace id), or plain text."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from opentelemetry import trace

from proxy.pod.state import POD, Role


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
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
        line = super().format(record)
        if POD.role is Role.WORKER:
            return f"[worker {POD.index}] {line}"
        if POD.role is Role.SUPERVISOR:
            return f"[supervisor] {line}"
        return line


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("mmguard")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


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
