"""SSRF through media URLs: a real ``mmguard serve`` in front of a real vLLM (which fetches any
http URL it is given and follows redirects), and HTTP servers on loopback that record every
request they get. Each attack must be answered 400 naming the part, and the servers that are not
allow-listed must see no request at all — neither from vLLM nor from mmguard.

"Allowed" and "not allowed" are different loopback ports (and ``localhost`` versus
``127.0.0.1`` versus ``[::1]``); no other address appears here.
"""

from __future__ import annotations

import base64
import http.server
import json
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ort_config
from tests.support.adversary import Prober, http_call, serve, write_config
from tests.support.process import MmguardProcess
from tests.support.vllm import VllmServer, png_bytes

pytestmark = pytest.mark.vllm
CAT = png_bytes(28, 28, (200, 30, 30))


@dataclass
class Hit:
    path: str
    user_agent: str


@dataclass
class Recorder:
    """An HTTP server on loopback that records every request: /cat.png (a PNG), /big.png
    (200 KB), /page.txt (text/plain), /slow.png (never finishes), /redirect?to=URL (302)."""

    family: socket.AddressFamily = socket.AF_INET
    hits: list[Hit] = field(default_factory=list)
    port: int = 0
    _server: http.server.ThreadingHTTPServer | None = None

    def start(self) -> Recorder:
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                recorder.hits.append(Hit(self.path, self.headers.get("User-Agent", "")))
                path, _, query = self.path.partition("?")
                if path == "/slow.png":  # headers at once, then nothing for 10 s
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(CAT)))
                    self.end_headers()
                    self.wfile.flush()
                    time.sleep(10)
                    return
                if path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", urllib.parse.parse_qs(query)["to"][0])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body, ctype = {"/cat.png": (CAT, "image/png"),
                               "/big.png": (CAT + b"\0" * 200_000, "image/png"),
                               "/page.txt": (b"not an image", "text/plain")}.get(
                                   path, (b"missing", "text/plain"))
                self.send_response(200 if body != b"missing" else 404)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            address_family = self.family

        host = "::1" if self.family == socket.AF_INET6 else "127.0.0.1"
        self._server = Server((host, 0), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        host = "[::1]" if self.family == socket.AF_INET6 else "127.0.0.1"
        return f"http://{host}:{self.port}"


@pytest.fixture(scope="module")
def images() -> Iterator[Recorder]:
    """The allow-listed image host."""
    r = Recorder().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def secret() -> Iterator[Recorder]:
    """A loopback service nobody allowed: every attack aims here."""
    r = Recorder().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def secret_v6() -> Iterator[Recorder]:
    r = Recorder(socket.AF_INET6).start()
    yield r
    r.stop()


def proxy_config(ort_models: Path, vllm: VllmServer, openai: dict[str, Any]) -> dict[str, Any]:
    cfg = ort_config(ort_models, openai=openai)
    cfg["backends"].append({"kind": "vllm", "name": "llava", "url": vllm.url})
    cfg["models"].append({"name": "tiny-llava", "backend": "llava"})
    return cfg


@pytest.fixture(scope="module")
def forward(ort_models: Path, vllm_llava: VllmServer, images: Recorder,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[MmguardProcess]:
    """remote_images: forward — vLLM fetches what passes; a bare ``localhost`` means port 80."""
    cfg = proxy_config(ort_models, vllm_llava, {
        "remote_images": "forward",
        "image_url_allow_hosts": [f"127.0.0.1:{images.port}", "localhost"]})
    with serve(tmp_path_factory.mktemp("ssrf_forward"), cfg, ready_timeout=180) as proc:
        yield proc


@pytest.fixture(scope="module")
def fetching(ort_models: Path, vllm_llava: VllmServer, images: Recorder,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[MmguardProcess]:
    """remote_images: fetch (the default) — mmguard fetches and inlines."""
    cfg = proxy_config(ort_models, vllm_llava, {
        "image_url_allow_hosts": [f"127.0.0.1:{images.port}", f"localhost:{images.port}"],
        "fetch": {"max_bytes": 100_000, "timeout_s": 2, "allow_networks": ["127.0.0.1/32"]}})
    with serve(tmp_path_factory.mktemp("ssrf_fetch"), cfg, ready_timeout=180) as proc:
        yield proc


def post(proc: MmguardProcess, path: str, doc: dict[str, Any]) -> tuple[int, dict[str, Any],
                                                                       dict[str, str]]:
    status, headers, body = http_call(proc.ports["http"], "POST", path, json.dumps(doc).encode(),
                                      {"Content-Type": "application/json"}, timeout=120)
    return status, json.loads(body) if body else {}, headers


def chat(*parts: Any) -> dict[str, Any]:
    return {"model": "tiny-llava", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}]}


def attacks(s: str, v6: str) -> list[tuple[str, str, dict[str, Any], str, str]]:
    """(name, endpoint, body, param the 400 names, words its message has). ``s`` is the
    not-allowed service's authority (127.0.0.1:port), ``v6`` the [::1] one's."""
    port = s.rsplit(":", 1)[1]
    img = f"http://{s}/cat.png"
    chat_ep, part0 = "/v1/chat/completions", "messages[0].content[0]"
    return [
        ("backslash differential", chat_ep, chat(
            {"type": "image_url", "image_url": {"url": f"http://{s}\\@127.0.0.1:1/x.png"}}),
         f"{part0}.image_url.url", "backslash"),
        ("userinfo", chat_ep, chat({"type": "image_url", "image_url": {"url": f"http://a@{s}/"}}),
         f"{part0}.image_url.url", "userinfo"),
        ("space", chat_ep, chat({"type": "image_url", "image_url": {"url": f"http://{s} /x"}}),
         f"{part0}.image_url.url", "space"),
        ("tab", chat_ep, chat({"type": "image_url", "image_url": {"url": f"http://{s}/\tx"}}),
         f"{part0}.image_url.url", "control"),
        ("not allow-listed", chat_ep, chat({"type": "image_url", "image_url": {"url": img}}),
         f"{part0}.image_url.url", "not on openai.image_url_allow_hosts"),
        ("bare host is port 80 only", chat_ep, chat(
            {"type": "image_url", "image_url": {"url": f"http://localhost:{port}/cat.png"}}),
         f"{part0}.image_url.url", f"localhost:{port} is not on"),
        ("numeric host", chat_ep, chat(
            {"type": "image_url", "image_url": {"url": f"http://2130706433:{port}/cat.png"}}),
         f"{part0}.image_url.url", "is refused"),
        ("short numeric host", chat_ep, chat(
            {"type": "image_url", "image_url": {"url": f"http://127.1:{port}/cat.png"}}),
         f"{part0}.image_url.url", "is refused"),
        ("ipv6 loopback", chat_ep, chat({"type": "image_url", "image_url": {
            "url": f"http://{v6}/cat.png"}}), f"{part0}.image_url.url", "is not on"),
        ("untyped part", chat_ep, chat({"image_url": {"url": img}}), f"{part0}.image_url.url",
         "is not on"),
        ("untyped string part", chat_ep, chat({"image_url": img}), f"{part0}.image_url",
         "is not on"),
        ("uuid makes a text part an image", chat_ep, chat(
            {"type": "text", "text": "x", "uuid": "u1", "image_url": img}),
         f"{part0}.image_url", "is not on"),
        ("input_image in chat", chat_ep, chat({"type": "input_image", "image_url": img,
                                              "detail": "auto"}),
         f"{part0}.image_url", "is not on"),
        ("video_url", chat_ep, chat({"type": "video_url", "video_url": {"url": img}}),
         f"{part0}.video_url.url", "is not on"),
        ("audio_url", chat_ep, chat({"type": "audio_url", "audio_url": {"url": img}}),
         f"{part0}.audio_url.url", "is not on"),
        ("unknown part type", chat_ep, chat({"type": "image_file", "file": {"url": img}}),
         f"{part0}.type", "unknown content part type 'image_file'"),
        ("embeddings part", chat_ep, chat({"type": "image_embeds", "image_embeds": "AAAA"}),
         f"{part0}.type", "cannot inspect image embeddings"),
        ("file scheme", chat_ep, chat({"type": "image_url", "image_url": {
            "url": "file:///etc/hostname"}}), f"{part0}.image_url.url", "scheme 'file'"),
        ("tokenize with an image", "/tokenize", {"model": "tiny-llava", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": img}}]}]},
         f"{part0}.image_url.url", "is not on"),
        ("responses input_image", "/v1/responses", {"model": "tiny-llava",
                                                    "max_output_tokens": 2, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": img,
                                          "detail": "auto"}]}]},
         "input[0].content[0].image_url", "is not on"),
        ("responses tool server", "/v1/responses", {"model": "tiny-llava", "input": "hi",
                                                    "tools": [{"type": "mcp",
                                                               "server_label": "x",
                                                               "server_url": img}]},
         "tools[0].server_url", "is not on"),
        ("embeddings messages", "/v1/embeddings", {"model": "tiny-llava", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": img}}]}]},
         f"{part0}.image_url.url", "is not on"),
        ("invocations", "/invocations", {"model": "tiny-llava", "messages": [
            {"role": "user", "content": [{"image_url": {"url": img}}]}]},
         f"{part0}.image_url.url", "is not on"),
    ]


