"""``mmguard-timeout-ms`` on the OpenAI front, as on the KServe v2 one, in front of a real vLLM
slowed per token (its delay plugin): the OpenAI front never read the header, and answered 200
long after the client's deadline, counted ``ok``.

- a whole answer past the deadline: 504, counted ``deadline_exceeded``;
- a stream past it: the events so far, then an error event at the deadline (the client had its
  200) and ``[DONE]``, counted ``deadline_exceeded``;
- a value that is not a positive number of milliseconds: 400, as on the KServe v2 front.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.mmguard import RunningMmguard
from tests.support.vllm import DELAY_ARG, VllmServer

pytestmark = pytest.mark.vllm
SLOW = {"model": "tiny-llama", "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 60, "ignore_eos": True, "vllm_xargs": {DELAY_ARG: 50}}  # ~3 s


@pytest.fixture(scope="module")
def proxy(vllm_llama: VllmServer) -> Iterator[RunningMmguard]:
    cfg = {"backends": [{"kind": "vllm", "name": "llama", "url": vllm_llama.url}],
           "models": [{"name": "tiny-llama", "backend": "llama",
                       "backend_model": vllm_llama.model}]}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=120)
        yield m


def count(m: RunningMmguard, code: str) -> float:
    return m.telemetry.registry.get_sample_value("mmguard_requests_total", {
        "model": "tiny-llama", "backend": "llama", "front": "openai", "code": code}) or 0.0


def post(m: RunningMmguard, doc: dict[str, Any], timeout_ms: str
         ) -> tuple[int, list[bytes], float]:
    """(status, the body's lines, seconds to the end of the answer)."""
    host, port = m.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    started = time.monotonic()
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(doc),
                     {"Content-Type": "application/json", "mmguard-timeout-ms": timeout_ms})
        resp = conn.getresponse()
        lines = [line for line in resp.read().splitlines() if line.strip()]
        return resp.status, lines, time.monotonic() - started
    finally:
        conn.close()


def settled(m: RunningMmguard, code: str, before: float) -> float:
    deadline = time.monotonic() + 30
    while count(m, code) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    return count(m, code) - before


def test_a_whole_answer_past_the_deadline_is_504(proxy: RunningMmguard) -> None:
    before = count(proxy, "deadline_exceeded")
    status, lines, took = post(proxy, SLOW, "500")
    assert status == 504, lines
    assert took < 2.5  # the answer takes ~3 s; generous against a busy machine
    assert json.loads(b"".join(lines))["error"]["code"] == 504
    assert settled(proxy, "deadline_exceeded", before) == 1


def test_a_stream_past_the_deadline_ends_with_an_error_event(proxy: RunningMmguard) -> None:
    before = count(proxy, "deadline_exceeded")
    status, lines, took = post(proxy, {**SLOW, "stream": True}, "800")
    assert status == 200  # the stream had started
    events = [json.loads(line[6:]) for line in lines
              if line.startswith(b"data: {")]
    assert events and "error" in events[-1], lines[-3:]
    assert "deadline" in events[-1]["error"]["message"]
    assert lines[-1] == b"data: [DONE]"  # after the error event, as vLLM ends a failed one
    assert took < 2.5
    assert settled(proxy, "deadline_exceeded", before) == 1


def test_a_timeout_that_is_not_a_number_is_refused(proxy: RunningMmguard) -> None:
    status, lines, _ = post(proxy, {**SLOW, "max_tokens": 2}, "soon")
    assert status == 400
    assert "mmguard-timeout-ms must be a positive number of milliseconds" in \
        json.loads(b"".join(lines))["error"]["message"]
