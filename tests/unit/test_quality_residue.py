"""``residue``: a faint copy of an earlier image of the same request, on synthetic textures and
real photographs, alone and through the quality filter (a v2 batch, an OpenAI chat's images)."""

from __future__ import annotations

import base64
import io
import random
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from PIL import Image

from filters.quality import residue
from filters.quality.filter import Quality, QualityConfig
from filters.quality.residue import (
    RESIDUE_BAD,
    WINDOW,
    Budget,
    Trace,
    overlap,
    residues,
    trace,
)
from filters.quality.rules import SCREEN_RULES
from filters.quality.signals import ImageSpec, measure_image
from proxy.call import STREAM_MEMORY, Call, Reply, Result, StreamMemory, Target
from proxy.chain import FilterContext
from proxy.clock import ManualClock
from proxy.telemetry import Telemetry
from proxy.tensor import Tensor
from tests.support import photos

U8 = ImageSpec("HWC", (0.0,), (255.0,))


def photo(name: str) -> NDArray[np.uint8]:
    return next(c.image for c in photos.clean_set() if c.name == name)


def laid_over(x: NDArray[np.uint8], other: NDArray[np.uint8], opacity: float
              ) -> NDArray[np.uint8]:
    mixed = (1 - opacity) * x.astype(np.float64) + opacity * other.astype(np.float64)
    return np.clip(mixed + 0.5, 0, 255).astype(np.uint8)


def texture(seed: int, side: int = 224) -> NDArray[np.uint8]:
    """Smoothed noise: edges everywhere, no two seeds alike."""
    noise = np.random.default_rng(seed).normal(0, 1, (side + 4, side + 4))
    smooth = sum(noise[i:i + side, j:j + side] for i in range(5) for j in range(5)) / 5
    grey = np.clip(128 + 40 * smooth, 0, 255).astype(np.uint8)
    return np.repeat(grey[:, :, None], 3, axis=2)


def traced(x: NDArray[np.uint8]) -> Trace:
    found = trace(measure_image(x, U8)[1])
    assert found is not None
    return found


def later_score(earlier: NDArray[np.uint8], later: NDArray[np.uint8]) -> float:
    found = residues([traced(earlier), traced(later)], ["image 0", "image 1"])
    assert found[0] is None  # the first image has nothing before it
    assert found[1] is not None
    return found[1].score


def test_a_faint_copy_of_the_texture_before_scores_low_and_an_unrelated_one_scores_one() -> None:
    a, c = texture(1), texture(2)
    assert later_score(a, c) == 1.0
    found = residues([traced(a), traced(laid_over(c, a, 0.1))], ["input 'x' image 0",
                                                                  "input 'x' image 1"])[1]
    assert found is not None and found.score == 0.0 and found.value > RESIDUE_BAD
    assert found.what == ("edge-sign correlation with input 'x' image 0, the earlier image it "
                          "agrees with most")


@pytest.mark.parametrize(("earlier", "later"), [("astronaut", "coffee"), ("chelsea", "rocket"),
                                                ("coffee", "camera"), ("grass", "chelsea")])
def test_on_photographs_more_of_the_copy_never_scores_higher(earlier: str, later: str) -> None:
    a, b = photo(earlier), photo(later)
    ladder = [later_score(a, b)] + [later_score(a, laid_over(b, a, op))
                                    for op in (0.05, 0.10, 0.15)]
    assert ladder[0] == 1.0, ladder  # unrelated photographs
    assert ladder == sorted(ladder, reverse=True), ladder
    rule = next(r.below for r in SCREEN_RULES if r.signal == "residue")
    assert ladder[2] < rule, ladder  # 10 % is caught on each of these


def test_frames_of_one_scene_and_a_repeated_image_are_not_read_as_a_copy() -> None:
    src = photos._source("astronaut")
    side = int(min(src.shape[:2]) * 0.8)
    first = photos.to_model_input(src, (40, 20, 40 + side, 20 + side))
    for dx, dy in ((1, 0), (2, 1), (4, 2), (8, 4)):  # a camera that moved a little
        moved = photos.to_model_input(src, (40 + dx, 20 + dy, 40 + dx + side, 20 + dy + side))
        found = overlap(traced(first), traced(moved))
        assert found is not None and found.coarse >= 0.9, found  # one scene
        assert later_score(first, moved) == 1.0
    assert later_score(first, first) == 1.0  # the same picture twice: a repeat, not a residue


def test_each_image_is_compared_with_the_window_before_it_only() -> None:
    frames = [texture(10 + i) for i in range(WINDOW + 2)]
    near = laid_over(texture(50), frames[1], 0.15)  # image WINDOW + 1: frame 1 is in reach
    far = laid_over(texture(51), frames[0], 0.15)  # image WINDOW + 1 as well: frame 0 is not
    for last, caught in ((near, True), (far, False)):
        found = residues([traced(f) for f in [*frames[:WINDOW + 1], last]],
                         [f"image {i}" for i in range(WINDOW + 2)])
        assert found[0] is None and all(s is not None and s.score == 1.0 for s in found[1:-1])
        assert found[-1] is not None and (found[-1].score < 0.5) is caught, found[-1]


