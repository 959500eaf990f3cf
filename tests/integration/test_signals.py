"""What the client saw = what the metric says = what the span says, for every error kind of
the one table (``proxy.errors.STATUS``), on every front: a unary HTTP and gRPC call, a gRPC
stream that fails before its first answer. Failures come from a backend that answers with the
kind's own status (a hand-written KServe v2 server: no real one fails on cue with each code).

The OpenAI stream's three endings (ok, failed before the first byte, broken mid-stream) are
checked against a real vLLM killed mid-run in ``test_signals_vllm.py``."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tritonclient.utils import InferenceServerException

from proxy.errors import STATUS, ErrorKind, kind_from_grpc, kind_from_http
from tests.support.fake_v2 import FakeV2
from tests.support.mmguard import RunningMmguard
from tests.support.wire import grpc_infer_raw, grpc_request, http_binary_body, http_post

X = np.array([1.5, -2.0], "<f4")
KINDS = [k for k in ErrorKind if k is not ErrorKind.ALREADY_EXISTS]
"""ALREADY_EXISTS is a shared-memory region's name taken: registration, never an inference."""


def span_exporter() -> InMemorySpanExporter:
    """An in-memory exporter on the process's SDK provider (installed once per process: the
    OpenTelemetry API refuses a second one)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return span_exporter()


@pytest.fixture(scope="module")
def setup(exporter: InMemorySpanExporter) -> Iterator[tuple[RunningMmguard, FakeV2]]:
    with FakeV2() as fake:
        cfg = {"backends": [
            {"kind": "triton_grpc", "name": "g", "url": f"127.0.0.1:{fake.grpc_port}"},
            {"kind": "triton_http", "name": "h", "url": f"127.0.0.1:{fake.http_port}"}],
            "models": [{"name": "via_grpc", "backend": "g", "backend_model": "echo"},
                       {"name": "via_http", "backend": "h", "backend_model": "echo"}]}
        with RunningMmguard(cfg) as m:
            m.wait_ready()
            yield m, fake
            fake.fail_http, fake.fail_grpc = 0, None


def _count(m: RunningMmguard, model: str, front: str, code: str) -> float:
    backend = "g" if model == "via_grpc" else "h"
    return m.telemetry.registry.get_sample_value(
        "mmguard_requests_total",
        {"model": model, "backend": backend, "front": front, "code": code}) or 0.0


def _server_span(exporter: InMemorySpanExporter) -> ReadableSpan:
    spans = [s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.SERVER]
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_http_front_http_backend(setup: tuple[RunningMmguard, FakeV2],
                                 exporter: InMemorySpanExporter, kind: ErrorKind) -> None:
    m, fake = setup
    fake.fail_http, fake.fail_grpc = STATUS[kind].http, None
    expected = kind_from_http(STATUS[kind].http)  # the backend's status read back
    before = _count(m, "via_http", "http", expected.value)
    exporter.clear()
    body, hlen = http_binary_body([("INPUT0", "FP32", [2], X.tobytes())])
    status, _, _ = http_post(m.http_url, "/v2/models/via_http/infer", body,
                             {"Inference-Header-Content-Length": str(hlen)})
    span = _server_span(exporter)
    assert span.attributes is not None
    saw = (status, _count(m, "via_http", "http", expected.value) - before,
           span.attributes["http.response.status_code"], span.attributes["error.type"])
    assert saw == (STATUS[expected].http, 1, status, expected.value)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_grpc_front_grpc_backend(setup: tuple[RunningMmguard, FakeV2],
                                 exporter: InMemorySpanExporter, kind: ErrorKind) -> None:
    m, fake = setup
    fake.fail_http, fake.fail_grpc = 0, STATUS[kind].grpc
    expected = kind_from_grpc(STATUS[kind].grpc)
    before = _count(m, "via_grpc", "grpc", expected.value)
    exporter.clear()
    with pytest.raises(grpc.RpcError) as err:
        grpc_infer_raw(m.grpc_url, grpc_request("via_grpc", [("INPUT0", "FP32", [2],
                                                              X.tobytes())]))
    span = _server_span(exporter)
    assert span.attributes is not None
    code = err.value.code()
    saw = (code, _count(m, "via_grpc", "grpc", expected.value) - before,
           span.attributes["rpc.response.status_code"], span.attributes["error.type"])
    assert saw == (STATUS[expected].grpc, 1, code.name, expected.value)


def test_a_success_is_ok_everywhere(setup: tuple[RunningMmguard, FakeV2],
                                    exporter: InMemorySpanExporter) -> None:
    m, fake = setup
    fake.fail_http, fake.fail_grpc = 0, None
    before = _count(m, "via_grpc", "grpc", "ok")
    exporter.clear()
    grpc_infer_raw(m.grpc_url, grpc_request("via_grpc", [("INPUT0", "FP32", [2], X.tobytes())]))
    span = _server_span(exporter)
    assert span.attributes is not None
    assert _count(m, "via_grpc", "grpc", "ok") - before == 1
    assert span.attributes["rpc.response.status_code"] == "OK"
    assert "error.type" not in span.attributes


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT])
def test_a_grpc_stream_that_fails_before_its_first_answer(
        setup: tuple[RunningMmguard, FakeV2], exporter: InMemorySpanExporter,
        code: grpc.StatusCode) -> None:
    """ModelStreamInfer: the client gets the error as a stream message (as Triton sends it);
    the request counts with that error's code, not ``ok``, and its span ends with it."""
    m, fake = setup
    fake.fail_http, fake.fail_grpc = 0, code
    expected = kind_from_grpc(code)
    before_ok = _count(m, "via_grpc", "grpc", "ok")
    before = _count(m, "via_grpc", "grpc", expected.value)
    exporter.clear()
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(m.grpc_url)
    inp = grpcclient.InferInput("INPUT0", [2], "FP32")
    inp.set_data_from_numpy(X)
    try:
        client.start_stream(callback=lambda result, error: results.put(error or result))
        client.async_stream_infer("via_grpc", [inp])
        got = results.get(timeout=30)
    finally:
        client.stop_stream()
        client.close()
    assert isinstance(got, InferenceServerException)
    assert "fake failure" in (got.message() or "")
    assert _count(m, "via_grpc", "grpc", expected.value) - before == 1
    assert _count(m, "via_grpc", "grpc", "ok") == before_ok
    span = _server_span(exporter)
    assert span.name == "inference.GRPCInferenceService/ModelStreamInfer"
    assert span.attributes is not None
    assert span.attributes["error.type"] == expected.value
    assert span.attributes["rpc.response.status_code"] == STATUS[expected].grpc.name


def _undecoded(m: RunningMmguard, front: str, code: str) -> float:
    return m.telemetry.registry.get_sample_value(
        "mmguard_requests_total",
        {"model": "(undecoded)", "backend": "", "front": front, "code": code}) or 0.0


def test_requests_refused_before_the_data_plane_are_counted(
        setup: tuple[RunningMmguard, FakeV2]) -> None:
    """An unreadable body is refused by the front's codec: counted too, as what the client
    got, under model (undecoded)."""
    m, _ = setup
    before = {f: _undecoded(m, f, "invalid_argument") for f in ("grpc", "http", "openai")}
    with pytest.raises(grpc.RpcError) as err:
        grpc_infer_raw(m.grpc_url, b"\x0a\x7fnot a request")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status, _, _ = http_post(m.http_url, "/v2/models/via_http/infer", b"{not json",
                             {"Content-Type": "application/json"})
    assert status == 400
    status, _, _ = http_post(m.http_url, "/v1/chat/completions", b"{not json",
                             {"Content-Type": "application/json"})
    assert status == 400
    after = {f: _undecoded(m, f, "invalid_argument") for f in ("grpc", "http", "openai")}
    assert {f: after[f] - before[f] for f in after} == {"grpc": 1, "http": 1, "openai": 1}
