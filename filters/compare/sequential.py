"""Anytime-valid statistics: confidence sequences that stay valid however often one looks.

The release verdict is consulted after every comparison. A fixed-sample interval recomputed at
every look is wrong more often than it says (the more looks, the surer a false alarm): that is
how a promote at 20 of 20 and a flap to abort 94 ms later happen. Everything here is a
*confidence sequence*: with probability at least ``1 - level`` the true value lies inside the
bounds at every sample size at once, so the verdict may stop the moment a bound crosses a bar.

Method (docs/canary.md, "How the verdict decides"): the beta-binomial mixture martingale of
Robbins (1970) in the form of Howard, Ramdas, McAuliffe and Sekhon (2021, "Time-uniform,
nonparametric, nonasymptotic confidence sequences", Ann. Statist. 49(2)). For observations
``x_i`` in [0, 1] with mean ``p``, ``M_n(p) = ∫ Π (q/p)^x_i ((1-q)/(1-p))^(1-x_i) dπ(q)`` is a
non-negative supermartingale (weighted AM-GM: each factor's expectation is at most 1, so 0/1
outcomes and [0, 1] scores alike), and by Ville's inequality ``P(∃n: M_n(p) ≥ 1/level) ≤ level``.
The confidence sequence is ``{p : M_n(p) < 1/level}``, an interval (``log M_n`` is convex in
``p``). The prior ``π`` is a mixture of Beta laws centred on the bars the verdict tests (it
changes only how fast a bound moves, never its validity).

Quantiles (Howard and Ramdas 2022, "Sequential estimation of quantiles", Bernoulli 28(3)): for
a continuous law the count of samples at or below its q-quantile is Binomial(n, q), so the same
sequence bounds that count, and the order statistics at the ends of the range bound the quantile
itself, distribution-free. A tail quantile's upper bound is infinite until the sample supports
it (about 460 samples for a p99 at 1 %): the verdict says so instead of judging the maximum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

METHOD = ("beta-binomial mixture confidence sequence (Robbins 1970; Howard et al. 2021), "
          "anytime-valid by Ville's inequality")
_ITER = 48  # bisection steps: 2^-48 of the unit interval


@dataclass(frozen=True, slots=True)
class Prior:
    """A mixture of Beta(a, b) laws: (log weight, a, b, log B(a, b)) per component."""

    parts: tuple[tuple[float, float, float, float], ...]


def prior_around(*centres: float, strengths: Sequence[float] = (30.0, 1000.0)) -> Prior:
    """Beta(1, 1) and, for every centre, Beta laws of mean ``centre`` and the given strengths,
    all of equal weight."""
    laws = [(1.0, 1.0)]
    for c in centres:
        c = min(max(c, 1e-4), 1 - 1e-4)
        laws += [(max(c * k, 0.05), max((1 - c) * k, 0.05)) for k in strengths]
    w = -math.log(len(laws))
    return Prior(tuple((w, a, b, _lbeta(a, b)) for a, b in laws))


UNIFORM = Prior(((0.0, 1.0, 1.0, 0.0),))


def _lbeta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


@lru_cache(maxsize=4096)
def _log_prior_mass(s: float, n: float, prior: Prior) -> float:
    """``log ∫ q^s (1-q)^(n-s) dπ(q)``: the part of ``log M_n(p)`` that does not depend on
    ``p``, computed once per (s, n) however many ``p`` a bound's bisection tries. The verdict
    runs in the event loop after every pair: recomputing it at each of a bisection's 48 steps
    (about 80 bounds per pair) held the loop for tens of ms on a busy 2-core machine, and the
    backend answers that waited behind it read as the backends' latency (docs/canary.md)."""
    terms = [w + math.lgamma(a + s) + math.lgamma(b + n - s) - math.lgamma(a + b + n) - lb
             for w, a, b, lb in prior.parts]
    top = max(terms)
    return top + math.log(sum(math.exp(t - top) for t in terms))


def _against(mass: float, s: float, n: float, p: float) -> float:
    out = mass
    if s > 0:
        out -= s * math.log(p) if p > 0 else -math.inf
    if n - s > 0:
        out -= (n - s) * math.log1p(-p) if p < 1 else -math.inf
    return out


def log_mixture(s: float, n: float, p: float, prior: Prior) -> float:
    """``log M_n(p)``: the evidence against the mean being ``p`` after ``s`` of ``n``."""
    return _against(_log_prior_mass(s, n, prior), s, n, p)


def rejects(s: float, n: float, p: float, level: float, prior: Prior) -> bool:
    """The sequence at ``level`` excludes ``p`` after ``s`` of ``n`` (Ville: at most ``level``
    of the time ever, when ``p`` is the true mean)."""
    return n > 0 and log_mixture(s, n, p, prior) >= -math.log(level)


def lower_bound(s: float, n: float, level: float, prior: Prior) -> float:
    """The smallest mean not excluded (0 when none is)."""
    if n <= 0 or s <= 0 or not rejects(s, n, 0.0, level, prior):
        return 0.0
    mass, bar = _log_prior_mass(s, n, prior), -math.log(level)
    lo, hi = 0.0, s / n  # excluded at lo, not at hi (the estimate never is: M_n(p̂) ≤ 1)
    for _ in range(_ITER):
        mid = (lo + hi) / 2
        if _against(mass, s, n, mid) >= bar:
            lo = mid
        else:
            hi = mid
    return hi


