"""Samples to a decision at matched error rates: the sequential verdict beside fixed-sample judges
sized to hold the same false-abort and false-promote rates on the same scenarios.

A fixed-sample judge looks once, after n samples, and its error rates fall as n grows; comparing
its n with the verdict's samples means something only at equal error rates. Here every
fixed-sample judge is sized to hold the verdict's defaults — ``alpha`` (false abort, split over
the abort tests as the verdict splits it) and ``beta`` (false promote) — and the verdict's
median and p90 samples to a decision (``bench.verdict_sim``, consulted after every sample) sit
beside that n.

- **The same test at a fixed n**: the one-sided binomial test of the hypothesis the verdict's
  test decides (agreement at the promote bar or the abort line; a pair slower than the latency
  margin with probability ½), at the size that separates it from the effect the scenario really
  has (exact binomial, checked against the normal approximation). It is told the effect in
  advance; the verdict is not.
- **The Kayenta-style judge** of ``bench.verdict_sim`` as one analysis of the first n
  comparisons (agreement ≥ the bar; a one-sided Mann-Whitney p < 0.05 with a median 10 % higher
  fails latency): the smallest n on a grid at which, on seeded streams, it aborts no scenario
  that meets its SLO in more than ``alpha`` of runs and promotes none that misses it in more
  than ``beta`` — once for the whole table, once on the latency scenarios alone. Checked against
  normal approximations: the agreement check is ``Binomial(n, p) ≥ bar·n``; on latency the
  median gate binds (the sample median's variance, ``π/2 · σ² / n`` on the log scale).

    python -m bench.verdict_matched [--runs 120] [--kayenta-runs 1000] [--seed 1] [--procs 2]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy import stats

from bench.verdict_sim import SCENARIOS, Scenario, simulate, stream
from filters.compare import Verdict, VerdictConfig
from proxy.clock import ManualClock

MW_P, MEDIAN_RATIO = 0.05, 1.1
"""The Kayenta-style latency check, as in ``bench.verdict_sim.run_kayenta``."""
GRID = (25, 50, 75, 100, 150, 200, 250, 300, 400, 500, 600, 700, 800, 900, 1000, 1050, 1100,
        1150, 1200, 1300, 1400, 1600, 1800, 2000, 2500)


@dataclass(frozen=True)
class Sized:
    n: int | None
    """The smallest n that holds both error rates (None: none up to the cap)."""
    cut: int
    """Decide for the alternative at this many successes or more (fewer, when it is below)."""
    normal: float
    """The normal approximation of n."""


def fixed_n(null_p: float, alt_p: float, null_level: float, alt_level: float,
            cap: int = 100_000) -> Sized:
    """The smallest n at which a one-sided binomial test tells ``null_p`` from ``alt_p``:
    P(decide for the alternative | null_p) ≤ ``null_level`` and P(decide for the null | alt_p)
    ≤ ``alt_level``; each n gets its most powerful cut (exact binomial)."""
    if alt_p < null_p:  # count failures instead: the same test, mirrored
        found = fixed_n(1 - null_p, 1 - alt_p, null_level, alt_level, cap)
        return Sized(found.n, -1 if found.n is None else found.n - found.cut, found.normal)
    ns = np.arange(1, cap + 1)
    k = np.asarray(stats.binom.ppf(1 - null_level, ns, null_p), dtype=np.float64)
    ok = np.asarray(stats.binom.cdf(k, ns, alt_p) <= alt_level)  # k: P(X > k | null) ≤ level
    hits = np.flatnonzero(ok)
    n = int(ns[hits[0]]) if hits.size else None
    z0, z1 = float(stats.norm.isf(null_level)), float(stats.norm.isf(alt_level))
    normal = ((z0 * math.sqrt(null_p * (1 - null_p)) + z1 * math.sqrt(alt_p * (1 - alt_p)))
              / (alt_p - null_p)) ** 2
    return Sized(n, -1 if n is None else int(k[n - 1]) + 1, normal)


def agreement_check_n(bad_p: float, bar: float, beta: float, cap: int = 20_000
                      ) -> tuple[Sized, int | None]:
    """The Kayenta-style agreement check (promote at agreement ≥ ``bar`` over n): the smallest n
    at which a canary agreeing at ``bad_p`` passes it in at most ``beta`` of runs, and the
    smallest from which that holds at every larger n up to ``cap`` (the cut moves in whole
    samples, so the rate zigzags with n)."""
    ns = np.arange(1, cap + 1)
    cut = np.ceil(bar * ns - 1e-9)
    ok = np.asarray(stats.binom.sf(cut - 1, ns, bad_p) <= beta)
    hits = np.flatnonzero(ok)
    n = int(ns[hits[0]]) if hits.size else None
    misses = np.flatnonzero(~ok)
    always = None if not ok[-1] else int(ns[misses[-1]]) + 1 if misses.size else 1
    normal = (float(stats.norm.isf(beta)) * math.sqrt(bad_p * (1 - bad_p)) / (bar - bad_p)) ** 2
    return Sized(n, -1 if n is None else int(cut[n - 1]), normal), always


def median_gate_n(good_ratio: float, sigma: float, alpha: float) -> float:
    """Normal approximation of the n at which a canary ``good_ratio`` times slower (inside the
    margin) passes the median gate (median ``MEDIAN_RATIO`` times higher) in ≥ 1 − ``alpha`` of
    runs: each log median has variance π/2 · σ² / n."""
    sd = sigma * math.sqrt(math.pi)  # of the difference of the two log medians, times √n
    return float((stats.norm.isf(alpha) * sd / math.log(MEDIAN_RATIO / good_ratio)) ** 2)


# --- the Kayenta-style judge as one analysis of n, on seeded streams ------------------------


@dataclass
class Batch:
    agree: NDArray[np.bool_]
    primary_ms: NDArray[np.float64]
    canary_ms: NDArray[np.float64]


def batch(sc: Scenario, runs: int, horizon: int, seed: int) -> Batch:
    found = [stream(sc, horizon, seed * 1_000_003 + i) for i in range(runs)]
    return Batch(np.stack([s.agree for s in found]), np.stack([s.primary_ms for s in found]),
                 np.stack([s.canary_ms for s in found]))


def kayenta_promotes(b: Batch, n: int, bar: float) -> NDArray[np.bool_]:
    """Per run: the Kayenta-style judge promotes after one analysis of the first n comparisons
    (the Mann-Whitney test only where the median gate is crossed: the check needs both)."""
    agreed = b.agree[:, :n].mean(axis=1) >= bar
    c, p = b.canary_ms[:, :n], b.primary_ms[:, :n]
    high = np.median(c, axis=1) > MEDIAN_RATIO * np.median(p, axis=1)
    rows = np.flatnonzero(high)
    if rows.size:
        pv = stats.mannwhitneyu(c[rows], p[rows], axis=1, alternative="greater").pvalue
        high[rows] = np.asarray(pv) < MW_P
    return np.asarray(agreed & ~high, dtype=np.bool_)


def kayenta_curve(sc: Scenario, runs: int, seed: int, bar: float) -> dict[int, float]:
    """The Kayenta-style judge's wrong-decision rate after one analysis of n, per grid n."""
    b = batch(sc, runs, max(GRID), seed)
    curve = {}
    for n in GRID:
        promoted = kayenta_promotes(b, n, bar)
        curve[n] = float(np.mean(~promoted if sc.good else promoted))
    return curve


