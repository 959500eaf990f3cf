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
    with pytest.raises(ValidationError, match="min_samples 30 can never be reached"):
        VerdictConfig(window=10, min_samples=30)


# --- verdict -------------------------------------------------------------------------------

Moves = list[tuple[str, str, list[str]]]


def verdict(**kw: Any) -> tuple[Verdict, ManualClock, Moves]:
    clock = ManualClock()
    moves: Moves = []
    v = Verdict(VerdictConfig(**kw), clock)
    v.on_change(lambda old, new, why: moves.append((old, new, why)))
    return v, clock, moves


def test_collecting_then_promote_with_identical_answers() -> None:
    v, _, moves = verdict(min_samples=20)
    for _ in range(19):
        v.add(AGREE, 0.010, 0.011)
    assert v.state() == "collecting" and v.reasons() == ["19 of 20 samples collected"]
    v.add(AGREE, 0.010, 0.011)
    assert v.state() == "promote" and v.reasons() == []
    assert [m[:2] for m in moves] == [("collecting", "promote")]


def test_hold_between_the_thresholds_then_abort_below_abort_agreement() -> None:
    v, _, moves = verdict(window=20, min_samples=20)
    for _ in range(20):
        v.add(AGREE, 0.01, 0.01)
    v.add(DISAGREE, 0.01, 0.01)  # 19 of 20 = 95 %: not under 95 %, under 99.5 %
    assert v.state() == "hold"
    assert v.reasons() == [
        "effective agreement 95.0% < promote threshold 99.5% (the canary agreed in 19 of 20)",
        "latest disagreement: output 'logits': cosine 0.500 < 0.990"]
    v.add(DISAGREE, 0.01, 0.01)  # 18 of 20 = 90 %
    assert v.state() == "abort"
    assert v.reasons()[0] == ("effective agreement 90.0% < abort threshold 95.0% "
                              "(the canary agreed in 18 of 20)")
    assert [m[:2] for m in moves] == [("collecting", "promote"), ("promote", "hold"),
                                      ("hold", "abort")]
    assert moves[-1][2] == v.reasons()


def test_abort_latches_until_reset_and_on_change_fires_once_per_change() -> None:
    v, _, moves = verdict(window=20, min_samples=20)
    for _ in range(20):
        v.add(DISAGREE, 0.01, 0.01)
    for _ in range(40):  # the window is all agreement again, but an abort is not taken back
        v.add(AGREE, 0.01, 0.01)
        assert v.state() == "abort"
    assert [m[:2] for m in moves] == [("collecting", "abort")]
    v.reset()
    assert v.state() == "collecting" and v.snapshot()["samples"] == 0
    assert [m[:2] for m in moves] == [("collecting", "abort"), ("abort", "collecting")]


def test_slow_canary_aborts_on_the_p99_latency_ratio() -> None:
    v, _, _ = verdict(min_samples=20, max_latency_ratio=1.5)
    for _ in range(20):
        v.add(AGREE, 0.100, 0.200)
    assert v.state() == "abort"
    assert v.reasons() == ["canary p99 latency 200.0 ms is 2.00× the primary's 100.0 ms "
                           "(limit 1.50×)"]
    quick, _, _ = verdict(min_samples=20, max_latency_ratio=None)
    for _ in range(20):
        quick.add(AGREE, 0.100, 0.200)
    assert quick.state() == "promote"


def feed(v: Verdict, agreed: int, total: int, noise: bool = False) -> None:
    for i in range(total):
        c = AGREE if i < agreed else DISAGREE
        if noise:
            v.add_noise(c)
        else:
            v.add(c, 0.01, 0.01)


def test_noise_floor_judges_the_canary_against_the_primarys_self_agreement() -> None:
    # A sampling model: two answers of the primary to one request agree 90 % of the time.
    # A canary that agrees with the primary 90 % of the time is as good as the primary itself:
    # effective = min(1, 0.90 / 0.90) = 1.0 ≥ 99.5 % → promote, where the raw 90 % would abort.
    v, _, _ = verdict(window=100, min_samples=20)
    feed(v, 18, 20, noise=True)  # self-agreement 18/20 = 0.90
    feed(v, 90, 100)  # agreement 90/100 = 0.90
    snap = v.snapshot()
    assert snap["agreement"] == pytest.approx(0.90)
    assert snap["self_agreement"] == pytest.approx(0.90)
    assert snap["effective_agreement"] == pytest.approx(1.0)
    assert v.state() == "promote"

    raw, _, _ = verdict(window=100, min_samples=20, noise_floor=False)
    feed(raw, 18, 20, noise=True)
    feed(raw, 90, 100)
    assert raw.state() == "abort" and raw.snapshot()["effective_agreement"] == pytest.approx(0.9)

    # 88 %: 0.88 / 0.90 = 0.978 → hold; 85 %: 0.85 / 0.90 = 0.944 < 0.95 → abort
    hold, _, _ = verdict(window=100, min_samples=20)
    feed(hold, 18, 20, noise=True)
    feed(hold, 88, 100)
    assert hold.state() == "hold"
    assert hold.snapshot()["effective_agreement"] == pytest.approx(0.88 / 0.90)
    assert "the primary agrees with itself 90.0% over 20" in hold.reasons()[0]
    bad, _, _ = verdict(window=100, min_samples=20)
    feed(bad, 18, 20, noise=True)
    feed(bad, 85, 100)
    assert bad.state() == "abort"


