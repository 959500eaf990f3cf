"""Input quality signals: cheap, reference-free measurements of one image or one text.

Guards against a model answering confidently on garbage: the seeds' edge inputs (low-light frames,
Gaussian σ = 0.08 noise at PSNR 22 dB, blur from an 8.7× resolution collapse, OCR residue, garbled
or mixed-script text, FP16 NaN/Inf) all show up here before the model sees them.

Every signal is a ``Signal``: a ``score`` in [0, 1] (1 = good, the unit rules and drift work in)
and the raw ``value`` it came from (for messages). Functions are pure numpy, vectorised, with no
state and no I/O, so the filter can run them in a worker thread and the benchmark can time each.

Image signals work on a luminance plane in [0, 1] at the scale a vision encoder sees (block-mean
down-sampled to ~224 px on the short side), so sharpness and noise mean the same for a 224 px
tensor and a 2048 px photo. Text signals classify code points through a table built once for the
Basic Multilingual Plane, so a 1 KB text costs a handful of numpy calls, not a Python loop per
character.

Rules that MUST hold: scores are finite and in [0, 1]; a degraded version of an image (blurred,
darkened, over-exposed, noised, NaN) never scores higher on the signal that measures that
degradation than the clean image does.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from numpy.typing import NDArray

IMAGE_SIGNALS = ("finite", "range", "constant", "sharpness", "exposure", "noise")
TEXT_SIGNALS = ("empty", "length", "control", "replacement", "symbols", "repetition", "script")
REF_SIDE = 224  # the short side a vision encoder reads; planes are measured at this scale
_LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601
SHARPNESS_BLURRED, SHARPNESS_SHARP = 0.3, 1.1  # second/first difference energy; sharpness()
EXPOSURE_DARK, EXPOSURE_LIT = 0.03, 0.2  # mean luminance
HIGHLIGHTS_DIM, HIGHLIGHTS_LIT = 0.35, 0.6  # 99th-percentile luminance; see exposure()
EXPOSURE_BLOWN, EXPOSURE_BRIGHT = 0.25, 0.05  # weighted blown-white share; see exposure()
_MID_LOW, _MID_HIGH = np.float32(0.25), np.float32(0.75)  # the mid-tones' luminance
NOISE_BAD, NOISE_GOOD = 0.06, 0.02  # noise σ of the smoothest blocks; see noise()
_NOISE_BLOCK = 8
_NOISE_P25_GAIN = 1.135  # the 25th percentile of block means under pure noise, over their mean
_BLOWN = np.float32(250 / 255)  # a pixel at or above it is blown white

F32 = NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class Signal:
    score: float  # in [0, 1]; 1 = nothing wrong
    value: float  # the raw measurement the score was mapped from
    what: str  # how to read the value in a message, e.g. "NaN/Inf values"


def _ramp(x: float, bad: float, good: float) -> float:
    """0 at ``bad``, 1 at ``good``, linear between (either direction), clipped."""
    t = (x - bad) / (good - bad)
    return 0.0 if t <= 0.0 else 1.0 if t >= 1.0 else float(t)


# --- images -------------------------------------------------------------------------------------


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


def finite(image: NDArray[Any], mins: F32 | None = None, maxs: F32 | None = None) -> Signal:
    """NaN and ±Inf values: 0 when there is any. Given the extrema, a clean image costs nothing."""
    if image.dtype.kind != "f" or image.size == 0:
        return Signal(1.0, 0.0, "NaN/Inf values")
    if mins is None or maxs is None:
        mins, maxs = np.array([image.min()]), np.array([image.max()])
    if np.isfinite(mins).all() and np.isfinite(maxs).all():
        return Signal(1.0, 0.0, "NaN/Inf values")
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
    if not (np.isfinite(mins).all() and np.isfinite(maxs).all()):
        chans = [x[np.isfinite(x)] for x in chans]
        mins = np.array([x.min() if x.size else 0 for x in chans], np.float32)
        maxs = np.array([x.max() if x.size else 0 for x in chans], np.float32)
    span = hi - lo
    tol = 0.02 * span  # resampling overshoot (bicubic rings) is not an encoding error
    where = f"[{fmt_value(float(lo.min()))}, {fmt_value(float(hi.max()))}]"
    if np.all(mins >= lo - tol) and np.all(maxs <= hi + tol):
        used = float(np.max((maxs - mins) / span))
        if used == 0.0:  # a constant image: the 'constant' signal speaks for it
            return Signal(1.0, 0.0, f"of the expected range {where} spanned")
        return Signal(_ramp(used, 0.0, 0.02), used, f"of the expected range {where} spanned")
    out = 0
    count = 0
    for x, low, high, t in zip(chans, lo, hi, tol, strict=True):
        sub = x[::2, ::2] if x.ndim == 2 else x[::4]  # a quarter orders images the same way
        out += int(np.count_nonzero((sub < low - t) | (sub > high + t)))
        count += sub.size
    share = out / max(count, 1)
    return Signal(_ramp(share, 0.05, 0.0), share, f"share of values outside {where}")


def _block_mean(image: NDArray[Any], layout: str) -> NDArray[Any]:
    """Block-mean down-sampling so the short side is ~REF_SIDE, done before the luminance mix
    (both are linear, so the order does not matter) so a large photo is never copied whole
    into float32."""
    hw = image.shape[1:3] if layout == "CHW" else image.shape[:2]
    k = min(hw) // REF_SIDE if image.size else 0
    if k < 2:
        return image
    h, w = (hw[0] // k) * k, (hw[1] // k) * k
    # Rows first, then columns: two single-axis sums are ~7x faster than one over (k, k) blocks.
    if layout == "CHW":
        rows = image[:, :h, :w].reshape(image.shape[0], h // k, k, w).sum(axis=2,
                                                                            dtype=np.float32)
        out = rows.reshape(image.shape[0], h // k, w // k, k).sum(axis=3)
    else:
        rows = image[:h, :w].reshape(h // k, k, w, *image.shape[2:]).sum(axis=1,
                                                                          dtype=np.float32)
        out = rows.reshape(h // k, w // k, k, *image.shape[2:]).sum(axis=2)
    mean: F32 = np.multiply(out, np.float32(1.0 / (k * k)), dtype=np.float32)
    return mean


def luminance(image: NDArray[Any], spec: ImageSpec) -> F32:
    """Luminance in [0, 1] (NaN read as 0, Inf clipped) at ~REF_SIDE on the short side."""
    image = _block_mean(image, spec.layout)
    chans = channels_of(image, spec.layout)
    lo, hi = spec.bounds(len(chans))
    weights = np.asarray(_LUMA if len(chans) == 3 else (1.0,) * len(chans), np.float32)
    gain = weights / weights.sum() / (hi - lo)
    if spec.layout == "HWC":
        plane = np.asarray(image[..., : len(chans)] @ gain, np.float32)
    else:
        plane = np.multiply(chans[0], gain[0], dtype=np.float32)
        for c in range(1, len(chans)):
            plane += np.multiply(chans[c], gain[c], dtype=np.float32)
    offset = np.float32(np.sum(gain * lo))
    if offset:
        plane -= offset
    if plane.size:
        low, high = float(plane.min()), float(plane.max())
        if not (math.isfinite(low) and math.isfinite(high)):
            plane = np.nan_to_num(plane, nan=0.0, posinf=1.0, neginf=0.0)
            low, high = float(plane.min()), float(plane.max())  # NaN compared as in range
        if low < 0.0 or high > 1.0:
            np.minimum(plane, 1.0, out=plane)
            np.maximum(plane, 0.0, out=plane)
    return plane


def second_differences(plane: F32) -> tuple[F32, F32]:
    """(along rows, along columns): [1,-2,1] across x (H × W-2) and across y (H-2 × W). Both
    the Laplacian (sharpness) and Immerkær's mask (noise) are made of these."""
    rows = plane[:, :-2] + plane[:, 2:]
    centre = plane[:, 1:-1]
    rows -= centre  # twice, in place: no temporary for 2 * centre
    rows -= centre
    cols = plane[:-2] + plane[2:]
    middle = plane[1:-1]
    cols -= middle
    cols -= middle
    return rows, cols


