"""A backend answer whose bytes do not fit its shape never reaches a client as a 200.

No real server sends one on cue, so a real v2 server over the real wire (``FakeV2``) does: an
output 4 bytes short or long, BYTES framing cut or an element short, JSON data an element
short, a raw-content count that does not match the outputs, a binary part longer than the
outputs declare. Through either Triton backend and either front, the client gets INTERNAL / 502
naming the backend, the model and the output; with a fallback configured, the next level
answers instead.
"""

from __future__ import annotations

import json
import queue
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.fake_v2 import FakeV2
from tests.support.mmguard import RunningMmguard

X = np.arange(16, dtype=np.float32).reshape(1, 16)

# (backend kind, cue, what the error must say beyond naming backend, model and output)
CASES = [
    ("grpc", "short", "FP32 shape [1, 16] needs 64 bytes, got 60"),
    ("grpc", "long", "FP32 shape [1, 16] needs 64 bytes, got 68"),
    ("grpc", "bytes-cut", "BYTES element 15 declares 9 bytes, only 3 remain"),
    ("grpc", "bytes-count", "shape needs 16 BYTES elements, got 15"),
    ("grpc", "raw-count", "2 outputs but 1 raw_output_contents"),
    ("http", "short", "FP32 shape [1, 16] needs 64 bytes, got 60"),
    ("http", "long", "FP32 shape [1, 16] needs 64 bytes, got 68"),
    ("http", "json-short", "FP32 shape [1, 16] needs 16 elements, the JSON data has 15"),
    ("http", "bytes-cut", "BYTES element 15 declares 9 bytes, only 3 remain"),
    ("http", "bytes-count", "shape needs 16 BYTES elements, got 15"),
    ("http", "binary-extra", "the binary part has 68 bytes but the outputs declare 64"),
]


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[FakeV2, FakeV2]]:
    with FakeV2() as broken, FakeV2() as healthy:
        yield broken, healthy


@pytest.fixture(scope="module")
def proxy(fakes: tuple[FakeV2, FakeV2]) -> Iterator[RunningMmguard]:
    broken, healthy = fakes
    fallback = {"fallback": {"degrade_to": ["echo_ok"], "cache": None,
                             "breaker": {"minimum_calls": 100}}}
    cfg = {"backends": [
        {"kind": "triton_grpc", "name": "fake-grpc", "url": f"127.0.0.1:{broken.grpc_port}"},
        {"kind": "triton_http", "name": "fake-http", "url": f"127.0.0.1:{broken.http_port}"},
        {"kind": "triton_grpc", "name": "healthy", "url": f"127.0.0.1:{healthy.grpc_port}"}],
        "models": [{"name": "g_echo", "backend": "fake-grpc", "backend_model": "echo"},
                   {"name": "h_echo", "backend": "fake-http", "backend_model": "echo"},
                   {"name": "guarded", "backend": "fake-grpc", "backend_model": "echo",
                    "filters": [fallback]},
                   {"name": "echo_ok", "backend": "healthy", "backend_model": "echo"}]}
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        yield m


@pytest.fixture
def broken(fakes: tuple[FakeV2, FakeV2]) -> Iterator[FakeV2]:
    yield fakes[0]
    fakes[0].bad_answer = ""


def infer(proxy: RunningMmguard, front: str, route: str) -> Any:
    """The answer (a numpy array) or the InferenceServerException."""
    if front == "grpc":
        g = grpcclient.InferenceServerClient(proxy.grpc_url)
        inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(X)
        try:
            return g.infer(route, [inp]).as_numpy("OUTPUT0")
        except InferenceServerException as exc:
            return exc
        finally:
            g.close()
    h = httpclient.InferenceServerClient(proxy.http_url)
    binary = front == "http"
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(X, binary_data=binary)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
    try:
        return h.infer(route, [inp], outputs=[out]).as_numpy("OUTPUT0")
    except InferenceServerException as exc:
        return exc
    finally:
        h.close()


