"""A backend answer is held up to the backend's ``max_message_bytes`` and no further, on every
backend kind and both HTTP clients: past it the client gets a bad gateway (HTTP 502, gRPC
INTERNAL, an OpenAI error) that names the backend, the model and the setting, the backend's
connection is closed, and the next call is served. Without the bound a broken server could make
mmguard read and hold an answer until its memory ran out, for every client at once. In time as
in bytes: a vLLM stream that goes silent is broken off after ``stream_idle_timeout_s``.

Real Triton (a 600 KB identity answer through a 64 KiB bound; a 600 KB request that a 64 KiB
gRPC channel cannot send); real ``tritonclient`` and ``openai`` clients. What no real server does
on cue — answer bigger than its request over gRPC, send a server-sent event of 100 KiB — the
hand-written servers do over the real wire (``FakeV2`` with ``grow``, a small OpenAI server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from aiohttp import web
from tritonclient.utils import InferenceServerException

from tests.support.fake_openai import openai_app
from tests.support.fake_v2 import FakeV2
from tests.support.loop import LoopbackApp
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer

BOUND = 64 * 1024
CLIENTS = ("httptools", "aiohttp")
CHAT_MODEL = "chatty"
BIG_TEXT = "w" * (100 * 1024)
IDLE_S = 1.0  # well above a busy machine's stalls: a watch fires only on silence


class BigOpenAI(LoopbackApp):
    """An OpenAI-compatible server whose answers are 100 KiB: a whole chat answer, or a stream
    whose first event (prompt "first") or second event (prompt "later") is that big; or a
    stream that goes silent after its head ("stall-first") or its first event ("stall")."""

    def __init__(self) -> None:
        super().__init__(self._app, on_stop=lambda: self.stop.set())
        self.stop: Any = None  # an asyncio.Event of the server's loop: silent streams end

    def _app(self) -> web.Application:
        self.stop = asyncio.Event()
        return openai_app(CHAT_MODEL, self._chat)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        doc = await request.json()
        if not doc.get("stream"):
            return web.json_response(_chunk(BIG_TEXT, "chat.completion"))
        prompt = doc["messages"][-1]["content"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if prompt.startswith("stall"):
            if prompt == "stall":
                await resp.write(b"data: " + json.dumps(_chunk("ok")).encode() + b"\n\n")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 60)
            return resp
        texts = [BIG_TEXT, "ok"] if prompt == "first" else ["ok", BIG_TEXT]
        for text in texts:
            await resp.write(b"data: " + json.dumps(_chunk(text)).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _chunk(text: str, kind: str = "chat.completion.chunk") -> dict[str, Any]:
    part = "message" if kind == "chat.completion" else "delta"
    return {"id": "chatcmpl-1", "object": kind, "created": 0, "model": CHAT_MODEL,
            "choices": [{"index": 0, "finish_reason": None,
                         part: {"role": "assistant", "content": text}}]}


@pytest.fixture(scope="module")
def proxy(triton: TritonServer) -> Iterator[tuple[RunningMmguard, FakeV2]]:
    with FakeV2() as fake, BigOpenAI() as chat:
        fake.grow = 16
        backends: list[dict[str, Any]] = [
            {"kind": "triton_http", "name": f"t-{c}", "url": triton.http_url,
             "infer_client": c, "max_message_bytes": BOUND} for c in CLIENTS]
        backends += [
            {"kind": "triton_grpc", "name": "t-grpc", "url": triton.grpc_url,
             "max_message_bytes": BOUND},
            {"kind": "triton_grpc", "name": "fake-grpc", "url": f"127.0.0.1:{fake.grpc_port}",
             "max_message_bytes": BOUND},
            {"kind": "triton_http", "name": "fake-http", "url": f"127.0.0.1:{fake.http_port}",
             "max_message_bytes": BOUND},
            *({"kind": "vllm", "name": f"chat-{c}", "url": f"http://127.0.0.1:{chat.port}",
               "image_input": "no", "infer_client": c, "max_message_bytes": BOUND,
               "stream_idle_timeout_s": IDLE_S}
              for c in CLIENTS)]
        models: list[dict[str, Any]] = [
            {"name": f"{b}_{m}", "backend": b, "backend_model": m}
            for b in ("t-httptools", "t-aiohttp", "t-grpc")
            for m in ("pixel_identity", "small_fp32")]
        models += [{"name": f"{b}_echo", "backend": b, "backend_model": "echo"}
                   for b in ("fake-grpc", "fake-http")]
        models += [{"name": f"chat-{c}", "backend": f"chat-{c}", "backend_model": CHAT_MODEL}
                   for c in CLIENTS]
        with RunningMmguard({"backends": backends, "models": models}) as m:
            m.wait_ready()
            yield m, fake


def _infer(proxy: RunningMmguard, front: str, route: str, name: str, data: np.ndarray[Any, Any]
           ) -> Any:
    lib: Any = httpclient if front == "http" else grpcclient
    client = lib.InferenceServerClient(proxy.http_url if front == "http" else proxy.grpc_url)
    t = lib.InferInput(name, list(data.shape), "FP32")
    t.set_data_from_numpy(data)
    return client.infer(route, [t])


PIXELS = np.random.default_rng(3).random((1, 3, 224, 224), dtype=np.float32)
SMALL = np.arange(16, dtype=np.float32).reshape(1, 16)


@pytest.mark.parametrize("front", ["http", "grpc"])
@pytest.mark.parametrize("backend", ["t-httptools", "t-aiohttp"])
def test_a_triton_http_answer_over_the_bound_is_a_bad_gateway_and_the_next_call_is_served(
        proxy: tuple[RunningMmguard, FakeV2], front: str, backend: str) -> None:
    m, _ = proxy
    with pytest.raises(InferenceServerException) as err:
        _infer(m, front, f"{backend}_pixel_identity", "pixel_values", PIXELS)
    message = err.value.message()
    assert err.value.status() == ("502" if front == "http" else "StatusCode.INTERNAL")
    assert f"backend '{backend}'" in message and "model 'pixel_identity'" in message
    assert "sent an answer of " in message  # Triton declares its length: refused unread
    assert f"at most {BOUND} bytes (backends[].max_message_bytes)" in message
    out = _infer(m, front, f"{backend}_small_fp32", "x", SMALL)
    assert out.as_numpy("y").shape == (1, 16)  # the same backend serves the next call


@pytest.mark.parametrize("front", ["http", "grpc"])
def test_a_grpc_answer_over_the_bound_is_a_bad_gateway_not_an_overload(
        proxy: tuple[RunningMmguard, FakeV2], front: str) -> None:
    m, _ = proxy
    data = np.ones((1, 2048), np.float32)  # 8 KiB in, 128 KiB out (grow 16)
    with pytest.raises(InferenceServerException) as err:
        _infer(m, front, "fake-grpc_echo", "INPUT0", data)
    message = err.value.message()
    assert err.value.status() == ("502" if front == "http" else "StatusCode.INTERNAL")
    assert "backend 'fake-grpc'" in message and "model 'echo'" in message
    assert f"at most {BOUND} bytes (backends[].max_message_bytes) and refused it" in message
    small = _infer(m, front, "fake-grpc_echo", "INPUT0", np.ones((1, 16), np.float32))
    assert small.as_numpy("OUTPUT0").shape == (1, 256)


@pytest.mark.parametrize("front", ["http", "grpc"])
def test_a_chunk_by_chunk_http_answer_over_the_bound_is_cut_off(
        proxy: tuple[RunningMmguard, FakeV2], front: str) -> None:
    m, _ = proxy
    data = np.ones((1, 2048), np.float32)
    with pytest.raises(InferenceServerException) as err:
        _infer(m, front, "fake-http_echo", "INPUT0", data)
    assert "backend 'fake-http'" in err.value.message()
    assert "(backends[].max_message_bytes)" in err.value.message()


def test_a_request_over_a_grpc_backends_bound_is_too_large_and_names_the_setting(
        proxy: tuple[RunningMmguard, FakeV2]) -> None:
    m, _ = proxy
    with pytest.raises(InferenceServerException) as err:
        _infer(m, "http", "t-grpc_pixel_identity", "pixel_values", PIXELS)
    assert err.value.status() == "413"
    assert "backend 't-grpc'" in err.value.message()
    assert f"at most {BOUND} bytes (backends[].max_message_bytes)" in err.value.message()
    assert _infer(m, "http", "t-grpc_small_fp32", "x", SMALL).as_numpy("y").shape == (1, 16)


def _broken_after_ok(sdk: openai.OpenAI, route: str, prompt: str) -> str:
    """A stream broken off after its first event: that event reached the client, then an
    error; the error's message."""
    got: list[str] = []
    with pytest.raises(openai.APIError) as err:
        for chunk in sdk.chat.completions.create(
                model=route, stream=True, messages=[{"role": "user", "content": prompt}]):
            got.append(chunk.choices[0].delta.content or "")
    assert got == ["ok"]
    return err.value.message


