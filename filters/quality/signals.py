"""Image quality signals: cheap, reference-free measurements of one image (text: ``text``).

Guards against a model answering confidently on a garbage image: the seeds' edge inputs
(low-light frames, Gaussian σ = 0.08 noise at PSNR 22 dB, blur from an 8.7× resolution collapse,
JPEG blocking, FP16 NaN/Inf) show up here before the model sees them. How often each is caught
on real photographs, and what each signal confuses, is in docs/quality.md.

Every signal is a ``Signal``: a ``score`` in [0, 1] (1 = good, the unit rules and drift work in)
and the raw ``value`` it came from (for messages). Functions are pure numpy, vectorised, with no
state and no I/O, so the filter can run them in a worker thread and the benchmark can time each.

Image signals work on a luminance plane in [0, 1] at the scale a vision encoder sees (block-mean
down-sampled to ~224 px on the short side), so sharpness and noise mean the same for a 224 px
tensor and a 2048 px photo. The scores (``modality_score``, ``trust_score``) are here too, for
image and text signals alike.

Rules that MUST hold: scores are finite and in [0, 1]; a degraded version of an image (blurred,
darkened, over-exposed, noised, NaN) never scores higher on the signal that measures that
degradation than the clean image does.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from filters.quality import native, scenes
from filters.quality.differences import NOISE_BLOCK as _NOISE_BLOCK
from filters.quality.differences import TILES as _TILES
from filters.quality.differences import PlaneDifferences as Differences
from filters.quality.differences import differences
from filters.quality.luma import REF_SIDE as REF_SIDE
from filters.quality.luma import (
    clip_levels,
    clipped_to_range,
    first_at_least,
    image_pass,
    inside_range,
)
from filters.quality.luma import luminance as luminance
from filters.quality.measure import F32 as F32
from filters.quality.measure import Levels, levels
from filters.quality.measure import Signal as Signal
from filters.quality.measure import ramp as _ramp
from filters.quality.values import ImageSpec as ImageSpec
from filters.quality.values import (
    channels_of,
    extrema,
    finite,
    shared_extrema_signals,
    value_range,
)
from filters.quality.values import fmt_value as fmt_value
from filters.quality.values import widen_float16 as widen_float16
from filters.quality.washout import washout

IMAGE_SIGNALS = ("finite", "range", "constant", "sharpness", "exposure", "noise", "blockiness",
                 *scenes.SCENE_SIGNALS)
REQUEST_SIGNALS = ("residue",)
"""Image signals read across a request's images, not of one image alone (``residue``: a faint
copy of an earlier image of the request); the quality filter measures them."""
SHARPNESS_BLURRED, SHARPNESS_SHARP = 0.3, 1.1  # second/first difference energy; sharpness()
EXPOSURE_DARK, EXPOSURE_LIT = 0.03, 0.2  # mean luminance
HIGHLIGHTS_DIM, HIGHLIGHTS_LIT = 0.35, 0.6  # 99th-percentile luminance; see exposure()
EXPOSURE_BLOWN, EXPOSURE_BRIGHT = 0.25, 0.05  # weighted blown-white share; see exposure()
BLOCKY, NOT_BLOCKY = 1.75, 1.25  # gradient energy on / beside the 8-px grid; blockiness()
_FLAT_ENERGY = 1e-5  # per pixel: below ~1 grey level of steps, a line counts as flat
NOISE_BAD, NOISE_GOOD = 0.06, 0.02  # noise σ of the smoothest blocks; see noise()
_NOISE_P25_GAIN = 1.135  # the 25th percentile of block means under pure noise, over their mean


# --- images -------------------------------------------------------------------------------------


def _mean_var(x: F32, mean: float | None = None) -> tuple[float, float]:
    """Mean and variance through a BLAS dot of the centred values: several times cheaper than
    ``x.var()``, and centring keeps float32 accumulation exact enough for a flat image."""
    flat = x.reshape(-1)
    n = flat.size
    if mean is None:
        mean = float(flat.sum(dtype=np.float64)) / n
    kernels = native.kernels
    if kernels is not None:  # the same centring, no centred copy, one pass
        total: float = kernels.centred_energy(np.ascontiguousarray(flat, np.float32), n,
                                              np.float32(mean))
        return mean, total / n
    centred = flat - np.float32(mean)
    return mean, float(np.dot(centred, centred)) / n


def constant(plane: F32, mean: float | None = None) -> Signal:
    std = math.sqrt(_mean_var(plane, mean)[1]) if plane.size else 0.0
    return Signal(_ramp(std, 0.0, 0.02), std, "luminance standard deviation")


def sharpness(plane: F32, d: Differences | None = None) -> Signal:
    """How thin the edges are: per axis, the energy of the second difference over the energy
    of the first difference of the luminance (at REF_SIDE scale), and the lower of the two
    axes. A gain or an offset of the luminance scales both energies alike, so a dark or
    low-contrast but sharp photo keeps its score (an absolute Laplacian variance, the usual
    measure, shrinks with brightness and reads a dark photo as blurred). Blur, defocus and
    up-sampling widen edges along both axes, camera shake along one (hence the lower axis).
    A ratio of 1.1 scores 1 and 0.3 scores 0 (the softest clean photograph of the evaluation
    set reads 0.82, a 2 px defocus ~0.6; the default rule's 0.5 is a ratio of 0.7).

    Known confusions: noise raises the ratio (a blurred, noisy image can read sharp); images
    soft by nature (microscopy, a small image up-scaled by the client, smooth gradients) read
    blurred; a flat image has no edges to measure (it scores 0: the 'constant' signal speaks
    for it)."""
    if min(plane.shape) < 3:
        return Signal(0.0, 0.0, "second/first difference energy (image too small)")
    d = d or differences(plane)
    ex, ey = d.gx_energy, d.gy_energy
    gx = float(ex.sum(dtype=np.float64)) / (ex.size * plane.shape[0])
    gy = float(ey.sum(dtype=np.float64)) / (ey.size * plane.shape[1])
    if min(gx, gy) <= 1e-12:
        return Signal(0.0, 0.0, "second/first difference energy (no edges)")
    rows, cols = d.second_energies()
    ratio = min(rows / gx, cols / gy)
    # Regions only matter when the whole image is not already sharp (most photographs are).
    region = (sharpest_region(d)
              if ratio < SHARPNESS_SHARP and min(plane.shape) >= 8 * _TILES else 0.0)
    if region > ratio:
        return Signal(_ramp(region, SHARPNESS_BLURRED, SHARPNESS_SHARP), region,
                      "second/first difference energy, lower axis, sharpest region")
    return Signal(_ramp(ratio, SHARPNESS_BLURRED, SHARPNESS_SHARP), ratio,
                  "second/first difference energy, lower axis")


def sharpest_region(d: Differences) -> float:
    """The sharpness ratio of the second-sharpest of 4 × 4 tiles that hold edges (a gradient
    energy at least the tiles' mean): a sharp subject on a soft background (bokeh, a blurred
    wall) is a sharp photograph; blur, defocus and up-sampling soften every tile. The second,
    not the sharpest: one tile where a shake runs along the edges reads sharp by chance
    (with the sharpest, camera shake's AUC fell from 0.98 to 0.95)."""
    kernels = native.kernels
    if kernels is not None:
        value: float = kernels.region_pick(d.region_energies(), _TILES)
        return value
    ex, ey, erows, ecols = d.region_energies()
    enough = (ex + ey) >= float((ex + ey).mean())
    enough &= (ex > 1e-9) & (ey > 1e-9)
    if not enough.any():
        return 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        both = np.minimum(erows / ex, ecols / ey)[enough]
    return float(np.partition(both, -2)[-2] if both.size >= 2 else both[0])


def blockiness(plane: F32, d: Differences | None = None) -> Signal:
    """JPEG blocking: at each boundary of the 8-pixel grid (between pixels 7 and 8, 15 and
    16, ...), the gradient energy across it over the mean of the two across the middles of the
    blocks beside it; the median over the grid, the mean of both axes. A natural image has no
    preference for the grid (about 1: the clean photographs of the evaluation set read at most
    1.18, documents 1.21); a JPEG coded at this resolution puts a small step at every block
    boundary (quality 30 reads mostly 1.45-2.5, quality 10 2.2-5). The median keeps a few
    edges that happen to fall on the grid from counting. A ratio of 1.25 scores 1, 1.75 scores 0.

    Known confusions: it sees only blocks on this image's own 8-pixel grid, so a JPEG
    re-sampled afterwards (coded at another size, then resized by the client, or decoded
    reduced by mmguard) hides its blocks; a picture with an 8-pixel period of its own, aligned
    on the grid (a checkerboard of 8-px squares, pixel art scaled 8×), reads blocky."""
    if min(plane.shape) < 17:
        return Signal(1.0, 1.0, "gradient energy on the 8-px grid (image too small)")
    d = d or differences(plane)
    kernels = native.kernels
    if kernels is not None:  # the same ratios and medians in C (numpy: ~10 small passes)
        rx, ry = kernels.blockiness(np.ascontiguousarray(d.gx_energy),
                                    np.ascontiguousarray(d.gy_energy), plane.shape[1],
                                    plane.shape[0], _FLAT_ENERGY)
        ratio = (rx + ry) / 2
        return Signal(_ramp(ratio, BLOCKY, NOT_BLOCKY), ratio,
                      "gradient energy on the 8-px grid over mid-block")
    ratios = []
    for e, length in zip((d.gx_energy, d.gy_energy), plane.shape[::-1], strict=True):
        # Against the block middles (4 away): an image up-scaled 2x or 4x has a period of
        # 2 or 4 px, the same at both; only an 8-px grid differs.
        n = len(range(7, e.size - 4, 8))  # boundaries 7, 15, ... with a middle 4 after
        beside = np.maximum((e[3::8][:n] + e[11::8][:n]) * 0.5, _FLAT_ENERGY * length)
        r = e[7::8][:n] / beside
        ratios.append(float(np.partition(r, r.size // 2)[r.size // 2]))  # np.median: 5x dearer
    ratio = sum(ratios) / 2
    return Signal(_ramp(ratio, BLOCKY, NOT_BLOCKY), ratio,
                  "gradient energy on the 8-px grid over mid-block")


def noise(plane: F32, d: Differences | None = None) -> Signal:
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
    d = d or differences(plane)
    b = _NOISE_BLOCK
    flat = d.noise_blocks()
    k = flat.size // 4
    low = float(np.partition(flat, k)[k]) / (b * b)
    sigma = math.sqrt(math.pi / 2.0) * low / 6.0 * _NOISE_P25_GAIN
    return Signal(_ramp(sigma, NOISE_BAD, NOISE_GOOD), sigma, "noise sigma")


def channel_clipped(image: NDArray[Any], spec: ImageSpec) -> float:
    """The share of light pixels (channels' mean ≥ 75 % of the range: a saturated colour is
    not light) with a channel within 1.5/255 of its top, on every other row and column (to
    about half a percent, 4x cheaper): a gain clips the brightest channel first. 0 for grey."""
    sub = image[:, ::2, ::2] if spec.layout == "CHW" else image[::2, ::2]
    count = 1 if spec.layout == "HW" else min(
        sub.shape[0] if spec.layout == "CHW" else sub.shape[-1], 3)
    if sub.size == 0 or count < 3:
        return 0.0
    tops, light = clip_levels(spec.low, spec.high, count)
    kernels = native.kernels
    if kernels is not None and len(set(tops)) == 1 and image.ndim == 3 \
            and image.flags.c_contiguous and (
                (spec.layout == "CHW" and image.dtype == np.float32 and image.shape[0] == 3)
                or (spec.layout == "HWC" and image.dtype == np.uint8 and image.shape[2] == 3)):
        # the same count in one C pass over the pixels, no planes copied
        planar = spec.layout == "CHW"
        h, w = image.shape[1:] if planar else image.shape[:2]
        top, ceiling = ((tops[0], float(light)) if planar
                        else (first_at_least(tops[0]), math.ceil(float(light))))
        hits, looked = kernels.clipped(image, h, w, planar, top, ceiling)
        share: float = hits / looked
        return share
    if len(set(tops)) == 1:
        # The three channels copied once as planes (numpy's loops over a stride-2 view, or
        # over an HWC pixel's 3 channels, are 3-10x slower), then one maximum and one sum of
        # the planes: the same sum in the same order as a channel at a time; a NaN pixel is
        # not light either way.
        three = np.ascontiguousarray(sub[:3] if spec.layout == "CHW"
                                     else np.moveaxis(sub[..., :3], -1, 0))
        top = np.maximum(three[0], three[1])
        np.maximum(top, three[2], out=top)
        if three.dtype == np.uint8:
            # Integers: the first value the float comparisons accept, compared in integers.
            hit: NDArray[np.bool_] = top >= first_at_least(tops[0])
            level = np.add(three[0], three[1], dtype=np.uint16)
            level += three[2]
            hit &= level >= math.ceil(float(light))  # every sum is exact in float32 too
            return np.count_nonzero(hit) / hit.size
        hit = top >= tops[0]
        level = np.add(three[0], three[1], dtype=np.float32)
        level += three[2]
    else:
        chans = channels_of(sub, spec.layout)
        hit = np.zeros(chans[0].shape, np.bool_)
        level = np.zeros(chans[0].shape, np.float32)
        for c, top in zip(chans, tops, strict=True):
            hit |= c >= top
            level += c  # in the input's own units: compared once, below
    hit &= level >= light
    return np.count_nonzero(hit) / hit.size


def exposure(plane: F32, lv: Levels | None = None, clipped: float | None = None) -> Signal:
    """Whether the scene got the right amount of light, from the luminance histogram.

    Under-exposure: the mean luminance (0.03 scores 0, 0.2 scores 1; the darkest clean
    photograph of the evaluation set has 0.21), forgiven when the brightest 1 % of the image is
    bright (99th percentile ≥ 0.6): a dark scene with bright highlights (a night sky, a lamp)
    was lit enough for what is in it, while cutting the light dims the highlights too.
    Over-exposure: the share of blown-white pixels, counted in proportion to the share of
    mid-tones (0.25-0.75) or to the lack of dark pixels (under 0.25): a white page is paper
    white plus dark ink, few mid-tones, so its white does not count; an over-exposed photo
    keeps mid-tones or has lost its darks. A weighted share of 25 % scores 0, 5 % scores 1.
    Blown counts the larger of the white luminance and, when the caller measured it
    (``clipped``, from ``channel_clipped``), the share of light pixels with a colour channel at
    its top: a gain clips the brightest channel first (AUC at 1.5× 0.864 -> 0.909, no clean
    input of any kind flagged more: docs/quality.md).
    A picture that reads as drawn (``scenes.graphic``: flat colours, white not reached through a
    gradient: a light-mode screenshot, clip art) has its weighted share cut in proportion;
    only a candidate over-exposure (weighted share above 5 %) pays for that test.

    Known confusions: a dark tone curve (gamma) that keeps the highlights reads as a dark
    scene, not as low light; a scene dark by nature without highlights (a dim microscope
    slide) reads under-exposed; an over-exposed photograph of flat-coloured things whose white
    is not reached through a gradient reads as a drawing (none on the evaluation set, where
    the discount costs no over-exposure at 1.5-3×); a photo blown so far that only white and
    deep shadows are left reads as a white page."""
    if plane.size == 0:
        return Signal(0.0, 0.0, "mean luminance (empty image)")
    # Counts by comparison, not a histogram: np.bincount widens uint8 to int64 (~0.3 ms).
    lv = lv or levels(plane)
    mean, blown, ink, mid = lv.mean, lv.blown, lv.ink, lv.mid
    if clipped is not None:
        blown = max(blown, clipped)
    # The 99th percentile of a 1/16 subsample: a few thousand values, exact enough for a ramp.
    sub = plane[::4, ::4].reshape(-1)
    k = int(0.99 * (sub.size - 1))
    p99 = float(np.partition(sub, k)[k])
    # A page needs ink: white with neither mid-tones nor dark strokes is blown, not paper.
    weighted = blown * max(_ramp(mid, 0.15, 0.35), _ramp(ink, 0.03, 0.005))
    if weighted > EXPOSURE_BRIGHT:  # only a candidate over-exposure pays for the graphics test
        ramped = (lv.near_white - lv.blown) / lv.blown if lv.blown else 1.0
        weighted *= 1.0 - scenes.graphic(plane, ramped)
    # A dark scene with bright highlights (a night sky, a lamp) was lit enough for what is in
    # it; cutting the light dims the highlights too.
    under = max(_ramp(mean, EXPOSURE_DARK, EXPOSURE_LIT),
                _ramp(p99, HIGHLIGHTS_DIM, HIGHLIGHTS_LIT))
    over = _ramp(weighted, EXPOSURE_BLOWN, EXPOSURE_BRIGHT)
    if under <= over:
        return Signal(under, mean, f"mean luminance (99th percentile {p99:.3f})")
    return Signal(over, weighted, f"share of blown-white pixels weighted by mid-tones and missing"
                  f" darks ({blown:.0%} blown, {mid:.0%} mid-tones, {ink:.0%} dark)")


def image_signals(image: NDArray[Any], spec: ImageSpec,
                  optional: Collection[str] = ()) -> dict[str, Signal]:
    """Every image signal of one image (CHW, HWC or HW, any float or integer dtype); of the
    dear ones (``scenes.OPTIONAL_SIGNALS``), only those named in ``optional``."""
    return measure_image(image, spec, optional)[0]


def measure_image(image: NDArray[Any], spec: ImageSpec,
                  optional: Collection[str] = ()) -> tuple[dict[str, Signal], F32]:
    """``image_signals``, and the luminance plane they were read from (``residue`` compares
    the planes of a request's images)."""
    if image.dtype == np.float16:  # numpy keeps float16 math in float16 (slow): measure in
        image = widen_float16(image)  # float32 (measured: native float16 was 2.7x dearer)
    with np.errstate(all="ignore"):  # NaN/Inf are measured, not warned about
        channels = 1 if spec.layout == "HW" else min(
            image.shape[0] if spec.layout == "CHW" else image.shape[-1], 3)
        one = image_pass(image, spec)
        lv: Levels | None
        if one is not None:  # the input read once (luma.py): the plane, extrema, clipped, levels
            bounds = (one.low,) * channels, (one.high,) * channels
            inside = inside_range(spec, channels, *bounds)
            plane = clipped_to_range(one.plane, inside)
            lv = one.levels if inside else levels(plane)  # not inside: the plane may be clipped
            clipped = one.clipped
            nan_inf, in_range = shared_extrema_signals(image, spec, channels, one.low, one.high)
        else:
            mins, maxs = extrema(image, spec, channels)
            plane = luminance(image, spec, inside_range(spec, channels, mins.tolist(),
                                                        maxs.tolist()))
            lv = levels(plane) if plane.size else None
            clipped = channel_clipped(image, spec)
            nan_inf, in_range = finite(image, mins, maxs), value_range(image, spec, mins, maxs)
        d = differences(plane) if min(plane.shape, default=0) >= 3 else None
        return {"finite": nan_inf, "range": in_range,
                "constant": constant(plane, lv.mean if lv else None),
                "sharpness": sharpness(plane, d),
                "exposure": exposure(plane, lv, clipped),
                "noise": (nz := noise(plane, d)), "blockiness": blockiness(plane, d),
                "perspective": scenes.perspective(plane), "tone": scenes.tone(plane, lv),
                "shake": scenes.shake(plane, nz.value),
                **({"ghosting": scenes.ghosting(plane)} if "ghosting" in optional else {}),
                **({"moire": scenes.moire(plane)} if "moire" in optional else {}),
                **({"washout": washout(plane)} if "washout" in optional else {})}, plane


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