def _mean_var(x: F32) -> tuple[float, float]:
    """Mean and variance through a BLAS dot of the centred values: several times cheaper than
    ``x.var()``, and centring keeps float32 accumulation exact enough for a flat image."""
    flat = x.reshape(-1)
    n = flat.size
    mean = float(flat.sum(dtype=np.float64)) / n
    centred = flat - np.float32(mean)
    return mean, float(np.dot(centred, centred)) / n


def constant(plane: F32) -> Signal:
    std = math.sqrt(_mean_var(plane)[1]) if plane.size else 0.0
    return Signal(_ramp(std, 0.0, 0.02), std, "luminance standard deviation")


def _energy(x: F32) -> float:
    flat = x.reshape(-1)
    return float(np.dot(flat, flat)) / max(flat.size, 1)


def sharpness(plane: F32, diffs: tuple[F32, F32] | None = None) -> Signal:
    """How thin the edges are: per axis, the energy of the second difference over the energy
    of the first difference of the luminance (at REF_SIDE scale), and the lower of the two
    axes. A gain or an offset of the luminance scales both energies alike, so a dark or
    low-contrast but sharp photo keeps its score (an absolute Laplacian variance, the usual
    measure, shrinks with brightness and reads a dark photo as blurred). Blur, defocus and
    up-sampling widen edges along both axes, camera shake along one (hence the lower axis).
    The ratio of the softest clean photograph in the evaluation set (0.8) scores 1; 0.4 (a
    2 px defocus reads ~0.5) scores 0.

    Known confusions: noise raises the ratio (a blurred, noisy image can read sharp); images
    soft by nature (microscopy, a small image up-scaled by the client, soft rendered text)
    read blurred; a flat image has no edges to measure (it scores 0: the 'constant' signal
    speaks for it)."""
    if min(plane.shape) < 3:
        return Signal(0.0, 0.0, "second/first difference energy (image too small)")
    rows, cols = diffs or second_differences(plane)
    gx = _energy(plane[:, 1:] - plane[:, :-1])
    gy = _energy(plane[1:] - plane[:-1])
    if min(gx, gy) <= 1e-12:
        return Signal(0.0, 0.0, "second/first difference energy (no edges)")
    ratio = min(_energy(rows) / gx, _energy(cols) / gy)
    return Signal(_ramp(ratio, SHARPNESS_BLURRED, SHARPNESS_SHARP), ratio,
                  "second/first difference energy, lower axis")


