"""The edge scenes and canary eligibility through a real front and a real Triton (clip_demo over
Triton's gRPC): a phone photo of a screen (at an angle, or square on with moiré), a ghosted
frame, a frame carrying a faint copy of the frame before it in the same batch (residue), a
washed-out photograph (a bright tone curve, opt-in) and a shaken photograph (at the
default rules; and the real shaken clock) made from
real photographs are annotated, their clean sources are not; with
``canary.eligible`` on the quality filter's alignment, only well-aligned calls become canary
traffic (a fault experiment on canary traffic hits them and nothing else), the shadow mirrors
only them, and its snapshot names the population its verdict judges."""

from __future__ import annotations

import json
import queue
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from numpy.typing import NDArray
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_quality import (
    alignment,
    answer,
    clip_inputs,
    ids,
    pixels,
    scores,
    t,
    tinted,
    write_encoder_pair,
)
from tests.support import photos
from tests.support.images import scene
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.wire import grpc_infer_raw, grpc_request, http_binary_body, http_post

ELIGIBLE = 0.85  # the source documents' gray release: alignment above 0.85 first


def photo(name: str) -> Any:
    return next(c.image for c in photos.clean_set() if c.name == name)


@pytest.fixture(scope="module")
def proxy(triton: TritonServer, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[RunningMmguard]:
    encoders = write_encoder_pair(tmp_path_factory.mktemp("encoders"))

    def quality(**options: Any) -> dict[str, Any]:
        return {"quality": {"images": {"pixel_values": {}}, "drift": None, **options}}

    aligned = quality(alignment=alignment(encoders, text_input="input_ids"), rules=[])
    rules = [{"signal": "perspective", "below": 0.5, "action": "annotate"},
             {"signal": "ghosting", "below": 0.5, "action": "annotate"},
             {"signal": "moire", "below": 0.5, "action": "annotate"},
             {"signal": "washout", "below": 0.5, "action": "annotate"},
             {"signal": "sharpness", "below": 0.5, "action": "annotate"}]
    abort = {"name": "gray", "actions": [{"kind": "abort", "grpc_code": "UNAVAILABLE",
                                          "http_status": 503, "message": "canary fault"}]}
    cfg: dict[str, Any] = {
        "backends": [{"kind": "triton_grpc", "name": "triton", "url": triton.grpc_url}],
        "models": [
            {"name": "scenes", "backend": "triton", "backend_model": "clip_demo",
             "filters": [quality(rules=rules)]},
            {"name": "defaults", "backend": "triton", "backend_model": "clip_demo",
             "filters": [quality()]},  # the shipped default rules
            {"name": "screens", "backend": "triton", "backend_model": "clip_demo",
             "filters": [quality(intent="screens")]},  # the defaults, moiré and ghosting
            {"name": "gray", "backend": "triton", "backend_model": "clip_demo",
             "filters": [aligned, {"fault": {"experiments": [abort]}}]},
            {"name": "mirrored", "backend": "triton", "backend_model": "clip_demo",
             "filters": [aligned, {"shadow": {"canary": "mirrored_canary"}}]},
            {"name": "mirrored_canary", "backend": "triton", "backend_model": "clip_demo",
             "filters": []},
        ],
        "canary": {"share": 1.0, "eligible": [{"score": "quality.alignment",
                                               "at_least": ELIGIBLE}]},
        # the tests read the mmguard-fault trailer, which only a listener showing treatment sends
        "listeners": {"grpc": {"treatment_headers": True, "client_header": "x-client-id"}},
    }
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        yield m


def quality_notes(trailers: dict[str, str]) -> dict[str, str]:
    return {k.removeprefix("mmguard-quality-"): v for k, v in trailers.items()
            if k.startswith("mmguard-quality-") and k != "mmguard-quality-scores"}


def annotated(proxy: RunningMmguard, route: str, signal: str, source: NDArray[np.uint8],
              bad_image: NDArray[np.uint8]) -> str:
    """The clean source passes ``route`` with no note of ``signal`` and a full score; the bad
    image still gets the model's answer and ``signal``'s annotation, which is returned."""
    _, clean = answer(proxy.grpc_url, route, clip_inputs(source))
    assert signal not in quality_notes(clean), clean
    assert scores(clean["mmguard-quality-scores"])[signal] == 1.0
    resp, bad = answer(proxy.grpc_url, route, clip_inputs(bad_image))
    assert resp.outputs  # annotated, not refused: the model still answers
    note = quality_notes(bad)[signal]
    assert note.startswith(f"annotate; input 'pixel_values' image 0: signal '{signal}' is "), note
    return note


@pytest.mark.parametrize("name", ["astronaut", "coffee", "chelsea"])
def test_a_screen_photo_is_annotated_and_its_clean_source_is_not(
        proxy: RunningMmguard, name: str) -> None:
    source = photo(name)
    screen = photos.perspective(source, 0.2, np.random.default_rng(7))
    resp, clean = answer(proxy.grpc_url, "scenes", clip_inputs(source))
    assert resp.outputs and quality_notes(clean) == {}, clean
    note = annotated(proxy, "scenes", "perspective", source, screen)
    assert note.startswith("annotate; input 'pixel_values' image 0: signal 'perspective' is 0.")
    assert "leaning straight margin edges" in note and note.endswith("threshold 0.5")


@pytest.mark.parametrize(("name", "opacity"), [("astronaut", 0.25), ("rocket", 0.25),
                                               ("coffee", 0.25), ("chelsea", 0.15)])
def test_a_ghosted_frame_is_annotated_and_its_clean_source_is_not(
        proxy: RunningMmguard, name: str, opacity: float) -> None:
    source = photo(name)
    ghosted = _ghosted(source, opacity)
    _, clean = answer(proxy.grpc_url, "scenes", clip_inputs(source))
    assert "ghosting" not in quality_notes(clean), clean
    resp, bad = answer(proxy.grpc_url, "scenes", clip_inputs(ghosted))
    assert resp.outputs
    note = quality_notes(bad)["ghosting"]
    assert note.startswith("annotate; input 'pixel_values' image 0: signal 'ghosting' is ")
    # the lag either way round (the cepstrum is symmetric); echo.py reports dy >= 0
    assert "cepstral echo off zero, over its spread (at +5, +9 px)" in note \
        or "(at -5, -9 px)" in note, note


@pytest.mark.parametrize("name", ["astronaut", "coffee", "chelsea"])
def test_moire_of_a_screen_is_annotated_and_its_clean_source_is_not(
        proxy: RunningMmguard, name: str) -> None:
    source = photo(name)
    screen = photos.moire(source, 0.7, np.random.default_rng(4))
    note = annotated(proxy, "scenes", "moire", source, screen)
    # read in the whole frame or in its regions, whichever reads it lower (moire.py)
    assert "twin spectral peaks" in note and " (period " in note, note
    assert note.endswith("threshold 0.5"), note


def test_a_screen_photographed_at_an_angle_is_annotated_by_its_moire_in_regions(
        proxy: RunningMmguard) -> None:
    # the screen fills the frame (no bezel for perspective) and is keystoned: its beat is
    # chirped across the frame, so the whole frame's peaks spread; 128² regions still read it
    source = photo("coffee")
    rng = np.random.default_rng(2)
    angled = photos.keystone(photos.moire(source, 0.4, rng), 0.2, rng)
    note = annotated(proxy, "scenes", "moire", source, angled)
    assert "twin spectral peaks in 2 of 4 regions (period" in note, note


def _ghosted(source: NDArray[np.uint8], opacity: float) -> NDArray[np.uint8]:
    h, w = source.shape[:2]
    shifted = source[np.clip(np.arange(h) - 9, 0, h - 1)][:, np.clip(np.arange(w) - 5, 0, w - 1)]
    return np.asarray((1 - opacity) * source + opacity * shifted).round().astype(np.uint8)


@pytest.mark.parametrize("name", ["astronaut", "coffee", "chelsea"])
def test_the_screens_intent_annotates_moire_and_ghosting_and_the_default_intent_does_not(
        proxy: RunningMmguard, name: str) -> None:
    """``quality: {intent: screens}`` (no rules listed) turns on the two scene signals of phone
    pictures of screens and OCR residue at their documented points; the clean source passes
    with no note at all. The default intent ('photos') does not measure either."""
    source = photo(name)
    resp, clean = answer(proxy.grpc_url, "screens", clip_inputs(source))
    assert resp.outputs and quality_notes(clean) == {}, clean
    measured = scores(clean["mmguard-quality-scores"])
    assert measured["moire"] >= 0.5 and measured["ghosting"] >= 0.5, measured  # measured
    screen = photos.moire(source, 0.7, np.random.default_rng(4))
    ghosted = _ghosted(source, 0.25)
    for bad, signal in ((screen, "moire"), (ghosted, "ghosting")):
        resp, notes = answer(proxy.grpc_url, "screens", clip_inputs(bad))
        assert resp.outputs  # annotated, not refused
        note = quality_notes(notes)[signal]
        assert note.startswith(f"annotate; input 'pixel_values' image 0: signal '{signal}' is "
                               ) and note.endswith("threshold 0.5"), note
        _, default = answer(proxy.grpc_url, "defaults", clip_inputs(bad))
        assert signal not in quality_notes(default), default
        assert signal not in scores(default["mmguard-quality-scores"]), default


def _batch(*images: NDArray[np.uint8]) -> list[Any]:
    """clip_demo inputs for a batch of pictures (one token row each)."""
    return [t("pixel_values", np.concatenate([pixels(x) for x in images])),
            t("input_ids", np.concatenate([ids(1) for _ in images]))]


@pytest.mark.parametrize(("earlier", "later"), [("astronaut", "coffee"), ("chelsea", "rocket"),
                                                ("coffee", "camera")])
def test_a_frame_carrying_a_faint_copy_of_the_frame_before_it_is_annotated(
        proxy: RunningMmguard, earlier: str, later: str) -> None:
    """The screens intent compares the images of one request: a batch whose second picture
    carries 10 % of the first (a page left on the scanner, OCR residue) is annotated on that
    picture, naming the one it carries; the same two clean pictures pass with a full score;
    the default intent does not measure it. Triton answers the whole batch each time."""
    first, second = photo(earlier), photo(later)
    resp, clean = answer(proxy.grpc_url, "screens", _batch(first, second))
    assert resp.outputs and resp.outputs[0].shape[0] == 2, resp
    assert quality_notes(clean) == {}, clean
    assert scores(clean["mmguard-quality-scores"])["residue"] == 1.0
    mixed = np.clip(0.9 * second + 0.1 * first.astype(np.float64) + 0.5, 0, 255)
    carrying = mixed.astype(np.uint8)
    resp, bad = answer(proxy.grpc_url, "screens", _batch(first, carrying))
    # annotated, not refused
    assert resp.outputs and resp.outputs[0].shape[0] == 2, resp
    note = quality_notes(bad)["residue"]
    assert note.startswith("annotate; input 'pixel_values' image 1: signal 'residue' is 0."), note
    assert "edge-sign correlation with input 'pixel_values' image 0," in note, note
    assert note.endswith("threshold 0.5"), note
    _, default = answer(proxy.grpc_url, "defaults", _batch(first, carrying))
    assert "residue" not in quality_notes(default), default
    assert "residue" not in scores(default["mmguard-quality-scores"]), default


def _stream(proxy: RunningMmguard, frames: list[NDArray[np.uint8]]) -> int:
    """Sends ``frames`` one request each over one gRPC stream (tritonclient's), as a video
    client does, to the screens route; every frame must be answered. Returns how many residue
    annotations the route made meanwhile (a stream message carries no trailers: the
    decision is counted, and logged at DEBUG)."""
    labels = {"filter": "quality", "model": "screens", "decision": "residue:annotate"}
    before = metric(proxy, "mmguard_filter_decisions_total", **labels)
    client = grpcclient.InferenceServerClient(proxy.grpc_url)
    got: queue.Queue[object] = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put(error or result))
    try:
        for i, frame in enumerate(frames):
            px = grpcclient.InferInput("pixel_values", [1, 3, 224, 224], "FP32")
            px.set_data_from_numpy(pixels(frame))
            tokens = grpcclient.InferInput("input_ids", [1, 77], "INT64")
            tokens.set_data_from_numpy(ids(1))
            client.async_stream_infer("screens", [px, tokens], request_id=f"frame{i}")
        answers = [got.get(timeout=30) for _ in frames]
    finally:
        client.stop_stream()
        client.close()
    for item in answers:
        assert isinstance(item, grpcclient.InferResult), item  # annotated, not refused
        assert item.as_numpy("image_embeds") is not None
    return int(metric(proxy, "mmguard_filter_decisions_total", **labels) - before)


