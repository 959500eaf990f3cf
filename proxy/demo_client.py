"""``mmguard demo``: one real request to a running mmguard, with tritonclient, as a user would."""

from __future__ import annotations

import numpy as np

from proxy.demo_model import CLIP_DEMO, IMAGE_SIZE, tokenize


def run_demo(url: str, text: str) -> int:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    rng = np.random.default_rng(0)
    pixels = rng.random((1, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    ids = tokenize(text)[None, :]
    inputs = [grpcclient.InferInput("pixel_values", list(pixels.shape), "FP32"),
              grpcclient.InferInput("input_ids", list(ids.shape), "INT64")]
    inputs[0].set_data_from_numpy(pixels)
    inputs[1].set_data_from_numpy(ids)
    try:
        result = client.infer(CLIP_DEMO, inputs)
    except InferenceServerException as exc:
        print(f"request to mmguard at {url} failed: {exc}")
        return 1
    emb = result.as_numpy("image_embeds")
    sim = result.as_numpy("similarity")
    assert emb is not None and sim is not None
    print(f"model {CLIP_DEMO} via mmguard at {url}")
    print(f"  text: {text!r}")
    print(f"  image_embeds: shape {list(emb.shape)}, first values {np.round(emb[0, :4], 4)}")
    print(f"  similarity (image vs text): {float(sim[0]):.4f}")
    return 0
