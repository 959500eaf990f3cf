"""The verdict over a sliding window of comparisons: promote, hold or abort."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from pydantic import Field, model_validator

from filters.compare.answers import (
    Comparison,
    State,
)
from proxy.clock import Clock
from proxy.strict import Strict


class VerdictConfig(Strict):
    window: int = Field(200, gt=0)
    """The verdict judges the last ``window`` comparisons (and as many primary self-comparisons)."""
    window_s: float | None = Field(None, gt=0)
    """Also forget samples older than this many seconds; None: only the count bounds them."""
    min_samples: int = Field(20, ge=1)
    """Below this many comparisons the state is ``collecting``; also the number of
    primary self-comparisons needed before the noise floor is used."""
    promote_agreement: float = Field(0.995, ge=0, le=1)
    """Effective agreement at or above which the canary may be promoted (the correctness SLI)."""
    abort_agreement: float = Field(0.95, ge=0, le=1)
    """Effective agreement below which the canary is aborted; in between: hold."""
    max_latency_ratio: float | None = Field(1.5, gt=0)
    """Canary p99 latency / primary p99 latency above this aborts (judged once ``min_samples``
    canary latencies are in the window). None: latency is not judged."""
    noise_floor: bool = True
    """Judge the canary against what the primary agrees with itself (see ``Verdict``), once
    ``min_samples`` primary-vs-primary comparisons are in the window."""
    min_self_agreement: float = Field(0.5, ge=0, le=1)
    """A primary that agrees with itself less than this cannot tell a good canary from a bad
    one: the verdict holds (never promotes, and aborts on latency only) while that lasts; the
    comparison's tolerances are tighter than the model's own noise."""

    @model_validator(mode="after")
    def _ordered(self) -> VerdictConfig:
        if self.abort_agreement > self.promote_agreement:
            raise ValueError(f"abort_agreement {self.abort_agreement} is above "
                             f"promote_agreement {self.promote_agreement}")
        if self.min_samples > self.window:
            raise ValueError(f"min_samples {self.min_samples} can never be reached in a window "
                             f"of {self.window}")
        return self


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float
    agree: bool
    metrics: dict[str, float]
    primary_s: float
    canary_s: float | None


@dataclass(frozen=True, slots=True)
class _Figures:
    samples: int
    agreed: int
    agreement: float | None
    noise_samples: int
    self_agreement: float | None
    effective: float | None
    primary_p99_ms: float | None
    canary_p99_ms: float | None
    latency_ratio: float | None


OnChange = Callable[[State, State, list[str]], None]
_EPS = 1e-9
_DISAGREEMENTS_KEPT = 50
_BINS = 20


class Verdict:
    """Promote / hold / abort over a sliding window of comparisons, on an injected clock.

    With the noise floor on and ``min_samples`` primary-vs-primary comparisons in the window
    (``add_noise``), the effective agreement is ``min(1, agreement / max(self_agreement, ε))``:
    agreement = comparisons where the canary agreed with the primary / comparisons, and
    self_agreement = the same share for two answers of the primary to one request. A sampling
    LLM whose answers agree with themselves 90 % of the time and with a canary 90 % of the time
    has an effective agreement of 1: the canary is as consistent with production as production
    is with itself. Otherwise the effective agreement is the raw agreement. A primary that agrees
    with itself less than ``min_self_agreement`` holds the verdict: the ratio means nothing there.

    ``state``: ``collecting`` below ``min_samples``; ``abort`` below ``abort_agreement`` or past
    ``max_latency_ratio``; ``promote`` at or above ``promote_agreement``; ``hold`` in between.
    ``abort`` latches until ``reset``: the callbacks stop mirroring and fault experiments on it,
    and samples ageing out of the window MUST NOT silently turn it back into ``collecting``.
    Memory is bounded: ``window`` samples of each kind and 50 disagreement reasons.
    """

    def __init__(self, cfg: VerdictConfig, clock: Clock, expect_noise: bool = False) -> None:
        self.cfg = cfg
        self.clock = clock
        self.expect_noise = expect_noise and cfg.noise_floor
        """Self-comparisons are coming (the mirror sends some calls twice): judge nothing until
        the noise floor is known, rather than abort a non-deterministic model on raw figures."""
        self._samples: deque[_Sample] = deque(maxlen=cfg.window)
        self._noise: deque[tuple[float, bool]] = deque(maxlen=cfg.window)
        self._disagreements: deque[tuple[float, str]] = deque(maxlen=_DISAGREEMENTS_KEPT)
        self._callbacks: list[OnChange] = []
        self._state: State = "collecting"
        self._reasons: list[str] = []
        self._judge()

    def add(self, c: Comparison, primary_latency_s: float,
            canary_latency_s: float | None = None) -> None:
        """One canary comparison; ``canary_latency_s`` is None when the canary did not answer."""
        metrics = dict(c.metrics)
        if canary_latency_s is not None:
            metrics["latency_diff_ms"] = (canary_latency_s - primary_latency_s) * 1000
        self._samples.append(_Sample(self.clock.monotonic(), c.agree, metrics,
                                     primary_latency_s, canary_latency_s))
        if not c.agree:
            self._disagreements.append((self.clock.wall(), c.reason or "disagreed"))
        self._judge()

    def add_noise(self, c: Comparison) -> None:
        """One comparison of two primary answers to the same request (the noise floor)."""
        self._noise.append((self.clock.monotonic(), c.agree))
        self._judge()

    def on_change(self, callback: OnChange) -> None:
        """Call ``callback(old_state, new_state, reasons)`` on every change of state, inside the
        ``add`` / ``state`` call that saw it; it MUST NOT raise."""
        self._callbacks.append(callback)

    def state(self) -> State:
        self._judge()
        return self._state

    def reasons(self) -> list[str]:
        """Why the state is what it is (empty for ``promote``), with figures; for ``abort``,
        the figures of the moment it aborted."""
        self._judge()
        return list(self._reasons)

    def reset(self) -> None:
        """Forget every sample and un-latch an abort (an operator's decision)."""
        self._samples.clear()
        self._noise.clear()
        self._disagreements.clear()
        self._move("collecting", self._decide(self._figures())[1])

    def _prune(self) -> None:
        if self.cfg.window_s is None:
            return
        cutoff = self.clock.monotonic() - self.cfg.window_s
        while self._samples and self._samples[0].at < cutoff:
            self._samples.popleft()
        while self._noise and self._noise[0][0] < cutoff:
            self._noise.popleft()

    def _figures(self) -> _Figures:
        self._prune()
        cfg, n, n_noise = self.cfg, len(self._samples), len(self._noise)
        agreed = sum(s.agree for s in self._samples)
        agreement = agreed / n if n else None
        self_agreement = (sum(a for _, a in self._noise) / n_noise
                          if n_noise >= cfg.min_samples else None)
        effective = agreement
        if cfg.noise_floor and agreement is not None and self_agreement is not None:
            effective = min(1.0, agreement / max(self_agreement, _EPS))
        primary = [s.primary_s * 1000 for s in self._samples]
        canary = [s.canary_s * 1000 for s in self._samples if s.canary_s is not None]
        p99_p = float(np.percentile(primary, 99)) if primary else None
        p99_c = float(np.percentile(canary, 99)) if canary else None
        ratio = (p99_c / p99_p if p99_c is not None and p99_p and len(canary) >= cfg.min_samples
                 else None)
        return _Figures(n, agreed, agreement, n_noise, self_agreement, effective, p99_p, p99_c,
                        ratio)

    def _decide(self, f: _Figures) -> tuple[State, list[str]]:
        cfg = self.cfg
        if f.samples < cfg.min_samples or f.effective is None:
            return "collecting", [f"{f.samples} of {cfg.min_samples} samples collected"]
        if self.expect_noise and f.self_agreement is None:
            return "collecting", [f"waiting for the noise floor: {f.noise_samples} of "
                                  f"{cfg.min_samples} self-comparisons"]
        basis = f"the canary agreed in {f.agreed} of {f.samples}"
        if f.self_agreement is not None and cfg.noise_floor:
            basis += (f"; the primary agrees with itself {f.self_agreement:.1%} "
                      f"over {f.noise_samples}")
        elif cfg.noise_floor and f.noise_samples:
            basis += (f"; noise floor unknown yet ({f.noise_samples} of {cfg.min_samples} "
                      f"self-comparisons): raw agreement used")
        latest = ([f"latest disagreement: {self._disagreements[-1][1]}"]
                  if self._disagreements and f.agreed < f.samples else [])
        aborts: list[str] = []
        blind = (cfg.noise_floor and f.self_agreement is not None
                 and f.self_agreement < cfg.min_self_agreement)
        # A primary that mostly disagrees with itself cannot convict the canary either: with
        # such a noise floor only latency may abort.
        if f.effective < cfg.abort_agreement and not blind:
            aborts.append(f"effective agreement {f.effective:.1%} < abort threshold "
                          f"{cfg.abort_agreement:.1%} ({basis})")
        if (cfg.max_latency_ratio is not None and f.latency_ratio is not None
                and f.latency_ratio > cfg.max_latency_ratio):
            aborts.append(f"canary p99 latency {f.canary_p99_ms:.1f} ms is {f.latency_ratio:.2f}× "
                          f"the primary's {f.primary_p99_ms:.1f} ms "
                          f"(limit {cfg.max_latency_ratio:.2f}×)")
        if aborts:
            return "abort", aborts + latest
        holds: list[str] = []
        if blind:
            holds.append(f"the primary agrees with itself only {f.self_agreement:.1%} "
                         f"(< {cfg.min_self_agreement:.1%}): comparisons cannot judge the canary")
        if f.effective < cfg.promote_agreement:
            holds.append(f"effective agreement {f.effective:.1%} < promote threshold "
                         f"{cfg.promote_agreement:.1%} ({basis})")
        return ("hold", holds + latest) if holds else ("promote", [])

    def _judge(self) -> None:
        if self._state == "abort":
            return
        self._move(*self._decide(self._figures()))

    def _move(self, state: State, reasons: list[str]) -> None:
        old, self._state, self._reasons = self._state, state, reasons
        if old != state:
            for callback in list(self._callbacks):
                callback(old, state, list(reasons))

    def snapshot(self) -> dict[str, Any]:
        """JSON-able evidence for the admin API and ``mmguard canary-report``."""
        state, reasons = self.state(), self.reasons()
        f = self._figures()
        cfg = self.cfg
        names = sorted({k for s in self._samples for k in s.metrics})
        values = {k: [s.metrics[k] for s in self._samples if k in s.metrics] for k in names}
        primary = [s.primary_s * 1000 for s in self._samples]
        canary = [s.canary_s * 1000 for s in self._samples if s.canary_s is not None]
        return {
            "state": state, "reasons": reasons,
            "samples": f.samples, "agreed": f.agreed, "agreement": f.agreement,
            "noise_samples": f.noise_samples, "self_agreement": f.self_agreement,
            "effective_agreement": f.effective,
            "thresholds": {"promote_agreement": cfg.promote_agreement,
                           "abort_agreement": cfg.abort_agreement,
                           "max_latency_ratio": cfg.max_latency_ratio,
                           "min_samples": cfg.min_samples, "window": cfg.window,
                           "window_s": cfg.window_s},
            "metrics": {k: q for k in names if (q := _quantiles(values[k]))},
            "latency_ms": {"primary": _quantiles(primary, (50, 99)),
                           "canary": _quantiles(canary, (50, 99)),
                           "p99_ratio": f.latency_ratio},
            "disagreements": [{"at": at, "reason": why} for at, why in self._disagreements],
            "histograms": {"metrics": {k: h for k in names if (h := _histogram(values[k]))},
                           "latency_ms": _latency_histogram(primary, canary)},
        }


def _finite(values: list[float]) -> NDArray[np.float64]:
    arr = np.asarray(values, dtype=np.float64)
    return np.asarray(arr[np.isfinite(arr)], dtype=np.float64)


def _quantiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    arr = _finite(values)
    if not arr.size:
        return {}
    found = {f"p{p}": float(q) for p, q in zip(ps, np.percentile(arr, ps), strict=True)}
    return found | ({"min": float(arr.min()), "max": float(arr.max())} if len(ps) > 2 else {})


def _histogram(values: list[float]) -> dict[str, list[float]]:
    arr = _finite(values)
    if not arr.size:
        return {}
    counts, edges = np.histogram(arr, bins=_BINS)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


def _latency_histogram(primary: list[float], canary: list[float]) -> dict[str, list[float]]:
    """Primary and canary latencies over the same bin edges, so one plot can overlay them."""
    p, c = _finite(primary), _finite(canary)
    if not p.size and not c.size:
        return {}
    edges = np.histogram_bin_edges(np.concatenate([p, c]), bins=_BINS)
    return {"edges": edges.tolist(), "primary": np.histogram(p, edges)[0].tolist(),
            "canary": np.histogram(c, edges)[0].tolist()}
