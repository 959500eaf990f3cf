"""A Triton gRPC stream through mmguard is bounded by silence, not by its length: the backend's
``timeout_s`` until the first response, ``stream_idle_timeout_s`` between responses (real
Triton, its decoupled ``decoupled_counter`` answering every 10 ms, tritonclient's stream)."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def proxy(triton: TritonServer) -> Iterator[RunningMmguard]:
    cfg = {
        "backends": [
            # first response within 1 s; then as long as it talks
            {"kind": "triton_grpc", "name": "short-first", "url": triton.grpc_url,
             "timeout_s": 1.0},
            # silent 3 ms after a response: broken off (the counter answers every 10 ms)
            {"kind": "triton_grpc", "name": "twitchy", "url": triton.grpc_url,
             "timeout_s": 10, "stream_idle_timeout_s": 0.003},
        ],
        "models": [
            {"name": "long_stream", "backend": "short-first", "backend_model": "decoupled_counter"},
            {"name": "slow_first", "backend": "short-first", "backend_model": "slow_fp32"},
            {"name": "idle_stream", "backend": "twitchy", "backend_model": "decoupled_counter"},
        ],
    }
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        yield m


def counter_input(count: int) -> list[grpcclient.InferInput]:
    x = grpcclient.InferInput("count", [1], "INT32")
    x.set_data_from_numpy(np.array([count], np.int32))
    return [x]


class Stream:
    """One tritonclient stream to mmguard; ``take`` waits for what its callback got."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.got: queue.Queue[object] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.got.put(error or result))

    def take(self, timeout: float = 15.0) -> object:
        return self.got.get(timeout=timeout)

    def close(self) -> None:
        self.client.stop_stream()


def test_a_stream_longer_than_timeout_s_runs_to_its_end(proxy: RunningMmguard) -> None:
    """150 responses 10 ms apart (1.5 s at least) through a backend whose timeout_s is 1 s: a
    whole-stream deadline cut it at 1 s; the first response came in time, so all of it comes."""
    stream = Stream(proxy.grpc_url)
    try:
        stream.client.async_stream_infer("long_stream", counter_input(150), request_id="long")
        started = time.monotonic()
        values = []
        for _ in range(150):
            item = stream.take()
            assert isinstance(item, grpcclient.InferResult), item
            out = item.as_numpy("value")
            assert out is not None
            values.append(int(out[0]))
        assert time.monotonic() - started > 1.0  # it did outlive timeout_s
    finally:
        stream.close()
    assert values == list(range(150))


def test_a_stream_silent_past_its_idle_timeout_is_broken_off_and_says_so(
        proxy: RunningMmguard) -> None:
    stream = Stream(proxy.grpc_url)
    try:
        stream.client.async_stream_infer("idle_stream", counter_input(200), request_id="idle")
        values: list[int] = []
        error: InferenceServerException | None = None
        while error is None:
            item = stream.take()
            if isinstance(item, InferenceServerException):
                error = item
            else:
                assert isinstance(item, grpcclient.InferResult), item
                out = item.as_numpy("value")
                assert out is not None
                values.append(int(out[0]))
        assert 1 <= len(values) < 200 and values == list(range(len(values)))
        words = str(error)
        assert "backend 'twitchy' sent nothing on the stream of model 'decoupled_counter' " \
               "for 0.003 s after its last response" in words, words
        assert "backends[].stream_idle_timeout_s" in words
        # the client's stream goes on: the next request on it is served whole
        stream.client.async_stream_infer("long_stream", counter_input(3), request_id="next")
        after = [stream.take() for _ in range(3)]
        assert all(isinstance(x, grpcclient.InferResult) for x in after), after
        assert [int(x.as_numpy("value")[0]) for x in after] == [0, 1, 2]  # type: ignore
    finally:
        stream.close()


def test_no_first_response_within_timeout_s_is_a_deadline(proxy: RunningMmguard) -> None:
    stream = Stream(proxy.grpc_url)
    try:
        x = grpcclient.InferInput("x", [1, 1], "FP32")
        x.set_data_from_numpy(np.array([[1.0]], np.float32))
        delay = grpcclient.InferInput("delay_ms", [1, 1], "INT32")
        delay.set_data_from_numpy(np.array([[4000]], np.int32))
        started = time.monotonic()
        stream.client.async_stream_infer("slow_first", [x, delay])
        item = stream.take()
        assert isinstance(item, InferenceServerException), item
        assert "backend 'short-first' did not answer model 'slow_fp32' within 1000 ms" in str(item)
        assert time.monotonic() - started < 3.5  # not after the model's 4 s
    finally:
        stream.close()
