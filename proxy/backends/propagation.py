"""What crosses the proxy hop: client metadata that the backend should see, plus W3C trace
context. Transport and hop-by-hop headers stay behind, and so do mmguard's own."""

from __future__ import annotations

from opentelemetry import propagate

from proxy.telemetry.tracing import tracing_on

_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length", "content-type", "user-agent",
    "accept", "accept-encoding", "content-encoding", "expect", "inference-header-content-length",
})


def forward_headers(headers: dict[str, str]) -> dict[str, str]:
    out = {k: v for k, v in headers.items()
           if k not in _HOP and not k.startswith((":", "grpc-", "mmguard-"))}
    # With tracing on, mmguard's current span replaces the client's traceparent as the parent;
    # with it off, the client's W3C headers were kept above and cross unchanged (and there is
    # no context of mmguard's to inject: ~10 µs a call saved).
    if tracing_on():
        propagate.inject(out)
    return out


def forward_metadata(headers: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in forward_headers(headers).items() if not k.endswith("-bin"))
