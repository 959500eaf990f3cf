"""vLLM parity: the same openai-SDK and HTTP calls run against the real vLLM directly and through
mmguard (a vllm backend serving each model under its own name), with the same assertions. Every
answer through mmguard is also compared with the direct one (greedy or seeded sampling makes the
tiny models deterministic). A test that fails ``direct`` is a fixture bug; one that fails only
``mmguard`` is a mmguard bug.

Servers: the session's tiny-llava (text, images, /tokenizer_info on) and, for this module only,
tiny-llama served as an embedding model (vLLM's pooling runner), for /v1/embeddings and /pooling.

Intended differences (asserted as such): vLLM's own /metrics and its server-internal endpoints
(/load) are not served to clients through mmguard (404 / 403 naming where to go instead).
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest
from openai.types.chat import ChatCompletionContentPartParam, ChatCompletionMessageParam

from tests.support.mmguard import RunningMmguard
from tests.support.vllm import VllmServer, png_data_url

pytestmark = pytest.mark.vllm
T = TypeVar("T")
LLAVA, EMBED = "tiny-llava", "tiny-embed"


@pytest.fixture(scope="module")
def vllm_embed(vllm_models: dict[str, Path],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    server = VllmServer(vllm_models["tiny-llama"], EMBED, delay_plugin=False,
                        extra_args=["--runner", "pooling", "--convert", "embed"],
                        log_path=tmp_path_factory.mktemp("vllm_embed") / "embed.log")
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def parity_proxy(vllm_llava: VllmServer, vllm_embed: VllmServer) -> Iterator[RunningMmguard]:
    cfg = {"backends": [{"kind": "vllm", "name": "llava", "url": vllm_llava.url},
                        {"kind": "vllm", "name": "embed", "url": vllm_embed.url}],
           "models": [{"name": LLAVA, "backend": "llava"}, {"name": EMBED, "backend": "embed"}]}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=180)
        yield m


@dataclass(frozen=True)
class Side:
    """Where the client connects: the model's own vLLM (``direct``) or mmguard."""

    label: str
    llava: str  # base URL for tiny-llava calls
    embed: str  # base URL for tiny-embed calls

    def sdk(self, model: str = LLAVA) -> openai.OpenAI:
        base = self.llava if model == LLAVA else self.embed
        client = _CLIENTS.get(base)
        if client is None:
            client = _CLIENTS[base] = openai.OpenAI(base_url=f"{base}/v1", api_key="unused",
                                                    max_retries=0)
        return client

    def http(self, method: str, path: str, doc: Any = None, model: str = LLAVA,
             ) -> tuple[int, str, bytes]:
        base = self.llava if model == LLAVA else self.embed
        req = urllib.request.Request(base + path, method=method, headers={
            "Content-Type": "application/json"}, data=None if doc is None else json.dumps(
                doc).encode())
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.headers.get("Content-Type", ""), r.read()
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.headers.get("Content-Type", ""), e.read()


_CLIENTS: dict[str, openai.OpenAI] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    for client in _CLIENTS.values():
        client.close()
    _CLIENTS.clear()


@pytest.fixture(scope="module")
def direct(vllm_llava: VllmServer, vllm_embed: VllmServer) -> Side:
    return Side("direct", vllm_llava.url, vllm_embed.url)


@pytest.fixture(params=["direct", "mmguard"])
def side(request: pytest.FixtureRequest, direct: Side, parity_proxy: RunningMmguard) -> Side:
    if request.param == "direct":
        return direct
    url = f"http://{parity_proxy.http_url}"
    return Side("mmguard", url, url)


_DIRECT: dict[str, Any] = {}


def same_as_direct(side: Side, direct: Side, key: str, value: T,
                   call: Callable[[Side], T]) -> None:
    """Through mmguard, the answer equals the direct one (computed once per key)."""
    if side.label == "direct":
        _DIRECT[key] = value
        return
    if key not in _DIRECT:
        _DIRECT[key] = call(direct)
    assert value == _DIRECT[key], f"{key}: mmguard {value!r} != direct {_DIRECT[key]!r}"


USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me about the river"}]


