"""The real vLLM fixture (tests/support/vllm.py), checked directly over HTTP, no proxy.

Needs ``bash scripts/setup_vllm.sh`` once; without it every test fails (never skips) and says so.
Two servers (tiny-llama, tiny-llava; ~3 GB RSS each) are started once per session (conftest).
Killing a server mid-stream is tested through mmguard, on a server of its own
(tests/integration/test_openai_vllm.py).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.support.vllm import (
    DELAY_ARG,
    IMAGE_TOKENS,
    MAX_IMAGES,
    MAX_MODEL_LEN,
    VllmServer,
    png_data_url,
)

pytestmark = pytest.mark.vllm


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def llama(vllm_llama: VllmServer) -> VllmServer:
    return vllm_llama


@pytest.fixture
def llava(vllm_llava: VllmServer) -> VllmServer:
    return vllm_llava


# ---------------------------------------------------------------------------------------------
# plain HTTP helpers
# ---------------------------------------------------------------------------------------------


def _request(
    url: str, body: dict[str, Any] | None = None, timeout: float = 60
) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url,
        data=data,
        method="POST" if data else "GET",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), json.loads(exc.read())


def _chat(server: VllmServer, content: object, **extra: object) -> tuple[int, dict[str, Any]]:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }
    return _request(server.url + "/v1/chat/completions", body)


def _image_content(n: int, text: str = "what is this?") -> list[dict[str, object]]:
    parts: list[dict[str, object]] = [{"type": "text", "text": text}]
    for i in range(n):
        url = png_data_url(40 + i, 30, (10 * i, 90, 200))
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _assert_error(status: int, body: dict[str, Any], param: str | None) -> None:
    assert status == 400, body
    err = body["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError", body
    assert err["param"] == param, body
    assert err["message"], body


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "llava"])
def test_models_reports_max_model_len(name: str, request: pytest.FixtureRequest) -> None:
    server: VllmServer = request.getfixturevalue(name)
    assert server.url.startswith("http://127.0.0.1:")
    status, body = _request(server.url + "/v1/models")
    assert status == 200
    [entry] = body["data"]
    assert entry["id"] == server.model
    assert entry["max_model_len"] == MAX_MODEL_LEN == server.max_model_len


def test_tokenize_counts(llama: VllmServer) -> None:
    status, body = _request(
        llama.url + "/tokenize", {"model": llama.model, "prompt": "hello world"}
    )
    assert status == 200, body
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == MAX_MODEL_LEN


def test_tokenize_counts_image_tokens(llava: VllmServer) -> None:
    counts = []
    for n in (0, 1, 2):
        status, body = _request(
            llava.url + "/tokenize",
            {
                "model": llava.model,
                "messages": [{"role": "user", "content": _image_content(n)}],
            },
        )
        assert status == 200, body
        counts.append(body["count"])
    assert counts[1] - counts[0] == IMAGE_TOKENS
    assert counts[2] - counts[1] == IMAGE_TOKENS


@pytest.mark.parametrize("name", ["llama", "llava"])
def test_chat_completion_returns_text(name: str, request: pytest.FixtureRequest) -> None:
    server: VllmServer = request.getfixturevalue(name)
    status, body = _chat(server, "hello world")
    assert status == 200, body
    [choice] = body["choices"]
    text = choice["message"]["content"]
    assert isinstance(text, str) and text.strip(), body
    assert text.isascii() and "\ufffd" not in text
    assert body["usage"]["completion_tokens"] <= 8
    # deterministic at temperature 0
    assert _chat(server, "hello world")[1]["choices"][0]["message"]["content"] == text


def test_streaming_events_then_done(llama: VllmServer) -> None:
    body = {
        "model": llama.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    req = urllib.request.Request(
        llama.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = resp.read().decode()
    data = [line.removeprefix("data: ") for line in raw.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert len(events) >= 3
    assert events[0]["choices"][0]["delta"].get("role") == "assistant"
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text.strip()


@pytest.mark.parametrize("images", [1, MAX_IMAGES])
def test_multimodal_chat(llava: VllmServer, images: int) -> None:
    status, body = _chat(llava, _image_content(images))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"].strip()
    status0, body0 = _chat(llava, _image_content(0))
    assert status0 == 200
    extra = body["usage"]["prompt_tokens"] - body0["usage"]["prompt_tokens"]
    assert extra == images * IMAGE_TOKENS


def test_too_many_images_is_400(llava: VllmServer) -> None:
    status, body = _chat(llava, _image_content(MAX_IMAGES + 1))
    _assert_error(status, body, "image")


@pytest.mark.parametrize("name", ["llama", "llava"])
def test_prompt_over_max_model_len_is_400(name: str, request: pytest.FixtureRequest) -> None:
    server: VllmServer = request.getfixturevalue(name)
    status, body = _chat(server, "hello world " * 70)  # ~145 tokens with the template
    _assert_error(status, body, "input_tokens")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in body["error"]["message"]


def test_max_tokens_over_max_model_len_is_400(llama: VllmServer) -> None:
    status, body = _chat(llama, "hi", max_tokens=MAX_MODEL_LEN + 1)
    _assert_error(status, body, "max_tokens")


def test_prompt_plus_max_tokens_over_limit_is_cut(llama: VllmServer) -> None:
    status, body = _chat(llama, "hello world " * 30, max_tokens=100, ignore_eos=True)
    assert status == 200, body
    usage = body["usage"]
    assert usage["total_tokens"] == MAX_MODEL_LEN
    assert body["choices"][0]["finish_reason"] == "length"


def test_image_to_text_model_is_400(llama: VllmServer) -> None:
    status, body = _chat(llama, _image_content(1))
    _assert_error(status, body, None)
    assert "not a multimodal model" in body["error"]["message"]


def test_rss_is_reported(llama: VllmServer, llava: VllmServer) -> None:
    for server in (llama, llava):
        assert 500 * 2**20 < server.rss_bytes() < 8 * 2**30


def _stream(server: VllmServer, **extra: object) -> tuple[list[float], str]:
    """Stream a chat completion; return each event's arrival time and the joined text."""
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        **extra,
    }
    req = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.monotonic()
    times, text = [], ""
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                times.append(time.monotonic() - t0)
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    return times, text


def test_delay_plugin_slows_stream_not_text(llama: VllmServer) -> None:
    fast_times, fast_text = _stream(llama)
    slow_times, slow_text = _stream(llama, vllm_xargs={DELAY_ARG: 60})
    assert slow_text == fast_text
    assert slow_times[-1] - slow_times[1] >= 8 * 0.06  # 10 tokens, one sleep each
    assert fast_times[-1] < slow_times[-1]
    status, body = _chat(llama, "hi", vllm_xargs={DELAY_ARG: "soon"})
    assert status == 400, body
    assert DELAY_ARG in body["error"]["message"]
