"""Metrics, and the one way a filter makes a decision visible (``Telemetry.decide``).

Metrics use ``prometheus-client`` with a registry per server (tests run several in one process).
Why not OpenTelemetry metrics: the Prometheus exposition is the product here (ServiceMonitor,
alert rules, Grafana), and prometheus-client gives it exactly, with no SDK bridge on the hot path.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import random
from collections import deque
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from opentelemetry import trace
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector

from proxy.call import TREATMENT
from proxy.errors import header_value

if TYPE_CHECKING:
    from proxy.call import Call
    from proxy.telemetry.settings import TelemetryConfig

log = logging.getLogger("mmguard.decision")
access_log = logging.getLogger("mmguard.access")

# A `_created` series per counter and histogram child doubles the series count and no rule or
# panel reads it.
disable_created_metrics()  # type: ignore[no-untyped-call]

# 0.2 s is a bucket edge: the seeds' latency SLO (p99 <= 200 ms) is read off it exactly.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0)
JITTER_WINDOW = 200
MAX_CACHED_CHILDREN = 4096
"""Counter children ``Telemetry.child`` keeps looked up."""
"""Requests per model over which the response jitter coefficient (std / mean) is computed."""
JITTER_EVERY = 50


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


class OneHot:
    """A state as one gauge child per state, the current one at 1 and the others at 0.

    Why not a number per state: ``max``/``sum`` across pods of "0 closed, 1 open, 3 forced open"
    mean nothing (one forced-open pod and one closed pod read as "3"); ``sum by (state)`` of a
    one-hot gauge is the number of pods in each state."""

    __slots__ = ("gauge", "states")

    def __init__(self, gauge: Any, states: Sequence[str]) -> None:
        self.gauge = gauge
        self.states = tuple(states)

    def set(self, labels: Sequence[str], state: str) -> None:
        if state not in self.states:
            raise ValueError(f"state {state!r} is not one of {self.states}")
        for s in self.states:
            self.gauge.labels(*labels, s).set(1 if s == state else 0)


class RequestMetrics(NamedTuple):
    """The label children of one (model, backend, front), looked up once, not per request."""

    latency: Any
    in_flight: Any
    request_bytes: Any
    codes: dict[str, Any]
    jitter: Jitter
    """The model's latency window (shared by its fronts and backends)."""


_SUMMED = {"mmguard_requests_in_flight", "mmguard_shm_regions", "mmguard_shm_handoff_slots",
           "mmguard_shm_handoff_slots_in_use", "mmguard_answer_cache_bytes",
           "mmguard_quality_residue_kept_bytes"}
"""Gauges that count something each worker of a pod has: the pod's value is their sum."""
_WORST = {"mmguard_backend_ready": "livemin", "mmguard_route_ready": "livemin",
          "mmguard_latency_jitter_coefficient": "livemax"}


def gauge_mode(name: str) -> Any:
    """How a pod's ``/metrics`` merges a gauge over its processes (prometheus-client
    multiprocess mode; ignored in a single process): counts each worker has are summed; a
    backend is ready when every worker sees it ready; jitter is the worst worker's; control
    state (breakers, verdicts, experiments, router weights), which every process holds the same,
    is the value set last."""
    if name in _SUMMED:
        return "livesum"
    return _WORST.get(name, "livemostrecent")


def pod_exposition(metrics_dir: str) -> CollectorRegistry:
    """A pod supervisor's ``/metrics``: every process's metrics from the multiprocess files."""
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=metrics_dir)  # type: ignore[no-untyped-call]
    return registry


