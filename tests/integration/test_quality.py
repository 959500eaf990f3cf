"""quality through real fronts and backends: in-process ONNX Runtime (clip_demo, identity_bytes)
over gRPC and HTTP, and a real multimodal vLLM (tiny-llava) over the OpenAI API. A blurred image
is annotated, a NaN image refused with the signal named, a dark image marks its modality
unusable, drift shows on /metrics and its baseline survives a restart, and an image–text encoder
pair built here ranks matching pairs above mismatched ones."""

from __future__ import annotations

import base64
import io
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import openai
import pytest
import tritonclient.grpc as grpcclient
from numpy.typing import NDArray
from onnx import TensorProto, helper, numpy_helper
from PIL import Image, ImageFilter
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from filters.quality.align import AlignmentConfig, EncoderPair
from proxy.pb import grpc_service_pb2 as pb
from tests.conftest import ort_config
from tests.support import photos
from tests.support.images import scene
from tests.support.mmguard import RunningMmguard
from tests.support.vllm import VllmServer
from tests.support.wire import grpc_infer_raw, grpc_request, http_binary_body, http_post

# --- inputs with known properties ---------------------------------------------------------------


def blurred(img: NDArray[np.uint8], radius: float = 3) -> NDArray[np.uint8]:
    return np.asarray(Image.fromarray(img).filter(ImageFilter.GaussianBlur(radius)))


def dark(img: NDArray[np.uint8]) -> NDArray[np.uint8]:
    return np.asarray(img * 0.04, np.uint8)


def tinted(img: NDArray[np.uint8], rgb: tuple[float, float, float]) -> NDArray[np.uint8]:
    return np.asarray(img * np.array(rgb), np.uint8)


def pixels(img: NDArray[np.uint8]) -> NDArray[np.float32]:
    """HWC uint8 → clip_demo's pixel_values, [1, 3, 224, 224] FP32 in [0, 1]."""
    return np.ascontiguousarray((img.transpose(2, 0, 1) / 255.0)[None], np.float32)


def data_url(img: NDArray[np.uint8]) -> str:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def t(name: str, arr: NDArray[Any]) -> tuple[str, str, list[int], bytes]:
    dt = {"float32": "FP32", "int64": "INT64"}[str(arr.dtype)]
    return name, dt, list(arr.shape), np.ascontiguousarray(arr).tobytes()


def ids(*tokens: int) -> NDArray[np.int64]:
    out = np.zeros((1, 77), np.int64)
    out[0, : len(tokens)] = tokens
    return out


def clip_inputs(img: NDArray[Any], tokens: NDArray[np.int64] | None = None) -> list[Any]:
    """pixel_values (an HWC uint8 picture, or FP32 pixels as they are) and input_ids."""
    px = img if img.dtype == np.float32 else pixels(img)
    return [t("pixel_values", px), t("input_ids", ids(1) if tokens is None else tokens)]


def bytes_input(*texts: bytes) -> tuple[str, str, list[int], bytes]:
    raw = b"".join(len(x).to_bytes(4, "little") + x for x in texts)
    return "INPUT0", "BYTES", [len(texts)], raw


def answer(url: str, model: str, tensors: list[Any]) -> tuple[pb.ModelInferResponse,
                                                              dict[str, str]]:
    body, trailers = grpc_infer_raw(url, grpc_request(model, tensors))
    return pb.ModelInferResponse.FromString(body), dict(trailers or ())


