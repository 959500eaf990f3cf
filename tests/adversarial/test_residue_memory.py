"""What quality's residue keeps of gRPC streams' images, against a real ``mmguard serve`` on
the embedded clip_demo (a route with the screens intent): each open stream keeps its last four
images' traces and no more, the process says what it keeps
(``mmguard_quality_residue_kept_bytes``), every byte goes back when the streams end, whether the
client ends them or drops them, and the probe client is answered throughout."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from numpy.typing import NDArray
from prometheus_client.parser import text_string_to_metric_families

from filters.quality.residue import WINDOW, compact, nbytes, trace
from filters.quality.signals import ImageSpec, measure_image
from tests.conftest import ort_config
from tests.support.adversary import Prober, http_call, rss_mib, serve
from tests.support.process import MmguardProcess

STREAMS = 16
FRAMES = WINDOW + 2  # more than a stream keeps
CHW01 = ImageSpec("CHW", (0.0,), (1.0,))


@pytest.fixture(scope="module")
def framed(ort_models: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[MmguardProcess]:
    cfg = ort_config(ort_models)
    cfg["models"].append({"name": "frames", "backend": "ort", "backend_model": "clip_demo",
                          "filters": [{"quality": {"images": {"pixel_values": {}},
                                                   "intent": "screens", "drift": None}}]})
    with serve(tmp_path_factory.mktemp("residue_memory"), cfg) as proc:
        yield proc


def frame(seed: int) -> NDArray[np.float32]:
    """A [1, 3, 224, 224] FP32 picture of smoothed noise: edges everywhere, no two alike."""
    noise = np.random.default_rng(seed).normal(0, 1, (228, 228))
    smooth = sum(noise[i:i + 224, j:j + 224] for i in range(5) for j in range(5)) / 25
    grey = np.clip(0.5 + 0.15 * smooth, 0, 1).astype(np.float32)
    return np.ascontiguousarray(np.broadcast_to(grey, (1, 3, 224, 224)))


def kept(proc: MmguardProcess) -> float:
    status, _, body = http_call(proc.ports["admin"], "GET", "/metrics")
    assert status == 200
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == "mmguard_quality_residue_kept_bytes":
                return float(s.value)
    raise AssertionError("mmguard_quality_residue_kept_bytes is not exported")


def open_stream(proc: MmguardProcess, seed: int) -> tuple[grpcclient.InferenceServerClient,
                                                          queue.Queue[object]]:
    """A client with a stream that has sent ``FRAMES`` frames and had every one answered."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{proc.ports['grpc']}")
    got: queue.Queue[object] = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put(error or result))
    for i in range(FRAMES):
        px = grpcclient.InferInput("pixel_values", [1, 3, 224, 224], "FP32")
        px.set_data_from_numpy(frame(seed * 100 + i))
        ids = grpcclient.InferInput("input_ids", [1, 77], "INT64")
        ids.set_data_from_numpy(np.zeros((1, 77), np.int64))
        client.async_stream_infer("frames", [px, ids])
    for _ in range(FRAMES):
        answer = got.get(timeout=60)
        assert isinstance(answer, grpcclient.InferResult), answer
    return client, got


def test_open_streams_keep_four_images_each_and_give_every_byte_back(
        framed: MmguardProcess) -> None:
    one = trace(measure_image(frame(0)[0], CHW01)[1])
    assert one is not None
    per_stream = WINDOW * nbytes(compact(one))
    assert kept(framed) == 0
    rss = rss_mib(framed.proc.pid)
    with Prober(framed.ports["http"]) as probe:
        clients = [open_stream(framed, seed)[0] for seed in range(STREAMS)]
        assert kept(framed) == STREAMS * per_stream  # four of the six frames each, no more
        grown = rss_mib(framed.proc.pid) - rss
        for i, client in enumerate(clients):
            if i % 2:
                client.stop_stream()  # the client ends its stream
            client.close()  # or just goes: the stream is cancelled
        deadline = time.monotonic() + 30
        while kept(framed) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kept(framed) == 0
    probe.assert_served()
    # What the streams keep is ~0.9 MB here; the rest of the growth is the 16 x 6 requests'
    # own buffers (~600 KB each), which the allocator may keep: generous, but bounded.
    assert grown < 200, grown
