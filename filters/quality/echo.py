"""A faint shifted copy of the frame over itself: OCR residue, a previous video frame, a double
exposure (the seeds' "OCR residue" case), read from the cepstrum: ``ghosting``.

A copy at opacity a shifted by d multiplies the picture's spectrum by |1 + r·e^(-iωd)|² with
r = a / (1 − a); the logarithm turns that into a ripple 2r·cos(ωd) added to the picture's own
log spectrum, so the cepstrum (the inverse FFT of the log power spectrum) has a peak of about
r at ±d (0.053 at 5 %, 0.11 at 10 %, 0.18 at 15 %), whatever the picture. What the picture
adds there is its own cepstrum: smooth near zero, ridges for edges and textures, peaks for a
repeated object. ``echo`` finds the most isolated peak off zero and says how far it stands out
of the picture's own cepstrum; ``ghosting`` maps that to a score.

Rules that MUST hold: the score is finite and in [0, 1]; a ghosted copy never scores above its
clean source on the evaluation set (one stated exception: a picture whose own repetition reads
as a faint ghost that a shifted copy blurs, brick and one rocket crop); the lag named in the
message is the copy's shift (either sign: the cepstrum of a real picture is symmetric).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray

from filters.quality.measure import F32, LAPLACIAN_FLAT, Signal, laplacian
from filters.quality.measure import ramp as _ramp

GHOST_BAD, GHOST_GOOD = 12.0, 1.0  # echo's height over the cepstrum's spread; see ghosting()
_FLOOR = 1e-4  # of the mean power, added before the logarithm
# A pattern's second harmonic counts three times its height against the first (a UI's text
# lines: 6 of 8 rendered screenshots read as ghosts at 1, 1 at 3); a faint echo's second peak
# is r²/2 and negative, so ghosts lose nothing.
_HARMONIC_WEIGHT = 3.0
# Added to the cepstrum's spread: a picture whose cepstrum is nearly flat would otherwise turn
# a tiny peak into a large one (the AUC at 5 % moves 0.926 -> 0.933 with it).
_SPREAD_FLOOR = 0.005
_N = 256  # the FFT's side: the ~224 px plane, zero-padded
# A copy's echo does not repeat: the Laplacian's signs agree with themselves at twice its lag
# about as little as the picture's own do (at most 0.24 of the agreement at the lag, 10-15 %
# ghosts of the evaluation set), where a pattern's repeat recurs (a UI's text lines: 0.33-0.99).
_PERIODIC = 0.3
_MIN, _MAX = 4, 28  # lags searched (px): beyond an edge's own width, within a frame's tenth
_AROUND = 2  # a peak is over every value up to this far (its 5 × 5 neighbourhood)
_REACH = _MAX + _AROUND
_OFFSETS = tuple((oy, ox) for oy in range(-_AROUND, _AROUND + 1)
                 for ox in range(-_AROUND, _AROUND + 1) if oy or ox)
_NEAR_ROWS = np.arange(-_AROUND, 2 * _MAX + _AROUND + 1) % _N
"""The cepstrum's rows ``echo`` reads: the lags' window and their harmonics (twice the lag)."""


@dataclass(frozen=True, slots=True)
class Echo:
    """The most isolated peak of the cepstrum 4-28 px off zero."""

    dy: int
    dx: int
    height: float  # over the highest of its 24 neighbours (and over 0)
    harmonic: float  # the same at twice its lag (0 when none)
    spread: float  # the cepstrum's robust spread over the lags searched (1.4826 × MAD)
    # The Laplacian's signs' agreement with themselves at twice the lag over that at the lag:
    # measured only for an echo that stands out (z over 1; else 0). At 0.3 and over, a repeat.
    recurs: float = 0.0

    @property
    def z(self) -> float:
        """The height less three times the harmonic's, over the spread (+ 0.005): 0 when
        nothing stands out."""
        lift = self.height - _HARMONIC_WEIGHT * self.harmonic
        return max(lift, 0.0) / (self.spread + _SPREAD_FLOOR)


def cepstrum(plane: F32, rows: NDArray[np.intp] | None = None) -> NDArray[np.float64] | None:
    """The real cepstrum of the plane's Laplacian (its first ``_N`` rows and columns, zero-
    padded to ``_N``²), or only its ``rows`` (lags mod ``_N``); None when the plane has no
    edges. The Laplacian flattens the picture's spectrum before the logarithm and has no step
    at the frame's border for the padding to smear. The inverse runs down the columns, then
    along the rows asked for only: numpy's ``irfft2`` is those two passes, so the rows are its
    rows bit for bit, at a quarter of the second pass for ``echo``'s 61."""
    return _cepstrum(laplacian(plane), rows)


