"""A log line never holds a secret: what ``redact`` removes, on every path a line takes."""

from __future__ import annotations

import io
import json
import logging

from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from pydantic import SecretStr

from proxy.config.refs import read_secret
from proxy.process.malformed import reason
from proxy.telemetry.logs import MAX_LINE_CHARS, JsonFormatter, redact, register_secret


def test_config_secrets_and_credential_headers_are_redacted() -> None:
    register_secret("s3cr3t-admin-token")
    line = redact("b'Authorization: Bearer s3cr3t-admin-token\\nX-Api-Key: client-key' "
                  "{'cookie': 'session=abc'} token s3cr3t-admin-token "
                  "Proxy-Authorization: Basic dXNlcjpwdw==")
    for secret in ("s3cr3t-admin-token", "client-key", "session=abc", "dXNlcjpwdw=="):
        assert secret not in line, line
    assert "Authorization: <redacted>" in line
    url = redact("backend 'llm' (http://user:pw@vllm:8000/v1) is unavailable")
    assert url == "backend 'llm' (http://<redacted>@vllm:8000/v1) is unavailable"


def test_a_secret_read_from_the_config_is_registered() -> None:
    assert read_secret("token", SecretStr("from-the-config-0042"), None, None, "") \
        == "from-the-config-0042"
    assert redact("the token from-the-config-0042 leaked") == "the token <redacted> leaked"


def test_short_values_and_plain_words_are_left_alone() -> None:
    register_secret("abc")  # too short to redact without eating ordinary words
    assert redact("abc def: model 'clip' answered") == "abc def: model 'clip' answered"


def test_every_line_is_bounded_and_library_records_are_redacted_as_json() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    lib = logging.getLogger("aiohttp.server.test")
    lib.addHandler(handler)
    lib.propagate = False
    try:
        lib.error("Error handling request %s", "Authorization: Bearer abcdef123456")
        lib.error("x" * (MAX_LINE_CHARS * 2))
    finally:
        lib.removeHandler(handler)
    first, second = stream.getvalue().splitlines()
    assert "abcdef123456" not in first and json.loads(first)["level"] == "error"
    assert len(second) <= MAX_LINE_CHARS + 100 and "[cut:" in second


def test_a_parser_refusal_is_named_without_the_clients_bytes() -> None:
    exc = BadHttpMessage("Missing expected CR after header value:\n\n  b'Authorization: Bearer "
                         "tok\\nX: y'\n    ^")
    assert reason(exc) == "Missing expected CR after header value"
    assert "tok" not in reason(LineTooLong(b"Bearer tok" * 100, 8190))