ATTACK_NAMES = [a[0] for a in attacks("127.0.0.1:1", "[::1]:1")]


@pytest.mark.parametrize("mode", ["forward", "fetching"])
@pytest.mark.parametrize("name", ATTACK_NAMES)
def test_attack_is_refused_and_nothing_is_fetched(
        request: pytest.FixtureRequest, mode: str, name: str, secret: Recorder,
        secret_v6: Recorder, images: Recorder, vllm_llava: VllmServer) -> None:
    proc: MmguardProcess = request.getfixturevalue(mode)
    attack = next(a for a in attacks(f"127.0.0.1:{secret.port}", f"[::1]:{secret_v6.port}")
                  if a[0] == name)
    _, endpoint, doc, param, words = attack
    before = len(images.hits)
    status, body, headers = post(proc, endpoint, doc)
    assert status == 400, (status, body)
    assert body["error"]["param"] == param, body
    assert words in body["error"]["message"], body
    assert headers["mmguard-error-origin"] == "mmguard"
    time.sleep(0.2)  # a fetch, had one been made, would have landed by now
    assert secret.hits == [] and secret_v6.hits == []
    assert len(images.hits) == before


def test_allowed_url_is_forwarded_as_parsed_and_vllm_fetches_it(
        forward: MmguardProcess, images: Recorder, secret: Recorder) -> None:
    """forward mode: the allow-listed URL reaches vLLM, written out again (the default port and
    the host's case are normalised), and vLLM fetches it once."""
    before = len(images.hits)
    url = f"HTTP://127.0.0.1:{images.port}/cat.png?x=1"
    status, body, _ = post(forward, "/v1/chat/completions",
                           chat({"type": "image_url", "image_url": {"url": url}}))
    assert status == 200, body
    fetched = images.hits[before:]
    assert [h.path for h in fetched] == ["/cat.png?x=1"]
    assert "mmguard" not in fetched[0].user_agent  # vLLM fetched it, not mmguard
    assert secret.hits == []


