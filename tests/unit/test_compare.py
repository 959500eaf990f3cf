"""Canary comparison (tensors, text, outcomes) and the sliding-window verdict, on a ManualClock."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from filters.compare import (
    CompareConfig,
    Comparison,
    Verdict,
    VerdictConfig,
    compare,
    compare_status,
    compare_tensors,
    compare_text,
    normalise,
)
from proxy.clock import ManualClock

RNG = np.random.default_rng(7)
LOGITS = RNG.normal(size=(4, 10)).astype(np.float32)
AGREE = Comparison(True, {"cosine": 1.0, "max_abs": 0.0})
DISAGREE = Comparison(False, {"cosine": 0.5, "max_abs": 2.0},
                      "output 'logits': cosine 0.500 < 0.990")


def cfg(**kw: Any) -> CompareConfig:
    return CompareConfig(**kw)


# --- tensors -------------------------------------------------------------------------------

def test_identical_tensors_agree_with_cosine_one() -> None:
    c = compare_tensors({"logits": LOGITS}, {"logits": LOGITS.copy()}, cfg(atol=0.0))
    assert c.agree and c.reason == ""
    assert c.metrics["cosine"] == 1.0 and c.metrics["max_abs"] == 0.0


def test_noise_within_atol_agrees_and_beyond_it_disagrees_naming_the_output() -> None:
    noise = RNG.uniform(-1, 1, LOGITS.shape).astype(np.float32)
    small = compare_tensors({"logits": LOGITS}, {"logits": LOGITS + 1e-4 * noise}, cfg(atol=1e-3))
    assert small.agree and 0 < small.metrics["max_abs"] <= 1e-3
    big = compare_tensors({"logits": LOGITS}, {"logits": LOGITS + 1e-2 * noise}, cfg(atol=1e-3))
    assert not big.agree
    assert big.reason.startswith("output 'logits': max_abs ") and "> 0.001" in big.reason


def test_cosine_is_judged_per_batch_item_and_the_worst_is_reported() -> None:
    canary = LOGITS.copy()
    canary[2] = -canary[2]  # one item of four points the other way
    c = compare_tensors({"logits": LOGITS}, {"logits": canary}, cfg())
    assert not c.agree and c.metrics["cosine"] == pytest.approx(-1.0)
    assert "output 'logits': cosine -1.000 < 0.990" in c.reason


def test_shape_dtype_and_missing_outputs_disagree() -> None:
    shape = compare_tensors({"y": LOGITS}, {"y": LOGITS[:3]}, cfg())
    assert not shape.agree and shape.reason == "output 'y': shape [3, 10] != primary [4, 10]"
    kind = compare_tensors({"y": LOGITS}, {"y": LOGITS.astype(np.int32)}, cfg())
    assert not kind.agree and "dtype int32 (int) != primary float32 (float)" in kind.reason
    # float16 against float32 is the same kind: compared by value
    assert compare_tensors({"y": LOGITS}, {"y": LOGITS.astype(np.float16)}, cfg()).agree
    missing = compare_tensors({"y": LOGITS, "z": LOGITS}, {"y": LOGITS}, cfg())
    assert not missing.agree and missing.reason == "output 'z': missing from the canary answer"
    # an output only the canary has is ignored; a named one the primary lacks is not
    assert compare_tensors({"y": LOGITS}, {"y": LOGITS, "new": LOGITS}, cfg()).agree
    named = compare_tensors({"y": LOGITS}, {"y": LOGITS}, cfg(outputs=("y", "w")))
    assert named.reason == "output 'w': missing from the primary answer"


def test_nan_in_the_canary_where_the_primary_is_finite_disagrees() -> None:
    canary = LOGITS.copy()
    canary[1, 3] = np.nan
    canary[0, 0] = np.inf
    c = compare_tensors({"logits": LOGITS}, {"logits": canary}, cfg(cosine_min=None))
    assert not c.agree
    assert c.reason == "output 'logits': 2 NaN/Inf values in the canary where the primary is finite"
    # the same NaN on both sides is not the canary's fault
    both = LOGITS.copy()
    both[1, 3] = np.nan
    assert compare_tensors({"logits": both}, {"logits": both.copy()}, cfg(atol=0.0)).agree


def test_classification_detects_a_top1_flip_that_cosine_misses() -> None:
    canary = LOGITS.copy()
    row = canary[1]
    first, second = np.argsort(-row)[:2]
    row[first], row[second] = row[second], row[first]  # swap the two best classes of one row
    plain = compare_tensors({"logits": LOGITS}, {"logits": canary}, cfg(cosine_min=0.5))
    assert plain.agree  # close enough by cosine
    c = compare_tensors({"logits": LOGITS}, {"logits": canary},
                        cfg(cosine_min=0.5, classification=True, topk=3))
    assert not c.agree and "top-1 class differs in 25.0% of rows" in c.reason
    assert c.metrics["top1"] == 0.75
    assert c.metrics["topk"] == 1.0  # the same three classes, in another order


def test_topk_overlap_is_the_worst_rows_share() -> None:
    primary = np.array([[5.0, 4, 3, 2, 1]])
    canary = np.array([[5.0, 4, 1, 2, 3]])  # top-3 {0,1,2} vs {0,1,4}
    c = compare_tensors({"p": primary}, {"p": canary},
                        cfg(cosine_min=None, classification=True, topk=3))
    assert c.agree and c.metrics["topk"] == pytest.approx(2 / 3)


def test_integer_outputs_must_match_exactly() -> None:
    ids = np.array([[3, 7, 9]], np.int64)
    assert compare_tensors({"ids": ids}, {"ids": ids.copy()}, cfg()).agree
    c = compare_tensors({"ids": ids}, {"ids": np.array([[3, 8, 9]], np.int64)}, cfg())
    assert not c.agree and c.metrics["exact"] == pytest.approx(2 / 3)
    assert c.reason == "output 'ids': 66.7% of elements equal (all required)"


def test_bytes_outputs_are_compared_as_text_unless_kind_is_tensors() -> None:
    p = {"text": np.array([b"Paris.", b"a cat"], dtype=object)}
    q = {"text": np.array([b"paris", b"a cat"], dtype=object)}
    assert compare_tensors(p, q, cfg()).agree
    exact = compare_tensors(p, q, cfg(kind="tensors"))
    assert not exact.agree and exact.metrics["exact"] == 0.5


def test_compare_dispatches_on_the_answers() -> None:
    assert compare("Yes.", "yes", cfg()).agree
    assert compare({"y": LOGITS}, {"y": LOGITS}, cfg()).agree
    wrong = compare("yes", {"y": LOGITS}, cfg())
    assert not wrong.agree and "str and dict" in wrong.reason


# --- text ----------------------------------------------------------------------------------

def test_normalise() -> None:
    assert normalise("  «Hello,\tWORLD!» ") == "hello, world"
    assert normalise("ＡＢＣ ﬁne\n\n  Straße") == "abc fine strasse"  # NFKC, casefold
    assert normalise("...") == ""


def test_text_exact_and_normalised() -> None:
    assert compare_text("Paris", "Paris", cfg(text="exact")).agree
    exact = compare_text("Paris", "paris.", cfg(text="exact"))
    assert not exact.agree and exact.reason.startswith("text differs (exact match required")
    assert compare_text("Paris", "  paris. ", cfg(text="normalised")).agree
    other = compare_text("Paris", "Lyon", cfg(text="normalised"))
    assert not other.agree and other.reason == "text differs after normalisation (token F1 0.000)"
    assert other.metrics == {"exact": 0.0, "normalised": 0.0, "token_f1": 0.0}


def test_text_token_f1() -> None:
    near = compare_text("the cat sat", "The cat sat down.", cfg(text="token_f1"))
    assert near.agree and near.metrics["token_f1"] == pytest.approx(6 / 7)  # P 3/4, R 1
    far = compare_text("the cat sat", "a dog sat", cfg(text="token_f1"))
    assert not far.agree and far.reason == "text: token F1 0.333 < 0.800"
    # multisets: one "the" and one "cat" in common out of three tokens each
    bag = compare_text("the the cat", "the cat cat", cfg(text="token_f1"))
    assert bag.metrics["token_f1"] == pytest.approx(2 / 3)
    assert compare_text("", "", cfg(text="token_f1")).metrics["token_f1"] == 1.0


def test_compare_status() -> None:
    assert compare_status(True, "ok", True, "ok").agree
    assert compare_status(False, "too_large", False, "too_large").agree
    c = compare_status(True, "ok", False, "unavailable")
    assert not c.agree and c.reason == "outcome differs: primary ok, canary unavailable"
    assert not compare_status(False, "too_large", False, "internal").agree


def test_bad_configs_fail_at_load() -> None:
    with pytest.raises(ValidationError):
        CompareConfig(atol=-1)
    with pytest.raises(ValidationError):
        CompareConfig(cosine=0.9)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match=r"abort_agreement 0\.99 is above"):
        VerdictConfig(abort_agreement=0.99, promote_agreement=0.9)
    with pytest.raises(ValidationError, match="alpha"):
        VerdictConfig(alpha=0.7)
    with pytest.raises(ValidationError, match="max_latency_ratio"):
        VerdictConfig(max_latency_ratio=0.9)  # faster than production is no margin


# --- verdict ----------------------------------------------------------------------------
# (the statistics against scipy and the error rates in simulation: tests/unit/test_sequential.py)

Moves = list[tuple[str, str, list[str]]]


def verdict(**kw: Any) -> tuple[Verdict, ManualClock, Moves]:
    clock = ManualClock()
    moves: Moves = []
    v = Verdict(VerdictConfig(**kw), clock)
    v.on_change(lambda old, new, why: moves.append((old, new, why)))
    return v, clock, moves


def until(v: Verdict, state: str, c: Comparison = AGREE, limit: int = 5000,
          primary_s: float = 0.010, canary_s: float | None = 0.010) -> int:
    """Feed ``c`` until ``state``; the number of samples it took."""
    for i in range(limit):
        v.add(c, primary_s, canary_s)
        if v.state() == state:
            return i + 1
    raise AssertionError(f"no {state} in {limit} samples: {v.reasons()}")


def test_twenty_of_twenty_is_not_evidence_and_the_hold_says_how_much_is_missing() -> None:
    v, _, moves = verdict()
    for _ in range(19):
        v.add(AGREE, 0.010, 0.010)
    assert v.state() == "collecting" and v.reasons()[0] == "19 of 20 samples collected"
    v.add(AGREE, 0.010, 0.010)
    assert v.state() == "hold"  # the old verdict promoted here: the lower bound is ~83 %
    why = v.reasons()[0]
    assert why.startswith("effective agreement 100.00%, anytime bounds 8")
    assert "promote needs the lower bound ≥ 99.5%" in why and "more at the observed rates" in why
    more = int(why.split("about ")[1].split(" more")[0])
    took = until(v, "promote")
    assert abs(took - more) <= max(50, more // 10)  # the estimate was about right
    assert [m[:2] for m in moves] == [("collecting", "hold"), ("hold", "promote")]
    evidence = v.reasons()
    assert evidence == moves[-1][2]
    assert "anytime lower bound, false-promote rate 0.05) ≥ promote bar 99.5%" in evidence[0]
    assert "sequential sign test" in evidence[1]
    decided = v.snapshot()["decided"]
    assert decided["state"] == "promote" and decided["comparisons"] == 20 + took
    assert decided["figures"]["agreement"]["lower"] >= 0.995


def test_all_disagreeing_aborts_with_its_bound_and_latches_until_reset() -> None:
    v, _, moves = verdict()
    assert until(v, "abort", DISAGREE) == 20  # min_samples is the floor of any decision
    (why,) = v.reasons()
    assert why.startswith("effective agreement ≤ ") and "< abort line 95.0%" in why
    assert "the canary agreed in 0 of 20" in why
    assert "latest disagreement: output 'logits': cosine 0.500 < 0.990" in why
    for _ in range(3000):  # agreement again does not take an abort back
        v.add(AGREE, 0.01, 0.01)
    assert v.state() == "abort" and v.reasons() == [why]
    v.reset()
    assert v.state() == "collecting" and v.snapshot()["samples"] == 0
    assert [m[:2] for m in moves] == [("collecting", "abort"), ("abort", "collecting")]


def test_between_the_lines_it_holds_and_never_decides_on_a_few_samples() -> None:
    v, _, moves = verdict()
    for i in range(3000):  # 97 %: under the bar, over the abort line
        v.add(DISAGREE if i % 33 == 0 else AGREE, 0.01, 0.01)
    assert v.state() == "hold" and [m[:2] for m in moves] == [("collecting", "hold")]
    snap = v.snapshot()
    ev = snap["evidence"]["agreement"]
    assert ev["lower"] < 0.97 < ev["upper"] < 0.995
    assert snap["missing"] == v.reasons()


def test_a_promote_is_revoked_only_by_evidence_of_a_regression() -> None:
    v, _, moves = verdict()
    until(v, "promote")
    for _ in range(5):  # a few disagreements: no evidence of anything
        v.add(DISAGREE, 0.01, 0.01)
    assert v.state() == "promote"
    until(v, "abort", DISAGREE)  # the canary breaks for good: the upper bound falls
    assert [m[1] for m in moves] == ["hold", "promote", "abort"]


def test_a_slower_canary_aborts_on_the_sign_test_with_its_figures() -> None:
    v, _, _ = verdict()
    took = until(v, "abort", primary_s=0.100, canary_s=0.200)
    assert took == 20
    (why,) = v.reasons()
    assert why.startswith("latency: the canary took longer than max(1.1× production, "
                          "production + 1 ms) in 20 of 20 pairs")
    assert "sequential sign test, false-abort rate 0.0033" in why
    blind, _, _ = verdict(max_latency_ratio=None)
    until(blind, "promote", primary_s=0.100, canary_s=0.200)


def test_a_difference_below_the_minimum_effect_is_no_regression() -> None:
    # 0.5 ms slower on a 5 ms model: under min_effect_ms (1 ms), whatever the ratio says
    v, _, _ = verdict(max_latency_ratio=1.0)
    until(v, "promote", primary_s=0.005, canary_s=0.0055)
    strict, _, _ = verdict(max_latency_ratio=1.0, min_effect_ms=0.0)
    until(strict, "abort", primary_s=0.005, canary_s=0.0055)


def test_stalls_never_abort_and_the_tail_waits_for_a_sample_that_supports_it() -> None:
    v, _, _ = verdict()
    rng = np.random.default_rng(3)
    for i in range(400):
        stall = 0.012 if i % 97 == 0 else 0.0  # one canary call in 97 stalls 12 ms
        v.add(AGREE, 0.005 * rng.lognormal(0, 0.1), 0.005 * rng.lognormal(0, 0.1) + stall)
    assert v.state() == "hold"
    tail = v.snapshot()["evidence"]["latency"]["tail"]
    assert tail["judged"] is False and tail["supported_from"] > 400
    assert f"latency p99 not judged yet: a distribution-free bound needs " \
           f"{tail['supported_from']} pairs, 400 so far" in v.reasons()


def test_a_heavier_canary_tail_aborts_once_the_sample_supports_the_p99() -> None:
    v, _, _ = verdict()
    rng = np.random.default_rng(4)
    for i in range(3000):
        slow = 0.100 if i % 20 == 0 else 0.0  # 5 % of canary calls take 100 ms more
        v.add(AGREE, 0.010 * rng.lognormal(0, 0.05), 0.010 * rng.lognormal(0, 0.05) + slow)
        if v.state() == "abort":
            break
    assert v.state() == "abort"
    (why,) = v.reasons()
    assert why.startswith("latency tail: canary p99 latency ≥ ")
    assert "distribution-free anytime bounds" in why


def feed(v: Verdict, agreed: int, total: int, noise: bool = False) -> None:
    for i in range(total):
        c = AGREE if i % total < agreed else DISAGREE
        if noise:
            v.add_noise(c)
        else:
            v.add(c, 0.01, 0.01)


def test_noise_floor_carries_its_uncertainty_through_the_ratio() -> None:
    # A sampling model: two answers of the primary agree 90 % of the time, and so does the
    # canary with the primary: effective agreement 1.0 -- but the bounds know that both are
    # estimates, so neither promote (lower bound far under 99.5 %) nor abort.
    v = Verdict(VerdictConfig(), ManualClock(), expect_noise=True)
    for _ in range(10):
        feed(v, 9, 10, noise=True)
        feed(v, 9, 10)
    snap = v.snapshot()
    assert snap["agreement"] == pytest.approx(0.9)
    assert snap["self_agreement"] == pytest.approx(0.9)
    assert snap["effective_agreement"] == pytest.approx(1.0)
    ev = snap["evidence"]["agreement"]
    assert ev["lower"] < 0.9 and ev["upper"] == 1.0 and v.state() == "hold"
    assert "the primary agrees with itself 90.0% over 100" in v.reasons()[0]
    # the raw figure would abort a model as noisy as production itself
    raw = Verdict(VerdictConfig(noise_floor=False), ManualClock())
    for _ in range(100):
        feed(raw, 9, 10)
        if raw.state() == "abort":
            break
    assert raw.state() == "abort" and raw.snapshot()["samples"] < 1000
    # a canary far below its own noise floor aborts
    bad = Verdict(VerdictConfig(), ManualClock(), expect_noise=True)
    for _ in range(30):
        feed(bad, 9, 10, noise=True)
        feed(bad, 5, 10)
    assert bad.state() == "abort" and "the primary agrees with itself" in bad.reasons()[0]


def test_before_any_self_comparison_an_expected_noise_floor_blocks_the_agreement_abort() -> None:
    v = Verdict(VerdictConfig(), ManualClock(), expect_noise=True)
    feed(v, 50, 100)
    assert v.state() == "hold"  # the floor might be 50 %: no abort on agreement yet


def test_a_primary_that_rarely_agrees_with_itself_cannot_judge() -> None:
    v = Verdict(VerdictConfig(), ManualClock(), expect_noise=True)
    for _ in range(10):
        feed(v, 1, 10, noise=True)
        feed(v, 0, 10)
    assert v.state() == "hold"
    assert any("comparisons cannot judge the canary" in r for r in v.reasons())


def test_snapshot_is_json_and_bounded() -> None:
    v, clock, _ = verdict(window=30, min_samples=5)
    for i in range(1000):
        clock.advance(0.1)
        c = AGREE if i % 3 else Comparison(False, {"cosine": 0.1 * (i % 7)}, f"failure {i}")
        v.add(c, 0.010 + 0.001 * (i % 5), None if i % 10 == 0 else 0.012)
    for _ in range(100):
        v.add_noise(AGREE)
    snap = json.loads(json.dumps(v.snapshot(), allow_nan=False))
    assert {"state", "reasons", "missing", "samples", "agreed", "agreement", "noise_samples",
            "self_agreement", "effective_agreement", "evidence", "decided", "thresholds",
            "metrics", "latency_ms", "disagreements", "histograms"} == set(snap)
    assert snap["samples"] == 1000 and snap["noise_samples"] == 100  # the tests forget nothing
    assert snap["latency_ms"]["recent"] == 30  # the figures: the last window
    assert len(snap["disagreements"]) == 50
    assert snap["disagreements"][-1] == {"at": pytest.approx(clock.wall()),
                                         "reason": "failure 999"}
    assert set(snap["metrics"]["cosine"]) == {"p50", "p90", "p99", "min", "max"}
    assert set(snap["metrics"]) == {"cosine", "max_abs", "latency_diff_ms"}
    cosine = snap["histograms"]["metrics"]["cosine"]
    assert len(cosine["edges"]) == 21 and sum(cosine["counts"]) == 30
    latency = snap["histograms"]["latency_ms"]
    assert sum(latency["primary"]) == 30 and sum(latency["canary"]) == 27  # 3 without canary
    assert snap["latency_ms"]["canary"]["p50"] == pytest.approx(12.0)
    ev = snap["evidence"]
    assert ev["alpha"] == 0.01 and ev["beta"] == 0.05 and ev["abort_tests"] == 3
    assert "Robbins 1970" in ev["method"] and ev["latency"]["samples"] == 900


def test_empty_snapshot() -> None:
    v, _, _ = verdict()
    snap = json.loads(json.dumps(v.snapshot(), allow_nan=False))
    assert snap["state"] == "collecting" and snap["agreement"] is None
    assert snap["metrics"] == {} and snap["histograms"] == {"metrics": {}, "latency_ms": {}}


def test_a_floor_estimated_low_never_lowers_the_promote_bar_to_a_bad_canary() -> None:
    """The red team's case: a floor read low (37 %: faults on production's copies, or a noisy
    primary) put L(agreement) / U(self) over 100 % for a canary wrong on half its inputs. A
    promote needs the floor itself shown ≥ ``min_self_agreement``."""
    v = Verdict(VerdictConfig(), ManualClock(), expect_noise=True)
    feed(v, 7, 19, noise=True)  # the floor, 37 % over 19: its upper bound is far under 1
    for _ in range(10):
        feed(v, 10, 10)  # the canary agrees with the copies it saw
    assert v.state() == "hold"
    assert any("a promote needs it shown ≥ 50.0%" in m for m in v.snapshot()["missing"])
    # the same canary beside a steady floor promotes
    steady = Verdict(VerdictConfig(), ManualClock(), expect_noise=True)
    for _ in range(300):  # the 99.5 % bar takes ~1,200 agreeing pairs
        feed(steady, 10, 10, noise=True)
        feed(steady, 10, 10)
        if steady.state() == "promote":
            break
    assert steady.state() == "promote"