class Telemetry:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._request_metrics: dict[tuple[str, str, str], RequestMetrics] = {}
        self._jitter: dict[str, Jitter] = {}  # per model, shared by its fronts/backends
        self._extra: dict[str, Any] = {}
        r = self.registry = registry or CollectorRegistry()
        self.exposition = r
        """What ``/metrics`` shows: this registry, or for a pod's supervisor every process's
        metrics (``pod_exposition``)."""
        self.access_sample = 0.0
        self._access_rng = random.Random()
        # The default collectors, on this server's own registry: CPU seconds, resident memory,
        # open file descriptors (process_*), the Python version and GC counts.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
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
                               ["model", "front"], registry=r,
                               multiprocess_mode=gauge_mode("mmguard_requests_in_flight"))
        self.request_bytes = Counter("mmguard_request_bytes_total", "Request tensor bytes.",
                                     ["model", "front"], registry=r)
        self.response_bytes = Counter("mmguard_response_bytes_total", "Response body bytes.",
                                      ["model", "front"], registry=r)
        self.decisions = Counter("mmguard_filter_decisions_total",
                                 "Decisions filters made (reject, reroute, degrade, inject...).",
                                 ["filter", "model", "decision"], registry=r)
        self._children: dict[tuple[Any, ...], Any] = {}
        """(counter, *labels) → its child (``child``): counters' children are never removed,
        so a cached child stays the shown series."""
        self.backend_ready = Gauge("mmguard_backend_ready", "1 when the backend is ready.",
                                   ["backend"], registry=r,
                                   multiprocess_mode=gauge_mode("mmguard_backend_ready"))
        self.route_ready = Gauge("mmguard_route_ready", "1 when the route's backend is ready "
                                 "and its contract known; 0 from start-up until then.",
                                 ["model", "backend"], registry=r,
                                 multiprocess_mode=gauge_mode("mmguard_route_ready"))
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
                            "critical > 0.42).", ["model"], registry=r,
                            multiprocess_mode=gauge_mode("mmguard_latency_jitter_coefficient"))
        self.inter_token = Histogram("mmguard_inter_token_latency_seconds",
                                     "Streams: time between two events of one answer (vLLM's "
                                     "inter-token latency as the client sees it).",
                                     ["model", "backend"], buckets=_LATENCY_BUCKETS, registry=r)
        self.config_reloads = Counter("mmguard_config_reloads_total", "Config reload attempts.",
                                      ["result"], registry=r)
        # Known label values start at 0: increase() over a child that first appears at 1 is 0,
        # so the first rejected reload would never alert.
        for result in ("applied", "rejected"):
            self.config_reloads.labels(result)

    def configure(self, cfg: TelemetryConfig) -> None:
        """Settings that follow the config (and its reloads)."""
        self.access_sample = cfg.access_log_sample

    def forget(self, routes: Collection[str], pairs: Collection[tuple[str, str]],
               backends: Collection[str]) -> None:
        """Delete the gauge series of what a reload removed: routes, (route, backend) pairs (a
        route moved to another backend) and backends. That is readiness, jitter, and every
        filter gauge labelled by ``model`` or ``route`` (a route's name) or ``backend``. A gauge
        keeps its last value, so a series left behind would say a backend nothing uses is
        down (or up) for ever. Counters are kept: their totals stay true. (A pod's
        multiprocess files cannot forget a value: there the series reads on.)"""
        gone_routes, gone_pairs, gone_backends = set(routes), set(pairs), set(backends)
        for model in gone_routes:  # cached children would write to series no longer shown
            self._jitter.pop(model, None)
        for key in [k for k in self._request_metrics if k[0] in gone_routes]:
            del self._request_metrics[key]
        gauges = [self.backend_ready, self.route_ready, self.jitter,
                  *(g for g in self._extra.values() if isinstance(g, Gauge))]
        for gauge in gauges:
            names: tuple[str, ...] = tuple(gauge._labelnames)
            for family in gauge.collect():
                for sample in family.samples:
                    labels = sample.labels
                    route = labels.get("model", labels.get("route"))
                    backend = labels.get("backend")
                    stale = ((route, backend) in gone_pairs if route is not None
                             and backend is not None
                             else route in gone_routes if route is not None
                             else backend in gone_backends)
                    if stale:
                        with contextlib.suppress(KeyError):  # a histogram-like second sample
                            gauge.remove(*(labels[n] for n in names))

    def one_hot(self, name: str, doc: str, labels: list[str], states: Sequence[str]) -> OneHot:
        """A filter's state gauge, one child per state (label ``state``)."""
        return OneHot(self.metric(Gauge, name, doc, [*labels, "state"]), states)

    def metric(self, kind: type[Any], name: str, doc: str, labels: list[str]) -> Any:
        """A filter's own metric, made once per registry however many routes use the filter."""
        found = self._extra.get(name)
        if found is None:
            extra = {"multiprocess_mode": gauge_mode(name)} if kind is Gauge else {}
            found = self._extra[name] = kind(name, doc, labels, registry=self.registry, **extra)
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

    def child(self, counter: Counter, *labels: str) -> Any:
        """``counter.labels(*labels)``, looked up once per label set (``labels()`` takes a lock
        and builds a key on every call); at most ``MAX_CACHED_CHILDREN`` kept (a label can be a
        backend's word, e.g. a finish reason): past that, looked up each time."""
        key = (counter, *labels)
        found = self._children.get(key)
        if found is None:
            found = counter.labels(*labels)
            if len(self._children) < MAX_CACHED_CHILDREN:
                self._children[key] = found
        return found

    def count_response_bytes(self, model: str, front: str, size: int) -> None:
        """An answer's body bytes on ``mmguard_response_bytes_total``."""
        self.child(self.response_bytes, model, front).inc(size)

    def observe_latency(self, m: RequestMetrics, seconds: float) -> None:
        m.latency.observe(seconds)
        m.jitter.observe(seconds)

    def count_request(self, m: RequestMetrics, model: str, backend: str, front: str,
                      code: str) -> None:
        child = m.codes.get(code)
        if child is None:
            child = m.codes[code] = self.requests.labels(model, backend, front, code)
        child.inc()

    def access(self, call: Call, code: str, seconds: float) -> None:
        """The sampled access log: one INFO line for a share ``telemetry.access_log_sample`` of
        requests (0, the default, writes none; every decision is in headers, metrics, spans)."""
        if self.access_sample <= 0 or self._access_rng.random() >= self.access_sample:
            return
        access_log.info("%s %s %s %.1f ms", call.front, call.model, code, seconds * 1000,
                        extra={"fields": {"model": call.model, "front": call.front, "code": code,
                                          "duration_ms": round(seconds * 1000, 3),
                                          "decisions": dict(call.decisions),
                                          "sample": self.access_sample}})

    def decide(self, call: Call, filter_name: str, decision: str, detail: str = "",
               header: str | None = None, treatment: bool = False, **attributes: Any) -> None:
        """Record one filter decision everywhere at once: the ``mmguard-<filter>`` header /
        trailer (``mmguard-<filter>-<header>`` when a filter makes several kinds of decision;
        the counter's label is then ``<header>:<decision>``), a counter, a span event and a
        DEBUG log line (decisions are per request: at INFO they would be a log line per request;
        the sampled access log carries them at INFO when asked for). ``treatment``: the header
        reveals the call's treatment (mirrored, faulted) and reaches only clients of a listener
        that shows treatment (``Call.shown_decisions``); counter, span and log are the
        operator's and always get it."""
        value = header_value(f"{decision}; {detail}" if detail else decision)
        name = f"mmguard-{filter_name}" + (f"-{header}" if header else "")
        call.decisions[name] = value
        if treatment:
            call.state.setdefault(TREATMENT, set).add(name)
        if header:
            decision = f"{header}:{decision}"
        labels = (filter_name, call.model, decision)
        self.child(self.decisions, *labels).inc()
        span = trace.get_current_span()
        debug = log.isEnabledFor(logging.DEBUG)
        if not (debug or span.is_recording()):
            return  # no span to add to and no log line: the attributes would go nowhere
        attrs = {"mmguard.filter": filter_name, "mmguard.decision": decision,
                 "mmguard.model": call.model, **{f"mmguard.{k}": v for k, v in attributes.items()}}
        if detail:
            attrs["mmguard.detail"] = detail
        span.add_event(f"{filter_name}.{decision}", attributes=attrs)
        if debug:
            log.debug("%s %s on model %r%s", filter_name, decision, call.model,
                      f": {detail}" if detail else "", extra={"fields": attrs})


