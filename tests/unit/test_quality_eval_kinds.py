"""The evaluation's ladders on other kinds of clean input (bench/quality_eval.py,
``KIND_LADDERS``: the keystone ladder on documents and screenshots): each severity is measured
on every clean input of the kind in every framing, ``KIND_SEEDS`` copies each, and its AUC
reads the right way round (a copy that changes nothing ties its source: 0.5 on every signal; a
copy flattened to grey reads below every source on ``constant`` and ``sharpness``: 1.0, and
the sharpness rule catches every copy)."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from bench import quality_eval as qe
from filters.quality.signals import IMAGE_SIGNALS
from tests.support import photos


def _scored() -> dict[str, list[Any]]:
    """Two framings holding screenshots (rendered UIs) and one photograph that must be left
    out of the screenshots' ladder."""
    uis = [photos.Clean(n, "screenshot", x) for n, x in photos.screenshots(3)]
    cat = next(c for c in photos.clean_set() if c.name == "chelsea")
    return {"one": [(c, qe.score(c.image)) for c in (uis[0], cat)],
            "two": [(c, qe.score(c.image)) for c in uis[1:]]}


def _identity(x: NDArray[np.uint8], severity: float, rng: np.random.Generator
              ) -> NDArray[np.uint8]:
    return x.copy()


def _grey(x: NDArray[np.uint8], severity: float, rng: np.random.Generator
          ) -> NDArray[np.uint8]:
    return np.full_like(x, 128)


def _ladder(apply: Any) -> dict[str, Any]:
    d = photos.Degradation("probe", apply, (0.1, 0.2), 0.2, "sharpness", "unit")
    thresholds = qe.default_thresholds()
    return qe._kind_ladder(d, _scored(), "screenshot", thresholds,
                           {"ghosting": 0.5, "moire": 0.5})


def test_every_clean_input_of_the_kind_in_every_framing_with_its_seeded_copies() -> None:
    out = _ladder(_identity)
    assert out["n_clean"] == 3  # the three UIs of both framings, not the photograph
    assert list(out["severities"]) == ["0.1", "0.2"]
    for r in out["severities"].values():
        assert r["n"] == 3 * qe.KIND_SEEDS
        assert set(r["auc"]) == set(IMAGE_SIGNALS)
        # an unchanged copy scores as its source does: a tie on every signal
        assert all(a == 0.5 for a in r["auc"].values()), r["auc"]
        assert r["detected"] == 0.0  # no default rule flags these clean UIs


def test_a_flattened_copy_reads_below_every_source_and_is_caught() -> None:
    out = _ladder(_grey)
    for r in out["severities"].values():
        assert r["auc"]["constant"] == 1.0
        assert r["auc"]["sharpness"] == 1.0
        assert r["detected_by_signal"] == 1.0  # the meant signal's default rule alone
        assert r["detected"] == 1.0


def test_the_keystone_ladder_is_measured_on_documents_and_screenshots() -> None:
    assert qe.KIND_LADDERS["keystone"] == ("document", "screenshot")
    assert "keystone" in photos.BY_NAME


def test_every_intent_s_rules_and_the_opt_in_ones_apply_to_one_image_s_scores() -> None:
    # residue compares a request's images (bench/residue_eval.py): a single image has no
    # score for it, and a rule on it here once stopped the whole evaluation (KeyError)
    scores = qe.score(next(c.image for c in photos.clean_set() if c.name == "chelsea"))
    assert "residue" not in qe.opt_in_rules() and "moire" in qe.opt_in_rules()
    for intent in qe.INTENTS:
        assert qe.flagged(scores, qe.default_thresholds(intent)) == [], intent
    assert qe.flagged(scores, qe.opt_in_rules()) == []
