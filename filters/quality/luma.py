"""The luminance plane every image signal reads, and the one pass over the input that makes it.

An image (CHW, HWC or HW, any float or integer dtype) becomes a float32 plane in [0, 1] at the
scale a vision encoder sees: block-mean down-sampled to ~``REF_SIDE`` on the short side, its
channels mixed by ITU-R BT.601's weights. For the inputs most models take (three channels, one
range for all, FP32 planes or UINT8 pixels, no down-sampling), ``image_pass`` reads the input
once, in C (``_pass.c``), for everything the signals read off the input itself: the plane, the
extrema (``finite``, ``range``), channel_clipped's count and the plane's levels (``exposure``,
``tone``), where four calls used to read it (measured: ~6 µs less per 224² FP32 image warm,
~11 µs with the caches cold; the passes were memory-bound alike, the calls around them were
not).

What MUST hold: ``image_pass``'s results are the separate functions' exactly (``luminance``,
``values.extrema``, ``signals.channel_clipped``, ``measure.levels``): the same float32
arithmetic per pixel, the same blocks summed in the same order
(``tests/unit/test_quality_kernels.py``). Every other input takes the numpy code, the reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from numpy.typing import NDArray

from filters.quality import native
from filters.quality.measure import (
    BLOWN,
    CLIPPED,
    F32,
    MID_HIGH,
    MID_LOW,
    NEAR_WHITE,
    Levels,
    levels_from_counts,
)
from filters.quality.values import ImageSpec, _bounds, channels_of

REF_SIDE = 224  # the short side a vision encoder reads; planes are measured at this scale
LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601
CLIPPED_LEVEL = 0.75  # mean of the channels, of the range; see signals.channel_clipped()


def block_mean(image: NDArray[Any], layout: str) -> NDArray[Any]:
    """Block-mean down-sampling so the short side is ~REF_SIDE, done before the luminance mix
    (both are linear, so the order does not matter) so a large photo is never copied whole
    into float32."""
    hw = image.shape[1:3] if layout == "CHW" else image.shape[:2]
    k = min(hw) // REF_SIDE if image.size else 0
    if k < 2:
        return image
    h, w = (hw[0] // k) * k, (hw[1] // k) * k
    inv = np.float32(1.0 / (k * k))
    kernels = native.kernels
    if (kernels is not None and image.ndim == 3 and image.flags.c_contiguous
            and image.dtype in (np.uint8, np.float32)
            and (k < 8 or (layout == "HWC" and image.shape[2] > 1))):
        # The same sums in C, one read of the image (13 -> ~1 ms for 1920 x 1080 x 3 uint8)
        hwc = layout == "HWC"
        c = image.shape[2] if hwc else image.shape[0]
        shape = (h // k, w // k, c) if hwc else (c, h // k, w // k)
        out_c: F32 = np.empty(shape, np.float32)
        kernels.block_mean(image, hwc, hw[0], hw[1], c, k, float(inv), out_c)
        return out_c
    # Rows first, then columns: two single-axis sums are ~7x faster than one over (k, k) blocks.
    if layout == "CHW":
        rows = image[:, :h, :w].reshape(image.shape[0], h // k, k, w).sum(axis=2,
                                                                            dtype=np.float32)
        out = rows.reshape(image.shape[0], h // k, w // k, k).sum(axis=3)
    else:
        rows = image[:h, :w].reshape(h // k, k, w, *image.shape[2:]).sum(axis=1,
                                                                          dtype=np.float32)
        out = rows.reshape(h // k, w // k, k, *image.shape[2:]).sum(axis=2)
    mean: F32 = np.multiply(out, inv, dtype=np.float32)
    return mean


@cache
def luma_gain(low: tuple[float, ...], high: tuple[float, ...], channels: int
               ) -> tuple[F32, np.float32]:
    """Per-channel weights that mix the channels into a luminance in [0, 1], and the offset
    to take off; shared, read-only."""
    lo, hi = _bounds(low, high, channels)
    weights = np.asarray(LUMA if channels == 3 else (1.0,) * channels, np.float32)
    gain: F32 = weights / weights.sum() / (hi - lo)
    gain.flags.writeable = False
    return gain, np.float32(np.sum(gain * lo))


@cache
def clip_levels(low: tuple[float, ...], high: tuple[float, ...], channels: int
                 ) -> tuple[tuple[float, ...], np.float32]:
    """channel_clipped's per-channel top (within 1.5/255 of the range's top) and the channels'
    sum from which a pixel is light; per spec, computed once."""
    lows, highs = _bounds(low, high, channels)
    tops = tuple(hi - (hi - lo) * (1.5 / 255) for lo, hi in zip(lows.tolist(), highs.tolist(),
                                                                strict=True))
    return tops, np.float32(float((lows + CLIPPED_LEVEL * (highs - lows)).sum()))


@cache
def first_at_least(top: float) -> int:
    """The lowest uint8 value that compares ``>= top`` as numpy compares a uint8 array with
    this float (256 when none does)."""
    return int(np.argmax(np.append(np.arange(256, dtype=np.uint8) >= top, True)))


def inside_range(spec: ImageSpec, channels: int, mins: Sequence[float],
                 maxs: Sequence[float]) -> bool:
    """Whether every channel's values (their extrema, per channel) are finite and within the
    range the model expects."""
    lo, hi = (x.tolist() for x in spec.bounds(channels))  # NaN compares False below
    return all(a >= b for a, b in zip(mins, lo, strict=True)) and all(
        a <= b for a, b in zip(maxs, hi, strict=True))


def luminance(image: NDArray[Any], spec: ImageSpec, inside: bool = False) -> F32:
    """Luminance in [0, 1] (NaN read as 0, Inf clipped) at ~REF_SIDE on the short side.
    ``inside``: every value is known finite and in range, so the plane is in [0, 1] but for
    its sum's rounding (an ulp or two): not scanned for NaN nor clipped."""
    image = block_mean(image, spec.layout)
    chans = channels_of(image, spec.layout)
    gain, offset = luma_gain(spec.low, spec.high, len(chans))
    # Never ``image @ gain`` for HWC: that is OpenBLAS's sgemv, whose sums round differently by
    # CPU (seen on AVX-512). The C pass or the multiply-adds below sum as the fused pass does,
    # bit for bit, on every machine.
    kernels = native.kernels
    if (spec.layout == "HWC" and kernels is not None and image.dtype == np.float32
            and image.ndim == 3 and len(chans) == 3 and image.flags.c_contiguous):
        plane = np.empty(image.shape[:2], np.float32)
        kernels.mix(image, plane.size, image.shape[2], *gain.tolist(), float(offset), plane)
        return clipped_to_range(plane, inside)
    if spec.layout == "CHW" and image.dtype == np.float32 and image.ndim == 3:
        # One pass over the channels (measured 2.4x cheaper than a multiply-add per channel;
        # the same sum in the same order). Not a BLAS product: OpenBLAS spreads a matrix-vector
        # product this size over its threads, whose spinning cost 2.5x the CPU it saved.
        plane = np.einsum("c,chw->hw", gain, image[: len(chans)])
    else:
        plane = np.multiply(chans[0], gain[0], dtype=np.float32)
        for c in range(1, len(chans)):
            plane += np.multiply(chans[c], gain[c], dtype=np.float32)
    if offset:
        plane -= offset
    return clipped_to_range(plane, inside)