def refused(url: str, model: str, tensors: list[Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        grpc_infer_raw(url, grpc_request(model, tensors))
    return exc.value


def http_infer(url: str, model: str, tensors: list[Any]) -> tuple[int, dict[str, str], bytes]:
    body, hlen = http_binary_body(tensors)
    return http_post(url, f"/v2/models/{model}/infer", body,
                     {"Inference-Header-Content-Length": str(hlen)})


def scores(header: str) -> dict[str, float]:
    """``scored; trust=0.812 image=0.620 ...`` → {"trust": 0.812, "image": 0.62, ...}"""
    decision, _, rest = header.partition("; ")
    assert decision == "scored", header
    return {k: float(v) for k, v in (kv.split("=") for kv in rest.split())}


def drift(admin_url: str, model: str, modality: str, signal: str,
          metric: str = "mmguard_input_drift") -> float | None:
    with urllib.request.urlopen(admin_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == metric and s.labels == {"model": model, "modality": modality,
                                                 "signal": signal}:
                return float(s.value)
    return None


# --- an image–text encoder pair, built here ------------------------------------------------------

VOCAB = {"[PAD]": 0, "red": 1, "green": 2, "blue": 3, "[UNK]": 4}


def write_encoder_pair(root: Path) -> tuple[Path, Path, Path]:
    """A colour CLIP: the image encoder maps an image's mean colour through three orthonormal
    8-d directions; the text encoder sums the same directions for the words red/green/blue
    (other words and padding add nothing). Matching colour and word → cosine near 1."""
    basis = np.linalg.qr(np.random.default_rng(11).standard_normal((8, 8)))[0][:3]
    table = np.zeros((49408, 8), np.float32)
    table[1:4] = basis
    image = helper.make_graph(
        [helper.make_node("ReduceMean", ["pixel_values"], ["rgb"], axes=[2, 3], keepdims=0),
         helper.make_node("MatMul", ["rgb", "basis"], ["image_embeds"])], "image_encoder",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["n", 3, 224, 224])],
        [helper.make_tensor_value_info("image_embeds", TensorProto.FLOAT, ["n", 8])],
        initializer=[numpy_helper.from_array(basis.astype(np.float32), "basis")])
    text = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["tok"], axis=0),
         helper.make_node("ReduceSum", ["tok", "axis1"], ["text_embeds"], keepdims=0)],
        "text_encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["n", 77])],
        [helper.make_tensor_value_info("text_embeds", TensorProto.FLOAT, ["n", 8])],
        initializer=[numpy_helper.from_array(table, "table"),
                     numpy_helper.from_array(np.array([1], np.int64), "axis1")])
    paths = root / "image_encoder.onnx", root / "text_encoder.onnx", root / "tokenizer.json"
    for graph, path in zip((image, text), paths, strict=False):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        onnx.save(model, path)
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(paths[2]))
    return paths


@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return write_encoder_pair(tmp_path_factory.mktemp("encoders"))


def alignment(encoders: tuple[Path, Path, Path], **extra: Any) -> dict[str, Any]:
    image, text, tokenizer = encoders
    return {"image_encoder": str(image), "text_encoder": str(text), "tokenizer": str(tokenizer),
            **extra}


def test_the_encoder_pair_ranks_matching_pairs_above_mismatched(
        encoders: tuple[Path, Path, Path]) -> None:
    pair = EncoderPair(AlignmentConfig.model_validate(alignment(encoders)))
    red, green, blue = (tinted(scene(seed=s), c) for s, c in
                        ((1, (1, .2, .2)), (2, (.2, 1, .2)), (3, (.2, .2, 1))))
    images = pair.embed_images(np.concatenate([pair.prepare_rgb(x) for x in (red, green, blue)]))
    texts = pair.embed_texts(["a red car", "A GREEN field", "the blue sea"])
    cos = images @ texts.T / np.outer(np.linalg.norm(images, axis=1),
                                      np.linalg.norm(texts, axis=1))
    assert (np.argmax(cos, axis=1) == [0, 1, 2]).all()
    assert (np.diag(cos) > 0.9).all() and (cos[~np.eye(3, dtype=bool)] < 0.5).all()
    matched = pair.scores(pair.cosines(images, texts))
    shuffled = pair.scores(pair.cosines(images, texts[[1, 2, 0]]))
    assert (matched > shuffled).all()


# --- ONNX Runtime, v2 over gRPC and HTTP -------------------------------------------------------

RULES = [{"signal": "finite", "below": 1.0, "action": "reject"},
         {"signal": "sharpness", "below": 0.5, "action": "annotate"},
         {"signal": "image", "below": 0.3, "action": "drop-modality"}]
