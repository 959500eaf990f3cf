"""Traces: the OpenTelemetry API, with the SDK and OTLP exporter set up only when configured;
span names and attributes in OpenTelemetry's semantic conventions."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv._incubating.attributes import rpc_attributes as rpc
from opentelemetry.semconv.attributes import error_attributes as error_attrs
from opentelemetry.semconv.attributes import http_attributes as http_attrs
from opentelemetry.semconv.attributes import server_attributes as server
from opentelemetry.semconv.attributes import url_attributes as url

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
# Every key and enumerated value is the semantic-conventions package's constant, never typed by
# hand (tests/unit/test_semconv.py fails on a key the package marks deprecated).

GRPC_SERVICE = "inference.GRPCInferenceService"
_GRPC = rpc.RpcSystemNameValues.GRPC.value
_OPENAI = gen_ai.GenAiProviderNameValues.OPENAI.value
_CHAT = gen_ai.GenAiOperationNameValues.CHAT.value
_GEN_AI_OPERATION = {"/v1/chat/completions": _CHAT,
                     "/v1/completions": gen_ai.GenAiOperationNameValues.TEXT_COMPLETION.value,
                     "/v1/embeddings": gen_ai.GenAiOperationNameValues.EMBEDDINGS.value,
                     "/pooling": gen_ai.GenAiOperationNameValues.EMBEDDINGS.value}
"""The gen_ai operation of each OpenAI endpoint (others, /v1/responses included: chat)."""


def _grpc_method(call: Call) -> str:
    """The fully qualified method (``rpc.method``), also the span name."""
    return f"{GRPC_SERVICE}/{'ModelStreamInfer' if call.streaming else 'ModelInfer'}"


def server_span(call: Call, scheme: str = "http") -> tuple[str, dict[str, Any]]:
    """The name and attributes of the span for one request as mmguard received it
    (``scheme``: the HTTP listener's, ``http`` or ``https``)."""
    attrs: dict[str, Any] = {"mmguard.model": call.model}
    if call.front == "grpc":
        method = _grpc_method(call)
        attrs.update({rpc.RPC_SYSTEM_NAME: _GRPC, rpc.RPC_METHOD: method})
        return method, attrs
    if call.front == "openai":
        route = call.endpoint or "/v1/chat/completions"
        attrs.update({http_attrs.HTTP_REQUEST_METHOD: "POST", http_attrs.HTTP_ROUTE: route,
                      url.URL_PATH: route, url.URL_SCHEME: scheme,
                      gen_ai.GEN_AI_OPERATION_NAME: _GEN_AI_OPERATION.get(route, _CHAT),
                      gen_ai.GEN_AI_PROVIDER_NAME: _OPENAI,
                      gen_ai.GEN_AI_REQUEST_MODEL: call.model})
        return f"POST {route}", attrs
    version = f"/versions/{call.version}" if call.version else ""
    verb = f"/{call.endpoint or 'infer'}"  # infer, generate or generate_stream
    route = "/v2/models/{model_name}" + ("/versions/{model_version}" if version else "") + verb
    attrs.update({http_attrs.HTTP_REQUEST_METHOD: "POST", http_attrs.HTTP_ROUTE: route,
                  url.URL_PATH: f"/v2/models/{call.model}{version}{verb}",
                  url.URL_SCHEME: scheme})
    return f"POST {route}", attrs


def end_server_span(span: Any, call: Call, kind_value: str | None, http_status: int,
                    grpc_code: grpc.StatusCode) -> None:
    """Status attributes once the answer is known (kind_value None: a success)."""
    if call.front == "grpc":
        span.set_attribute(rpc.RPC_RESPONSE_STATUS_CODE, grpc_code.name)
    else:
        span.set_attribute(http_attrs.HTTP_RESPONSE_STATUS_CODE, http_status)
    if kind_value is not None:
        span.set_attribute(error_attrs.ERROR_TYPE, kind_value)


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
                             server.SERVER_ADDRESS: parts.hostname or address}
    with contextlib.suppress(ValueError):
        if parts.port is not None:
            attrs[server.SERVER_PORT] = parts.port
    if protocol == "grpc":
        method = _grpc_method(call)
        attrs.update({rpc.RPC_SYSTEM_NAME: _GRPC, rpc.RPC_METHOD: method})
        return method, attrs
    if protocol == "openai":
        op = _GEN_AI_OPERATION.get(call.endpoint, _CHAT)
        attrs.update({gen_ai.GEN_AI_OPERATION_NAME: op, gen_ai.GEN_AI_PROVIDER_NAME: _OPENAI,
                      gen_ai.GEN_AI_REQUEST_MODEL: model, http_attrs.HTTP_REQUEST_METHOD: "POST",
                      url.URL_FULL: f"{address.rstrip('/')}{call.endpoint}"})
        return f"{op} {model}", attrs
    if protocol == "http":
        attrs.update({http_attrs.HTTP_REQUEST_METHOD: "POST",
                      url.URL_FULL: f"{address.rstrip('/')}/v2/models/{model}/infer"})
        return "POST", attrs
    attrs["mmguard.runtime"] = protocol  # in-process: no network hop
    return f"{protocol} {model}", attrs


def caused_by() -> trace.SpanContext | None:
    """The current span's context, to link work it causes off the request path (None with
    tracing off)."""
    if not tracing_on():
        return None
    ctx = trace.get_current_span().get_span_context()
    return ctx if ctx.is_valid else None


def linked_span(name: str, cause: trace.SpanContext | None, **attributes: Any) -> Any:
    """A span in a trace of its own, linked to the request that caused it: what a mirrored or
    perturbed copy runs in, so that no request's trace swallows the copies of later ones and
    their log lines carry their own trace id. A no-op context manager when tracing is off."""
    if not tracing_on():
        return _NO_SPAN
    links = [trace.Link(cause)] if cause is not None else []
    return _tracer.start_as_current_span(name, context=otel_context.Context(),
                                         kind=trace.SpanKind.INTERNAL, links=links,
                                         attributes=attributes)


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
        span.set_attribute(gen_ai.GEN_AI_RESPONSE_MODEL, doc["model"])
    usage = doc.get("usage")
    if isinstance(usage, dict):
        for ours, theirs in (("prompt_tokens", gen_ai.GEN_AI_USAGE_INPUT_TOKENS),
                             ("completion_tokens", gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS)):
            if isinstance(usage.get(ours), int):
                span.set_attribute(theirs, usage[ours])
    reasons = [c["finish_reason"] for c in doc.get("choices") or []
               if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)]
    if reasons:
        span.set_attribute(gen_ai.GEN_AI_RESPONSE_FINISH_REASONS, reasons)


class _NoSpan:
    def __enter__(self) -> Any:
        return trace.INVALID_SPAN

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()
_tracer = trace.get_tracer("mmguard")
