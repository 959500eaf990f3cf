"""What the quality filter reads once per request, read the same as when it was read every time:
drift's gauges when only the series a call fed are looked at, and the report's trust score
(kept per report and weights, made anew when an item, the alignment or the weights change)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from filters.quality.drift import DriftConfig, DriftMonitor, drift_gauges
from filters.quality.measure import Signal
from filters.quality.report import Item, Report
from filters.quality.signals import trust_score


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples}


def _calls(rng: random.Random, n: int) -> list[list[tuple[str, str, float]]]:
    """Mixed traffic: a series stuck at 1.0 (its window never changes), a varying one, one fed
    twice by some calls (a batch of two images), one that only some calls carry."""
    calls = []
    for _ in range(n):
        values = [("image", "finite", 1.0), ("image", "sharpness", rng.random())]
        if rng.random() < 0.3:
            values.append(("image", "sharpness", rng.random()))
        if rng.random() < 0.5:
            values.append(("text", "empty", round(rng.random(), 1)))
        values.append(("all", "trust", rng.choice((0.9, 1.0))))
        calls.append(values)
    return calls


def test_observe_all_sets_the_gauges_a_walk_over_every_series_set() -> None:
    cfg = DriftConfig(baseline_size=20, window=10, every=3)
    calls = _calls(random.Random(5), 400)
    new_registry, old_registry = CollectorRegistry(), CollectorRegistry()
    new = DriftMonitor("m", cfg, drift_gauges(new_registry))
    old = DriftMonitor("m", cfg, drift_gauges(old_registry))
    seen = 0
    for i, values in enumerate(calls):
        new.observe_all(values)
        for modality, signal, value in values:  # what observe_all did before: every series
            old.observe(modality, signal, value)
        old.update()
        now = _samples(new_registry)
        assert now == _samples(old_registry), f"call {i}"
        seen = max(seen, len(now))
    assert seen == 8  # every series' two gauges were set along the way
    assert new.dirty and old.dirty  # the baselines completed


def test_a_series_fed_by_observe_is_reported_by_update() -> None:
    registry = CollectorRegistry()
    monitor = DriftMonitor("m", DriftConfig(baseline_size=2, window=2, every=1),
                           drift_gauges(registry))
    for v in (0.1, 0.2, 0.9, 0.9):
        monitor.observe("image", "noise", v)
    labels = {"model": "m", "modality": "image", "signal": "noise"}
    assert registry.get_sample_value("mmguard_input_drift", labels) is None
    monitor.observe_all([("image", "tone", 1.0)])  # another series: noise is not looked at
    assert registry.get_sample_value("mmguard_input_drift", labels) is None
    monitor.update()
    assert registry.get_sample_value("mmguard_input_drift", labels) == pytest.approx(0.75)


def _image(score: float, where: str = "input 'x'") -> Item:
    return Item("image", where, {"finite": Signal(1.0, 0.0, "NaN/Inf values"),
                                 "sharpness": Signal(score, score, "sharpness")})


def test_the_trust_score_is_made_anew_when_the_report_or_the_weights_change() -> None:
    weights = {"visual": 0.4, "text": 0.3, "alignment": 0.3}
    report = Report()
    assert report.trust(weights) is None  # nothing scored yet
    report.add(_image(0.8))
    assert report.trust(weights) == pytest.approx(0.8)
    report.add(_image(0.5, "input 'x' image 1"))  # a weaker image lowers the visual score
    assert report.trust(weights) == pytest.approx(0.5)
    report.add(Item("text", "input 't'", {"empty": Signal(1.0, 0.0, "characters")}))
    assert report.trust(weights) == pytest.approx((0.4 * 0.5 + 0.3 * 1.0) / 0.7)
    report.set_alignment(np.array([0.2], np.float32), "inputs 'x' and 't'")
    assert report.trust(weights) == pytest.approx(0.4 * 0.5 + 0.3 * 1.0 + 0.3 * 0.2)
    other = {"visual": 1.0, "text": 0.0, "alignment": 0.0}
    assert report.trust(other) == pytest.approx(0.5)  # other weights: computed for them
    assert report.trust(weights) == pytest.approx(trust_score(report.parts(), weights))
    # every reader of the report reads that one value
    assert report.score("trust", weights) == report.trust(weights)
    assert report.published(weights)["quality.trust"] == report.trust(weights)
    assert report.summary(weights).startswith(f"trust={report.trust(weights):.3f} ")
    assert list(report.series(weights))[-1] == ("all", "trust", report.trust(weights))


def test_the_header_writes_every_score_to_three_decimals() -> None:
    """Signals at 1.0 are written from a table; the others formatted: the header reads the same."""
    weights = {"visual": 0.4, "text": 0.3, "alignment": 0.3}
    report = Report()
    report.add(Item("image", "input 'x'", {"finite": Signal(1.0, 0.0, "NaN/Inf values"),
                                           "range": Signal(0.99951, 0.0, "range"),
                                           "sharpness": Signal(0.25, 0.1, "sharpness"),
                                           "noise": Signal(1.0, 0.0, "noise")}))
    report.add(Item("text", "input 't'", {"empty": Signal(1.0, 0.0, "characters")}))
    trust = (0.4 * 0.25 + 0.3 * 1.0) / 0.7
    assert report.summary(weights) == (
        f"trust={trust:.3f} image=0.250 text=1.000 finite=1.000 range=1.000 sharpness=0.250 "
        "noise=1.000 empty=1.000")
