"""Metrics, traces and logs (``metrics``, ``tracing``, ``logs``, the config block in
``settings``). The names below are the package's interface; import them from here."""

from proxy.telemetry.logs import JsonFormatter, RepeatedFailure, setup_logging
from proxy.telemetry.metrics import (
    JITTER_EVERY,
    JITTER_WINDOW,
    Jitter,
    OneHot,
    RequestMetrics,
    Telemetry,
    gauge_mode,
    pod_exposition,
)
from proxy.telemetry.tracing import (
    GRPC_SERVICE,
    backend_span,
    caused_by,
    end_server_span,
    gen_ai_usage,
    linked_span,
    server_span,
    setup_tracing,
    traced_stream,
    tracing_on,
)

__all__ = ["GRPC_SERVICE", "JITTER_EVERY", "JITTER_WINDOW", "Jitter", "JsonFormatter", "OneHot",
           "RepeatedFailure", "RequestMetrics", "Telemetry", "backend_span", "caused_by",
           "end_server_span", "gauge_mode", "gen_ai_usage", "linked_span", "pod_exposition",
           "server_span", "setup_logging", "setup_tracing", "traced_stream", "tracing_on"]
