"""The release verdict: clean-copy correctness, robustness side by side (paired anytime-valid
bounds; Wilson intervals beside them), and the rate cap on production's extra calls."""

from __future__ import annotations

import pytest

from filters.compare import Comparison, VerdictConfig
from filters.robustness.config import RobustnessConfig
from filters.robustness.experiment import Pair, TokenBucket
from filters.robustness.stats import difference_interval, wilson
from filters.robustness.verdict import ReleaseVerdict
from proxy.clock import ManualClock

CFG = VerdictConfig(promote_agreement=0.99, abort_agreement=0.9)
ROBUST = RobustnessConfig(perturbations=({"kind": "gaussian_noise"}, {"kind": "patch_mask"}),
                          min_samples=10, max_drop=0.05)
AGREE = Comparison(True, {"cosine": 1.0})


def test_wilson_matches_the_textbook_figures() -> None:
    lo, hi = wilson(8, 10)  # 80 % of 10: 0.490 to 0.943
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0)
    lo, hi = wilson(20, 20)
    assert hi == 1.0 and lo == pytest.approx(0.8389, abs=1e-3)
    # equal proportions: the difference interval straddles 0; far apart: it does not
    lo, hi = difference_interval((18, 20), (18, 20))
    assert lo < 0 < hi
    assert difference_interval((2, 20), (19, 20))[1] < 0


def correct(v: ReleaseVerdict, n: int = 600) -> None:
    for _ in range(n):
        v.add(AGREE, 0.001, 0.001)


def test_faulted_copies_never_count_toward_correctness_or_latency() -> None:
    v = ReleaseVerdict(CFG, ManualClock())
    correct(v)
    for _ in range(50):  # delayed 80 ms and disagreeing: all touched by a fault
        v.exclude(["chaos/delay", "chaos/gaussian_noise"])
    assert v.state() == "promote"
    snap = v.snapshot()
    assert snap["excluded"] == 50 and snap["samples"] == 600
    assert snap["excluded_by"] == {"chaos/delay": 50, "chaos/gaussian_noise": 50}


def pairs(v: ReleaseVerdict, label: str, n: int, production: bool, canary: bool) -> None:
    assert v.robustness is not None
    for _ in range(n):
        v.robustness.add(label, Pair(production, canary, {}, {}))
    v.judge_robustness()


def test_promote_needs_every_perturbation_shown_within_the_margin() -> None:
    v = ReleaseVerdict(CFG, ManualClock(), robustness=ROBUST)
    correct(v)
    assert v.state() == "hold"
    assert "robustness under 'gaussian_noise': 0 of 10 pairs" in v.reasons()
    pairs(v, "gaussian_noise", 10, True, True)  # 10 identical pairs: not evidence yet
    assert v.state() == "hold"
    assert any(r.startswith("robustness under 'gaussian_noise': difference bounds")
               for r in v.reasons())
    pairs(v, "gaussian_noise", 200, True, True)
    assert v.state() == "hold"
    assert [r for r in v.reasons() if "robustness" in r] == [
        "robustness under 'patch_mask': 0 of 10 pairs"]
    pairs(v, "patch_mask", 200, False, False)  # neither side keeps: as robust as production
    assert v.state() == "promote"
    assert any("robustness under 'patch_mask': difference ≥" in r for r in v.reasons())
    row = v.snapshot()["robustness"]["rows"][0]
    assert row["verdict"] == "passes" and row["difference_bounds"][0] >= -0.05


def test_a_less_robust_canary_aborts_naming_the_perturbation() -> None:
    v = ReleaseVerdict(CFG, ManualClock(), robustness=ROBUST)
    correct(v, 20)
    pairs(v, "patch_mask", 20, True, True)
    for _ in range(10):  # 70 % vs 100 %: 30 points below
        pairs(v, "gaussian_noise", 7, True, True)
        pairs(v, "gaussian_noise", 3, True, False)
        if v.state() == "abort":
            break
    assert v.state() == "abort"
    (why,) = v.reasons()
    assert why.startswith("robustness under 'gaussian_noise': canary keeps 70.0% of its clean "
                          "answers, production 100.0%")
    assert "-30.0 points (anytime bounds" in why and "below the margin of -5.0" in why
    assert v.snapshot()["robustness"]["rows"][0]["difference"] == pytest.approx(-0.3)


def test_within_the_margin_is_not_an_abort() -> None:
    v = ReleaseVerdict(CFG, ManualClock(), robustness=ROBUST)
    correct(v)
    pairs(v, "patch_mask", 400, True, True)
    for _ in range(20):  # 2 points below production: inside the 5-point margin
        pairs(v, "gaussian_noise", 49, True, True)
        pairs(v, "gaussian_noise", 1, True, False)
    assert v.state() == "promote"
    v.reset()
    assert v.state() == "collecting" and v.snapshot()["robustness"]["rows"][0]["samples"] == 0


def test_the_cap_on_production_calls_refills_with_time() -> None:
    now = [0.0]
    bucket = TokenBucket(10, lambda: now[0])
    assert all(bucket.take(2) for _ in range(5))  # one second's worth
    assert not bucket.take(2)
    now[0] += 0.2  # two more tokens
    assert bucket.take(2) and not bucket.take(2)


def test_perturbation_names_must_be_unique() -> None:
    with pytest.raises(ValueError, match="unique"):
        RobustnessConfig(perturbations=({"kind": "gaussian_noise"}, {"kind": "gaussian_noise"}))
    RobustnessConfig(perturbations=({"kind": "gaussian_noise"},
                                    {"kind": "gaussian_noise", "name": "noise-0.03",
                                     "sigma": 0.03}))
