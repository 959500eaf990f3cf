"""Quality signals on inputs made with known properties: a sharp scene and the same scene blurred,
darkened, over-exposed, noised or broken with NaN; texts with one known defect each; drift with a
seeded generator; the filter itself with an injected rng; and configs that must be refused."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from numpy.typing import NDArray
from PIL import Image, ImageFilter
from prometheus_client import CollectorRegistry

from filters.call_keys import UNUSABLE_MODALITIES
from filters.quality.drift import DriftConfig, DriftMonitor, compare, drift_gauges
from filters.quality.filter import Quality, QualityConfig, resolve_layout
from filters.quality.report import Item, Report
from filters.quality.scenes import OPTIONAL_SIGNALS, graphic
from filters.quality.signals import (
    IMAGE_SIGNALS,
    ImageSpec,
    Signal,
    image_signals,
    luminance,
    modality_score,
    trust_score,
    widen_float16,
)
from filters.quality.text import TEXT_SIGNALS, text_signals
from proxy.call import Call, LocalReply, Reply, Result, Target
from proxy.chain import FilterContext
from proxy.clock import ManualClock
from proxy.config.model import ConfigError, parse_config
from proxy.errors import ErrorKind
from proxy.telemetry import Telemetry
from proxy.tensor import Tensor
from tests.support import photos
from tests.support.images import scene

HWC = ImageSpec("HWC", (0.0,), (255.0,))
CHW01 = ImageSpec("CHW", (0.0,), (1.0,))


def blurred(img: NDArray[np.uint8], radius: float) -> NDArray[np.uint8]:
    return np.asarray(Image.fromarray(img).filter(ImageFilter.GaussianBlur(radius)))


def noised(img: NDArray[np.uint8], sigma: float, seed: int = 1) -> NDArray[np.uint8]:
    noisy = img / 255.0 + np.random.default_rng(seed).normal(0.0, sigma, img.shape)
    return np.asarray(np.clip(noisy, 0, 1) * 255 + 0.5, np.uint8)


def signals(img: NDArray[Any], spec: ImageSpec = HWC) -> dict[str, float]:
    return {k: s.score for k, s in image_signals(img, spec).items()}


def visual(img: NDArray[Any], spec: ImageSpec = HWC) -> float:
    return modality_score(image_signals(img, spec))[0]


# --- images -------------------------------------------------------------------------------------


def test_the_clean_scene_scores_full_marks() -> None:
    measured = [s for s in IMAGE_SIGNALS if s not in OPTIONAL_SIGNALS]  # unless a rule asks
    assert signals(scene()) == dict.fromkeys(measured, 1.0)


def test_blur_lowers_sharpness_step_by_step() -> None:
    sharp = scene()
    scores = [signals(sharp)["sharpness"]] + [signals(blurred(sharp, r))["sharpness"]
                                              for r in (1, 2, 4)]
    assert scores == sorted(scores, reverse=True) and scores[0] > scores[-1]
    assert scores[-1] == 0.0
    values = [image_signals(blurred(sharp, r), HWC)["sharpness"].value for r in (0.5, 1, 2, 4)]
    assert values == sorted(values, reverse=True)  # the raw Laplacian variance too


def test_dark_and_blown_out_versions_score_low_on_exposure() -> None:
    # A photograph: the synthetic scene is a drawing (flat colours), and a drawing's white is
    # not read as blown (the next test).
    sharp = next(c.image for c in photos.clean_set() if c.name == "chelsea")
    dark = np.asarray(sharp * 0.12, np.uint8)
    blown = np.asarray(np.clip(sharp * 3.0, 0, 255), np.uint8)
    clean = image_signals(sharp, HWC)["exposure"]
    low, high = image_signals(dark, HWC)["exposure"], image_signals(blown, HWC)["exposure"]
    assert clean.score == 1.0 and low.score < 0.3 and high.score < 0.3
    assert low.value < clean.value  # dark: the value is the mean luminance
    assert "mean luminance" in low.what and "blown" in high.what  # blown: the blown share


def test_white_reached_without_a_gradient_reads_as_a_drawing_not_as_blown() -> None:
    # Flat colours with white that no ramp of tones leads to: a light-mode screenshot, clip art.
    # The synthetic scene blown 3x is such a picture too, and is read the same way: the cost of
    # not flagging white UIs (docs/quality.md, "False positives").
    drawn = np.asarray(np.clip(scene() * 3.0, 0, 255), np.uint8)
    plane = luminance(drawn, HWC)
    assert graphic(plane, 0.0) == 1.0 and image_signals(drawn, HWC)["exposure"].score >= 0.5
    for name, ui in photos.screenshots(4):
        assert image_signals(ui, HWC)["exposure"].score >= 0.5, name
    # A photograph's neighbours differ (sensor noise, texture): never a drawing, however blown.
    chelsea = next(c.image for c in photos.clean_set() if c.name == "chelsea")
    for gain in (1.5, 2.0, 3.0):
        blown = np.asarray(np.clip(chelsea * gain, 0, 255), np.uint8)
        assert graphic(luminance(blown, HWC), 0.0) == 0.0, gain


def test_added_noise_lowers_the_noise_score_monotonically() -> None:
    sharp = scene()
    scores = [signals(noised(sharp, s))["noise"] for s in (0.0, 0.02, 0.05, 0.08)]
    assert scores == sorted(scores, reverse=True)
    assert scores[0] > 0.95 and scores[-1] < 0.5
    sigma = image_signals(noised(sharp, 0.05), HWC)["noise"].value
    assert 0.025 < sigma < 0.06  # Immerkær's estimate of σ = 0.05 (less what clipping ate)


def test_nan_and_inf_are_counted_and_fail_finite() -> None:
    img = (scene().transpose(2, 0, 1) / 255.0).astype(np.float32)
    img[0, :2, :5] = np.nan
    img[1, 100, 100] = np.inf
    found = image_signals(img, CHW01)
    assert found["finite"] == Signal(0.0, 11.0, "NaN/Inf values")
    assert all(0.0 <= s.score <= 1.0 for s in found.values())
    assert found["range"].score == 1.0  # NaN/Inf are finite's business, not range's


def test_a_constant_image_is_caught() -> None:
    flat = np.full((224, 224, 3), 128, np.uint8)
    found = image_signals(flat, HWC)
    assert found["constant"].score == 0.0 and found["sharpness"].score == 0.0
    assert found["range"].score == 1.0


def test_value_range_catches_the_wrong_scale() -> None:
    f01 = (scene().transpose(2, 0, 1) / 255.0).astype(np.float32)
    assert signals(f01, CHW01)["range"] == 1.0
    raw = f01 * 255  # 0-255 sent to a model that reads [0, 1]
    wrong = image_signals(raw, CHW01)["range"]
    assert wrong.score == 0.0 and wrong.value > 0.9 and "outside [0, 1]" in wrong.what
    tiny = image_signals(f01, ImageSpec("CHW", (0.0,), (255.0,)))["range"]  # [0,1] to 0-255
    assert tiny.score < 0.3 and "spanned" in tiny.what
    mean, std = np.array([0.48, 0.46, 0.41]), np.array([0.27, 0.26, 0.28])
    normalised = ((f01 - mean[:, None, None]) / std[:, None, None]).astype(np.float32)
    spec = ImageSpec("CHW", tuple(-mean / std), tuple((1 - mean) / std))
    assert signals(normalised, spec) == signals(f01, CHW01) | {"range": 1.0}
    assert signals(normalised, CHW01)["range"] < 0.5


def test_layouts_and_dtypes_measure_the_same_picture_alike() -> None:
    hwc = scene()
    chw = (hwc.transpose(2, 0, 1) / 255.0).astype(np.float32)
    ref = {k: round(v, 3) for k, v in signals(hwc).items()}
    cases: list[tuple[NDArray[Any], ImageSpec]] = [
        (chw, CHW01), (chw.astype(np.float16), CHW01),
        (np.ascontiguousarray(chw.transpose(1, 2, 0)), ImageSpec("HWC", (0.0,), (1.0,)))]
    for arr, spec in cases:
        assert {k: round(v, 3) for k, v in signals(arr, spec).items()} == ref


def test_size_is_normalised_to_the_encoder_scale() -> None:
    small = scene()
    big = small.repeat(2, axis=0).repeat(2, axis=1)  # 448 px: each pixel a 2 x 2 block
    a, b = image_signals(small, HWC), image_signals(big, HWC)
    assert a["sharpness"].value == pytest.approx(b["sharpness"].value, rel=1e-4)
    assert a["noise"].value == pytest.approx(b["noise"].value, rel=1e-3, abs=1e-6)


def test_the_visual_score_orders_every_degradation_below_the_clean_scene() -> None:
    sharp = scene()
    nan = (sharp / 255.0).astype(np.float32)
    nan[0, 0, 0] = np.nan
    clean = visual(sharp)
    degraded = {"blurred": visual(blurred(sharp, 3)), "dark": visual(np.asarray(sharp * 0.1,
                                                                                np.uint8)),
                # as a camera takes it (a little sensor noise): blown, a photograph, not a
                # drawing, whose flat white is not read as blown (test above)
                "blown": visual(np.asarray(np.clip(noised(sharp, 0.01) * 3.0, 0, 255),
                                           np.uint8)),
                "noised": visual(noised(sharp, 0.08)),
                "nan": visual(nan, ImageSpec("HWC", (0.0,), (1.0,)))}
    assert all(v < 0.5 < clean for v in degraded.values()), degraded


def test_float16_is_widened_exactly_as_numpy_casts_it() -> None:
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    image = every[: 3 * 128 * 128].reshape(3, 128, 128)  # NaN, ±Inf and subnormals included
    assert np.array_equal(widen_float16(image), image.astype(np.float32), equal_nan=True)
    assert np.array_equal(widen_float16(every), every.astype(np.float32), equal_nan=True)
    sharp = (scene().transpose(2, 0, 1) / 255.0).astype(np.float16)
    assert image_signals(sharp, CHW01) == image_signals(sharp.astype(np.float32), CHW01)


def test_a_rule_reads_the_score_its_sentence_reports() -> None:
    report = Report()
    report.add(Item("image", "input 'a'", image_signals(scene(), HWC)))
    report.add(Item("image", "input 'b'", image_signals(blurred(scene(), 3), HWC)))
    report.add(Item("text", "input 't'", text_signals("a sentence of words", 1, 100)))
    weights = {"visual": 0.4, "text": 0.3, "alignment": 0.3}
    for name in (*IMAGE_SIGNALS, *TEXT_SIGNALS, "image", "text", "alignment", "trust"):
        found = report.find(name, weights)
        assert report.score(name, weights) == (None if found is None else found.score), name


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 12), st.integers(1, 12), st.just(3)),
              elements=st.floats(width=32, allow_nan=True, allow_infinity=True)))
def test_every_score_is_finite_and_in_unit_range(img: NDArray[np.float32]) -> None:
    for s in image_signals(img, ImageSpec("HWC", (0.0,), (1.0,))).values():
        assert 0.0 <= s.score <= 1.0 and np.isfinite(s.score)


@pytest.mark.parametrize(("shape", "layout", "found"), [
    ((1, 3, 224, 224), "auto", ("CHW", True)), ((2, 224, 224, 3), "auto", ("HWC", True)),
    ((3, 32, 32), "auto", ("CHW", False)), ((32, 32), "auto", ("HW", False)),
    ((1, 3, 8, 8), "NHWC", ("HWC", True)), ((3, 8, 8), "NCHW", None),
    ((5, 7, 9), "auto", None), ((10,), "auto", None)])
def test_layouts_resolve_from_shape_or_config(shape: tuple[int, ...], layout: str,
                                              found: tuple[str, bool] | None) -> None:
    assert resolve_layout(shape, layout) == found


# --- texts --------------------------------------------------------------------------------------

GOOD = "A small red bicycle leans against a brick wall in the late afternoon sun, near a cafe."
BAD = {
    "empty": " \n\t  ",
    "control": "hello\x00\x01\x02 world\x07\x1b there",
    "replacement": "caf\ufffd au lait \ufffd and cr\ufffdme br\ufffdl\ufffde",
    "symbols": "~|]l;:,.-_ ,.;' |||| }{ ~~ ^^ ..,, ;; '' [] ~|| ?",
    "repetition": "what is this " + "the " * 14 + "thing",
    "script": "pаypal lоgin: vеrify уour ассount nоw",  # Cyrillic look-alikes inside words
    "length": "x" * 300,
}


def test_a_clean_text_scores_full_marks() -> None:
    assert {k: s.score for k, s in text_signals(GOOD).items()} == dict.fromkeys(TEXT_SIGNALS,
                                                                                 1.0)


@pytest.mark.parametrize("signal", sorted(BAD))
def test_each_defect_is_caught_by_its_own_signal(signal: str) -> None:
    found = text_signals(BAD[signal], min_chars=1, max_chars=100)
    assert found[signal].score < 0.5, found[signal]
    assert modality_score(found)[0] < 0.5


def test_invalid_utf8_bytes_count_as_invalid_characters() -> None:
    text = b"caf\xe9 au lait \xff\xfe ok".decode("utf-8", "surrogateescape")
    found = text_signals(text)["control"]
    assert found.value == 3 and found.score < 0.5


def test_ordinary_script_mixing_is_not_flagged() -> None:
    for text in ("Tシャツを買った。 東京で iPhone を見た", "Привет, мир! Hello, world!",
                 "Der Straßenbahnfahrer sagte: «Guten Morgen»", "a 5µm filter at 3K, Nº 4"):
        assert text_signals(text)["script"].score == 1.0, text


def test_repeats_of_short_sequences_are_counted() -> None:
    assert text_signals("go on " * 8)["repetition"].value == 8
    assert text_signals("one two three " * 5)["repetition"].value == 5
    assert text_signals(GOOD)["repetition"].value == 1


# --- scores -------------------------------------------------------------------------------------


def test_trust_renormalises_over_the_parts_present() -> None:
    w = {"visual": 0.4, "text": 0.3, "alignment": 0.3}
    assert trust_score({"visual": 1.0, "text": 0.5, "alignment": 0.0}, w) == pytest.approx(0.55)
    assert trust_score({"visual": 0.5, "text": None, "alignment": None}, w) == 0.5
    assert trust_score({"visual": 1.0, "text": 0.0, "alignment": None}, w) == pytest.approx(4 / 7)
    assert trust_score({"visual": None, "text": None, "alignment": None}, w) is None


def test_a_report_finds_the_worst_item_per_signal() -> None:
    report = Report()
    report.add(Item("image", "input 'a' image 0", image_signals(scene(), HWC)))
    report.add(Item("image", "input 'a' image 1", image_signals(blurred(scene(), 3), HWC)))
    found = report.find("sharpness", {})
    assert found is not None and found.modality == "image"
    assert found.detail.startswith("input 'a' image 1: signal 'sharpness' is 0.000")
    assert report.find("text", {}) is None and report.find("alignment", {}) is None
    assert "sharpness=0.000" in report.summary({"visual": 0.4})


# --- drift --------------------------------------------------------------------------------------


def test_compare_matches_the_definitions() -> None:
    a = np.sort(np.zeros(10))
    assert compare(a, np.full(10, 0.3)) == pytest.approx((0.3, 1.0))
    assert compare(a, np.zeros(5)) == (0.0, 0.0)
    b = np.sort(np.array([0.0, 1.0]))
    assert compare(b, np.array([0.0, 0.0, 1.0, 1.0])) == (0.0, 0.0)
    assert compare(b, np.array([1.0, 1.0])) == pytest.approx((0.5, 0.5))


def drift_value(registry: CollectorRegistry, name: str, signal: str) -> float | None:
    return registry.get_sample_value(name, {"model": "m", "modality": "image",
                                            "signal": signal})


def test_drift_stays_flat_on_the_same_distribution_and_rises_on_a_shift() -> None:
    rng = np.random.default_rng(7)
    registry = CollectorRegistry()
    cfg = DriftConfig(baseline_size=400, window=200, every=50)
    monitor = DriftMonitor("m", cfg, drift_gauges(registry))
    for v in rng.beta(8, 2, 400):
        monitor.observe("image", "sharpness", float(v))
    assert monitor.dirty
    flat = []
    for v in rng.beta(8, 2, 600):
        monitor.observe("image", "sharpness", float(v))
        monitor.update()
        flat.append(drift_value(registry, "mmguard_input_drift", "sharpness"))
    assert flat[198] is None and flat[199] is not None  # only once the window is full
    assert max(x for x in flat if x is not None) < 0.05  # the seeds' baseline: 0.03 ± 0.02
    for v in rng.beta(3, 3, 200):  # blurrier inputs: the mean drops from 0.8 to 0.5
        monitor.observe("image", "sharpness", float(v))
        monitor.update()
    shifted = drift_value(registry, "mmguard_input_drift", "sharpness")
    ks = drift_value(registry, "mmguard_input_drift_ks", "sharpness")
    assert shifted is not None and shifted > 0.28  # past the seeds' critical threshold
    assert ks is not None and ks > 0.5


def test_a_baseline_is_saved_and_loaded_back(tmp_path: Path) -> None:
    path = tmp_path / "baselines" / "route.json"
    cfg = DriftConfig(baseline_size=4, window=2, every=1, baseline_file=path)
    registry = CollectorRegistry()
    first = DriftMonitor("m", cfg, drift_gauges(registry))
    for v in (0.9, 0.8, 0.7, 1.0):
        first.observe("image", "noise", v)
    first.save(first.snapshot())
    assert json.loads(path.read_text())["series"] == {"image/noise": [0.7, 0.8, 0.9, 1.0]}
    again = DriftMonitor("m", cfg, drift_gauges(registry))  # same registry: gauges shared
    for v in (0.1, 0.1):
        again.observe("image", "noise", v)
    again.update()  # no relearning: the window compares with the loaded baseline at once
    assert drift_value(registry, "mmguard_input_drift", "noise") == pytest.approx(0.75)


def test_an_unreadable_baseline_is_relearned(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    monitor = DriftMonitor("m", DriftConfig(baseline_size=2, baseline_file=path),
                           drift_gauges(CollectorRegistry()))
    monitor.observe("text", "empty", 1.0)
    assert not monitor.dirty
    monitor.observe("text", "empty", 1.0)
    assert monitor.dirty


# --- the filter, with an injected rng -----------------------------------------------------------


def make_filter(cfg: dict[str, Any], seed: int = 0) -> tuple[Quality, Telemetry]:
    telemetry = Telemetry()
    ctx = FilterContext("m", telemetry, ManualClock(), random.Random(seed), lambda: None)
    return Quality(QualityConfig.model_validate(cfg), ctx), telemetry


def image_call(img: NDArray[np.uint8]) -> Call:
    chw = np.ascontiguousarray((img.transpose(2, 0, 1) / 255.0)[None], np.float32)
    return Call("m", "", [Tensor.from_numpy("pixel_values", chw)], target=Target("b", "m"))


async def answer(call: Call) -> Reply:
    return Result("m")


async def test_drop_modality_marks_the_call_and_goes_on() -> None:
    quality, _ = make_filter({"images": {"pixel_values": {}}, "drift": None, "rules": [
        {"signal": "image", "below": 0.5, "action": "drop-modality"}]})
    call = image_call(np.asarray(scene() * 0.05, np.uint8))
    assert isinstance(await quality(call, answer), Result)
    reason = call.state[UNUSABLE_MODALITIES]["image"]
    assert reason.startswith("input 'pixel_values' image 0: image score is 0.000 (weakest "
                             "signal '")
    assert call.decisions["mmguard-quality-image"].startswith("drop-modality; ")
    clean = image_call(scene())
    await quality(clean, answer)
    assert UNUSABLE_MODALITIES not in clean.state
    assert clean.decisions["mmguard-quality-scores"].startswith("scored; trust=1.000 image=1.000")


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BF16", "UINT8"])
async def test_every_image_datatype_reads_the_same_picture(datatype: str) -> None:
    img = blurred(scene(), 1)
    f32 = np.ascontiguousarray((img.transpose(2, 0, 1) / 255.0)[None], np.float32)
    forms: dict[str, NDArray[Any]] = {
        "FP32": f32, "FP16": f32.astype(np.float16),
        "BF16": (f32.view(np.uint32) >> 16).astype(np.uint16),  # bfloat16 bits, truncated
        "UINT8": np.ascontiguousarray(img.transpose(2, 0, 1)[None])}
    raw = forms[datatype]
    quality, _ = make_filter({"images": {"pixel_values": {}}, "drift": None})
    call = Call("m", "", [Tensor("pixel_values", datatype, raw.shape, raw=raw.tobytes())],
                target=Target("b", "m"))
    await quality(call, answer)
    got = dict(kv.split("=") for kv in call.decisions["mmguard-quality-scores"][8:].split())
    ref = signals(img)
    assert {k: float(got[k]) for k in ref} == pytest.approx(ref, abs=0.02)


async def test_reject_names_the_signal_its_value_and_the_threshold() -> None:
    quality, telemetry = make_filter({"images": {"pixel_values": {}}, "drift": None, "rules": [
        {"signal": "sharpness", "below": 0.4, "action": "reject"}]})
    call = image_call(blurred(scene(), 4))
    reply = await quality(call, answer)
    assert isinstance(reply, LocalReply) and reply.kind is ErrorKind.UNPROCESSABLE
    assert reply.message.startswith("quality: input 'pixel_values' image 0: signal 'sharpness' "
                                    "is 0.000 (")
    assert "second/first difference energy, lower axis" in reply.message
    assert reply.message.endswith("), below the threshold 0.4")
    assert telemetry.registry.get_sample_value("mmguard_filter_decisions_total", {
        "filter": "quality", "model": "m", "decision": "sharpness:reject"}) == 1


async def test_sampling_scores_the_configured_share() -> None:
    quality, _ = make_filter({"images": {"pixel_values": {}}, "sample": 0.25, "drift": None},
                             seed=3)
    img = scene(64)
    decisions = []
    for _ in range(400):
        call = image_call(img)
        await quality(call, answer)
        decisions.append(call.decisions["mmguard-quality-scores"].split(";")[0])
    assert 70 < decisions.count("scored") < 130
    assert decisions.count("scored") + decisions.count("unsampled") == 400


# --- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "problem"), [
    ({"rules": [{"signal": "blurriness", "below": 0.5, "action": "reject"}]},
     "unknown signal 'blurriness'"),
    ({"rules": [{"signal": "trust", "below": 0.5, "action": "drop-modality"}]},
     "drop-modality needs an image or text signal"),
    ({"rules": [{"signal": "image", "below": 1.5, "action": "reject"}]},
     "less than or equal to 1"),
    ({"rules": [{"signal": "alignment", "below": 0.5, "action": "annotate"}]},
     "a rule on 'alignment' needs the alignment section"),
    ({"images": {"x": {"mean": [0.5]}}}, "mean and std go together"),
    ({"images": {"x": {"range": [1, 0]}}}, "range must be [low, high]"),
    ({"images": {"x": {}}, "texts": {"x": {}}}, "inputs cannot be both image and text"),
    ({"sample": 2}, "less than or equal to 1"),
    ({"drift": {"window": 1}}, "greater than or equal to 2"),
    ({"alignment": {"image_encoder": "/nonexistent.onnx", "text_encoder": "/n.onnx"}},
     "Path does not point to a file"),
    ({"colour": True}, "Extra inputs are not permitted"),
])
def test_bad_configs_are_refused_with_their_path(options: dict[str, Any], problem: str) -> None:
    doc = {"backends": [{"kind": "onnxruntime", "name": "ort", "model_dir": "/tmp"}],
           "models": [{"name": "m", "backend": "ort", "filters": [{"quality": options}]}]}
    with pytest.raises(ConfigError) as exc:
        parse_config(doc)
    text = str(exc.value)
    assert "models[0].filters[0].quality" in text and problem in text, text
