"""The verdict's statistics against scipy, their anytime validity on seeded streams, and the
release verdict's error rates in a smaller seeded run of ``bench.verdict_sim``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from bench.verdict_sim import SCENARIOS, simulate
from filters.compare.sequential import (
    UNIFORM,
    LogHistogram,
    count_range,
    log_mixture,
    lower_bound,
    prior_around,
    quantile_bounds,
    rejects,
    support_from,
    upper_bound,
)
from filters.robustness.stats import paired_difference_bounds, wilson


@pytest.mark.parametrize(("s", "n", "p"), [(0, 10, 0.3), (7, 10, 0.5), (990, 1000, 0.995),
                                           (1000, 1000, 0.99), (3, 400, 0.02)])
def test_the_uniform_mixture_is_the_inverse_binomial_probability(s: int, n: int,
                                                                 p: float) -> None:
    # ∫ L(q) dq / L(p) with a uniform prior = 1 / ((n + 1) · Binomial(n, p).pmf(s))
    expect = -math.log((n + 1) * stats.binom.pmf(s, n, p))
    assert log_mixture(s, n, p, UNIFORM) == pytest.approx(expect, rel=1e-9, abs=1e-9)


def test_a_beta_mixture_is_the_beta_binomial_over_the_binomial() -> None:
    prior = prior_around(0.9, strengths=(50.0,))  # ½ Beta(1, 1) + ½ Beta(45, 5)
    s, n, p = 180, 200, 0.95
    mix = 0.5 * stats.betabinom.pmf(s, n, 1, 1) + 0.5 * stats.betabinom.pmf(s, n, 45, 5)
    expect = math.log(mix / stats.binom.pmf(s, n, p))
    assert log_mixture(s, n, p, prior) == pytest.approx(expect, rel=1e-9)


def test_bounds_sit_where_the_evidence_reaches_one_over_the_level() -> None:
    prior = prior_around(0.995, 0.95)
    s, n, level = 960, 1000, 0.01
    lo, hi = lower_bound(s, n, level, prior), upper_bound(s, n, level, prior)
    assert lo < s / n < hi
    for edge in (lo, hi):
        assert log_mixture(s, n, edge, prior) == pytest.approx(-math.log(level), abs=1e-6)
    # an anytime interval contains the fixed-sample one at the same level
    cp = stats.binomtest(s, n).proportion_ci(1 - 2 * level, method="exact")
    assert lo < cp.low and hi > cp.high
    assert lower_bound(0, n, level, prior) == 0.0 and upper_bound(n, n, level, prior) == 1.0


def test_twenty_of_twenty_bounds_agreement_far_below_the_bar() -> None:
    assert wilson(20, 20)[0] == pytest.approx(0.8389, abs=1e-3)  # the figure
    assert lower_bound(20, 20, 0.05, prior_around(0.995, 0.95)) < 0.9


def _ever_excluded(rng: np.random.Generator, p: float, n: int, level: float,
                   looks: int = 1) -> bool:
    x = np.cumsum(rng.random(n) < p)
    prior = prior_around(p)
    return any(rejects(int(x[i - 1]), i, p, level, prior) for i in range(looks, n + 1, looks))


def test_anytime_validity_on_seeded_streams_where_repeated_wilson_fails() -> None:
    rng = np.random.default_rng(11)
    runs, n, level = 200, 400, 0.05
    ours = sum(_ever_excluded(rng, 0.9, n, level) for _ in range(runs))
    hi = stats.binom.ppf(0.999, runs, level)  # at most `level`, within binomial noise
    assert ours <= hi
    # the same streams judged by a 95 % Wilson interval at every look: wrong far more often
    rng = np.random.default_rng(11)
    naive = 0
    for _ in range(runs):
        x = np.cumsum(rng.random(n) < 0.9)
        naive += any(not wilson(int(x[i - 1]), i)[0] <= 0.9 <= wilson(int(x[i - 1]), i)[1]
                     for i in range(10, n + 1))
    assert naive > 3 * ours and naive / runs > 0.2


def test_quantile_bounds_cover_the_true_median_and_p99_at_every_look() -> None:
    rng = np.random.default_rng(5)
    level, misses, runs = 0.05, 0, 80
    truth = {0.5: 10.0, 0.99: 10.0 * math.exp(0.3 * stats.norm.ppf(0.99))}
    for _ in range(runs):
        h = LogHistogram()
        bad = False
        for i, ms in enumerate(10.0 * rng.lognormal(0, 0.3, 1000)):
            h.add(float(ms))
            if (i + 1) % 50:
                continue
            for q, true in truth.items():
                b = quantile_bounds(h, q, level / 2, prior_around(q))
                bad |= (b.lower is not None and b.lower > true) or \
                    (b.upper is not None and b.upper < true)
        misses += bad
    assert misses <= stats.binom.ppf(0.999, runs, level)


def test_a_p99_needs_hundreds_of_samples_before_it_is_bounded_above() -> None:
    n = support_from(0.99, 0.005, prior_around(0.99))
    assert 400 < n < 1500
    _, hi = count_range(n - 1, 0.99, 0.005, prior_around(0.99))
    assert hi == n - 1  # one sample fewer: the largest might still be under the p99
    assert count_range(n, 0.99, 0.005, prior_around(0.99))[1] < n


def test_the_histogram_reads_order_statistics_on_the_safe_side() -> None:
    h = LogHistogram()
    for ms in (1.0, 2.0, 3.0, 100.0):
        h.add(ms)
    assert h.order_stat(2, "low") <= 2.0 <= h.order_stat(2, "high") <= 2.0 * 1.02
    assert h.order_stat(4, "high") >= 100.0


def test_paired_robustness_bounds_use_the_discordant_pairs() -> None:
    lo, hi = paired_difference_bounds(300, 0, 0, 0.05, 0.01)
    assert -0.05 < lo < 0 < hi < 0.05  # identical answers: near 0, fast
    lo, hi = paired_difference_bounds(300, 90, 0, 0.05, 0.01)
    assert hi < -0.15  # production alone kept 30 %: clearly below


# --- the verdict's error rates, a smaller seeded run of bench/verdict_sim ---------------------


def _index(name: str) -> int:
    return next(i for i, sc in enumerate(SCENARIOS) if sc.name == name)


def test_error_rates_in_simulation_are_inside_their_binomial_bounds() -> None:
    runs = 40
    rows = {r["scenario"]: r["mmguard"] for r in simulate(
        runs, 1300, seed=7, procs=1, kayenta=4,
        only=(_index("A/A stalls 1 % both sides"), _index("A/B agreement 99 %"),
              _index("A/B latency +30 %")))}
    stalls = rows["A/A stalls 1 % both sides"]
    assert stalls["error"] * runs <= stats.binom.ppf(0.999, runs, 0.01)  # alpha
    assert stalls["right"] > 0.8  # promoted (the rest: still holding at the horizon)
    assert rows["A/B agreement 99 %"]["error"] * runs <= stats.binom.ppf(0.999, runs, 0.05)
    slow = rows["A/B latency +30 %"]
    assert slow["right"] * runs >= stats.binom.ppf(0.001, runs, 0.95)  # aborted ≥ 95 %
    assert slow["median_samples"] < 300
