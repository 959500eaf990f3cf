"""Every log line of a pod's process says which process wrote it: ``worker`` N or the
``supervisor`` (JSON and text); a single process's lines stay as they were."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from proxy.pod.state import POD, Role
from proxy.telemetry.logs import LIBRARY_LOGGERS, JsonFormatter, TextFormatter, setup_logging


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


def test_a_grpc_write_after_its_client_left_is_debug_not_an_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    """grpc.aio logs an answer written after its client left at ERROR with a traceback; any
    client could write one such line per stream it abandons. At INFO it is not written; other
    grpc errors still are."""
    touched = [logging.getLogger(n) for n in ("mmguard", *LIBRARY_LOGGERS)]
    was = [(lg, lg.level, list(lg.handlers), lg.propagate) for lg in touched]
    setup_logging("info", "json")
    try:
        core = logging.getLogger("grpc._cython.cygrpc")
        try:
            raise RuntimeError("Failed \"execute_batch\": (<grpc._cython.cygrpc.SendMessage>,)")
        except RuntimeError:
            core.exception("ExecuteBatchError raised in core by servicer method [/inference."
                           "GRPCInferenceService/ModelStreamInfer]")
        core.error("something else broke")
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    finally:
        for lg, level, handlers, propagate in was:
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate = propagate
    assert [line["msg"] for line in lines] == ["something else broke"]
