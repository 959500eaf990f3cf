"""The fallback's answer cache holds what its bounds allow, in a running mmguard: distinct
requests whose answers are large fill it up to ``max_bytes`` and no further, an answer over
``max_entry_bytes`` is not kept, and both show on ``/metrics`` (real ONNX Runtime identity
model, real gRPC client calls)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.pb import grpc_service_pb2 as pb
from tests.conftest import ort_config
from tests.support.mmguard import RunningMmguard
from tests.support.wire import grpc_infer_raw, grpc_request

KB = 1000


@pytest.fixture(scope="module")
def proxy(ort_models: Path) -> Iterator[RunningMmguard]:
    cfg = ort_config(ort_models)
    cfg["models"].append({"name": "cached", "backend": "ort", "backend_model": "identity_fp32",
                          "filters": [{"fallback": {"cache": {
                              "max_bytes": 300 * KB, "max_entry_bytes": 150 * KB}}}]})
    cfg["models"].append({"name": "unkeyed", "backend": "ort", "backend_model": "identity_fp32",
                          "filters": [{"fallback": {"cache": {
                              "max_bytes": 1000 * KB, "max_entry_bytes": 300 * KB}}}]})
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        yield m


def cache_metrics(m: RunningMmguard, route: str = "cached") -> tuple[float, float]:
    """(mmguard_answer_cache_bytes, mmguard_answer_cache_skipped_total) of the route."""
    text = urllib.request.urlopen(m.admin_url + "/metrics", timeout=10).read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if (s.name in ("mmguard_answer_cache_bytes", "mmguard_answer_cache_skipped_total")
                    and s.labels == {"model": route}):
                found[s.name] = s.value
    return found["mmguard_answer_cache_bytes"], found["mmguard_answer_cache_skipped_total"]


def call(m: RunningMmguard, values: int, seed: int, route: str = "cached") -> None:
    x = np.random.default_rng(seed).random(values, np.float32)
    raw, _ = grpc_infer_raw(m.grpc_url, grpc_request(route, [
        ("INPUT0", "FP32", [values], x.tobytes())]))
    reply = pb.ModelInferResponse()
    reply.ParseFromString(raw)
    assert reply.raw_output_contents[0] == x.tobytes()  # the answer itself is untouched


def test_distinct_large_answers_fill_the_cache_to_its_bytes_and_no_further(
        proxy: RunningMmguard) -> None:
    assert cache_metrics(proxy) == (0.0, 0.0)
    for seed in range(5):  # five 100 KB answers, 300 KB allowed: the oldest two go
        call(proxy, 25_000, seed)
    held, skipped = cache_metrics(proxy)
    assert 200 * KB <= held <= 300 * KB and skipped == 0
    call(proxy, 50_000, 99)  # a 200 KB answer: over max_entry_bytes, not kept
    assert cache_metrics(proxy) == (held, 1.0)


def test_an_entry_not_yet_keyed_counts_the_request_it_keeps_alive(
        proxy: RunningMmguard) -> None:
    """No MAC on a good call: the entry holds its request (the gRPC message its input is a view
    into) with its answer until the cache is read, and the metric counts both. Here each 100 KB
    answer's entry is ~200 KB; 1000 KB allowed: four are held after six calls."""
    for seed in range(6):
        call(proxy, 25_000, seed, route="unkeyed")
    held, skipped = cache_metrics(proxy, "unkeyed")
    assert 4 * 200 * KB <= held <= 1000 * KB and skipped == 0, held
