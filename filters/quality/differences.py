"""The luminance plane's differences, computed once per image for every signal that reads them:
sharpness (first and second differences along both axes), blockiness (the first differences'
energy per column and per row), noise (Immerkær's mask, the second difference of the second
difference) and sharpness's regions (all four, tile by tile).

Why a module of its own: these are most of the image signals' cost, and each used to be
computed where it was read (the first differences three times over). Here each is one
subtraction over the plane read as a flat array, so numpy runs one contiguous loop instead of
one short loop per row: a difference along x of a flat H × W plane is the row's difference
everywhere but at the last column, where it steps into the next row; that column is zeroed
and never read. Every array keeps the plane's row stride W, so a 2-D view of its valid part
(``grid``) is free.

What MUST hold: every value read is the difference of pixels of one row (x) or one column (y),
exactly as the 2-D slicing computed it; the columns past a row's end are zero wherever a
total is taken over the whole buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from filters.quality.measure import F32


@dataclass(frozen=True, slots=True)
class Differences:
    """One plane's differences (H × W, both at least 3). Flat buffers with row stride W:
    ``gx`` (first, across x: H rows, W-1 valid columns), ``gy`` (first, across y: H-1 × W),
    ``rows`` (second, across x: H × W-2), ``cols`` (second, across y: H-2 × W)."""

    height: int
    width: int
    gx: F32
    gy: F32
    rows: F32
    cols: F32
    gx_energy: F32
    """Per column boundary (W-1): the summed squared first difference across x."""
    gy_energy: F32
    """Per row boundary (H-1): the summed squared first difference across y."""

    def grid(self, flat: F32, rows: int, cols: int) -> F32:
        """The valid rows × cols of one of the flat buffers, as a 2-D view."""
        out: F32 = flat[:rows * self.width].reshape(rows, self.width)[:, :cols]
        return out

    def second_energies(self) -> tuple[float, float]:
        """Mean squared second difference across x (over H × (W-2)) and across y
        (over (H-2) × W): the Laplacian's two halves, sharpness's numerators."""
        h, w = self.height, self.width
        return (float(np.dot(self.rows, self.rows)) / (h * (w - 2)),
                float(np.dot(self.cols, self.cols)) / ((h - 2) * w))


def differences(plane: F32) -> Differences:
    """The differences of ``plane`` (C-contiguous float32, both sides at least 3)."""
    h, w = plane.shape
    flat = np.ascontiguousarray(plane).reshape(-1)
    n = flat.size
    gx = np.empty(n, np.float32)
    np.subtract(flat[1:], flat[:-1], out=gx[:-1])
    gx2 = gx.reshape(h, w)
    gx2[:, w - 1] = 0.0  # the step from a row's end into the next row: not a difference
    rows = np.empty(n, np.float32)
    np.subtract(gx[1:], gx[:-1], out=rows[:-1])
    rows.reshape(h, w)[:, w - 2:] = 0.0  # reach past the row's end
    gy = np.subtract(flat[w:], flat[:-w])
    cols = np.subtract(gy[w:], gy[:-w])
    ex = np.einsum("ij,ij->j", gx2, gx2)[:w - 1]
    gy2 = gy.reshape(h - 1, w)
    ey = np.einsum("ij,ij->i", gy2, gy2)
    return Differences(h, w, gx, gy, rows, cols, ex, ey)


def immerkaer(d: Differences) -> F32:
    """|M * plane| for Immerkær's mask M = [1,-2,1]ᵀ[1,-2,1]: the second difference across y
    of the second difference across x, (H-2) rows of stride W (W-2 valid columns)."""
    w = d.width
    step = np.subtract(d.rows[w:], d.rows[:-w])
    m = np.subtract(step[w:], step[:-w])
    np.abs(m, out=m)
    return m
