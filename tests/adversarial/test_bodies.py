"""Bodies and streams an attacker sizes: compression bombs, a huge JSON tensor, and a
ModelStreamInfer client that sends and never reads — each against a real ``mmguard serve``
process with a probe sending good requests every 100 ms.

Seen before the fixes (issue 15): a 987-byte gzip body took the proxy to 1.6 GB; a 57 MiB JSON
body stalled every client 3.6 s and held +700 MB; a stream client that never read held 1.3 GB,
still held after it cancelled.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from tests.support.adversary import PROBE_PATH, Prober, http_call, rss_mib
from tests.support.process import MmguardProcess

MiB = 1024 * 1024
BOMB_INFLATED = 512 * MiB
"""What the bombs inflate to: eight times the default 64 MiB request limit."""


def _zeros_compressed(total: int, coding: str) -> bytes:
    wbits = 16 + zlib.MAX_WBITS if coding == "gzip" else zlib.MAX_WBITS
    c = zlib.compressobj(9, zlib.DEFLATED, wbits)
    block = bytes(MiB)
    parts = [c.compress(block) for _ in range(total // MiB)]
    return b"".join([*parts, c.flush()])


def _json_tensor(mib: float, parameters: dict[str, object] | None = None) -> bytes:
    """An FP32 JSON tensor body of about ``mib`` MiB (10 bytes an element)."""
    n = int(mib * MiB) // 10
    doc: dict[str, object] = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [n],
                                          "data": [0.123456] * n}]}
    if parameters:
        doc["parameters"] = parameters
    body = json.dumps(doc).encode()
    assert abs(len(body) - mib * MiB) < MiB
    return body


@contextmanager
def peak_rss(pid: int) -> Iterator[list[float]]:
    """Samples the process's RSS every 20 ms while the block runs; yields [peak] at exit."""
    peak = [rss_mib(pid)]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mib(pid))
            stop.wait(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield peak
    finally:
        stop.set()
        t.join(5)


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_compression_bomb_is_413_with_bounded_memory(served: MmguardProcess, coding: str,
                                                     binary: bool) -> None:
    bomb = _zeros_compressed(BOMB_INFLATED, coding)
    assert len(bomb) < BOMB_INFLATED // 500  # a real bomb: ~1000:1
    headers = {"Content-Encoding": coding, "Content-Type": "application/json"}
    limit = 64 * MiB
    if binary:  # the binary extension: the body limit (64 MiB) applies, not the JSON one
        headers["Inference-Header-Content-Length"] = "100"
    else:
        limit = 16 * MiB
    before = rss_mib(served.proc.pid)
    with Prober(served.ports["http"]) as probes, peak_rss(served.proc.pid) as peak:
        began = time.monotonic()
        status, _, body = http_call(served.ports["http"], "POST", PROBE_PATH, bomb, headers)
        took = time.monotonic() - began
        time.sleep(0.3)
    assert status == 413, body[:300]
    message = json.loads(body)["error"]
    assert f"{coding} request body inflates past {limit} bytes" in message
    probes.assert_served(minimum=2)
    assert took < 10
    # Never more than the limit (and one copy of it) in memory, never the 512 MiB.
    assert peak[0] - before < 2 * limit / MiB + 60, f"peak RSS {peak[0] - before:.0f} MiB"
    assert rss_mib(served.proc.pid) - before < 60


def test_json_over_its_limit_is_refused_unread(served: MmguardProcess) -> None:
    """57 MiB of JSON (under the 64 MiB body limit, over the 16 MiB JSON one): 413 at once."""
    body = _json_tensor(57)
    before = rss_mib(served.proc.pid)
    with Prober(served.ports["http"]) as probes:
        status, _, answer = http_call(served.ports["http"], "POST", PROBE_PATH, body)
        time.sleep(0.3)
    assert status == 413
    assert "listeners.http.max_json_bytes" in json.loads(answer)["error"]
    probes.assert_served(minimum=2)
    assert rss_mib(served.proc.pid) - before < 30


def test_json_near_its_limit_keeps_probes_served(served: MmguardProcess) -> None:
    """A JSON body near the default JSON limit is parsed off the loop: probes go on. The answer
    is asked for in binary form, so this measures the request side only (a JSON *answer* of
    the same size is written by the codec while holding the interpreter lock)."""
    body = _json_tensor(15, {"binary_data_output": True})
    n = 15 * MiB // 10
    before = rss_mib(served.proc.pid)
    with Prober(served.ports["http"]) as probes:
        for _ in range(3):
            status, headers, answer = http_call(served.ports["http"], "POST", PROBE_PATH, body)
            assert status == 200, answer[:300]
        time.sleep(0.3)
    header_length = int(headers["inference-header-content-length"])
    assert len(answer) - header_length == 4 * n  # n FP32 values, binary
    probes.assert_served()
    assert rss_mib(served.proc.pid) - before < 300


_STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def _stream_request(n_floats: int) -> bytes:
    from proxy.pb import grpc_service_pb2 as pb
    req = pb.ModelInferRequest(model_name="identity_fp32")
    t = req.inputs.add(name="INPUT0", datatype="FP32", shape=[n_floats])
    del t
    req.raw_input_contents.append(bytes(4 * n_floats))
    return bytes(req.SerializeToString())


async def _send_never_read(port: int, seconds: float) -> tuple[int, grpc.aio.StreamStreamCall]:
    """Writes 256 KiB requests for ``seconds`` without reading one answer; returns how many
    writes the proxy took (flow control stops the rest) and the open call."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = channel.stream_stream(_STREAM)()
    body = _stream_request(64 * 1024)
    sent = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            await asyncio.wait_for(call.write(body), timeout=max(0.05, deadline - time.monotonic()))
        except TimeoutError:
            break  # pushed back: the proxy stopped reading
        sent += 1
    call.__dict__["_mmguard_channel"] = channel  # closed by the caller with the call
    return sent, call


def test_stream_client_that_never_reads_holds_bounded_memory(served: MmguardProcess) -> None:
    async def attack() -> tuple[int, float, float]:
        before = rss_mib(served.proc.pid)
        sent, call = await _send_never_read(served.ports["grpc"], 8.0)
        held = rss_mib(served.proc.pid) - before
        call.cancel()
        await call.__dict__["_mmguard_channel"].close()
        await asyncio.sleep(1.5)
        return sent, held, rss_mib(served.proc.pid) - before

    with Prober(served.ports["http"]) as probes:
        sent, held, after = asyncio.run(attack())
    probes.assert_served()
    # Pushed back: 8 s of writing would be gigabytes; a bounded stream takes a few MiB.
    assert sent * 256 / 1024 < 200, f"the proxy took {sent} requests of 256 KiB"
    assert held < 150, f"{held:.0f} MiB held while the client did not read ({sent} sent)"
    assert after < 60, f"{after:.0f} MiB still held after the client cancelled"


def test_grpc_compressed_bomb_is_refused_with_bounded_memory(served: MmguardProcess) -> None:
    """gRPC message compression is inflated by gRPC core, which holds it to the listener's
    message limit (64 MiB): a message that inflates to 256 MiB is RESOURCE_EXHAUSTED."""
    from proxy.pb import grpc_service_pb2 as pb
    req = pb.ModelInferRequest(model_name="identity_fp32")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[64 * MiB])
    req.raw_input_contents.append(bytes(256 * MiB))
    body = req.SerializeToString()
    del req
    before = rss_mib(served.proc.pid)
    with Prober(served.ports["http"]) as probes, peak_rss(served.proc.pid) as peak, \
            grpc.insecure_channel(f"127.0.0.1:{served.ports['grpc']}") as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as err:
            infer(body, timeout=60, compression=grpc.Compression.Gzip)
        time.sleep(0.3)
    del body
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    probes.assert_served(minimum=2)
    assert peak[0] - before < 2 * 64 + 60, f"peak RSS {peak[0] - before:.0f} MiB"
    # gRPC core's buffer for one message (64 MiB) may stay with the allocator afterwards; the
    # 256 MiB the bomb inflates to must not.
    left = rss_mib(served.proc.pid) - before
    assert left < 64 + 40, f"{left:.0f} MiB still held"
