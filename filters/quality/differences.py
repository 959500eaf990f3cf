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

Where the C module is built (``native``), ``differences`` returns ``FusedDifferences``: the
same totals read in one pass over the plane, without the four buffers. Both answer the same
questions (``PlaneDifferences``); the numpy one is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from filters.quality import native
from filters.quality.measure import F32, tile_sums

TILES = 4  # sharpness's regions: 4 × 4 tiles
NOISE_BLOCK = 8  # noise: the 8 × 8 blocks of Immerkær's response
_ONES = np.ones(NOISE_BLOCK, np.float32)


class PlaneDifferences(Protocol):
    """What the signals read of a plane's differences, however they were computed."""

    @property
    def height(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def gx_energy(self) -> F32:
        """Per column boundary (W-1): the summed squared first difference across x."""
    @property
    def gy_energy(self) -> F32:
        """Per row boundary (H-1): the summed squared first difference across y."""
    def second_energies(self) -> tuple[float, float]:
        """Mean squared second difference across x (over H × (W-2)) and across y
        (over (H-2) × W): the Laplacian's two halves, sharpness's numerators."""
    def region_energies(self) -> F32:
        """(4, TILES, TILES): the squared gx, gy, second across x and second across y summed
        per tile over the first (H-2)//TILES*TILES rows and (W-2)//TILES*TILES columns."""
    def noise_blocks(self) -> F32:
        """|Immerkær's mask| summed per NOISE_BLOCK² block over the first (H-2)//8*8 rows and
        (W-2)//8*8 columns of its response, row-major, flat."""


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
        h, w = self.height, self.width
        return (float(np.dot(self.rows, self.rows)) / (h * (w - 2)),
                float(np.dot(self.cols, self.cols)) / ((h - 2) * w))

    def region_energies(self) -> F32:
        h = (self.height - 2) // TILES * TILES
        w = (self.width - 2) // TILES * TILES
        # read in place from the flat buffers (row stride self.width)
        return np.stack([tile_sums(np.square(x[:h * self.width]), self.width, h, w, TILES)
                         for x in (self.gx, self.gy, self.rows, self.cols)])

    def noise_blocks(self) -> F32:
        b = NOISE_BLOCK
        h, w = ((self.height - 2) // b) * b, ((self.width - 2) // b) * b
        # b × b block sums as two small products with ones: 5x cheaper than sums over short axes.
        m = immerkaer(self)[:h * self.width].reshape(h // b, b, self.width)
        strips = _ONES @ m  # (h / b) × W: each block row's column sums
        out: F32 = (strips[:, :w].reshape(h // b, w // b, b) @ _ONES).reshape(-1)
        return out


@dataclass(frozen=True, slots=True)
class FusedDifferences:
    """The totals ``Differences`` computes from its buffers, read by the C module's one pass."""

    height: int
    width: int
    gx_energy: F32
    gy_energy: F32
    second: tuple[float, float]
    region: F32
    blocks: F32

    def second_energies(self) -> tuple[float, float]:
        return self.second

    def region_energies(self) -> F32:
        return self.region

    def noise_blocks(self) -> F32:
        return self.blocks


def differences(plane: F32) -> PlaneDifferences:
    """The differences of ``plane`` (float32, both sides at least 3)."""
    kernels = native.kernels
    if kernels is None:
        return numpy_differences(plane)
    h, w = plane.shape
    flat = np.ascontiguousarray(plane, np.float32)
    gx, gy = np.empty(w - 1, np.float32), np.empty(h - 1, np.float32)
    region = np.empty((4, TILES, TILES), np.float32)
    blocks = np.empty(((h - 2) // NOISE_BLOCK) * ((w - 2) // NOISE_BLOCK), np.float32)
    rows, cols = kernels.differences(flat, h, w, TILES, NOISE_BLOCK, gx, gy, region, blocks)
    return FusedDifferences(h, w, gx, gy, (rows / (h * (w - 2)), cols / ((h - 2) * w)),
                            region, blocks)


def numpy_differences(plane: F32) -> Differences:
    """The differences of ``plane`` by numpy (C-contiguous float32, both sides at least 3)."""
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
