"""A real vLLM killed mid-run with streaming clients: what each client saw is what
``mmguard_requests_total`` and the SERVER spans say. Streams running when it dies count as
``stream_broken`` (their clients got 200, then an error event), calls after it as
``unavailable`` (their clients got 503 before any byte), never as ``ok``."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from opentelemetry import trace

from tests.integration.test_signals import span_exporter
from tests.support.mmguard import RunningMmguard
from tests.support.vllm import DELAY_ARG, VllmServer

pytestmark = pytest.mark.vllm
CLIENTS = 3


errors: list[str] = []


def _stream(address: str, slow: bool, started: threading.Barrier | None) -> tuple[int, str]:
    """(HTTP status, how the stream ended: "done", "error event", or "no stream")."""
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 60, "stream": True, "ignore_eos": True}
    if slow:
        body["vllm_xargs"] = {DELAY_ARG: 50}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        resp.read()
        conn.close()
        if started is not None:
            started.abort()
        return resp.status, "no stream"
    ended = "cut"
    first = True
    for line in resp:
        if first and started is not None:
            started.wait(timeout=60)  # every client is mid-stream before the kill
        first = False
        if line.startswith(b"data: [DONE]"):
            ended = "done" if ended == "cut" else ended
        elif line.startswith(b"data: "):
            doc = json.loads(line[6:])
            if isinstance(doc, dict) and "error" in doc:
                ended = "error event"
                errors.append(str(doc["error"]))
    conn.close()
    return 200, ended


def _streams_through(m: RunningMmguard, kill: Callable[[], None]) -> list[tuple[int, str]]:
    """``CLIENTS`` slow streams through ``m``; ``kill`` once each holds its first event; how
    each one ended."""
    started = threading.Barrier(CLIENTS + 1)
    seen: list[tuple[int, str]] = []
    threads = [threading.Thread(target=lambda: seen.append(_stream(m.http_url, True, started)))
               for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    started.wait(timeout=120)  # each client holds its first event
    kill()
    for t in threads:
        t.join(timeout=120)
    return seen


@contextmanager
def _doomed(models: dict[str, Path], tmp: Path) -> Iterator[tuple[VllmServer, RunningMmguard]]:
    """A vLLM of its own (the test kills it) and a mmguard in front of it, ready."""
    doomed = VllmServer(models["tiny-llama"], "tiny-llama", log_path=tmp / "v.log")
    doomed.start()
    try:
        cfg = {"backends": [{"kind": "vllm", "name": "llama", "url": doomed.url}],
               "models": [{"name": "tiny-llama", "backend": "llama"}]}
        with RunningMmguard(cfg) as m:
            m.wait_ready(timeout=120)
            yield doomed, m
    finally:
        doomed.stop()


def _count(m: RunningMmguard, code: str) -> float:
    return m.telemetry.registry.get_sample_value("mmguard_requests_total", {
        "model": "tiny-llama", "backend": "llama", "front": "openai", "code": code}) or 0.0


def test_vllm_killed_mid_run(vllm_models: dict[str, Path], tmp_path: Path) -> None:
    exporter = span_exporter()
    with _doomed(vllm_models, tmp_path) as (doomed, m):
        assert _stream(m.http_url, False, None) == (200, "done"), errors
        assert _count(m, "ok") == 1
        exporter.clear()
        seen = _streams_through(m, doomed.kill)
        after = [_stream(m.http_url, False, None) for _ in range(4)]
        spans = [s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.SERVER]
    assert sorted(seen) == [(200, "error event")] * CLIENTS, seen
    assert after == [(503, "no stream")] * 4, after
    # the metric says what the clients saw
    assert (_count(m, "ok"), _count(m, "stream_broken"), _count(m, "unavailable")) == \
        (1, CLIENTS, 4)
    # and so do the spans: 200 + a stream_broken event for the broken ones, 503 for the rest
    broken = [s for s in spans if s.attributes and s.attributes.get("error.type") ==
              "stream_broken"]
    refused = [s for s in spans if s.attributes and s.attributes.get("error.type") ==
               "unavailable"]
    assert len(broken) == CLIENTS and len(refused) == 4, [(s.name, s.attributes) for s in spans]
    assert all(s.attributes and s.attributes["http.response.status_code"] == 200
               and [e.name for e in s.events] == ["stream_broken"] for s in broken)
    assert all(s.attributes and s.attributes["http.response.status_code"] == 503
               for s in refused)


def _engine_core(server: VllmServer) -> int:
    """The pid of the vLLM server's engine process (its title names it ``EngineCore``)."""
    from tests.support.vllm import _group_pids

    pgid = server._pgid or server.pid
    assert pgid is not None
    for pid in _group_pids(pgid):
        try:
            if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise AssertionError(f"no EngineCore process in group {pgid}")


def test_vllm_engine_killed_mid_stream_counts_as_broken(vllm_models: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """Only vLLM's engine dies: its API server answers each running stream with its own error
    event (``EngineCore encountered an issue``) and ``[DONE]``. The client gets that event as
    vLLM sent it, and the call counts as ``stream_broken``: it counted ``ok`` (the stream ended
    cleanly, as far as the transport could tell)."""
    with _doomed(vllm_models, tmp_path) as (doomed, m):
        seen = _streams_through(m, lambda: os.kill(_engine_core(doomed), signal.SIGKILL))
        counts = (_count(m, "ok"), _count(m, "stream_broken"))
    assert sorted(seen) == [(200, "error event")] * CLIENTS, seen
    assert any("EngineCore" in e for e in errors), errors  # vLLM's own words reached them
    assert counts == (0, CLIENTS), counts
