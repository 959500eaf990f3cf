"""Logs never hold a secret (issue 26, item 5), against a real ``mmguard serve``.

Before: a header line ending in a bare LF got 400, and aiohttp logged a traceback quoting the
raw line, admin token and ``Authorization`` header included (500 such requests: +272 KB of
log); the 400's body echoed the line back. Now mmguard answers malformed requests itself (JSON,
the parser's reason, none of the client's bytes), counts them, and logs them at DEBUG in one
line; every line it writes is redacted. ``serve`` checks every process of the adversarial tier
for the admin token and the client credential in its log after its attacks.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ort_config
from tests.support.adversary import (
    ADMIN_TOKEN,
    CLIENT_CREDENTIAL,
    Prober,
    assert_log_holds_no_secret,
    http_call,
    rss_mib,
    serve,
)
from tests.support.process import MmguardProcess

ATTACKS = 500


@pytest.fixture(scope="module")
def served(ort_models: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[MmguardProcess]:
    with serve(tmp_path_factory.mktemp("logs"), ort_config(ort_models)) as proc:
        yield proc


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
        return out


MALFORMED = [
    # a bare LF ends the Authorization line: the attack
    (b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: x\r\n"
     b"Authorization: Bearer %(token)s\nX-Api-Key: %(client)s\r\nContent-Length: 0\r\n\r\n"),
    (b"GET /v2/health/ready HTTP/1.1\r\nAuthorization: Bearer %(token)s\r\n"
     b"Content-Length: 99999999999999999999999999999\r\n\r\n"),
    b"GET /v2/health/ready HTTP/1.1\r\nAuthorization: Basic %(client)s\r\nX: \x00\x01\r\n\r\n",
    b"GET /\x7f%(token)s HTTP/1.1\r\nAuthorization: Bearer %(client)s\r\n\r\n",
    b"GET /v2 HTTP/1.1\r\nCookie: session=%(client)s\r\nX: " + b"a" * 20000 + b"\r\n\r\n",
]


def test_malformed_requests_are_answered_without_echo_and_never_logged_with_secrets(
        served: MmguardProcess) -> None:
    secrets = {b"token": ADMIN_TOKEN.encode(), b"client": CLIENT_CREDENTIAL.encode()}
    log_before = served.log_path.stat().st_size
    rss_before = rss_mib(served.proc.pid)
    with Prober(served.ports["http"]) as probe:
        for i in range(ATTACKS):
            port = served.ports["admin" if i % 5 == 4 else "http"]
            answer = _raw(port, MALFORMED[i % len(MALFORMED)] % secrets)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.split(b" ", 2)[1] in (b"400", b"431"), answer[:200]
            assert json.loads(body)["error"].startswith("malformed HTTP request: "), body
            assert ADMIN_TOKEN.encode() not in answer and CLIENT_CREDENTIAL.encode() not in answer
    probe.assert_served()
    grown = served.log_path.stat().st_size - log_before
    assert grown < 4096, f"{ATTACKS} malformed requests wrote {grown} bytes of log"
    assert rss_mib(served.proc.pid) - rss_before < 100
    _, _, metrics = http_call(served.ports["admin"], "GET", "/metrics")
    counted = {found[1]: float(found[2]) for found in re.finditer(
        r'mmguard_listener_refusals_total\{limit="malformed",listener="(\w+)"\} (\S+)',
        metrics.decode())}
    assert counted == {"admin": ATTACKS / 5, "http": ATTACKS * 4 / 5}
    assert_log_holds_no_secret(served.log_path, [ADMIN_TOKEN, CLIENT_CREDENTIAL])


def test_grpc_garbage_carrying_secrets_is_not_logged(served: MmguardProcess) -> None:
    port = served.ports["grpc"]
    for data in (b"POST / HTTP/1.1\r\nAuthorization: Bearer %s\r\n\r\n" % ADMIN_TOKEN.encode(),
                 b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + CLIENT_CREDENTIAL.encode() * 50,
                 b"PRI * HTTP/2.0\r\n\r\n"):  # half a preface, then close
        _raw(port, data)
    assert_log_holds_no_secret(served.log_path, [ADMIN_TOKEN, CLIENT_CREDENTIAL])
