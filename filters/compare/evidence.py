"""The verdict's two tests on clean copies, each an anytime-valid confidence sequence
(``filters.compare.sequential``) with its own share of the error rates.

- ``AgreementEvidence``: effective agreement = agreement / self-agreement (the noise floor),
  both bounded by confidence sequences, the floor's uncertainty carried through the ratio:
  lower = L(agreement) / U(self), upper = U(agreement) / L(self). A promote also needs the
  floor itself shown at least ``min_self_agreement`` (``steady``).
- ``LatencyEvidence``: canary vs production latency as distributions. The centre: a sequential
  sign test on pairs (one request, both sides) of ``P(canary > max(ratio × production,
  production + min_effect))`` against ½ (the probability of superiority, the Mann-Whitney
  parameter, with the margin that matters); valid under any drift of load over time, since the
  two answers of a pair are exchangeable when the canary meets its SLO. The tail: distribution-free
  quantile bounds on each side, judged only once the production side's upper bound is finite.

Every method is O(1) per sample for the decision; bounds by bisection only when shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from filters.compare.sequential import (
    LogHistogram,
    Prior,
    QuantileBound,
    count_range,
    lower_bound,
    prior_around,
    quantile_bounds,
    rejects,
    samples_needed,
    support_from,
    upper_bound,
)

TAIL_EVERY = 8


@dataclass(frozen=True, slots=True)
class Levels:
    """Error rates of one test: ``abort`` (false abort) and ``promote`` (false promote)."""

    abort: float
    promote: float


class AgreementEvidence:
    def __init__(self, promote_at: float, abort_at: float) -> None:
        self.promote_at, self.abort_at = promote_at, abort_at
        self.prior = prior_around(promote_at, abort_at)
        self.noise_prior = prior_around(0.5, 0.9, 0.99)
        self.agreed = self.n = 0
        self.self_agreed = self.self_n = 0
        self.noise = False
        """The noise floor is in use (its own share of the error rates)."""
        self._memo: dict[tuple[str, float, int, float], float] = {}

    def clear(self) -> None:
        self.agreed = self.n = self.self_agreed = self.self_n = 0
        self._memo.clear()

    def _levels(self, lv: Levels) -> Levels:
        return Levels(lv.abort / 2, lv.promote / 2) if self.noise else lv

    def _self(self, side: str, level: float, sa: float, sn: int) -> float:
        """L or U of the self-agreement (1 when the floor is not in use), memoised."""
        if not self.noise:
            return 1.0
        key = (side, sa, sn, level)
        if key not in self._memo:
            if len(self._memo) > 64:
                self._memo.clear()
            f = lower_bound if side == "lower" else upper_bound
            self._memo[key] = f(sa, sn, level, self.noise_prior)
        return self._memo[key]

    def promotes(self, lv: Levels) -> bool:
        """L(agreement) / U(self) ≥ the promote bar, at ``lv.promote``."""
        return self._promotes(self.agreed, self.n, self.self_agreed, self.self_n, lv)

    def aborts(self, lv: Levels) -> bool:
        """U(agreement) / L(self) < the abort line, at ``lv.abort``."""
        return self._aborts(self.agreed, self.n, self.self_agreed, self.self_n, lv)

    def _promotes(self, a: float, n: int, sa: float, sn: int, lv: Levels) -> bool:
        lv = self._levels(lv)
        target = min(1.0, self.promote_at * self._self("upper", lv.promote, sa, sn))
        if n == 0 or a < target * n:
            return False
        return target <= 0 or rejects(a, n, target, lv.promote, self.prior)

    def _aborts(self, a: float, n: int, sa: float, sn: int, lv: Levels) -> bool:
        lv = self._levels(lv)
        target = self.abort_at * self._self("lower", lv.abort, sa, sn)
        if n == 0 or target <= 0 or a >= target * n:
            return False
        return rejects(a, n, target, lv.abort, self.prior)

    def blind(self, lv: Levels, min_self: float) -> bool:
        """The primary is shown to agree with itself less than ``min_self``."""
        return self.noise and self._self("upper", self._levels(lv).abort, self.self_agreed,
                                         self.self_n) < min_self

    def steady(self, lv: Levels, min_self: float) -> bool:
        """The primary is shown to agree with itself at least ``min_self`` (the lower bound, at
        the false-promote rate): only then does the floor say how much agreement a good canary
        can reach. Without it a floor estimated low (a noisy primary, or faults on its copies)
        would lower the promote bar to what a bad canary reaches."""
        return not self.noise or self.self_lower(lv) >= min_self

    def self_lower(self, lv: Levels) -> float:
        """The self-agreement's lower bound at the false-promote rate (1 without a floor)."""
        return self._self("lower", self._levels(lv).promote, self.self_agreed, self.self_n)

    def figures(self, lv: Levels) -> dict[str, Any]:
        lv = self._levels(lv)
        la = lower_bound(self.agreed, self.n, lv.promote, self.prior)
        ua = upper_bound(self.agreed, self.n, lv.abort, self.prior)
        ls = self._self("lower", lv.abort, self.self_agreed, self.self_n)
        us = self._self("upper", lv.promote, self.self_agreed, self.self_n)
        rate = self.agreed / self.n if self.n else None
        floor = self.self_agreed / self.self_n if self.noise and self.self_n else None
        eff = None if rate is None else min(1.0, rate / floor) if floor else rate
        lo = min(1.0, la / us) if us > 0 else 0.0
        hi = min(1.0, ua / ls) if ls > 0 else 1.0
        return {"test": "anytime-valid bounds of effective agreement", "samples": self.n,
                "agreed": self.agreed, "estimate": eff, "lower": lo, "upper": hi,
                "agreement": {"estimate": rate, "lower": la, "upper": ua},
                "self_agreement": ({"estimate": floor, "lower": ls, "upper": us,
                                    "samples": self.self_n} if self.noise else None),
                "promote_at": self.promote_at, "abort_at": self.abort_at,
                "alpha": lv.abort, "beta": lv.promote}

    def needed(self, lv: Levels) -> int | None:
        """Comparisons to a decision if the rates stayed as observed (the noise floor's sample
        growing in proportion)."""
        if self.n == 0:
            return None
        share = self.self_n / self.n
        srate = self.self_agreed / self.self_n if self.self_n else 1.0

        def decided(a: float, n: int) -> bool:
            sn = round(share * n) if self.noise else 0
            return self._promotes(a, n, srate * sn, sn, lv) or self._aborts(a, n, srate * sn,
                                                                             sn, lv)

        return samples_needed(self.agreed / self.n, self.n, decided)


