"""The openai SDK → mmguard → a real vLLM: chat, completions, images, streaming, errors."""

from __future__ import annotations

import http.server
import json
import os
import signal
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionContentPartParam

from tests.support.mmguard import RunningMmguard
from tests.support.vllm import DELAY_ARG, VllmServer, _group_pids, png_bytes, png_data_url

pytestmark = pytest.mark.vllm


def vllm_config(**backends: VllmServer) -> dict[str, Any]:
    return {
        "backends": [{"kind": "vllm", "name": n, "url": s.url} for n, s in backends.items()],
        "models": [{"name": s.model, "backend": n} for n, s in backends.items()],
    }


@pytest.fixture(scope="module")
def proxy(vllm_llama: VllmServer, vllm_llava: VllmServer) -> Iterator[RunningMmguard]:
    cfg = vllm_config(llama=vllm_llama, llava=vllm_llava)
    cfg["models"].append({"name": "chat", "backend": "llama", "backend_model": vllm_llama.model})
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=120)
        yield m


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{url}/v1", api_key="unused", max_retries=0)


def direct(server: VllmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_chat_through_mmguard_equals_direct(proxy: RunningMmguard,
                                            vllm_llama: VllmServer) -> None:
    kw: dict[str, Any] = {"messages": [{"role": "user", "content": "tell me a story"}],
                          "max_tokens": 12, "temperature": 0}
    via = sdk(proxy.http_url).chat.completions.create(model="tiny-llama", **kw)
    ref = direct(vllm_llama).chat.completions.create(model="tiny-llama", **kw)
    assert via.choices[0].message.content == ref.choices[0].message.content
    assert via.usage is not None and via.usage == ref.usage
    renamed = sdk(proxy.http_url).chat.completions.create(model="chat", **kw)
    assert renamed.model == "chat"  # the name the client used, not the backend's
    assert renamed.choices[0].message.content == ref.choices[0].message.content


def test_completions(proxy: RunningMmguard, vllm_llama: VllmServer) -> None:
    kw: dict[str, Any] = {"prompt": "once upon a time", "max_tokens": 8, "temperature": 0}
    via = sdk(proxy.http_url).completions.create(model="tiny-llama", **kw)
    ref = direct(vllm_llama).completions.create(model="tiny-llama", **kw)
    assert via.choices[0].text == ref.choices[0].text and via.choices[0].text


def test_multimodal_chat_with_png_data_urls(proxy: RunningMmguard,
                                            vllm_llava: VllmServer) -> None:
    content = [{"type": "text", "text": "compare these"},
               {"type": "image_url", "image_url": {"url": png_data_url(rgb=(200, 30, 30))}},
               {"type": "image_url", "image_url": {"url": png_data_url(rgb=(30, 30, 200))}}]
    kw: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "max_tokens": 6,
                          "temperature": 0}
    via = sdk(proxy.http_url).chat.completions.create(model="tiny-llava", **kw)
    ref = direct(vllm_llava).chat.completions.create(model="tiny-llava", **kw)
    assert via.choices[0].message.content == ref.choices[0].message.content
    assert via.usage is not None and ref.usage is not None
    assert via.usage.prompt_tokens == ref.usage.prompt_tokens


def test_streaming_arrives_incrementally(proxy: RunningMmguard) -> None:
    """With the backend pacing tokens ~40 ms apart, the first chunk must reach the client long
    before the last one is produced: a proxy that buffered the stream would deliver all
    chunks at once at the end."""
    stream = sdk(proxy.http_url).chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "count"}], max_tokens=20,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "vllm_xargs": {DELAY_ARG: 40}})
    arrivals, text, usage = [], "", None
    for chunk in stream:
        arrivals.append(time.monotonic())
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == 20
    assert len(arrivals) >= 20 and text
    spread = arrivals[-1] - arrivals[0]
    assert spread > 0.5 * 19 * 0.040, f"chunks arrived together ({spread:.3f}s apart)"


def test_a_stream_runs_to_its_end_across_a_reload_that_replaces_its_backend(
        vllm_llama: VllmServer, tmp_path: Path) -> None:
    """A reload that rebuilds the vLLM backend (here with no grace at all) while an answer
    streams from it: the stream ends as it would have (every token, the same text as direct),
    and the retired backend's connection is closed once it has, not kept and not cut."""
    def config(timeout_s: float) -> dict[str, Any]:
        cfg = vllm_config(llama=vllm_llama)
        cfg["backends"][0]["timeout_s"] = timeout_s
        return {**cfg, "shutdown_grace_s": 0}

    kw: dict[str, Any] = {"model": "tiny-llama", "max_tokens": 16, "temperature": 0,
                          "messages": [{"role": "user", "content": "count"}],
                          "extra_body": {"ignore_eos": True, "vllm_xargs": {DELAY_ARG: 60}}}
    path = tmp_path / "mmguard.yaml"
    path.write_text(json.dumps(config(60)))
    with RunningMmguard(config(60), config_path=path) as m:
        assert m.server is not None
        m.wait_ready(timeout=120)
        old = m.server.plane.runtime.backends["llama"]
        stream = sdk(m.http_url).chat.completions.create(stream=True, **kw)
        chunks = iter(stream)
        text = next(chunks).choices[0].delta.content or ""
        path.write_text(json.dumps(config(50)))  # a changed backend: built anew, old retired
        assert m.run(m.server.reload())
        assert m.server.plane.runtime.backends["llama"] is not old
        finish = None
        for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        pool = old.pool  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10  # the retired runtime closes once its last call ends
        while not (pool.closed and not pool._idle):
            assert time.monotonic() < deadline, "the retired backend kept its connection"
            time.sleep(0.02)
    ref = direct(vllm_llama).chat.completions.create(**kw)
    assert finish == "length" and text == ref.choices[0].message.content