def test_safe_mode_fetches_once_and_inlines(fetching: MmguardProcess, images: Recorder,
                                            vllm_llava: VllmServer) -> None:
    """fetch mode: mmguard fetches the image itself (once), vLLM gets it inline: the answer is
    the one vLLM gives for the same image sent as a data: URL."""
    before = len(images.hits)
    with Prober(fetching.ports["http"]) as probes:
        status, body, headers = post(fetching, "/v1/chat/completions", chat(
            {"type": "image_url", "image_url": {"url": f"{images.url}/cat.png"}}))
    assert status == 200, body
    assert [(h.path, h.user_agent) for h in images.hits[before:]] == [("/cat.png", "mmguard")]
    assert headers["mmguard-remote-images"] == "fetched 1, sent inline"
    inline = f"data:image/png;base64,{base64.b64encode(CAT).decode()}"
    direct = http_call(int(vllm_llava.url.rsplit(":", 1)[1]), "POST", "/v1/chat/completions",
                       json.dumps(chat({"type": "image_url", "image_url": {"url": inline}})
                                  ).encode(), {"Content-Type": "application/json"}, timeout=60)
    assert json.loads(direct[2])["choices"][0]["message"]["content"] == \
        body["choices"][0]["message"]["content"]
    assert body["usage"] == json.loads(direct[2])["usage"]
    probes.assert_served(minimum=1)


