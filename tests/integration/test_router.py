"""modality_router over two real backends serving the same model (Triton and in-process ORT):
a path slowed on cue loses its traffic and wins it back; a path whose answers lose confidence
loses weight; a call whose image is unusable is served by the text-only path without it."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from proxy.cli.demo_model import tokenize
from tests.conftest import ort_config
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.wire import grpc_infer_raw, grpc_request

pytestmark = pytest.mark.triton


def body(px: NDArray[Any] | None = None) -> bytes:
    px = np.random.default_rng(0).random((1, 3, 224, 224), np.float32) if px is None else px
    return grpc_request("clip", [
        ("pixel_values", "FP32", [1, 3, 224, 224], px.astype("<f4").tobytes()),
        ("input_ids", "INT64", [1, 77], tokenize("a red bus")[None, :].tobytes())])


@pytest.fixture(scope="module")
def cue(triton: TritonServer) -> Iterator[Callable[[dict[str, float]], None]]:
    path = Path(triton.repository) / "clip_demo.cue.json"

    def set_cue(values: dict[str, float]) -> None:
        if values:
            path.write_text(json.dumps(values))
        else:
            path.unlink(missing_ok=True)

    yield set_cue
    path.unlink(missing_ok=True)


def router_config(triton: TritonServer, ort_models: Path, **router: Any) -> dict[str, Any]:
    cfg = ort_config(ort_models)
    cfg["backends"].append({"kind": "triton_grpc", "name": "triton", "url": triton.grpc_url})
    cfg["models"] = [
        {"name": "clip", "backend": "ort", "backend_model": "clip_demo", "filters": [
            {"quality": {"images": {"pixel_values": {}}, "annotate": False, "drift": None,
                         "rules": [{"signal": "finite", "below": 1.0,
                                    "action": "drop-modality"}]}},
            {"modality_router": {
                "paths": [{"route": "clip_triton", "confidence": {"kind": "scalar",
                                                                  "output": "similarity"}},
                          {"route": "clip_ort", "confidence": {"kind": "scalar",
                                                               "output": "similarity"}},
                          {"route": "text_only", "modalities": ["text"]}],
                "inputs": {"pixel_values": "image", "input_ids": "text"},
                "dwell_s": 0, "ewma": 0.5, "window": 10, "temperature": 0.1, **router}}]},
        {"name": "clip_triton", "backend": "triton", "backend_model": "clip_demo",
         "filters": []},
        {"name": "clip_ort", "backend": "ort", "backend_model": "clip_demo", "filters": []},
        {"name": "text_only", "backend": "ort", "backend_model": "text_encoder",
         "filters": []},
    ]
    return cfg


def weights(m: RunningMmguard) -> dict[str, float]:
    doc = json.loads(urllib.request.urlopen(m.admin_url + "/admin/routers", timeout=5).read())
    return doc["clip"]["weights"]  # type: ignore[no-any-return]


def drive(m: RunningMmguard, until: Callable[[dict[str, float]], bool], limit: int) -> int:
    """Send requests until the condition holds on the weights; return how many it took."""
    for n in range(1, limit + 1):
        grpc_infer_raw(m.grpc_url, body())
        if until(weights(m)):
            return n
    raise AssertionError(f"weights never got there in {limit} requests: {weights(m)}")


def test_a_slowed_path_loses_traffic_and_wins_it_back(
        triton: TritonServer, ort_models: Path, cue: Callable[[dict[str, float]], None]) -> None:
    with RunningMmguard(router_config(triton, ort_models)) as m:
        m.wait_ready(timeout=60)
        drive(m, lambda w: w["clip_triton"] > 0.1, 200)  # healthy: both in use
        cue({"delay_ms": 150})
        try:
            drive(m, lambda w: w["clip_triton"] < 0.07, 100)  # slowed: exploration floor only
        finally:
            cue({})
        drive(m, lambda w: w["clip_triton"] > 0.1, 400)  # recovered: traffic back
        text = urllib.request.urlopen(m.admin_url + "/metrics", timeout=5).read().decode()
        assert 'mmguard_router_weight{model="clip",path="clip_triton"}' in text


def test_a_path_whose_confidence_drops_loses_weight(
        triton: TritonServer, ort_models: Path, cue: Callable[[dict[str, float]], None]) -> None:
    cfg = router_config(triton, ort_models, alpha=0.0)  # judge on confidence alone
    for path in cfg["models"][0]["filters"][1]["modality_router"]["paths"][:2]:
        path["confidence"]["range"] = [-1.0, 1.0]  # similarity is a cosine
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        drive(m, lambda w: w["clip_triton"] > 0.3, 200)
        cue({"similarity": -1.0})  # a replica whose answers went bad: no match at all
        try:
            drive(m, lambda w: w["clip_triton"] < 0.07, 300)
        finally:
            cue({})


def test_an_unusable_image_is_served_by_the_text_path_without_it(
        triton: TritonServer, ort_models: Path) -> None:
    with RunningMmguard(router_config(triton, ort_models)) as m:
        m.wait_ready(timeout=60)
        nan_image = np.full((1, 3, 224, 224), np.nan, np.float32)
        out, trailers = grpc_infer_raw(m.grpc_url, body(nan_image))
        meta = dict(trailers or ())
        assert meta["mmguard-modality-dropped"].startswith("image; image: ")
        assert meta["mmguard-router-path"].startswith("text_only")
        from proxy.pb import grpc_service_pb2 as pb
        resp = pb.ModelInferResponse.FromString(out)
        assert [o.name for o in resp.outputs] == ["text_embeds"]
