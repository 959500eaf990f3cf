"""A KServe v2 JSON body read one way by mmguard's filters and another by Triton: a request
judged is not the request run. Real Triton, both backends (``g_``: mmguard re-encodes the
request for gRPC; ``h_``: mmguard forwards the body it did not change, as its bytes).

- A key repeated in one object: Triton reads the first (rapidjson), so mmguard does too. It
  read the last: ``{"inputs": [batch 8], "inputs": [batch 1]}`` passed ``limits.max_batch: 1``
  while Triton ran batch 8 (``h_``), and the gRPC backend ran batch 1 where Triton runs 8.
- A value of another JSON type than Triton reads (``proxy/wire/triton_json.py``): Triton refuses
  it; mmguard converted it for the gRPC backend (BOOL ``"false"`` ran as true, FP32 ``"nan"``
  as NaN, INT64 ``1e3`` as 1000) and forwarded it to the HTTP one (refused there). Now both
  routes refuse it before any filter, with Triton's words first.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.conftest import triton_routes
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.wire import http_post


def _one(datatype: str, data: list[object], **request: object) -> bytes:
    return json.dumps({"inputs": [{"name": "INPUT0", "datatype": datatype,
                                   "shape": [1, len(data)], "data": data}],
                       **request}).encode()


MISTYPED = {  # case: (model, body)
    "bool-as-string": ("identity_bool", _one("BOOL", ["false", "0"])),
    "fp32-as-string": ("identity_fp32", _one("FP32", ["1", 2.0])),
    "fp32-as-bool": ("identity_fp32", _one("FP32", [True, 2.0])),
    "int64-as-exponent": ("identity_int64", _one("INT64", [1, 1e3])),
    "int64-as-double": ("identity_int64", _one("INT64", [9007199254740993.0])),
    "bytes-as-number": ("identity_bytes", _one("BYTES", [5, "a"])),
    "fp16-in-json": ("identity_fp16", _one("FP16", [0.5, 1.0])),
    "id-as-number": ("identity_fp32", _one("FP32", [1.0], id=123)),
    "binary-output-as-string": ("identity_fp32", _one(
        "FP32", [1.0], parameters={"binary_data_output": "true"})),
    "binary-data-as-number": ("identity_fp32", _one(
        "FP32", [1.0], outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": 1}}])),
}


def _tensor(rows: int) -> str:
    return json.dumps({"name": "INPUT0", "datatype": "FP32", "shape": [rows, 2],
                       "data": [float(i) for i in range(rows * 2)]})


TWICE = f'{{"inputs": [{_tensor(8)}], "inputs": [{_tensor(1)}]}}'.encode()
"""Batch 8 first, batch 1 second: Triton runs batch 8."""


@pytest.fixture(scope="module")
def proxy(triton: TritonServer) -> Iterator[RunningMmguard]:
    cfg = triton_routes(triton, ["identity_fp32", "identity_bool", "identity_int64",
                                 "identity_bytes", "identity_fp16"])
    cfg["models"] += [{**route, "name": f"lim_{route['name']}",
                       "filters": [{"limits": {"max_batch": 1}}]}
                      for route in list(cfg["models"]) if "fp32" in route["name"]]
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        yield m


def test_triton_reads_the_first_of_a_repeated_key(triton: TritonServer) -> None:
    """The premise, on the real server."""
    status, _, body = http_post(triton.http_url, "/v2/models/identity_fp32/infer", TWICE)
    assert status == 200, body
    assert json.loads(body)["outputs"][0]["shape"] == [8, 2]


@pytest.mark.parametrize("route", ["g_identity_fp32", "h_identity_fp32"])
def test_a_repeated_key_means_what_it_means_to_triton(proxy: RunningMmguard,
                                                      triton: TritonServer, route: str) -> None:
    _, _, direct = http_post(triton.http_url, "/v2/models/identity_fp32/infer", TWICE)
    status, _, body = http_post(proxy.http_url, f"/v2/models/{route}/infer", TWICE)
    assert status == 200, body
    assert json.loads(body)["outputs"] == json.loads(direct)["outputs"]


@pytest.mark.parametrize("route", ["lim_g_identity_fp32", "lim_h_identity_fp32"])
def test_a_repeated_key_cannot_hide_a_batch_from_the_limits(proxy: RunningMmguard,
                                                            route: str) -> None:
    status, _, body = http_post(proxy.http_url, f"/v2/models/{route}/infer", TWICE)
    assert status == 413, body
    assert "input 'INPUT0' has batch 8; the limit is 1" in json.loads(body)["error"]


@pytest.mark.parametrize("case", list(MISTYPED))
def test_a_value_of_another_json_type_is_refused_in_tritons_words(
        proxy: RunningMmguard, triton: TritonServer, case: str) -> None:
    """Triton's status for these is 400 or 500 (its JSON reader's errors are INTERNAL);
    mmguard's is 400, a client's mistake (docs/triton-compat.md)."""
    model, body = MISTYPED[case]
    status, _, direct = http_post(triton.http_url, f"/v2/models/{model}/infer", body)
    assert status in (400, 500), direct
    words = json.loads(direct)["error"]
    for route in (f"g_{model}", f"h_{model}"):
        status, _, got = http_post(proxy.http_url, f"/v2/models/{route}/infer", body)
        assert status == 400, (route, got)
        assert json.loads(got)["error"].startswith(words), (route, got, words)