def test_images_of_other_shapes_too_small_or_not_finite_are_not_compared() -> None:
    a = texture(3)
    wide = np.concatenate([a, a[:, :32]], axis=1)
    assert residues([traced(a), traced(wide)], ["0", "1"]) == [None, None]
    assert trace(np.zeros((20, 224), np.float32)) is None
    plane = measure_image(a, U8)[1].copy()
    plane[5, 7] = np.nan
    assert trace(plane) is None
    assert residues([None, traced(a)], ["0", "1"]) == [None, None]


# --- through the filter -------------------------------------------------------------------------


def make_filter(cfg: dict[str, Any]) -> Quality:
    ctx = FilterContext("m", Telemetry(), ManualClock(), random.Random(0), lambda: None)
    return Quality(QualityConfig.model_validate(cfg), ctx)


async def answer(call: Call) -> Reply:
    return Result("m")


def batch_call(*images: NDArray[np.uint8]) -> Call:
    nchw = np.ascontiguousarray(np.stack([i.transpose(2, 0, 1) for i in images]) / 255.0,
                                np.float32)
    return Call("m", "", [Tensor.from_numpy("pixel_values", nchw)], target=Target("b", "m"))


def header(call: Call) -> dict[str, str]:
    return dict(kv.split("=") for kv in call.decisions["mmguard-quality-scores"][8:].split())


async def test_the_screens_intent_annotates_the_image_that_carries_the_copy() -> None:
    quality = make_filter({"images": {"pixel_values": {}}, "drift": None, "intent": "screens"})
    a, b = photo("astronaut"), photo("coffee")
    clean = batch_call(a, b)
    await quality(clean, answer)
    assert "mmguard-quality-residue" not in clean.decisions
    assert header(clean)["residue"] == "1.000"
    bad = batch_call(a, laid_over(b, a, 0.1))
    assert isinstance(await quality(bad, answer), Result)  # annotated, not refused
    note = bad.decisions["mmguard-quality-residue"]
    assert note.startswith("annotate; input 'pixel_values' image 1: signal 'residue' is 0."), note
    assert "edge-sign correlation with input 'pixel_values' image 0" in note, note
    assert note.endswith("threshold 0.5"), note
    single = batch_call(a)  # one image: nothing to compare, no residue score at all
    await quality(single, answer)
    assert "residue" not in header(single)


async def test_the_default_intent_does_not_measure_residue() -> None:
    quality = make_filter({"images": {"pixel_values": {}}, "drift": None})
    a, b = photo("astronaut"), photo("coffee")
    call = batch_call(a, laid_over(b, a, 0.15))
    await quality(call, answer)
    assert "residue" not in header(call) and "mmguard-quality-residue" not in call.decisions


def data_url(img: NDArray[np.uint8]) -> str:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def test_a_chats_images_are_compared_in_the_order_they_come() -> None:
    quality = make_filter({"drift": None, "intent": "screens"})
    a, b = photo("chelsea"), photo("rocket")
    parts = [{"type": "text", "text": "what changed between these pages?"},
             {"type": "image_url", "image_url": {"url": data_url(a)}},
             {"type": "image_url", "image_url": {"url": data_url(laid_over(b, a, 0.15))}}]
    doc = {"model": "llm", "messages": [{"role": "user", "content": parts}]}
    call = Call(model="llm", version="", inputs=[], document=doc, target=Target("b", "llm"))
    await quality(call, answer)
    note = call.decisions["mmguard-quality-residue"]
    assert note.startswith("annotate; messages[0].content[2].image_url: signal 'residue' "
                           "is 0."), note
    assert "edge-sign correlation with messages[0].content[1].image_url," in note, note


# --- the pair evaluation (bench/residue_eval.py) ------------------------------------------------


def test_the_pair_evaluation_scores_pairs_as_the_filter_does() -> None:
    from bench import residue_eval
    a, b = photo("astronaut"), photo("coffee")
    assert residue_eval.pair_score(a, b)[0] == 1.0
    score, value = residue_eval.pair_score(a, residue_eval.blend(b, a, 0.15))
    assert score < residue_eval.THRESHOLD and value > RESIDUE_BAD
    table = residue_eval.table({"threshold": 0.5, "clean": {"pairs": {
        "n": 4, "flagged": 1, "rate": 0.25, "interval": (0.05, 0.7), "which": ["x then y"],
        "highest": 0.04}}, "ladder": {"photographs": {"0.05": {
            "n": 10, "auc": 0.9, "caught": 0.8, "interval": (0.5, 0.9)}}}})
    assert "1 /    4 =  25.0%" in table and "x then y" in table, table
    assert "0.05: AUC 0.900, 80% of 10 [50%, 90%]" in table, table


# --- a client stream's earlier requests (gRPC ModelStreamInfer) ---------------------------------


