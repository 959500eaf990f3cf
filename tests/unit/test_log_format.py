"""Every log line of a pod's process says which process wrote it: ``worker`` N or the
``supervisor`` (JSON and text); a single process's lines stay as they were."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from proxy.pod.state import POD, Role
from proxy.telemetry.logs import JsonFormatter, TextFormatter


@pytest.fixture
def role() -> Iterator[None]:
    was = (POD.role, POD.index)
    yield
    POD.role, POD.index = was


def _record() -> logging.LogRecord:
    return logging.LogRecord("mmguard.x", logging.INFO, __file__, 1, "hello", None, None)


@pytest.mark.usefixtures("role")
def test_worker_and_supervisor_lines_carry_their_process() -> None:
    POD.role, POD.index = Role.WORKER, 3
    assert json.loads(JsonFormatter().format(_record()))["worker"] == 3
    assert TextFormatter().format(_record()).startswith("[worker 3] ")
    POD.role = Role.SUPERVISOR
    assert json.loads(JsonFormatter().format(_record()))["worker"] == "supervisor"
    assert TextFormatter().format(_record()).startswith("[supervisor] ")
    POD.role = Role.SINGLE
    assert "worker" not in json.loads(JsonFormatter().format(_record()))
    assert "worker" not in TextFormatter().format(_record())
