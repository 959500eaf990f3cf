"""Samples to a decision at matched error rates (``bench.verdict_matched``): the fixed-sample
sizes are what the binomial law says, the Kayenta-style judge holds ``beta`` only from that size
on, and the sequential verdict decides in fewer samples than it at the same error rates, in a
smaller seeded run of the simulation (where it needs more than the same test at a fixed n, the
test says so too)."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from bench.verdict_matched import (
    agreement_check_n,
    batch,
    fixed_n,
    kayenta_promotes,
    median_gate_n,
)
from bench.verdict_sim import SCENARIOS, simulate
from filters.compare import VerdictConfig

CFG = VerdictConfig()
SHARE = CFG.alpha / 3


def _scenario(name: str) -> int:
    return next(i for i, sc in enumerate(SCENARIOS) if sc.name == name)


def test_an_identical_canary_needs_n_with_bar_to_the_n_under_beta() -> None:
    found = fixed_n(CFG.promote_agreement, 1.0, CFG.beta, SHARE)
    assert found.n == math.ceil(math.log(CFG.beta) / math.log(CFG.promote_agreement)) == 598
    assert found.cut == found.n  # promote only when every comparison agreed


@pytest.mark.parametrize(("null_p", "alt_p", "null_level", "alt_level"), [
    (0.95, 0.90, SHARE, CFG.beta), (0.5, 0.65, SHARE, CFG.beta), (0.5, 0.2, CFG.beta, SHARE)])
def test_fixed_n_is_the_smallest_size_holding_both_error_rates(
        null_p: float, alt_p: float, null_level: float, alt_level: float) -> None:
    found = fixed_n(null_p, alt_p, null_level, alt_level)
    assert found.n is not None
    up = alt_p > null_p
    n, cut = found.n, found.cut
    wrong_null = stats.binom.sf(cut - 1, n, null_p) if up else stats.binom.cdf(cut, n, null_p)
    wrong_alt = stats.binom.cdf(cut - 1, n, alt_p) if up else stats.binom.sf(cut, n, alt_p)
    assert wrong_null <= null_level and wrong_alt <= alt_level
    for c in range(n):  # one sample fewer: no cut holds both
        if up:
            assert (stats.binom.sf(c - 1, n - 1, null_p) > null_level
                    or stats.binom.cdf(c - 1, n - 1, alt_p) > alt_level)
        else:
            assert (stats.binom.cdf(c, n - 1, null_p) > null_level
                    or stats.binom.sf(c, n - 1, alt_p) > alt_level)
    assert found.normal == pytest.approx(n, rel=0.15)


def test_the_kayenta_style_check_holds_beta_on_a_99_percent_canary_only_from_a_thousand() -> None:
    check, always = agreement_check_n(0.99, CFG.promote_agreement, CFG.beta)
    assert always is not None and 1000 < always < 1100
    assert check.normal == pytest.approx(always, rel=0.1)
    assert check.n is not None and check.n < always  # a lucky n exists; a judge cannot pick it
    runs = 400
    b = batch(SCENARIOS[_scenario("A/B agreement 99 %")], runs, always, seed=3)
    promoted = int(kayenta_promotes(b, always, CFG.promote_agreement).sum())
    assert promoted <= stats.binom.ppf(0.999, runs, CFG.beta)
    early = int(kayenta_promotes(b, 400, CFG.promote_agreement).sum())  # 8 intervals of 50
    assert early >= stats.binom.ppf(0.001, runs, 0.15)  # far above beta


def test_the_median_gate_needs_about_177_pairs_not_to_abort_a_canary_inside_the_margin() -> None:
    assert median_gate_n(1.05, 0.15, CFG.alpha) == pytest.approx(177, abs=2)


def test_the_verdict_decides_sooner_than_the_kayenta_style_judge_at_the_same_error_rates() -> None:
    _, kayenta = agreement_check_n(0.99, CFG.promote_agreement, CFG.beta)
    assert kayenta is not None
    runs = {"A/B latency +30 %": 24, "A/B agreement 90 %": 16, "A/A deterministic": 4}
    rows = {r["scenario"]: r["mmguard"] for name, k in runs.items()
            for r in simulate(k, 1300, seed=11, procs=1, kayenta=4, only=(_scenario(name),))}
    for name, k in runs.items():
        row = rows[name]
        assert row["error"] * k <= stats.binom.ppf(0.999, k, CFG.alpha if "A/A" in name
                                                   else CFG.beta), name
        assert row["decided"] == 1.0, name
        assert row["median_samples"] < kayenta, (name, row)
    # against the same test sized for the effect the scenario has: sooner on the regressions
    # (the effect is larger than the bar it is tested against) ...
    assert rows["A/B latency +30 %"]["median_samples"] < fixed_n(0.5, 0.657, SHARE, CFG.beta).n
    assert rows["A/B agreement 90 %"]["median_samples"] < fixed_n(0.95, 0.90, SHARE, CFG.beta).n
    # ... but an identical canary's promote costs more than the 598 of 598 a fixed-n test
    # needs: evidence that holds at every look is paid for where it accumulates steadily
    assert rows["A/A deterministic"]["median_samples"] > 598