def clipped_to_range(plane: F32, inside: bool) -> F32:
    """The plane with NaN read as 0 and values clipped to [0, 1], unless ``inside``."""
    if plane.size and not inside:
        low, high = float(plane.min()), float(plane.max())
        if not (math.isfinite(low) and math.isfinite(high)):
            plane = np.nan_to_num(plane, nan=0.0, posinf=1.0, neginf=0.0)
            low, high = float(plane.min()), float(plane.max())  # NaN compared as in range
        if low < 0.0 or high > 1.0:
            np.minimum(plane, 1.0, out=plane)
            np.maximum(plane, 0.0, out=plane)
    return plane


@dataclass(frozen=True, slots=True)
class Pass:
    """What ``image_pass`` read off one image."""

    low: float  # the smallest value of every channel (NaN when any value is NaN or ±Inf)
    high: float  # the largest (NaN likewise)
    plane: F32  # the luminance, not yet clipped to [0, 1]
    clipped: float  # signals.channel_clipped's share
    levels: Levels  # measure.levels of ``plane`` as it is (valid once it needs no clipping)


def image_pass(image: NDArray[Any], spec: ImageSpec) -> Pass | None:
    """The input's one pass in C, for three channels, one range for all, FP32 planes (CHW) or
    UINT8 pixels (HWC), at a size read without down-sampling; None for every other input (and
    where the C module is not built): numpy's functions read those."""
    kernels = native.kernels
    if kernels is None or image.ndim != 3 or not image.flags.c_contiguous:
        return None
    if len(set(spec.low)) != 1 or len(set(spec.high)) != 1:
        return None
    if spec.layout == "CHW" and image.dtype == np.float32 and image.shape[0] == 3:
        (h, w), planar = image.shape[1:], True
    elif spec.layout == "HWC" and image.dtype == np.uint8 and image.shape[2] == 3:
        (h, w), planar = image.shape[:2], False
    else:
        return None
    if min(h, w) // REF_SIDE >= 2 or h == 0 or w == 0:  # block-mean down-sampled first
        return None
    gain, offset = luma_gain(spec.low, spec.high, 3)
    tops, light = clip_levels(spec.low, spec.high, 3)
    # channel_clipped's thresholds, as its C count takes them (integers for uint8 pixels)
    top, ceiling = ((tops[0], float(light)) if planar
                    else (first_at_least(tops[0]), math.ceil(float(light))))
    plane = np.empty((h, w), np.float32)
    low, high, hits, looked, total, ink, over, white, clip, blown = kernels.image_pass(
        image, h, w, planar, *gain.tolist(), offset, plane, top, ceiling, MID_LOW, MID_HIGH,
        NEAR_WHITE, CLIPPED, BLOWN)
    return Pass(low, high, plane, hits / looked,
                levels_from_counts(total, ink, over, white, clip, blown, h * w))