def test_models_and_tokenize(proxy: RunningMmguard, vllm_llama: VllmServer) -> None:
    models = {m.id: m for m in sdk(proxy.http_url).models.list().data}
    assert set(models) == {"tiny-llama", "tiny-llava", "chat"}
    assert models["tiny-llama"].model_extra["max_model_len"] == 128  # type: ignore[index]
    body = json.dumps({"model": "chat", "prompt": "hello world"}).encode()
    via = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://{proxy.http_url}/tokenize", data=body,
        headers={"Content-Type": "application/json"}), timeout=30).read())
    ref = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"{vllm_llama.url}/tokenize", data=json.dumps(
            {"model": "tiny-llama", "prompt": "hello world"}).encode(),
        headers={"Content-Type": "application/json"}), timeout=30).read())
    assert via == ref and via["count"] > 0
    detok = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://{proxy.http_url}/detokenize", data=json.dumps(
            {"model": "tiny-llama", "tokens": via["tokens"]}).encode(),
        headers={"Content-Type": "application/json"}), timeout=30).read())
    assert "hello" in detok["prompt"]


def _raw_post(url: str, doc: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:  # an error response holds its socket until closed
            return e.code, e.read()


def test_backend_errors_keep_status_and_body(proxy: RunningMmguard, vllm_llama: VllmServer,
                                             vllm_llava: VllmServer) -> None:
    too_long = {"model": "tiny-llama", "max_tokens": 1,
                "messages": [{"role": "user", "content": "word " * 200}]}
    image_to_text = {"model": "tiny-llama", "max_tokens": 1, "messages": [{
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url()}}]}]}
    for doc, server in ((too_long, vllm_llama), (image_to_text, vllm_llama)):
        via = _raw_post(f"http://{proxy.http_url}/v1/chat/completions", doc)
        ref = _raw_post(f"{server.url}/v1/chat/completions", doc)
        assert via[0] == ref[0] == 400
        assert json.loads(via[1]) == json.loads(ref[1])  # vLLM's own error object, intact
    with pytest.raises(openai.BadRequestError) as exc:
        sdk(proxy.http_url).chat.completions.create(**too_long)  # type: ignore[call-overload]  # a JSON dict
    assert exc.value.body["param"] == "input_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as nf:
        sdk(proxy.http_url).chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert "The model `gpt-9` does not exist." in nf.value.message


def test_remote_image_urls_are_refused_by_default(proxy: RunningMmguard) -> None:
    content: list[ChatCompletionContentPartParam] = [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/latest.png"}}]
    with pytest.raises(openai.BadRequestError) as exc:
        sdk(proxy.http_url).chat.completions.create(
            model="tiny-llava", messages=[{"role": "user", "content": content}], max_tokens=1)
    message = exc.value.message
    assert "remote media URLs are refused by mmguard" in message and "127.0.0.1:9" in message
    assert exc.value.body["param"] == "messages[0].content[0].image_url.url"  # type: ignore[index]


@pytest.fixture
def image_host(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "cat.png").write_bytes(png_bytes())

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, directory=str(tmp_path), **kw)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    finally:
        server.shutdown()
        server.server_close()


def test_allow_listed_image_host_reaches_the_backend(vllm_llava: VllmServer,
                                                     image_host: str) -> None:
    port = urllib.parse.urlsplit(image_host).port
    cfg = {**vllm_config(llava=vllm_llava),
           "openai": {"image_url_allow_hosts": [f"127.0.0.1:{port}"]}}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=120)
        content: list[ChatCompletionContentPartParam] = [
            {"type": "text", "text": "what?"},
            {"type": "image_url", "image_url": {"url": image_host}}]
        out = sdk(m.http_url).chat.completions.create(
            model="tiny-llava", messages=[{"role": "user", "content": content}], max_tokens=2)
        assert out.usage is not None and out.choices[0].message.content is not None


