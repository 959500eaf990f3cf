"""A failure that repeats on every retry logs once at WARNING, then one summary per interval,
then once when it ends (no line per retry, no INFO line every 5 s forever)."""

from __future__ import annotations

import logging

import pytest

from proxy.telemetry import RepeatedFailure


def test_first_at_warning_then_one_summary_per_interval_then_recovery(
        caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("mmguard.test.repeat")
    down = RepeatedFailure(log, "backend 'b' failed to start", {"backend": "b"}, interval_s=60)
    with caplog.at_level(logging.DEBUG, logger="mmguard.test.repeat"):
        for t in range(0, 180, 5):  # a retry every 5 s for 3 minutes: 36 failures
            down.failed(float(t), "connection refused")
        down.recovered(181.0)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [lvl for lvl, _ in lines] == ["WARNING", "WARNING", "WARNING", "INFO"]
    assert lines[0][1] == "backend 'b' failed to start: connection refused"
    assert "still failing after 60s (13 attempts, 12 since the last line)" in lines[1][1]
    assert "still failing after 120s (25 attempts, 12 since the last line)" in lines[2][1]
    assert lines[3][1] == "backend 'b' failed to start: recovered after 181s (36 failed attempts)"
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="mmguard.test.repeat"):
        down.recovered(200.0)  # nothing was failing: nothing to say
        down.failed(300.0, "refused again")  # a new outage: its first line is a WARNING again
    assert [r.levelname for r in caplog.records] == ["WARNING"]
