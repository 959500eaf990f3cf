"""``mmguard demo``: a walk through what mmguard is for, against a running embedded default.

Six steps, each a real request printed with the ``mmguard-*`` headers that explain what mmguard
decided: a clean call (with ``tritonclient``, as a user's code would make it), an over-long text
refused with its token counts, a dark image answered and annotated, a NaN image refused, a
canary-marked call with the fault experiment's header, then ``mmguard status``. The HTTP calls
use the KServe v2 binary tensor extension with the standard library, so the headers are shown
as they come.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any, TextIO

import numpy as np
from numpy.typing import NDArray

from proxy.cli.demo_model import CLIP_DEMO, CONTEXT_LENGTH, IMAGE_SIZE, tokenize
from proxy.cli.embedded import CANARY_HEADER

_LONG_TEXT = " ".join(f"word{i}" for i in range(CONTEXT_LENGTH + 13))  # 90 tokens


class Answer:
    """One HTTP answer: status, mmguard's headers, the body's JSON header part."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.mmguard = {k.lower(): v for k, v in headers.items()
                        if k.lower().startswith("mmguard-")}
        length = headers.get("Inference-Header-Content-Length")
        head = body[: int(length)] if length else body
        try:
            self.json = json.loads(head)
        except ValueError:
            self.json = {"error": head.decode("utf-8", "replace")}


def image(kind: str, seed: int = 0) -> NDArray[np.float32]:
    """A [1, 3, 224, 224] image in [0, 1]: ``clean`` (a smooth scene with edges and a little
    texture, as a photo has), ``dark`` (the same, 25× darker) or ``nan``."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float32) / IMAGE_SIZE
    disc = ((x - 0.6) ** 2 + (y - 0.4) ** 2 < 0.05).astype(np.float32)
    planes = [0.25 + 0.5 * x, 0.3 + 0.4 * y, 0.6 - 0.3 * x * y]
    scene = np.stack([np.clip(p * (1 - disc) + 0.9 * disc * (i == 0), 0, 1) for i, p in
                      enumerate(planes)])[None]
    px: NDArray[np.float32] = np.asarray(
        np.clip(scene + rng.normal(0, 0.01, scene.shape), 0, 1), dtype=np.float32)
    if kind == "dark":
        px *= np.float32(0.04)
    elif kind == "nan":
        px[0, :, :8, :8] = np.nan
    return px


def long_ids() -> NDArray[np.int64]:
    """The token ids of a 90-word text, unpadded and uncut (the model reads 77)."""
    ids = [int(x) for x in tokenize(_LONG_TEXT)]  # the first 77 ids, as the model would
    extra = [1 + (7919 * i) % 49000 for i in range(13)]
    return np.array([ids + extra], dtype=np.int64)


def infer_http(http: str, model: str, pixels: NDArray[np.float32], ids: NDArray[np.int64],
               headers: dict[str, str] | None = None, timeout: float = 30.0) -> Answer:
    tensors: list[tuple[str, str, NDArray[Any]]] = [("pixel_values", "FP32", pixels),
                                                    ("input_ids", "INT64", ids)]
    head = json.dumps({"inputs": [
        {"name": n, "datatype": d, "shape": list(a.shape),
         "parameters": {"binary_data_size": a.nbytes}} for n, d, a in tensors],
        "outputs": [{"name": "similarity", "parameters": {"binary_data": False}}]}).encode()
    body = head + b"".join(a.tobytes() for _, _, a in tensors)
    req = urllib.request.Request(f"http://{http}/v2/models/{model}/infer", data=body,
                                 method="POST", headers={
                                     "Content-Type": "application/octet-stream",
                                     "Inference-Header-Content-Length": str(len(head)),
                                     **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Answer(r.status, dict(r.headers), r.read())
    except urllib.error.HTTPError as e:
        return Answer(e.code, dict(e.headers), e.read())


def _show(out: TextIO, answer: Answer) -> None:
    if answer.status == 200:
        sim = next((o["data"][0] for o in answer.json.get("outputs", [])
                    if o.get("name") == "similarity"), None)
        out.write(f"   -> HTTP 200, similarity {sim:.4f}\n" if sim is not None
                  else "   -> HTTP 200\n")
    else:
        out.write(f"   -> HTTP {answer.status}: {answer.json.get('error', answer.json)}\n")
    for k, v in sorted(answer.mmguard.items()):
        out.write(f"      {k}: {v}\n")


def clean_call_grpc(url: str, out: TextIO, text: str) -> bool:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    pixels, ids = image("clean"), tokenize(text)[None, :]
    inputs = [grpcclient.InferInput("pixel_values", list(pixels.shape), "FP32"),
              grpcclient.InferInput("input_ids", list(ids.shape), "INT64")]
    inputs[0].set_data_from_numpy(pixels)
    inputs[1].set_data_from_numpy(ids)
    try:
        result = client.infer(CLIP_DEMO, inputs)
    except InferenceServerException as exc:
        out.write(f"request to mmguard at {url} failed: {exc}\n")
        return False
    emb, sim = result.as_numpy("image_embeds"), result.as_numpy("similarity")
    assert emb is not None and sim is not None
    out.write(f"   model {CLIP_DEMO} via mmguard at {url} (tritonclient.grpc, unchanged)\n"
              f"   text: {text!r}\n"
              f"   image_embeds: shape {list(emb.shape)}, first values "
              f"{np.round(emb[0, :4], 4)}\n"
              f"   similarity (image vs text): {float(sim[0]):.4f}\n")
    return True


def run_demo(url: str, text: str, http: str = "127.0.0.1:9000",
             admin: str = "http://127.0.0.1:9002", out: TextIO = sys.stdout) -> int:
    ids = tokenize(text)[None, :]
    out.write(f"mmguard demo: the embedded default ({CLIP_DEMO} on in-process ONNX Runtime) "
              "behind shape_guard, quality, fallback, shadow and fault.\n\n"
              "1. A clean call. mmguard changes nothing in a correct answer; the headers say "
              "what it checked.\n")
    if not clean_call_grpc(url, out, text):
        return 1
    _show(out, infer_http(http, CLIP_DEMO, image("clean"), ids))
    out.write(f"\n2. A text of {long_ids().shape[1]} tokens; the model reads "
              f"{CONTEXT_LENGTH} and would silently drop the rest. shape_guard refuses it, "
              "with the counts.\n")
    _show(out, infer_http(http, CLIP_DEMO, image("clean"), long_ids()))
    out.write("\n3. A dark image. quality answers it, annotated with the weakest signal, so the "
              "caller can tell.\n")
    _show(out, infer_http(http, CLIP_DEMO, image("dark"), ids))
    out.write("\n4. An image with NaN pixels. The model would answer NaN embeddings; quality "
              "refuses it (422).\n")
    _show(out, infer_http(http, CLIP_DEMO, image("nan"), ids))
    out.write(f"\n5. A canary-marked call ({CANARY_HEADER}: 1). The fault experiment adds "
              "noise to canary traffic only, and says so.\n")
    _show(out, infer_http(http, CLIP_DEMO, image("clean"), ids, {CANARY_HEADER: "1"}))
    out.write("\n6. mmguard status: requests by outcome, breakers, experiments, the canary "
              "verdict (every call above was also mirrored to clip_demo_canary and "
              "compared).\n\n")
    out.flush()
    from proxy.cli.status import main as status_main
    return status_main(argparse.Namespace(admin=admin, timeout=10.0))