def _chat(side: Side) -> tuple[str, str, int]:
    out = side.sdk().chat.completions.create(model=LLAVA, messages=USER,
                                             max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert out.usage is not None
    return (out.choices[0].message.content or "", out.choices[0].finish_reason,
            out.usage.prompt_tokens)


def test_chat(side: Side, direct: Side) -> None:
    text, finish, prompt = _chat(side)
    assert text and finish == "length" and prompt > 0
    same_as_direct(side, direct, "chat", (text, finish, prompt), _chat)


def _chat_image(side: Side) -> tuple[str, int]:
    content: list[ChatCompletionContentPartParam] = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": png_data_url(rgb=(20, 200, 20))}}]
    out = side.sdk().chat.completions.create(
        model=LLAVA, messages=[{"role": "user", "content": content}],
        max_tokens=4, temperature=0)
    assert out.usage is not None
    return out.choices[0].message.content or "", out.usage.prompt_tokens


def test_chat_with_an_image(side: Side, direct: Side) -> None:
    text, prompt = _chat_image(side)
    assert text and prompt > 4
    same_as_direct(side, direct, "chat_image", (text, prompt), _chat_image)


def _completion(side: Side) -> tuple[str, str]:
    out = side.sdk().completions.create(model=LLAVA, prompt="once upon a time", max_tokens=8,
                                        temperature=0)
    return out.choices[0].text, out.choices[0].finish_reason


def test_completions(side: Side, direct: Side) -> None:
    text, finish = _completion(side)
    assert text and finish == "length"
    same_as_direct(side, direct, "completion", (text, finish), _completion)


def _n2(side: Side) -> list[tuple[int, str]]:
    out = side.sdk().completions.create(model=LLAVA, prompt="the mill", max_tokens=6, n=2,
                                        temperature=1.0, seed=11)
    return sorted((c.index, c.text) for c in out.choices)


def test_n_greater_than_one(side: Side, direct: Side) -> None:
    choices = _n2(side)
    assert [i for i, _ in choices] == [0, 1] and all(t for _, t in choices)
    same_as_direct(side, direct, "n2", choices, _n2)


def _logprobs(side: Side) -> list[tuple[str, int]]:
    out = side.sdk().chat.completions.create(model=LLAVA, messages=USER,
                                             max_tokens=4, temperature=0, logprobs=True,
                                             top_logprobs=2)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    for tok in content:
        assert math.isfinite(tok.logprob) and tok.logprob <= 0 and len(tok.top_logprobs) == 2
    return [(tok.token, len(tok.top_logprobs)) for tok in content]


def test_logprobs(side: Side, direct: Side) -> None:
    tokens = _logprobs(side)
    assert len(tokens) == 4
    same_as_direct(side, direct, "logprobs", tokens, _logprobs)


def _completion_logprobs(side: Side) -> list[str]:
    out = side.sdk().completions.create(model=LLAVA, prompt="a quiet", max_tokens=3,
                                        temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert all(len(t) >= 2 for t in lp.top_logprobs)
    return lp.tokens


def test_completion_logprobs(side: Side, direct: Side) -> None:
    tokens = _completion_logprobs(side)
    assert len(tokens) == 3
    same_as_direct(side, direct, "completion_logprobs", tokens, _completion_logprobs)


def _stop(side: Side) -> tuple[str, str]:
    # the first greedy token of this prompt is the stop string: the answer stops at once
    free = side.sdk().completions.create(model=LLAVA, prompt="the river", max_tokens=6,
                                         temperature=0).choices[0].text
    stop = free.strip()[:2] or free[:1]
    out = side.sdk().completions.create(model=LLAVA, prompt="the river", max_tokens=6,
                                        temperature=0, stop=[stop])
    assert stop not in out.choices[0].text
    return out.choices[0].text, out.choices[0].finish_reason


def test_stop(side: Side, direct: Side) -> None:
    text, finish = _stop(side)
    assert finish == "stop"
    same_as_direct(side, direct, "stop", (text, finish), _stop)


def _stream_chat(side: Side) -> tuple[str, int, int]:
    stream = side.sdk().chat.completions.create(
        model=LLAVA, messages=USER, max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, pieces, completion = "", 0, 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces += 1
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            completion = chunk.usage.completion_tokens
    return text, completion, pieces


def test_streaming_chat(side: Side, direct: Side) -> None:
    text, completion, pieces = _stream_chat(side)
    # Streamed, not buffered: the text comes in pieces. Not one piece per token: vLLM merges
    # the tokens its API server has not sent yet into one delta when it falls behind (a busy
    # machine: 8 tokens in 6 pieces, direct).
    assert completion == 8 and pieces >= 2, (text, completion, pieces)
    assert text == _chat(side)[0]  # the stream says what the whole answer says
    same_as_direct(side, direct, "stream_chat", (text, completion), lambda s: _stream_chat(s)[:2])


def _stream_completion(side: Side) -> str:
    return "".join(c.choices[0].text for c in side.sdk().completions.create(
        model=LLAVA, prompt="once upon a time", max_tokens=8, temperature=0, stream=True)
        if c.choices)


def test_streaming_completion(side: Side) -> None:
    assert _stream_completion(side) == _completion(side)[0]


def _responses(side: Side) -> tuple[str, str]:
    out = side.sdk().responses.create(model=LLAVA, input="hello there", max_output_tokens=5,
                                      temperature=0)
    return out.output_text, out.model


def test_responses(side: Side, direct: Side) -> None:
    text, model = _responses(side)
    assert text and model == LLAVA
    same_as_direct(side, direct, "responses", (text, model), _responses)


def _responses_image(side: Side) -> str:
    out = side.sdk().responses.create(model=LLAVA, max_output_tokens=4, temperature=0, input=[{
        "role": "user", "content": [
            {"type": "input_text", "text": "describe"},
            {"type": "input_image", "image_url": png_data_url(rgb=(10, 10, 240)),
             "detail": "auto"}]}])
    return out.output_text


def test_responses_with_an_image(side: Side, direct: Side) -> None:
    text = _responses_image(side)
    assert text
    same_as_direct(side, direct, "responses_image", text, _responses_image)


def _responses_stream(side: Side) -> tuple[list[str], str]:
    kinds, text = [], ""
    for event in side.sdk().responses.create(model=LLAVA, input="hello there",
                                             max_output_tokens=5, temperature=0, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
    return sorted(set(kinds)), text


def test_responses_streaming(side: Side, direct: Side) -> None:
    kinds, text = _responses_stream(side)
    assert "response.created" in kinds and "response.completed" in kinds
    assert text == _responses(side)[0]
    same_as_direct(side, direct, "responses_stream", (kinds, text), _responses_stream)


def _embeddings(side: Side) -> list[list[float]]:
    out = side.sdk(EMBED).embeddings.create(model=EMBED, input=["hello", "the river"])
    return [d.embedding for d in sorted(out.data, key=lambda d: d.index)]


def test_embeddings(side: Side, direct: Side) -> None:
    vectors = _embeddings(side)
    assert len(vectors) == 2 and len(vectors[0]) == len(vectors[1]) == 64
    assert vectors[0] != vectors[1]
    same_as_direct(side, direct, "embeddings", vectors, _embeddings)


def _pooling(side: Side) -> tuple[int, list[Any]]:
    status, _, body = side.http("POST", "/pooling", {"model": EMBED, "input": "hello"}, EMBED)
    return status, json.loads(body)["data"][0]["data"]


def test_pooling(side: Side, direct: Side) -> None:
    status, data = _pooling(side)
    assert status == 200 and len(data) == 64
    same_as_direct(side, direct, "pooling", (status, data), _pooling)


def test_embeddings_on_a_generative_model_is_vllms_404(side: Side) -> None:
    status, _, body = side.http("POST", "/v1/embeddings", {"model": LLAVA, "input": "x"})
    assert status == 404 and json.loads(body) == {"detail": "Not Found"}


def _tokenize(side: Side) -> tuple[Any, Any, Any]:
    _, _, a = side.http("POST", "/tokenize", {"model": LLAVA, "prompt": "hello world"})
    tokens = json.loads(a)["tokens"]
    _, _, b = side.http("POST", "/detokenize", {"model": LLAVA, "tokens": tokens})
    _, _, c = side.http("POST", "/tokenize", {"model": LLAVA, "messages": [{
        "role": "user", "content": [{"type": "text", "text": "hi"}, {
            "type": "image_url", "image_url": {"url": png_data_url()}}]}]})
    return json.loads(a), json.loads(b), json.loads(c)


def test_tokenize_and_detokenize(side: Side, direct: Side) -> None:
    plain, back, with_image = _tokenize(side)
    assert plain["count"] == len(plain["tokens"]) > 0 and "hello" in back["prompt"]
    assert with_image["count"] > plain["count"]
    same_as_direct(side, direct, "tokenize", (plain, back, with_image), _tokenize)


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version"),
    ("GET", "/tokenizer_info?model=tiny-llava"),
    ("GET", "/v1/responses/resp_unknown?model=tiny-llava"),
])
def test_server_endpoints(side: Side, direct: Side, method: str, path: str) -> None:
    """Byte for byte. ``?model=`` says which backend a model-less endpoint is about when mmguard
    has several (vLLM ignores it); with one vLLM backend it is not needed."""
    def call(s: Side) -> tuple[int, bytes]:
        status, _, body = s.http(method, path)
        return status, body
    status, body = call(side)
    assert status == (404 if "resp_" in path else 200), body
    if path.startswith("/tokenizer_info"):
        assert "tokenizer_class" in json.loads(body)
    same_as_direct(side, direct, f"{method} {path}", (status, body), call)


@pytest.mark.parametrize("path", ["/tokenizer_info", "/v1/responses/resp_unknown"])
def test_model_less_endpoints_with_two_backends_ask_which(side: Side, path: str) -> None:
    status, _, body = side.http("GET", path)
    if side.label == "direct":
        assert status in (200, 404)
    else:
        assert status == 400
        assert "serves 2 vLLM backends; say which with ?model=" in json.loads(body)["error"][
            "message"]


def _invocations(side: Side) -> tuple[str, str]:
    _, _, a = side.http("POST", "/invocations", {"model": LLAVA, "messages": USER,
                                                 "max_tokens": 5, "temperature": 0})
    _, _, b = side.http("POST", "/invocations", {"model": LLAVA, "prompt": "once",
                                                 "max_tokens": 5, "temperature": 0})
    return (json.loads(a)["choices"][0]["message"]["content"],
            json.loads(b)["choices"][0]["text"])


def test_invocations(side: Side, direct: Side) -> None:
    chat, completion = _invocations(side)
    assert chat and completion
    same_as_direct(side, direct, "invocations", (chat, completion), _invocations)


def test_models(side: Side, direct: Side) -> None:
    """Each entry as vLLM lists it: every field in its order (``owned_by`` "vllm", ``parent``,
    ``permission``), ``created`` the listing's time, compact JSON; mmguard wrote its own."""
    models = {m.id: m for m in side.sdk().models.list().data}
    assert models[LLAVA].model_extra["max_model_len"] == 128  # type: ignore[index]

    def listing(s: Side) -> tuple[bytes, dict[str, Any]]:
        with urllib.request.urlopen(s.llava + "/v1/models", timeout=60) as r:
            raw = r.read()
        entry = next(m for m in json.loads(raw)["data"] if m["id"] == LLAVA)
        return raw, entry

    raw, entry = listing(side)
    direct_raw, direct_entry = listing(direct)
    assert list(entry) == list(direct_entry) and entry["owned_by"] == direct_entry["owned_by"]
    assert abs(entry["created"] - time.time()) < 600
    assert [list(p) for p in entry["permission"]] == \
        [list(p) for p in direct_entry["permission"]]
    assert b'", "' not in raw and b'", "' not in direct_raw  # compact, as vLLM writes it


def test_errors_keep_their_status_and_param(side: Side) -> None:
    too_long = {"model": LLAVA, "max_tokens": 1,
                "messages": [{"role": "user", "content": "word " * 200}]}
    with pytest.raises(openai.BadRequestError) as exc:
        side.sdk().chat.completions.create(**too_long)  # type: ignore[call-overload]
    assert exc.value.body["param"] == "input_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as nf:
        side.sdk().chat.completions.create(model="gpt-9", messages=USER)
    assert "gpt-9" in nf.value.message
    if side.label == "mmguard":  # vLLM lists its models to anyone; mmguard names none
        assert LLAVA not in nf.value.message and EMBED not in nf.value.message


@pytest.mark.parametrize(("path", "via_mmguard"), [("/metrics", 404), ("/load", 403)])
def test_server_internals_are_not_served_to_clients(side: Side, path: str,
                                                    via_mmguard: int) -> None:
    """The intended differences: vLLM answers these to anyone; mmguard says where to look."""
    status, _, body = side.http("GET", path)
    if side.label == "direct":
        assert status == 200
    else:
        assert status == via_mmguard
        message = json.loads(body)["error"]["message"]
        assert "vLLM server" in message


@pytest.mark.parametrize("stream", ["false", "No", 0, None, "yes", 1.0, "maybe", 2])
def test_stream_reads_as_vllm_reads_it(side: Side, direct: Side, stream: object) -> None:
    """``"stream": "false"`` is vLLM's (pydantic's) False: a whole answer, through mmguard too
    (it streamed by Python's truth and failed it 503, blaming the backend); a value vLLM
    refuses is refused with vLLM's own status and words."""
    doc = {"model": LLAVA, "messages": USER, "max_tokens": 4, "temperature": 0,
           "stream": stream}

    def answer(s: Side) -> tuple[int, str, str]:
        status, ctype, body = s.http("POST", "/v1/chat/completions", doc)
        if ctype.startswith("text/event-stream"):
            return status, ctype, "".join(
                (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content")
                or "" for line in body.decode().splitlines()
                if line.startswith("data: {"))
        got = json.loads(body)
        if status != 200:
            return status, "error", got["error"]["message"].split("\n")[0]
        return status, "whole", got["choices"][0]["message"]["content"]

    status, kind, text = answer(side)
    assert (status, kind.split(";")[0]) == (
        (400, "error") if stream in ("maybe", 2) else (200, "text/event-stream")
        if stream in ("yes", 1.0) else (200, "whole"))  # the stream's type compared whole
    same_as_direct(side, direct, f"stream={stream!r}", (status, kind, text), answer)


@pytest.fixture(scope="module")
def single_proxy(vllm_llava: VllmServer) -> Iterator[RunningMmguard]:
    cfg = {"backends": [{"kind": "vllm", "name": "llava", "url": vllm_llava.url}],
           "models": [{"name": LLAVA, "backend": "llava"}]}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=180)
        yield m


@pytest.mark.parametrize("named", ["absent", "null", "empty"])
def test_a_request_naming_no_model_is_served_by_the_only_one(
        single_proxy: RunningMmguard, parity_proxy: RunningMmguard, direct: Side,
        named: str) -> None:
    """vLLM serves a chat that names no model (absent, null or "") with its one model; so does
    mmguard when it serves one model over the OpenAI API (it refused it). With two, it cannot
    tell which, and says so."""
    doc: dict[str, Any] = {"messages": USER, "max_tokens": 4, "temperature": 0,
                           **({} if named == "absent" else {"model": None if named == "null"
                                                            else ""})}

    def text(side: Side) -> tuple[int, str]:
        status, _, body = side.http("POST", "/v1/chat/completions", doc)
        got = json.loads(body)
        return status, (got["choices"][0]["message"]["content"] if status == 200
                        else got["error"]["message"])

    url = f"http://{single_proxy.http_url}"
    assert text(Side("mmguard", url, url)) == text(direct)
    assert text(direct)[0] == 200
    two = f"http://{parity_proxy.http_url}"
    assert text(Side("mmguard", two, two)) == (
        400, "'model' is required: mmguard serves 2 models over the OpenAI API")


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None,
                                   "application/json; charset=utf-8", "Application/JSON"])
