"""Input drift: each quality signal's recent distribution against a baseline.

Guards against the silent kind of failure: nothing errors, yet the inputs change (a new camera, a
new OCR front end, a client that starts sending screenshots) and the model's answers degrade with
them. Seed KPI: input drift as the Wasserstein distance between time slices, warning above 0.15,
critical above 0.28, with a healthy baseline of 0.03 ± 0.02. Signals are compared as scores in
[0, 1], so those thresholds read the same for every signal.

For every series (a modality's signal, a modality score, alignment, trust) the first
``baseline_size`` values become the baseline, unless a baseline file already holds one; it is
then written to the file (atomically) so it survives restarts and reloads. After that a sliding
window of the last ``window`` values is compared with the baseline every ``every`` new values by
the 1-Wasserstein distance and the two-sample Kolmogorov–Smirnov statistic (numpy only), and
both are exported: ``mmguard_input_drift{model,modality,signal}`` (Wasserstein) and
``mmguard_input_drift_ks{model,modality,signal}``.

Rules that MUST hold: a series reports nothing until its baseline is complete and its window is
full; the same registry gets one set of gauges however many routes use the filter.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from prometheus_client import CollectorRegistry, Gauge
from pydantic import Field

from proxy.files import DATA_BYTES, read_bounded
from proxy.pod.state import POD, Role, Shared, decided
from proxy.strict import Strict

log = logging.getLogger("mmguard.quality.drift")
_FORMAT = 1  # baseline file format version


class DriftConfig(Strict):
    baseline_size: int = Field(500, ge=2)
    """Values per series that form the baseline (the first ones seen, unless the file has them)."""
    window: int = Field(200, ge=2)
    """Most recent values compared with the baseline."""
    every: int = Field(16, ge=1)
    """Recompute a series' distances after this many new values (bounds the cost per request)."""
    baseline_file: Path | None = None
    """JSON file the baseline is loaded from and saved to; one file per route."""


def compare(baseline: NDArray[np.float64], window: NDArray[np.float64]) -> tuple[float, float]:
    """(1-Wasserstein distance, KS statistic) between two samples; ``baseline`` sorted.
    Both come from the two empirical CDFs evaluated on the merged support (as scipy does)."""
    recent = np.sort(window)
    support = np.sort(np.concatenate((baseline, recent)))
    cdf_a = np.searchsorted(baseline, support, side="right") / baseline.size
    cdf_b = np.searchsorted(recent, support, side="right") / recent.size
    gap = np.abs(cdf_a - cdf_b)
    w1 = float(np.sum(gap[:-1] * np.diff(support)))
    return w1, float(gap.max())


class Series:
    """One signal's baseline and sliding window."""

    __slots__ = ("baseline", "changed", "learning", "pending", "window")

    def __init__(self, window: int, baseline: list[float] | None = None) -> None:
        self.learning: list[float] = []
        self.baseline: NDArray[np.float64] | None = (
            np.sort(np.asarray(baseline, np.float64)) if baseline else None)
        self.window: deque[float] = deque(maxlen=window)
        self.pending = 0
        self.changed = True
        """The window holds other values than at the last ``distances`` (a value that
        replaces an equal one changes nothing: most signals of clean inputs sit at 1.0)."""

    def observe(self, value: float, baseline_size: int) -> bool:
        """Add a value; True when this value completed the baseline."""
        if self.baseline is None:
            self.learning.append(value)
            if len(self.learning) < baseline_size:
                return False
            self.baseline = np.sort(np.asarray(self.learning, np.float64))
            self.learning = []
            return True
        window = self.window
        if not self.changed and (len(window) < (window.maxlen or 0) or window[0] != value):
            self.changed = True
        window.append(value)
        self.pending += 1
        return False

    def due(self, every: int) -> bool:
        return (self.baseline is not None and self.window.maxlen is not None
                and len(self.window) == self.window.maxlen and self.pending >= every)

    def distances(self) -> tuple[float, float] | None:
        """(Wasserstein, KS) against the baseline; None when the window holds the same values
        as at the last call (the distances are those already reported)."""
        assert self.baseline is not None
        self.pending = 0
        if not self.changed:
            return None
        self.changed = False
        return compare(self.baseline, np.fromiter(self.window, np.float64, len(self.window)))


@dataclass(frozen=True)
class DriftGauges:
    wasserstein: Any
    ks: Any


_GAUGES: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, DriftGauges]] = (
    weakref.WeakKeyDictionary())


