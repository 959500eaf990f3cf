"""Metrics, traces and logs, and the one way a filter makes a decision visible.

Metrics use ``prometheus-client`` with a registry per server (tests run several in one process).
Why not OpenTelemetry metrics: the Prometheus exposition is the product here (ServiceMonitor,
alert rules, Grafana), and prometheus-client gives it exactly, with no SDK bridge on the hot path.
Traces use the OpenTelemetry API; the SDK and OTLP exporter are set up only when configured.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy.errors import MAX_HEADER_CHARS, bounded

if TYPE_CHECKING:
    from proxy.call import Call

log = logging.getLogger("mmguard.decision")

# 0.2 s is a bucket edge: the seeds' latency SLO (p99 <= 200 ms) is read off it exactly.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0)
JITTER_WINDOW = 200
"""Requests per model over which the response jitter coefficient (std / mean) is computed."""
JITTER_EVERY = 50


def tracing_on() -> bool:
    """True when an SDK tracer provider is installed. Without one, mmguard makes no spans at
    all (even no-op ones cost ~15 µs each on the hot path) and passes the client's W3C headers
    through unchanged."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.NoOpTracerProvider, trace.ProxyTracerProvider))


class Jitter:
    """The response jitter coefficient (std / mean) over a model's last JITTER_WINDOW
    latencies, recomputed every JITTER_EVERY requests once the window is full."""

    __slots__ = ("gauge", "recent", "since")

    def __init__(self, gauge: Any) -> None:
        self.gauge = gauge
        self.recent: deque[float] = deque(maxlen=JITTER_WINDOW)
        self.since = 0

    def observe(self, seconds: float) -> None:
        self.recent.append(seconds)
        self.since += 1
        if len(self.recent) < JITTER_WINDOW or self.since < JITTER_EVERY:
            return
        self.since = 0
        n = len(self.recent)
        mean = sum(self.recent) / n
        if mean > 0:
            var = sum((x - mean) ** 2 for x in self.recent) / n
            self.gauge.set(var ** 0.5 / mean)


class RequestMetrics(NamedTuple):
    """The label children of one (model, backend, front), looked up once, not per request."""

    latency: Any
    in_flight: Any
    request_bytes: Any
    codes: dict[str, Any]
    jitter: Jitter
    """The model's latency window (shared by its fronts and backends)."""


class Telemetry:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._request_metrics: dict[tuple[str, str, str], RequestMetrics] = {}
        self._jitter: dict[str, Jitter] = {}  # per model, shared by its fronts/backends
        self._extra: dict[str, Any] = {}
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("mmguard_requests_total", "Requests answered, by outcome code.",
                                ["model", "backend", "front", "code"], registry=r)
        self.latency = Histogram("mmguard_request_duration_seconds",
                                 "Time from decoded request to encoded answer.",
                                 ["model", "backend", "front"], buckets=_LATENCY_BUCKETS,
                                 registry=r)
        self.backend_latency = Histogram("mmguard_backend_duration_seconds",
                                         "Time spent waiting for the backend.",
                                         ["model", "backend"], buckets=_LATENCY_BUCKETS,
                                         registry=r)
        self.in_flight = Gauge("mmguard_requests_in_flight", "Requests being served.",
                               ["model", "front"], registry=r)
        self.request_bytes = Counter("mmguard_request_bytes_total", "Request tensor bytes.",
                                     ["model", "front"], registry=r)
        self.response_bytes = Counter("mmguard_response_bytes_total", "Response body bytes.",
                                      ["model", "front"], registry=r)
        self.decisions = Counter("mmguard_filter_decisions_total",
                                 "Decisions filters made (reject, reroute, degrade, inject...).",
                                 ["filter", "model", "decision"], registry=r)
        self.backend_ready = Gauge("mmguard_backend_ready", "1 when the backend is ready.",
                                   ["backend"], registry=r)
        self.ttft = Histogram("mmguard_time_to_first_token_seconds",
                              "Streams: time from request to the first event.",
                              ["model", "backend"], buckets=_LATENCY_BUCKETS, registry=r)
        self.stream_duration = Histogram("mmguard_stream_duration_seconds",
                                         "Streams: time from request to the last event.",
                                         ["model", "backend"], buckets=_LATENCY_BUCKETS,
                                         registry=r)
        self.tokens = Counter("mmguard_tokens_total", "Tokens from the backend's usage report.",
                              ["model", "kind"], registry=r)
        self.finish_reasons = Counter("mmguard_finish_reasons_total",
                                      "Completions by finish_reason (length = cut off).",
                                      ["model", "reason"], registry=r)
        self.jitter = Gauge("mmguard_latency_jitter_coefficient",
                            "Response jitter: std / mean of the model's last "
                            f"{JITTER_WINDOW} request latencies (seeds: warn > 0.25, "
                            "critical > 0.42).", ["model"], registry=r)
        self.config_reloads = Counter("mmguard_config_reloads_total", "Config reload attempts.",
                                      ["result"], registry=r)

    def metric(self, kind: type[Any], name: str, doc: str, labels: list[str]) -> Any:
        """A filter's own metric, made once per registry however many routes use the filter."""
        found = self._extra.get(name)
        if found is None:
            found = self._extra[name] = kind(name, doc, labels, registry=self.registry)
        return found

    def request_metrics(self, model: str, backend: str, front: str) -> RequestMetrics:
        key = (model, backend, front)
        found = self._request_metrics.get(key)
        if found is None:
            found = self._request_metrics[key] = RequestMetrics(
                self.latency.labels(model, backend, front), self.in_flight.labels(model, front),
                self.request_bytes.labels(model, front), {},
                self._jitter.get(model) or self._jitter.setdefault(
                    model, Jitter(self.jitter.labels(model))))
        return found

    def observe_latency(self, m: RequestMetrics, seconds: float) -> None:
        m.latency.observe(seconds)
        m.jitter.observe(seconds)

    def count_request(self, m: RequestMetrics, model: str, backend: str, front: str,
                      code: str) -> None:
        child = m.codes.get(code)
        if child is None:
            child = m.codes[code] = self.requests.labels(model, backend, front, code)
        child.inc()

    def decide(self, call: Call, filter_name: str, decision: str, detail: str = "",
               header: str | None = None, **attributes: Any) -> None:
        """Record one filter decision everywhere at once: the ``mmguard-<filter>`` header /
        trailer (``mmguard-<filter>-<header>`` when a filter makes several kinds of decision;
        the counter's label is then ``<header>:<decision>``), a counter, a span event and a log
        line."""
        value = bounded(f"{decision}; {detail}" if detail else decision, MAX_HEADER_CHARS)
        name = f"mmguard-{filter_name}" + (f"-{header}" if header else "")
        call.decisions[name] = value
        if header:
            decision = f"{header}:{decision}"
        self.decisions.labels(filter_name, call.model, decision).inc()
        attrs = {"mmguard.filter": filter_name, "mmguard.decision": decision,
                 "mmguard.model": call.model, **{f"mmguard.{k}": v for k, v in attributes.items()}}
        if detail:
            attrs["mmguard.detail"] = detail
        trace.get_current_span().add_event(f"{filter_name}.{decision}", attributes=attrs)
        log.info("%s %s on model %r%s", filter_name, decision, call.model,
                 f": {detail}" if detail else "", extra={"fields": attrs})


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


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            out["trace_id"] = format(span.trace_id, "032x")
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("mmguard")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
