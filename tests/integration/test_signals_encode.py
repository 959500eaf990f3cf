"""An answer the backend gave but the client never got: what the client saw = what the metric
says = what the span says, when the front's last step on a real Triton answer fails after the
backend call succeeded. Two such steps, each on every front and both Triton backends:

* encoding: an FP16 output asked for as JSON (Triton's HTTP server refuses that as 400, so
  mmguard refuses it too when it encodes a gRPC backend's answer for an HTTP client);
* writing the outputs into the client's shared memory: a region too small for the answer
  (Triton says INTERNAL).

Each must count as the refusal its client got, never as ``ok``. So must a refusal made before
the backend call by the shared-memory step (a region the client never registered): it once
reached the client and neither the metric nor a span."""

from __future__ import annotations

import json
import os
import queue
import secrets
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tritonclient.utils import InferenceServerException

from tests.conftest import triton_routes
from tests.integration.test_signals import span_exporter
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.wire import http_post

pytestmark = pytest.mark.triton
X = np.arange(16, dtype=np.float32).reshape(1, 16)
BACKENDS = {"g": "triton-grpc", "h": "triton-http"}


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return span_exporter()


@pytest.fixture(scope="module")
def proxy(triton: TritonServer, exporter: InMemorySpanExporter) -> Iterator[RunningMmguard]:
    cfg = triton_routes(triton, ["identity_fp16", "small_fp32"])
    cfg["shared_memory"] = {"system": True}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=120)
        yield m


def _count(m: RunningMmguard, model: str, front: str, code: str) -> float:
    return m.telemetry.registry.get_sample_value("mmguard_requests_total", {
        "model": model, "backend": BACKENDS[model[0]], "front": front, "code": code}) or 0.0


def _counts(m: RunningMmguard, model: str, front: str) -> dict[str, float]:
    return {c: _count(m, model, front, c)
            for c in ("ok", "invalid_argument", "internal", "not_found")}


def _server_span(exporter: InMemorySpanExporter) -> ReadableSpan:
    spans = [s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.SERVER]
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


@pytest.mark.parametrize("route", ["g", "h"])
def test_an_output_json_cannot_carry(proxy: RunningMmguard, exporter: InMemorySpanExporter,
                                     route: str) -> None:
    """FP16 asked for as JSON: 400 whichever backend answered (mmguard's encoding refuses a
    gRPC backend's answer; Triton refuses the HTTP backend's request itself), and 400 is
    what the metric and the span say."""
    model = f"{route}_identity_fp16"
    before = _counts(proxy, model, "http")
    exporter.clear()
    head = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP16", "shape": [1, 2],
                                   "parameters": {"binary_data_size": 4}}],
                       "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}]}
                      ).encode()
    status, _, text = http_post(proxy.http_url, f"/v2/models/{model}/infer",
                                head + np.array([1.5, -2.0], np.float16).tobytes(),
                                {"Content-Type": "application/octet-stream",
                                 "Inference-Header-Content-Length": str(len(head))})
    after = _counts(proxy, model, "http")
    assert status == 400, text
    assert b"FP16" in text, text
    assert {c: after[c] - before[c] for c in after} == \
        {"ok": 0, "invalid_argument": 1, "internal": 0, "not_found": 0}
    span = _server_span(exporter)
    assert span.attributes is not None
    assert (span.attributes["http.response.status_code"],
            span.attributes["error.type"]) == (400, "invalid_argument")