def drift_gauges(registry: CollectorRegistry, name: str = "mmguard_input_drift",
                 what: str = "a quality signal's recent window (scores in [0,1])",
                 labels: tuple[str, str, str] = ("model", "modality", "signal")) -> DriftGauges:
    """The registry's one pair of gauges ``<name>`` (Wasserstein) and ``<name>_ks`` for a
    family of series (prometheus-client refuses a second registration)."""
    per_registry = _GAUGES.setdefault(registry, {})
    found = per_registry.get(name)
    if found is None:
        found = per_registry[name] = DriftGauges(
            Gauge(name, f"Wasserstein distance between {what} and its baseline.", list(labels),
                  multiprocess_mode="livemostrecent",
                  registry=registry),
            Gauge(f"{name}_ks", f"Kolmogorov-Smirnov statistic between {what} and its "
                  "baseline.", list(labels), multiprocess_mode="livemostrecent",
                  registry=registry))
    return found


class DriftMonitor(Shared):
    """Every series of one route, keyed by (modality, signal).

    In a pod of several workers (``proxy.pod.state``) the supervisor holds the one baseline and
    window per series, on every worker's values (``observe_all`` is forwarded), sets the gauges
    and saves the baseline file; a worker's replica holds nothing."""

    def __init__(self, model: str, cfg: DriftConfig, gauges: DriftGauges) -> None:
        self.model = model
        self.cfg = cfg
        self.gauges = gauges
        self.series: dict[tuple[str, str], Series] = {}
        self._loaded = self._load() if cfg.baseline_file is not None else {}
        self.dirty = False
        """A baseline completed since the last save."""

    def observe(self, modality: str, signal: str, value: float) -> None:
        key = (modality, signal)
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = Series(self.cfg.window, self._loaded.get(key))
        if series.observe(value, self.cfg.baseline_size):
            self.dirty = True

    @decided
    def observe_all(self, values: list[tuple[str, str, float]]) -> None:
        """One call's values; the gauges that are due. A pod's supervisor also saves a baseline
        that just completed (small, once); elsewhere the filter saves it off the loop.

        Only the series this call fed can have fallen due (a series falls due when a value
        arrives, and ``distances`` clears it), so only those are looked at: every series of
        the route was walked after every call before, most of them for nothing. A series fed
        through ``observe`` is reported by ``update``."""
        found = self.series
        size, every = self.cfg.baseline_size, self.cfg.every
        due: list[tuple[tuple[str, str], Series]] = []
        for modality, signal, value in values:
            key = (modality, signal)
            series = found.get(key)
            if series is None:
                series = found[key] = Series(self.cfg.window, self._loaded.get(key))
            if series.observe(value, size):
                self.dirty = True
            elif series.pending >= every and series.due(every):
                due.append((key, series))
        for (modality, signal), series in due:
            if series.due(every):  # a series fed twice by one call is listed twice
                self._report(modality, signal, series)
        if POD.role is Role.SUPERVISOR and self.dirty and self.cfg.baseline_file is not None:
            self.dirty = False
            try:
                self.save(self.snapshot())
            except OSError as exc:
                log.warning("drift: cannot save the baseline to %s: %s",
                            self.cfg.baseline_file, exc)

    def export_state(self) -> dict[str, Any]:
        return {}  # nothing on the request path reads it

    def import_state(self, state: dict[str, Any]) -> None:
        pass

    def update(self) -> None:
        """Recompute the series that are due and set their gauges."""
        for (modality, signal), series in self.series.items():
            if series.due(self.cfg.every):
                self._report(modality, signal, series)

    def _report(self, modality: str, signal: str, series: Series) -> None:
        """A due series' distances on its gauges (unchanged when its window is)."""
        if (found := series.distances()) is not None:
            w1, ks = found
            self.gauges.wasserstein.labels(self.model, modality, signal).set(w1)
            self.gauges.ks.labels(self.model, modality, signal).set(ks)

    def snapshot(self) -> dict[str, Any]:
        """The baselines learned so far, as the file stores them."""
        return {"format": _FORMAT, "model": self.model, "series": {
            f"{m}/{s}": [round(float(v), 6) for v in series.baseline]
            for (m, s), series in sorted(self.series.items()) if series.baseline is not None}}

    def save(self, doc: dict[str, Any]) -> None:
        """Write a snapshot atomically (blocking: the filter calls it in a worker thread)."""
        path = self.cfg.baseline_file
        assert path is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _load(self) -> dict[tuple[str, str], list[float]]:
        path = self.cfg.baseline_file
        assert path is not None
        if not path.exists():
            return {}
        try:
            doc = json.loads(read_bounded(path, DATA_BYTES))  # a regular file, bounded
            if doc.get("format") != _FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, expected {_FORMAT}")
            out: dict[tuple[str, str], list[float]] = {}
            for key, values in doc["series"].items():
                modality, _, signal = key.partition("/")
                if len(values) >= 2:
                    out[(modality, signal)] = [float(v) for v in values]
            return out
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # A baseline we cannot read is relearned (and the file rewritten) rather than
            # keeping the route from starting.
            log.warning("quality drift baseline %s is unreadable (%s); learning a new one",
                        path, exc)
            return {}
