"""A gRPC ``ModelStreamInfer`` stream counts what its client saw (a real Triton behind):

- an answer counts once gRPC has taken it for the client, so a client that never reads and
  then leaves has its answers counted ``cancelled``, not ``ok`` (they were counted as they were
  queued: nine ``ok`` while no answer byte had left the process);
- a stream past its client's deadline counts ``deadline_exceeded``, as a unary call does (it
  counted ``cancelled``, and its backend call had no deadline).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from proxy.pb import grpc_service_pb2 as pb
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.wire import grpc_request

pytestmark = pytest.mark.triton
MIB = 1 << 20


@pytest.fixture(scope="module")
def proxy(triton: TritonServer) -> Iterator[RunningMmguard]:
    cfg = {"backends": [{"kind": "triton_grpc", "name": "t", "url": triton.grpc_url}],
           "models": [{"name": m, "backend": "t"}
                      for m in ("identity_fp32", "decoupled_counter")]}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        yield m


def count(m: RunningMmguard, model: str, code: str) -> float:
    return m.telemetry.registry.get_sample_value(
        "mmguard_requests_total", {"model": model, "backend": "t", "front": "grpc",
                                   "code": code}) or 0.0


def settled(m: RunningMmguard, model: str, codes: tuple[str, ...], before: dict[str, float],
            n: int) -> dict[str, float]:
    """The counts of ``codes`` since ``before``, once they add up to ``n`` (60 s at most)."""
    deadline = time.monotonic() + 60
    while True:
        got = {c: count(m, model, c) - before[c] for c in codes}
        if sum(got.values()) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_answers_a_client_never_read_are_not_counted_ok(proxy: RunningMmguard) -> None:
    codes = ("ok", "cancelled")
    before = {c: count(proxy, "identity_fp32", c) for c in codes}
    body = grpc_request("identity_fp32", [("INPUT0", "FP32", [1, MIB // 4],
                                           np.zeros(MIB // 4, "<f4").tobytes())])
    written = 0

    def requests() -> Iterator[bytes]:
        nonlocal written
        for _ in range(40):
            written += 1
            yield body

    # a small receive window, never read: the answers pile up in mmguard
    opts = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 0),
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(proxy.grpc_url, options=opts) as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")(
            requests())
        time.sleep(4)
        taken = settled(proxy, "identity_fp32", codes, before, 0)  # what counted before
        call.cancel()
    after = settled(proxy, "identity_fp32", codes, before, 1)
    # the window holds about one 1 MiB answer, gRPC core one more: nothing like the 9-12 of
    # the answers queued in mmguard that counted ok before
    assert taken["ok"] <= 3, taken
    assert after["ok"] <= 3 and after["cancelled"] >= 1, after


def test_a_stream_past_its_deadline_is_counted_deadline_exceeded(proxy: RunningMmguard) -> None:
    codes = ("deadline_exceeded", "cancelled", "stream_broken", "ok")
    before = {c: count(proxy, "decoupled_counter", c) for c in codes}
    body = grpc_request("decoupled_counter", [("count", "INT32", [1],
                                               np.array([300], "<i4").tobytes())])
    with grpc.insecure_channel(proxy.grpc_url) as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        for _ in range(3):
            answers = stream(iter([body]), timeout=0.5)  # 300 answers 10 ms apart: 3 s
            with pytest.raises(grpc.RpcError) as err:
                for msg in answers:
                    assert not pb.ModelStreamInferResponse.FromString(msg).error_message
            assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    got = settled(proxy, "decoupled_counter", codes, before, 3)
    assert got == {"deadline_exceeded": 3, "cancelled": 0, "stream_broken": 0, "ok": 0}, got
