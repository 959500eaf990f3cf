"""W3C trace context crosses mmguard to the backend (gRPC metadata and HTTP headers); mmguard
makes one span per request and one per filter, and a filter's decision is a span event."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.integration.test_signals import span_exporter
from tests.support.fake_v2 import FakeV2
from tests.support.mmguard import RunningMmguard
from tests.support.wire import grpc_infer_raw, grpc_request, http_binary_body, http_post

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
X = ("INPUT0", "FP32", [2], np.array([1.5, -2], "<f4").tobytes())


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    # on the process's one SDK provider: another tier's test may have installed it first
    return span_exporter()


@pytest.fixture(scope="module")
def setup(exporter: InMemorySpanExporter) -> Iterator[tuple[RunningMmguard, FakeV2]]:
    with FakeV2() as fake:
        cfg = {
            "backends": [{"kind": "triton_grpc", "name": "g", "url": f"127.0.0.1:{fake.grpc_port}"},
                         {"kind": "triton_http", "name": "h",
                          "url": f"127.0.0.1:{fake.http_port}"}],
            "models": [{"name": "via_grpc", "backend": "g", "backend_model": "echo",
                        "filters": [{"limits": {"max_batch": 1}}]},
                       {"name": "via_http", "backend": "h", "backend_model": "echo"}],
        }
        with RunningMmguard(cfg) as m:
            m.wait_ready()
            yield m, fake


@pytest.mark.parametrize("route", ["via_grpc", "via_http"])
def test_trace_context_reaches_backend_on_both_protocols(
        setup: tuple[RunningMmguard, FakeV2], exporter: InMemorySpanExporter,
        route: str) -> None:
    proxy, fake = setup
    fake.headers.clear()
    exporter.clear()
    grpc_infer_raw(proxy.grpc_url, grpc_request(route, [("INPUT0", "FP32", [1], X[3][:4])]),
                   metadata=(("traceparent", PARENT), ("x-tenant", "blue")))
    seen = fake.headers[-1]
    assert seen["traceparent"].startswith(f"00-{TRACE_ID}-")  # same trace, continued
    assert seen["traceparent"] != PARENT  # with mmguard's span as the parent
    assert seen["x-tenant"] == "blue"  # client metadata propagated
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.kind == trace.SpanKind.SERVER)
    # OpenTelemetry's RPC conventions: the client called gRPC ModelInfer
    assert root.name == "inference.GRPCInferenceService/ModelInfer"
    assert root.attributes is not None and root.attributes["rpc.system.name"] == "grpc"
    assert root.attributes["rpc.method"] == "inference.GRPCInferenceService/ModelInfer"
    assert root.attributes["rpc.response.status_code"] == "OK"
    assert format(root.context.trace_id, "032x") == TRACE_ID
    step = next(s for s in spans if s.name == "filter limits")  # every route has limits
    assert step.parent is not None and step.parent.span_id == root.context.span_id
    # the hop to the backend is a CLIENT span, and the backend's parent is that span
    hop = next(s for s in spans if s.kind == trace.SpanKind.CLIENT)
    assert hop.parent is not None and hop.parent.span_id == step.context.span_id
    assert seen["traceparent"].split("-")[2] == format(hop.context.span_id, "016x")
    assert hop.attributes is not None and hop.attributes["server.address"] == "127.0.0.1"
    assert hop.attributes["server.port"] in (fake.grpc_port, fake.http_port)
    if route == "via_grpc":
        assert hop.name == "inference.GRPCInferenceService/ModelInfer"
        assert hop.attributes["rpc.method"] == "inference.GRPCInferenceService/ModelInfer"
    else:
        assert hop.attributes["url.full"] == f"http://127.0.0.1:{fake.http_port}/v2/models/echo/infer"


def test_decision_is_a_span_event(setup: tuple[RunningMmguard, FakeV2],
                                  exporter: InMemorySpanExporter) -> None:
    proxy, _ = setup
    exporter.clear()
    body, hlen = http_binary_body([X])  # batch 2 > max_batch 1
    status, headers, _ = http_post(proxy.http_url, "/v2/models/via_grpc/infer", body,
                                   {"Inference-Header-Content-Length": str(hlen),
                                    "traceparent": PARENT})
    assert status == 413 and headers["mmguard-limits"].startswith("reject-batch")
    span = next(s for s in exporter.get_finished_spans() if s.name == "filter limits")
    event = span.events[0]
    assert event.name == "limits.reject-batch"
    assert event.attributes is not None and event.attributes["mmguard.model"] == "via_grpc"
    # the HTTP server span follows OpenTelemetry's HTTP conventions
    root = next(s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.SERVER)
    assert root.name == "POST /v2/models/{model_name}/infer"
    assert root.attributes is not None
    assert root.attributes["url.path"] == "/v2/models/via_grpc/infer"
    assert root.attributes["url.scheme"] == "http"
    assert root.attributes["http.response.status_code"] == 413
    assert root.attributes["error.type"] == "too_large"


def test_a_backend_stream_is_one_client_span_with_gen_ai_usage(
        exporter: InMemorySpanExporter) -> None:
    """traced_stream (the vLLM and Triton gRPC streams): the CLIENT span is current while the
    backend stream is read (so its headers name it), ends with the stream, and carries the
    usage and finish reasons of the last events."""
    import asyncio

    from proxy.call import Call, SseEvent
    from proxy.telemetry import traced_stream

    seen: list[int] = []

    async def backend() -> AsyncIterator[SseEvent]:
        for raw in (b'data: {"choices":[{"delta":{"content":"hi"},"finish_reason":null}]}\n\n',
                    b'data: {"model":"tiny","choices":[{"finish_reason":"length"}],'
                    b'"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n',
                    b"data: [DONE]\n\n"):
            seen.append(trace.get_current_span().get_span_context().span_id)
            yield SseEvent(raw)

    async def read() -> int:
        call = Call(model="tiny", version="", inputs=[], front="openai", streaming=True,
                    endpoint="/v1/chat/completions")
        tracer = trace.get_tracer("test")
        with tracer.start_as_current_span("outer") as outer:
            items = [i async for i in traced_stream(call, "openai", "v", "tiny",
                                                    "http://127.0.0.1:8000", backend())]
            assert len(items) == 3
            # after the stream, the caller's span is current again
            assert trace.get_current_span() is outer
            return outer.get_span_context().span_id

    exporter.clear()
    outer_id = asyncio.run(read())
    (hop,) = [s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.CLIENT]
    assert hop.name == "chat tiny" and hop.parent is not None and hop.parent.span_id == outer_id
    assert set(seen) == {hop.context.span_id}
    assert hop.attributes is not None
    assert hop.attributes["gen_ai.usage.input_tokens"] == 5
    assert hop.attributes["gen_ai.usage.output_tokens"] == 2
    assert tuple(hop.attributes["gen_ai.response.finish_reasons"]) == ("length",)  # type: ignore[arg-type]  # a str-sequence attribute
    assert hop.attributes["server.port"] == 8000


@pytest.mark.parametrize("verb", ["infer", "generate", "generate_stream"])
def test_a_v2_http_request_s_span_names_the_endpoint_it_came_to(
        setup: tuple[RunningMmguard, FakeV2], exporter: InMemorySpanExporter, verb: str) -> None:
    # generate and generate_stream are Triton's own endpoints: their spans are not infer's
    proxy, _ = setup
    exporter.clear()
    body = (http_binary_body([X])[0] if verb == "infer"
            else b'{"INPUT0": [1.5, -2]}')
    headers = ({"Inference-Header-Content-Length": str(http_binary_body([X])[1])}
               if verb == "infer" else {"Content-Type": "application/json"})
    status, _, answer = http_post(proxy.http_url, f"/v2/models/via_http/{verb}", body,
                                  headers)
    assert status == 200, answer
    root = next(s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.SERVER)
    assert root.name == f"POST /v2/models/{{model_name}}/{verb}"
    assert root.attributes is not None
    assert root.attributes["http.route"] == f"/v2/models/{{model_name}}/{verb}"
    assert root.attributes["url.path"] == f"/v2/models/via_http/{verb}"
