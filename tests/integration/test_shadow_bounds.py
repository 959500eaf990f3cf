"""The shadow's copies are bounded in bytes as well as in number: a copy keeps its request and
production's answer alive until it is compared, so a queue of 64 image-sized copies (or of the
listener's largest requests) is bounded by ``queue_max_bytes``; past it a copy is dropped as on
a full queue, said in the decision and counted (real mmguard, real ONNX Runtime routes, real
gRPC calls)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ort_config
from tests.integration.test_shadow import VERDICT, clip_body, same_answer, shadows, wait_compared
from tests.support.mmguard import RunningMmguard
from tests.support.wire import grpc_infer_raw


@pytest.fixture(scope="module")
def proxy(ort_models: Path) -> Iterator[RunningMmguard]:
    cfg: dict[str, Any] = ort_config(ort_models)
    shadow = {"canary": "clip_canary", "verdict": VERDICT}
    cfg["models"] = [
        # one 600 KB request alone is over 100 KB: every copy is dropped
        {"name": "tight", "backend": "ort", "backend_model": "clip_demo",
         "filters": [{"shadow": {**shadow, "queue_max_bytes": 100_000}}]},
        {"name": "roomy", "backend": "ort", "backend_model": "clip_demo",
         "filters": [{"shadow": shadow}]},
        {"name": "clip_direct", "backend": "ort", "backend_model": "clip_demo", "filters": []},
        {"name": "clip_canary", "backend": "ort", "backend_model": "clip_demo", "filters": []},
    ]
    cfg["listeners"] = {"grpc": {"treatment_headers": True}}  # the test reads the decision
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        yield m


def test_a_copy_over_the_bytes_bound_is_dropped_and_says_so(proxy: RunningMmguard) -> None:
    for i in range(4):
        body, trailers = grpc_infer_raw(proxy.grpc_url, clip_body("tight", i))
        direct, _ = grpc_infer_raw(proxy.grpc_url, clip_body("clip_direct", i))
        assert same_answer(body, direct)  # production is never touched
        decision = dict(trailers)["mmguard-shadow"]
        assert decision.startswith("dropped; queue full (0 copies, 0 bytes waiting)"), decision
    snap = shadows(proxy)["tight"]
    assert (snap["mirrored"], snap["dropped"]) == (0, 4)
    metrics = urllib.request.urlopen(proxy.admin_url + "/metrics", timeout=10).read()
    assert b'mmguard_shadow_dropped_total{canary="clip_canary",model="tight",' \
           b'reason="queue-full"} 4.0' in metrics


def test_copies_within_the_bound_are_mirrored_and_give_their_bytes_back(
        proxy: RunningMmguard) -> None:
    for i in range(12):  # sent one at a time: each copy is compared and frees its bytes
        body, _ = grpc_infer_raw(proxy.grpc_url, clip_body("roomy", i))
        direct, _ = grpc_infer_raw(proxy.grpc_url, clip_body("clip_direct", i))
        assert same_answer(body, direct)
    snap = wait_compared(proxy, "roomy", 12)
    assert (snap["mirrored"], snap["dropped"]) == (12, 0)
    deadline = time.monotonic() + 30  # the last copy's task ends just after its count
    while snap["held_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
        snap = shadows(proxy)["roomy"]
    assert snap["held_bytes"] == 0  # every compared copy gave its bytes back
