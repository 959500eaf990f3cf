"""The cheaper paths of the image signals compute what the plain numpy they replaced computes, to
the last bit: the tile sums read in place from flat buffers (``measure.tile_sums``: shake, the
sharpest region), the float16 widening by a table take, and ``channel_clipped``'s planar and
integer paths, each against the straightforward formulation on real photographs and on values
chosen at the edges (NaN, ±Inf, the clipping threshold, the light level)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from filters.quality.measure import tile_sums
from filters.quality.signals import ImageSpec, channel_clipped, widen_float16
from tests.support import photos

RNG = np.random.default_rng


def reference_tile_sums(grid: NDArray[np.float32], tiles: int) -> NDArray[np.float32]:
    """The formulation tile_sums replaces: a contiguous 2-D grid, summed over a middle axis
    (row after row), then along each tile's columns."""
    h, w = grid.shape
    out: NDArray[np.float32] = grid.reshape(tiles, h // tiles, w).sum(axis=1).reshape(
        tiles, tiles, w // tiles).sum(axis=2)
    return out


@pytest.mark.parametrize(("rows", "cols", "stride", "tiles"),
                         [(220, 220, 224, 4), (108, 108, 109, 4), (27, 12, 13, 3), (8, 8, 8, 4)])
def test_tile_sums_add_exactly_as_a_sum_over_the_grid(rows: int, cols: int, stride: int,
                                                      tiles: int) -> None:
    rng = RNG(rows * cols)
    squares = np.square(rng.normal(0.0, 0.1, (3, rows * stride + 5)).astype(np.float32))
    squares[:, rows * stride:] = np.nan  # past the rows read: never summed
    got = tile_sums(squares, stride, rows, cols, tiles)
    assert got.shape == (3, tiles, tiles)
    for k in range(3):
        grid = np.ascontiguousarray(squares[k, :rows * stride].reshape(rows, stride)[:, :cols])
        want = reference_tile_sums(grid, tiles)
        assert np.array_equal(got[k], want), np.max(np.abs(got[k] - want))
    one = tile_sums(squares[1], stride, rows, cols, tiles)
    assert one.shape == (tiles, tiles) and np.array_equal(one, got[1])


def test_tile_sums_never_read_past_the_columns_asked_for() -> None:
    squares = np.ones(12 * 10, np.float32).reshape(12, 10)
    squares[:, 8:] = np.inf  # a row's wrap: the columns past ``cols``
    got = tile_sums(squares.reshape(-1), 10, 12, 8, 4)
    assert np.array_equal(got, np.full((4, 4), 6.0, np.float32))  # 3 rows × 2 columns per tile


def test_float16_widening_matches_astype_bit_for_bit() -> None:
    """Every float16 bit pattern (NaN payloads and signs, ±Inf, subnormals, -0) widens to the
    float32 bit pattern numpy's astype gives it, whatever the array's shape or strides."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    want = every.astype(np.float32).view(np.uint32)
    assert np.array_equal(widen_float16(every).view(np.uint32), want)
    shuffled = every[RNG(0).permutation(every.size)][: 3 * 100 * 100].reshape(3, 100, 100)
    strided = shuffled[:, ::2, ::3]  # not contiguous: copied before the lookup
    assert np.array_equal(widen_float16(strided).view(np.uint32),
                          strided.astype(np.float32).view(np.uint32))
    assert widen_float16(strided).shape == strided.shape


def channel_clipped_by_channel(image: NDArray[Any], spec: ImageSpec) -> float:
    """channel_clipped as first written: one channel at a time, in the input's own values."""
    sub = image[:, ::2, ::2] if spec.layout == "CHW" else image[::2, ::2]
    chans = [sub[c] if spec.layout == "CHW" else sub[..., c] for c in range(3)]
    lows, highs = spec.bounds(3)
    hit = np.zeros(chans[0].shape, np.bool_)
    level = np.zeros(chans[0].shape, np.float32)
    for c, lo, hi in zip(chans, lows.tolist(), highs.tolist(), strict=True):
        hit |= c >= hi - (hi - lo) * (1.5 / 255)
        level += c
    hit &= level >= np.float32(float((lows + 0.75 * (highs - lows)).sum()))
    return np.count_nonzero(hit) / hit.size


def edge_values(shape: tuple[int, ...], seed: int) -> NDArray[np.uint8]:
    """uint8 values crowded at the clipping top (253-255) and around the light level (a sum
    of 573-575 over three channels), with the rest spread."""
    rng = RNG(seed)
    out = rng.integers(0, 256, shape).astype(np.uint8)
    pick = rng.random(shape[:-1])
    out[pick < 0.4] = rng.integers(250, 256, (int(np.count_nonzero(pick < 0.4)), shape[-1]))
    near = (pick >= 0.4) & (pick < 0.7)
    out[near] = rng.integers(189, 194, (int(np.count_nonzero(near)), shape[-1]))
    return out


@pytest.mark.parametrize("spec", [ImageSpec("HWC", (0.0,), (255.0,)),
                                  ImageSpec("HWC", (0.0,), (254.0,)),
                                  ImageSpec("HWC", (12.0,), (250.0,))])
def test_channel_clipped_in_integers_counts_what_the_float_comparisons_count(
        spec: ImageSpec) -> None:
    images = [edge_values((64, 48, 3), s) for s in range(4)]
    images += [p.image for p in photos.clean_set()[:12]]
    images += [np.asarray(np.clip(p.image * 1.7, 0, 255), np.uint8)
               for p in photos.clean_set()[:12]]
    for img in images:
        want = channel_clipped_by_channel(img, spec)
        assert channel_clipped(img, spec) == want
        chw = np.ascontiguousarray(img.transpose(2, 0, 1))
        assert channel_clipped(chw, ImageSpec("CHW", spec.low, spec.high)) == want
    assert any(channel_clipped(img, spec) > 0 for img in images)  # the edges are reached


def test_channel_clipped_on_floats_matches_channel_by_channel_nan_and_inf_included() -> None:
    spec = ImageSpec("HWC", (0.0,), (1.0,))
    rng = RNG(5)
    for p in photos.clean_set()[:10]:
        img = np.clip(p.image / 255.0 * 1.6, 0.0, 1.0).astype(np.float32)
        img[rng.random(img.shape) < 0.02] = np.nan
        img[rng.random(img.shape) < 0.01] = np.inf
        want = channel_clipped_by_channel(img, spec)
        assert channel_clipped(img, spec) == want
        chw = np.ascontiguousarray(img.transpose(2, 0, 1))
        assert channel_clipped(chw, ImageSpec("CHW", (0.0,), (1.0,))) == want