def holds_from(curves: list[tuple[dict[int, float], float]]) -> int | None:
    """The smallest grid n from which every curve stays within its target at every larger
    grid n (a judge does not get to pick a lucky n)."""
    found = None
    for n in reversed(GRID):
        if any(curve[n] > target for curve, target in curves):
            break
        found = n
    return found


# --- the table -------------------------------------------------------------------------------


def slower_share(sc: Scenario, cfg: VerdictConfig, runs: int = 200, horizon: int = 2000,
                 seed: int = 99) -> float:
    """P(a pair's canary is slower than the verdict's margin): the sign test's true rate."""
    assert cfg.max_latency_ratio is not None
    b = batch(sc, runs, horizon, seed)
    limit = np.maximum(cfg.max_latency_ratio * b.primary_ms, b.primary_ms + cfg.min_effect_ms)
    return float(np.mean(b.canary_ms > limit))


def same_test_n(sc: Scenario, cfg: VerdictConfig, abort_share: float) -> tuple[Sized, str]:
    """The fixed-n size of the verdict's own test for the decision it reaches on ``sc``."""
    lat = slower_share(sc, cfg)
    if sc.good:  # promote: agreement's lower bound over the bar, latency's upper under ½
        agree = fixed_n(cfg.promote_agreement, sc.agreement, cfg.beta, abort_share)
        centre = fixed_n(0.5, lat, cfg.beta, abort_share)
        worst = max((agree, centre), key=lambda s: math.inf if s.n is None else s.n)
        return worst, f"agreement 1 vs bar, slower-than-margin {lat:.0%} vs ½"
    if sc.agreement < cfg.abort_agreement:
        return (fixed_n(cfg.abort_agreement, sc.agreement, abort_share, cfg.beta),
                f"agreement {sc.agreement:.0%} vs abort line")
    if lat > 0.5:
        return fixed_n(0.5, lat, abort_share, cfg.beta), f"slower-than-margin {lat:.1%} vs ½"
    return Sized(None, -1, math.nan), "held: between the abort line and the bar"


MATCHED = ("A/A deterministic", "A/A stalls 1 % both sides", "A/A heavy tails",
           "A/B latency +5 % (within margin)", "A/B agreement 99 %", "A/B agreement 97 %",
           "A/B agreement 90 %", "A/B latency +30 %", "A/B latency +30 %, stalls")
