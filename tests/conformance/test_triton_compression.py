"""Compressed HTTP bodies, as ``tritonclient.http`` sends and asks for them: gzip and deflate
request bodies (``request_compression_algorithm``) and compressed answers
(``response_compression_algorithm``), JSON and binary tensors, the same direct and through
mmguard. Before the fix every compressed request got 400 "not a gzipped file" through mmguard
(aiohttp had inflated the body already and the front inflated it again)."""

from __future__ import annotations

import gzip
import http.client
import json
import zlib
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient

from tests.conformance.conftest import Target
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer

CODINGS = [None, "gzip", "deflate"]


def _infer(url: str, data: np.ndarray[Any, Any], binary: bool, request: str | None,
           response: str | None) -> np.ndarray[Any, Any]:
    client = httpclient.InferenceServerClient(url)
    try:
        tensor = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data, binary_data=binary)
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
        result = client.infer("identity_fp32", [tensor], outputs=[out],
                              request_compression_algorithm=request,
                              response_compression_algorithm=response)
        got: np.ndarray[Any, Any] | None = result.as_numpy("OUTPUT0")
        assert got is not None
        return got
    finally:
        client.close()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("response", CODINGS, ids=lambda c: f"answer-{c}")
@pytest.mark.parametrize("request_coding", CODINGS, ids=lambda c: f"body-{c}")
def test_compressed_bodies_and_answers(target: Target, request_coding: str | None,
                                       response: str | None, binary: bool) -> None:
    data = np.arange(3000, dtype=np.float32).reshape(1, 3000) / 7
    got = _infer(target.http_url, data, binary, request_coding, response)
    assert got.dtype == np.float32
    assert got.tobytes() == data.tobytes()


def _raw_post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str],
                                                                       bytes]:
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v2/models/identity_fp32/infer", body=body, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_answer_is_compressed_when_asked(target: Target, coding: str) -> None:
    """What the wire carries: a Content-Encoding the client asked for, a body that inflates to
    the same JSON answer Triton gives."""
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 512],
                                   "data": [0.5] * 512}]}).encode()
    status, headers, raw = _raw_post(target.http_url, body, {"Accept-Encoding": coding})
    assert status == 200, raw[:300]
    assert headers.get("content-encoding") == coding
    plain = gzip.decompress(raw) if coding == "gzip" else zlib.decompress(raw)
    answer = json.loads(plain)
    assert answer["outputs"][0]["data"] == [0.5] * 512


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_corrupt_body_never_becomes_data(target: Target, coding: str) -> None:
    """Not gzip/deflate at all. Triton 2.51 answers 200 with an empty tensor (it inflates to
    nothing); mmguard refuses with 400 naming the encoding (an intended difference: a guard
    must not turn a broken request into an answer)."""
    status, _, raw = _raw_post(target.http_url, b"certainly not compressed",
                               {"Content-Encoding": coding, "Content-Type": "application/json"})
    if target.via_mmguard:
        assert status == 400
        assert f"not valid {coding}" in json.loads(raw)["error"]
    else:
        assert status != 200 or json.loads(raw)["outputs"][0]["shape"] == [1, 0]


@pytest.mark.parametrize("coding", ["br", "GZIP", "Deflate"])
def test_unsupported_encoding_is_501(target: Target, coding: str) -> None:
    """Triton matches the coding's name exactly: ``GZIP`` is none of its codings (mmguard
    inflated it)."""
    body = gzip.compress(b'{"inputs": []}')
    status, _, raw = _raw_post(target.http_url, body, {"Content-Encoding": coding})
    assert status == 501
    assert json.loads(raw)["error"].startswith("Unsupported compression type")


@pytest.mark.parametrize("accept", [
    "gzip;q=0.5, deflate", "GZIP", "gzip;q=0.000", "gzip;q=0", "identity, gzip;q=0.1",
    "*;q=0.9, gzip;q=0.1", "gzip; q=0.5", "gzip;level=1", "deflate;q=abc, gzip", "x-gzip",
    "deflate;q=0, gzip", "  gzip", "gzip;q=0.7, deflate;q=0.7", "deflate, gzip"])
def test_the_answer_coding_is_chosen_as_triton_chooses_it(triton: TritonServer, target: Target,
                                                         accept: str) -> None:
    """By weight, then order; names matched exactly; an unreadable weight drops its part.
    mmguard took the first gzip or deflate listed, in any case, whatever its weight."""
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 512],
                                   "data": [0.5] * 512}]}).encode()
    direct = _raw_post(triton.http_url, body, {"Accept-Encoding": accept})
    status, headers, _ = _raw_post(target.http_url, body, {"Accept-Encoding": accept})
    assert direct[0] == status == 200
    assert headers.get("content-encoding") == direct[1].get("content-encoding")


async def test_aio_client_compressed(target: Target) -> None:
    client = aiohttpclient.InferenceServerClient(target.http_url)
    try:
        data = np.linspace(-1, 1, 1000, dtype=np.float32).reshape(1, 1000)
        tensor = aiohttpclient.InferInput("INPUT0", [1, 1000], "FP32")
        tensor.set_data_from_numpy(data)
        result = await client.infer("identity_fp32", [tensor],
                                    request_compression_algorithm="deflate",
                                    response_compression_algorithm="gzip")
        got = result.as_numpy("OUTPUT0")
        assert got is not None and got.tobytes() == data.tobytes()
    finally:
        await client.close()


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_grpc_compressed_messages(target: Target, coding: str) -> None:
    """gRPC message compression (``compression_algorithm``): gRPC inflates it itself, within
    the listener's message limit; the answer is the same."""
    client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        data = np.arange(4096, dtype=np.float32).reshape(1, 4096)
        tensor = grpcclient.InferInput("INPUT0", [1, 4096], "FP32")
        tensor.set_data_from_numpy(data)
        result = client.infer("identity_fp32", [tensor], compression_algorithm=coding)
        got = result.as_numpy("OUTPUT0")
        assert got is not None and got.tobytes() == data.tobytes()
    finally:
        client.close()


def test_a_weight_past_a_double_is_dropped_and_never_reaches_triton(
        triton: TritonServer, conformance_proxies: dict[str, RunningMmguard]) -> None:
    """``Accept-Encoding: gzip;q=1e999`` aborts Triton 2.51 (SIGABRT: seen here, once per
    request that carries it). mmguard reads the header itself (``std::stod``'s out-of-range
    drops the part, as Triton means to) and never forwards it: the answer is uncompressed and
    Triton lives."""
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                                   "data": [0.5] * 4}]}).encode()
    for proxy in conformance_proxies.values():
        status, headers, raw = _raw_post(proxy.http_url, body, {"Accept-Encoding": "gzip;q=1e999"})
        assert status == 200 and "content-encoding" not in headers, raw[:200]
    assert triton.is_running()
