"""The washout signal (filters/quality/washout.py): a bright tone curve value^γ on a
real photograph reads washed out and its clean source does not; the synthetic high-key scenes
(a white product shot, a snow field: tests/support/photos.py ``high_key``) are not read as a
curve; an over-exposed gain is measured by exposure and tone exactly as without the signal."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from filters.quality.scenes import OPTIONAL_SIGNALS
from filters.quality.signals import ImageSpec, image_signals, luminance
from filters.quality.washout import washout
from tests.support import photos

HWC = ImageSpec("HWC", (0.0,), (255.0,))
RNG = np.random.default_rng


def plane(img: NDArray[Any]) -> NDArray[np.float32]:
    return luminance(img, HWC)


def whole(name: str) -> NDArray[np.uint8]:
    return next(c.image for c in photos.whole_frames() if c.name == name)


@pytest.mark.parametrize("name", ["chelsea", "grass", "gravel", "brick"])
def test_a_bright_curve_on_a_photo_reads_washed_out_and_its_source_does_not(name: str) -> None:
    source = whole(name)
    clean = washout(plane(source))
    assert clean.score >= 0.5, clean
    found = [washout(plane(photos.gamma(source, g, RNG(0)))) for g in (0.7, 0.5, 0.33)]
    # a stronger curve lifts the key below white further
    assert clean.value < found[0].value < found[1].value < found[2].value, (clean, found)
    assert found[1].score < 0.5, found[1]  # γ 0.5, the ladder's named severity


def test_a_photo_with_true_black_is_lifted_less() -> None:
    # astronaut: black space stays black under value^γ (0^γ = 0), so its key below white
    # rises little (the documented miss, docs/quality.md Round 8)
    source = whole("astronaut")
    lifted = washout(plane(photos.gamma(source, 0.5, RNG(0))))
    assert lifted.score >= 0.5 and lifted.value > washout(plane(source)).value, lifted


def test_high_key_product_shots_and_snow_fields_are_not_read_as_a_curve() -> None:
    found = {c.name: washout(plane(c.image)) for c in photos.high_key()}
    assert len(found) == 28
    low = {n: round(s.score, 3) for n, s in found.items() if s.score < 0.5}
    assert not low, low
    # a snow field has no dark tones: not read at all; a product shot is read by its subject
    snow = [s for n, s in found.items() if n.endswith("/snow")]
    assert all(s.score == 1.0 and "no dark tones" in s.what for s in snow)
    product = [s for n, s in found.items() if n.endswith("/product")]
    assert all("no dark tones" not in s.what for s in product)


def test_an_over_exposed_gain_is_measured_by_exposure_and_tone_as_before() -> None:
    source = whole("chelsea")
    for gain in (1.5, 2.0, 3.0):
        img = photos.overexposure(source, gain, RNG(0))
        without = image_signals(img, HWC)
        with_it = image_signals(img, HWC, ("washout",))
        assert "washout" not in without and "washout" in with_it
        assert {k: v for k, v in with_it.items() if k != "washout"} == without
    # and at 2x the exposure signal still reads it as over-exposed
    assert image_signals(photos.overexposure(source, 2.0, RNG(0)), HWC)["exposure"].score < 0.5


def test_washout_is_opt_in_and_the_edge_cases_pass() -> None:
    assert "washout" in OPTIONAL_SIGNALS
    assert washout(np.ones((224, 224), np.float32)).score == 1.0  # nothing below white
    assert washout(np.zeros((224, 224), np.float32)).score == 1.0  # black: key 0.01
    assert washout(np.full((224, 224), 0.75, np.float32)).score == 1.0  # no dark tones
    flat = washout(np.full((224, 224), 0.65, np.float32))  # a flat light grey, darks present
    assert flat.score == pytest.approx((0.8 - 0.66) / 0.4, abs=0.01), flat
    assert washout(np.zeros((0, 0), np.float32)).score == 1.0


def test_no_photograph_scores_higher_under_a_bright_curve_than_clean() -> None:
    """The module's rule: on the evaluation set's photographs, value^0.5 never raises the
    score (a curve never makes a photograph read less washed out)."""
    found = [(c.name, washout(plane(c.image)).score,
              washout(plane(photos.gamma(c.image, 0.5, RNG(0)))).score)
             for c in photos.clean_set() if c.kind == "photo"]
    assert len(found) == 99
    assert [f for f in found if f[2] > f[1]] == []
