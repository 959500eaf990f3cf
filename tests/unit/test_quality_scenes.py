"""The edge scenes' signals (filters/quality/scenes.py) and the sharpest-region sharpness, on
synthetic inputs with known geometry and on real photographs (tests/support/photos.py): each
degradation moves its signal the expected way, its clean source does not, and the confusions
docs/quality.md promises not to make (a letterbox, a white page, a periodic texture, a sharp
subject on a soft background) are not made."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from PIL import Image, ImageFilter

from filters.quality.echo import echo
from filters.quality.scenes import OPTIONAL_SIGNALS, ghosting, perspective, tone
from filters.quality.signals import IMAGE_SIGNALS, ImageSpec, Signal, image_signals, luminance
from tests.support import photos
from tests.support.images import scene

HWC = ImageSpec("HWC", (0.0,), (255.0,))
RNG = np.random.default_rng


def plane(img: NDArray[Any]) -> NDArray[np.float32]:
    return luminance(img, HWC)


def photo(name: str = "astronaut") -> NDArray[np.uint8]:
    return next(c.image for c in photos.clean_set() if c.name == name)


def all_signals(img: NDArray[Any]) -> dict[str, Signal]:
    return image_signals(img, HWC, OPTIONAL_SIGNALS)


# --- perspective --------------------------------------------------------------------------------


@pytest.mark.parametrize("strength", [0.1, 0.2, 0.3])
def test_a_screen_photographed_at_an_angle_reads_as_one(strength: float) -> None:
    for source in (scene(), photo("astronaut"), photo("coffee")):
        clean = perspective(plane(source))
        warped = perspective(plane(photos.perspective(source, strength, RNG(3))))
        assert clean.score == 1.0, clean
        assert warped.score < 0.5, warped
        assert "straight of 4 sides" in warped.what


def test_a_letterboxed_frame_and_a_framed_screenshot_are_not_leaning() -> None:
    img = photo("chelsea").copy()
    img[:30] = 0
    img[-30:] = 0  # black bars, level: a video frame, not a screen at an angle
    found = perspective(plane(img))
    assert found.score == 1.0 and found.value == 0.0, found


def test_a_bezel_with_sensor_noise_is_still_a_bezel() -> None:
    warped = photos.perspective(photo("rocket"), 0.2, RNG(5)).astype(np.float64)
    warped += RNG(6).normal(0, 2.0, warped.shape)  # ~1 % noise: a phone sensor in a dim room
    noisy = np.clip(warped, 0, 255).round().astype(np.uint8)
    assert perspective(plane(noisy)).score < 0.5


def test_no_clean_photograph_reads_as_a_screen() -> None:
    clean = [c for c in (*photos.clean_set(), *photos.random_crops()) if c.kind == "photo"]
    flagged = [c.name for c in clean if perspective(plane(c.image)).score < 0.5]
    assert not flagged


# --- tone ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["astronaut", "coffee", "chelsea", "motorcycle_left"])
def test_a_dark_tone_curve_lowers_tone_and_a_stronger_one_more(name: str) -> None:
    source = photo(name)
    found = [tone(plane(photos.gamma(source, g, RNG(0)))) for g in (1.0, 1.5, 2.2, 3.0)]
    assert found[0].score == 1.0
    keys = [s.value for s in found]
    assert keys == sorted(keys, reverse=True) and keys[3] < 0.5 * keys[0], keys
    assert [s.score for s in found] == sorted((s.score for s in found), reverse=True)
    assert found[3].score < 0.5, found[3]


def test_over_exposure_lowers_tone_but_paper_and_flat_graphics_do_not() -> None:
    source = photo("chelsea")
    found = [tone(plane(photos.overexposure(source, g, RNG(0)))).score for g in (1, 1.5, 2, 3)]
    assert found == sorted(found, reverse=True) and found[0] == 1.0 and found[3] < 0.5, found
    for name in ("page/levelled", "text/levelled", "logo"):
        clean = next(c for c in photos.clean_set() if c.name == name)
        assert tone(plane(clean.image)).score == 1.0, (name, tone(plane(clean.image)))
    for name, ui in photos.screenshots(4):
        if "dark" not in name:  # white user interfaces: white is their paper
            assert tone(plane(ui)).score == 1.0, (name, tone(plane(ui)))


def test_tone_synthetic_directions() -> None:
    ramp = np.tile(np.linspace(0, 255, 224, dtype=np.float64), (224, 1))
    ramp3 = np.repeat(ramp[..., None], 3, axis=2)
    clean = tone(plane(ramp3.astype(np.uint8)))
    darker = [tone(plane((255 * (ramp3 / 255) ** g).astype(np.uint8))) for g in (2, 3, 5)]
    assert clean.score == 1.0
    assert clean.value > darker[0].value > darker[1].value > darker[2].value
    assert darker[2].score < 0.5 and "log-average luminance" in darker[2].what


# --- ghosting -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["astronaut", "coffee", "rocket"])
def test_a_shifted_copy_over_the_frame_reads_as_a_ghost_at_its_lag(name: str) -> None:
    source = photo(name)
    h, w = source.shape[:2]
    dy, dx = 6, -11
    shifted = source[np.clip(np.arange(h) - dy, 0, h - 1)][:, np.clip(np.arange(w) - dx, 0,
                                                                       w - 1)]
    ghosted = np.asarray(0.75 * source + 0.25 * shifted, np.float64).round().astype(np.uint8)
    clean, found = ghosting(plane(source)), ghosting(plane(ghosted))
    # values are the echo's height over the cepstrum's spread (filters/quality/echo.py)
    assert found.score < clean.score and found.value > clean.value + 10
    assert found.score < 0.5
    assert "at -11, +6 px" in found.what or "at +11, -6 px" in found.what, found.what


def test_a_faint_ghost_on_real_photographs_reads_lower_than_its_source() -> None:
    # Real: the seeds' 10 % trace of the frame, 9 px down and 5 px across, over three photos.
    for name in ("astronaut", "coffee", "chelsea"):
        source = photo(name)
        h, w = source.shape[:2]
        shifted = source[np.clip(np.arange(h) - 9, 0, h - 1)][:, np.clip(np.arange(w) - 5, 0,
                                                                           w - 1)]
        ghosted = np.asarray(0.9 * source + 0.1 * shifted, np.float64).round().astype(np.uint8)
        clean, found = ghosting(plane(source)), ghosting(plane(ghosted))
        assert found.value > clean.value + 3 and found.score < clean.score, name


def test_a_periodic_texture_and_a_page_of_text_are_not_ghosts() -> None:
    for name in ("brick", "text/levelled", "page/levelled"):
        found = next(c for c in photos.clean_set() if c.name == name)
        assert ghosting(plane(found.image)).score >= 0.5, name


def test_text_lines_of_a_rendered_screen_are_not_ghosts() -> None:
    # Lines 9 px apart peak at 9 px; their harmonic at 18 px weighs three times against it
    # (at once: 6 of 8 read as ghosts), and where an echo still stands out, its signs agree
    # again at twice its lag: a repeating pattern (6 of these 48 read as ghosts without it)
    uis = [ui for seed in (0, 1, 2) for _, ui in photos.screenshots(16, seed)]
    scored = [ghosting(plane(ui)) for ui in uis]
    assert [s for s in scored if s.score < 0.5] == []
    repeating = [s for s in scored if "a repeating pattern, not a copy" in s.what]
    assert len([s for s in repeating if s.value > 6.5]) >= 6, repeating
    assert all(s.score == 1.0 for s in repeating), repeating


@pytest.mark.parametrize("opacity", [0.10, 0.15])
def test_a_ghost_s_echo_does_not_recur_at_twice_its_lag(opacity: float) -> None:
    # a copy's agreement at twice its lag is the picture's own (under 0.24 of its agreement
    # at the lag in the evaluation set): none of these ghosts is taken for a pattern
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        found = echo(plane(photos.ghost(photo(name), opacity, np.random.default_rng(3))))
        assert found is not None and found.z > 1.0, name  # standing out: its recurrence read
        assert found.recurs < 0.3, (name, found)


def test_ghosting_is_measured_only_when_asked() -> None:
    assert "ghosting" not in image_signals(photo(), HWC)
    assert image_signals(photo(), HWC, ("ghosting",))["ghosting"].score > 0.9
    assert set(all_signals(photo())) == set(IMAGE_SIGNALS)


# --- sharpness: the sharpest region -------------------------------------------------------------


def test_a_sharp_subject_on_a_soft_background_is_sharp() -> None:
    source = photo("coffee")
    soft = np.asarray(Image.fromarray(source).filter(ImageFilter.GaussianBlur(3)))
    subject = soft.copy()
    subject[80:150, 80:150] = source[80:150, 80:150]  # a sharp subject, a blurred background
    assert all_signals(soft)["sharpness"].score < 0.5
    found = all_signals(subject)["sharpness"]
    assert found.score >= 0.55 and "sharpest region" in found.what, found  # the default rule


def test_the_sharpest_region_does_not_rescue_a_blurred_photo() -> None:
    for name in ("astronaut", "coffee", "chelsea", "grass"):
        d = photos.BY_NAME["defocus"]
        blurred = d.apply(photo(name), 3.0, RNG(0))
        assert all_signals(blurred)["sharpness"].score < 0.5, name


# --- every new signal: bounded, finite ----------------------------------------------------------


@pytest.mark.parametrize("img", [np.zeros((224, 224, 3), np.uint8),
                                 np.full((224, 224, 3), 255, np.uint8),
                                 np.zeros((20, 20, 3), np.uint8),
                                 RNG(0).integers(0, 256, (224, 300, 3), dtype=np.uint8)],
                         ids=["black", "white", "tiny", "noise"])
def test_scene_signals_are_finite_and_bounded(img: NDArray[np.uint8]) -> None:
    for fn in (perspective, tone, ghosting):
        s = fn(plane(img))
        assert 0.0 <= s.score <= 1.0 and np.isfinite(s.value), (fn.__name__, s)


def test_the_cepstrums_near_rows_are_irfft2s_rows_bit_for_bit() -> None:
    """``echo`` reads 61 rows of the cepstrum, inverted column-wise then along those rows only:
    exactly the rows of the whole inverse (numpy's irfft2 is the same two passes)."""
    from filters.quality import echo

    rng = np.random.default_rng(4)
    planes = [luminance(c.image, ImageSpec("HWC", (0.0,), (255.0,))) for c in
              photos.clean_set()[::20]]
    planes += [rng.random((h, w), np.float32) for h, w in ((32, 32), (40, 300), (256, 256),
                                                           (300, 257))]
    for plane in planes:
        whole = echo.cepstrum(plane)
        near = echo.cepstrum(plane, echo._NEAR_ROWS)
        assert whole is not None and near is not None
        assert near.shape == (61, 256)
        assert np.array_equal(near.view(np.int64), whole[echo._NEAR_ROWS].view(np.int64))