SMALL_DRIFT = {"baseline_size": 6, "window": 6, "every": 1}


@pytest.fixture(scope="module")
def ort(ort_models: Path, encoders: tuple[Path, Path, Path]) -> Iterator[RunningMmguard]:
    def quality(**options: Any) -> list[dict[str, Any]]:
        return [{"quality": {"images": {"pixel_values": {}}, "drift": None, **options}}]

    cfg = ort_config(ort_models)
    cfg["models"] = [
        {"name": "clip_demo", "backend": "ort"},
        {"name": "q_clip", "backend": "ort", "backend_model": "clip_demo",
         "filters": quality(rules=RULES)},
        {"name": "q_drift", "backend": "ort", "backend_model": "clip_demo",
         "filters": quality(drift=SMALL_DRIFT)},
        {"name": "q_align", "backend": "ort", "backend_model": "clip_demo",
         "filters": quality(alignment=alignment(encoders, text_input="input_ids"), rules=[
             {"signal": "alignment", "below": 0.5, "action": "annotate"}])},
        {"name": "q_sampled", "backend": "ort", "backend_model": "clip_demo",
         "filters": quality(sample=0.0)},
        {"name": "q_photo", "backend": "ort", "backend_model": "clip_demo",
         "filters": quality()},  # the shipped default rules
        {"name": "q_photo_drop", "backend": "ort", "backend_model": "clip_demo",
         "filters": quality(rules=[{"signal": "exposure", "below": 0.5,
                                    "action": "drop-modality"}])},
        {"name": "q_graded", "backend": "ort", "backend_model": "clip_demo",
         "filters": quality(rules=[], graded={})},
        {"name": "q_text", "backend": "ort", "backend_model": "identity_bytes",
         "filters": [{"quality": {"texts": {"INPUT0": {}}, "drift": None, "rules": [
             {"signal": "text", "below": 0.5, "action": "reject"}]}}]},
    ]
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        yield m


def test_a_clean_image_is_scored_and_served(ort: RunningMmguard) -> None:
    resp, trailers = answer(ort.grpc_url, "q_clip", clip_inputs(scene()))
    assert [o.name for o in resp.outputs] == ["image_embeds", "text_embeds", "similarity"]
    assert scores(trailers["mmguard-quality-scores"]) == {
        "trust": 1.0, "image": 1.0, "finite": 1.0, "range": 1.0, "constant": 1.0,
        "sharpness": 1.0, "exposure": 1.0, "noise": 1.0, "blockiness": 1.0,
        "perspective": 1.0, "tone": 1.0, "shake": 1.0}
    assert not any(k.startswith("mmguard-quality-") and k != "mmguard-quality-scores"
                   for k in trailers)


def test_a_blurred_image_is_annotated_on_both_fronts(ort: RunningMmguard) -> None:
    resp, trailers = answer(ort.grpc_url, "q_clip", clip_inputs(blurred(scene())))
    assert resp.outputs  # annotated, not refused
    note = trailers["mmguard-quality-sharpness"]
    assert note.startswith("annotate; input 'pixel_values' image 0: signal 'sharpness' is 0.000 (")
    assert "second/first difference energy, lower axis" in note
    assert note.endswith("); threshold 0.5")
    assert scores(trailers["mmguard-quality-scores"])["sharpness"] == 0.0
    status, headers, _ = http_infer(ort.http_url, "q_clip", clip_inputs(blurred(scene())))
    assert status == 200 and headers["mmguard-quality-sharpness"] == note