def test_a_streamed_frame_carrying_the_frame_before_it_is_annotated_in_its_stream_only(
        proxy: RunningMmguard) -> None:
    """A video sent frame by frame over one ModelStreamInfer stream: the screens intent
    compares each frame with the stream's frames before it. A frame carrying 10 % of the one
    before is annotated once; the same clean frames are not; and the carrying frame sent on a
    stream of its own is not compared with any other stream's frames (a stream is one
    client's: nothing crosses between clients)."""
    a, b, c = photo("astronaut"), photo("coffee"), photo("chelsea")
    carrying = np.clip(0.9 * b + 0.1 * a.astype(np.float64) + 0.5, 0, 255).astype(np.uint8)
    assert _stream(proxy, [a, b, c]) == 0
    assert _stream(proxy, [a, carrying, c]) == 1
    assert _stream(proxy, [a]) == 0
    assert _stream(proxy, [carrying]) == 0  # the frame it carries came in another stream


def test_a_named_clients_next_unary_request_is_compared_with_its_last(
        proxy: RunningMmguard) -> None:
    """The gRPC listener names the client header a gateway sets (``client_header``): a
    client's unary request whose picture carries 10 % of the one it sent before is annotated,
    naming that request; another client's, or a request without the header, is not compared
    with it; on the HTTP listener, which names no client header, the header links nothing."""
    a, b = photo("astronaut"), photo("coffee")
    mixed = np.clip(0.9 * b + 0.1 * a.astype(np.float64) + 0.5, 0, 255).astype(np.uint8)
    body = grpc_request("screens", clip_inputs(a))
    grpc_infer_raw(proxy.grpc_url, body, metadata=(("x-client-id", "page-scanner-1"),))
    carrying = grpc_request("screens", clip_inputs(mixed))
    for metadata in ((("x-client-id", "page-scanner-2"),), ()):
        _, trailers = grpc_infer_raw(proxy.grpc_url, carrying, metadata=metadata)
        assert "residue" not in quality_notes(dict(trailers)), trailers
    _, trailers = grpc_infer_raw(proxy.grpc_url, carrying,
                                 metadata=(("x-client-id", "page-scanner-1"),))
    note = quality_notes(dict(trailers))["residue"]
    assert note.startswith("annotate; input 'pixel_values' image 0: signal 'residue' is 0."), note
    assert ("edge-sign correlation with input 'pixel_values' image 0 of the client's scored "
            "request 1," in note), note
    head_and_body = [http_binary_body(clip_inputs(x)) for x in (a, mixed)]
    for body_bytes, length in head_and_body:
        status, headers, _ = http_post(
            proxy.http_url, "/v2/models/screens/infer", body_bytes,
            {"x-client-id": "page-scanner-3", "Content-Type": "application/octet-stream",
             "Inference-Header-Content-Length": str(length)})
        assert status == 200, headers
    lower = {k.lower(): v for k, v in headers.items()}
    assert "mmguard-quality-residue" not in lower, headers
    assert "residue" not in scores(lower["mmguard-quality-scores"]), headers  # not compared


