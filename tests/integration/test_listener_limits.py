"""Each listener's own limits: header size, concurrent requests (HTTP, gRPC), body size on admin,
and the admin token from a file or the environment, never shown.

Requests are held open by a real v2 server that stalls on cue (``FakeV2``); the test waits until
the fake has *received* them, so "the limit is reached" is a fact, not a timing guess.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from proxy.config.model import ConfigError, parse_config
from tests.conftest import ort_config
from tests.support.fake_v2 import FakeV2
from tests.support.mmguard import RunningMmguard
from tests.support.wire import INFER, grpc_request

ECHO_JSON = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2],
                                    "data": [1.0, 2.0]}]}).encode()


def _http(url: str, method: str, path: str, body: bytes | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.headers), r.read()
    finally:
        conn.close()


def _refusals(m: RunningMmguard, listener: str, limit: str) -> float:
    text = urllib.request.urlopen(m.admin_url + "/metrics", timeout=10).read().decode()
    key = f'mmguard_listener_refusals_total{{limit="{limit}",listener="{listener}"}} '
    lines = [ln for ln in text.splitlines() if ln.startswith(key)]
    return float(lines[0].split()[-1]) if lines else 0.0


def _wait(cond: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.fixture
def fake() -> Iterator[FakeV2]:
    with FakeV2() as server:
        yield server


def _fake_routes(fake: FakeV2, **listeners: Any) -> dict[str, Any]:
    return {"backends": [{"kind": "triton_http", "name": "fake-http",
                          "url": f"127.0.0.1:{fake.http_port}"},
                         {"kind": "triton_grpc", "name": "fake-grpc",
                          "url": f"127.0.0.1:{fake.grpc_port}"}],
            "models": [{"name": "echo", "backend": "fake-http"},
                       {"name": "gecho", "backend": "fake-grpc", "backend_model": "echo"}],
            "listeners": listeners}


# --- header size ------------------------------------------------------------------------------


def test_oversized_http_headers_are_refused(ort_models: Path) -> None:
    cfg = ort_config(ort_models, listeners={"http": {"max_header_bytes": 1024}})
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        status, _, _ = _http(m.http_url, "GET", "/v2/health/ready", headers={"x-big": "a" * 2000})
        assert status == 400  # one line over the limit: aiohttp's parser refuses it
        many = {f"x-h{i}": "b" * 90 for i in range(20)}  # each line fits, the whole does not
        status, headers, body = _http(m.http_url, "GET", "/v2/health/ready", headers=many)
        assert status == 431
        assert "over listeners.http.max_header_bytes (1024)" in json.loads(body)["error"]
        assert headers["mmguard-error-origin"] == "proxy"
        assert _refusals(m, "http", "max_header_bytes") == 1
        status, _, _ = _http(m.http_url, "GET", "/v2/health/ready",
                             headers={"x-fits": "c" * 500})
        assert status == 200


def test_oversized_grpc_metadata_is_refused(ort_models: Path) -> None:
    cfg = ort_config(ort_models, listeners={"grpc": {"max_header_bytes": 1024}})
    body = grpc_request("identity_fp32", [("INPUT0", "FP32", [1], b"\0\0\0\0")])
    with RunningMmguard(cfg) as m, grpc.insecure_channel(m.grpc_url) as channel:
        m.wait_ready()
        rpc = channel.unary_unary(INFER)
        with pytest.raises(grpc.RpcError) as exc:
            rpc(body, timeout=10, metadata=(("x-big", "a" * 2000),))
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert rpc(body, timeout=10, metadata=(("x-fits", "a" * 300),))


# --- concurrency ------------------------------------------------------------------------------


def test_http_concurrency_limit_refuses_the_excess_and_keeps_serving(fake: FakeV2) -> None:
    with RunningMmguard(_fake_routes(fake, http={"max_concurrent_requests": 2})) as m, \
            ThreadPoolExecutor(2) as pool:
        m.wait_ready()
        fake.delay_s = 2.0
        held = [pool.submit(_http, m.http_url, "POST", "/v2/models/echo/infer", ECHO_JSON)
                for _ in range(2)]
        _wait(lambda: len(fake.headers) == 2)  # both are inside the backend now
        status, headers, body = _http(m.http_url, "POST", "/v2/models/echo/infer", ECHO_JSON)
        assert status == 429
        assert headers["Retry-After"] == "1"
        assert "listeners.http.max_concurrent_requests (2)" in json.loads(body)["error"]
        status, _, _ = _http(m.http_url, "GET", "/v2/health/ready")
        assert status == 200  # probes pass at the limit
        assert [f.result(30)[0] for f in held] == [200, 200]
        fake.delay_s = 0.0
        status, _, body = _http(m.http_url, "POST", "/v2/models/echo/infer", ECHO_JSON)
        assert status == 200 and json.loads(body)["outputs"][0]["data"] == [1.0, 2.0]
        assert _refusals(m, "http", "max_concurrent_requests") == 1


def test_grpc_concurrency_limit_refuses_the_excess_and_keeps_serving(fake: FakeV2) -> None:
    body = grpc_request("gecho", [("INPUT0", "FP32", [2], np.ones(2, "<f4").tobytes())])
    with RunningMmguard(_fake_routes(fake, grpc={"max_concurrent_requests": 1})) as m, \
            grpc.insecure_channel(m.grpc_url) as channel:
        m.wait_ready()
        rpc = channel.unary_unary(INFER)
        fake.delay_s = 2.0
        held = rpc.future(body, timeout=30)
        _wait(lambda: len(fake.headers) == 1)
        with pytest.raises(grpc.RpcError) as exc:
            rpc(body, timeout=10)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert held.result()
        fake.delay_s = 0.0
        # The server counts the held call out a moment after its answer has left.
        assert _eventually(lambda: rpc(body, timeout=10))


def _eventually(call: Callable[[], Any], timeout: float = 10) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def test_grpc_max_concurrent_streams_queues_calls_on_one_connection(fake: FakeV2) -> None:
    body = grpc_request("gecho", [("INPUT0", "FP32", [2], np.ones(2, "<f4").tobytes())])
    with RunningMmguard(_fake_routes(fake, grpc={"max_concurrent_streams": 1})) as m, \
            grpc.insecure_channel(m.grpc_url) as channel:
        m.wait_ready()
        rpc = channel.unary_unary(INFER)
        assert rpc(body, timeout=10)  # the connection is up and has the server's SETTINGS
        fake.headers.clear()
        fake.delay_s = 1.0
        calls: list[Future[Any]] = [rpc.future(body, timeout=30) for _ in range(2)]
        _wait(lambda: len(fake.headers) == 1)
        time.sleep(0.5)  # the second waits in the client for a free stream, not in the backend
        assert len(fake.headers) == 1
        assert all(c.result() for c in calls)
        assert len(fake.headers) == 2


# --- admin ------------------------------------------------------------------------------------


def _admin_config(models: Path, **admin: Any) -> dict[str, Any]:
    return ort_config(models, listeners={"admin": admin})


def _act(m: RunningMmguard, token: str | None = None) -> tuple[int, bytes]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    status, _, body = _http(m.admin_url.removeprefix("http://"), "POST",
                            "/admin/breakers/nothing/nothing/open", headers=headers)
    return status, body


def test_admin_token_from_a_file(ort_models: Path, tmp_path: Path,
                                 caplog: pytest.LogCaptureFixture) -> None:
    secret = "s3cret-from-file"
    path = tmp_path / "token"
    path.write_text(secret + "\n")  # a Secret written with a newline
    cfg = parse_config(_admin_config(ort_models, token_file=str(path)))
    assert secret not in repr(cfg) and secret not in str(cfg.listeners.admin)
    with RunningMmguard(cfg) as m:
        status, body = _act(m)
        assert status == 401 and secret.encode() not in body
        assert _act(m, "wrong")[0] == 401
        assert _act(m, secret)[0] == 404  # past the token: there is no such breaker
    assert secret not in caplog.text


def test_admin_token_from_the_environment(ort_models: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "s3cret-from-env"
    monkeypatch.setenv("MMGUARD_TEST_ADMIN_TOKEN", secret)
    cfg = parse_config(_admin_config(ort_models, token_env="MMGUARD_TEST_ADMIN_TOKEN"))
    assert secret not in repr(cfg)
    with RunningMmguard(cfg) as m:
        assert _act(m)[0] == 401
        assert _act(m, secret)[0] == 404


def test_admin_token_in_the_config_is_never_shown(ort_models: Path) -> None:
    cfg = parse_config(_admin_config(ort_models, token="inline-s3cret"))
    assert "inline-s3cret" not in repr(cfg)
    assert cfg.listeners.admin.resolve_token() == "inline-s3cret"


def test_admin_token_sources_are_checked_at_load(ort_models: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def problem(**admin: Any) -> str:
        with pytest.raises(ConfigError) as exc:
            parse_config(_admin_config(ort_models, **admin))
        return str(exc.value)

    text = problem(token="abc", token_file=str(tmp_path / "t"))
    assert "listeners.admin: Value error, the admin token comes from one source; token and " \
           "token_file are both set" in text and "abc" not in text
    assert f"token_file: cannot read {tmp_path / 'nope'}" in problem(
        token_file=str(tmp_path / "nope"))
    monkeypatch.delenv("MMGUARD_NO_SUCH_TOKEN", raising=False)
    assert "environment variable MMGUARD_NO_SUCH_TOKEN is empty or unset" in problem(
        token_env="MMGUARD_NO_SUCH_TOKEN")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert "is empty or unset" in problem(token_file=str(empty))


def test_admin_request_size_limit(ort_models: Path) -> None:
    with RunningMmguard(_admin_config(ort_models, max_request_bytes=1024, token="t")) as m:
        admin = m.admin_url.removeprefix("http://")
        status, _, body = _http(admin, "POST", "/admin/breakers/a/b/open", b"x" * 2048)
        assert status == 413
        assert "over listeners.admin.max_request_bytes (1024)" in json.loads(body)["error"]
        host, port = admin.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:  # no Content-Length: refused before anything is read
            conn.request("POST", "/admin/breakers/a/b/open", body=iter([b"x" * 10]),
                         encode_chunked=True)
            assert conn.getresponse().status == 411
        finally:
            conn.close()
        assert _http(admin, "POST", "/admin/breakers/a/b/open", b"{}",
                     headers={"Authorization": "Bearer t"})[0] == 404
        assert _refusals(m, "admin", "max_request_bytes") == 2


def test_limits_have_bounds(ort_models: Path) -> None:
    for listeners, where in [({"http": {"max_concurrent_requests": 0}},
                              "listeners.http.max_concurrent_requests"),
                             ({"grpc": {"max_concurrent_streams": 0}},
                              "listeners.grpc.max_concurrent_streams"),
                             ({"admin": {"max_request_bytes": 2 * 1024 * 1024}},
                              "listeners.admin.max_request_bytes"),
                             ({"http": {"max_connections": 0}}, "listeners.http.max_connections"),
                             ({"admin": {"header_timeout_s": 0}},
                              "listeners.admin.header_timeout_s"),
                             ({"http": {"min_body_bytes_per_s": -1}},
                              "listeners.http.min_body_bytes_per_s"),
                             ({"grpc": {"max_connection_idle_s": 0}},
                              "listeners.grpc.max_connection_idle_s")]:
        with pytest.raises(ConfigError) as exc:
            parse_config(ort_config(ort_models, listeners=listeners))
        assert where in str(exc.value)


# --- slow and many connections ----------------------------------------------------------------


def _drip_until_closed(url: str, limit_s: float) -> float:
    """Open a connection that sends a partial request line, one byte a second; seconds until
    the proxy closes it."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=limit_s)
    start = time.monotonic()
    try:
        for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 100:
            sock.send(bytes([byte]))
            ready, _, _ = select.select([sock], [], [], 1.0)
            if ready and sock.recv(1024) == b"":
                return time.monotonic() - start
            if time.monotonic() - start > limit_s:
                break
    except OSError:
        return time.monotonic() - start
    finally:
        sock.close()
    raise AssertionError(f"still open after {limit_s} s")


