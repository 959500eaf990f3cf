"""The moiré signal (filters/quality/scenes.py, ``moire``): a screen's pixel grid beating with
the camera's reads as two perpendicular narrow spectral peaks; on synthetic gratings of known
period and on real photographs photographed off a simulated screen (tests/support/photos.py,
``moire``), and the clean inputs that must not read as moiré (a brick wall, a page of text, a
rendered screenshot)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from filters.quality import moire as moire_module
from filters.quality.scenes import moire
from filters.quality.signals import ImageSpec, image_signals, luminance
from tests.support import photos

HWC = ImageSpec("HWC", (0.0,), (255.0,))


def plane(img: NDArray[Any]) -> NDArray[np.float32]:
    return luminance(img, HWC)


def clean(name: str) -> NDArray[np.uint8]:
    return next(c.image for c in (*photos.clean_set(), *photos.whole_frames())
                if c.name == name)


def grating(period: float, angle: float, turns: tuple[float, ...]) -> NDArray[np.float32]:
    """Cosines of ``period`` px at ``angle`` and at each of ``turns`` more radians."""
    yy, xx = np.mgrid[0:224, 0:224].astype(np.float64)
    out = np.zeros((224, 224))
    for t in (0.0, *turns):
        a = angle + t
        out += np.cos(2 * np.pi * (xx * np.cos(a) + yy * np.sin(a)) / period)
    return np.asarray(out, np.float32)


def test_a_crosshatch_over_noise_reads_as_moire_at_its_period() -> None:
    noise = np.random.default_rng(0).random((224, 224)).astype(np.float32)
    base = moire(noise)
    found = moire(noise + 0.05 * grating(9.0, 0.3, (np.pi / 2,)))
    assert base.score == 1.0 and base.value < 4.0, base
    assert found.score == 0.0 and found.value > 10 * base.value, found
    assert "period 9." in found.what or "period 8." in found.what, found.what


def test_stripes_in_one_direction_or_two_unequal_ones_are_not_moire() -> None:
    # The twin test: text lines and a brick's rows and joints are periodic, but a pixel
    # grid's two directions have one pitch.
    noise = np.random.default_rng(1).random((224, 224)).astype(np.float32)
    stripes = moire(noise + 0.05 * grating(9.0, 0.3, ()))
    unequal = moire(noise + 0.025 * grating(9.0, 0.3, ())
                    + 0.025 * grating(14.0, 0.3 + np.pi / 2, ()))
    assert stripes.score == 1.0, stripes
    assert unequal.score == 1.0, unequal


def whole_frame_only(p: NDArray[np.float32], monkeypatch: pytest.MonkeyPatch) -> float:
    """moire's value without its regions: the whole frame's twin peak alone."""
    with monkeypatch.context() as m:
        m.setattr(moire_module, "_regional", lambda *_: (0.0, 0.0))
        return moire(p).value


def crosshatch(turn_degrees: float, second_period: float) -> NDArray[np.float32]:
    """Noise and two gratings of 0.05 each, 9 px and ``second_period`` px, their directions
    ``turn_degrees`` apart: a grid seen square on (90°, 9 px) or sheared and scaled."""
    noise = np.random.default_rng(0).random((224, 224)).astype(np.float32)
    return noise + np.float32(0.05) * (grating(9.0, 0.3, ()) + grating(
        second_period, 0.3 + np.radians(turn_degrees), ()))


def test_a_grid_sheared_and_scaled_as_a_perspective_leaves_it_reads_in_regions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 80° apart and 9 / 10 px: no exact twin in the whole frame (2.7, as the noise alone
    # reads), the regions' relaxed twin (within 15° of a right angle, 1.3× of one pitch) finds it
    sheared = crosshatch(80.0, 10.0)
    found = moire(sheared)
    assert whole_frame_only(sheared, monkeypatch) < 4.0
    assert found.score == 0.0 and "in 2 of 4 regions" in found.what, found
    assert "period 9." in found.what, found.what


@pytest.mark.parametrize(("turn", "period"), [(60.0, 9.0), (90.0, 14.0), (0.0, 9.0)])
def test_directions_or_pitches_a_perspective_cannot_leave_are_no_twin(turn: float,
                                                                     period: float) -> None:
    # 60° apart, or pitches 1.56× apart (a brick's rows and joints), or one direction
    assert moire(crosshatch(turn, period)).score == 1.0


@pytest.mark.parametrize(("name", "seed"), [("coffee", 2), ("rocket", 2), ("camera", 2)])
def test_a_screen_photographed_at_an_angle_is_read_by_its_regions(
        name: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the picture shown on a screen (grid contrast 0.4) photographed at an angle (corner
    # shift 0.2): the chirped beat spreads the whole frame's peak, a region's stays narrow
    rng = np.random.default_rng(seed)
    source = clean(name)
    shot = plane(photos.keystone(photos.moire(source, 0.4, rng), 0.2, rng))
    found = moire(shot)
    assert moire(plane(source)).score == 1.0
    assert whole_frame_only(shot, monkeypatch) < 8.0 < found.value, found
    assert found.score < 0.5 and "in 2 of 4 regions" in found.what, found


def test_a_plane_too_small_for_its_corners_regions_reads_the_whole_frame_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    small = crosshatch(90.0, 9.0)[:159, :159]
    assert moire_module._regional(small, 0, 0, 159) == (0.0, 0.0)
    assert moire(small).value == whole_frame_only(small, monkeypatch)


@pytest.mark.parametrize("name", ["astronaut", "coffee", "chelsea", "motorcycle_left"])
def test_a_photo_of_a_screen_reads_lower_than_its_source(name: str) -> None:
    source = clean(name)
    before = moire(plane(source))
    values = [moire(plane(photos.moire(source, c, np.random.default_rng(4)))).value
              for c in (0.2, 0.4, 0.7)]
    assert before.score == 1.0, before
    assert values == sorted(values) and values[0] > before.value, values
    assert moire(plane(photos.moire(source, 0.7, np.random.default_rng(4)))).score < 0.5


@pytest.mark.parametrize("name", ["brick", "page", "text", "page/levelled", "gravel",
                                  "grass"])
def test_periodic_textures_and_pages_are_not_moire(name: str) -> None:
    assert moire(plane(clean(name))).score >= 0.5, name


def test_rendered_screenshots_are_not_moire() -> None:
    found = [n for n, ui in photos.screenshots(8) if moire(plane(ui)).score < 0.5]
    assert found == [], found


def test_a_checkerboard_is_a_grid_and_reads_as_one() -> None:
    # The documented confusion (docs/quality.md, moiré): a picture of a grid is a grid.
    assert moire(plane(clean("checkerboard"))).score == 0.0


def test_moire_is_measured_only_when_asked_and_small_or_flat_images_pass() -> None:
    img = clean("astronaut")
    assert "moire" not in image_signals(img, HWC)
    assert image_signals(img, HWC, ("moire",))["moire"].score == 1.0
    assert moire(np.zeros((16, 300), np.float32)).score == 1.0
    assert moire(np.full((224, 224), 0.5, np.float32)).score == 1.0
    wide = moire(plane(np.ascontiguousarray(np.concatenate([img, img], axis=1))))
    assert 0.0 <= wide.score <= 1.0 and np.isfinite(wide.value)


def _moire_by_the_definition(p: NDArray[np.float32]) -> float:
    """moire's value computed the long way, over the whole spectrum: the complex FFT of the
    windowed Laplacian, each bin's 3 × 3 sum over the mean of the 72 bins around it in its
    9 × 9 (by rolling, the spectrum read as periodic), zero outside periods 2.5-32 px, and the
    highest over every frequency of the lower of it and the same at the frequency turned by
    90°."""
    side = min(p.shape[0], p.shape[1], 224)
    top, left = (p.shape[0] - side) // 2, (p.shape[1] - side) // 2
    w = p[top:top + side, left:left + side].astype(np.float64)
    lap = np.zeros((side, side))
    lap[1:-1, 1:-1] = (4 * w[1:-1, 1:-1] - w[:-2, 1:-1] - w[2:, 1:-1] - w[1:-1, :-2]
                       - w[1:-1, 2:])
    lap[1:-1, 1:-1] -= lap[1:-1, 1:-1].mean()
    hann = np.hanning(side)
    lap *= np.outer(hann, hann)
    power = np.abs(np.fft.fft2(lap)) ** 2

    def box(r: int) -> NDArray[np.float64]:
        return sum((np.roll(power, (dy, dx), axis=(0, 1))
                    for dy in range(-r, r + 1) for dx in range(-r, r + 1)),
                   np.zeros_like(power))

    peak = box(1)
    ratio = peak / ((box(4) - peak) / 72 * 9 + power.mean() * 1e-6)
    f = np.fft.fftfreq(side)
    r = np.hypot(f[:, None], f[None, :])
    ratio[(r < 1 / 32) | (r > 1 / 2.5)] = 0.0
    turned = np.empty_like(ratio)
    for fy in range(side):
        for fx in range(side):
            turned[fy, fx] = ratio[fx, -fy % side]
    return float(np.minimum(ratio, turned).max())


@pytest.mark.parametrize("shape", [(224, 224), (230, 301), (57, 33), (100, 40), (33, 64)])
def test_the_value_is_the_whole_spectrum_s_by_the_definition(
        shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    # moire reads half the spectrum, only the columns its band reaches (a real image's power
    # is symmetric): the same value as the whole spectrum's, on even, odd and small sides
    # (the band reaching the last column or not), for a screen photo and for noise; the
    # whole frame's value (the regions have a test of their own in test_quality_spectra.py)
    rng = np.random.default_rng(sum(shape))
    for p in (rng.random(shape, dtype=np.float32),
              plane(photos.moire(np.asarray(rng.integers(0, 256, (*shape, 3)), np.uint8),
                                 0.7, rng))):
        got = whole_frame_only(p, monkeypatch)
        assert got == pytest.approx(_moire_by_the_definition(p), rel=1e-6, abs=1e-9), shape
