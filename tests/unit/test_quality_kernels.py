"""The quality signals' fused C passes (``filters/quality/_kernels.c``) give what their numpy code
gives: every per-pixel value by the same float32 arithmetic, the sums in another order (so equal
to a few ulps of the total, never more), the counts by level exactly; and on real photographs and
their degraded copies, every signal's score and value as the numpy code reads them.

The module is built by the install (``setup.py``); these tests fail where it was not, rather than
pass on the numpy code alone."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from filters.quality import differences as diffs
from filters.quality import luma, measure, native, scenes
from filters.quality.filter import QualityConfig, QualityFactory
from filters.quality.signals import ImageSpec, image_signals
from proxy.chain import FilterContext
from proxy.clock import ManualClock
from proxy.telemetry import Telemetry
from tests.support import photos

F32 = NDArray[np.float32]
HWC = ImageSpec("HWC", (0.0,), (255.0,))


def test_the_c_module_is_built_and_used() -> None:
    module = importlib.import_module("filters.quality._kernels")
    assert native.kernels is module
    plane = np.random.default_rng(0).random((40, 50), np.float32)
    assert isinstance(diffs.differences(plane), diffs.FusedDifferences)


@pytest.fixture
def numpy_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(native, "kernels", None)
    yield


def both(fn: Any, *args: Any) -> tuple[Any, Any]:
    """``fn(*args)`` on the C passes, then on the numpy code."""
    kernels = native.kernels
    assert kernels is not None
    fused = fn(*args)
    native.kernels = None
    try:
        reference = fn(*args)
    finally:
        native.kernels = kernels
    return fused, reference


def close(got: F32, want: F32, scale: float) -> None:
    """Equal but for the order of float32 sums: within 1e-5 of the sums' own scale."""
    assert got.shape == want.shape
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6 * scale), np.max(np.abs(got - want))


def planes() -> list[F32]:
    rng = np.random.default_rng(7)
    out = [rng.random(shape, np.float32) for shape in
           ((3, 3), (3, 17), (17, 3), (11, 11), (31, 40), (64, 65), (224, 224), (225, 301))]
    smooth = np.linspace(0, 1, 224 * 224, dtype=np.float32).reshape(224, 224)
    out.append(smooth)
    out.append(np.zeros((40, 40), np.float32))  # flat: every energy 0
    # exactly at every level's threshold, and either side of it
    edges = np.array([measure.MID_LOW, measure.MID_HIGH, measure.NEAR_WHITE, measure.CLIPPED,
                      measure.BLOWN], np.float32)
    levels = np.concatenate([edges, np.nextafter(edges, 0), np.nextafter(edges, 1), [0, 1]])
    out.append(np.resize(levels, (37, 53)).astype(np.float32))
    return out


@pytest.mark.parametrize("plane", planes(), ids=lambda p: "x".join(map(str, p.shape)))
def test_differences_match_the_numpy_reference(plane: F32) -> None:
    fused, ref = both(diffs.differences, plane)
    assert isinstance(fused, diffs.FusedDifferences) and isinstance(ref, diffs.Differences)
    total = float(np.sum(np.square(np.diff(plane, axis=1)))) + 1e-12
    close(fused.gx_energy, ref.gx_energy, total)
    close(fused.gy_energy, ref.gy_energy, total)
    for got, want in zip(fused.second_energies(), ref.second_energies(), strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-12)
    if min(plane.shape) >= 2 + diffs.TILES:
        close(fused.region_energies(), ref.region_energies(), total)
    close(fused.noise_blocks(), ref.noise_blocks(), float(np.sum(ref.noise_blocks())) + 1e-12)


