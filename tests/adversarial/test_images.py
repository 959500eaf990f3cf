"""Image decode amplification (issue 15, item 9): four small PNGs that declare 6300 × 6300
pixels each, sent at once to an OpenAI route whose quality filter scores images. Before the fix
each was decoded to a full-size RGB array (+1.8 GB for four); now scoring decodes a reduced image
and a process-wide budget bounds the pixels being decoded at once.

The backend is a hand-written OpenAI-compatible server on loopback (it speaks the real wire
protocol: /health, /version, /v1/models, /v1/chat/completions): the attack is on mmguard's own
decoding, before any backend is asked, and a real vLLM costs 3.3 GB that this tier does not
need. Probes go to the ORT identity model on the same listener, every 100 ms, all through the
attack.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from PIL import Image

from tests.conftest import ort_config
from tests.support.adversary import Prober, http_call, rss_mib, serve
from tests.support.fake_openai import openai_app
from tests.support.loop import LoopbackApp
from tests.support.process import MmguardProcess

MODEL = "mm-fake"
SIDE = 6300


class FakeOpenAI(LoopbackApp):
    """An OpenAI-compatible chat server that answers every completion with one fixed word and
    counts the completions it was asked for."""

    def __init__(self) -> None:
        super().__init__(self._app)
        self.completions = 0

    def _app(self) -> web.Application:
        return openai_app(MODEL, self._chat, client_max_size=64 << 20)

    async def _chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.completions += 1
        return web.json_response({
            "id": f"chatcmpl-{self.completions}", "object": "chat.completion", "created": 0,
            "model": MODEL, "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as fake:
        yield fake


@pytest.fixture(scope="module")
def mmguard(ort_models: Path, backend: FakeOpenAI,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[MmguardProcess]:
    cfg: dict[str, Any] = ort_config(ort_models)
    cfg["backends"].append({"kind": "vllm", "name": "fake", "image_input": "yes",
                            "url": f"http://127.0.0.1:{backend.port}"})
    cfg["models"].append({"name": MODEL, "backend": "fake",
                          "filters": [{"quality": {"drift": None}}]})
    with serve(tmp_path_factory.mktemp("images"), cfg) as proc:
        yield proc


def png_data_url(side: int, colour: tuple[int, int, int]) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_body(url: str) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is in the picture?"},
        {"type": "image_url", "image_url": {"url": url}}]}]}).encode()


class PeakRss:
    """Samples a process's RSS every 20 ms from a thread; ``peak`` is the highest seen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_mib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_mib(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_four_6300px_pngs_at_once_stay_within_the_decode_budget(
        mmguard: MmguardProcess, backend: FakeOpenAI) -> None:
    port = mmguard.ports["http"]
    url = png_data_url(SIDE, (90, 120, 200))
    assert len(url) < 400_000  # a few hundred KiB on the wire for 119 MB of RGB
    # warm up: the route, the worker threads and the allocator see one small image first
    assert http_call(port, "POST", "/v1/chat/completions", chat_body(
        png_data_url(300, (10, 200, 30))), {"content-type": "application/json"})[0] == 200
    before = rss_mib(mmguard.proc.pid)
    with Prober(port) as probes, PeakRss(mmguard.proc.pid) as rss, \
            ThreadPoolExecutor(4) as pool:
        time.sleep(0.3)
        answers = list(pool.map(lambda _: http_call(
            port, "POST", "/v1/chat/completions", chat_body(url),
            {"content-type": "application/json"}, timeout=60), range(4)))
        time.sleep(0.3)
    after = rss_mib(mmguard.proc.pid)
    statuses = [a[0] for a in answers]
    # each is served, or refused as over the decode budget (never a 500, never a crash)
    assert set(statuses) <= {200, 429} and 200 in statuses, statuses
    for status, headers, body in answers:
        if status == 200:
            assert json.loads(body)["choices"][0]["message"]["content"] == "ok"
            assert headers["mmguard-quality-scores"].startswith("scored; trust=")
        else:
            message = json.loads(body)["error"]["message"]
            assert "image decode budget" in message and headers.get("retry-after") == "1"
    probes.assert_served()
    # one image at the limit is in flight at a time: ~160 MB of decoder memory, not 4 × 450 MB
    print(f"RSS before {before:.0f} MiB, peak {rss.peak:.0f} MiB, after {after:.0f} MiB; "
          f"answers {statuses}")
    assert rss.peak - before < 600, (before, rss.peak)
    assert after - before < 300, (before, after)


def test_a_flood_of_huge_images_stays_within_the_budget_and_probes_go_on(
        mmguard: MmguardProcess) -> None:
    # Ten at once: each is served in turn or refused as over the budget (how many depends on
    # how fast this machine decodes; the refusal itself is tested in
    # tests/unit/test_quality_decode.py); memory stays at about one image.
    port = mmguard.ports["http"]
    url = png_data_url(SIDE, (200, 40, 40))
    before = rss_mib(mmguard.proc.pid)
    with Prober(port) as probes, PeakRss(mmguard.proc.pid) as rss, \
            ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: http_call(
            port, "POST", "/v1/chat/completions", chat_body(url),
            {"content-type": "application/json"}, timeout=60), range(10)))
    statuses = [a[0] for a in answers]
    assert set(statuses) <= {200, 429} and 200 in statuses, statuses
    for status, headers, body in answers:
        if status == 429:
            assert "image decode budget" in json.loads(body)["error"]["message"]
            assert headers.get("retry-after") == "1"
    probes.assert_served()
    print(f"flood of 10: RSS before {before:.0f} MiB, peak {rss.peak:.0f} MiB; {statuses}")
    assert rss.peak - before < 600, (before, rss.peak)
