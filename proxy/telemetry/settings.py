"""The ``telemetry:`` block of the config: log level and format, trace export, access log."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proxy.strict import Strict


class TelemetryConfig(Strict):
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "text"] = "json"
    otlp_endpoint: str | None = None
    """OTLP/gRPC collector for traces; tracing export is off without it."""
    service_name: str = "mmguard"
    access_log_sample: float = Field(0.0, ge=0, le=1)
    """Share of requests that write an access log line at INFO (0: none, the default; every
    decision is still a header, a metric and a span event, and a DEBUG log line)."""
