"""Building a runtime is side-effect free: a runtime that is built and never swapped in (a
rejected reload) starts no experiment and takes over no shared state; ``activate`` does, once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from filters.fault.registry import EXPERIMENTS
from filters.shadow.filter import LIVE_SHADOWS
from proxy.clock import SystemClock
from proxy.config.model import parse_config
from proxy.engine.runtime import Runtime
from proxy.telemetry import Telemetry


def _config(tmp_path: Path, experiment: str) -> Any:
    return parse_config({
        "backends": [{"kind": "onnxruntime", "name": "ort", "model_dir": str(tmp_path)}],
        "models": [{"name": "a", "backend": "ort", "filters": [
            {"shadow": {"canary": "b"}},
            {"fault": {"experiments": [{"name": experiment,
                                        "actions": [{"kind": "delay", "ms": 1}]}]}}]},
                   {"name": "b", "backend": "ort"}]})


def _running(rt: Runtime) -> dict[str, str]:
    return {e.name: e.state for e in rt.state[EXPERIMENTS].experiments.values()}


def test_a_built_runtime_changes_nothing_until_activated(tmp_path: Path) -> None:
    telemetry, clock = Telemetry(), SystemClock()
    old = Runtime.build(_config(tmp_path, "first"), telemetry, clock)
    assert _running(old) == {}  # built: nothing started yet
    old.activate()
    assert _running(old) == {"first": "running"}
    serving_shadow = old.state[LIVE_SHADOWS]["a"]

    rejected = Runtime.build(_config(tmp_path, "second"), telemetry, clock, previous=old)
    assert _running(rejected) == {"first": "running"}  # the old config's, untouched
    assert rejected.state[LIVE_SHADOWS]["a"] is serving_shadow

    applied = Runtime.build(_config(tmp_path, "third"), telemetry, clock, previous=old)
    applied.activate()
    assert _running(applied) == {"first": "stopped", "third": "running"}
    assert applied.state[LIVE_SHADOWS]["a"] is not serving_shadow
    applied.activate()  # once: a second call starts nothing again
    assert _running(applied) == {"first": "stopped", "third": "running"}
    for rt in (old, rejected, applied):
        asyncio.run(rt.close())