def test_metrics_count_tokens_finish_reasons_and_ttft(proxy: RunningMmguard) -> None:
    sdk(proxy.http_url).completions.create(model="tiny-llama", prompt="a", max_tokens=3,
                                           extra_body={"ignore_eos": True})
    for _ in sdk(proxy.http_url).completions.create(model="tiny-llama", prompt="b", max_tokens=2,
                                                    stream=True):
        pass
    text = urllib.request.urlopen(proxy.admin_url + "/metrics", timeout=10).read().decode()

    def value(prefix: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(prefix))
        return float(line.rsplit(" ", 1)[1])

    assert value('mmguard_tokens_total{kind="completion",model="tiny-llama"}') >= 3
    assert value('mmguard_finish_reasons_total{model="tiny-llama",reason="length"}') >= 2
    assert value('mmguard_time_to_first_token_seconds_count{backend="llama",'
                 'model="tiny-llama"}') >= 1
    assert value('mmguard_requests_total{backend="llama",code="ok",front="openai",'
                 'model="tiny-llama"}') >= 2


def test_backend_killed_mid_stream(vllm_models: dict[str, Path], vllm_llava: VllmServer,
                                   tmp_path: Path) -> None:
    """The client gets a well-formed error event and the stream ends; mmguard keeps serving.
    Also checks the fixture's kill(): no process of the group and no /dev/shm segment left."""
    doomed = VllmServer(vllm_models["tiny-llama"], "tiny-llama", log_path=tmp_path / "doomed.log")
    doomed.start()
    try:
        cfg = vllm_config(doomed=doomed, llava=vllm_llava)
        with RunningMmguard(cfg) as m:
            m.wait_ready(timeout=120)
            stream = sdk(m.http_url).chat.completions.create(
                model="tiny-llama", messages=[{"role": "user", "content": "go"}],
                max_tokens=100, stream=True,
                extra_body={"ignore_eos": True, "vllm_xargs": {DELAY_ARG: 50}})
            got = 0
            pgid = doomed.pid
            with pytest.raises(openai.APIError) as exc:
                for _ in stream:
                    got += 1
                    if got == 3:
                        doomed.kill()
            assert "broke off the stream" in str(exc.value)
            assert 3 <= got < 100
            ok = sdk(m.http_url).chat.completions.create(
                model="tiny-llava", messages=[{"role": "user", "content": "still there?"}],
                max_tokens=2)
            assert ok.choices[0].message.content is not None
            assert pgid is not None and _group_pids(pgid) == []

            # The backend comes back on its address, and mmguard serves it again; then it ends
            # on its own (no kill() by the test), and the fixture starts it again on its port.
            for _ in range(2):
                if doomed.process is None:
                    doomed.start(keep_port=True)
                else:
                    doomed.process.wait(timeout=60)
                    why = doomed.restart_if_ended()
                    assert why is not None and "ended (killed by SIGKILL)" in why, why
                assert doomed.url == cfg["backends"][0]["url"]
                assert _answers_again(m.http_url, "tiny-llama"), "not served after the restart"
                assert doomed.pid is not None
                os.kill(doomed.pid, signal.SIGKILL)  # the API server alone: its group follows
    finally:
        doomed.stop()


def _answers_again(url: str, model: str, within_s: float = 60) -> bool:
    """Whether ``model`` answers through mmguard within ``within_s`` (its breaker may be open
    for a while after the backend's death)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            sdk(url).chat.completions.create(
                model=model, messages=[{"role": "user", "content": "back?"}], max_tokens=2)
            return True
        except openai.APIError:
            time.sleep(0.5)
    return False


def test_responses_images_are_seen_by_the_filters(vllm_llava: VllmServer) -> None:
    """An input_image of /v1/responses is an image to the chain: quality scores and annotates
    it by its JSON path, and the answer still comes from vLLM."""
    cfg = vllm_config(llava=vllm_llava)
    cfg["models"][0]["filters"] = [{"quality": {"rules": [
        {"signal": "sharpness", "below": 0.5, "action": "annotate"}], "drift": None}}]
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=120)
        flat = png_data_url(64, 64, (120, 120, 120))  # one colour: no edges, sharpness 0
        raw = sdk(m.http_url).responses.with_raw_response.create(
            model="tiny-llava", max_output_tokens=2, temperature=0, input=[{
                "role": "user", "content": [
                    {"type": "input_text", "text": "what is in this picture?"},
                    {"type": "input_image", "image_url": flat, "detail": "auto"}]}])
        assert raw.parse().output_text is not None
        assert raw.headers["mmguard-quality-sharpness"].startswith(
            "annotate; input[0].content[1].image_url: signal 'sharpness' is 0.000")


@pytest.mark.parametrize("rid", ["..%2F..%2Fload", "..%2Fload", "%2E%2E%2F%2E%2E%2Fload",
                                 "x%3Fy"])
def test_a_response_id_cannot_reach_another_vllm_endpoint(proxy: RunningMmguard,
                                                          rid: str) -> None:
    """/v1/responses/{id} is forwarded, so its id must not walk to /load or add a query."""
    status, body = _raw_get(f"http://{proxy.http_url}/v1/responses/{rid}?model=tiny-llava")
    assert status in (400, 404), body
    assert b"server_load" not in body


def _raw_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()