def upper_bound(s: float, n: float, level: float, prior: Prior) -> float:
    """The largest mean not excluded (1 when none is)."""
    if n <= 0 or s >= n or not rejects(s, n, 1.0, level, prior):
        return 1.0
    mass, bar = _log_prior_mass(s, n, prior), -math.log(level)
    lo, hi = s / n, 1.0
    for _ in range(_ITER):
        mid = (lo + hi) / 2
        if _against(mass, s, n, mid) >= bar:
            hi = mid
        else:
            lo = mid
    return lo


def samples_needed(rate: float, n: int, decided: Callable[[float, int], bool],
                   cap: int = 10_000_000) -> int | None:
    """The smallest sample size ``N ≥ n`` at which ``decided(rate · N, N)`` holds, if the
    observed rate stayed as it is; None when it would not within ``cap``."""
    if decided(rate * n, n):
        return n
    hi = max(n, 16)
    while not decided(rate * hi, hi):
        if hi >= cap:
            return None
        hi = min(cap, hi * 2)
    lo = max(n, hi // 2)
    while hi - lo > max(1, lo // 100):  # to 1 %: it is an estimate
        mid = (lo + hi) // 2
        if decided(rate * mid, mid):
            hi = mid
        else:
            lo = mid
    return hi


# --- quantiles ---------------------------------------------------------------------------------


def count_range(n: int, q: float, level: float, prior: Prior) -> tuple[int, int]:
    """Counts ``k`` of n samples at or below the q-quantile that the sequence does not exclude
    (``log M`` is convex in the count: the set is an interval around ``n·q``)."""
    centre = min(n, max(0, round(n * q)))
    lo, hi = centre, centre
    if rejects(centre, n, q, level, prior):  # cannot happen for a sane prior; be safe
        return centre, centre
    # the left end: the smallest k not excluded
    a, b = 0, centre
    if not rejects(0, n, q, level, prior):
        lo = 0
    else:
        while b - a > 1:
            mid = (a + b) // 2
            if rejects(mid, n, q, level, prior):
                a = mid
            else:
                b = mid
        lo = b
    a, b = centre, n
    if not rejects(n, n, q, level, prior):
        hi = n
    else:
        while b - a > 1:
            mid = (a + b) // 2
            if rejects(mid, n, q, level, prior):
                b = mid
            else:
                a = mid
        hi = a
    return lo, hi


def support_from(q: float, level: float, prior: Prior, cap: int = 1_000_000) -> int:
    """The fewest samples whose largest one bounds the q-quantile from above at ``level``."""
    n = 1
    while n < cap and not rejects(n, n, q, level, prior):
        n *= 2
    lo, hi = n // 2, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if rejects(mid, mid, q, level, prior):
            hi = mid
        else:
            lo = mid
    return hi


class LogHistogram:
    """Latencies in geometric bins (2 % wide, 1 µs to ~1 h): exact counts in bounded memory.
    Order statistics are read to the bin edge on the safe side, so a quantile bound from it is
    at most 2 % looser than from the raw sample, never tighter."""

    GROWTH = 1.02
    LOW_MS = 1e-3
    BINS = 1120

    def __init__(self) -> None:
        self.counts: NDArray[np.int64] = np.zeros(self.BINS, dtype=np.int64)
        self.n = 0
        self._log_g = math.log(self.GROWTH)

    def add(self, ms: float) -> None:
        if not math.isfinite(ms):
            ms = self.edge(self.BINS)
        i = 0 if ms <= self.LOW_MS else int(math.log(ms / self.LOW_MS) / self._log_g) + 1
        self.counts[min(i, self.BINS - 1)] += 1
        self.n += 1

    def edge(self, i: int) -> float:
        """The upper edge of bin ``i - 1``, the lower edge of bin ``i``."""
        return 0.0 if i <= 0 else self.LOW_MS * self.GROWTH ** (i - 1)

    def order_stat(self, k: int, side: str) -> float:
        """The k-th smallest sample (1-based), rounded down (``side="low"``) or up."""
        idx = int(np.searchsorted(np.cumsum(self.counts), k))
        return self.edge(idx) if side == "low" else self.edge(idx + 1)

    def clear(self) -> None:
        self.counts[:] = 0
        self.n = 0


@dataclass(frozen=True, slots=True)
class QuantileBound:
    lower: float | None
    """None: no sample is yet known to lie below the quantile."""
    upper: float | None
    """None: the sample does not support the quantile yet (its upper bound is infinite)."""


def quantile_bounds(h: LogHistogram, q: float, level: float, prior: Prior,
                    counts: tuple[int, int] | None = None) -> QuantileBound:
    """Distribution-free, anytime-valid bounds of the q-quantile of what ``h`` holds
    (``counts``: ``count_range`` for ``h.n`` when already known)."""
    if h.n == 0:
        return QuantileBound(None, None)
    lo, hi = counts if counts is not None else count_range(h.n, q, level, prior)
    return QuantileBound(h.order_stat(lo, "low") if lo >= 1 else None,
                         h.order_stat(hi + 1, "high") if hi + 1 <= h.n else None)