def test_content_type_is_checked_as_vllm_checks_it(side: Side, direct: Side,
                                                   ctype: str | None) -> None:
    """vLLM takes a JSON media type only (``curl -d`` sends a form); mmguard served any."""
    body = json.dumps({"model": LLAVA, "messages": USER, "max_tokens": 2}).encode()

    def status(s: Side) -> tuple[int, bytes]:
        req = urllib.request.Request(s.llava + "/v1/chat/completions", body, method="POST")
        if ctype is not None:
            req.add_header("Content-Type", ctype)
        else:
            req.remove_header("Content-type")
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, b""
        except urllib.error.HTTPError as e:
            with e:  # the whole body: vLLM's type ("Bad Request") and its compact JSON
                return e.code, e.read()

    got = status(side)
    assert got[0] == (200 if ctype and "json" in ctype.lower() else 400), got
    same_as_direct(side, direct, f"content-type={ctype!r}", got, status)


REFUSED_FIRST = {  # case: (path, raw body) mmguard reads before vLLM would
    "messages-missing": ("/v1/chat/completions", b'{"model": "tiny-llava"}'),
    "messages-a-string": ("/v1/chat/completions", b'{"model": "tiny-llava", "messages": "hi"}'),
    "messages-empty": ("/v1/chat/completions", b'{"model": "tiny-llava", "messages": []}'),
    "model-a-number": ("/v1/chat/completions",
                       b'{"model": 5, "messages": [{"role": "user", "content": "hi"}]}'),
    "body-a-list": ("/v1/chat/completions", b'[1, 2]'),
    "body-empty": ("/v1/chat/completions", b''),
    "body-not-json": ("/v1/chat/completions", b'{nope'),
    "body-null": ("/v1/completions", b'null'),
    "body-not-utf8": ("/v1/completions", b'{"model": "tiny-llava", "prompt": "caf\xe9"}'),
    "completion-without-prompt": ("/v1/completions", b'{"model": "tiny-llava"}'),
    "completion-with-messages": ("/v1/completions", b'{"model": "tiny-llava", "prompt": "a", '
                                 b'"max_tokens": 2, "temperature": 0, "messages": [{"role": '
                                 b'"user", "content": "hi"}]}'),
    "completion-token-ids-read-lax": ("/v1/completions", b'{"model": "tiny-llava", "prompt": '
                                      b'[true, 2.0, "3", 4], "max_tokens": 2, '
                                      b'"temperature": 0}'),
}
SERVED = ("completion-with-messages", "completion-token-ids-read-lax")


