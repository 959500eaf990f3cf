"""The remote image fetcher under attack (issue 26 items 2 and 3): a budget for the amplifier,
and one address rule for the allow-list.

Before: four 756-byte chats naming eight allow-listed 7.9 MiB images each cost +1080 MiB and
a 1.48 s stall, and sent 84 MiB bodies to vLLM although clients are held to 16 MiB; and with
``127.0.0.1:A`` and ``localhost:B`` allow-listed, ``localhost:B`` was fetched from 127.0.0.1:B
(the literal entry allowed its address on any port).

The image hosts are ``http.server`` threads on loopback; the backend is the hand-written
OpenAI-compatible server of ``test_images`` (the fetch happens before any backend is asked),
here recording the size of every body it gets. Probes go to the ORT identity model on the same
listener all through.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.adversarial.test_images import MODEL, FakeOpenAI, PeakRss
from tests.conftest import ort_config
from tests.support.adversary import Prober, http_call, rss_mib, serve
from tests.support.process import MmguardProcess

MiB = 1 << 20
BIG = 7_900_000  # the 7.9 MiB image
LISTENER_LIMIT = 16 * MiB


class RecordingOpenAI(FakeOpenAI):
    """The fake chat server, recording the size of each body it was sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    async def _chat(self, request: web.Request) -> web.Response:
        self.sizes.append(len(await request.read()))
        self.completions += 1
        return web.json_response({
            "id": "c", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


class ImageHost:
    """Serves ``/big-<n>.png`` (``BIG`` bytes), ``/five.png`` (5 MiB: 4 MiB sent, then a pause
    until ``gate`` handlers have sent theirs or 5 s passed, then the rest) and ``/cat.png``.
    Records every path asked for."""

    def __init__(self, gate: int = 3) -> None:
        self.hits: list[str] = []
        self.gate = gate
        self._sent_first = 0
        self._cond = threading.Condition()
        host = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                host.hits.append(self.path)
                if self.path == "/five.png":
                    self._send_gated()
                    return
                body = b"\x89PNG" + b"\0" * (BIG - 4 if self.path.startswith("/big") else 60)
                self._head(len(body))
                self.wfile.write(body)

            def _head(self, length: int) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(length))
                self.end_headers()

            def _send_gated(self) -> None:
                self._head(5 * MiB)
                try:
                    self.wfile.write(b"\0" * (4 * MiB))
                    with host._cond:
                        host._sent_first += 1
                        host._cond.notify_all()
                        host._cond.wait_for(lambda: host._sent_first >= host.gate, timeout=5)
                    self.wfile.write(b"\0" * MiB)
                except OSError:
                    pass  # mmguard refused this one and closed the connection

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[ImageHost, ImageHost]]:
    allowed, other = ImageHost(), ImageHost()
    yield allowed, other
    allowed.close()
    other.close()


@pytest.fixture(scope="module")
def backend() -> Iterator[RecordingOpenAI]:
    fake = RecordingOpenAI()
    with fake:
        yield fake


@pytest.fixture(scope="module")
def mmguard(ort_models: Path, backend: RecordingOpenAI, hosts: tuple[ImageHost, ImageHost],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[MmguardProcess]:
    allowed, other = hosts
    cfg: dict[str, Any] = ort_config(ort_models, openai={
        "image_url_allow_hosts": [f"127.0.0.1:{allowed.port}", f"localhost:{other.port}"],
        "remote_images": "fetch",
        "fetch": {"max_pod_bytes": 10 * MiB, "timeout_s": 20}})
    cfg["listeners"] = {"http": {"max_request_bytes": LISTENER_LIMIT}}
    cfg["backends"].append({"kind": "vllm", "name": "fake", "image_input": "yes",
                            "url": f"http://127.0.0.1:{backend.port}"})
    cfg["models"].append({"name": MODEL, "backend": "fake"})
    with serve(tmp_path_factory.mktemp("fetch_budget"), cfg) as proc:
        yield proc


def chat(*urls: str) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is in the pictures?"},
        *({"type": "image_url", "image_url": {"url": u}} for u in urls)]}]}).encode()


