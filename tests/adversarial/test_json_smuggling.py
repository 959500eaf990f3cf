"""A KServe v2 JSON body read one way by mmguard's filters and another by Triton: a request
judged is not the request run. Real Triton, both backends (``g_``: mmguard re-encodes the
request for gRPC; ``h_``: mmguard forwards the body it did not change, as its bytes).

- A key repeated in one object: Triton reads the first (rapidjson), so mmguard does too. It
  read the last: ``{"inputs": [batch 8], "inputs": [batch 1]}`` passed ``limits.max_batch: 1``
  while Triton ran batch 8 (``h_``), and the gRPC backend ran batch 1 where Triton runs 8.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.conftest import triton_routes
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.wire import http_post


def _tensor(rows: int) -> str:
    return json.dumps({"name": "INPUT0", "datatype": "FP32", "shape": [rows, 2],
                       "data": [float(i) for i in range(rows * 2)]})


TWICE = f'{{"inputs": [{_tensor(8)}], "inputs": [{_tensor(1)}]}}'.encode()
"""Batch 8 first, batch 1 second: Triton runs batch 8."""


@pytest.fixture(scope="module")
def proxy(triton: TritonServer) -> Iterator[RunningMmguard]:
    cfg = triton_routes(triton, ["identity_fp32"])
    cfg["models"] += [{**route, "name": f"lim_{route['name']}",
                       "filters": [{"limits": {"max_batch": 1}}]}
                      for route in list(cfg["models"])]
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
