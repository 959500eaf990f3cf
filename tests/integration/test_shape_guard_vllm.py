"""shape_guard in front of a real vLLM: prompt + max_tokens over max_model_len is refused with
the counts or rerouted to a longer-context model; finish_reason "length" is flagged."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.mmguard import RunningMmguard
from tests.support.vllm import VllmServer

pytestmark = pytest.mark.vllm
PROMPT = "tell me everything about " + "the quiet river and the old mill " * 6


@pytest.fixture(scope="module")
def proxy(vllm_llama: VllmServer, vllm_llama_long: VllmServer) -> Iterator[RunningMmguard]:
    cfg = {
        "backends": [{"kind": "vllm", "name": "short", "url": vllm_llama.url},
                     {"kind": "vllm", "name": "long", "url": vllm_llama_long.url}],
        "models": [
            {"name": "tiny-llama", "backend": "short"},
            {"name": "guarded", "backend": "short", "backend_model": "tiny-llama",
             "filters": [{"shape_guard": {}}]},
            {"name": "guarded_reroute", "backend": "short", "backend_model": "tiny-llama",
             "filters": [{"shape_guard": {"on_context": "reroute",
                                          "reroute_to": "tiny-llama-long"}}]},
            {"name": "tiny-llama-long", "backend": "long", "filters": [{"shape_guard": {}}]},
            {"name": "strict_finish", "backend": "short", "backend_model": "tiny-llama",
             "filters": [{"shape_guard": {"on_length_finish": "reject"}}]},
        ],
    }
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=120)
        yield m


def post(url: str, doc: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:  # an error response holds its socket until closed
            return e.code, dict(e.headers), json.loads(e.read())


def prompt_tokens(server: VllmServer) -> int:
    req = urllib.request.Request(server.url + "/tokenize", data=json.dumps(
        {"model": server.model, "messages": [{"role": "user", "content": PROMPT}]}).encode(),
        headers={"Content-Type": "application/json"})
    return int(json.loads(urllib.request.urlopen(req, timeout=30).read())["count"])


def chat(model: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_context_overflow_is_refused_with_the_counts(proxy: RunningMmguard,
                                                     vllm_llama: VllmServer) -> None:
    n = prompt_tokens(vllm_llama)
    assert 40 < n < 128
    want = 128 - n + 20  # each fits alone; together 20 over
    status, _, body = post(f"http://{proxy.http_url}", chat("tiny-llama", want))
    assert status == 200  # unguarded: vLLM answers, cut short, and says so only in the body
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 128 - n < want
    status, headers, body = post(f"http://{proxy.http_url}", chat("guarded", want))
    assert status == 400
    assert body["error"]["message"] == (
        f"model 'guarded' has max_model_len 128; the prompt has {n} tokens and max_tokens is "
        f"{want}: the answer would be cut at {128 - n} tokens")
    assert body["error"]["param"] == "max_tokens"
    assert headers["mmguard-shape-context"].startswith("reject")


def test_context_overflow_is_rerouted_to_a_longer_context(proxy: RunningMmguard,
                                                          vllm_llama: VllmServer) -> None:
    n = prompt_tokens(vllm_llama)
    want = 128 - n + 20
    status, headers, body = post(f"http://{proxy.http_url}", chat("guarded_reroute", want))
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == want  # nothing cut
    assert body["model"] == "guarded_reroute"
    assert headers["mmguard-shape-context"].startswith("reroute")
    assert "sent to 'tiny-llama-long'" in headers["mmguard-shape-context"]
    assert headers["mmguard-shape-finish"].startswith("length")  # max_tokens reached, as asked


def test_finish_reason_length_is_flagged_or_refused(proxy: RunningMmguard) -> None:
    status, headers, body = post(f"http://{proxy.http_url}", chat("guarded", 3))
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert headers["mmguard-shape-finish"].startswith("length")
    status, headers, body = post(f"http://{proxy.http_url}", chat("strict_finish", 3))
    assert status == 422
    assert "finish_reason length" in body["error"]["message"]
    text = urllib.request.urlopen(proxy.admin_url + "/metrics", timeout=10).read().decode()
    assert 'mmguard_filter_decisions_total{decision="finish:length",filter="shape",' \
           'model="guarded"}' in text


def test_responses_context_overflow_is_refused_like_chat(proxy: RunningMmguard,
                                                         vllm_llama: VllmServer) -> None:
    """/v1/responses goes through the same chain: its input is counted as the chat it becomes,
    and max_output_tokens is its max_tokens."""
    n = prompt_tokens(vllm_llama)
    want = 128 - n + 20
    req = urllib.request.Request(
        f"http://{proxy.http_url}/v1/responses", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": "guarded", "input": PROMPT, "max_output_tokens": want,
                         "temperature": 0}).encode())
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=120)
    with exc.value as e:
        assert e.code == 400
        body = json.loads(e.read())
        assert e.headers["mmguard-shape-context"].startswith("reject")
    assert f"the prompt has {n} tokens and max_tokens is {want}" in body["error"]["message"]
    ok = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://{proxy.http_url}/v1/responses", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": "guarded", "input": PROMPT, "max_output_tokens": 4,
                         "temperature": 0}).encode()), timeout=120).read())
    assert ok["model"] == "guarded" and ok["output"][0]["content"][0]["text"]