def test_a_streams_memory_releases_what_it_replaces_and_everything_when_closed() -> None:
    released: list[str] = []
    memory = StreamMemory()
    memory.put("a", 1, lambda: released.append("a1"))
    memory.put("a", 2, lambda: released.append("a2"))
    memory.put("b", 3)
    assert released == ["a1"] and memory.get("a") == 2 and memory.get("b") == 3
    memory.close()
    assert released == ["a1", "a2"] and memory.get("a") is None
    memory.put("a", 4, lambda: released.append("a4"))  # the stream has ended: nothing is kept
    assert released == ["a1", "a2", "a4"] and memory.get("a") is None


def streamed(image: NDArray[np.uint8], memory: StreamMemory | None) -> Call:
    call = batch_call(image)
    if memory is not None:
        call.state[STREAM_MEMORY] = memory
    return call


async def test_a_frame_carrying_the_streams_frame_before_it_is_annotated() -> None:
    """One image per request, as a video goes frame by frame over a stream: the second frame
    carries 10 % of the first and is annotated, naming the request the first came in; a clean
    frame after it is not; the same frame as a unary call has nothing to compare with."""
    quality = make_filter({"images": {"pixel_values": {}}, "drift": None, "intent": "screens"})
    a, b, c = photo("astronaut"), photo("coffee"), photo("chelsea")
    used = residue.STREAMS.used
    memory = StreamMemory()
    first = streamed(a, memory)
    await quality(first, answer)
    assert "residue" not in header(first)  # nothing before it
    second = streamed(laid_over(b, a, 0.1), memory)
    assert isinstance(await quality(second, answer), Result)
    note = second.decisions["mmguard-quality-residue"]
    assert note.startswith("annotate; input 'pixel_values' image 0: signal 'residue' is 0."), note
    assert ("edge-sign correlation with input 'pixel_values' image 0 of the stream's scored "
            "request 1," in note), note
    third = streamed(c, memory)
    await quality(third, answer)
    assert header(third)["residue"] == "1.000" and "mmguard-quality-residue" not in \
        third.decisions
    assert residue.STREAMS.used > used  # three frames kept (at most WINDOW)
    memory.close()
    assert residue.STREAMS.used == used  # the stream ended: every byte given back
    unary = streamed(laid_over(b, a, 0.1), None)
    await quality(unary, answer)
    assert "residue" not in header(unary)


async def test_past_the_process_budget_a_stream_keeps_nothing_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(residue, "STREAMS", Budget(limit=1000))
    quality = make_filter({"images": {"pixel_values": {}}, "drift": None, "intent": "screens"})
    memory = StreamMemory()
    a, b = photo("astronaut"), photo("coffee")
    first = streamed(a, memory)
    await quality(first, answer)
    assert first.decisions["mmguard-quality-unscored"] == (
        "unscored; residue: this stream's images are not kept for its next requests (the "
        f"process keeps at most {1000 / 2 ** 20:g} MiB of streams' images)")
    second = streamed(laid_over(b, a, 0.1), memory)
    await quality(second, answer)
    assert "residue" not in header(second) and residue.STREAMS.used == 0
    named = streamed(a, StreamMemory("the client"))  # a named client's refusal says so
    await quality(named, answer)
    assert named.decisions["mmguard-quality-unscored"].startswith(
        "unscored; residue: this client's images are not kept for its next requests"), \
        named.decisions


async def test_a_named_clients_unary_requests_are_compared_as_a_streams_are() -> None:
    quality = make_filter({"images": {"pixel_values": {}}, "drift": None, "intent": "screens"})
    a, b = photo("astronaut"), photo("coffee")
    memory = StreamMemory("the client")
    await quality(streamed(a, memory), answer)
    second = streamed(laid_over(b, a, 0.1), memory)
    await quality(second, answer)
    note = second.decisions["mmguard-quality-residue"]
    assert ("edge-sign correlation with input 'pixel_values' image 0 of the client's scored "
            "request 1," in note), note
    memory.close()


def test_the_filter_holds_a_window_of_traces_not_one_per_image() -> None:
    """A batch compares each image with the four before it and keeps only the last four traces
    for its stream or client (a batch of thousands of small images holds four, not
    thousands)."""
    quality = make_filter({"images": {"pixel_values": {}}, "drift": None, "intent": "screens"})
    frames = [texture(30 + i) for i in range(WINDOW + 1)]
    near = laid_over(texture(60), frames[2], 0.15)  # frames[2] is within the window of 4
    far = laid_over(texture(61), frames[0], 0.15)  # frames[0] is not, by then
    report = quality.measure(batch_call(*frames, near, far), False)
    scores = [item.signals.get("residue") for item in report.items]
    assert scores[0] is None and all(s is not None and s.score == 1.0 for s in scores[1:-2])
    assert scores[-2] is not None and scores[-2].score < 0.5, scores[-2]
    assert scores[-1] is not None and scores[-1].score == 1.0, scores[-1]
    assert [where for where, _ in report.traces] == [
        f"input 'pixel_values' image {i}" for i in range(len(frames) + 2 - WINDOW,
                                                         len(frames) + 2)]
