"""Keystone as converging lines on a page (issue 30, docs/quality.md "Round 11"): a study
feature for ``bench.keystone_study``, not a shipped signal.

A digital page or UI has its lines exactly along the axes. Photographed filling the frame at
an angle, the lines converge: the tilt of the text lines changes from one third of the frame
to the next (a rotation tilts every third alike). What a phone adds after the warp -- sensor
noise, JPEG, a screen's moiré -- changes neither the lines' positions nor their straightness,
so the geometry is read on the luminance plane as it comes, without a flat-colour prior
(Round 9's, which noise and moiré defeat). A photograph's own straight edges converge too (a
building *is* a keystone), so the geometry is judged only where the frame holds text lines:
in some third, the profile summed along the lines' best tilt is periodic (its
autocorrelation peaks at >= ``PERIODIC``) and coherent. That prior is read from the same
search, so it survives what the search survives.

- ``band_tilts``: per third of the frame (bands of rows), the lines' tilt by search, how
  coherent they are, how far that stands above the other tilts, and the periodicity of the
  profile aligned at that tilt.
- ``converging``: how much the tilt changes across the frame, in degrees (0 off the prior).
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]
STEEPEST = 12.0  # degrees: the lines of a page or screen at an angle stay within this of an axis
_SLOPES = np.tan(np.radians(np.arange(-STEEPEST, STEEPEST + 0.01, 0.25)))
BANDS = 3  # thirds of the frame, across each axis
WINDOWS = 14  # windows along each band: 16 px at 224, whose profiles are aligned by whole px
PERIODIC = 0.3  # the aligned profile's autocorrelation peak that reads as text lines
COHERENT = 0.2  # the share of the windows' energy that adds up along one tilt
STANDS_OUT = 2.0  # that coherence over its median over every tilt (~1.5 for a texture)


@cache
def _shifts(windows: int, step: int, width: int) -> I64:
    """Per searched slope and window, the window's shift (whole px) along the band."""
    centre = (np.arange(windows) + 0.5) * step - width / 2
    out: I64 = np.rint(_SLOPES[:, None] * centre[None, :]).astype(np.int64)
    return out


def _highpass(p: F64, k: int = 7) -> F64:
    """``p`` minus its running mean over ``k`` along the last axis (shading gone, lines kept)."""
    pad = [(0, 0)] * (p.ndim - 1) + [(k // 2 + 1, k // 2)]
    c = np.cumsum(np.pad(p, pad, mode="edge"), axis=-1)
    out: F64 = p - (c[..., k:] - c[..., :-k]) / k
    return out


def periodicity(q: F64, longest: int = 40) -> float:
    """The highest autocorrelation peak of ``q`` at a lag of 3 px or more (0 if none)."""
    q = q - q.mean()
    energy = float(q @ q)
    top = min(longest, q.size // 2)
    if energy <= 1e-12 or top < 4:
        return 0.0
    r = np.array([float(q[:-j] @ q[j:]) / energy for j in range(1, top + 1)])
    peaks = [r[i] for i in range(2, top - 1) if r[i] >= r[i - 1] and r[i] >= r[i + 1]]
    return float(max(peaks, default=0.0))


def band_tilts(z: F64, bands: int = BANDS, windows: int = WINDOWS) -> F64:
    """Per band of rows of ``z``: (tilt in degrees, coherence, how far it stands out,
    periodicity of the aligned profile); zeros for a band with under 3 windows of content.
    Each window's row profile (high-passed) is shifted by slope × the window's centre and
    the windows summed; the slope whose sum has the most energy is the lines' tilt."""
    h, w = z.shape
    rows, step = h // bands, w // windows
    mean = z[:rows * bands, :step * windows].reshape(bands, rows, windows, step).mean(-1)
    prof = _highpass(np.swapaxes(mean, 1, 2))  # bands, windows, rows
    energy = (prof ** 2).sum(-1)
    live = energy > 0.05 * energy.max(axis=1, keepdims=True)
    prof = prof * live[..., None]
    n, total = live.sum(1), (energy * live).sum(1)
    shifts = _shifts(windows, step, w)
    pad = int(np.abs(shifts).max()) + 1
    padded = np.pad(prof, ((0, 0), (0, 0), (pad, pad)))
    at = pad + np.arange(rows)[None, None, :] + shifts[:, :, None]  # slopes, windows, rows
    summed = padded[:, np.arange(windows)[None, :, None], at].sum(2)  # bands, slopes, rows
    coherence = (summed ** 2).sum(-1) / np.maximum(n * total, 1e-12)[:, None]
    out = np.zeros((bands, 4))
    for b in range(bands):
        if n[b] < 3 or total[b] <= 1e-12:
            continue
        best = int(coherence[b].argmax())
        out[b] = (np.degrees(np.arctan(_SLOPES[best])), coherence[b, best],
                  coherence[b, best] / max(float(np.median(coherence[b])), 1e-12),
                  periodicity(summed[b, best]))
    return out


def tilt_record(y: F64) -> F64:
    """``band_tilts`` of the lines along the rows (thirds top to bottom), then of those along
    the columns (thirds left to right): shape (2 × BANDS, 4)."""
    return np.concatenate([band_tilts(y), band_tilts(np.ascontiguousarray(y.T))])


def on_text_lines(record: F64) -> bool:
    """The prior: some third holds periodic, coherent lines along the rows (text lines)."""
    rows = record[:BANDS]
    return bool(((rows[:, 3] >= PERIODIC) & (rows[:, 1] >= 0.3)).any())


def converging(record: F64, columns: bool = True) -> float:
    """How much the lines' tilt changes across the frame, in degrees, where ``on_text_lines``
    (0 elsewhere): per family of lines (along the rows; along the columns unless
    ``columns`` is False), the largest minus the smallest tilt of its coherent thirds that
    stand out; a family with one such third, that third's |tilt|."""
    if not on_text_lines(record):
        return 0.0
    best = 0.0
    for family in (record[:BANDS], record[BANDS:]) if columns else (record[:BANDS],):
        seen = family[(family[:, 1] >= COHERENT) & (family[:, 2] >= STANDS_OUT), 0]
        if seen.size >= 2:
            best = max(best, float(seen.max() - seen.min()))
        elif seen.size == 1:
            best = max(best, abs(float(seen[0])))
    return best