def test_a_darkened_real_photo_is_annotated_and_its_clean_source_is_not(
        ort: RunningMmguard) -> None:
    source = next(c.image for c in photos.clean_set() if c.name == "chelsea")
    darkened = photos.low_light(source, 0.1, np.random.default_rng(0))
    _, clean = answer(ort.grpc_url, "q_photo", clip_inputs(source))
    assert scores(clean["mmguard-quality-scores"])["exposure"] == 1.0
    assert not [k for k in clean if k.startswith("mmguard-quality-") and k not in (
        "mmguard-quality-scores",)], clean
    resp, dark_trailers = answer(ort.grpc_url, "q_photo", clip_inputs(darkened))
    assert resp.outputs  # annotated by default, not refused
    note = dark_trailers["mmguard-quality-exposure"]
    assert note.startswith("annotate; input 'pixel_values' image 0: signal 'exposure' is 0.")
    assert "mean luminance" in note and note.endswith("threshold 0.6")  # the default
    assert "mmguard-quality-sharpness" not in dark_trailers  # dark, but not blurred
    status, headers, _ = http_infer(ort.http_url, "q_photo", clip_inputs(darkened))
    assert status == 200 and headers["mmguard-quality-exposure"] == note


def test_a_darkened_real_photo_has_its_modality_dropped_when_configured(
        ort: RunningMmguard) -> None:
    source = next(c.image for c in photos.clean_set() if c.name == "coffee")
    darkened = photos.low_light(source, 0.1, np.random.default_rng(0))
    _, trailers = answer(ort.grpc_url, "q_photo_drop", clip_inputs(darkened))
    assert trailers["mmguard-quality-exposure"].startswith("drop-modality; input 'pixel_values'")
    _, clean = answer(ort.grpc_url, "q_photo_drop", clip_inputs(source))
    assert "mmguard-quality-exposure" not in clean