def _cepstrum(lap: F32, rows: NDArray[np.intp] | None) -> NDArray[np.float64] | None:
    """``cepstrum`` of the plane's Laplacian ``lap`` (centred here, on a copy)."""
    lap = lap - lap.mean()
    size = (_N, _N)
    spectrum = np.fft.rfft2(lap[:_N, :_N], s=size)
    power = spectrum.real ** 2
    power += spectrum.imag ** 2
    mean_power = float(power.mean())
    if mean_power <= 1e-20:
        return None
    power += mean_power * _FLOOR  # a flat or blocky picture has empty frequencies
    np.log(power, out=power)
    if rows is None:
        ceps: NDArray[np.float64] = np.fft.irfft2(power, s=size)
        return ceps
    down = np.fft.ifft(power, _N, axis=0)
    part: NDArray[np.float64] = np.fft.irfft(down[rows], _N, axis=1)
    return part


def echo(plane: F32) -> Echo | None:
    """The echo ``ghosting`` reads; None when the plane is too small or has no edges.

    A ghost's peak is one pixel wide: it is measured over the highest of its 24 neighbours
    up to 2 px away (a texture's or an edge's ridge runs through a neighbour; the picture's
    smooth cepstrum near zero lifts the neighbours as much as the peak). Measured over the
    8 neighbours 2 px away only (the first version), a clean photograph's bumps read as high
    as a 5 % ghost (its AUC at 5 %: 0.743, now 0.933; docs/quality.md, Round 10). The
    spread is the cepstrum's own over the same lags: a busy picture (the rocket's struts, a
    brick wall) has a rough cepstrum everywhere, a ghost stands out of a smooth one."""
    if min(plane.shape) < 32:
        return None
    lap = laplacian(plane)
    near = _cepstrum(lap, _NEAR_ROWS)  # row k is the lag dy = k - _AROUND
    if near is None:
        return None
    # The cepstrum of a real picture is symmetric (c(-d) = c(d)): the lags with dy > 0, and
    # dy = 0 with dx > 0, are all of it; their window carries 2 px around them.
    cols = np.arange(-_REACH, _REACH + 1) % _N
    win = near[: _AROUND + _REACH + 1][:, cols]
    side = 2 * _MAX + 1
    inner = win[_AROUND:_AROUND + _MAX + 1, _AROUND:_AROUND + side]
    around = np.zeros_like(inner)  # peaks are measured over 0 too: a dip is not an echo
    for oy, ox in _OFFSETS:
        np.maximum(around, win[_AROUND + oy:_AROUND + oy + _MAX + 1,
                               _AROUND + ox:_AROUND + ox + side], out=around)
    ring = _ring()
    height = np.where(ring, inner - around, -np.inf)
    at = int(np.argmax(height))
    dy, dx = divmod(at, side)
    dx -= _MAX
    values = inner[ring]
    spread = 1.4826 * float(np.median(np.abs(values - np.median(values))))
    found = Echo(dy, dx, float(height.flat[at]), max(_height_at(near, 2 * dy, 2 * dx), 0.0),
                 spread)
    if found.z <= GHOST_GOOD:
        return found
    signs = (lap > LAPLACIAN_FLAT).astype(np.int8)
    signs -= lap < -LAPLACIAN_FLAT
    once = _agreement(signs, dy, dx)
    return replace(found, recurs=_agreement(signs, 2 * dy, 2 * dx) / once if once > 0 else 0.0)


