"""A fast fake of vLLM's OpenAI server, for measuring what mmguard itself adds to a stream.

    python -m bench.fake_vllm PORT [MODEL]

Speaks the parts of vLLM's API that mmguard's ``vllm`` backend and ``bench.openai`` use, on
aiohttp with uvloop, with no model behind it: ``/health``, ``/v1/models`` (``max_model_len``
128), ``/version``, ``/tokenize`` (one token per word), and ``/v1/chat/completions``: a streamed
answer is vLLM's event sequence (a role event, ``max_tokens`` content events ``"tok<i> "``, a
``finish_reason: length`` event, a usage event when ``stream_options.include_usage``, ``[DONE]``),
each event its own write; a request with an image part is refused with 400 (the backend's image
probe reads "text only"). So the backend costs next to nothing and every CPU-millisecond of
mmguard's shows, where a real vLLM on the same two cores would drown it in ±15 ms of noise
(``python -m bench.openai --backend fake``). Prints ``ready`` once it listens.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from bench.common import ROOT, free_ports, pdeathsig, stop_process

MAX_MODEL_LEN = 128


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def chunks(model: str, max_tokens: int, usage: bool) -> list[bytes]:
    """The SSE events of one streamed answer, as vLLM writes them."""
    head = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}]}

    out = [_event(choice({"role": "assistant", "content": ""}))]
    out += [_event(choice({"content": f"tok{i} "})) for i in range(max_tokens)]
    out.append(_event(choice({}, "length")))
    if usage:
        out.append(_event({**head, "choices": [], "usage": {
            "prompt_tokens": 16, "total_tokens": 16 + max_tokens,
            "completion_tokens": max_tokens}}))
    out.append(b"data: [DONE]\n\n")
    return out


def app(model: str) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": model, "object": "model", "created": 0, "owned_by": "fake", "root": model,
             "max_model_len": MAX_MODEL_LEN}]})

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "fake"})

    async def tokenize(request: web.Request) -> web.Response:
        doc = await request.json()
        text = doc.get("prompt") or json.dumps(doc.get("messages", ""))
        n = len(str(text).split())
        return web.json_response({"count": n, "max_model_len": MAX_MODEL_LEN,
                                  "tokens": list(range(n))})

    async def chat(request: web.Request) -> web.StreamResponse:
        doc = await request.json()
        if '"image_url"' in json.dumps(doc.get("messages", [])):
            return web.json_response({"object": "error", "message": "text-only model",
                                      "type": "BadRequestError", "code": 400}, status=400)
        max_tokens = int(doc.get("max_tokens") or 16)
        if not doc.get("stream"):
            text = "".join(f"tok{i} " for i in range(max_tokens))
            return web.json_response({
                "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 16, "completion_tokens": max_tokens,
                          "total_tokens": 16 + max_tokens}})
        usage = bool((doc.get("stream_options") or {}).get("include_usage"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in chunks(model, max_tokens, usage):
            await resp.write(event)  # one write per event, as a token-by-token server does
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    a = web.Application()
    a.router.add_get("/health", health)
    a.router.add_get("/v1/models", models)
    a.router.add_get("/version", version)
    a.router.add_post("/tokenize", tokenize)
    a.router.add_post("/v1/chat/completions", chat)
    return a


async def serve(port: int, model: str) -> None:
    runner = web.AppRunner(app(model), access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


class FakeVllm:
    """The fake as a child process, with the face ``bench.openai`` uses of a ``VllmServer``."""

    def __init__(self, model: str, log_path: Path) -> None:
        self.model = model
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.start_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        t0 = time.monotonic()
        self.port = free_ports(1)[0]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bench.fake_vllm", str(self.port), self.model], cwd=ROOT,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
                preexec_fn=pdeathsig)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            if "ready" in self.log_path.read_text(errors="replace"):
                self.start_seconds = time.monotonic() - t0
                return
            time.sleep(0.05)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"the fake vLLM did not start; log tail:\n{tail}")

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout=10)


if __name__ == "__main__":
    import uvloop

    uvloop.run(serve(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "tiny-llama"))