@pytest.mark.parametrize("case", list(REFUSED_FIRST))
def test_a_mistake_mmguard_finds_first_reads_as_vllms(side: Side, direct: Side,
                                                       case: str) -> None:
    """The error body byte for byte as vLLM's own (its validation errors are pydantic's, in
    FastAPI's format, written compact); mmguard answered in its own words, which no vLLM
    client knew, then in vLLM's words with its own spacing."""
    path, body = REFUSED_FIRST[case]

    def answer(s: Side) -> tuple[int, Any]:
        req = urllib.request.Request(s.llava + path, body, {"Content-Type": "application/json"},
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())["object"]
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.read()

    got = answer(side)
    assert got[0] == (200 if case in SERVED else 400), got
    same_as_direct(side, direct, f"mistake {case}", got, answer)


MISSES = [("HEAD", "/v1/models"), ("HEAD", "/health"), ("HEAD", "/version"),
          ("GET", "/v1/chat/completions"), ("PUT", "/v1/chat/completions"),
          ("OPTIONS", "/v1/completions"), ("DELETE", "/v1/models"), ("POST", "/health"),
          ("GET", "/v1/models/tiny-llava"), ("GET", "/v1/nope"),
          ("POST", "/v1/chat/completions/"), ("GET", "/v1/models/?x=1"), ("GET", "/health/")]


@pytest.mark.parametrize(("method", "path"), MISSES)
def test_a_path_or_method_not_served_reads_as_vllms(side: Side, direct: Side, method: str,
                                                     path: str) -> None:
    """What FastAPI answers where no route serves: 405 with Allow (HEAD included), 404
    ``{"detail":"Not Found"}``, 307 to the path with its trailing slash toggled."""
    import http.client

    def answer(s: Side) -> tuple[int, bytes, str | None, str | None]:
        host, port = s.llava.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            conn.request(method, path, body=b"{}" if method in ("POST", "PUT") else None,
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            location = r.getheader("Location")
            return (r.status, r.read(), r.getheader("Allow"),
                    location and location.replace(s.llava, "BASE"))
        finally:
            conn.close()

    got = answer(side)
    assert got[0] in (307, 404, 405), got
    if got[0] == 405:
        assert got[2], got  # the methods it does take
    same_as_direct(side, direct, f"miss {method} {path}", got, answer)
