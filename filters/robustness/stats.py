"""Intervals for the robustness table: Wilson's score interval for a kept share, and the
interval of the difference between two shares (canary minus production)."""

from __future__ import annotations

import math


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
