"""An OpenAI stream through mmguard, byte for byte, however the backend's events fall into
reads: several events in one write, one event cut across two, every event and the stream's end
in one read (mmguard then sends them and its own end in one write), usage and finish reasons
counted (compact and spaced JSON, ``null`` ones not), renamed routes renamed on every event.
Each test runs on the default chain, where the front reads the stream read by read
(``SseStream.reads``), and behind a filter that wraps the stream (``shape_guard``), where it
reads it event by event.

The backend is hand-written: it speaks vLLM's SSE wire, and on cue writes its events in the
groupings a real server only shows under load (events of one read sent together by mmguard is
what keeps a stream at one syscall per backend read)."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from tests.support.loop import BackgroundLoop
from tests.support.mmguard import RunningMmguard

MODEL = "tiny-fake"


def _event(doc: dict[str, Any], spaced: bool = False) -> bytes:
    text = json.dumps(doc) if spaced else json.dumps(doc, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


def _events() -> list[bytes]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}

    def delta(content: str, finish: str | None = None, spaced: bool = False) -> bytes:
        return _event({**head, "usage": None, "choices": [
            {"index": 0, "delta": {"content": content}, "finish_reason": finish}]}, spaced)

    return [delta(""), *(delta(f"t{i} ") for i in range(6)), delta("", "length", spaced=True),
            _event({**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6,
                                                     "total_tokens": 9}}),
            b"data: [DONE]\n\n"]


# how the backend cuts its bytes into writes: a list of byte ranges of the whole stream
def _writes(stream: bytes, how: str) -> list[bytes]:
    if how == "together":  # the whole answer in one write
        return [stream]
    if how == "pairs":  # two events per write
        events = re.findall(rb".+?\n\n", stream, re.S)
        return [b"".join(events[i:i + 2]) for i in range(0, len(events), 2)]
    # "cut": every write ends in the middle of an event
    return [stream[i:i + 37] for i in range(0, len(stream), 37)]


class SseBackend:
    """vLLM's endpoints that mmguard's backend reads, and a chat stream written as ``how``."""

    def __init__(self) -> None:
        self.how = "together"
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._ok)
        app.router.add_get("/version", self._version)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/tokenize", self._tokenize)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _tokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"count": 3, "max_model_len": 128, "tokens": [1, 2, 3]})

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0-fake"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "root": MODEL, "max_model_len": 128}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        doc = await request.json()
        if "image_url" in json.dumps(doc):  # the image probe: a text-only model
            return web.json_response({"object": "error", "message": "text only"}, status=400)
        if self.how == "whole":  # every event and the end in one read (Content-Length)
            return web.Response(body=b"".join(_events()),
                                headers={"Content-Type": "text/event-stream"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in _writes(b"".join(_events()), self.how):
            await resp.write(chunk)
            await asyncio.sleep(0.01)  # each write its own read on mmguard's side
        await resp.write_eof()
        return resp


@pytest.fixture(scope="module")
def backend() -> Iterator[SseBackend]:
    loop = BackgroundLoop()
    b = SseBackend()
    loop.run(b.start())
    yield b
    loop.run(b.stop())
    loop.close()
    loop.loop.close()


@pytest.fixture(scope="module", params=["default chain", "stream wrapped by a filter"])
def proxy(backend: SseBackend, request: pytest.FixtureRequest) -> Iterator[RunningMmguard]:
    cfg: dict[str, Any] = {
        "backends": [{"kind": "vllm", "name": "fake", "url": f"http://127.0.0.1:{backend.port}",
                      "image_input": "no"}],
        "models": [{"name": MODEL, "backend": "fake"},
                   {"name": "renamed", "backend": "fake", "backend_model": MODEL}]}
    if request.param != "default chain":
        cfg["defaults"] = {"filters": [{"limits": {}}, {"shape_guard": {}}]}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        yield m


def _post(url: str, model: str) -> bytes:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return bytes(r.read())


def _metric(proxy: RunningMmguard, name: str) -> float:
    text = urllib.request.urlopen(f"{proxy.admin_url}/metrics", timeout=10).read().decode()
    found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith(name)]
    return sum(found)


@pytest.mark.parametrize("how", ["together", "pairs", "cut", "whole"])
def test_the_stream_arrives_byte_for_byte_however_it_was_read(
        proxy: RunningMmguard, backend: SseBackend, how: str) -> None:
    backend.how = how
    direct = _post(f"http://127.0.0.1:{backend.port}/v1/chat/completions", MODEL)
    tokens = _metric(proxy, 'mmguard_tokens_total{kind="completion",model="tiny-fake"}')
    reasons = _metric(proxy, 'mmguard_finish_reasons_total{model="tiny-fake",reason="length"}')
    via = _post(f"http://{proxy.http_url}/v1/chat/completions", MODEL)
    assert via == direct == b"".join(_events())
    # the usage event and the (spaced) finish event were read; the null ones were not counted
    assert _metric(proxy, 'mmguard_tokens_total{kind="completion",model="tiny-fake"}') \
        == tokens + 6
    assert _metric(proxy, 'mmguard_finish_reasons_total{model="tiny-fake",reason="length"}') \
        == reasons + 1


def test_a_renamed_route_renames_every_event_in_order(proxy: RunningMmguard,
                                                     backend: SseBackend) -> None:
    backend.how = "pairs"
    via = _post(f"http://{proxy.http_url}/v1/chat/completions", "renamed")
    events = re.findall(rb"data: (.+?)\n\n", via, re.S)
    assert events[-1] == b"[DONE]" and len(events) == len(_events())
    docs = [json.loads(e) for e in events[:-1]]
    assert {d["model"] for d in docs} == {"renamed"}
    assert "".join(d["choices"][0]["delta"]["content"] for d in docs if d["choices"]) == \
        "".join(f"t{i} " for i in range(6))
