"""Traces: the OpenTelemetry API, with the SDK and OTLP exporter set up only when configured;
span names and attributes in OpenTelemetry's semantic conventions."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace

if TYPE_CHECKING:
    from proxy.call import Call


_UNSET = object()
_PROVIDER_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
"""The API loads a provider named in the environment on first use; the environment is read once."""


def tracing_on() -> bool:
    """True when an SDK tracer provider is installed. Without one, mmguard makes no spans at
    all (even no-op ones cost ~15 µs each on the hot path) and passes the client's W3C headers
    through unchanged. Asked by every filter step: it reads the API's global (~0.1 µs), not
    ``get_tracer_provider()`` (~3 µs: an ``os.environ`` lookup on every call while none is set)."""
    provider = getattr(trace, "_TRACER_PROVIDER", _UNSET)
    if provider is None and not _PROVIDER_FROM_ENV:
        return False
    if provider is None or provider is _UNSET:  # to be loaded, or another API version
        provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.NoOpTracerProvider, trace.ProxyTracerProvider))


def setup_tracing(otlp_endpoint: str | None, service_name: str) -> None:
    """Install the SDK with an OTLP exporter; without an endpoint the API stays a no-op (the
    incoming W3C context is still propagated to backends)."""
    if not otlp_endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint,
                                                                    insecure=True)))
    trace.set_tracer_provider(provider)


# rpc.* for gRPC, http.* / url.* for HTTP, gen_ai.* for OpenAI calls; mmguard.* for mmguard's own.

GRPC_SERVICE = "inference.GRPCInferenceService"
_GEN_AI_OPERATION = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}


def server_span(call: Call) -> tuple[str, dict[str, Any]]:
    """The name and attributes of the span for one request as mmguard received it."""
    attrs: dict[str, Any] = {"mmguard.model": call.model}
    if call.front == "grpc":
        method = "ModelStreamInfer" if call.streaming else "ModelInfer"
        attrs.update({"rpc.system": "grpc", "rpc.service": GRPC_SERVICE, "rpc.method": method})
        return f"{GRPC_SERVICE}/{method}", attrs
    if call.front == "openai":
        route = call.endpoint or "/v1/chat/completions"
        attrs.update({"http.request.method": "POST", "http.route": route, "url.path": route,
                      "gen_ai.operation.name": _GEN_AI_OPERATION.get(route, "chat"),
                      "gen_ai.request.model": call.model})
        return f"POST {route}", attrs
    version = f"/versions/{call.version}" if call.version else ""
    route = "/v2/models/{model_name}" + ("/versions/{model_version}" if version else "") + "/infer"
    attrs.update({"http.request.method": "POST", "http.route": route,
                  "url.path": f"/v2/models/{call.model}{version}/infer"})
    return f"POST {route}", attrs


def end_server_span(span: Any, call: Call, kind_value: str | None, http_status: int,
                    grpc_code: int) -> None:
    """Status attributes once the answer is known (kind_value None: a success)."""
    if call.front == "grpc":
        span.set_attribute("rpc.grpc.status_code", grpc_code)
    else:
        span.set_attribute("http.response.status_code", http_status)
    if kind_value is not None:
        span.set_attribute("error.type", kind_value)


def backend_span(call: Call, protocol: str, backend: str, model: str, address: str) -> Any:
    """The CLIENT span of the hop to the backend, started as the current span so that the W3C
    headers forwarded to the backend name it as the parent. A no-op context manager when
    tracing is off (no span costs nothing)."""
    if not tracing_on():
        return _NO_SPAN
    name, attrs = _client_span(call, protocol, backend, model, address)
    return _tracer.start_as_current_span(name, kind=trace.SpanKind.CLIENT, attributes=attrs)


def _client_span(call: Call, protocol: str, backend: str, model: str,
                 address: str) -> tuple[str, dict[str, Any]]:
    parts = urlsplit(address if "://" in address else f"//{address}")
    attrs: dict[str, Any] = {"mmguard.backend": backend,
                             "server.address": parts.hostname or address}
    with contextlib.suppress(ValueError):
        if parts.port is not None:
            attrs["server.port"] = parts.port
    if protocol == "grpc":
        method = "ModelStreamInfer" if call.streaming else "ModelInfer"
        attrs.update({"rpc.system": "grpc", "rpc.service": GRPC_SERVICE, "rpc.method": method})
        return f"{GRPC_SERVICE}/{method}", attrs
    if protocol == "openai":
        op = _GEN_AI_OPERATION.get(call.endpoint, "chat")
        attrs.update({"gen_ai.operation.name": op, "gen_ai.system": "openai",
                      "gen_ai.request.model": model, "http.request.method": "POST",
                      "url.path": call.endpoint})
        return f"{op} {model}", attrs
    if protocol == "http":
        attrs.update({"http.request.method": "POST", "url.path": f"/v2/models/{model}/infer"})
        return "POST", attrs
    attrs["mmguard.runtime"] = protocol  # in-process: no network hop
    return f"{protocol} {model}", attrs


def traced_stream(call: Call, protocol: str, backend: str, model: str, address: str,
                  inner: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A backend stream inside its CLIENT span: the span is current only while the stream is
    being read (each step attaches and detaches it, so no context leaks across the caller's
    awaits), and ends with the stream. With tracing off, the stream itself."""
    if not tracing_on():
        return inner
    name, attrs = _client_span(call, protocol, backend, model, address)
    return _traced(_tracer.start_span(name, kind=trace.SpanKind.CLIENT, attributes=attrs), inner)


async def _traced(span: Any, inner: AsyncIterator[Any]) -> AsyncIterator[Any]:
    from proxy.call import SseEvent

    ctx = trace.set_span_in_context(span)
    try:
        while True:
            token = otel_context.attach(ctx)
            try:
                item = await anext(inner)
            except StopAsyncIteration:
                return
            except Exception as exc:
                span.record_exception(exc)
                span.set_status(trace.StatusCode.ERROR, str(exc))
                raise
            finally:
                otel_context.detach(token)
            if isinstance(item, SseEvent) and (b'"usage"' in item.raw
                                               or b'"finish_reason":"' in item.raw
                                               or b'"finish_reason": "' in item.raw):
                gen_ai_usage(span, item.json())
            yield item
    finally:
        aclose = getattr(inner, "aclose", None)
        if aclose is not None:
            await aclose()
        span.end()


def gen_ai_usage(span: Any, doc: dict[str, Any] | None) -> None:
    """gen_ai.* answer attributes from an OpenAI answer (or a streamed event carrying them)."""
    if not doc or not span.is_recording():
        return
    if isinstance(doc.get("model"), str):
        span.set_attribute("gen_ai.response.model", doc["model"])
    usage = doc.get("usage")
    if isinstance(usage, dict):
        for ours, theirs in (("prompt_tokens", "input_tokens"),
                             ("completion_tokens", "output_tokens")):
            if isinstance(usage.get(ours), int):
                span.set_attribute(f"gen_ai.usage.{theirs}", usage[ours])
    reasons = [c["finish_reason"] for c in doc.get("choices") or []
               if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)]
    if reasons:
        span.set_attribute("gen_ai.response.finish_reasons", reasons)


class _NoSpan:
    def __enter__(self) -> Any:
        return trace.INVALID_SPAN

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()
_tracer = trace.get_tracer("mmguard")
