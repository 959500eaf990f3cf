"""moire's and ghosting's C passes around their FFTs (``filters/quality/_spectra.c``) give what
their numpy code gives: the Laplacian bit for bit, moire's twin-peak search bit for bit on the
same spectrum (the same box sums in the same order), its regional twin to the last bits (the
C reads the half spectrum, numpy the whole), and moire's windowed energy to the last bits of
its sum; so on real photographs, their screen-photo and ghosted copies, and planes of
every size the search meets, both signals read the same value, score and message."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest
from numpy.typing import NDArray

from filters.quality import echo, moire, native, scenes
from tests.support import photos

F32 = NDArray[np.float32]
T = TypeVar("T")
SHAPES = ((32, 32), (33, 47), (40, 33), (64, 64), (100, 130), (224, 224), (225, 301))
"""Even and odd sides; the half spectrum whole (sides up to 33) or cut to the band's reach."""


def kernels() -> Any:
    found = native.kernels
    assert found is not None, "the C module is not built"
    return found


def numpy_path(fn: Callable[..., T], *args: Any) -> T:
    saved = native.kernels
    native.kernels = None
    try:
        return fn(*args)
    finally:
        native.kernels = saved


def luminance(rgb: NDArray[np.uint8]) -> F32:
    plane = rgb.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32) / 255
    return np.ascontiguousarray(plane, np.float32)


def planes() -> list[tuple[str, F32]]:
    rng = np.random.default_rng(11)
    out = [(f"random {h}x{w}", rng.random((h, w), np.float32)) for h, w in SHAPES]
    grid = (np.indices((96, 96)).sum(axis=0) % 2).astype(np.float32)  # a checkerboard
    out.append(("checkerboard", grid))
    for clean in photos.clean_set()[::9]:
        out.append((clean.name, luminance(clean.image)))
        out.append((f"{clean.name}/moire", luminance(photos.moire(clean.image, 0.4, rng))))
        out.append((f"{clean.name}/keystoned moire",
                    luminance(photos.keystone_moire(clean.image, 0.2, rng))))
        out.append((f"{clean.name}/ghost", luminance(photos.ghost(clean.image, 0.1, rng))))
    return out


PLANES = planes()


@pytest.mark.parametrize(("name", "plane"), PLANES, ids=[n for n, _ in PLANES])
def test_moire_and_ghosting_read_as_their_numpy_code(name: str, plane: F32) -> None:
    kernels()
    for signal in (scenes.moire, echo.ghosting):
        got, want = signal(plane), numpy_path(signal, plane)
        assert got.what == want.what, name  # the period or the lag: the same peak chosen
        assert got.value == pytest.approx(want.value, rel=1e-9, abs=1e-12), name
        assert got.score == pytest.approx(want.score, abs=1e-9), name


@pytest.mark.parametrize(("name", "plane"), PLANES, ids=[n for n, _ in PLANES])
def test_the_twin_peak_is_numpys_bit_for_bit_on_the_same_spectrum(name: str, plane: F32
                                                                  ) -> None:
    kernels()
    side = min(plane.shape[0], plane.shape[1], 224)
    half, mean_power = moire._moire_power(plane, side)
    if mean_power <= 1e-20:
        pytest.fail(f"{name}: no edges to search")
    assert moire._twin_peak(half, side, mean_power) == numpy_path(
        moire._twin_peak, half, side, mean_power)


def test_a_nan_in_the_spectrum_is_the_peak_on_either_path_as_argmax_has_it() -> None:
    plane = PLANES[5][1]
    half, mean_power = moire._moire_power(plane, 224)
    half[40, 12] = complex(math.nan, 0.0)
    value, at, cols = moire._twin_peak(half, 224, mean_power)
    want_value, want_at, want_cols = numpy_path(moire._twin_peak, half, 224, mean_power)
    assert math.isnan(value) and math.isnan(want_value)
    assert (at, cols) == (want_at, want_cols)