def post(proc: MmguardProcess, body: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    status, headers, out = http_call(proc.ports["http"], "POST", "/v1/chat/completions", body,
                                     {"content-type": "application/json"}, timeout=60)
    return status, headers, json.loads(out)


def test_four_small_chats_naming_eight_big_images_each_stay_within_the_budget(
        mmguard: MmguardProcess, backend: RecordingOpenAI,
        hosts: tuple[ImageHost, ImageHost]) -> None:
    allowed = hosts[0]
    base = f"http://127.0.0.1:{allowed.port}"
    body = chat(*(f"{base}/big-{i}.png" for i in range(8)))
    assert len(body) < 1000
    # one image fits: served, and the body vLLM gets stays within the listener's 16 MiB
    status, headers, doc = post(mmguard, chat(f"{base}/big-one.png"))
    assert status == 200, doc
    assert headers["mmguard-remote-images"] == "fetched 1, sent inline"
    before_rss, sent_before = rss_mib(mmguard.proc.pid), len(backend.sizes)
    with Prober(mmguard.ports["http"]) as probes, PeakRss(mmguard.proc.pid) as rss, \
            ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: post(mmguard, body), range(4)))
    for status, _, doc in answers:
        assert status in (413, 429), (status, doc)
        message = doc["error"]["message"]
        assert doc["error"]["param"].startswith("messages[0].content["), doc
        assert ("max_json_bytes" in message or "max_request_bytes" in message
            or "max_pod_bytes" in message), message
    assert len(backend.sizes) == sent_before  # none of the four reached the backend
    assert max(backend.sizes) <= LISTENER_LIMIT, backend.sizes
    probes.assert_served()
    print(f"RSS before {before_rss:.0f} MiB, peak {rss.peak:.0f} MiB; "
          f"{[a[0] for a in answers]}; bodies sent {backend.sizes}")
    assert rss.peak - before_rss < 300, (before_rss, rss.peak)


def test_the_pod_holds_at_most_max_pod_bytes_of_fetched_images(
        mmguard: MmguardProcess, hosts: tuple[ImageHost, ImageHost]) -> None:
    """Three requests of one 5 MiB image each, their hosts pausing after 4 MiB until all
    three have sent that much: 12 MiB would be held at once, past the pod's 10 MiB, so one is
    refused with 429 and Retry-After while the others are served."""
    url = f"http://127.0.0.1:{hosts[0].port}/five.png"
    with Prober(mmguard.ports["http"]) as probes, ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: post(mmguard, chat(url)), range(3)))
    statuses = sorted(a[0] for a in answers)
    assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}, answers
    for status, headers, doc in answers:
        if status == 429:
            assert "openai.fetch.max_pod_bytes" in doc["error"]["message"], doc
            assert headers.get("retry-after") == "1"
    probes.assert_served()


def test_a_literal_entry_allows_its_address_on_its_own_port_only(
        mmguard: MmguardProcess, hosts: tuple[ImageHost, ImageHost]) -> None:
    """``127.0.0.1:A`` and ``localhost:B`` allow-listed: ``localhost:B`` resolves to
    127.0.0.1, which only port A may be reached on; nothing reaches port B."""
    allowed, other = hosts
    before = len(other.hits)
    status, _, doc = post(mmguard, chat(f"http://localhost:{other.port}/cat.png"))
    assert status == 400, doc
    message = doc["error"]["message"]
    assert f"none is allow-listed with port {other.port}" in message, message
    assert "mmguard did not fetch" in message
    status, _, doc = post(mmguard, chat(f"http://127.0.0.1:{other.port}/cat.png"))
    assert status == 400 and "is not on openai.image_url_allow_hosts" in \
        doc["error"]["message"], doc
    time.sleep(0.2)  # a fetch, had one been made, would have landed by now
    assert len(other.hits) == before
    status, _, doc = post(mmguard, chat(f"http://127.0.0.1:{allowed.port}/cat.png"))
    assert status == 200, doc