@pytest.mark.parametrize("plane", planes(), ids=lambda p: "x".join(map(str, p.shape)))
def test_levels_count_exactly_as_numpy(plane: F32) -> None:
    fused, ref = both(measure.levels, plane)
    assert (fused.ink, fused.mid, fused.near_white, fused.clipped, fused.blown) == (
        ref.ink, ref.mid, ref.near_white, ref.clipped, ref.blown)
    assert fused.mean == pytest.approx(ref.mean, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("plane", [p for p in planes() if min(p.shape) >= 32],
                         ids=lambda p: "x".join(map(str, p.shape)))
def test_shake_sums_match_the_numpy_reference(plane: F32) -> None:
    t = scenes._SHAKE_TILES
    h, w = plane.shape
    th, tw = (h - 2) // (2 * t), (w - 2) // (2 * t)
    got = np.empty((2, 4, t, t), np.float32)
    kernels = native.kernels
    assert kernels is not None
    kernels.shake(plane, h, w, t, got)
    want = scenes._shake_sums(plane, th, tw, t)
    close(got, want, float(want.sum()) + 1e-12)


def test_a_plane_that_is_not_float32_or_too_short_is_refused() -> None:
    kernels = native.kernels
    assert kernels is not None
    out = np.empty((2, 4, 4, 4), np.float32)
    with pytest.raises(TypeError, match="plane: expected float32, got format d"):
        kernels.shake(np.zeros((40, 40)), 40, 40, 4, out)
    with pytest.raises(ValueError, match="plane: expected at least 1600 values, got 1599"):
        kernels.shake(np.zeros(1599, np.float32), 40, 40, 4, out)
    with pytest.raises(ValueError, match="too small"):
        kernels.shake(np.zeros((9, 9), np.float32), 9, 9, 4, out)
    with pytest.raises(BufferError):  # an output it cannot write into
        kernels.shake(np.zeros((40, 40), np.float32), 40, 40, 4, out.tobytes())


def inputs() -> Iterator[tuple[str, NDArray[np.uint8]]]:
    rng = np.random.default_rng(3)
    for clean in photos.clean_set()[::3]:
        yield clean.name, clean.image
        yield f"{clean.name}/noise", photos.gaussian(clean.image, 0.05, rng)
        yield f"{clean.name}/gain", photos.overexposure(clean.image, 1.8, rng)
        yield f"{clean.name}/gamma", photos.gamma(clean.image, 2.2, rng)
        yield f"{clean.name}/defocus", photos.defocus(clean.image, 3.0, rng)


def test_every_signal_reads_the_same_on_photographs_and_degraded_copies() -> None:
    """Scores equal to 1e-4 and values to 1e-4 of their size, on every dtype the fronts
    measure: the C passes cannot move a decision beyond the last bits of a threshold."""
    checked = 0
    optional = scenes.OPTIONAL_SIGNALS
    for name, pixels in inputs():
        planes = np.ascontiguousarray(pixels.transpose(2, 0, 1), np.float32) / 255
        chw = ImageSpec("CHW", (0.0,), (1.0,))
        for image, spec in ((pixels, HWC), (planes, chw), (planes.astype(np.float16), chw)):
            fused, ref = both(image_signals, image, spec, optional)
            assert fused.keys() == ref.keys()
            for key, got in fused.items():
                want = ref[key]
                where = f"{name} {spec.layout} {key}: {got} vs {want}"
                assert got.score == pytest.approx(want.score, abs=1e-4), where
                assert got.value == pytest.approx(want.value, rel=1e-4, abs=1e-7), where
                assert got.what == want.what, where
                checked += 1
    assert checked > 3000


def test_a_route_measured_without_the_c_module_says_so_once_at_load(
        numpy_only: None, caplog: pytest.LogCaptureFixture) -> None:
    """A log line and the gauge when the numpy code measures a route's images; the gauge alone
    when the C passes do."""
    telemetry = Telemetry()
    ctx = FilterContext("m", telemetry, ManualClock(), random.Random(1), lambda: None)
    with caplog.at_level(logging.INFO, logger="mmguard.quality"):
        QualityFactory().build(QualityConfig(), ctx)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "quality on route m: the C module filters.quality._kernels is not" \
        " built" in said[0] and "~3x the CPU" in said[0], said
    gauge = "mmguard_quality_image_passes"
    read = telemetry.registry.get_sample_value
    assert read(gauge, {"model": "m", "passes": "numpy"}) == 1.0
    assert read(gauge, {"model": "m", "passes": "c"}) is None
    native.kernels = importlib.import_module("filters.quality._kernels")
    caplog.clear()
    other = FilterContext("n", telemetry, ManualClock(), random.Random(1), lambda: None)
    with caplog.at_level(logging.INFO, logger="mmguard.quality"):
        QualityFactory().build(QualityConfig(), other)
    assert caplog.records == []
    assert read(gauge, {"model": "n", "passes": "c"}) == 1.0


def odd_images() -> list[tuple[str, NDArray[Any], ImageSpec]]:
    """FP32 planes and UINT8 pixels the fused luminance reads, with the values at its edges."""
    rng = np.random.default_rng(11)
    chw = ImageSpec("CHW", (0.0,), (1.0,))
    out: list[tuple[str, NDArray[Any], ImageSpec]] = []
    base = rng.random((3, 64, 80), np.float32)
    for name, value in (("nan", np.nan), ("+inf", np.inf), ("-inf", -np.inf), ("-0", -0.0),
                        ("huge", 3e38), ("below", -0.5), ("above", 7.0)):
        x = base.copy()
        x[1, 10, 20] = value
        out.append((name, x, chw))
    both_inf = base.copy()
    both_inf[0, 5, 5], both_inf[2, 5, 5] = np.inf, -np.inf  # one pixel: inf - inf
    out.append(("inf-inf", both_inf, chw))
    out.append(("raw 0-255 as float", base * 255, chw))
    out.append(("normalised", (base - 0.45) / 0.22, ImageSpec("CHW", (-2.0,), (2.5,))))
    out.append(("constant", np.full((3, 40, 40), 0.5, np.float32), chw))
    # as the fronts decode a tensor off the wire: little-endian, buffer format "<f" or "B"
    out.append(("wire <f4", np.frombuffer(base.tobytes(), "<f4").reshape(base.shape), chw))
    u8 = rng.integers(0, 256, (64, 80, 3), dtype=np.uint8)
    out.append(("uint8", u8, HWC))
    out.append(("uint8 black", np.zeros((40, 40, 3), np.uint8), HWC))
    out.append(("uint8 white", np.full((40, 40, 3), 255, np.uint8), HWC))
    out.append(("uint8 read as 0-1", u8, ImageSpec("HWC", (0.0,), (1.0,))))
    out.append(("wire u1", np.frombuffer(u8.tobytes(), "u1").reshape(u8.shape), HWC))
    return out


@pytest.mark.parametrize(("name", "image", "spec"), odd_images(), ids=lambda x: str(x)[:20])
def test_the_one_pass_reads_edge_values_as_numpy(name: str, image: NDArray[Any],
                                                 spec: ImageSpec) -> None:
    """NaN, ±Inf (the one pass reports either as NaN extrema: the same signals follow),
    -0, values out of range: every signal as the numpy code reads it."""
    assert luma.image_pass(image, spec) is not None, "the one pass should read this input"
    got, want = both(image_signals, image, spec)
    for key, signal in got.items():
        assert signal.score == pytest.approx(want[key].score, abs=1e-6), (key, signal, want[key])
        assert signal.value == pytest.approx(want[key].value, rel=1e-5, abs=1e-9), (
            key, signal, want[key])
        assert signal.what == want[key].what


_PLANES = ([c for c in odd_images() if "NaN" not in c[0] and "Inf" not in c[0]]
           + [(c.name, c.image, HWC) for c in photos.clean_set()[::4]])


@pytest.mark.parametrize(("name", "image", "spec"), _PLANES, ids=[c[0] for c in _PLANES])
def test_the_luminance_plane_is_the_c_passes_bit_for_bit(name: str, image: NDArray[Any],
                                                         spec: ImageSpec) -> None:
    """The plane itself, not only the signals read off it: numpy's code is the C pass's sums
    in their order on every machine. (An HWC product through OpenBLAS rounded differently on
    an AVX-512 machine, and ghosting, reading a log spectrum, moved 1.2e-4.)"""
    fused = luma.image_pass(image, spec)
    assert fused is not None
    plane = fused.plane.reshape(luma.luminance(image, spec).shape)
    want = luma.luminance(image, spec, inside=True)
    assert plane.dtype == want.dtype == np.float32
    assert np.array_equal(plane.view(np.uint32), want.view(np.uint32)), name


@pytest.mark.parametrize("shape", [(40, 40, 3), (224, 300, 4), (501, 640, 3), (3, 1, 3),
                                   (0, 5, 3)])
def test_an_hwc_float_plane_is_mixed_in_c_as_numpy_mixes_it(shape: tuple[int, ...]) -> None:
    """``luminance`` of a float32 HWC image (a float model input, or a large image once
    down-sampled) through the C mix, against numpy's multiply-adds: bit for bit, alpha
    left out, values out of range clipped alike."""
    from filters.quality.signals import luminance
    rng = np.random.default_rng(11)
    spec = ImageSpec("HWC", (-0.5,), (1.5,))
    for image in (rng.random(shape, np.float32) * 2 - 0.5,
                  rng.integers(0, 256, shape).astype(np.uint8)):
        s = spec if image.dtype == np.float32 else HWC
        got, want = both(luminance, image, s)
        assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (shape, image.dtype)


@pytest.mark.parametrize(("layout", "shape"), [
    ("HWC", (449, 700, 3)), ("HWC", (672, 1000, 4)), ("HWC", (1800, 1900, 3)),  # k 2, 3, 8
    ("HWC", (900, 1000, 1)), ("CHW", (3, 449, 700)), ("CHW", (3, 1344, 1500)),  # k 4, 2, 6
    ("CHW", (1, 1800, 1900))])  # k 8: numpy's pairwise order, left to numpy
def test_a_large_image_is_down_sampled_as_numpy_does_it(layout: str,
                                                       shape: tuple[int, ...]) -> None:
    """``_block_mean``'s block means in C, bit for bit: uint8 (whose sums are exact in any
    order) and float32 (whose are not; -0.0 included), every layout and factor it takes."""
    rng = np.random.default_rng(13)
    floats = rng.random(shape, np.float32) * 3 - 1
    floats.flat[::97] = -0.0
    for image in (rng.integers(0, 256, shape).astype(np.uint8), floats):
        got, want = both(luma.block_mean, image, layout)
        assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (layout, image.dtype)


def test_the_block_mean_refuses_what_it_cannot_read() -> None:
    kernels = native.kernels
    assert kernels is not None
    out = np.empty((2, 2, 3), np.float32)
    with pytest.raises(ValueError, match="k < 8 for CHW or one channel"):
        kernels.block_mean(np.zeros((3, 16, 16), np.float32), False, 16, 16, 3, 8, 1.0, out)
    with pytest.raises(ValueError, match="image: expected at least 768 values, got 767"):
        kernels.block_mean(np.zeros(767, np.uint8), True, 16, 16, 3, 8, 1.0, out)
    with pytest.raises(TypeError, match="image: expected uint8 or float32, got format d"):
        kernels.block_mean(np.zeros((16, 16, 3)), True, 16, 16, 3, 8, 1.0, out)
    with pytest.raises(ValueError, match="out: expected at least 48 values, got 12"):
        kernels.block_mean(np.zeros((16, 16, 3), np.uint8), True, 16, 16, 3, 4, 1.0, out)


def test_the_mix_refuses_what_it_cannot_read() -> None:
    kernels = native.kernels
    assert kernels is not None
    out = np.empty(4, np.float32)
    with pytest.raises(ValueError, match="at least 3 channels"):
        kernels.mix(np.zeros((4, 2), np.float32), 4, 2, 1.0, 1.0, 1.0, 0.0, out)
    with pytest.raises(ValueError, match="image: expected at least 12 values, got 11"):
        kernels.mix(np.zeros(11, np.float32), 4, 3, 1.0, 1.0, 1.0, 0.0, out)
    with pytest.raises(TypeError, match="image: expected float32, got format d"):
        kernels.mix(np.zeros((4, 3)), 4, 3, 1.0, 1.0, 1.0, 0.0, out)


def test_the_one_pass_leaves_other_inputs_to_numpy() -> None:
    chw = ImageSpec("CHW", (0.0,), (1.0,))
    x = np.zeros((3, 40, 40), np.float32)
    assert luma.image_pass(x, chw) is not None
    for image, spec in ((x.astype(np.float64), chw),  # another dtype
                        (np.zeros((4, 40, 40), np.float32), chw),  # an alpha plane
                        (x[:, ::2, ::2], chw),  # not contiguous
                        (np.zeros((3, 500, 500), np.float32), chw),  # down-sampled first
                        (x, ImageSpec("CHW", (0.0, 0.1, 0.0), (1.0,))),  # ranges per channel
                        (np.zeros((40, 40, 3), np.float32), ImageSpec("HWC", (0.0,), (1.0,))),
                        (x.astype(">f4"), chw)):  # byte-swapped
        assert luma.image_pass(image, spec) is None


@pytest.mark.parametrize("dtype", [">f4", "<f4", ">f2", "<f2"])
def test_either_byte_order_reads_as_numpy_reads_it(dtype: str) -> None:
    """A tensor of either byte order (a client may send a byte-swapped numpy array's bytes, and
    a front may hand a view of it): the same signals on both paths, and the same as native."""
    rng = np.random.default_rng(2)
    native_image = rng.random((3, 48, 64), np.float32)
    image = native_image.astype(dtype)
    chw = ImageSpec("CHW", (0.0,), (1.0,))
    got, want = both(image_signals, image, chw)
    for key, signal in got.items():
        assert (signal.score, signal.what) == (want[key].score, want[key].what), key
        assert signal.value == pytest.approx(want[key].value, rel=1e-5, abs=1e-9), key
    from filters.quality.signals import widen_float16
    if dtype.endswith("f2"):
        assert np.array_equal(widen_float16(image), image.astype(np.float32))


@pytest.mark.parametrize(("name", "image", "spec"), odd_images(), ids=lambda x: str(x)[:20])
def test_channel_clipped_counts_exactly_as_numpy(name: str, image: NDArray[Any],
                                                 spec: ImageSpec) -> None:
    from filters.quality.signals import channel_clipped
    bright = _brightened(image, spec)
    for x in (image, bright, bright[..., :-1].copy() if bright.dtype == np.uint8
              else bright[:, :-1].copy()):  # an odd width
        got, want = both(channel_clipped, x, spec)
        assert got == want, (name, got, want)


def _brightened(image: NDArray[Any], spec: ImageSpec) -> NDArray[Any]:
    """A third of the pixels at the range's top, a third just under channel_clipped's top."""
    bright = image.copy()
    if bright.dtype == np.uint8:
        bright[::3] = 255
        bright[1::3, :, 0] = 253
    else:
        bright[:, ::3] = spec.high[0]
        bright[0, 1::3] = np.nextafter(np.float32(spec.high[0] - (spec.high[0] - spec.low[0])
                                                  * 1.5 / 255), np.float32(-1e9))
    return bright


_ONE_PASS = odd_images() + [(c.name, c.image, HWC) for c in photos.clean_set()[::9]]


@pytest.mark.parametrize(("name", "image", "spec"), _ONE_PASS, ids=[c[0] for c in _ONE_PASS])
def test_the_one_pass_reads_what_the_separate_passes_read(name: str, image: NDArray[Any],
                                                          spec: ImageSpec) -> None:
    """luma.image_pass against the functions it stands in for, on the image, a brightened copy
    and copies whose sides are odd and not multiples of 64 (the levels' blocks then straddle
    rows, and a tail is left): the plane bit for bit, the extrema as numpy's, channel_clipped's
    share and the levels' counts exactly, the levels' sum as measure.levels' C pass sums it
    (the same blocks, the same order: bit for bit) and within rounding of numpy's."""
    from filters.quality.signals import channel_clipped
    from filters.quality.values import extrema
    bright = _brightened(image, spec)
    hwc = image.dtype == np.uint8
    for x in (image, bright, np.ascontiguousarray(bright[:-1, :-1] if hwc
                                                  else bright[:, :-1, :-1])):
        one = luma.image_pass(x, spec)
        assert one is not None, name
        lows, highs = extrema(x, spec, 3)
        if np.isnan(one.low):  # NaN or ±Inf anywhere: reported as NaN extrema
            assert not (np.isfinite(lows).all() and np.isfinite(highs).all()), name
        else:
            assert (one.low, one.high) == (float(lows.min()), float(highs.max())), name
        plane = luma.luminance(x, spec, inside=True)
        assert np.array_equal(one.plane.view(np.uint32), plane.view(np.uint32)), name
        clipped, reference = both(channel_clipped, x, spec)
        assert one.clipped == clipped == reference, (name, one.clipped, reference)
        counted, numpy_counted = both(measure.levels, one.plane)
        same = [a == b or (a != a and b != b) for a, b in  # NaN (a NaN pixel) is NaN's match
                zip(dataclasses.astuple(one.levels), dataclasses.astuple(counted), strict=True)]
        assert all(same), (name, one.levels, counted)
        assert one.levels.mean == pytest.approx(numpy_counted.mean, rel=1e-6, abs=1e-9,
                                                nan_ok=True)
        assert (one.levels.ink, one.levels.mid, one.levels.near_white, one.levels.clipped,
                one.levels.blown) == (numpy_counted.ink, numpy_counted.mid,
                                      numpy_counted.near_white, numpy_counted.clipped,
                                      numpy_counted.blown), name


def _at_the_tolerance(spec: ImageSpec) -> list[tuple[str, NDArray[Any], ImageSpec]]:
    """Images whose extrema sit exactly at value_range's floor and ceiling, and one float32
    step past each."""
    from filters.quality.values import _limits
    _, _, floor, ceiling, _ = _limits(spec.low, spec.high, 3)
    out = []
    for name, low, high in (("at", floor[0], ceiling[0]),
                            ("under", np.nextafter(np.float32(floor[0]), np.float32(-9)),
                             ceiling[0]),
                            ("over", floor[0], np.nextafter(np.float32(ceiling[0]),
                                                            np.float32(9)))):
        x = np.full((3, 8, 8), 0.5, np.float32)
        x[0, 0, 0], x[2, 7, 7] = low, high
        out.append((f"{name} the tolerance", x, spec))
    return out


@pytest.mark.parametrize(("name", "image", "spec"),
                         odd_images() + _at_the_tolerance(ImageSpec("CHW", (0.0,), (1.0,)))
                         + _at_the_tolerance(ImageSpec("CHW", (-2.0,), (2.5,))),
                         ids=lambda x: str(x)[:24])
def test_the_shared_extrema_give_finite_and_range_as_their_functions_do(
        name: str, image: NDArray[Any], spec: ImageSpec) -> None:
    """values.shared_extrema_signals (two floats for every channel's extrema) against
    finite and value_range on the per-channel arrays: the same signals exactly, in range, out
    of it, at its tolerance's edges and with NaN or ±Inf (which it hands to them)."""
    from filters.quality.values import extrema, finite, shared_extrema_signals, value_range
    mins, maxs = extrema(image, spec, 3)
    assert len(set(mins.tolist())) == 1 or np.isnan(mins).all(), name
    low, high = float(mins[0]), float(maxs[0])
    got = shared_extrema_signals(image, spec, 3, low, high)
    want = finite(image, mins, maxs), value_range(image, spec, mins, maxs)
    assert got == want, (name, got, want)


def test_the_one_pass_refuses_what_it_cannot_read() -> None:
    kernels = native.kernels
    assert kernels is not None
    plane = np.empty((4, 4), np.float32)
    args = (1.0, 1.0, 1.0, 0.0, plane, 1.0, 1.0, 0.25, 0.75, 0.9, 0.98, 0.98)
    with pytest.raises(ValueError, match="at least 48 values"):
        kernels.image_pass(np.zeros(47, np.float32), 4, 4, True, *args)
    with pytest.raises(TypeError, match="uint8"):
        kernels.image_pass(np.zeros(48, np.float32), 4, 4, False, *args)
    with pytest.raises(ValueError, match="h >= 1"):
        kernels.image_pass(np.zeros(48, np.float32), 0, 4, True, *args)
    with pytest.raises(ValueError, match="out: expected at least 16"):
        kernels.image_pass(np.zeros(48, np.float32), 4, 4, True, 1.0, 1.0, 1.0, 0.0,
                           np.empty(15, np.float32), *args[5:])


@pytest.mark.parametrize("fused", [True, False], ids=["c", "numpy"])
def test_float16_widening_is_astype_bit_for_bit_on_either_path(fused: bool) -> None:
    """Every float16 bit pattern (NaN payloads, ±Inf, subnormals, -0), whole and as a strided
    view, on the C pass and on numpy's table."""
    from filters.quality.signals import widen_float16
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    kernels = native.kernels
    native.kernels = kernels if fused else None
    try:
        for x in (every, every.reshape(256, 256)[::3, 1::2], every[:0]):
            want = x.astype(np.float32)
            got = widen_float16(x)
            assert got.shape == want.shape and got.dtype == np.float32
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    finally:
        native.kernels = kernels


@pytest.mark.parametrize("plane", planes(), ids=lambda p: "x".join(map(str, p.shape)))
def test_tone_key_matches_the_numpy_reference(plane: F32) -> None:
    """The sum of logarithms by products of 64 (C) against numpy's float32 logarithms."""
    got, want = both(scenes.tone, plane)
    assert got.value == pytest.approx(want.value, rel=1e-6)
    assert got.score == pytest.approx(want.score, abs=1e-6)


def test_the_sharpest_region_is_chosen_exactly_as_numpy_chooses() -> None:
    """Random tiles (and tiles with ties at the mean, with none or one holding edges): the C
    choice and numpy's give the same float, bit for bit."""
    from filters.quality.signals import sharpest_region
    rng = np.random.default_rng(5)
    cases = [rng.gamma(0.5, 1e-3, (4, 4, 4)).astype(np.float32) for _ in range(300)]
    flat = np.full((4, 4, 4), 1e-4, np.float32)
    one = flat.copy()
    one[:2] = 0.0
    one[:2, 1, 2] = 1e-3  # one tile with edges
    cases += [flat, np.zeros((4, 4, 4), np.float32), one]
    for region in cases:
        d = diffs.FusedDifferences(40, 40, np.zeros(39, np.float32), np.zeros(39, np.float32),
                                   (0.0, 0.0), region, np.zeros(16, np.float32))
        got, want = both(sharpest_region, d)
        assert got == want, (got, want)


def test_shake_is_chosen_exactly_as_numpy_chooses() -> None:
    """From the same tile sums of real photographs' planes, from every tile holding edges to
    none (the noise's share rises with sigma): the same value and count, bit for bit."""
    from filters.quality.signals import luminance
    kernels = native.kernels
    assert kernels is not None
    t = scenes._SHAKE_TILES
    counts = set()
    for clean in photos.clean_set()[::9]:
        plane = luminance(clean.image, HWC)
        h, w = plane.shape
        th, tw = (h - 2) // (2 * t), (w - 2) // (2 * t)
        sums = scenes._shake_sums(plane, th, tw, t)
        for sigma in (0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.2, 1.0):
            got = kernels.shake_pick(sums, t, th * tw, sigma, scenes._SHAKE_RANK,
                                     scenes._SHAKE_EDGE)
            want = scenes._shake_pick(sums, th * tw, sigma)
            assert got == want, (clean.name, sigma, got, want)
            counts.add(got[1])
    assert {0, 1, t * t} <= counts and len(counts) >= 8, counts


@pytest.mark.parametrize("side", [17, 18, 19, 20, 31, 224, 225, 447, 700])
def test_blockiness_is_read_exactly_as_numpy_reads_it(side: int) -> None:
    """The same energies (random, with flat lines below the floor and ties): the same ratio,
    bit for bit, from 1 boundary per axis to 87 (past the C code's 64 on the stack)."""
    from filters.quality.signals import blockiness
    rng = np.random.default_rng(side)
    for trial in range(20):
        gx = rng.gamma(0.7, 1e-3, side + trial % 3 - 1).astype(np.float32)
        gy = rng.gamma(0.7, 1e-3, side).astype(np.float32)
        gx[::5] = 0.0  # flat lines: the floor decides
        gy[3::8] = gy[11::8].mean()  # ties among the block middles
        plane = np.zeros((gy.size + 1, gx.size + 1), np.float32)
        d = diffs.FusedDifferences(plane.shape[0], plane.shape[1], gx, gy, (0.0, 0.0),
                                   np.zeros((4, 4, 4), np.float32), np.zeros(0, np.float32))
        got, want = both(blockiness, plane, d)
        assert (got.score, got.value) == (want.score, want.value), (side, trial, got, want)


def test_a_flat_plane_has_no_variance_on_either_path() -> None:
    """constant's variance about the mean: exactly 0 for a constant plane (the C pass centres
    before it squares, as numpy does), equal to 1e-6 elsewhere."""
    from filters.quality.signals import constant
    for plane in (np.full((50, 60), 0.37, np.float32), np.zeros((9, 9), np.float32)):
        got, want = both(constant, plane)
        assert got.value == want.value == 0.0 and got.score == want.score == 0.0
    for plane in planes():
        got, want = both(constant, plane)
        assert got.value == pytest.approx(want.value, rel=1e-6, abs=1e-12)


def test_perspective_reads_the_borders_exactly_as_numpy() -> None:
    """The borders' medians and spreads are order statistics: the C selection gives numpy's
    partition's values exactly, so the signal is the same to the bit on photographs, on the
    odd planes, and on screens photographed at an angle (flat dark surround, leaning edges)."""
    from filters.quality.signals import luminance
    rng = np.random.default_rng(9)
    cases = [luminance(c.image, HWC) for c in photos.clean_set()[::5]]
    cases += [p for p in planes() if min(p.shape) >= 32]
    cases += [luminance(photos.perspective(c.image, 0.2, rng), HWC)
              for c in photos.clean_set()[::15]]
    for lean in (0, 6, 14):
        screen = np.full((120, 160), 0.05, np.float32) + rng.normal(0, 0.002, (120, 160)).astype(
            np.float32)
        for r in range(120):
            left = 20 + lean * r // 120
            screen[r, left:140 - lean * r // 120] = 0.8 + 0.1 * rng.random()
        cases.append(np.ascontiguousarray(screen[10:110]))
    leaning = 0
    seen = set()
    for plane in cases:
        got, want = both(scenes.perspective, plane)
        assert (got.score, got.value, got.what) == (want.score, want.value, want.what)
        seen.add(got.what.split("(")[-1])
        leaning += got.value > 0
    assert len(seen) >= 3 and leaning >= 3, (seen, leaning)  # no surround, sides measured


def test_a_refused_buffer_is_let_go() -> None:
    """An input of the wrong dtype or length is refused with the name of the argument, and its
    buffer is released (numpy cannot resize an array whose buffer is still held)."""
    kernels = native.kernels
    assert kernels is not None
    for bad, error, words in (
            (np.zeros(100, np.float64), TypeError, "expected float32"),
            (np.zeros(10, np.float32), ValueError, "expected at least 100 values, got 10")):
        with pytest.raises(error, match=f"plane: {words}"):
            kernels.levels(bad, 100, 0.25, 0.75, 0.9, 0.98, 0.98)
        with pytest.raises(error, match=f"plane: {words}"):
            kernels.log_sum(bad, 100, 4, 0.01)
        bad.resize(200, refcheck=False)  # BufferError if the refused call still held it
    region = np.zeros(63, np.float32)
    with pytest.raises(ValueError, match="region: expected at least 64 values, got 63"):
        kernels.region_pick(region, 4)
    region.resize(70, refcheck=False)


@pytest.mark.parametrize("pattern", ["sorted", "reversed", "equal", "organ", "sawtooth",
                                     "random"])
def test_border_statistics_on_long_crafted_borders_are_numpy_partitions(pattern: str) -> None:
    """A client chooses the border values perspective selects its quartiles from: on long
    borders in orders that defeat a naive pivot, the C selection still gives numpy's exact
    order statistics (and a sort takes over past its rounds, so no order is quadratic)."""
    kernels = native.kernels
    assert kernels is not None
    n = 60_001
    ramp = np.arange(n, dtype=np.float32)
    border = {"sorted": ramp, "reversed": ramp[::-1].copy(), "equal": np.ones(n, np.float32),
              "organ": np.concatenate([ramp[: n // 2], ramp[n // 2::-1]])[:n],
              "sawtooth": ramp % 97,
              "random": np.random.default_rng(4).random(n).astype(np.float32)}[pattern]
    plane = np.zeros((n, 3), np.float32)
    plane[:, 0] = border  # the left side
    stats = kernels.borders(plane, n, 3)
    q = np.partition(border, (n // 4, n // 2, 3 * n // 4))
    assert stats[0] == float(q[n // 2])
    assert stats[1] == float((q[3 * n // 4] - q[n // 4]) * np.float32(0.5))
