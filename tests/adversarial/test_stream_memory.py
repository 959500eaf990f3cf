"""A ``ModelStreamInfer`` client that sends big requests and never reads holds a bounded amount
of mmguard's memory (a real Triton behind). Before, one stream of 32 MiB requests took mmguard
from 96 MB to 2.5 GB: 8 requests in flight and 8 answers queued, each copied on its way.

- one stream holds at most ``listeners.grpc.max_stream_bytes`` of requests in flight and
  answers not taken (one request always runs): past it, it reads no more requests;
- all streams together at most ``max_streams_bytes``: a request past it, on a stream holding
  nothing, is refused in the stream (the stream stays open).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from proxy.pb import grpc_service_pb2 as pb
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.wire import grpc_request

pytestmark = pytest.mark.triton
MIB = 1 << 20
BIG = grpc_request("identity_fp32", [("INPUT0", "FP32", [1, 2 * MIB],
                                      np.zeros(2 * MIB, "<f4").tobytes())])  # 8 MiB
OPTS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 0),
        ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def served(triton: TritonServer) -> int:
    """Requests Triton ran on identity_fp32 so far."""
    with grpcclient.InferenceServerClient(triton.grpc_url) as client:
        stats = client.get_inference_statistics("identity_fp32", as_json=True)
    return int(stats["model_stats"][0].get("inference_count", 0))


@pytest.fixture(scope="module")
def proxy(triton: TritonServer) -> Iterator[RunningMmguard]:
    cfg = {"listeners": {"grpc": {"max_stream_bytes": 16 * MIB,
                                  "max_streams_bytes": 36 * MIB}},
           "backends": [{"kind": "triton_grpc", "name": "t", "url": triton.grpc_url}],
           "models": [{"name": "identity_fp32", "backend": "t"}]}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        yield m


def test_a_stream_that_never_reads_stops_being_read(proxy: RunningMmguard,
                                                    triton: TritonServer) -> None:
    before = served(triton)
    with grpc.insecure_channel(proxy.grpc_url, options=OPTS) as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")(
            iter([BIG] * 16))
        time.sleep(4)
        ran = served(triton) - before
        call.cancel()
    # 16 MiB: a request and its answer, then one more request: at most 2 of 16 (before: 16)
    assert 1 <= ran <= 2, ran
    with grpc.insecure_channel(proxy.grpc_url) as channel:  # and the next client is served
        small = grpc_request("identity_fp32", [("INPUT0", "FP32", [1, 4],
                                                np.ones(4, "<f4").tobytes())])
        answer = next(channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer")(iter([small]), timeout=30))
    assert not pb.ModelStreamInferResponse.FromString(answer).error_message


def test_streams_past_the_listeners_bound_are_refused_in_the_stream(
        proxy: RunningMmguard) -> None:
    """Three streams that never read hold ~16 MiB each; the listener takes 36 MiB: the third
    stream's request is refused in the stream, naming the setting."""
    channels = [grpc.insecure_channel(proxy.grpc_url, options=OPTS) for _ in range(3)]
    try:
        calls = [ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")(
            iter([BIG] * 4)) for ch in channels[:2]]
        time.sleep(3)  # the two hold their bytes
        third = channels[2].stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")(
            iter([BIG]), timeout=30)
        msg = pb.ModelStreamInferResponse.FromString(next(third))
        for call in calls:
            call.cancel()
    finally:
        for ch in channels:
            ch.close()
    assert "listeners.grpc.max_streams_bytes" in msg.error_message, msg.error_message


def test_streams_that_left_give_their_bytes_back(proxy: RunningMmguard) -> None:
    """After the streams above were cancelled mid-flight (some requests waiting for a slot
    or for room), the listener holds nothing: a leak would refuse every stream later."""
    front = proxy.server.grpc_front  # type: ignore[union-attr]
    deadline = time.monotonic() + 30
    while front.streams_held.held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert front.streams_held.held == 0
