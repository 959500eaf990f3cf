"""The URL and content-part rules of the OpenAI front, on their own (no server): what is parsed,
how an accepted URL is written out again for the backend, and which parts are refused. The
same rules against a real vLLM are in tests/adversarial/test_ssrf.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.errors import ProxyError
from proxy.fronts.media_fetch import CheckedResolver
from proxy.wire import openai
from proxy.wire.media_urls import HostAllowList, parse_allow_entry, parse_url

ALLOW = HostAllowList.of(("127.0.0.1:8081", "localhost", "[::1]:8082"))


@pytest.mark.parametrize(("raw", "written"), [
    ("http://127.0.0.1:8081/a.png", "http://127.0.0.1:8081/a.png"),
    ("HTTP://LOCALHOST/a.png?x=1#frag", "http://localhost/a.png?x=1"),
    ("http://localhost:80", "http://localhost/"),
    ("http://localhost.:80/a", "http://localhost/a"),
    ("http://[::1]:8082/a", "http://[::1]:8082/a"),
    ("http://[0:0::1]:8082/a", "http://[::1]:8082/a"),
])
def test_accepted_urls_are_written_out_as_parsed(raw: str, written: str) -> None:
    url = ALLOW.check(raw, "p")
    assert url.text == written


@pytest.mark.parametrize(("raw", "words"), [
    ("http://127.0.0.1:9\\@127.0.0.1:8081/", "backslash"),
    ("http://x@127.0.0.1:8081/", "userinfo"),
    ("http://127.0.0.1:8081/a b", "space"),
    ("http://127.0.0.1:8081/\x00", "control"),
    ("http://127.0.0.1:8081/é", "non-ASCII"),
    ("http://127.0.0.1:8080/", "127.0.0.1:8080 is not on"),
    ("http://localhost:8081/", "localhost:8081 is not on"),
    ("https://localhost:80/", "localhost:80 is not on"),
    ("http://127.1:8081/", "is refused"),
    ("http://2130706433:8081/", "is refused"),
    ("http://0x7f.0.0.1:8081/", "is refused"),
    ("http://[::1%25lo]:8082/", "is refused"),
    ("http://[::ffff:127.0.0.1]:8081/", "is not on"),
    ("http://127.0.0.1:8081:1/", "not a valid URL"),
    ("file:///etc/hostname", "scheme 'file'"),
    ("gopher://127.0.0.1:8081/", "scheme 'gopher'"),
    ("//127.0.0.1:8081/", "scheme ''"),
])
def test_refused_urls_say_why(raw: str, words: str) -> None:
    with pytest.raises(ProxyError) as exc:
        ALLOW.check(raw, "messages[0].content[0].image_url.url")
    assert words in exc.value.message and exc.value.param == "messages[0].content[0].image_url.url"


@pytest.mark.parametrize(("entry", "host", "port"), [
    ("localhost", "localhost", None), ("LocalHost:8080", "localhost", 8080),
    ("[::1]", "::1", None), ("[::1]:9", "::1", 9), ("127.0.0.1:1", "127.0.0.1", 1),
])
def test_allow_entries(entry: str, host: str, port: int | None) -> None:
    parsed = parse_allow_entry(entry)
    assert (parsed.host, parsed.port) == (host, port)


@pytest.mark.parametrize("entry", ["", "localhost:0", "localhost:70000", "::1", "a/b",
                                   "u@localhost", "localhost:x", "127.1"])
def test_bad_allow_entries(entry: str) -> None:
    with pytest.raises(ValueError):
        parse_allow_entry(entry)


def test_a_bare_host_means_the_default_port_of_each_scheme() -> None:
    allow = HostAllowList.of(("localhost",))
    assert allow.allows(parse_url("http://localhost/a", "p"))
    assert allow.allows(parse_url("https://localhost:443/a", "p"))
    assert not allow.allows(parse_url("http://localhost:443/a", "p"))


def decode(doc: dict[str, Any], endpoint: str = openai.CHAT,
           mode: str = "forward") -> dict[str, Any]:
    policy = openai.MediaPolicy(ALLOW, mode)  # type: ignore[arg-type]
    call = openai.decode_request(json.dumps(doc).encode(), endpoint, policy)
    assert call.document is not None
    if call.wire is not None:  # unchanged: what goes on is the client's own bytes
        return json.loads(call.wire.body)  # type: ignore[no-any-return]
    return json.loads(openai.encode_request(call, call.model))  # type: ignore[no-any-return]


def parts(*content: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": list(content)}]}


def test_the_backend_gets_mmguards_writing_of_the_url() -> None:
    sent = decode(parts({"type": "image_url", "image_url": {"url": "HTTP://LOCALHOST:80/a"}}))
    assert sent["messages"][0]["content"][0]["image_url"]["url"] == "http://localhost/a"


def test_uuid_only_parts_pass_and_are_no_images() -> None:
    doc = parts({"type": "image_url", "image_url": None, "uuid": "cat"}, "plain text part",
                {"type": "text", "text": "hi"})
    call = openai.decode_request(json.dumps(doc).encode(), openai.CHAT)
    assert openai.ChatView(call).images() == []
    assert openai.ChatView(call).texts() == ["hi"]


def test_images_are_found_as_vllm_reads_them() -> None:
    data = "data:image/png;base64,AAAA"
    doc = parts({"image_url": {"url": data}}, {"type": "input_image", "image_url": data},
                {"type": "text", "text": "x", "uuid": "u", "image_url": data})
    call = openai.decode_request(json.dumps(doc).encode(), openai.CHAT)
    images = openai.ChatView(call).images()
    assert [i.param for i in images] == [f"messages[0].content[{j}].image_url" for j in range(3)]
    responses = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what"}, {"type": "input_image", "image_url": data}]}]}
    call = openai.decode_request(json.dumps(responses).encode(), openai.RESPONSES)
    view = openai.ChatView(call)
    assert [i.param for i in view.images()] == ["input[0].content[1].image_url"]
    assert view.texts() == ["what"]
    view.drop_image(view.images()[0])
    assert call.document is not None and len(call.document["input"][0]["content"]) == 1


@pytest.mark.parametrize(("part", "param", "words"), [
    ({"type": "image_embeds", "image_embeds": "AAAA"}, "messages[0].content[0].type",
     "cannot inspect image embeddings"),
    ({"type": "input_file", "file_data": "AAAA"}, "messages[0].content[0].type", "files"),
    ({"type": "nope"}, "messages[0].content[0].type", "unknown content part type 'nope'"),
    ({"text": "no type"}, "messages[0].content[0].type", "needs a 'type'"),
    ({"type": 5}, "messages[0].content[0].type", "must be a string"),
    ({"type": "image_url"}, "messages[0].content[0].image_url", "needs a URL"),
    (7, "messages[0].content[0]", "an object or a string"),
])
def test_parts_mmguard_cannot_check_are_refused(part: Any, param: str, words: str) -> None:
    with pytest.raises(ProxyError) as exc:
        decode(parts(part))
    assert exc.value.param == param and words in exc.value.message


def test_fetch_mode_refuses_remote_audio_and_keeps_images_for_the_fetcher() -> None:
    img = {"type": "image_url", "image_url": {"url": "http://localhost/a.png"}}
    assert decode(parts(img), mode="fetch")["messages"][0]["content"][0] == img
    with pytest.raises(ProxyError) as exc:
        decode(parts({"type": "audio_url", "audio_url": {"url": "http://localhost/a.wav"}}),
               mode="fetch")
    assert "fetches remote images only" in exc.value.message


def test_too_many_remote_urls() -> None:
    img = {"type": "image_url", "image_url": {"url": "http://localhost/a.png"}}
    with pytest.raises(ProxyError) as exc:
        decode(parts(*[img] * 9))
    assert "more than 8 remote URLs" in exc.value.message


def test_a_literal_entry_allows_its_address_on_its_own_port_only() -> None:
    """Issue 26 item 3: one rule for named and literal entries, a host and a port."""
    allow = HostAllowList.of(("127.0.0.1:22760", "localhost:22761", "10.0.0.5", "[::1]:81"))
    assert allow.literal_endpoints() == {("127.0.0.1", 22760), ("10.0.0.5", 80),
                                         ("10.0.0.5", 443), ("::1", 81)}
    resolver = CheckedResolver(allow.literal_endpoints(), ())
    assert resolver.allows("127.0.0.1", 22760)
    assert not resolver.allows("127.0.0.1", 22761)  # what localhost:22761 resolves to
    assert not resolver.allows("::ffff:127.0.0.1", 22761)
    assert resolver.allows("::1", 81) and not resolver.allows("::1", 80)
    assert resolver.allows("8.8.8.8", 22761)  # a global address, any listed port