def test_admin_misses_are_answered_in_the_apis_json(ort_models: Path) -> None:
    """An unknown admin path, and a method a path does not take, get JSON like every other
    admin answer (aiohttp's own were plain text), with ``Allow`` on a 405."""
    with RunningMmguard(_admin_config(ort_models, token="t")) as m:
        admin = m.admin_url.removeprefix("http://")
        status, headers, body = _http(admin, "GET", "/admin/nope")
        assert status == 404 and json.loads(body)["error"] == \
            "no such admin endpoint: GET /admin/nope"
        status, headers, body = _http(admin, "GET", "/admin/reload")
        assert status == 405 and headers["Allow"] == "POST"
        assert json.loads(body)["error"].startswith("GET is not served on /admin/reload")
        status, headers, _ = _http(admin, "GET", "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain")


def test_admin_listener_cuts_a_header_dripper(ort_models: Path) -> None:
    with RunningMmguard(_admin_config(ort_models, header_timeout_s=1.0)) as m:
        assert _drip_until_closed(m.admin_url, limit_s=15) < 1.0 + 5.0


def test_admin_listener_caps_connections(ort_models: Path) -> None:
    with RunningMmguard(_admin_config(ort_models, max_connections=2, token="t")) as m:
        admin = m.admin_url.removeprefix("http://")
        host, port = admin.split(":")
        held = []
        try:
            for _ in range(2):  # two requests in progress: their bodies never come
                s = socket.create_connection((host, int(port)), timeout=10)
                s.sendall(b"POST /admin/experiments HTTP/1.1\r\nHost: a\r\nAuthorization: "
                          b"Bearer t\r\nContent-Length: 10\r\n\r\n")
                held.append(s)
            time.sleep(0.5)
            status, headers, body = _http(admin, "GET", "/metrics")
        finally:
            for s in held:
                s.close()
        assert status == 503 and headers["Retry-After"] == "1"
        assert "listeners.admin.max_connections (2)" in json.loads(body)["error"]
        time.sleep(0.5)  # the held connections are closed: room for the next request
        assert _refusals(m, "admin", "max_connections") == 1