def test_safe_mode_by_name_connects_to_the_checked_address(fetching: MmguardProcess,
                                                           images: Recorder) -> None:
    """``localhost:port`` is allow-listed and 127.0.0.1/32 is in allow_networks: the resolved
    address passes the rule, and the fetch lands on the recorder at 127.0.0.1."""
    before = len(images.hits)
    status, body, _ = post(fetching, "/v1/responses", {
        "model": "tiny-llava", "max_output_tokens": 2, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": f"http://localhost:{images.port}/cat.png",
             "detail": "auto"}, {"type": "input_text", "text": "hi"}]}]})
    assert status == 200, body
    assert [(h.path, h.user_agent) for h in images.hits[before:]] == [("/cat.png", "mmguard")]


def test_safe_mode_refuses_a_redirect_to_a_host_not_allowed(
        fetching: MmguardProcess, images: Recorder, secret: Recorder) -> None:
    before = len(images.hits)
    target = urllib.parse.quote(f"http://127.0.0.1:{secret.port}/cat.png", safe="")
    status, body, _ = post(fetching, "/v1/chat/completions", chat(
        {"type": "image_url", "image_url": {"url": f"{images.url}/redirect?to={target}"}}))
    assert status == 400, body
    assert body["error"]["param"] == "messages[0].content[0].image_url.url"
    assert f"redirects to 127.0.0.1:{secret.port}" in body["error"]["message"]
    assert "did not follow it" in body["error"]["message"]
    assert [h.user_agent for h in images.hits[before:]] == ["mmguard"]  # one hop, mmguard's
    time.sleep(0.2)
    assert secret.hits == []


def test_safe_mode_follows_a_redirect_within_the_allow_list(fetching: MmguardProcess,
                                                            images: Recorder) -> None:
    before = len(images.hits)
    target = urllib.parse.quote(f"{images.url}/cat.png", safe="")
    status, body, _ = post(fetching, "/v1/chat/completions", chat(
        {"type": "image_url", "image_url": {"url": f"{images.url}/redirect?to={target}"}}))
    assert status == 200, body
    assert [h.path.split("?")[0] for h in images.hits[before:]] == ["/redirect", "/cat.png"]


@pytest.mark.parametrize(("path", "status", "words"), [
    ("/page.txt", 400, "Content-Type 'text/plain'"),
    ("/big.png", 413, "larger than 100000 bytes"),
    ("/missing.png", 400, "answered HTTP 404"),
])
def test_safe_mode_limits(fetching: MmguardProcess, images: Recorder, path: str, status: int,
                          words: str) -> None:
    got, body, _ = post(fetching, "/v1/chat/completions", chat(
        {"type": "image_url", "image_url": {"url": f"{images.url}{path}"}}))
    assert got == status, body
    assert words in body["error"]["message"]
    assert body["error"]["param"] == "messages[0].content[0].image_url.url"


def test_safe_mode_slow_image_host_times_out_without_stalling(fetching: MmguardProcess,
                                                              images: Recorder) -> None:
    """An image host that never finishes: 400 after openai.fetch.timeout_s, and every other
    client is served meanwhile (the fetch never holds the event loop)."""
    with Prober(fetching.ports["http"]) as probes:
        t0 = time.monotonic()
        status, body, _ = post(fetching, "/v1/chat/completions", chat(
            {"type": "image_url", "image_url": {"url": f"{images.url}/slow.png"}}))
        waited = time.monotonic() - t0
    assert status == 400 and "took longer than 2.0 s" in body["error"]["message"], body
    assert waited < 8
    probes.assert_served(minimum=10)


def test_safe_mode_refuses_remote_audio(fetching: MmguardProcess, images: Recorder) -> None:
    """mmguard fetches images only; vLLM would fetch an allow-listed audio URL itself (and
    follow its redirects), so in fetch mode it is refused."""
    before = len(images.hits)
    status, body, _ = post(fetching, "/v1/chat/completions", chat(
        {"type": "audio_url", "audio_url": {"url": f"{images.url}/cat.png"}}))
    assert status == 400 and "fetches remote images only" in body["error"]["message"]
    assert len(images.hits) == before