@pytest.mark.parametrize("front", ["grpc", "http", "http-json"])
@pytest.mark.parametrize("kind", ["grpc", "http"])
def test_a_healthy_answer_passes(proxy: RunningMmguard, broken: FakeV2, kind: str,
                                 front: str) -> None:
    got = infer(proxy, front, f"{kind[0]}_echo")
    assert isinstance(got, np.ndarray), got
    assert got.tobytes() == X.tobytes()




def _fits(kind: str, cue: str, front: str) -> bool:
    """A JSON body reaches an HTTP backend as it came (JSON), and the fake answers a JSON body
    with JSON data: there only the JSON and BYTES cues apply. Every other call reaches it in
    binary, where the JSON cue does not."""
    if kind == "http" and front == "http-json":
        return cue == "json-short" or cue.startswith("bytes-")
    return cue != "json-short"


MATRIX = [(kind, cue, detail, front) for kind, cue, detail in CASES
          for front in ("grpc", "http", "http-json") if _fits(kind, cue, front)]


@pytest.mark.parametrize(("kind", "cue", "detail", "front"), MATRIX,
                         ids=[f"{k}-{c}-{f}" for k, c, _, f in MATRIX])
def test_an_answer_that_does_not_fit_is_internal(proxy: RunningMmguard, broken: FakeV2,
                                                 kind: str, cue: str, detail: str,
                                                 front: str) -> None:
    broken.bad_answer = cue
    got = infer(proxy, front, f"{kind[0]}_echo")
    assert isinstance(got, InferenceServerException), f"forwarded as an answer: {got}"
    assert got.status() == ("StatusCode.INTERNAL" if front == "grpc" else "502")
    message = got.message() or ""
    assert f"backend 'fake-{kind}' for model 'echo' answered outside its contract" in message
    assert detail in message
    if cue not in ("raw-count", "binary-extra"):  # those are about the answer as a whole
        assert "output 'OUTPUT0'" in message


def test_fallback_answers_from_the_next_level(proxy: RunningMmguard, broken: FakeV2) -> None:
    """The check's INTERNAL is a failure the fallback acts on: L2 answers, and says so."""
    broken.bad_answer = "short"
    head = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
                                   "parameters": {"binary_data_size": 64}}],
                       "parameters": {"binary_data_output": True}}).encode()
    req = urllib.request.Request(
        f"http://{proxy.http_url}/v2/models/guarded/infer", data=head + X.tobytes(),
        method="POST", headers={"Inference-Header-Content-Length": str(len(head)),
                                "Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(req, timeout=30) as r:
        body, hlen = r.read(), int(r.headers["Inference-Header-Content-Length"])
        level = r.headers["mmguard-fallback-level"]
    assert level.startswith("2;") and "needs 64 bytes, got 60" in level
    assert body[hlen:] == X.tobytes()


@pytest.mark.parametrize("cue", ["short", "bytes-cut"])
def test_a_streamed_answer_that_does_not_fit_is_a_stream_error(proxy: RunningMmguard,
                                                               broken: FakeV2, cue: str) -> None:
    """ModelStreamInfer: the bad answer becomes the stream's error message, as Triton sends its
    errors on a stream, naming the backend, model and output; the next good one still comes."""
    results: queue.Queue[Any] = queue.Queue()
    g = grpcclient.InferenceServerClient(proxy.grpc_url)
    inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(X)
    try:
        g.start_stream(callback=lambda result, error: results.put(error or result))
        broken.bad_answer = cue
        g.async_stream_infer("g_echo", [inp])
        first = results.get(timeout=30)
        broken.bad_answer = ""
        g.async_stream_infer("g_echo", [inp])
        second = results.get(timeout=30)
    finally:
        g.stop_stream()
        g.close()
    assert isinstance(first, InferenceServerException), first
    message = first.message() or ""
    assert "backend 'fake-grpc' for model 'echo' answered outside its contract" in message
    assert "output 'OUTPUT0'" in message
    assert second.as_numpy("OUTPUT0").tobytes() == X.tobytes()
