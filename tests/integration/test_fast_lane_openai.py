"""OpenAI inference requests on the HTTP listener's fast lane, against aiohttp's path, in front
of one real vLLM (tiny-llama): the same requests to a mmguard with the lane and to one without
it get the same status and headers (but ``Date``), the same error bodies byte for byte, and the
same completions (ids and timestamps are vLLM's own per call); streams arrive chunked, event by
event, and a client that leaves mid-stream frees its place."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.test_openai_vllm import vllm_config
from tests.support.mmguard import RunningMmguard
from tests.support.vllm import VllmServer


def _chat(model: str, stream: bool = False, **extra: Any) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 6, "temperature": 0, "stream": stream, **extra}).encode()


@pytest.fixture(scope="module")
def pair(vllm_llama: VllmServer) -> Iterator[tuple[RunningMmguard, RunningMmguard]]:
    cfg = vllm_config(llama=vllm_llama)
    with RunningMmguard({**cfg, "listeners": {"http": {"max_json_bytes": 8192}}}) as lane, \
            RunningMmguard({**cfg, "listeners": {"http": {"max_json_bytes": 8192,
                                                          "fast_lane": False}}}) as plain:
        lane.wait_ready()
        plain.wait_ready()
        yield lane, plain


def _post(m: RunningMmguard, path: str, body: bytes,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = m.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _served(m: RunningMmguard) -> dict[str, float]:
    text = urllib.request.urlopen(m.admin_url + "/metrics", timeout=10).read().decode()
    prefix = "mmguard_http_fast_lane_requests_total{outcome=\""
    return {ln[len(prefix):].split('"')[0]: float(ln.split()[-1])
            for ln in text.splitlines() if ln.startswith(prefix)}


def _same_headers(got: dict[str, str], want: dict[str, str]) -> None:
    assert {k: v for k, v in got.items() if k != "date"} == \
        {k: v for k, v in want.items() if k != "date"}


def _text(body: bytes) -> list[Any]:
    doc = json.loads(body)
    return [(c["message"]["content"], c["finish_reason"]) for c in doc["choices"]]


def _deltas(body: bytes) -> tuple[str, list[str]]:
    text, finish = "", []
    for line in body.decode().split("\n\n"):
        if line.startswith("data: {"):
            doc = json.loads(line[6:])
            for choice in doc.get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
                if choice.get("finish_reason"):
                    finish.append(choice["finish_reason"])
    assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
    return text, finish


ERRORS = {  # mmguard's own answers, or the backend's, byte for byte
    "unknown model": ("/v1/chat/completions", _chat("no-such-model"), {}),
    "bad json": ("/v1/chat/completions", b'{"model": ', {}),
    "too many tokens": ("/v1/chat/completions", _chat("tiny-llama", max_tokens=100000), {}),
    "over max_json_bytes": ("/v1/chat/completions", _chat("tiny-llama", user="x" * 9000), {}),
    "brotli": ("/v1/chat/completions", _chat("tiny-llama"), {"Content-Encoding": "br"}),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_refusals_are_the_same_bytes(pair: tuple[RunningMmguard, RunningMmguard],
                                     case: str) -> None:
    lane, plain = pair
    path, body, headers = ERRORS[case]
    before = _served(lane)
    got, want = _post(lane, path, body, headers), _post(plain, path, body, headers)
    assert got[0] == want[0] and got[0] >= 400, (got, want)
    _same_headers(got[1], want[1])
    assert got[2] == want[2]
    after = _served(lane)
    handed = case in ("over max_json_bytes", "brotli")  # the headers refuse it: aiohttp's
    assert after.get("served", 0) - before.get("served", 0) == (0 if handed else 1)


def test_a_completion_is_the_same(pair: tuple[RunningMmguard, RunningMmguard]) -> None:
    lane, plain = pair
    for body, headers in ((_chat("tiny-llama"), {}),
                          (gzip.compress(_chat("tiny-llama")), {"Content-Encoding": "gzip"})):
        got, want = _post(lane, "/v1/chat/completions", body, headers), \
            _post(plain, "/v1/chat/completions", body, headers)
        assert got[0] == want[0] == 200
        _same_headers(got[1], want[1])
        assert _text(got[2]) == _text(want[2])


def test_a_stream_is_the_same(pair: tuple[RunningMmguard, RunningMmguard]) -> None:
    lane, plain = pair
    before = _served(lane)
    got = _post(lane, "/v1/chat/completions", _chat("tiny-llama", stream=True))
    want = _post(plain, "/v1/chat/completions", _chat("tiny-llama", stream=True))
    assert got[0] == want[0] == 200
    assert got[1]["transfer-encoding"] == "chunked"
    _same_headers(got[1], want[1])
    assert _deltas(got[2]) == _deltas(want[2])
    assert _served(lane)["served"] - before.get("served", 0) == 1


def test_streams_on_one_keep_alive_connection(pair: tuple[RunningMmguard, RunningMmguard]
                                              ) -> None:
    lane, _ = pair
    host, port = lane.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        texts = []
        for _ in range(3):
            conn.request("POST", "/v1/chat/completions", _chat("tiny-llama", stream=True),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200 and not resp.will_close
            texts.append(_deltas(resp.read()))
        assert texts[0] == texts[1] == texts[2]
    finally:
        conn.close()


def test_a_client_that_leaves_mid_stream_frees_its_place(vllm_llama: VllmServer) -> None:
    """With max_concurrent_requests 1: a stream whose client hangs up after its first bytes
    ends, and the next request is served."""
    cfg = {**vllm_config(llama=vllm_llama),
           "listeners": {"http": {"max_concurrent_requests": 1}}}
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        host, port = m.http_url.split(":")
        body = _chat("tiny-llama", stream=True, max_tokens=60)
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            assert s.recv(4096).startswith(b"HTTP/1.1 200 OK")
        deadline = time.monotonic() + 30
        while True:
            status, _, _ = _post(m, "/v1/chat/completions", _chat("tiny-llama"))
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status == 200