class Regions:
    """Input and output regions under /dev/shm for one client, removed at the end."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.tag = f"mmg{os.getpid()}_{secrets.token_hex(3)}"
        self.handles: list[Any] = []

    def make(self, name: str, size: int) -> str:
        region = f"{self.tag}_{name}"
        handle = shm.create_shared_memory_region(region, f"/{region}", size)
        self.handles.append(handle)
        if size >= X.nbytes:
            shm.set_shared_memory_region(handle, [X])
        self.client.register_system_shared_memory(region, f"/{region}", size)
        return region

    def close(self) -> None:
        for handle in self.handles:
            self.client.unregister_system_shared_memory(handle._triton_shm_name)
            shm.destroy_shared_memory_region(handle)


def _small_output(module: Any, regions: Regions) -> tuple[Any, Any]:
    """x from a region, y into a region of 16 bytes (the answer is 64)."""
    x = module.InferInput("x", [1, 16], "FP32")
    x.set_shared_memory(regions.make("in", X.nbytes), X.nbytes)
    y = module.InferRequestedOutput("y")
    y.set_shared_memory(regions.make("out", 16), 16)
    return x, y


def _refused(client: Any, front: str, model: str, inputs: list[Any],
             outputs: list[Any] | None = None) -> Any:
    """The client's error for one call, unary or on a stream (where it comes to the callback)."""
    if front == "grpc stream":
        got: queue.Queue[Any] = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put(error or result))
        client.async_stream_infer(model, inputs, outputs=outputs)
        err = got.get(timeout=30)
        client.stop_stream()
        assert isinstance(err, InferenceServerException), err
        return err
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, inputs, outputs=outputs)
    return info.value


def _counted_once(proxy: RunningMmguard, exporter: InMemorySpanExporter, model: str, front: str,
                  before: dict[str, float], code: str, http_status: int,
                  grpc_code: grpc.StatusCode) -> None:
    """The call is one request of ``code`` in the metric, and its server span says the same."""
    label = "http" if front == "http" else "grpc"
    after = _counts(proxy, model, label)
    assert {c: after[c] - before[c] for c in after} == \
        {c: 1 if c == code else 0 for c in ("ok", "invalid_argument", "internal", "not_found")}
    span = _server_span(exporter)
    assert span.attributes is not None
    assert span.attributes["error.type"] == code
    if front == "http":
        assert span.attributes["http.response.status_code"] == http_status
    else:
        assert span.attributes["rpc.response.status_code"] == grpc_code.name


@pytest.mark.parametrize("route", ["g", "h"])
@pytest.mark.parametrize("front", ["http", "grpc", "grpc stream"])
def test_an_answer_too_big_for_its_region(proxy: RunningMmguard,
                                          exporter: InMemorySpanExporter,
                                          front: str, route: str) -> None:
    """The answer is written into the client's region after the backend call: a region too
    small is Triton's INTERNAL for the client, and ``internal`` for the metric and span."""
    model = f"{route}_small_fp32"
    label = "http" if front == "http" else "grpc"
    module: Any = httpclient if front == "http" else grpcclient
    client = module.InferenceServerClient(proxy.http_url if front == "http"
                                          else proxy.grpc_url)
    regions = Regions(client)
    before = _counts(proxy, model, label)
    try:
        x, y = _small_output(module, regions)
        exporter.clear()
        err = _refused(client, front, model, [x], [y])
        if front != "grpc stream":
            assert err.status() == ("500" if front == "http" else "StatusCode.INTERNAL")
        assert "'y'" in (err.message() or "") and "16 bytes" in (err.message() or "")
    finally:
        regions.close()
        client.close()
    _counted_once(proxy, exporter, model, front, before, "internal", 500,
                  grpc.StatusCode.INTERNAL)


@pytest.mark.parametrize("front", ["http", "grpc", "grpc stream"])
def test_a_region_never_registered(proxy: RunningMmguard, exporter: InMemorySpanExporter,
                                   front: str) -> None:
    """Refused before the backend call, with Triton's words: 404 / NOT_FOUND for the client
    (a stream's error message), ``not_found`` for the metric and the span."""
    model = "g_small_fp32"
    label = "http" if front == "http" else "grpc"
    module: Any = httpclient if front == "http" else grpcclient
    client = module.InferenceServerClient(proxy.http_url if front == "http"
                                          else proxy.grpc_url)
    before = _counts(proxy, model, label)
    exporter.clear()
    x = module.InferInput("x", [1, 16], "FP32")
    x.set_shared_memory("never_registered", X.nbytes)
    try:
        err = _refused(client, front, model, [x])
        if front != "grpc stream":
            assert err.status() == ("404" if front == "http" else "StatusCode.NOT_FOUND")
        assert "Unable to find shared memory region: 'never_registered'" in (err.message()
                                                                             or "")
    finally:
        client.close()
    _counted_once(proxy, exporter, model, front, before, "not_found", 404,
                  grpc.StatusCode.NOT_FOUND)