class Observations:
    """Values for one histogram child, observed in bulk every ``every`` values and on
    ``flush()``: a stream's inter-token gaps, one per event, cost one bucket search each
    instead of a locked ``observe()`` each (~5 µs, the largest per-event metric cost)."""

    __slots__ = ("child", "every", "values")

    def __init__(self, child: Any, every: int = 64) -> None:
        self.child = child
        self.every = every
        self.values: list[float] = []

    def add(self, value: float) -> None:
        self.values.append(value)
        if len(self.values) >= self.every:
            self.flush()

    def repeat(self, value: float, times: int) -> None:
        """``add(value)`` ``times`` times."""
        self.values.extend([value] * times)
        if len(self.values) >= self.every:
            self.flush()

    def flush(self) -> None:
        values, self.values = self.values, []
        if values:
            observe_many(self.child, values)


def observe_many(child: Any, values: Sequence[float]) -> None:
    """``child.observe(v)`` for each value, as one update of each bucket touched (through the
    client's histogram fields; value by value where a client version lacks them)."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            child.observe(v)
        return
    counts: dict[int, int] = {}
    for v in values:
        i = bisect.bisect_left(bounds, v)  # the first bound >= v: observe()'s "v <= bound"
        counts[i] = counts.get(i, 0) + 1
    total.inc(sum(values))
    for i, n in counts.items():
        buckets[min(i, len(buckets) - 1)].inc(n)