def noise(plane: F32, diffs: tuple[F32, F32] | None = None) -> Signal:
    """The noise σ of the smoothest quarter of the image. Immerkær's mask
    M = [1,-2,1]ᵀ[1,-2,1] (1996) cancels ramps and axis-aligned edges; its mean |response| is
    taken per 8×8 block and the 25th percentile of the blocks is read as σ = √(π/2) · x / 6
    (scaled so pure Gaussian noise reads its own σ). Texture (grass, gravel) and edges raise
    some blocks, not the smooth ones, so a textured photo is not read as noisy; noise raises
    every block. σ ≤ 0.02 scores 1, σ ≥ 0.06 scores 0 (the seeds' low-light noise is 0.08).

    Known confusions: an image textured everywhere (gravel, foliage filling the frame) reads
    noisier than it is; JPEG block artefacts add a little; noise in clipped black or white areas
    is cut in half, so dark, noisy frames read a little cleaner than they are."""
    if min(plane.shape) < 3 + _NOISE_BLOCK:
        return Signal(1.0, 0.0, "noise sigma (image too small)")
    rows = (diffs or second_differences(plane))[0]
    m = rows[:-2] + rows[2:]
    m -= rows[1:-1]
    m -= rows[1:-1]
    np.abs(m, out=m)
    b = _NOISE_BLOCK
    h, w = (m.shape[0] // b) * b, (m.shape[1] // b) * b
    blocks = m[:h, :w].reshape(h // b, b, w).sum(axis=1).reshape(h // b, w // b, b).sum(axis=2)
    flat = blocks.reshape(-1)
    k = flat.size // 4
    low = float(np.partition(flat, k)[k]) / (b * b)
    sigma = math.sqrt(math.pi / 2.0) * low / 6.0 * _NOISE_P25_GAIN
    return Signal(_ramp(sigma, NOISE_BAD, NOISE_GOOD), sigma, "noise sigma")


def exposure(plane: F32) -> Signal:
    """Whether the scene got the right amount of light, from the luminance histogram.

    Under-exposure: the mean luminance (0.03 scores 0, 0.2 scores 1; the darkest clean
    photograph of the evaluation set has 0.21), forgiven when the brightest 1 % of the image is
    bright (99th percentile ≥ 0.6): a dark scene with bright highlights (a night sky, a lamp)
    was lit enough for what is in it, while cutting the light dims the highlights too.
    Over-exposure: the share of blown-white pixels, counted in proportion to the share of
    mid-tones (0.25-0.75) or to the lack of dark pixels (under 0.25): a white page is paper
    white plus dark ink, few mid-tones, so its white does not count; an over-exposed photo
    keeps mid-tones or has lost its darks. A weighted share of 25 % scores 0, 5 % scores 1.

    Known confusions: a dark tone curve (gamma) that keeps the highlights reads as a dark
    scene, not as low light; a scene dark by nature without highlights (a dim microscope
    slide) reads under-exposed; a white screenshot full of mid-grey widgets or photos reads
    over-exposed; a photo blown so far that only white and deep shadows are left reads as a
    white page."""
    if plane.size == 0:
        return Signal(0.0, 0.0, "mean luminance (empty image)")
    flat = plane.reshape(-1)
    n = flat.size
    mean = float(flat.sum(dtype=np.float64)) / n
    # Counts by comparison, not a histogram: np.bincount widens uint8 to int64 (~0.3 ms).
    blown = np.count_nonzero(flat >= _BLOWN) / n
    ink = np.count_nonzero(flat < _MID_LOW) / n
    mid = 1.0 - ink - np.count_nonzero(flat > _MID_HIGH) / n
    # The 99th percentile of a 1/16 subsample: a few thousand values, exact enough for a ramp.
    sub = plane[::4, ::4].reshape(-1)
    k = int(0.99 * (sub.size - 1))
    p99 = float(np.partition(sub, k)[k])
    # A page needs ink: white with neither mid-tones nor dark strokes is blown, not paper.
    weighted = blown * max(_ramp(mid, 0.15, 0.35), _ramp(ink, 0.03, 0.005))
    # A dark scene with bright highlights (a night sky, a lamp) was lit enough for what is in
    # it; cutting the light dims the highlights too.
    under = max(_ramp(mean, EXPOSURE_DARK, EXPOSURE_LIT),
                _ramp(p99, HIGHLIGHTS_DIM, HIGHLIGHTS_LIT))
    over = _ramp(weighted, EXPOSURE_BLOWN, EXPOSURE_BRIGHT)
    if under <= over:
        return Signal(under, mean, f"mean luminance (99th percentile {p99:.3f})")
    return Signal(over, weighted, f"share of blown-white pixels weighted by mid-tones and missing"
                  f" darks ({blown:.0%} blown, {mid:.0%} mid-tones, {ink:.0%} dark)")


def image_signals(image: NDArray[Any], spec: ImageSpec) -> dict[str, Signal]:
    """Every image signal of one image (CHW, HWC or HW, any float or integer dtype)."""
    if image.dtype == np.float16:  # numpy keeps float16 math in float16; measure in float32
        image = image.astype(np.float32)
    with np.errstate(all="ignore"):  # NaN/Inf are measured, not warned about
        channels = 1 if spec.layout == "HW" else min(
            image.shape[0] if spec.layout == "CHW" else image.shape[-1], 3)
        mins, maxs = extrema(image, spec, channels)
        plane = luminance(image, spec)
        diffs = second_differences(plane) if min(plane.shape, default=0) >= 3 else None
        return {"finite": finite(image, mins, maxs),
                "range": value_range(image, spec, mins, maxs),
                "constant": constant(plane), "sharpness": sharpness(plane, diffs),
                "exposure": exposure(plane), "noise": noise(plane, diffs)}


# --- text ---------------------------------------------------------------------------------------

# Character classes, one byte per BMP code point.
OTHER, LETTER, DIGIT, SPACE, CONTROL, REPLACEMENT = range(6)
_SPACES = "\t\n\r\x0b\x0c"
_JOINERS = "\u200c\u200d"  # ZWNJ/ZWJ are legitimate in Indic scripts and emoji sequences
_CJK = ("CJK", "HIRAGANA", "KATAKANA", "HANGUL", "BOPOMOFO", "IDEOGRAPHIC", "HALFWIDTH", "YI")
CJK_SCRIPT = 1  # script id of the CJK group: mixing it with Latin inside a token is normal
_NEUTRAL = frozenset(("MICRO", "FEMININE", "MASCULINE", "MODIFIER", "SCRIPT", "BLACK-LETTER",
                      "DOUBLE-STRUCK", "PLANCK", "TURNED", "INFORMATION", "ROMAN", "SMALL"))


def _char_class(ch: str) -> int:
    if ch == "\ufffd":
        return REPLACEMENT
    if ch in _SPACES:
        return SPACE
    cat = unicodedata.category(ch)
    if cat[0] in "LM":
        return LETTER
    if cat[0] == "N":
        return DIGIT
    if cat[0] == "Z":
        return SPACE
    if cat in ("Cc", "Cs", "Co", "Cn") or (cat == "Cf" and ch not in _JOINERS):
        return CONTROL
    return OTHER


def _script_name(ch: str) -> str:
    """The script of a letter from its Unicode name ("" for letter-like symbols: µ, ª, K)."""
    name = unicodedata.name(ch, "")
    if any(name.startswith(p) for p in _CJK):
        return "CJK"
    if "LATIN" in name:
        return "LATIN"
    first = name.split(" ", 1)[0]
    return "" if not first or first in _NEUTRAL or " SIGN" in name else first


@cache
def char_tables() -> tuple[NDArray[np.uint8], NDArray[np.uint8]]:
    """(class, script id) for every BMP code point; built once (~0.1 s), then shared.
    Script ids: 0 = not a letter, 1 = CJK, then one per script in code point order."""
    classes = np.zeros(0x10000, np.uint8)
    scripts = np.zeros(0x10000, np.uint8)
    ids: dict[str, int] = {"CJK": CJK_SCRIPT}
    for cp in range(0x10000):
        ch = chr(cp)
        cls = classes[cp] = _char_class(ch)
        name = _script_name(ch) if cls == LETTER and unicodedata.category(ch)[0] == "L" else ""
        if name:
            scripts[cp] = ids.setdefault(name, min(len(ids) + 1, 253))
    return classes, scripts


def _classify(text: str) -> tuple[NDArray[np.uint8], NDArray[np.uint8]]:
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    table_cls, table_script = char_tables()
    bmp = np.minimum(codes, 0xFFFF)
    cls, script = table_cls[bmp], table_script[bmp]
    astral = np.flatnonzero(codes > 0xFFFF)
    if astral.size:  # emoji and rare scripts: a few per text, classified one by one
        cls = cls.copy()
        script = script.copy()
        for i in astral:
            ch = chr(int(codes[i]))
            cls[i] = _char_class(ch)
            script[i] = 0 if cls[i] != LETTER else 254  # an astral letter: its own script
    return cls, script


def text_signals(text: str, min_chars: int = 1, max_chars: int = 20000) -> dict[str, Signal]:
    """Every text signal of one text. Invalid UTF-8 bytes decoded with ``surrogateescape`` count
    as control characters (they are lone surrogates, class CONTROL)."""
    cls, script = _classify(text)
    counts = np.bincount(cls, minlength=6)
    n = len(text)
    visible = n - int(counts[SPACE])
    share = 1.0 / max(n, 1)
    symbols = int(counts[OTHER]) / max(visible, 1)
    if n < min_chars:
        length = Signal(n / max(min_chars, 1), float(n), f"characters (minimum {min_chars})")
    else:
        length = Signal(min(1.0, max_chars / max(n, 1)), float(n),
                        f"characters (maximum {max_chars})")
    reps = repeated_run(text)
    mixed = mixed_script_share(cls, script)
    return {
        "empty": Signal(1.0 if visible else 0.0, float(visible), "visible characters"),
        "length": length,
        "control": Signal(_ramp(counts[CONTROL] * share, 0.02, 0.0), float(counts[CONTROL]),
                          "control or invalid characters"),
        "replacement": Signal(_ramp(counts[REPLACEMENT] * share, 0.02, 0.0),
                              float(counts[REPLACEMENT]), "U+FFFD replacement characters"),
        "symbols": Signal(_ramp(symbols, 0.5, 0.2), symbols,
                          "share of visible characters that are neither letters nor digits"),
        "repetition": Signal(_ramp(reps, 10.0, 3.0), reps, "repeats of one token sequence"),
        "script": Signal(_ramp(mixed, 0.2, 0.0), mixed, "share of words mixing scripts"),
    }


def repeated_run(text: str, max_period: int = 3) -> float:
    """The most consecutive repeats of one whitespace token or token sequence of up to
    ``max_period`` tokens ("the the the", "ok go ok go ok go"): 1 when nothing repeats."""
    words = text.split()
    if len(words) < 2:
        return 1.0
    index: dict[str, int] = {}
    ids = np.fromiter((index.setdefault(w, len(index)) for w in words), np.int64, len(words))
    best = 1.0
    for p in range(1, min(max_period, len(ids) - 1) + 1):
        same = np.concatenate(([False], ids[p:] == ids[:-p], [False]))
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        if edges.size:
            run = int(np.max(edges[1::2] - edges[::2]))
            best = max(best, run / p + 1.0)
    return best


def mixed_script_share(cls: NDArray[np.uint8], script: NDArray[np.uint8]) -> float:
    """Share of words (whitespace-separated, with letters) whose letters come from two or more
    scripts, the CJK group aside: "pаypal" with a Cyrillic 'а' mixes; "Tシャツ" does not count."""
    word = np.cumsum(cls == SPACE)
    keep = (script > 0) & (script != CJK_SCRIPT)
    if not keep.any():
        return 0.0
    w, s = word[keep], script[keep]
    starts = np.flatnonzero(np.concatenate(([True], w[1:] != w[:-1])))
    lo = np.minimum.reduceat(s, starts)
    hi = np.maximum.reduceat(s, starts)
    return float(np.count_nonzero(lo != hi)) / starts.size


# --- scores -------------------------------------------------------------------------------------


def modality_score(signals: Mapping[str, Signal]) -> tuple[float, str]:
    """The weakest signal: one broken property makes an input unusable, however good the rest.
    Returns (score, the signal that set it)."""
    name = min(signals, key=lambda k: signals[k].score)
    return signals[name].score, name


def trust_score(parts: Mapping[str, float | None], weights: Mapping[str, float]) -> float | None:
    """Weighted mean of the parts present (visual, text, alignment), weights renormalised over
    them; None when no weighted part is present."""
    total = 0.0
    acc = 0.0
    for part, value in parts.items():
        w = weights.get(part, 0.0)
        if value is not None and w > 0:
            total += w
            acc += w * value
    return None if total == 0 else acc / total


def fmt_value(x: float) -> str:
    """A measurement for a message: integers as integers, the rest to 4 significant digits."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e12 else f"{x:.4g}"
