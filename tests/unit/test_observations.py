"""``Observations`` / ``observe_many`` (proxy/telemetry/metrics.py): values observed in bulk
leave a histogram exactly as one ``observe()`` per value would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from proxy.telemetry.metrics import Observations, observe_many

BUCKETS = (0.001, 0.01, 0.1, 1.0)
VALUES = [0.0, 0.0005, 0.001, 0.0011, 0.01, 0.05, 0.1, 0.5, 1.0, 1.5, 30.0, 0.001, 0.002]


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in registry.collect() for s in m.samples if not s.name.endswith("_created")}


def _histogram() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    return registry, Histogram("gap_seconds", "gaps", ["model"], buckets=BUCKETS,
                               registry=registry)


def test_bulk_equals_one_observe_per_value_on_and_between_the_bounds() -> None:
    one_by_one, h1 = _histogram()
    bulk, h2 = _histogram()
    for v in VALUES:
        h1.labels("m").observe(v)
    observe_many(h2.labels("m"), VALUES)
    assert _samples(bulk) == _samples(one_by_one)
    assert _samples(bulk)[("gap_seconds_count", (("model", "m"),))] == len(VALUES)


def test_observations_flush_every_n_and_at_the_end() -> None:
    registry, h = _histogram()
    gaps = Observations(h.labels("m"), every=5)
    count = ("gap_seconds_count", (("model", "m"),))
    for v in VALUES[:7]:
        gaps.add(v)
    assert _samples(registry)[count] == 5  # the first five, flushed; two held
    gaps.flush()
    assert _samples(registry)[count] == 7
    gaps.flush()  # nothing held: nothing added
    assert _samples(registry)[count] == 7


class _NoFields:
    """A histogram child without the client's fields: value by value."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def observe(self, v: float) -> None:
        self.seen.append(v)


def test_a_child_without_the_fields_is_observed_value_by_value() -> None:
    child = _NoFields()
    observe_many(child, VALUES)
    assert child.seen == VALUES
