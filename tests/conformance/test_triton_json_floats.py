"""Float tensors in JSON answers, byte for byte as Triton writes them: the same request sent to
Triton and through mmguard on both backends (over ``triton_grpc`` mmguard writes the JSON
itself; over ``triton_http`` it forwards Triton's), for values across the whole float32 range
and the cases whose text Python writes differently (``1e-07`` for Triton's ``1e-7``, shortest
digits where Grisu2 keeps one more), and the same for generate answers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from proxy.wire import json_floats
from tests.conformance.conftest import Target
from tests.support.triton import TritonServer
from tests.support.wire import http_post

SEEN = [1.0000000116860974e-7, 1.0000000200408773e20, 1.4999999621068127e-05,
        9.313225746154786e-10, 3.4028234663852887e38, 1.5, 2.0, 7.0, 0.0, -0.0, 1e-3, 0.1,
        -2.5e-8, 123456.789, 1e21, 1e22, 2.0 ** -30, 2.0 ** -126, 2.0 ** -149, 16777216.0]


def _values(seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    spread = (rng.standard_normal(400) * 10.0 ** rng.uniform(-12, 12, 400)).astype(np.float32)
    small = rng.uniform(0, 2e-3, 200).astype(np.float32)  # probabilities, embedding entries
    bits = rng.integers(0, 2 ** 32, 400, dtype=np.uint64).astype(np.uint32).view(np.float32)
    every = np.concatenate([np.array(SEEN, np.float32), spread, small,
                            bits[np.isfinite(bits)]])
    return [float(v) for v in every]


def _doc(values: list[float]) -> bytes:
    return json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, len(values)],
                                   "data": values}]}).encode()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_json_answer_writes_floats_as_triton_does(triton: TritonServer, target: Target,
                                                    seed: int) -> None:
    body = _doc(_values(seed))
    direct = http_post(triton.http_url, "/v2/models/identity_fp32/infer", body)
    status, _, answer = http_post(target.http_url, "/v2/models/identity_fp32/infer", body)
    assert direct[0] == status == 200
    assert answer == direct[2]


def test_a_generate_answer_writes_floats_as_triton_does(triton: TritonServer,
                                                        target: Target) -> None:
    for values in (_values(2), [2.0 ** -30]):
        body = json.dumps({"INPUT0": values}).encode()
        direct = http_post(triton.http_url, "/v2/models/identity_fp32/generate", body)
        status, _, answer = http_post(target.http_url, "/v2/models/identity_fp32/generate",
                                      body)
        assert direct[0] == status == 200
        assert answer == direct[2]


def test_the_writer_is_the_compiled_one_and_the_fallback_writes_the_same() -> None:
    """Built at install (a CI without a compiler fails here rather than passing on the
    fallback), every value it writes reads back as the same double, and the fallback (the
    same algorithm on Python's integers) writes the same bytes for every value."""
    assert json_floats.native is not None
    values = np.concatenate([np.array(_values(3), np.float64),
                             np.random.default_rng(4).standard_normal(500) * 1e200,
                             [5e-324, 2.2250738585072014e-308, 1.7976931348623157e308]])
    text = json_floats.array_text(values)
    assert np.array_equal(np.array(json.loads(text)), values)
    assert text == b"[" + b",".join(json_floats._one(float(v)) for v in values) + b"]"


def test_an_empty_output_asked_in_binary_is_a_json_answer(triton: TritonServer,
                                                          target: Target) -> None:
    """No binary bytes follow: Triton answers plain JSON (no Inference-Header-Content-Length);
    mmguard answered with the header over a gRPC backend (the same body bytes)."""
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 0],
                                   "data": []}],
                       "outputs": [{"name": "OUTPUT0",
                                    "parameters": {"binary_data": True}}]}).encode()
    direct = http_post(triton.http_url, "/v2/models/identity_fp32/infer", body)
    status, headers, answer = http_post(target.http_url, "/v2/models/identity_fp32/infer", body)
    assert direct[0] == status == 200
    assert answer == direct[2]
    assert ("Inference-Header-Content-Length" in headers) is \
        ("Inference-Header-Content-Length" in direct[1])
    assert headers["Content-Type"].split(";")[0] == direct[1]["Content-Type"].split(";")[0]