def _agreement(signs: NDArray[np.int8], dy: int, dx: int) -> float:
    """The mean product of the signs with themselves shifted by (dy, dx), dy >= 0, over the
    pixels where both have one (0 where none do, or where the shift leaves no overlap)."""
    h, w = signs.shape
    if dy >= h or abs(dx) >= w:
        return 0.0
    a = signs[dy:, max(dx, 0):w + min(dx, 0)]
    b = signs[:h - dy, max(-dx, 0):w - max(dx, 0)]
    both = np.multiply(a, b, dtype=np.int8)
    n = int(np.count_nonzero(both))
    return float(both.sum(dtype=np.int64)) / n if n else 0.0


def ghosting(plane: F32) -> Signal:
    """A faint shifted copy of the frame over itself, from ``echo``: its height less three
    times its harmonic's, in units of the cepstrum's spread. 12 scores 0, 1 scores 1 (the median
    clean photograph reads 0.95: 58 % of them keep a score of 1 when a rule turns it on); 0.5 at
    6.5, above every clean input of the evaluation (photographs of every framing, high-key,
    documents, illustrations, screenshots: the highest, a brick product shot, 6.1) but one
    rendered UI (ui0, 11.1). One 256² FFT pair and a logarithm: the dearest signal with moire
    (docs/quality.md, "Cost"), so it is measured only when a rule names it.

    A copy's echo does not repeat; a pattern's does (round 19): where the echo stands out (z
    over 1), the Laplacian's signs are read at the lag and at twice it, and an echo whose
    agreement recurs at twice its lag at 0.3 of its own or more scores 1 ("a repeating
    pattern, not a copy"): the text lines of 6 of 48 rendered UIs, which read as ghosts
    before; the 10-15 % ghosts of the evaluation recur at most 0.24 (docs/quality.md,
    "Round 19").

    Known confusions: a periodic pattern without harmonics in range (one repeated object; a
    brick wall near its own period) reads as a ghost or hides one; a long camera shake is a
    smear of shifted copies (15 px: about a quarter read as ghosts); a ghost of another scene
    (not a shifted copy) is not seen; a shift under 4 px is blur, not a ghost."""
    found = echo(plane)
    if found is None:
        why = "image too small" if min(plane.shape) < 32 else "no edges"
        return Signal(1.0, 0.0, f"cepstral echo off zero ({why})")
    z, at = found.z, f"at {found.dx:+d}, {found.dy:+d} px"
    if found.recurs >= _PERIODIC:
        return Signal(1.0, z, f"cepstral echo off zero, over its spread ({at}; it recurs at "
                      f"twice its lag, {found.recurs:.2f} of its agreement: a repeating pattern, "
                      "not a copy)")
    return Signal(_ramp(z, GHOST_BAD, GHOST_GOOD), z,
                  f"cepstral echo off zero, over its spread ({at})")


def _height_at(near: NDArray[np.float64], dy: int, dx: int) -> float:
    """The cepstrum at (dy, dx), 0 <= dy <= 2 × 28, over the highest of its 24 neighbours and
    0 (``near``: the cepstrum's rows from the lag -2 on, as ``echo`` reads them)."""
    around = max(float(near[dy + oy + _AROUND, (dx + ox) % _N]) for oy, ox in _OFFSETS)
    return float(near[dy + _AROUND, dx % _N]) - max(around, 0.0)


_RING: list[NDArray[np.bool_]] = []


def _ring() -> NDArray[np.bool_]:
    """The lags searched, over the (28 + 1) × (2·28 + 1) half window ``echo`` reads (lag 0 at
    its first row's centre; of the lags on that row, those to the right); built once."""
    if not _RING:
        ky, kx = np.arange(0, _MAX + 1)[:, None], np.arange(-_MAX, _MAX + 1)[None, :]
        r = np.hypot(ky, kx)
        _RING.append((r >= _MIN) & (r <= _MAX) & ((ky > 0) | (kx > 0)))
    return _RING[0]
