"""The OpenAI front's non-stream answers, against a real vLLM (tiny-llama): what the client saw =
what ``mmguard_requests_total`` says = what the SERVER span says, for vLLM's own refusals passed
through (chat, completions, embeddings), a backend that is down, a route's timeout, mmguard's own
refusal, and a success.

A row is (client's status, the one code the metric grew by, the span's status and
``error.type``); the three must agree, and each row's expected kind is written down, so a
row that drifts (vLLM's status changing, a refusal counted as ``ok``) fails."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.errors import STATUS, ErrorKind
from tests.integration.test_signals import span_exporter
from tests.support.mmguard import RunningMmguard
from tests.support.vllm import DELAY_ARG, VllmServer
from tests.support.wire import http_post

pytestmark = pytest.mark.vllm
CODES = ["ok", *(k.value for k in ErrorKind)]
CHAT = [{"role": "user", "content": "go"}]


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return span_exporter()


@pytest.fixture(scope="module")
def proxy(vllm_llama: VllmServer, exporter: InMemorySpanExporter) -> Iterator[RunningMmguard]:
    cfg: dict[str, Any] = {
        "backends": [{"kind": "vllm", "name": "llama", "url": vllm_llama.url},
                     {"kind": "vllm", "name": "gone", "url": "http://127.0.0.1:1"},
                     {"kind": "triton_grpc", "name": "v2", "url": "127.0.0.1:1"}],
        "models": [{"name": "tiny-llama", "backend": "llama"},
                   {"name": "hasty", "backend": "llama", "backend_model": "tiny-llama",
                    "timeout_s": 1},
                   {"name": "nowhere", "backend": "gone", "backend_model": "tiny-llama"},
                   {"name": "tensors", "backend": "v2", "backend_model": "identity_fp32"}]}
    with RunningMmguard(cfg) as m:  # never ready as a whole: two of its backends are down
        assert m.server is not None
        runtime = m.server.plane.runtime
        deadline = time.monotonic() + 120
        while not all(m.run(runtime.model_ready(r, "")) for r in ("tiny-llama", "hasty")):
            assert time.monotonic() < deadline, "tiny-llama's routes never ready"
            time.sleep(0.1)
        yield m


def _counts(m: RunningMmguard, model: str, backend: str) -> dict[str, float]:
    return {c: m.telemetry.registry.get_sample_value("mmguard_requests_total", {
        "model": model, "backend": backend, "front": "openai", "code": c}) or 0.0
        for c in CODES}


ROWS: dict[str, tuple[str, str, str, dict[str, Any], ErrorKind | None]] = {
    # row: (endpoint, model, backend label, body, the kind the client must get)
    "chat ok": ("/v1/chat/completions", "tiny-llama", "llama",
                {"messages": CHAT, "max_tokens": 4}, None),
    "chat: vLLM's 400 (max_tokens)": ("/v1/chat/completions", "tiny-llama", "llama",
                                     {"messages": CHAT, "max_tokens": 4000},
                                     ErrorKind.INVALID_ARGUMENT),
    "completions: vLLM's 400 (prompt too long)": (
        "/v1/completions", "tiny-llama", "llama",
        {"prompt": "go " * 300, "max_tokens": 4}, ErrorKind.INVALID_ARGUMENT),
    "embeddings: vLLM's refusal of a generative model": (
        "/v1/embeddings", "tiny-llama", "llama", {"input": "go"}, ErrorKind.NOT_FOUND),
    "chat: backend down": ("/v1/chat/completions", "nowhere", "gone",
                           {"messages": CHAT, "max_tokens": 4}, ErrorKind.UNAVAILABLE),
    "completions: backend down": ("/v1/completions", "nowhere", "gone",
                                  {"prompt": "go", "max_tokens": 4}, ErrorKind.UNAVAILABLE),
    "chat: the route's timeout": ("/v1/chat/completions", "hasty", "llama",
                                  {"messages": CHAT, "max_tokens": 60, "ignore_eos": True,
                                   "vllm_xargs": {DELAY_ARG: 100}},
                                  ErrorKind.DEADLINE_EXCEEDED),
    "chat: mmguard's refusal (a v2 route)": ("/v1/chat/completions", "tensors", "v2",
                                             {"messages": CHAT}, ErrorKind.INVALID_ARGUMENT),
    "embeddings: mmguard's refusal (a v2 route)": ("/v1/embeddings", "tensors", "v2",
                                                   {"input": "go"},
                                                   ErrorKind.INVALID_ARGUMENT),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_client_metric_and_span_agree(proxy: RunningMmguard, exporter: InMemorySpanExporter,
                                      row: str) -> None:
    endpoint, model, backend, body, kind = ROWS[row]
    before = _counts(proxy, model, backend)
    exporter.clear()
    status, headers, text = http_post(proxy.http_url, endpoint,
                                      json.dumps({"model": model, **body}).encode(),
                                      {"Content-Type": "application/json"})
    after = _counts(proxy, model, backend)
    grew = {c: after[c] - before[c] for c in CODES if after[c] != before[c]}
    spans = [s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.SERVER]
    assert len(spans) == 1, [s.name for s in spans]
    attrs = spans[0].attributes
    assert attrs is not None
    saw = (status, grew, attrs["http.response.status_code"], attrs.get("error.type"))
    code = "ok" if kind is None else kind.value
    assert saw == (200 if kind is None else STATUS[kind].http, {code: 1}, status,
                   None if kind is None else code), text
    doc = json.loads(text)
    if kind is None:
        assert "error" not in doc
        return
    origin = headers.get("mmguard-error-origin")
    assert origin == ("backend" if backend == "llama" and "timeout" not in row
                      else "mmguard"), (origin, doc)
    if row.startswith("embeddings: vLLM"):  # vLLM serves no /v1/embeddings for this model:
        assert doc == {"detail": "Not Found"}  # its web framework's 404, passed on unchanged
    else:  # an OpenAI error object, whoever refused
        assert isinstance(doc.get("error"), dict) and doc["error"].get("message"), doc


def test_an_unknown_model_is_counted_as_its_client_was_told(proxy: RunningMmguard) -> None:
    """Refused before it became a call (no route to count it under): ``(undecoded)``, with
    the status the client got, and vLLM's words."""
    def undecoded() -> float:
        return proxy.telemetry.registry.get_sample_value("mmguard_requests_total", {
            "model": "(undecoded)", "backend": "", "front": "openai",
            "code": "not_found"}) or 0.0
    before = undecoded()
    status, _, text = http_post(proxy.http_url, "/v1/chat/completions",
                                json.dumps({"model": "no-such", "messages": CHAT}).encode(),
                                {"Content-Type": "application/json"})
    assert status == 404 and b"The model `no-such` does not exist." in text, text
    assert undecoded() - before == 1
