"""The fuzz properties over real sockets: malformed requests to a running mmguard's HTTP v2,
OpenAI and gRPC fronts. Every answer MUST be a success or a client error with a message —
never a 5xx / INTERNAL / UNKNOWN, and never silence: ``CLIENT_TIMEOUT_S`` is the hang guard.

The routes are those of ``tests.conftest.ort_config``: ``clip_demo`` and ``identity_<dtype>``
on in-process ONNX Runtime, so requests that decode well reach a real backend and its errors.
Used by ``test_fronts.py`` and ``scripts/fuzz_long.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from hypothesis import strategies as st

from proxy.errors import STATUS, ErrorKind
from proxy.wire.kserve_http import HEADER_LENGTH
from tests.fuzz.openai_inputs import openai_bodies
from tests.fuzz.oracle import CLIENT_ERRORS
from tests.fuzz.v2_inputs import grpc_bodies, http_bodies
from tests.support.mmguard import RunningMmguard
from tests.support.models import IDENTITY_TYPES
from tests.support.wire import INFER, grpc_request, http_binary_body, http_post

CLIENT_TIMEOUT_S = 10.0
MODELS = [*(f"identity_{d.lower()}" for d in IDENTITY_TYPES), "clip_demo", "no_such_model"]
_GRPC_REFUSALS = frozenset(STATUS[k].grpc for k in CLIENT_ERRORS)
_SMALL = ("INPUT0", "FP32", [4], np.arange(4, dtype="<f4").tobytes())


class Client:
    """One gRPC channel and the HTTP address of a running mmguard, kept for a whole run."""

    def __init__(self, proxy: RunningMmguard) -> None:
        self.http_url = proxy.http_url
        self.channel = grpc.insecure_channel(proxy.grpc_url)
        self.infer = self.channel.unary_unary(INFER)  # bytes in, bytes out: no (de)serializers

    def close(self) -> None:
        self.channel.close()


def _message(status: int, body: bytes, openai: bool) -> str:
    try:
        doc = json.loads(body)
        if openai and "detail" in doc:  # a body vLLM (Starlette) cannot parse: its own shape
            return str(doc["detail"])
        error = doc["error"]
        return str(error["message"] if openai else error)
    except (ValueError, KeyError, TypeError) as exc:
        raise AssertionError(f"HTTP {status} without an error message: {body[:300]!r}") from exc


def _check_http_answer(status: int, body: bytes, openai: bool) -> None:
    if status == 200:
        return
    message = _message(status, body, openai)
    if status == STATUS[ErrorKind.UNIMPLEMENTED].http:
        assert "shared memory" in message, message
        return
    assert 400 <= status < 500, f"HTTP {status}: {message}"
    assert message.strip(), f"HTTP {status} with an empty message"


def check_http_front(client: Client, case: tuple[str, bytes, str | None]) -> None:
    model, body, header_length = case
    headers = {"Content-Type": "application/json"}
    if header_length is not None:
        headers[HEADER_LENGTH] = header_length
    status, _, answer = http_post(client.http_url, f"/v2/models/{model}/infer", body, headers,
                                  timeout=CLIENT_TIMEOUT_S)
    _check_http_answer(status, answer, openai=False)


def check_openai_front(client: Client, case: tuple[bytes, str]) -> None:
    body, endpoint = case
    status, _, answer = http_post(client.http_url, endpoint, body,
                                  {"Content-Type": "application/json"}, timeout=CLIENT_TIMEOUT_S)
    _check_http_answer(status, answer, openai=True)


def check_grpc_front(client: Client, body: bytes) -> None:
    try:
        client.infer(body, timeout=CLIENT_TIMEOUT_S)
    except grpc.RpcError as err:
        code, details = err.code(), err.details() or ""
        assert code is not grpc.StatusCode.DEADLINE_EXCEEDED, "no answer in time (a hang)"
        if code is grpc.StatusCode.UNIMPLEMENTED:
            assert "shared memory" in details, details
            return
        assert code in _GRPC_REFUSALS, f"{code.name}: {details}"
        assert details.strip(), f"{code.name} with an empty message"


def refused_over_http(client: Client, path: str, body: bytes, status: int, says: list[str],
                      headers: dict[str, str] | None = None, openai: bool = False) -> str:
    """The HTTP front MUST answer ``status`` with a message holding every one of ``says``."""
    got, _, answer = http_post(client.http_url, path, body,
                               {"Content-Type": "application/json", **(headers or {})},
                               timeout=CLIENT_TIMEOUT_S)
    message = _message(got, answer, openai) if got != 200 else answer.decode(errors="replace")
    assert got == status, f"HTTP {got}, not {status}: {message[:300]}"
    missing = [s for s in says if s not in message]
    assert not missing, f"the message {message!r} does not say {missing}"
    return message


def refused_over_grpc(client: Client, body: bytes, code: grpc.StatusCode,
                      says: list[str]) -> str:
    """The gRPC front MUST answer ``code`` with details holding every one of ``says``."""
    try:
        client.infer(body, timeout=CLIENT_TIMEOUT_S)
    except grpc.RpcError as err:
        details = err.details() or ""
        assert err.code() is code, f"{err.code().name}, not {code.name}: {details}"
        missing = [s for s in says if s not in details]
        assert not missing, f"the message {details!r} does not say {missing}"
        return details
    raise AssertionError(f"accepted instead of refused ({code.name})")


def check_still_serving(client: Client) -> None:
    """A valid request gets the right answer on both v2 fronts."""
    answer = client.infer(grpc_request("identity_fp32", [_SMALL]), timeout=CLIENT_TIMEOUT_S)
    assert _SMALL[3] in answer
    body, hlen = http_binary_body([_SMALL], outputs=["OUTPUT0"])
    status, _, data = http_post(client.http_url, "/v2/models/identity_fp32/infer", body,
                                      {HEADER_LENGTH: str(hlen)}, timeout=CLIENT_TIMEOUT_S)
    assert status == 200 and data.endswith(_SMALL[3]), (status, data[:200])


def _ascii_header(case: tuple[bytes, str | None]) -> bool:
    return case[1] is None or case[1].isascii()


def http_front_cases() -> st.SearchStrategy[tuple[str, bytes, str | None]]:
    return st.tuples(st.sampled_from(MODELS), http_bodies().filter(_ascii_header)).map(
        lambda t: (t[0], *t[1]))


@dataclass(frozen=True)
class Front:
    name: str
    inputs: Callable[[], st.SearchStrategy[Any]]
    check: Callable[[Client, Any], None]


FRONTS = {f.name: f for f in [
    Front("front_http_v2", http_front_cases, check_http_front),
    Front("front_openai", openai_bodies, check_openai_front),
    Front("front_grpc", lambda: grpc_bodies(st.sampled_from(MODELS)), check_grpc_front),
]}