@pytest.mark.parametrize("name", ["chelsea", "grass", "brick"])
def test_a_washed_out_photo_is_annotated_and_its_clean_source_is_not(
        proxy: RunningMmguard, name: str) -> None:
    """A bright tone curve (value^0.5) on a route whose rules name the opt-in washout signal."""
    source = photo(name)
    _, clean = answer(proxy.grpc_url, "scenes", clip_inputs(source))
    assert "washout" not in quality_notes(clean), clean
    assert scores(clean["mmguard-quality-scores"])["washout"] >= 0.5
    resp, bad = answer(proxy.grpc_url, "scenes",
                       clip_inputs(photos.gamma(source, 0.5, np.random.default_rng(0))))
    assert resp.outputs  # annotated, not refused
    note = quality_notes(bad)["washout"]
    assert note.startswith("annotate; input 'pixel_values' image 0: signal 'washout' is 0."), note
    assert note.endswith("threshold 0.5"), note


@pytest.mark.parametrize("name", ["astronaut", "coffee", "chelsea"])
def test_a_shaken_photo_is_annotated_at_the_defaults_and_its_clean_source_is_not(
        proxy: RunningMmguard, name: str) -> None:
    """Camera shake with the sensor's noise added after the blur (as a camera adds it), on the
    route with the shipped default rules: the 'shake' rule annotates it, no rule fires on the
    clean source."""
    source = photo(name)
    shaken = photos.motion_angle(source, 0.0, np.random.default_rng(3))
    _, clean = answer(proxy.grpc_url, "defaults", clip_inputs(source))
    assert quality_notes(clean) == {}, clean  # no rule at all fires on the clean source
    note = annotated(proxy, "defaults", "shake", source, shaken)
    assert note.startswith("annotate; input 'pixel_values' image 0: signal 'shake' is 0."), note
    assert "noise-free edge ratio" in note and note.endswith("threshold 0.5"), note