def test_noise_floor_waits_for_enough_self_comparisons() -> None:
    v, _, _ = verdict(window=100, min_samples=20)
    feed(v, 9, 10, noise=True)  # 10 < min_samples: not used yet
    feed(v, 90, 100)
    assert v.snapshot()["self_agreement"] is None and v.state() == "abort"
    assert "noise floor unknown yet (10 of 20 self-comparisons)" in v.reasons()[0]


def test_a_primary_that_rarely_agrees_with_itself_cannot_promote() -> None:
    v, _, _ = verdict(window=100, min_samples=20)
    feed(v, 6, 20, noise=True)  # 30 % self-agreement
    feed(v, 30, 100)
    assert v.state() == "hold"
    assert v.reasons()[0] == ("the primary agrees with itself only 30.0% (< 50.0%): "
                              "comparisons cannot judge the canary")


def test_window_s_drops_old_samples() -> None:
    w, clock, moves = verdict(window=100, min_samples=3, window_s=10)
    for _ in range(3):
        w.add(AGREE, 0.01, 0.01)
    assert w.state() == "promote"
    clock.advance(5)
    w.add(AGREE, 0.01, 0.01)
    clock.advance(6)  # the first three are 11 s old now
    assert w.snapshot()["samples"] == 1 and w.state() == "collecting"
    clock.advance(20)
    assert w.snapshot()["samples"] == 0
    assert [m[:2] for m in moves] == [("collecting", "promote"), ("promote", "collecting")]


def test_window_s_forgets_old_disagreements() -> None:
    v, clock, _ = verdict(window=100, min_samples=3, window_s=10, promote_agreement=0.5,
                          abort_agreement=0.0)
    v.add(DISAGREE, 0.01, 0.01)
    v.add(DISAGREE, 0.01, 0.01)
    v.add(AGREE, 0.01, 0.01)
    assert v.state() == "hold"  # 1 of 3
    clock.advance(11)
    for _ in range(3):
        v.add(AGREE, 0.01, 0.01)
    assert v.state() == "promote" and v.snapshot()["agreement"] == 1.0


def test_snapshot_is_json_and_bounded() -> None:
    v, clock, _ = verdict(window=30, min_samples=5)
    for i in range(1000):
        clock.advance(0.1)
        c = AGREE if i % 3 else Comparison(False, {"cosine": 0.1 * (i % 7)}, f"failure {i}")
        v.add(c, 0.010 + 0.001 * (i % 5), None if i % 10 == 0 else 0.012)
    for _ in range(100):
        v.add_noise(AGREE)
    snap = json.loads(json.dumps(v.snapshot(), allow_nan=False))
    assert set(snap) == {"state", "reasons", "samples", "agreed", "agreement", "noise_samples",
                         "self_agreement", "effective_agreement", "thresholds", "metrics",
                         "latency_ms", "disagreements", "histograms"}
    assert snap["samples"] == 30 and snap["noise_samples"] == 30
    assert len(snap["disagreements"]) == 50
    assert snap["disagreements"][-1] == {"at": pytest.approx(clock.wall()),
                                         "reason": "failure 999"}
    assert set(snap["metrics"]["cosine"]) == {"p50", "p90", "p99", "min", "max"}
    assert set(snap["metrics"]) == {"cosine", "max_abs", "latency_diff_ms"}
    cosine = snap["histograms"]["metrics"]["cosine"]
    assert len(cosine["edges"]) == 21 and len(cosine["counts"]) == 20
    assert sum(cosine["counts"]) == 30
    latency = snap["histograms"]["latency_ms"]
    assert len(latency["edges"]) == 21
    assert sum(latency["primary"]) == 30 and sum(latency["canary"]) == 27  # 3 without canary
    assert set(snap["latency_ms"]["primary"]) == {"p50", "p99"}
    assert snap["latency_ms"]["canary"]["p50"] == pytest.approx(12.0)


def test_empty_snapshot() -> None:
    v, _, _ = verdict()
    snap = json.loads(json.dumps(v.snapshot(), allow_nan=False))
    assert snap["state"] == "collecting" and snap["agreement"] is None
    assert snap["metrics"] == {} and snap["histograms"] == {"metrics": {}, "latency_ms": {}}


def test_a_primary_blind_to_itself_never_aborts_on_agreement() -> None:
    v, _, _ = verdict(window=100, min_samples=20)
    feed(v, 2, 20, noise=True)  # 10 % self-agreement
    feed(v, 0, 100)  # the canary never agrees: no different from production itself
    assert v.state() == "hold"
    assert "comparisons cannot judge the canary" in v.reasons()[0]