def test_uuid_only_image_part_is_not_refused(forward: MmguardProcess) -> None:
    """vLLM accepts a part naming only a cached image's uuid; mmguard passes it (nothing to
    fetch) and the answer is vLLM's own."""
    inline = f"data:image/png;base64,{base64.b64encode(CAT).decode()}"
    first = chat({"type": "image_url", "image_url": {"url": inline}, "uuid": "cat-1"})
    assert post(forward, "/v1/chat/completions", first)[0] == 200
    status, body, _ = post(forward, "/v1/chat/completions",
                           chat({"type": "image_url", "image_url": None, "uuid": "cat-1"}))
    assert status == 200, body


def test_reload_applies_the_new_allow_list(ort_models: Path, vllm_llava: VllmServer,
                                           images: Recorder, tmp_path: Path) -> None:
    """SIGHUP with a new allow-list: the URL that passed is refused at once. The new list names
    ``localhost:port`` without allow_networks: the name resolves to a loopback address, which is
    neither listed nor global, so mmguard refuses it after DNS (no rebinding) and fetches
    nothing."""
    cfg = proxy_config(ort_models, vllm_llava, {
        "image_url_allow_hosts": [f"127.0.0.1:{images.port}"]})
    url = f"{images.url}/cat.png"
    with serve(tmp_path, cfg, ready_timeout=180) as proc:
        assert post(proc, "/v1/chat/completions", chat(
            {"type": "image_url", "image_url": {"url": url}}))[0] == 200
        cfg["openai"] = {"image_url_allow_hosts": [f"localhost:{images.port}"]}
        write_config(tmp_path / "mmguard.yaml", cfg)
        proc.signal(signal.SIGHUP)
        proc.wait_log("config reloaded", timeout=60)
        status, body, _ = post(proc, "/v1/chat/completions", chat(
            {"type": "image_url", "image_url": {"url": url}}))
        assert status == 400 and f"127.0.0.1:{images.port} is not on" in body["error"]["message"]
        before = len(images.hits)
        status, body, _ = post(proc, "/v1/chat/completions", chat(
            {"type": "image_url", "image_url": {"url": f"http://localhost:{images.port}/c.png"}}))
        assert status == 400, body
        assert "localhost resolved to ['127.0.0.1']" in body["error"]["message"]
        assert len(images.hits) == before


def test_forward_mode_needs_the_vllm_flags_against_redirects(
        ort_models: Path, vllm_models: dict[str, Path], vllm_llava: VllmServer,
        forward: MmguardProcess, images: Recorder, secret: Recorder, tmp_path: Path) -> None:
    """What docs/openai.md says about ``remote_images: forward``: mmguard checks the first URL
    only, and a default vLLM follows an allow-listed host's redirect to anywhere (the gap is
    real); the same request to a vLLM run with ``VLLM_MEDIA_URL_ALLOW_REDIRECTS=0`` and
    ``--allowed-media-domains`` fetches only the allowed host's redirect answer, never the
    target."""
    target = urllib.parse.quote(f"http://127.0.0.1:{secret.port}/cat.png", safe="")
    doc = chat({"type": "image_url",
                "image_url": {"url": f"{images.url}/redirect?to={target}"}})
    post(forward, "/v1/chat/completions", doc)
    assert [h.path for h in secret.hits] == ["/cat.png"]  # default vLLM followed the redirect
    secret.hits.clear()
    hardened = VllmServer(vllm_models["tiny-llava"], "tiny-llava", log_path=tmp_path / "v.log",
                          env={"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"},
                          extra_args=["--allowed-media-domains", "127.0.0.1"])
    try:
        hardened.start()
        cfg = proxy_config(ort_models, hardened, {
            "remote_images": "forward", "image_url_allow_hosts": [f"127.0.0.1:{images.port}"]})
        (tmp_path / "mmguard").mkdir()
        with serve(tmp_path / "mmguard", cfg, ready_timeout=180) as proc:
            before = len(images.hits)
            status, body, _ = post(proc, "/v1/chat/completions", doc)
            assert status != 200, body
            assert [h.path.split("?")[0] for h in images.hits[before:]] == ["/redirect"]
            time.sleep(0.2)
            assert secret.hits == []
    finally:
        hardened.stop()
        secret.hits.clear()
