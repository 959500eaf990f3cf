"""The input's values against what the model expects: how to read an image (``ImageSpec``),
its per-channel extrema, NaN/Inf (``finite``) and the value range (``value_range``); and
float16 values widened to float32 before any signal reads them (``widen_float16``).

Guards against an input the model cannot read as an image at all: FP16 overflow to Inf, NaN from
a broken pre-processor, raw 0-255 sent to a model that reads [0, 1] (or the reverse). Both
signals read the extrema the caller computed once per image, so a clean input costs two
passes (min and max) and nothing else. Its own module so the plane's signals (``signals``)
and these share ``ImageSpec`` without one long file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from numpy.typing import NDArray

from filters.quality import native
from filters.quality.measure import F32, Signal
from filters.quality.measure import ramp as _ramp


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """How to read one image: channel axis and the value range the model expects per channel
    (a mean/std-normalised input has the range ((0 - mean) / std, (1 - mean) / std))."""

    layout: str  # "CHW", "HWC" or "HW"
    low: tuple[float, ...]
    high: tuple[float, ...]

    def bounds(self, channels: int) -> tuple[F32, F32]:
        """Per-channel (low, high) arrays; shared, read-only."""
        return _bounds(self.low, self.high, channels)


@cache
def _bounds(low: tuple[float, ...], high: tuple[float, ...], channels: int) -> tuple[F32, F32]:
    lo = np.resize(np.asarray(low, np.float32), channels)
    hi = np.resize(np.asarray(high, np.float32), channels)
    lo.flags.writeable = hi.flags.writeable = False
    return lo, hi


def channels_of(image: NDArray[Any], layout: str) -> list[NDArray[Any]]:
    """2-D views, one per channel (at most 3: an alpha plane says nothing about quality)."""
    if layout == "HW":
        return [image]
    count = image.shape[0] if layout == "CHW" else image.shape[-1]
    return [image[c] if layout == "CHW" else image[..., c] for c in range(min(count, 3))]


def extrema(image: NDArray[Any], spec: ImageSpec, channels: int) -> tuple[F32, F32]:
    """Per-channel (min, max); NaN or ±Inf when there are any (min/max propagate both).
    With one range for every channel, the whole array's extrema serve each channel: one
    contiguous pass instead of strided ones (3-7x cheaper for HWC)."""
    if image.size == 0:
        zero = np.zeros(channels, np.float32)
        return zero, zero
    if len(set(spec.low)) == 1 and len(set(spec.high)) == 1:
        lo, hi = np.float32(image.min()), np.float32(image.max())
        return np.full(channels, lo, np.float32), np.full(channels, hi, np.float32)
    chans = channels_of(image, spec.layout)
    return (np.array([x.min() for x in chans], np.float32),
            np.array([x.max() for x in chans], np.float32))


_ALL_FINITE = Signal(1.0, 0.0, "NaN/Inf values")


def finite(image: NDArray[Any], mins: F32 | None = None, maxs: F32 | None = None) -> Signal:
    """NaN and ±Inf values: 0 when there is any. Given the extrema, a clean image costs nothing."""
    if image.dtype.kind != "f" or image.size == 0:
        return _ALL_FINITE
    if mins is None or maxs is None:
        mins, maxs = np.array([image.min()]), np.array([image.max()])
    if np.isfinite(mins).all() and np.isfinite(maxs).all():
        return _ALL_FINITE
    bad = int(image.size - np.count_nonzero(np.isfinite(image)))
    return Signal(0.0, float(bad), "NaN/Inf values")


def value_range(image: NDArray[Any], spec: ImageSpec, mins: F32 | None = None,
                maxs: F32 | None = None) -> Signal:
    """Values against the range the model expects. Two failures: values far outside it (raw
    0-255 sent to a model that reads [0, 1] or mean/std-normalised input), and a tiny share of
    it used ([0, 1] values sent to a model that reads 0-255). NaN/Inf are the 'finite'
    signal's business and are left out here."""
    chans = channels_of(image, spec.layout)
    lo, hi = spec.bounds(len(chans))
    if mins is None or maxs is None:
        mins, maxs = extrema(image, spec, len(chans))
    low, high = mins.tolist(), maxs.tolist()
    if not all(map(math.isfinite, low + high)):
        chans = [x[np.isfinite(x)] for x in chans]
        mins = np.array([x.min() if x.size else 0 for x in chans], np.float32)
        maxs = np.array([x.max() if x.size else 0 for x in chans], np.float32)
        low, high = mins.tolist(), maxs.tolist()
    span, tol, floor, ceiling, where = _limits(spec.low, spec.high, len(chans))
    if all(map(float.__ge__, low, floor)) and all(map(float.__le__, high, ceiling)):
        return _spanned(float(np.max((maxs - mins) / span)), where)
    out = 0
    count = 0
    for x, low, high, t in zip(chans, lo, hi, tol, strict=True):
        sub = x[::2, ::2] if x.ndim == 2 else x[::4]  # a quarter orders images the same way
        out += int(np.count_nonzero((sub < low - t) | (sub > high + t)))
        count += sub.size
    share = out / max(count, 1)
    return Signal(_ramp(share, 0.05, 0.0), share, f"share of values outside {where}")


