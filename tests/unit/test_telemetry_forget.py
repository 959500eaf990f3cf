"""``Telemetry.forget``: what a reload removed leaves no gauge series; what it kept (a route
moved to another backend keeps its name) keeps its own; a route that comes back is exported
again (no cached child left writing to a series that is no longer shown)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.telemetry import Telemetry


def _series(t: Telemetry, name: str) -> set[tuple[tuple[str, str], ...]]:
    return {tuple(sorted(s.labels.items())) for m in t.registry.collect() for s in m.samples
            if s.name == name}


def test_forget_removes_what_went_and_keeps_what_stayed() -> None:
    t = Telemetry(CollectorRegistry())
    breaker = t.metric(Gauge, "mmguard_test_breaker", "a filter's gauge", ["model", "level"])
    answers = t.metric(Counter, "mmguard_test_answers", "a filter's counter", ["model"])
    for name in ("a", "b"):
        t.backend_ready.labels(name).set(1)
    for route, backend in (("kept", "a"), ("gone", "b"), ("moved", "b")):
        t.route_ready.labels(route, backend).set(1)
        breaker.labels(route, "primary").set(1)
        answers.labels(route).inc()
        t.observe_latency(t.request_metrics(route, backend, "http"), 0.01)

    t.forget(routes={"gone"}, pairs={("gone", "b"), ("moved", "b")}, backends={"b"})

    assert _series(t, "mmguard_backend_ready") == {(("backend", "a"),)}
    assert _series(t, "mmguard_route_ready") == {(("backend", "a"), ("model", "kept"))}
    assert _series(t, "mmguard_test_breaker") == {
        (("level", "primary"), ("model", "kept")), (("level", "primary"), ("model", "moved"))}
    assert {dict(s)["model"] for s in _series(t, "mmguard_latency_jitter_coefficient")} == \
        {"kept", "moved"}
    assert {dict(s)["model"] for s in _series(t, "mmguard_test_answers_total")} == \
        {"kept", "gone", "moved"}  # counters keep their totals

    # the route comes back: its series are exported again, not written to a forgotten child
    t.observe_latency(t.request_metrics("gone", "a", "http"), 0.01)
    assert "gone" in {dict(s)["model"] for s in _series(t, "mmguard_latency_jitter_coefficient")}