def test_the_real_camera_shake_is_annotated_at_the_defaults(proxy: RunningMmguard) -> None:
    """scikit-image's clock, photographed while the camera moved: whole and four crops."""
    for view, img in photos.camera_shake():
        resp, trailers = answer(proxy.grpc_url, "defaults", clip_inputs(img))
        assert resp.outputs
        assert "shake" in quality_notes(trailers), (view, trailers)


def metric(m: RunningMmguard, name: str, **labels: str) -> float:
    with urllib.request.urlopen(m.admin_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


def red_call(token: int) -> list[Any]:
    return clip_inputs(tinted(scene(seed=4), (1.0, 0.2, 0.2)), ids(token))  # 1 red, 3 blue


def test_only_well_aligned_calls_enter_the_canary_share(proxy: RunningMmguard) -> None:
    hit, served = [], []
    for i in range(8):
        token = 1 if i % 2 == 0 else 3
        request = grpc_request("gray", red_call(token))
        try:
            _, trailers = grpc_infer_raw(proxy.grpc_url, request,
                                         metadata=(("x-request-id", f"gray-{i}"),))
            served.append((token, scores(dict(trailers)["mmguard-quality-scores"])))
        except grpc.RpcError as err:
            assert err.code() is grpc.StatusCode.UNAVAILABLE, err
            assert dict(err.trailing_metadata() or ())["mmguard-fault"].startswith("gray/")
            hit.append(token)
    # share 1.0: every call is in the share, but only the aligned ones may enter it
    assert hit == [1, 1, 1, 1]
    assert [t for t, _ in served] == [3, 3, 3, 3]
    assert all(s["alignment"] < ELIGIBLE for _, s in served)
    assert metric(proxy, "mmguard_canary_eligibility_calls_total", model="gray") == 8
    assert metric(proxy, "mmguard_canary_eligibility_judged_total", model="gray",
                  eligible="true") == 4
    assert metric(proxy, "mmguard_canary_eligibility_judged_total", model="gray",
                  eligible="false") == 4


def test_the_shadow_mirrors_only_the_eligible_population_and_says_so(
        proxy: RunningMmguard) -> None:
    for i in range(6):
        answer(proxy.grpc_url, "mirrored", red_call(1 if i < 2 else 3))
    deadline = time.monotonic() + 30
    while True:  # copies are sent off the request path
        with urllib.request.urlopen(proxy.admin_url + "/admin/shadows", timeout=10) as r:
            snap = json.loads(r.read())["mirrored"]
        if snap["mirrored"] + snap["unjudged"].get("replay", 0) >= 2 \
                or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert snap["population"] == f"quality.alignment >= {ELIGIBLE:g}"
    # the two eligible calls are one request twice: sent once, the other a replay
    assert snap["mirrored"] == 1 and snap["unjudged"]["replay"] == 1
    assert metric(proxy, "mmguard_shadow_dropped_total", model="mirrored",
                  canary="mirrored_canary", reason="ineligible") == 4


def test_a_call_without_the_score_is_not_eligible(proxy: RunningMmguard) -> None:
    # the 'scenes' route publishes no alignment: none of its calls may become canary
    before = metric(proxy, "mmguard_canary_eligibility_judged_total", model="scenes",
                    eligible="true")
    answer(proxy.grpc_url, "scenes", clip_inputs(scene()))
    assert metric(proxy, "mmguard_canary_eligibility_calls_total", model="scenes") >= 1
    assert metric(proxy, "mmguard_canary_eligibility_judged_total", model="scenes",
                  eligible="true") == before == 0

