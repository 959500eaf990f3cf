"""The release verdict: promote, hold or abort, each a test with a stated error rate.

Every decision is read off anytime-valid confidence sequences (``filters.compare.sequential``),
so the verdict may be consulted after every comparison without its error rates growing with the
number of looks: ``alpha`` bounds the chance of aborting a canary that meets its SLO, ``beta``
the chance of promoting one that misses it. Correctness and latency are judged on clean copies
(``filters.compare.evidence``); ``filters.robustness.verdict.ReleaseVerdict`` adds robustness.
"""

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
from filters.compare.evidence import AgreementEvidence, LatencyEvidence, Levels
from filters.compare.sequential import METHOD
from proxy.clock import Clock
from proxy.strict import Strict


class VerdictConfig(Strict):
    alpha: float = Field(0.01, gt=0, lt=0.5)
    """Probability of aborting a canary that meets its SLO (split evenly over the abort tests:
    agreement, latency centre, latency tail, each robustness perturbation)."""
    beta: float = Field(0.05, gt=0, lt=0.5)
    """Probability of promoting a canary that misses its SLO (each promote condition alone)."""
    promote_agreement: float = Field(0.995, ge=0, le=1)
    """Promote only once the lower bound of effective agreement is at or above this."""
    abort_agreement: float = Field(0.95, ge=0, le=1)
    """Abort once the upper bound of effective agreement is below this; in between: hold."""
    min_samples: int = Field(20, ge=1)
    """No decision at all below this many comparisons (the bounds decide; this is a floor)."""
    window: int = Field(200, gt=0)
    """Recent comparisons kept for the report's quantiles and histograms (the tests use every
    comparison since the last reset: a confidence sequence does not forget)."""
    max_latency_ratio: float | None = Field(1.1, ge=1)
    """The latency margin: the canary may take up to this many times production's latency
    (and ``min_effect_ms`` more); slower than that in most pairs aborts. None: latency is not
    judged."""
    min_effect_ms: float = Field(1.0, ge=0)
    """The smallest latency difference that matters, whatever the ratio."""
    tail_quantile: float | None = Field(0.99, gt=0.5, lt=1)
    """Also abort when this quantile of the canary's latency is beyond the margin of
    production's, judged once the sample supports a distribution-free bound. None: no tail."""
    noise_floor: bool = True
    """Judge the canary against what the primary agrees with itself (``Verdict.add_noise``)."""
    min_self_agreement: float = Field(0.5, ge=0, le=1)
    """A primary shown to agree with itself less than this cannot tell a good canary from a bad
    one: the verdict holds (never promotes; aborts on latency only). A promote needs the
    primary shown to agree with itself at least this much (its lower bound)."""

    @model_validator(mode="after")
    def _ordered(self) -> VerdictConfig:
        if self.abort_agreement > self.promote_agreement:
            raise ValueError(f"abort_agreement {self.abort_agreement} is above "
                             f"promote_agreement {self.promote_agreement}")
        return self


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float
    agree: bool
    metrics: dict[str, float]
    primary_s: float
    canary_s: float | None


OnChange = Callable[[State, State, list[str]], None]
_DISAGREEMENTS_KEPT = 50
_BINS = 20