@pytest.mark.parametrize("client", CLIENTS)
def test_openai_answers_and_events_over_the_bound_are_refused_and_named(
        proxy: tuple[RunningMmguard, FakeV2], client: str) -> None:
    m, _ = proxy
    sdk = openai.OpenAI(base_url=f"http://{m.http_url}/v1", api_key="none", max_retries=0)
    route = f"chat-{client}"
    with pytest.raises(openai.APIStatusError) as whole:
        sdk.chat.completions.create(model=route, messages=[{"role": "user", "content": "hi"}])
    assert whole.value.status_code == 502
    assert "max_message_bytes" in whole.value.message
    with pytest.raises(openai.APIStatusError) as first:  # before the first event: a 502
        list(sdk.chat.completions.create(model=route, stream=True,
                                         messages=[{"role": "user", "content": "first"}]))
    assert first.value.status_code == 502
    assert "a server-sent event of more than 65536 bytes" in first.value.message
    assert "a server-sent event of more than 65536 bytes" in _broken_after_ok(sdk, route, "later")


@pytest.mark.parametrize("client", CLIENTS)
def test_a_stream_that_goes_silent_is_broken_off_after_the_idle_timeout(
        proxy: tuple[RunningMmguard, FakeV2], client: str) -> None:
    m, _ = proxy
    sdk = openai.OpenAI(base_url=f"http://{m.http_url}/v1", api_key="none", max_retries=0,
                        timeout=30)
    route = f"chat-{client}"
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as first:  # silent before its first event: 504
        list(sdk.chat.completions.create(model=route, stream=True,
                                         messages=[{"role": "user", "content": "stall-first"}]))
    assert first.value.status_code == 504
    assert f"sent nothing on the stream of model '{CHAT_MODEL}' for {IDLE_S:g} s" in (
        first.value.message)
    assert "(backends[].stream_idle_timeout_s)" in first.value.message
    assert "stream_idle_timeout_s" in _broken_after_ok(sdk, route, "stall")
    assert time.monotonic() - t0 < 20  # liveness: not the server's 60 s silence
