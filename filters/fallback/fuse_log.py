"""The version fuse's log line: both fingerprints in full, at WARNING the first time a route
shows a given wrong fingerprint and at DEBUG after that (a fused route refuses every call; a
WARNING per call would flood the log)."""

from __future__ import annotations

from typing import Any

_WARNED: set[tuple[str, str, str, str]] = set()
_WARNED_MAX = 1024


def log_mismatch(log: Any, model: str, level: str, expected: str, actual: str) -> None:
    """Both fingerprints, in full, on a log line (the JSON log adds the call's trace id): at
    WARNING the first time a route shows a given wrong fingerprint, at DEBUG after that (a
    fused route refuses every call; a WARNING per call would flood the log)."""
    key = (model, level, expected, actual)
    first = key not in _WARNED
    if first and len(_WARNED) < _WARNED_MAX:
        _WARNED.add(key)
    log.log(30 if first else 10,
            "version fuse on %r: route %r has fingerprint %s, expected %s; refused", model,
            level, actual or "?", expected,
            extra={"fields": {"model": model, "level": level, "expected_fingerprint": expected,
                              "actual_fingerprint": actual}})
