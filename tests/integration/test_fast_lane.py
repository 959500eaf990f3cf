"""The HTTP listener's fast lane (``proxy.process.fast_lane``) against aiohttp's path, on one
real ONNX Runtime backend: the same raw requests sent to a mmguard with the lane and to one
without it get the same answers (status, headers but ``Date``, body, byte for byte); the lane
serves the plain infer requests and hands every other request, with its connection, to
aiohttp; pipelined, keep-alive, ``Connection: close`` and ``100-continue`` requests are
answered as HTTP/1.1 says."""

from __future__ import annotations

import gzip
import json
import socket
import struct
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ort_config
from tests.support.mmguard import RunningMmguard

JSON_BODY = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [3],
                                    "data": [1.0, 2.5, -4.0]}]}).encode()


def _binary_body() -> tuple[bytes, int]:
    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4],
                                     "parameters": {"binary_data_size": 16}}],
                         "outputs": [{"name": "OUTPUT0",
                                      "parameters": {"binary_data": True}}]}).encode()
    return header + struct.pack("<4f", 1, 2, 3, 4), len(header)


def _post(path: str, body: bytes, *extra: str, version: str = "HTTP/1.1",
          content_type: str = "application/json") -> bytes:
    lines = [f"POST {path} {version}", "Host: 127.0.0.1", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


BINARY, JSON_PART = _binary_body()
CASES: dict[str, bytes] = {
    "json": _post("/v2/models/identity_fp32/infer", JSON_BODY),
    "binary": _post("/v2/models/identity_fp32/infer", BINARY,
                    f"Inference-Header-Content-Length: {JSON_PART}",
                    content_type="application/octet-stream"),
    "version": _post("/v2/models/identity_fp32/versions/1/infer", JSON_BODY),
    "query": _post("/v2/models/identity_fp32/infer?x=1", JSON_BODY),
    "gzip body": _post("/v2/models/identity_fp32/infer", gzip.compress(JSON_BODY),
                       "Content-Encoding: gzip"),
    "gzip answer": _post("/v2/models/identity_fp32/infer", JSON_BODY,
                         "Accept-Encoding: gzip"),
    "bad json": _post("/v2/models/identity_fp32/infer", b'{"inputs": ['),
    "unknown model": _post("/v2/models/no_such_model/infer", JSON_BODY),
    "wrong datatype": _post("/v2/models/identity_fp32/infer", JSON_BODY.replace(
        b'"FP32"', b'"INT8"')),
    "bad timeout": _post("/v2/models/identity_fp32/infer", JSON_BODY,
                         "mmguard-timeout-ms: soon"),
    "header length too big": _post("/v2/models/identity_fp32/infer", BINARY,
                                   "Inference-Header-Content-Length: 99999999"),
    "brotli": _post("/v2/models/identity_fp32/infer", JSON_BODY, "Content-Encoding: br"),
    "json over its limit": _post("/v2/models/identity_fp32/infer", b" " * 5000 + JSON_BODY),
    "http/1.0": _post("/v2/models/identity_fp32/infer", JSON_BODY, version="HTTP/1.0"),
    "chunked": (b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: a\r\nContent-Type: "
                b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                + f"{len(JSON_BODY):x}".encode() + b"\r\n" + JSON_BODY + b"\r\n0\r\n\r\n"),
    "percent-escaped": _post("/v2/models/identity%5Ffp32/infer", JSON_BODY),
    "health": b"GET /v2/health/ready HTTP/1.1\r\nHost: a\r\n\r\n",
    "metadata": b"GET /v2/models/identity_fp32 HTTP/1.1\r\nHost: a\r\n\r\n",
}
LANE_SERVES = {"json", "binary", "version", "query", "gzip body", "gzip answer", "bad json",
               "unknown model", "wrong datatype", "bad timeout"}


class Answers:
    """HTTP/1.1 answers read off one socket, in order (Content-Length framed)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> bool:
        chunk = self.sock.recv(1 << 16)
        self.buffer += chunk
        return bool(chunk)

    def next(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            assert self._fill(), f"closed before an answer's head: {self.buffer[:200]!r}"
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        first, *lines = head.decode().split("\r\n")
        headers = {k.lower(): v for k, v in (ln.split(": ", 1) for ln in lines)}
        length = int(headers.get("content-length", "0"))
        if first.split()[1] == "100":
            return 100, headers, b""
        while len(self.buffer) < length:
            assert self._fill(), "closed before an answer's body"
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(first.split()[1]), headers, body

    def closed(self, within_s: float = 10.0) -> bool:
        self.sock.settimeout(within_s)
        try:
            return self.buffer == b"" and self.sock.recv(1) == b""
        except (TimeoutError, ConnectionResetError):
            return False


def _connect(m: RunningMmguard) -> socket.socket:
    host, port = m.http_url.split(":")
    return socket.create_connection((host, int(port)), timeout=20)


def _ask(m: RunningMmguard, request: bytes) -> tuple[int, dict[str, str], bytes]:
    with _connect(m) as s:
        s.sendall(request)
        return Answers(s).next()


def _lane_counts(m: RunningMmguard) -> dict[str, float]:
    text = urllib.request.urlopen(m.admin_url + "/metrics", timeout=10).read().decode()
    prefix = "mmguard_http_fast_lane_requests_total{outcome=\""
    return {ln[len(prefix):].split('"')[0]: float(ln.split()[-1])
            for ln in text.splitlines() if ln.startswith(prefix)}


@pytest.fixture(scope="module")
def pair(ort_models: Path) -> Iterator[tuple[RunningMmguard, RunningMmguard]]:
    http = {"max_json_bytes": 4096}
    with RunningMmguard(ort_config(ort_models, listeners={"http": http})) as lane, \
            RunningMmguard(ort_config(ort_models, listeners={
                "http": {**http, "fast_lane": False}})) as plain:
        lane.wait_ready()
        plain.wait_ready()
        yield lane, plain


@pytest.mark.parametrize("case", list(CASES))
def test_the_lane_answers_as_aiohttp_does(pair: tuple[RunningMmguard, RunningMmguard],
                                          case: str) -> None:
    lane, plain = pair
    before = _lane_counts(lane)
    got, want = _ask(lane, CASES[case]), _ask(plain, CASES[case])
    assert got[0] == want[0], (got, want)
    assert {k: v for k, v in got[1].items() if k != "date"} == \
        {k: v for k, v in want[1].items() if k != "date"}
    assert got[2] == want[2]
    after = _lane_counts(lane)
    served = after.get("served", 0) - before.get("served", 0)
    handed = after.get("handed_over", 0) - before.get("handed_over", 0)
    assert (served, handed) == ((1, 0) if case in LANE_SERVES else (0, 1)), (served, handed)
    if case in ("json", "gzip body"):
        assert got[0] == 200 and json.loads(got[2])["outputs"][0]["data"] == [1.0, 2.5, -4.0]
    if case == "gzip answer":
        assert got[1]["content-encoding"] == "gzip"
        assert json.loads(gzip.decompress(got[2]))["outputs"][0]["data"] == [1.0, 2.5, -4.0]
    if case == "binary":
        assert struct.unpack("<4f", got[2][int(got[1]["inference-header-content-length"]):]) \
            == (1, 2, 3, 4)


def test_pipelined_requests_are_answered_in_order(
        pair: tuple[RunningMmguard, RunningMmguard]) -> None:
    lane, _ = pair
    bodies = [json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1],
                                      "data": [float(i)]}]}).encode() for i in range(5)]
    with _connect(lane) as s:
        s.sendall(b"".join(_post("/v2/models/identity_fp32/infer", b) for b in bodies))
        answers = Answers(s)
        values = [json.loads(answers.next()[2])["outputs"][0]["data"][0] for _ in bodies]
    assert values == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_connection_moves_to_aiohttp_mid_way_and_keeps_serving(
        pair: tuple[RunningMmguard, RunningMmguard]) -> None:
    """Infer on the lane, a health probe (aiohttp's), infer again: one connection, three
    answers; the last infer is aiohttp's (the connection stays where it was handed)."""
    lane, _ = pair
    before = _lane_counts(lane)
    with _connect(lane) as s:
        answers = Answers(s)
        for request, status in ((CASES["json"], 200), (CASES["health"], 200),
                                (CASES["json"], 200)):
            s.sendall(request)
            assert answers.next()[0] == status
    after = _lane_counts(lane)
    assert after["served"] - before.get("served", 0) == 1
    assert after["handed_over"] - before.get("handed_over", 0) == 1


def test_connection_close_and_http_10_end_the_connection(
        pair: tuple[RunningMmguard, RunningMmguard]) -> None:
    lane, _ = pair
    with _connect(lane) as s:
        s.sendall(_post("/v2/models/identity_fp32/infer", JSON_BODY, "Connection: close"))
        answers = Answers(s)
        status, headers, _ = answers.next()
        assert status == 200 and headers["connection"] == "close"
        assert answers.closed()


def test_expect_100_continue_gets_its_interim_answer(
        pair: tuple[RunningMmguard, RunningMmguard]) -> None:
    lane, _ = pair
    request = _post("/v2/models/identity_fp32/infer", JSON_BODY, "Expect: 100-continue")
    head, body = request.split(b"\r\n\r\n", 1)
    with _connect(lane) as s:
        s.sendall(head + b"\r\n\r\n")
        answers = Answers(s)
        assert answers.next()[0] == 100
        s.sendall(body)
        status, _, answer = answers.next()
    assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [1.0, 2.5, -4.0]


def test_an_idle_keep_alive_connection_closes_at_the_header_timeout(ort_models: Path) -> None:
    http = {"header_timeout_s": 1.0}
    with RunningMmguard(ort_config(ort_models, listeners={"http": http})) as m:
        m.wait_ready()
        with _connect(m) as s:
            s.sendall(CASES["json"])
            answers = Answers(s)
            assert answers.next()[0] == 200
            began = time.monotonic()
            assert answers.closed(within_s=10)
            assert 0.8 <= time.monotonic() - began < 6


def test_a_client_that_leaves_mid_body_frees_its_place(ort_models: Path) -> None:
    """The in-flight count and the busy mark are released: with max_concurrent_requests 1, a
    request after the one abandoned mid-body is served."""
    http = {"max_concurrent_requests": 1}
    with RunningMmguard(ort_config(ort_models, listeners={"http": http})) as m:
        m.wait_ready()
        with _connect(m) as s:
            s.sendall(CASES["json"][:-5])
            time.sleep(0.3)
        time.sleep(0.3)
        assert _ask(m, CASES["json"])[0] == 200


def test_a_client_that_half_closes_after_its_answer_ends_the_connection(
        pair: tuple[RunningMmguard, RunningMmguard]) -> None:
    """Its end of the connection closed between requests: the connection ends at once. (Before
    its answer, HTTP/1.1 reads it as the client's leaving: ``test_client_leaves.py``.)"""
    lane, _ = pair
    with _connect(lane) as s:
        s.sendall(CASES["json"])
        answers = Answers(s)
        status, _, body = answers.next()
        assert status == 200 and json.loads(body)["outputs"][0]["data"] == [1.0, 2.5, -4.0]
        s.shutdown(socket.SHUT_WR)
        assert answers.closed(within_s=3)


def test_after_a_408_the_rest_of_the_body_is_dropped_unread(ort_models: Path) -> None:
    """A body too slow gets one 408 and the connection's end: what the client sends after it
    is neither parsed as a next request nor answered."""
    http = {"body_timeout_s": 2.0, "min_body_bytes_per_s": 0}
    with RunningMmguard(ort_config(ort_models, listeners={"http": http})) as m:
        m.wait_ready()
        with _connect(m) as s:
            s.sendall(b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: a\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
            answers = Answers(s)
            status, headers, body = answers.next()
            assert status == 408 and headers["connection"] == "close"
            assert "listeners.http.body_timeout_s (2 s;" in json.loads(body)["error"]
            try:
                s.sendall(b"x" * 40000)  # the rest of a body, with no head in it
            except OSError:
                pass  # already closed: as good
            assert answers.closed(within_s=5)
        assert _lane_counts(m).get("handed_over", 0) == 0  # not read as a head for aiohttp