def shared_extrema_signals(image: NDArray[Any], spec: ImageSpec, channels: int, low: float,
                           high: float) -> tuple[Signal, Signal]:
    """``finite`` and ``value_range`` of an image whose extrema over every channel are ``low``
    and ``high`` (one pass read them all: ``luma.image_pass``), as those functions give them.
    A finite image within its range's tolerance, nearly every input, costs a few float
    comparisons instead of the per-channel arrays (~30 µs with the caches cold); any other is
    handed to them."""
    span, _, floor, ceiling, where = _limits(spec.low, spec.high, channels)
    if not (low >= max(floor) and high <= min(ceiling)):  # NaN and ±Inf compare False
        mins = np.full(channels, low, np.float32)
        maxs = np.full(channels, high, np.float32)
        return finite(image, mins, maxs), value_range(image, spec, mins, maxs)
    spread = np.float32(high) - np.float32(low)  # float32, as value_range's arrays subtract
    return _ALL_FINITE, _spanned(max(float(spread / s) for s in span), where)


def _spanned(used: float, where: str) -> Signal:
    """value_range's signal for values within the range: the share of it they span (a tiny
    share: [0, 1] values sent to a model that reads 0-255)."""
    if used == 0.0:  # a constant image: the 'constant' signal speaks for it
        return Signal(1.0, 0.0, f"of the expected range {where} spanned")
    return Signal(_ramp(used, 0.0, 0.02), used, f"of the expected range {where} spanned")


@cache
def _limits(low: tuple[float, ...], high: tuple[float, ...], channels: int
            ) -> tuple[F32, F32, list[float], list[float], str]:
    """value_range's per-channel span, tolerance (resampling overshoot, bicubic rings, is not an
    encoding error), lowest and highest value accepted (float32, as Python floats), and its
    message's range."""
    lo, hi = _bounds(low, high, channels)
    span = hi - lo
    tol = np.float32(0.02) * span
    where = f"[{fmt_value(float(lo.min()))}, {fmt_value(float(hi.max()))}]"
    return span, tol, (lo - tol).tolist(), (hi + tol).tolist(), where


def fmt_value(x: float) -> str:
    """A measurement for a message: integers as integers, the rest to 4 significant digits."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e12 else f"{x:.4g}"


@cache
def _float16_table() -> F32:
    """Every float16 bit pattern's float32 value (256 KiB, built once)."""
    table: F32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(
        np.float16).astype(np.float32)
    table.flags.writeable = False
    return table


def widen_float16(image: NDArray[np.float16]) -> F32:
    """float16 → float32, exactly as ``astype`` (NaN, ±Inf and subnormals included), by a
    table lookup of the bit patterns: numpy 1.26 converts float16 one element at a time, and
    a take from a 65,536-entry table is about 3x cheaper. ``mode="wrap"``: a uint16 index is
    always within the table, so nothing wraps, and the take skips the per-element bounds check
    and error path of the default mode (1.6x cheaper again)."""
    if not image.dtype.isnative:  # a byte-swapped array: its bits are not float16's
        swapped: F32 = image.astype(np.float32)
        return swapped
    kernels = native.kernels
    if kernels is not None:  # the same bits by arithmetic, vectorised (~4x cheaper again)
        src = np.ascontiguousarray(image)
        widened: F32 = np.empty(src.shape, np.float32)
        kernels.widen_float16(src, src.size, widened)
        return widened
    out: F32 = np.take(_float16_table(), np.ascontiguousarray(image).view(np.uint16),
                       mode="wrap")
    return out
