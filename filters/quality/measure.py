"""What every quality signal returns: a ``Signal`` (a score in [0, 1] and the raw value behind
it), the ramp that maps a value to a score, and the luminance plane's ``Levels`` that exposure
and tone both read. Its own module so the first-round signals (``signals``) and the edge scenes'
(``scenes``) share them without importing each other both ways.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from filters.quality import native

F32 = NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class Signal:
    score: float  # in [0, 1]; 1 = nothing wrong
    value: float  # the raw measurement the score was mapped from
    what: str  # how to read the value in a message, e.g. "NaN/Inf values"


LAPLACIAN_FLAT = np.float32(1e-5)
"""A Laplacian within this of zero has no sign: a flat patch, whose rounding noise would
otherwise read as edges (1/255 of luminance is 4e-3). ``residue`` and ``ghosting`` read signs."""


def laplacian(plane: F32) -> F32:
    """The plane's 4-neighbour Laplacian, 4·centre less its neighbours, over its interior
    ((h - 2) × (w - 2)): in one C pass where the kernels are built, the same values in numpy
    otherwise (``ghosting``'s cepstrum and ``residue``'s signs read it)."""
    h, w = plane.shape
    kernels = native.kernels
    if kernels is not None and plane.dtype == np.float32 and plane.flags.c_contiguous:
        lap = np.empty((h - 2, w - 2), np.float32)
        kernels.laplacian(plane, h, w, 0, 0, h, w, lap, w - 2, 0)
        return lap
    out: F32 = plane[1:-1, 1:-1] * np.float32(4)
    out -= plane[:-2, 1:-1]
    out -= plane[2:, 1:-1]
    out -= plane[1:-1, :-2]
    out -= plane[1:-1, 2:]
    return out


def ramp(x: float, bad: float, good: float) -> float:
    """0 at ``bad``, 1 at ``good``, linear between (either direction), clipped."""
    t = (x - bad) / (good - bad)
    return 0.0 if t <= 0.0 else 1.0 if t >= 1.0 else float(t)


def tile_sums(squares: F32, stride: int, rows: int, cols: int, tiles: int) -> F32:
    """Sums of ``squares`` (one or more stacked buffers of rows of ``stride`` values) over a
    ``tiles`` × ``tiles`` grid of their first ``rows`` rows and ``cols`` columns (both multiples
    of ``tiles``; what lies past ``cols`` is never read): shape (..., tiles, tiles). The sums
    run down each tile's rows one row after another, then along its columns, as
    ``x.reshape(tiles, rows // tiles, cols).sum(axis=1).reshape(tiles, tiles, -1).sum(axis=2)``
    adds them, so the totals are identical to the last bit; ``einsum``'s loop down the rows is
    ~1.7x cheaper than numpy's sum over a middle axis, and the rows of the buffers are read in
    place (no copy of a 2-D view)."""
    th, tw = rows // tiles, cols // tiles
    lead = squares.shape[:-1]
    stack = squares[..., :rows * stride].reshape(-1, th, stride)
    strips = np.einsum("aij->aj", stack)[:, :cols]
    out: F32 = strips.reshape(*lead, tiles, tiles, tw).sum(axis=-1)
    return out


MID_LOW, MID_HIGH = np.float32(0.25), np.float32(0.75)  # the mid-tones' luminance
NEAR_WHITE = np.float32(0.9)  # from here up: where a gradient runs into white
CLIPPED = np.float32(0.98)  # tone's clipped white
BLOWN = np.float32(250 / 255)  # exposure's blown white


@dataclass(frozen=True, slots=True)
class Levels:
    """Shares of a luminance plane's pixels by level, and its mean: counted once per image
    for both ``signals.exposure`` and ``scenes.tone``."""

    mean: float
    ink: float  # under 0.25
    mid: float  # 0.25 to 0.75
    near_white: float  # 0.9 and up
    clipped: float  # 0.98 and up
    blown: float  # 250/255 and up


def levels(plane: F32) -> Levels:
    """The plane's ``Levels``. The whites are counted among the pixels at 0.9 and up only (a
    photograph has few), so the seven counts exposure and tone used to make cost four passes
    (one, in the C module, where it is built: ``native``)."""
    flat = plane.reshape(-1)
    n = max(flat.size, 1)
    kernels = native.kernels
    if kernels is not None and flat.size:
        total, ink_n, high_n, white_n, clip_n, blown_n = kernels.levels(
            np.ascontiguousarray(flat, np.float32), flat.size, MID_LOW, MID_HIGH, NEAR_WHITE,
            CLIPPED, BLOWN)
        return levels_from_counts(total, ink_n, high_n, white_n, clip_n, blown_n, n)
    mean = float(flat.sum(dtype=np.float64)) / n
    ink = np.count_nonzero(flat < MID_LOW) / n
    high = np.count_nonzero(flat > MID_HIGH) / n
    white = flat[flat >= NEAR_WHITE]
    return Levels(mean, ink, 1.0 - ink - high, white.size / n,
                  np.count_nonzero(white >= CLIPPED) / n, np.count_nonzero(white >= BLOWN) / n)


def levels_from_counts(total: float, ink: int, high: int, white: int, clipped: int, blown: int,
                       n: int) -> Levels:
    """``Levels`` from a C pass's sum and counts over ``n`` values (``levels`` here, and
    ``luma.image_pass``, which counts them while it writes the plane)."""
    return Levels(total / n, ink / n, 1.0 - ink / n - high / n, white / n, clipped / n,
                  blown / n)