class LatencyEvidence:
    def __init__(self, ratio: float, min_effect_ms: float, tail: float | None) -> None:
        self.ratio, self.min_effect_ms, self.tail = ratio, min_effect_ms, tail
        self.prior: Prior = prior_around(0.5)
        self.tail_prior: Prior = prior_around(tail or 0.99)
        self.slower = self.n = 0
        self.primary, self.canary = LogHistogram(), LogHistogram()
        self._range: tuple[int, float, int, int] | None = None
        self._support: tuple[float, int] | None = None

    def clear(self) -> None:
        self.slower = self.n = 0
        self.primary.clear()
        self.canary.clear()
        self._range = None

    def add(self, primary_ms: float, canary_ms: float) -> None:
        self.n += 1
        self.slower += canary_ms > self.limit(primary_ms)
        self.primary.add(primary_ms)
        self.canary.add(canary_ms)

    def limit(self, primary_ms: float) -> float:
        """The most the canary may take where production took ``primary_ms``."""
        return max(self.ratio * primary_ms, primary_ms + self.min_effect_ms)

    def margin(self) -> str:
        return f"max({self.ratio:g}× production, production + {self.min_effect_ms:g} ms)"

    def centre_aborts(self, level: float) -> bool:
        return 2 * self.slower > self.n and rejects(self.slower, self.n, 0.5, level, self.prior)

    def centre_promotes(self, level: float) -> bool:
        return 2 * self.slower < self.n and rejects(self.slower, self.n, 0.5, level, self.prior)

    def _tail_range(self, level: float) -> tuple[int, int]:
        """``count_range`` for the tail, followed one sample at a time (each end moves by at
        most one per sample: a few evaluations instead of a search)."""
        assert self.tail is not None
        n, q, prior = self.n, self.tail, self.tail_prior
        cached = self._range
        if cached is None or cached[1] != level or not 0 <= n - cached[0] <= 2 * TAIL_EVERY:
            lo, hi = count_range(n, q, level, prior)
        else:
            lo, hi = cached[2], cached[3]
            while lo > 0 and not rejects(lo - 1, n, q, level, prior):
                lo -= 1
            while lo < n and rejects(lo, n, q, level, prior):
                lo += 1
            while hi < n and not rejects(hi + 1, n, q, level, prior):
                hi += 1
            while hi > lo and rejects(hi, n, q, level, prior):
                hi -= 1
        self._range = (n, level, lo, hi)
        return lo, hi

    def tail_bounds(self, level: float) -> tuple[QuantileBound, QuantileBound] | None:
        """(production, canary) bounds of the tail quantile, each at ``level / 2``."""
        if self.tail is None or self.n == 0:
            return None
        half = level / 2
        if self._support is None or self._support[0] != half:
            self._support = (half, support_from(self.tail, half, self.tail_prior))
        if self.n < self._support[1]:
            return None
        counts = self._tail_range(half)
        if counts[1] + 1 > self.n:  # production's upper bound is still infinite: not judged
            return None
        return (quantile_bounds(self.primary, self.tail, half, self.tail_prior, counts),
                quantile_bounds(self.canary, self.tail, half, self.tail_prior, counts))

    def tail_aborts(self, level: float) -> str:
        """Looked at every ``TAIL_EVERY``-th pair: a confidence sequence is valid at any looks,
        and fewer looks cost at most that many pairs of delay."""
        if self.tail is None or self.n % TAIL_EVERY:
            return ""
        found = self.tail_bounds(level)
        if found is None:
            return ""
        p, c = found
        if p.upper is None or c.lower is None or c.lower <= self.limit(p.upper):
            return ""
        q = _q(self.tail)
        return (f"canary {q} latency ≥ {c.lower:.1f} ms > {self.margin()} with production's "
                f"{q} ≤ {p.upper:.1f} ms (distribution-free anytime bounds over {self.n} pairs, "
                f"false-abort rate {level:g})")

    def support(self, level: float) -> int | None:
        return None if self.tail is None else support_from(self.tail, level / 2, self.tail_prior)

    def figures(self, lv: Levels, tail_level: float) -> dict[str, Any]:
        rate = self.slower / self.n if self.n else None
        out: dict[str, Any] = {
            "test": "sequential sign test on pairs: P(canary > margin) vs 1/2 "
                    "(the Mann-Whitney probability of superiority, with the margin)",
            "margin": self.margin(), "samples": self.n, "slower": self.slower,
            "estimate": rate,
            "lower": lower_bound(self.slower, self.n, lv.abort, self.prior),
            "upper": upper_bound(self.slower, self.n, lv.promote, self.prior),
            "alpha": lv.abort, "beta": lv.promote}
        if self.tail is not None:
            q = _q(self.tail)
            bounds = self.tail_bounds(tail_level)
            out["tail"] = {"quantile": self.tail, "alpha": tail_level,
                           "supported_from": self.support(tail_level), "judged": bounds is not None,
                           "production": _qb(bounds[0]) if bounds else None,
                           "canary": _qb(bounds[1]) if bounds else None, "name": q}
        return out

    def needed(self, lv: Levels) -> int | None:
        if self.n == 0:
            return None
        rate = self.slower / self.n

        def decided(s: float, n: int) -> bool:
            return (rejects(s, n, 0.5, lv.abort, self.prior) if 2 * s > n
                    else 2 * s < n and rejects(s, n, 0.5, lv.promote, self.prior))

        return samples_needed(rate, self.n, decided)


def _q(q: float | None) -> str:
    return "" if q is None else f"p{q * 100:g}"


def _qb(b: QuantileBound) -> dict[str, float | None]:
    return {"lower_ms": b.lower, "upper_ms": b.upper}
