"""Intervals for the robustness table.

The verdict decides on anytime-valid bounds (``paired_difference_bounds``, ``share_bounds``:
the confidence sequences of ``filters.compare.sequential``), valid however often it looks.
Wilson's score interval and Newcombe's difference interval are fixed-sample figures, kept for
comparison with textbooks and other tools, never for a decision.
"""

from __future__ import annotations

import math

from filters.compare.sequential import UNIFORM, lower_bound, prior_around, upper_bound


def wilson(kept: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion ``kept / n`` (95 % by default); (0, 1) for n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = kept / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def difference_interval(canary: tuple[int, int], production: tuple[int, int],
                        z: float = 1.96) -> tuple[float, float]:
    """Newcombe's hybrid score interval of canary − production from the two Wilson intervals."""
    (kc, nc), (kp, np_) = canary, production
    pc, pp = kc / nc if nc else 0.0, kp / np_ if np_ else 0.0
    lc, uc = wilson(kc, nc, z)
    lp, up = wilson(kp, np_, z)
    d = pc - pp
    return (d - math.sqrt((pc - lc) ** 2 + (up - pp) ** 2),
            d + math.sqrt((uc - pc) ** 2 + (pp - lp) ** 2))


# --- anytime-valid (what the verdict decides on) -----------------------------------------------

_PAIRED = prior_around(0.01, 0.05, 0.3)


def paired_difference_bounds(n: int, production_only: int, canary_only: int, lower_level: float,
                             upper_level: float) -> tuple[float, float]:
    """Anytime-valid bounds of canary − production robustness from ``n`` paired copies: among
    them ``production_only`` kept by production alone and ``canary_only`` by the canary alone.

    The difference is P(canary only) − P(production only); each share is bounded by a
    confidence sequence (``filters.compare.sequential``) at half the level, so the lower bound
    L(canary only) − U(production only) errs with probability at most ``lower_level`` over
    every sample size at once (Bonferroni), and likewise the upper. Concordant pairs count: two
    identical models give a difference bounded near 0 at the rate of the pairs, not of the
    (much slower) two-sample comparison."""
    if n <= 0:
        return -1.0, 1.0
    lo = (lower_bound(canary_only, n, lower_level / 2, _PAIRED)
          - upper_bound(production_only, n, lower_level / 2, _PAIRED))
    hi = (upper_bound(canary_only, n, upper_level / 2, _PAIRED)
          - lower_bound(production_only, n, upper_level / 2, _PAIRED))
    return lo, hi


def share_bounds(kept: int, n: int, level: float) -> tuple[float, float]:
    """Anytime-valid bounds of one side's robustness (each end at ``level``)."""
    return (lower_bound(kept, n, level, UNIFORM), upper_bound(kept, n, level, UNIFORM))