def test_grpc_listener_caps_connections(ort_models: Path) -> None:
    body = grpc_request("identity_fp32", [("INPUT0", "FP32", [2], np.ones(2, "<f4").tobytes())])
    with RunningMmguard(ort_config(ort_models, listeners={"grpc": {"max_connections": 1}})) as m:
        m.wait_ready()
        own = [("grpc.use_local_subchannel_pool", 1)]  # each channel its own connection
        with grpc.insecure_channel(m.grpc_url, options=own) as first, \
                grpc.insecure_channel(m.grpc_url, options=own) as second:
            assert first.unary_unary(INFER)(body, timeout=10)
            with pytest.raises(grpc.RpcError) as exc:
                second.unary_unary(INFER)(body, timeout=3)
            assert exc.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                        grpc.StatusCode.DEADLINE_EXCEEDED)
            assert first.unary_unary(INFER)(body, timeout=10)  # the first is kept


def test_a_body_that_never_completes_gets_408_at_its_deadline(ort_models: Path) -> None:
    http = {"body_timeout_s": 2.0, "min_body_bytes_per_s": 0}  # only the deadline applies
    with RunningMmguard(ort_config(ort_models, listeners={"http": http})) as m:
        host, port = m.http_url.split(":")
        start = time.monotonic()
        with socket.create_connection((host, int(port)), timeout=20) as s:
            s.sendall(b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: a\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            answer = b""
            while chunk := s.recv(4096):  # the other 99 bytes never come
                answer += chunk
        took = time.monotonic() - start
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        message = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert message.startswith("the request body was not complete after "
                                  "listeners.http.body_timeout_s (2 s;"), message
        assert 2.0 <= took < 2.0 + 5.0
        assert _refusals(m, "http", "body_timeout_s") == 1


def test_listener_refusal_counters_exist_at_zero(ort_models: Path) -> None:
    """increase() sees the first refusal only if its series existed before it (at 0)."""
    with RunningMmguard(ort_config(ort_models)) as m:
        m.wait_ready()
        text = urllib.request.urlopen(m.admin_url + "/metrics", timeout=10).read().decode()
        for listener, limit in (("http", "max_connections"), ("admin", "body_timeout_s"),
                                ("http", "max_concurrent_requests")):
            assert (f'mmguard_listener_refusals_total{{limit="{limit}",listener="{listener}"}}'
                    " 0.0") in text