@pytest.mark.parametrize(("h", "w"), SHAPES)
def test_the_laplacian_is_numpys_bit_for_bit(h: int, w: int) -> None:
    k = kernels()
    plane = np.random.default_rng(h * w).random((h, w), np.float32)
    lap = np.empty((h - 2, w - 2), np.float32)
    k.laplacian(plane, h, w, 0, 0, h, w, lap, w - 2, 0)
    want = plane[1:-1, 1:-1] * np.float32(4)
    want -= plane[:-2, 1:-1]
    want -= plane[2:, 1:-1]
    want -= plane[1:-1, :-2]
    want -= plane[1:-1, 2:]
    assert np.array_equal(lap.view(np.uint32), want.view(np.uint32))
    # a window of it, into a zero-bordered square, as moire takes it
    side = min(h, w) - 1
    top, left = (h - side) // 2, (w - side) // 2
    square = np.zeros((side, side), np.float32)
    k.laplacian(plane, h, w, top, left, side, side, square,
                side, side + 1)
    window = plane[top:top + side, left:left + side]
    inner = window[1:-1, 1:-1] * np.float32(4)
    inner -= window[:-2, 1:-1]
    inner -= window[2:, 1:-1]
    inner -= window[1:-1, :-2]
    inner -= window[1:-1, 2:]
    assert np.array_equal(square[1:-1, 1:-1], inner)
    assert not square[0].any() and not square[-1].any()
    assert not square[:, 0].any() and not square[:, -1].any()


def test_the_window_is_numpys_and_its_energy_equal_to_the_last_bits() -> None:
    k = kernels()
    side = 224
    lap = np.random.default_rng(5).standard_normal((side, side)).astype(np.float32)
    want = lap.copy()
    inner = want[1:-1, 1:-1]
    mean = inner.mean()
    inner -= mean
    inner *= moire._hann(side)[1:-1, 1:-1]
    energy = k.windowed(lap, side, mean, moire._hann(side))
    assert np.array_equal(lap, want)
    assert energy == pytest.approx(float(np.dot(inner.ravel().astype(np.float64),
                                                inner.ravel())), rel=1e-6)


def test_refused_arguments_are_named_and_their_buffers_let_go() -> None:
    k = kernels()
    plane = np.zeros((40, 40), np.float32)
    out = np.zeros((38, 38), np.float32)
    with pytest.raises(ValueError, match="laplacian: the window is not inside the plane"):
        k.laplacian(plane, 40, 40, 5, 0, 40, 40, out, 38, 0)
    with pytest.raises(ValueError, match="out: expected at least 1444 values, got 1443"):
        k.laplacian(plane, 40, 40, 0, 0, 40, 40, out.ravel()[:-1],
                    38, 0)
    spectrum = np.zeros(2 * 64 * 30)
    band = np.ones((64, 26), bool)
    with pytest.raises(TypeError, match="band: expected bool, got format"):
        k.moire_peak(spectrum, 64, 30, 4, 1, 1e-6, band.astype(np.uint16))
    with pytest.raises(ValueError, match="spectrum: expected at least 3840 values, got 3839"):
        k.moire_peak(spectrum[:-1], 64, 30, 4, 1, 1e-6, band)
    with pytest.raises(ValueError, match="moire_peak: the spectrum does not fit the boxes"):
        k.moire_peak(spectrum, 64, 40, 4, 1, 1e-6, band)
    with pytest.raises(TypeError, match="spectrum: expected float64"):
        k.moire_peak(spectrum.astype(np.float32), 64, 30, 4, 1, 1e-6, band)
    for held in (plane, out, spectrum, band):
        held.resize(held.size + 1, refcheck=False)  # BufferError if a refused call held it


@pytest.mark.parametrize(("name", "plane"), PLANES, ids=[n for n, _ in PLANES])
def test_the_regional_twin_is_numpys_on_every_plane(name: str, plane: F32) -> None:
    kernels()
    side = min(plane.shape[0], plane.shape[1], 224)
    top, left = (plane.shape[0] - side) // 2, (plane.shape[1] - side) // 2
    got = moire._regional(plane, top, left, side)
    want = numpy_path(moire._regional, plane, top, left, side)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12), name
