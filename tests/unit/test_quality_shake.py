"""The camera-shake signal (``scenes.shake``): the sharpness ratio of the edge tiles cleaned of
the sensor noise's share, lowest of four directions. On a real shaken photograph (scikit-image's
clock, which ``sharpness`` reads as sharp), on real photographs shaken at each angle with noise
added after the blur as a camera does, and on a synthetic scene; the clean sources and the
clean crops are not flagged, and noise alone neither hides a shake nor makes one."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from filters.quality.filter import QualityConfig
from filters.quality.scenes import shake
from filters.quality.signals import ImageSpec, Signal, image_signals, luminance, noise
from tests.support import photos
from tests.support.images import scene

HWC = ImageSpec("HWC", (0.0,), (255.0,))
RNG = np.random.default_rng


def measured(img: NDArray[Any]) -> Signal:
    plane = luminance(img, HWC)
    return shake(plane, noise(plane).value)


def photo(name: str) -> NDArray[np.uint8]:
    return next(c.image for c in photos.clean_set() if c.name == name)


def default_below() -> float:
    return next(r.below for r in QualityConfig().rules if r.signal == "shake")


def test_the_real_camera_shake_is_flagged_in_every_view() -> None:
    """The clock was photographed while the camera moved: whole and in four corner crops."""
    below = default_below()
    found = {name: measured(x) for name, x in photos.camera_shake()}
    assert all(s.score < below for s in found.values()), found
    # and image_signals reports the same signal under its name, with the rule's reading
    whole = image_signals(photos.camera_shake()[0][1], HWC)["shake"]
    assert whole == found["clock/0"]
    assert "edge tiles" in whole.what


@pytest.mark.parametrize("name", ["astronaut", "coffee", "chelsea", "rocket", "coins"])
def test_a_shake_at_every_angle_reads_below_its_clean_source(name: str) -> None:
    source = photo(name)
    clean = measured(source)
    assert clean.score == 1.0, clean
    for degrees in (0.0, 22.5, 45.0, 90.0):
        shaken = measured(photos.motion_angle(source, degrees, RNG(1)))
        assert shaken.value < 0.75 * clean.value, (degrees, shaken, clean)


def test_most_shaken_photographs_are_flagged_at_the_default() -> None:
    """9 px with noise after the blur, at 0 / 45 / 90 degrees, over the eleven photographs:
    the default flags most of them (the evaluation measures the rate; 0.7 is far below it)."""
    below = default_below()
    shaken = [measured(photos.motion_angle(photo(n), a, RNG(2))).score < below
              for n in photos.PHOTOS for a in (0.0, 45.0, 90.0)]
    assert np.mean(shaken) >= 0.7, np.mean(shaken)


def test_noise_after_the_blur_does_not_hide_the_shake_from_it() -> None:
    """What it is for: noise added after a 9 px shake raises ``sharpness`` (noise is sharp)
    while this signal, which subtracts the noise's energy, still reads the shake."""
    source = photo("chelsea")
    shaken = photos.motion(source, 9, RNG(2))
    noisy = photos.gaussian(shaken, 0.01, RNG(3))
    sharp = [image_signals(x, HWC)["sharpness"].value for x in (shaken, noisy)]
    assert sharp[1] > sharp[0], sharp
    assert measured(noisy).score < default_below()


def test_noise_alone_does_not_read_as_a_shake() -> None:
    for name in ("astronaut", "coffee", "motorcycle_left"):
        noisy = photos.gaussian(photo(name), 0.01, RNG(4))
        assert measured(noisy).score == 1.0, name


def test_a_synthetic_scene_shaken_along_each_axis() -> None:
    clean = scene()
    assert measured(clean).score == 1.0
    for degrees in (0.0, 90.0):
        assert measured(photos.motion_angle(clean, degrees, RNG(5))).score < default_below()


def test_no_clean_photograph_nor_random_crop_is_flagged() -> None:
    below = default_below()
    clean = [c for c in (*photos.clean_set(), *photos.random_crops(), *photos.whole_frames())
             if c.kind == "photo"]
    flagged = [c.name for c in clean if measured(c.image).score < below]
    assert not flagged
    assert len(clean) == 99 + 168 + 14


def test_a_sharp_subject_on_a_soft_background_is_not_a_shake() -> None:
    """Bokeh: the whole frame shaken, a sharp 100 × 100 subject pasted back."""
    source = photo("astronaut")
    img = photos.motion_angle(source, 0.0, RNG(6))
    img[60:160, 60:160] = source[60:160, 60:160]
    assert measured(img).score == 1.0


def test_a_flat_or_noise_only_picture_has_nothing_to_judge() -> None:
    flat = np.full((224, 224, 3), 128, np.uint8)
    for img in (flat, photos.gaussian(flat, 0.02, RNG(7))):
        found = measured(img)
        assert found.score == 1.0 and "no edge tiles" in found.what, found
    tiny = measured(np.full((20, 20, 3), 9, np.uint8))
    assert tiny.score == 1.0 and "too small" in tiny.what