class Verdict:
    """Promote / hold / abort from anytime-valid bounds, on an injected clock.

    Effective agreement = agreement / self-agreement when the noise floor is in use (``add_noise``
    or ``expect_noise``): a sampling LLM that agrees with itself 90 % of the time and with the
    canary 90 % of the time has an effective agreement of 1. Both are bounded, and the floor's
    uncertainty is carried through the ratio; until self-comparisons come, the upper bound is 1
    (no abort on agreement) and the lower bound the raw one.

    ``collecting`` below ``min_samples``; ``abort`` when any abort test rejects at its share of
    ``alpha``; ``promote`` when every promote condition holds at ``beta``; ``hold`` otherwise,
    saying what is missing and about how many comparisons a decision needs. ``abort`` latches
    until ``reset``; ``promote`` latches too and carries its evidence, and only an abort test
    (evidence of a regression) revokes it — never one sample.
    """

    def __init__(self, cfg: VerdictConfig, clock: Clock, expect_noise: bool = False) -> None:
        self.cfg = cfg
        self.clock = clock
        self.expect_noise = expect_noise and cfg.noise_floor
        """Self-comparisons are coming (the mirror sends some calls twice): the noise floor
        takes its share of the error rates from the first comparison."""
        self.agreement = AgreementEvidence(cfg.promote_agreement, cfg.abort_agreement)
        self.agreement.noise = self.expect_noise
        self.latency = (None if cfg.max_latency_ratio is None else
                        LatencyEvidence(cfg.max_latency_ratio, cfg.min_effect_ms,
                                        cfg.tail_quantile))
        self._samples: deque[_Sample] = deque(maxlen=cfg.window)
        self._disagreements: deque[tuple[float, str]] = deque(maxlen=_DISAGREEMENTS_KEPT)
        self._callbacks: list[OnChange] = []
        self._state: State = "collecting"
        self._decided: dict[str, Any] | None = None
        """The evidence of the latched decision (promote or abort)."""
        self._judge()

    # --- feeding ------------------------------------------------------------------------------

    def add(self, c: Comparison, primary_latency_s: float,
            canary_latency_s: float | None = None) -> None:
        """One canary comparison; ``canary_latency_s`` is None when the canary did not answer."""
        metrics = dict(c.metrics)
        if canary_latency_s is not None:
            metrics["latency_diff_ms"] = (canary_latency_s - primary_latency_s) * 1000
            if self.latency is not None:
                self.latency.add(primary_latency_s * 1000, canary_latency_s * 1000)
        self._samples.append(_Sample(self.clock.monotonic(), c.agree, metrics,
                                     primary_latency_s, canary_latency_s))
        self.agreement.n += 1
        self.agreement.agreed += c.agree
        if not c.agree:
            self._disagreements.append((self.clock.wall(), c.reason or "disagreed"))
        self._judge()

    def add_noise(self, c: Comparison) -> None:
        """One comparison of two primary answers to the same request (the noise floor)."""
        if not self.cfg.noise_floor:
            return
        self.agreement.noise = True
        self.agreement.self_n += 1
        self.agreement.self_agreed += c.agree
        self._judge()

    def on_change(self, callback: OnChange) -> None:
        """Call ``callback(old_state, new_state, reasons)`` on every change of state, inside the
        ``add`` / ``state`` call that saw it; it MUST NOT raise."""
        self._callbacks.append(callback)

    def state(self) -> State:
        return self._state

    def reasons(self) -> list[str]:
        """Why the state is what it is, with figures: for ``promote`` and ``abort`` the evidence
        of the moment it was decided; for ``hold`` what is missing."""
        if self._decided is not None:
            return list(self._decided["reasons"])
        return self._missing()

    def reset(self) -> None:
        """Forget every sample and un-latch a decision (an operator's decision)."""
        self._samples.clear()
        self._disagreements.clear()
        self.agreement.clear()
        self.agreement.noise = self.expect_noise
        if self.latency is not None:
            self.latency.clear()
        self._decided = None
        self._move("collecting")

    # --- the tests ----------------------------------------------------------------------------

    def _abort_tests(self) -> int:
        """How many tests may abort (each gets ``alpha`` / this)."""
        lat = self.latency
        return 1 + (0 if lat is None else 1 + (lat.tail is not None))

    def levels(self) -> Levels:
        return Levels(self.cfg.alpha / self._abort_tests(), self.cfg.beta)

    def _aborts(self) -> list[str]:
        """The abort tests that reject now (cheap when none does)."""
        lv, cfg, out = self.levels(), self.cfg, []
        a = self.agreement
        if a.aborts(lv) and not a.blind(lv, cfg.min_self_agreement):
            f = a.figures(lv)
            out.append(f"effective agreement ≤ {f['upper']:.2%} (anytime upper bound, "
                       f"false-abort rate {f['alpha']:.2g}) < abort line "
                       f"{cfg.abort_agreement:.1%}: {self._basis(f)}")
        lat = self.latency
        if lat is not None and lat.n and lat.centre_aborts(lv.abort):
            f = lat.figures(lv, lv.abort)
            out.append(f"latency: the canary took longer than {f['margin']} in {f['slower']} of "
                       f"{f['samples']} pairs ({f['estimate']:.1%}, lower bound "
                       f"{f['lower']:.1%} > 50 %; {_SIGN}, false-abort rate {lv.abort:.2g})")
        if lat is not None:
            tail = lat.tail_aborts(lv.abort)
            if tail:
                out.append(f"latency tail: {tail}")
        return out

    def _promotes(self) -> bool:
        lv, a, lat = self.levels(), self.agreement, self.latency
        if not a.promotes(lv) or not a.steady(lv, self.cfg.min_self_agreement):
            return False
        return lat is None or (lat.n > 0 and lat.centre_promotes(lv.promote))

    def _basis(self, f: dict[str, Any]) -> str:
        out = f"the canary agreed in {f['agreed']} of {f['samples']}"
        s = f.get("self_agreement")
        if s is not None:
            est = "unknown yet" if s["estimate"] is None else f"{s['estimate']:.1%}"
            out += (f"; the primary agrees with itself {est} over {s['samples']} "
                    f"(bounds {s['lower']:.1%} to {s['upper']:.1%})")
        if self._disagreements and f["agreed"] < f["samples"]:
            out += f"; latest disagreement: {self._disagreements[-1][1]}"
        return out

    def _evidence(self) -> list[str]:
        """The promote evidence, one line per test."""
        lv = self.levels()
        f = self.agreement.figures(lv)
        out = [f"effective agreement ≥ {f['lower']:.2%} (anytime lower bound, false-promote "
               f"rate {f['beta']:.2g}) ≥ promote bar {self.cfg.promote_agreement:.1%}: "
               f"{self._basis(f)}"]
        if self.latency is not None:
            g = self.latency.figures(lv, lv.abort)
            out.append(f"latency: the canary took longer than {g['margin']} in {g['slower']} of "
                       f"{g['samples']} pairs, upper bound {g['upper']:.1%} < 50 % ({_SIGN}, "
                       f"false-promote rate {lv.promote:.2g})")
        return out

    def _missing(self) -> list[str]:
        """What a decision still needs (hold / collecting)."""
        lv, cfg, out = self.levels(), self.cfg, []
        a = self.agreement
        if a.n < cfg.min_samples:
            out.append(f"{a.n} of {cfg.min_samples} samples collected")
        f = a.figures(lv)
        if a.blind(lv, cfg.min_self_agreement):
            out.append(f"the primary agrees with itself at most {f['self_agreement']['upper']:.1%}"
                       f" (< {cfg.min_self_agreement:.1%}): comparisons cannot judge the canary")
        elif a.promotes(lv) and not a.steady(lv, cfg.min_self_agreement):
            s = f["self_agreement"]
            out.append(f"the primary agrees with itself {s['estimate'] or 0:.1%} over "
                       f"{s['samples']} noise-floor samples, lower bound "
                       f"{a.self_lower(lv):.1%} (false-promote rate {f['beta']:.2g}): a "
                       f"promote needs it shown ≥ {cfg.min_self_agreement:.1%} (the floor "
                       f"sets how much agreement a good canary can reach)")
        elif not a.promotes(lv) and f["estimate"] is not None:
            out.append(f"effective agreement {f['estimate']:.2%}, anytime bounds "
                       f"{f['lower']:.2%} to {f['upper']:.2%}: promote needs the lower bound ≥ "
                       f"{cfg.promote_agreement:.1%}, abort the upper < "
                       f"{cfg.abort_agreement:.1%} ({self._basis(f)}); "
                       f"{_more(a.n, a.needed(lv))}")
        lat = self.latency
        if lat is not None:
            g = lat.figures(lv, lv.abort)
            if not lat.n:
                out.append("latency: no canary latency yet")
            elif not lat.centre_promotes(lv.promote):
                out.append(f"latency: the canary took longer than {g['margin']} in "
                           f"{g['slower']} of {g['samples']} pairs, bounds {g['lower']:.1%} to "
                           f"{g['upper']:.1%}: promote needs the upper bound < 50 %; "
                           f"{_more(lat.n, lat.needed(lv))}")
            tail = g.get("tail")
            if tail is not None and not tail["judged"]:
                out.append(f"latency {tail['name']} not judged yet: a distribution-free bound "
                           f"needs {tail['supported_from']} pairs, {lat.n} so far")
        return out

    def _judge(self) -> None:
        if self._state == "abort":
            return
        if self.agreement.n >= self.cfg.min_samples:
            why = self._aborts()
            if why:
                self._decide("abort", why)
                return
        if self._state == "promote":
            return
        if self.agreement.n < self.cfg.min_samples:
            self._move("collecting")
        elif self._promotes():
            self._decide("promote", self._evidence())
        else:
            self._move("hold")

    def _decide(self, state: State, reasons: list[str]) -> None:
        self._decided = {"state": state, "reasons": reasons, "at": self.clock.wall(),
                         "comparisons": self.agreement.n, "figures": self._figures()}
        self._move(state)

    def _move(self, state: State) -> None:
        old, self._state = self._state, state
        if old != state and self._callbacks:
            reasons = self.reasons()
            for callback in list(self._callbacks):
                callback(old, state, list(reasons))

    def _figures(self) -> dict[str, Any]:
        lv = self.levels()
        out: dict[str, Any] = {"method": METHOD, "alpha": self.cfg.alpha, "beta": self.cfg.beta,
                               "abort_tests": self._abort_tests(),
                               "agreement": self.agreement.figures(lv)}
        if self.latency is not None:
            out["latency"] = self.latency.figures(lv, lv.abort)
        return out

    def snapshot(self) -> dict[str, Any]:
        """JSON-able evidence for the admin API and ``mmguard canary-report``."""
        state, reasons, cfg = self.state(), self.reasons(), self.cfg
        a, lv = self.agreement, self.levels()
        fa = a.figures(lv)
        names = sorted({k for s in self._samples for k in s.metrics})
        values = {k: [s.metrics[k] for s in self._samples if k in s.metrics] for k in names}
        primary = [s.primary_s * 1000 for s in self._samples]
        canary = [s.canary_s * 1000 for s in self._samples if s.canary_s is not None]
        self_a = fa["self_agreement"]
        return {
            "state": state, "reasons": reasons,
            "missing": [] if state in ("promote", "abort") else self._missing(),
            "samples": a.n, "agreed": a.agreed,
            "agreement": a.agreed / a.n if a.n else None,
            "noise_samples": a.self_n,
            "self_agreement": None if self_a is None else self_a["estimate"],
            "effective_agreement": fa["estimate"],
            "evidence": self._figures(),
            "decided": self._decided,
            "thresholds": {"alpha": cfg.alpha, "beta": cfg.beta,
                           "promote_agreement": cfg.promote_agreement,
                           "abort_agreement": cfg.abort_agreement,
                           "max_latency_ratio": cfg.max_latency_ratio,
                           "min_effect_ms": cfg.min_effect_ms,
                           "tail_quantile": cfg.tail_quantile,
                           "min_samples": cfg.min_samples, "window": cfg.window},
            "metrics": {k: q for k in names if (q := _quantiles(values[k]))},
            "latency_ms": {"primary": _quantiles(primary, (50, 99)),
                           "canary": _quantiles(canary, (50, 99)),
                           "recent": len(primary)},
            "disagreements": [{"at": at, "reason": why} for at, why in self._disagreements],
            "histograms": {"metrics": {k: h for k in names if (h := _histogram(values[k]))},
                           "latency_ms": _latency_histogram(primary, canary)},
        }


_SIGN = "sequential sign test"


def _more(n: int, needed: int | None) -> str:
    if needed is None:
        return "no decision in sight at the observed rates (the estimate sits at a bar)"
    return f"about {max(needed - n, 1)} more at the observed rates"


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
