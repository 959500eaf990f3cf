"""Moiré: a phone photo of a screen that fills the frame, read from the spectrum (``moire``).

The beat between a screen's pixel grid and a camera's is a faint crosshatch over the whole
picture: two narrow spectral peaks at right angles and at one distance from zero. Square on,
one spectrum of the central 224² window shows them (``_twin_peak``); a screen photographed at
an angle chirps the beat across the frame (its pitch and directions change from the near side
to the far side), so the whole frame's peaks spread and their twins are no longer exactly at
right angles. ``_regional`` reads the same evidence in 128² regions, where the chirp is a
quarter as wide, with the twin test relaxed as a perspective shears a grid.

Rules that MUST hold: the score is finite and in [0, 1]; it is the lower of the whole frame's
(the score of earlier rounds, bit for bit) and the regions', and the value and message are
those of the one that set it; a picture too small for three regions reads the whole frame's
only; the C search gives numpy's value (tests/unit/test_quality_spectra.py).
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from numpy.typing import NDArray

from filters.quality import native
from filters.quality.measure import F32, Signal, laplacian
from filters.quality.measure import ramp as _ramp

MOIRE_BAD, MOIRE_GOOD = 12.0, 4.0  # twin peak over its surround; see moire()
_MOIRE_N = 224  # the window read: a model's input side
_MOIRE_RING = 4  # the surround: the 9 × 9 bins around a peak's 3 × 3
_MOIRE_PERIODS = (2.5, 32.0)  # px: a beat finer is gone in the resize, coarser is the scene's
# A region's twin: its null is higher (a smaller window's spectrum is rougher, and the best of
# ten peaks' pairs is taken): clean photographs read a median of 3.9 where the whole frame
# reads 2.7, so its own ramp, 0.5 at 8 as the whole frame's.
REGION_BAD, REGION_GOOD = 10.0, 6.0
_REGION = 128  # px: a region's side; a perspective chirps the beat a quarter as much in it
_REGION_OVERLAP = 32  # px at least: the four corners' regions of a side of 160 px and up
_REGION_RANK = 2  # the second-highest region: a screen's beat fills the frame, a texture a part
_REGION_PEAKS = 10  # the strongest isolated peaks of a region that are paired
_TWIN_TURN = 15.0  # degrees: a regional twin's directions within this of a right angle
_TWIN_PITCH = 1.3  # and its periods within this ratio: a perspective shears and scales a grid
_TWIN_COSINE = math.cos(math.radians(90.0 - _TWIN_TURN))


def moire(plane: F32) -> Signal:
    """A phone photo of a screen that fills the frame: moiré, the beat between the screen's
    pixel grid and the camera's, a faint crosshatch over the whole picture.

    A pixel grid has two perpendicular directions of the same pitch, so its beats with the
    sensor's grid are two narrow peaks in the spectrum at the same distance from zero and at
    right angles. Per frequency (periods 2.5-32 px) of the Hann-windowed Laplacian of the
    central 224² window, the power of its 3 × 3 bins over the mean of the 9 × 9 around them
    (a peak one window-width wide stands out; a photograph's spectrum, smooth and fluctuating
    bin by bin, reads 2-5), and the value is the highest, over all frequencies, of the lower
    of that ratio and the same at the frequency turned by 90°. A texture's or a page's
    periodicity is one direction (text lines), or two of different periods (brick's rows and
    joints): without the twin test, brick reads 25-107 and a page 40, with it 3.9 and 4.7.
    12 scores 0, 4 scores 1 (0.5 at 8, above the highest clean input of any kind but a
    checkerboard, 6.4: a rendered dark-mode screenshot). One 224² real FFT, and the box sums
    and the twin test on its half only (a real image's spectrum is symmetric): still dearer
    than every default signal together, so measured only when a rule names it
    (docs/quality.md, "Cost" and "Round 6").

    **A screen photographed at an angle** (round 18): a perspective chirps the beat across the
    frame (its pitch and directions change from the near side to the far side), so the whole
    frame's peaks spread (the keystoned moiré ladder read AUC 0.813 / 0.677 / 0.576 at corner
    shifts 0.1 / 0.2 / 0.3 on the whole frame alone). The same ratio is read in the four
    corners' 128² regions (overlapping by 32 px at 224), where the chirp is a quarter as wide,
    and the twin test relaxed as a perspective shears and scales a grid (directions within 15°
    of a right angle, pitches within 1.3×; ``_regional``). The second-highest region counts (a
    screen's beat fills the frame, a texture's repeat fills a part of it), on a ramp of its own
    (its null is higher: 6 scores 1, 10 scores 0, 0.5 at 8 as the whole frame's); the score is
    the lower of the two and the message says which (``in 2 of 4 regions``). About twice the
    whole frame's cost (four 128² FFTs beside one 224²; docs/quality.md, "Round 18"; nine
    regions caught a few more at three times the cost).

    Known confusions: a picture of a regular grid (a checkerboard, tiles, a fence seen square
    on, graph paper) is a grid and reads as moiré; moiré along one direction only (a screen
    whose subpixel stripes beat but whose rows do not) is not seen, nor a beat coarser than
    32 px (a broad colour wave); a strong perspective still spreads a region's peak (corner
    shift 0.3), and a weak grid under a busy picture stays under its surround in a region
    that is a third of the frame's area."""
    side = min(plane.shape[0], plane.shape[1], _MOIRE_N)
    if side < 32:
        return Signal(1.0, 0.0, "twin spectral peaks (image too small)")
    half, mean_power = _moire_power(plane, side)
    if mean_power <= 1e-20:
        return Signal(1.0, 0.0, "twin spectral peaks (no edges)")
    value, at, cols = _twin_peak(half, side, mean_power)
    fy, fx = divmod(at, cols)
    fy = (fy + side // 2) % side - side // 2
    period = side / max(math.hypot(fy, fx), 1e-9)
    score, where = _ramp(value, MOIRE_BAD, MOIRE_GOOD), ""
    regional, regional_period = _regional(plane, (plane.shape[0] - side) // 2,
                                          (plane.shape[1] - side) // 2, side)
    regional_score = _ramp(regional, REGION_BAD, REGION_GOOD)
    if regional_score < score:
        regions = len(_region_starts(side)) ** 2
        score, value, period = regional_score, regional, regional_period
        where = f" in {_REGION_RANK} of {regions} regions"
    return Signal(score, value, f"twin spectral peaks{where} (period {period:.1f} px)")


def _moire_power(plane: F32, side: int) -> tuple[NDArray[np.complex128], float]:
    """The spectrum of the Hann-windowed Laplacian of the plane's central side² window, over the
    columns of the half spectrum the band (periods down to 2.5 px: |fx| <= 0.4) and its
    surround reach (the second FFT pass runs over those only), and the mean power over every
    frequency (by Parseval: the sum of |F|² is side² × the sum of lap²)."""
    top, left = (plane.shape[0] - side) // 2, (plane.shape[1] - side) // 2
    lap = np.zeros((side, side), np.float32)
    inner = lap[1:-1, 1:-1]
    kernels = native.kernels
    if kernels is not None and plane.dtype == np.float32 and plane.flags.c_contiguous:
        kernels.laplacian(plane, plane.shape[0], plane.shape[1], top, left, side, side, lap,
                          side, side + 1)
        mean_power: float = kernels.windowed(lap, side, inner.mean(), _hann(side))
    else:
        p = plane[top:top + side, left:left + side]
        inner += p[1:-1, 1:-1] * np.float32(4)
        inner -= p[:-2, 1:-1]
        inner -= p[2:, 1:-1]
        inner -= p[1:-1, :-2]
        inner -= p[1:-1, 2:]
        inner -= inner.mean()
        inner *= _hann(side)[1:-1, 1:-1]
        mean_power = float(np.dot(inner.ravel().astype(np.float64), inner.ravel()))
    cols = side // 2 + 1
    reach = min(cols, int(side / _MOIRE_PERIODS[0]) + 1 + _MOIRE_RING)
    rows_done = np.fft.rfft(lap, axis=1)
    half = np.fft.fft(rows_done[:, :reach] if reach < cols else rows_done, axis=0)
    return half, mean_power


def _twin_peak(half: NDArray[np.complex128], side: int, mean_power: float
               ) -> tuple[float, int, int]:
    """Per frequency in the band, the power of its 3 × 3 bins over the mean of the 9 × 9 ring
    around them, the lower of that and the same at the frequency turned by 90°: the highest,
    its flat index and the columns of the result it indexes."""
    kernels = native.kernels
    width = half.shape[1]
    cols = width - _MOIRE_RING if width < side // 2 + 1 else width
    if kernels is not None:  # the same powers and sums in the same order, in one pass
        by_column = np.ascontiguousarray(half.T).view(np.float64)  # numpy's FFT: no copy
        value, at, cols = kernels.moire_peak(by_column, side, width, _MOIRE_RING, 1,
                                             mean_power * 1e-6, _moire_band(side, cols))
        return value, at, cols
    power = half.real ** 2
    power += half.imag ** 2
    peak, around = _half_box_sums(power, side, 1, _MOIRE_RING)
    cols = peak.shape[1]
    around -= peak
    around *= 9.0 / 72.0
    around += mean_power * 1e-6  # an empty surround (a flat picture) is no peak
    ratio = np.divide(peak, around, out=peak)
    ratio[~_moire_band(side, cols)] = 0.0
    twin = np.minimum(ratio, ratio.flat[_turned(side, cols)])
    at = int(np.argmax(twin))
    return float(twin.flat[at]), at, cols


def _half_box_sums(power: NDArray[np.float64], side: int, small: int, big: int
                   ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The sums of the (2r + 1)² powers around every frequency of ``rfft2``'s half (rows: fy,
    periodic; columns: fx = 0 ..), for r = ``small`` and ``big``: the columns a box reaches
    below fx = 0 are read off the mirrored half (P(fy, -fx) = P(-fy, fx)), then one running
    sum down the rows and one along them. ``power`` holds every column of the half, or its
    first ones only: then the sums are of all but its last ``big`` columns (they are the
    surround of the others) and nothing is read past its end."""
    width = power.shape[1]
    truncated = width < side // 2 + 1
    out_cols = width - big if truncated else width
    flipped = power[(-np.arange(side)) % side]  # P(-fy, fx)
    ext = np.empty((side + 2 * big + 1, out_cols + 2 * big + 1))
    body = ext[1 + big:1 + big + side, 1:]
    body[:, :big] = flipped[:, big:0:-1]  # fx = -big .. -1
    if truncated:
        body[:, big:] = power
    else:
        body[:, big:big + width] = power
        last = width - 1 if side % 2 else width - 2  # the last column mirrored past the end
        body[:, big + width:] = flipped[:, last:last - big:-1]  # fx = width .. width + big - 1
    ext[1:1 + big, 1:] = body[-big:]
    ext[1 + big + side:, 1:] = body[:big]
    ext[0] = 0.0
    ext[:, 0] = 0.0
    np.cumsum(ext, axis=0, out=ext)
    out = []
    for r in (small, big):
        lo, hi = big - r, big + r + 1
        rows = ext[hi:hi + side] - ext[lo:lo + side]
        np.cumsum(rows, axis=1, out=rows)
        out.append(rows[:, hi:hi + out_cols] - rows[:, lo:lo + out_cols])
    return out[0], out[1]


@cache
def _turned(side: int, cols: int) -> NDArray[np.intp]:
    """Per frequency (fy, fx) of the first ``cols`` columns of ``rfft2``'s half, the flat
    index there of the frequency turned by 90°, (fx, -fy), or of its mirror (-fx, fy) where
    -fy < 0 (a power and every box sum of it are the same at f and -f). A turned frequency
    past the columns kept is outside the band, as its own is: it reads the last column."""
    fy = (np.arange(side)[:, None] + side // 2) % side - side // 2
    fx = np.arange(cols)[None, :]
    row = np.where(fy <= 0, fx, -fx) % side
    index: NDArray[np.intp] = (row * cols + np.minimum(np.abs(fy), cols - 1)).astype(np.intp)
    index.flags.writeable = False
    return index


@cache
def _hann(side: int) -> F32:
    w = np.hanning(side).astype(np.float32)
    out: F32 = np.outer(w, w)
    out.flags.writeable = False
    return out


@cache
def _moire_band(side: int, cols: int) -> NDArray[np.bool_]:
    """The frequencies of the first ``cols`` columns of ``rfft2``'s half whose period is in
    ``_MOIRE_PERIODS``."""
    f = np.fft.fftfreq(side)
    r = np.hypot(f[:, None], np.fft.rfftfreq(side)[None, :cols])
    lo, hi = _MOIRE_PERIODS
    band: NDArray[np.bool_] = (r >= 1.0 / hi) & (r <= 1.0 / lo)
    band.flags.writeable = False
    return band


def _regional(plane: F32, top: int, left: int, side: int) -> tuple[float, float]:
    """The twin peak of the four corners' 128² regions of the central side² window, the
    ``_REGION_RANK``-th highest over them, and its period (px): (0, 0) on a side under 160.
    Per region: the Hann-windowed Laplacian's power spectrum, each bin's 3 × 3 sum over the
    mean of the 72 around it in its 9 × 9 (the whole frame's ratio), its isolated peaks (the
    highest in their 5 × 5) in the band, and of the strongest ten the best pair whose
    directions are within 15° of a right angle and whose periods are within 1.3× of each
    other: the lower of the two ratios. In C where the kernels are built (one call per
    region after numpy's FFT), the same in numpy otherwise."""
    starts = _region_starts(side)
    if not starts:
        return 0.0, 0.0
    lap = laplacian(np.ascontiguousarray(plane[top:top + side, left:left + side]))
    n = len(starts)
    regions = np.zeros((n * n, _REGION, _REGION))
    inner = regions[:, 1:-1, 1:-1]
    step = starts[-1] - starts[0]
    inner[:] = sliding_window_view(lap, (_REGION - 2, _REGION - 2))[
        ::step, ::step].reshape(n * n, _REGION - 2, _REGION - 2)
    inner -= inner.mean(axis=(1, 2), keepdims=True)
    regions *= _hann(_REGION)
    kernels = native.kernels
    if kernels is None:
        values = [_relaxed_twin(r) for r in _region_ratios(regions)]
    else:
        reach = int(_REGION / _MOIRE_PERIODS[0]) + 1 + _MOIRE_RING
        half = np.fft.fft(np.fft.rfft(regions, axis=2)[:, :, :reach], axis=1)
        lifts = np.einsum("kij,kij->k", regions, regions) * 1e-6  # the mean power (Parseval)
        band, readable = _region_half_band(reach - _MOIRE_RING)
        values = [kernels.moire_regional(np.ascontiguousarray(h.T).view(np.float64), _REGION,
                                         reach, _MOIRE_RING, 1, float(lift), band, readable, 2,
                                         _REGION_PEAKS, _TWIN_COSINE, _TWIN_PITCH)
                  for h, lift in zip(half, lifts, strict=True)]
    values.sort(key=lambda v: v[0], reverse=True)
    return values[_REGION_RANK - 1]


def _region_starts(side: int) -> tuple[int, ...]:
    """Where the regions of a side² window start along each axis: at its two ends' 128 px
    (at 224: 0 and 96; at 160, the least, they overlap by 96 px), none on a smaller side."""
    return (0, side - _REGION) if side >= _REGION + _REGION_OVERLAP else ()


def _region_ratios(regions: NDArray[np.float64]) -> NDArray[np.float64]:
    """Per region and frequency, the 3 × 3 power over the mean of the ring to 9 × 9 (the
    spectrum read as periodic), zero outside the band."""
    n, big = _REGION, _MOIRE_RING
    half = np.fft.rfft2(regions)
    hp = half.real ** 2
    hp += half.imag ** 2
    power = np.empty(regions.shape)
    power[:, :, :n // 2 + 1] = hp
    power[:, :, n // 2 + 1:] = hp[:, (-np.arange(n)) % n, n // 2 - 1:0:-1]  # P(fy, -fx)
    mean = power.mean(axis=(1, 2))
    ext = np.pad(power, ((0, 0), (big + 1, big), (big + 1, big)), mode="wrap")
    ext[:, 0] = 0.0
    ext[:, :, 0] = 0.0
    np.cumsum(ext, axis=1, out=ext)
    np.cumsum(ext, axis=2, out=ext)

    def box(r: int) -> NDArray[np.float64]:  # rows and columns y - r .. y + r
        a, b = big - r, big + 1 + r
        out: NDArray[np.float64] = ext[:, b:b + n, b:b + n] - ext[:, a:a + n, b:b + n]
        out -= ext[:, b:b + n, a:a + n]
        out += ext[:, a:a + n, a:a + n]
        return out

    peak = box(1)
    around = box(big) - peak
    around *= 9.0 / 72.0
    around += mean[:, None, None] * 1e-6
    with np.errstate(invalid="ignore"):  # a region of no edges: 0 / 0, no peak (as in C)
        ratio: NDArray[np.float64] = np.divide(peak, around, out=peak)
    ratio[:, ~_region_band()[0]] = 0.0
    return ratio


def _relaxed_twin(ratio: NDArray[np.float64]) -> tuple[float, float]:
    """A region's best relaxed twin (see ``_regional``) and its mean period (px)."""
    n = _REGION
    ext = np.pad(ratio, 2, mode="wrap")
    rows = ext[:, 2:-2].copy()
    for d in (0, 1, 3, 4):
        np.maximum(rows, ext[:, d:d + n], out=rows)
    most = rows[2:-2].copy()
    for d in (0, 1, 3, 4):
        np.maximum(most, rows[d:d + n], out=most)
    at = np.flatnonzero((ratio >= most) & (ratio > 0.0) & _region_band()[1])
    if at.size < 2:
        return 0.0, 0.0
    at = at[np.argsort(ratio.flat[at])[::-1][:_REGION_PEAKS]]
    strength = ratio.flat[at]
    fy, fx = np.divmod(at, n)
    fy = (fy + n // 2) % n - n // 2
    fx = (fx + n // 2) % n - n // 2
    radius = np.hypot(fy, fx)
    angle = np.degrees(np.arctan2(fy, fx))
    turn = np.abs((angle[:, None] - angle[None, :] + 90.0) % 180.0 - 90.0)
    pitch = np.maximum(radius[:, None], radius[None, :]) / np.minimum(radius[:, None],
                                                                      radius[None, :])
    twin = (turn >= 90.0 - _TWIN_TURN) & (pitch <= _TWIN_PITCH)
    if not twin.any():
        return 0.0, 0.0
    both = np.where(twin, np.minimum(strength[:, None], strength[None, :]), 0.0)
    i, j = divmod(int(np.argmax(both)), len(at))
    return float(both[i, j]), 2.0 * n / float(radius[i] + radius[j])


@cache
def _region_band() -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
    """A region's frequencies in ``_MOIRE_PERIODS``, and those of them on the half of the
    spectrum whose peaks are read: fx > 0, or fx = 0 and fy > 0 (the other half mirrors it)."""
    f = np.fft.fftfreq(_REGION)
    fy, fx = f[:, None], f[None, :]
    r = np.hypot(fy, fx)
    lo, hi = _MOIRE_PERIODS
    band = (r >= 1.0 / hi) & (r <= 1.0 / lo)
    half = band & ((fx > 0) | ((fx == 0) & (fy > 0)))
    band.flags.writeable = False
    half.flags.writeable = False
    return band, half


@cache
def _region_half_band(cols: int) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
    """Over the first ``cols`` columns of a region's ``rfft2`` half: the band
    (``_moire_band``), and where its peaks are read (fx > 0, or fx = 0 and fy > 0)."""
    band = _moire_band(_REGION, cols)
    fy = np.fft.fftfreq(_REGION)[:, None]
    fx = np.arange(cols)[None, :]
    half = band & ((fx > 0) | (fy > 0))
    half.flags.writeable = False
    return band, half
