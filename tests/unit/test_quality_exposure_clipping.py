"""Over-exposure by clipped colour channels (filters/quality/signals.py, ``channel_clipped``
feeding ``exposure``): a gain clips the brightest channel before the luminance reaches white,
so an over-exposed photograph reads lower than by its luminance alone; a saturated colour, a
white page and the clean photographs do not."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.typing import NDArray

from filters.quality.measure import levels
from filters.quality.signals import ImageSpec, channel_clipped, exposure, image_signals, luminance
from tests.support import photos

HWC = ImageSpec("HWC", (0.0,), (255.0,))
MEAN, STD = (0.481, 0.458, 0.408), (0.269, 0.261, 0.276)  # CLIP's normalisation
CLIP_CHW = ImageSpec("CHW", tuple(-m / s for m, s in zip(MEAN, STD, strict=True)),
                     tuple((1 - m) / s for m, s in zip(MEAN, STD, strict=True)))


def clean(name: str) -> NDArray[np.uint8]:
    return next(c.image for c in (*photos.clean_set(), *photos.whole_frames())
                if c.name == name)


@pytest.mark.parametrize("name", ["coffee", "chelsea", "astronaut", "motorcycle_left"])
def test_an_over_exposed_photo_reads_lower_than_by_luminance_alone(name: str) -> None:
    source = clean(name)
    assert image_signals(source, HWC)["exposure"].score == 1.0
    for gain in (1.5, 2.0):
        shot = photos.overexposure(source, gain, np.random.default_rng(0))
        by_luminance = exposure(luminance(shot, HWC))
        found = image_signals(shot, HWC)["exposure"]
        assert found.score <= by_luminance.score, (gain, found, by_luminance)
        assert found.score < 0.6, (gain, found)  # the default rule's threshold


def test_a_red_ramp_under_a_gain_clips_red_before_white() -> None:
    ramp = np.linspace(0.2, 0.9, 224)[None, :].repeat(224, axis=0)
    rgb = np.stack([ramp, ramp * 0.8, ramp * 0.7], axis=-1)
    shot = np.asarray(np.clip(rgb * 1.6, 0, 1) * 255 + 0.5, np.uint8)
    plane = luminance(shot, HWC)
    blown = levels(plane).blown  # the luminance reaches white on the brightest 18 %
    assert channel_clipped(shot, HWC) > 2 * blown  # red reaches its top on 40 %


def test_saturated_colours_and_white_pages_are_not_over_exposed() -> None:
    # The colour wheel's pure hues have a channel at its top and one at zero: not light
    # (0.17 of it would count without the channels' mean of 0.75; 0.08 does).
    assert channel_clipped(clean("colorwheel"), HWC) < 0.1
    for name in ("page", "text", "page/levelled", "text/levelled", "colorwheel", "logo"):
        assert image_signals(clean(name), HWC)["exposure"].score >= 0.6, name


def test_normalised_chw_reads_as_uint8_hwc() -> None:
    shot = photos.overexposure(clean("coffee"), 1.5, np.random.default_rng(0))
    chw = (shot.transpose(2, 0, 1) / 255.0 - np.asarray(MEAN)[:, None, None]) \
        / np.asarray(STD)[:, None, None]
    a = channel_clipped(np.ascontiguousarray(chw, np.float32), CLIP_CHW)
    assert a == pytest.approx(channel_clipped(shot, HWC), abs=0.01)
    grey = np.repeat(shot[..., :1], 1, axis=-1)[..., 0]
    assert channel_clipped(grey, ImageSpec("HW", (0.0,), (255.0,))) == 0.0  # no colour


def test_a_white_product_shot_is_not_read_as_over_exposed() -> None:
    """High-key by nature: a correctly exposed photograph on a blown white backdrop (the
    synthetic ``photos.high_key`` set). Its white is clipped, but beside the subject's
    mid-tones and ink, which exposure's weighting forgives: none of the 14 reaches the default
    rule, while the whole shot over-exposed 2× does for half of them or more."""
    below = 0.6  # the default rule's threshold
    shots = [c for c in photos.high_key() if c.name.endswith("/product")]
    assert len(shots) == 14
    found = {c.name: image_signals(c.image, HWC)["exposure"] for c in shots}
    assert all(s.score >= below for s in found.values()), found
    gained = [image_signals(photos.overexposure(c.image, 2.0, np.random.default_rng(0)), HWC)
              ["exposure"].score < below for c in shots]
    assert sum(gained) >= 7, gained
