"""A client that leaves before its unary answer (HTTP, on the fast lane and on aiohttp's path):
its call is cancelled, as grpc.aio cancels a gRPC call whose client left. The backend call
ends with it (vLLM stops generating, mmguard's connection to Triton closes) and the call counts
as ``cancelled``, not ``ok``. Before, the backend worked on to the end for nobody and the call
counted as answered. Real vLLM (tiny-llama, ~100 ms a token) and real Triton (``slow_fp32``)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from tests.conftest import triton_routes
from tests.integration.test_openai_vllm import vllm_config
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.vllm import DELAY_ARG, VllmServer


def _send_and_leave(m: RunningMmguard, path: str, body: bytes, model: str, front: str,
                    after_s: float, half: bool = False) -> None:
    """Sends the request, waits until mmguard serves it and ``after_s`` more (the backend has
    it by then), then hangs up (``half``: shuts down its sending side only, and waits until
    the call has left mmguard's count before it closes)."""
    host, port = m.http_url.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % (path.encode(), len(body)) + body)
        _until("the call never came in", lambda: _in_flight(m, model, front) == 1)
        time.sleep(after_s)
        if half:
            s.shutdown(socket.SHUT_WR)
            _until("a client that half-closed was waited for",
                   lambda: _in_flight(m, model, front) == 0, within_s=10)


def _count(m: RunningMmguard, model: str, backend: str, front: str, code: str) -> float:
    return m.telemetry.registry.get_sample_value("mmguard_requests_total", {
        "model": model, "backend": backend, "front": front, "code": code}) or 0.0


def _in_flight(m: RunningMmguard, model: str, front: str) -> float:
    return m.telemetry.registry.get_sample_value(
        "mmguard_requests_in_flight", {"model": model, "front": front}) or 0.0


def _until(what: str, done: object, within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _vllm_running(server: VllmServer) -> float:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


@pytest.fixture(scope="module", params=[True, False], ids=["fast-lane", "aiohttp"])
def vllm_proxy(request: pytest.FixtureRequest,
               vllm_llama: VllmServer) -> Iterator[RunningMmguard]:
    cfg = {**vllm_config(llama=vllm_llama), "listeners": {"http": {"fast_lane": request.param}}}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=120)
        yield m


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_a_vllm_call_whose_client_left_stops_generating_and_counts_as_cancelled(
        vllm_proxy: RunningMmguard, vllm_llama: VllmServer, endpoint: str) -> None:
    m = vllm_proxy
    ask = ({"messages": [{"role": "user", "content": "count"}]} if "chat" in endpoint
           else {"prompt": "count"})
    body = json.dumps({"model": vllm_llama.model, **ask, "max_tokens": 100, "ignore_eos": True,
                       "temperature": 0, "vllm_xargs": {DELAY_ARG: 100}}).encode()
    ok = _count(m, vllm_llama.model, "llama", "openai", "ok")
    cancelled = _count(m, vllm_llama.model, "llama", "openai", "cancelled")
    _send_and_leave(m, endpoint, body, vllm_llama.model, "openai", after_s=1.0)  # of ~10 s
    _until("the call was not counted cancelled", lambda: _count(
        m, vllm_llama.model, "llama", "openai", "cancelled") == cancelled + 1)
    _until("vLLM went on generating for a client that left",
           lambda: _vllm_running(vllm_llama) == 0, within_s=5)
    assert _count(m, vllm_llama.model, "llama", "openai", "ok") == ok


@pytest.fixture(scope="module", params=[True, False], ids=["fast-lane", "aiohttp"])
def triton_proxy(request: pytest.FixtureRequest,
                 triton: TritonServer) -> Iterator[RunningMmguard]:
    cfg = {**triton_routes(triton, ["slow_fp32"]),
           "listeners": {"http": {"fast_lane": request.param}}}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        yield m


@pytest.mark.parametrize("half", [False, True], ids=["close", "half-close"])
@pytest.mark.parametrize("route", ["g_slow_fp32", "h_slow_fp32"])
def test_a_triton_call_whose_client_left_is_cancelled_and_counted_so(
        triton_proxy: RunningMmguard, route: str, half: bool) -> None:
    """The model sleeps 20 s; the call leaves mmguard's count of calls in flight within the
    liveness bound once its client hung up (it held it for the 20 s before). HTTP/1.1 has no
    half-close: a client that shuts down its sending side has left (as aiohttp and nginx
    read it)."""
    m = triton_proxy
    backend = "triton-grpc" if route.startswith("g_") else "triton-http"
    body = json.dumps({"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]},
        {"name": "delay_ms", "datatype": "INT32", "shape": [1, 1], "data": [20000]}]}).encode()
    ok = _count(m, route, backend, "http", "ok")
    cancelled = _count(m, route, backend, "http", "cancelled")
    _send_and_leave(m, f"/v2/models/{route}/infer", body, route, "http", after_s=0.5,
                    half=half)
    _until("the call whose client left stayed in flight",
           lambda: _in_flight(m, route, "http") == 0, within_s=10)
    assert _count(m, route, backend, "http", "cancelled") == cancelled + 1
    assert _count(m, route, backend, "http", "ok") == ok
    # the model is free again: Triton was told (gRPC cancels it; HTTP closes its connection)
    x = np.array([[3.0, 4.0]], np.float32)
    quick = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2],
                                    "data": x.ravel().tolist()}]}).encode()
    req = urllib.request.Request(f"http://{m.http_url}/v2/models/{route}/infer", quick,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        answer = json.loads(resp.read())
    assert answer["outputs"][0]["data"] == [3.0, 4.0]