def test_graded_actions_refuse_a_very_dark_photo_and_observe_its_source(
        ort: RunningMmguard) -> None:
    source = next(c.image for c in photos.clean_set() if c.name == "rocket")
    err = refused(ort.grpc_url, "q_graded", clip_inputs(
        photos.low_light(source, 0.05, np.random.default_rng(0))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT  # 422 on HTTP
    assert (err.details() or "").startswith("quality: trust score 0.")
    _, trailers = answer(ort.grpc_url, "q_graded", clip_inputs(source))
    assert trailers["mmguard-quality-graded"].startswith("observe; trust score 1.000")


def test_a_nan_image_is_refused_naming_the_signal(ort: RunningMmguard) -> None:
    px = pixels(scene())
    px[0, 1, 10, :7] = np.nan
    message = ("quality: input 'pixel_values' image 0: signal 'finite' is 0.000 (7 NaN/Inf "
               "values), below the threshold 1")
    err = refused(ort.grpc_url, "q_clip", clip_inputs(px))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == message
    trailers = dict(err.trailing_metadata())
    assert trailers["mmguard-quality-finite"].startswith("reject; ")
    assert trailers["mmguard-error-origin"] == "mmguard"  # stopped before the model
    status, headers, body = http_infer(ort.http_url, "q_clip", clip_inputs(px))
    assert status == 422 and json.loads(body)["error"] == message
    assert headers["mmguard-quality-finite"].startswith("reject; ")
    client = grpcclient.InferenceServerClient(ort.grpc_url)
    inputs = [grpcclient.InferInput("pixel_values", [1, 3, 224, 224], "FP32"),
              grpcclient.InferInput("input_ids", [1, 77], "INT64")]
    inputs[0].set_data_from_numpy(px)
    inputs[1].set_data_from_numpy(ids(1))
    with pytest.raises(InferenceServerException, match=re.escape("signal 'finite' is 0.000")):
        client.infer("q_clip", inputs)
    inputs[0].set_data_from_numpy(pixels(scene()))
    assert client.infer("q_clip", inputs).as_numpy("similarity").shape == (1,)


def test_a_dark_image_marks_the_image_modality_unusable(ort: RunningMmguard) -> None:
    resp, trailers = answer(ort.grpc_url, "q_clip", clip_inputs(dark(scene())))
    assert resp.outputs  # the router that serves without the image is another filter's job
    note = trailers["mmguard-quality-image"]
    assert note.startswith("drop-modality; input 'pixel_values' image 0: image score is 0.000")
    status, headers, _ = http_infer(ort.http_url, "q_clip", clip_inputs(dark(scene())))
    assert status == 200 and headers["mmguard-quality-image"] == note


def test_texts_are_scored_and_garbage_refused(ort: RunningMmguard) -> None:
    good = b"a red bicycle against a brick wall"
    _, trailers = answer(ort.grpc_url, "q_text", [bytes_input(good)])
    assert scores(trailers["mmguard-quality-scores"])["text"] == 1.0
    ocr = b"~|]l;:,.-_ ,.;' |||| }{ ~~ ^^ ..,, ;; '' []"
    err = refused(ort.grpc_url, "q_text", [bytes_input(good, ocr)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("quality: input 'INPUT0' text 1: text score is 0.000 "
                                    "(weakest signal 'symbols': ")
    status, headers, body = http_infer(ort.http_url, "q_text",
                                       [bytes_input(b"caf\xe9 \xff\xfe\x00\x01")])
    assert status == 422 and "weakest signal 'control'" in json.loads(body)["error"]
    assert headers["mmguard-quality-text"].startswith("reject; ")


def test_alignment_ranks_matching_image_and_text_first(ort: RunningMmguard) -> None:
    red = tinted(scene(seed=4), (1.0, 0.2, 0.2))
    _, match = answer(ort.grpc_url, "q_align", clip_inputs(red, ids(1)))  # "red"
    _, mismatch = answer(ort.grpc_url, "q_align", clip_inputs(red, ids(3)))  # "blue"
    a, b = scores(match["mmguard-quality-scores"]), scores(mismatch["mmguard-quality-scores"])
    assert a["alignment"] > 0.9 > 0.5 > b["alignment"]
    assert a["trust"] > b["trust"]
    assert "mmguard-quality-alignment" not in match
    assert mismatch["mmguard-quality-alignment"].startswith(
        "annotate; inputs 'pixel_values' and 'input_ids': alignment is ")


def test_unsampled_requests_pass_unscored(ort: RunningMmguard) -> None:
    px = pixels(scene())
    px[0, 0, 0, 0] = np.nan  # would be refused if scored
    _, trailers = answer(ort.grpc_url, "q_sampled", clip_inputs(px))
    assert trailers["mmguard-quality-scores"] == "unsampled; scored share 0"


def test_drift_stays_flat_then_rises_on_metrics(ort: RunningMmguard) -> None:
    def send(img: NDArray[np.uint8]) -> None:
        answer(ort.grpc_url, "q_drift", clip_inputs(img))

    for seed in range(12):  # baseline, then a window of the same kind of input
        send(scene(seed=seed))
    assert drift(ort.admin_url, "q_drift", "image", "sharpness") == 0.0
    assert drift(ort.admin_url, "q_drift", "all", "trust") == 0.0
    for seed in range(6):
        send(blurred(scene(seed=seed)))
    assert drift(ort.admin_url, "q_drift", "image", "sharpness") == pytest.approx(1.0)
    assert drift(ort.admin_url, "q_drift", "image", "sharpness",
                 "mmguard_input_drift_ks") == pytest.approx(1.0)
    assert drift(ort.admin_url, "q_drift", "image", "exposure") == 0.0  # blur keeps exposure


def test_the_drift_baseline_survives_a_restart(ort_models: Path, tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    cfg = ort_config(ort_models)
    cfg["models"] = [{"name": "q", "backend": "ort", "backend_model": "clip_demo", "filters": [
        {"quality": {"images": {"pixel_values": {}}, "drift": {**SMALL_DRIFT,
                                                               "baseline_file": str(path)}}}]}]
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        for seed in range(6):
            answer(m.grpc_url, "q", clip_inputs(scene(seed=seed)))
        assert drift(m.admin_url, "q", "image", "sharpness") is None  # window still empty
    saved = json.loads(path.read_text())
    assert saved["series"]["image/sharpness"] == [1.0] * 6
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        for seed in range(6):  # no baseline to learn: these six fill the window at once
            answer(m.grpc_url, "q", clip_inputs(blurred(scene(seed=seed))))
        assert drift(m.admin_url, "q", "image", "sharpness") == pytest.approx(1.0)


# --- OpenAI chat through a real multimodal vLLM -------------------------------------------------


@pytest.fixture(scope="module")
def llava(vllm_llava: VllmServer, encoders: tuple[Path, Path, Path]) -> Iterator[RunningMmguard]:
    cfg = {"backends": [{"kind": "vllm", "name": "llava", "url": vllm_llava.url}],
           "models": [{"name": "tiny-llava", "backend": "llava", "filters": [{"quality": {
               "rules": [*RULES, {"signal": "text", "below": 0.3, "action": "reject"}],
               "alignment": alignment(encoders), "drift": None}}]}]}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=120)
        yield m


def chat(m: RunningMmguard, img: NDArray[np.uint8], text: str) -> tuple[dict[str, str], Any]:
    """(response headers, the parsed completion) for one text + one image."""
    content = [{"type": "text", "text": text},
               {"type": "image_url", "image_url": {"url": data_url(img)}}]
    messages: Any = [{"role": "user", "content": content}]
    with openai.OpenAI(base_url=f"http://{m.http_url}/v1", api_key="unused",
                       max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-llava", messages=messages, max_tokens=2, temperature=0)
        return dict(raw.headers), raw.parse()


@pytest.mark.vllm
def test_chat_images_are_scored_annotated_and_dropped(llava: RunningMmguard) -> None:
    headers, completion = chat(llava, scene(), "what is in this picture?")
    assert completion.choices[0].message.content is not None
    got = scores(headers["mmguard-quality-scores"])
    assert got["image"] == 1.0 and got["text"] == 1.0
    headers, _ = chat(llava, blurred(scene()), "what is in this picture?")
    assert headers["mmguard-quality-sharpness"].startswith(
        "annotate; messages[0].content[1].image_url: signal 'sharpness' is 0.000")
    headers, completion = chat(llava, dark(scene()), "what is in this picture?")
    assert completion.choices  # still answered: serving without the image is #7's job
    assert headers["mmguard-quality-image"].startswith(
        "drop-modality; messages[0].content[1].image_url: image score is 0.000")


@pytest.mark.vllm
def test_a_transparent_image_is_scored_as_vllm_shows_it_over_white(llava: RunningMmguard) -> None:
    # a sharp, well-exposed scene sent fully transparent: vLLM gives its model a white frame
    # (convert_image_mode), so the scores are the white frame's, not the hidden scene's
    picture = scene()
    hidden = np.dstack([picture, np.zeros(picture.shape[:2], np.uint8)])
    headers, completion = chat(llava, hidden, "what is in this picture?")
    white, _ = chat(llava, np.full_like(picture, 255), "what is in this picture?")
    assert completion.choices
    assert headers["mmguard-quality-scores"] == white["mmguard-quality-scores"]
    assert scores(headers["mmguard-quality-scores"])["image"] < 0.5, headers
    visible, _ = chat(llava, np.dstack([picture, np.full(picture.shape[:2], 255, np.uint8)]),
                      "what is in this picture?")
    assert scores(visible["mmguard-quality-scores"])["image"] == 1.0  # opaque: the scene


@pytest.mark.vllm
def test_chat_garbage_text_is_refused_with_the_signal(llava: RunningMmguard) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        chat(llava, scene(), "the " * 20)
    assert exc.value.status_code == 422
    assert exc.value.body["message"] == (  # type: ignore[index]
        "quality: text 0: text score is 0.000 (weakest signal 'repetition': 20 repeats of one "
        "token sequence), below the threshold 0.3")
    assert exc.value.response.headers["mmguard-quality-text"].startswith("reject; ")


@pytest.mark.vllm
def test_chat_alignment_ranks_matching_text_first(llava: RunningMmguard) -> None:
    red = tinted(scene(seed=5), (1.0, 0.2, 0.2))
    match = scores(chat(llava, red, "is the car red?")[0]["mmguard-quality-scores"])
    other = scores(chat(llava, red, "is the car blue?")[0]["mmguard-quality-scores"])
    assert match["alignment"] > 0.9 > 0.5 > other["alignment"]