"""The scenarios a judge without a noise floor can be matched on (with a noise floor of 90 %
the Kayenta-style judge aborts an identical canary at any n)."""


def matched(rows: dict[str, dict[str, Any]], kayenta_runs: int, seed: int) -> dict[str, Any]:
    """``rows``: ``bench.verdict_sim.simulate``'s mmguard summaries by scenario name."""
    cfg = VerdictConfig()
    share = Verdict(cfg, ManualClock()).levels().abort  # alpha over its abort tests
    scs = [sc for sc in SCENARIOS if sc.name in MATCHED]
    curves = [(kayenta_curve(sc, kayenta_runs, seed, cfg.promote_agreement),
               cfg.alpha if sc.good else cfg.beta) for sc in scs]
    k_all = holds_from(curves)
    k_lat = holds_from([c for c, sc in zip(curves, scs, strict=True) if sc.agreement == 1.0])
    out = []
    for sc, (curve, target) in zip(scs, curves, strict=True):
        size, basis = same_test_n(sc, cfg, share)
        out.append({"scenario": sc.name, "good": sc.good, "mmguard": rows.get(sc.name),
                    "same_test": size, "basis": basis, "kayenta_own": holds_from([(curve, target)]),
                    "kayenta_at_n": None if k_all is None else curve[k_all]})
    bad = next(sc for sc in scs if sc.name == "A/B agreement 99 %")
    check, always = agreement_check_n(bad.agreement, cfg.promote_agreement, cfg.beta)
    return {"rows": out, "kayenta_n": k_all, "kayenta_latency_n": k_lat,
            "agreement_check": check, "agreement_check_always": always,
            "median_gate_normal": median_gate_n(1.05, 0.15, cfg.alpha),
            "kayenta_runs": kayenta_runs, "alpha": cfg.alpha, "beta": cfg.beta, "share": share}


def _n(s: Sized) -> str:
    return "—" if s.n is None else f"{s.n} (normal {s.normal:.0f})"


def _mm(m: dict[str, Any] | None) -> str:
    if m is None or math.isnan(m["median_samples"]):
        return "held: no decision"
    return (f"{m['median_samples']:.0f} ({m['p90_samples']:.0f}); "
            f"wrong {m['error']:.1%} [≤ {m['error_ci'][1]:.1%}]")


def markdown(m: dict[str, Any]) -> str:
    head = ("| scenario | wrong decision (target) | mmguard: median (p90) samples to a decision; "
            "wrong-decision rate [95 % upper] | the same test at a fixed n (normal approx.) | "
            "Kayenta-style, one analysis: n it needs; wrong rate at n = "
            f"{m['kayenta_n']} |\n|---|---|---|---|---|\n")
    body = ""
    for r in m["rows"]:
        own, at = r["kayenta_own"], r["kayenta_at_n"]
        k = ("—" if own is None else f"{own}") + ("" if at is None else f"; {at:.1%}")
        body += (f"| {r['scenario']} | {'abort (α)' if r['good'] else 'promote (β)'} | "
                 f"{_mm(r['mmguard'])} | {_n(r['same_test'])}: {r['basis']} | {k} |\n")
    ag = m["agreement_check"]
    return (head + body +
            f"\nα = {m['alpha']:g} (for the same test {m['share']:.4f}: α split over the abort "
            f"tests as the verdict splits it), β = {m['beta']:g}. Kayenta-style judge: "
            f"{m['kayenta_runs']} seeded runs per scenario, n on the grid {GRID[0]}–{GRID[-1]}, "
            f"the smallest from which every larger grid n holds: n = {m['kayenta_n']} for the "
            f"whole table, n = {m['kayenta_latency_n']} on the latency scenarios alone. Normal "
            f"approximations: the agreement check on the 99 % canary (bar 99.5 %) n ≈ "
            f"{ag.normal:.0f} (exact binomial: {ag.n} at the luckiest n, every n ≥ "
            f"{m['agreement_check_always']}); the median gate on the +5 % canary "
            f"n ≈ {m['median_gate_normal']:.0f}.\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=120, help="mmguard's runs per scenario")
    ap.add_argument("--horizon", type=int, default=2500)
    ap.add_argument("--kayenta-runs", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--procs", type=int, default=2)
    a = ap.parse_args()
    t0 = time.monotonic()
    only = tuple(i for i, sc in enumerate(SCENARIOS) if sc.name in MATCHED)
    rows = simulate(a.runs, a.horizon, a.seed, a.procs, 4, only)
    found = matched({r["scenario"]: r["mmguard"] for r in rows}, a.kayenta_runs, a.seed)
    print(markdown(found))
    print(f"mmguard: {a.runs} seeded runs of up to {a.horizon} per scenario; "
          f"wall {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
