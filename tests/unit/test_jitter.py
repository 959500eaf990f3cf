"""The response jitter coefficient (std / mean latency over a model's last requests)."""

from __future__ import annotations

import numpy as np

from proxy.telemetry import JITTER_EVERY, JITTER_WINDOW, Telemetry


def gauge(t: Telemetry, model: str) -> float | None:
    return t.registry.get_sample_value("mmguard_latency_jitter_coefficient", {"model": model})


def test_jitter_is_std_over_mean_of_the_last_window() -> None:
    t = Telemetry()
    m = t.request_metrics("clip", "ort", "grpc")
    rng = np.random.default_rng(0)
    values = rng.uniform(0.01, 0.03, JITTER_WINDOW + 3 * JITTER_EVERY)
    for v in values[:JITTER_WINDOW - 1]:
        t.observe_latency(m, float(v))
    assert gauge(t, "clip") in (None, 0.0)  # not a full window yet: nothing said
    for v in values[JITTER_WINDOW - 1:]:
        t.observe_latency(m, float(v))
    window = values[-JITTER_WINDOW:]
    assert gauge(t, "clip") is not None
    # recomputed every JITTER_EVERY requests: the last value is the window's exact figure
    assert abs(gauge(t, "clip") - np.std(window) / np.mean(window)) < 1e-9
    # a steady model has none; another front of the same model shares the window
    steady = t.request_metrics("steady", "ort", "http")
    for _ in range(JITTER_WINDOW):
        t.observe_latency(steady, 0.02)
    assert gauge(t, "steady") is not None and gauge(t, "steady") < 1e-9  # type: ignore[operator]
    other = t.request_metrics("clip", "ort", "http")
    assert other.jitter is m.jitter
