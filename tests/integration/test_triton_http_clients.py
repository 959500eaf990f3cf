"""Triton HTTP infer calls on the lean client (``infer_client: httptools``, the default) and on
aiohttp's session (``infer_client: aiohttp``) give the client the same answers and the same
errors: real Triton behind both, real ``tritonclient`` HTTP and gRPC in front, JSON and binary
tensors, BYTES, a 600 KB body sent in parts, Triton's own refusal."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer

CLIENTS = ("httptools", "aiohttp")
MODELS = ("identity_fp32", "identity_bytes", "pixel_identity", "small_fp32")


@pytest.fixture(scope="module")
def proxy(triton: TritonServer) -> Iterator[RunningMmguard]:
    backends = [{"kind": "triton_http", "name": f"t-{c}", "url": triton.http_url,
                 "infer_client": c} for c in CLIENTS]
    models = [{"name": f"{c}_{m}", "backend": f"t-{c}", "backend_model": m}
              for c in CLIENTS for m in MODELS]
    with RunningMmguard({"backends": backends, "models": models}) as m:
        m.wait_ready()
        yield m


def _inputs(model: str, lib: Any, binary: bool) -> list[Any]:
    rng = np.random.default_rng(7)
    data: np.ndarray[Any, Any]
    if model == "identity_bytes":
        odd = b"\x00\xffbinary" if binary else b"tab\there"  # JSON carries UTF-8 text only
        data = np.array([[b"a", odd, "é".encode()]], dtype=np.object_)
        name, dtype = "INPUT0", "BYTES"
    elif model == "pixel_identity":
        data, name, dtype = rng.random((1, 3, 224, 224), dtype=np.float32), "pixel_values", "FP32"
    elif model == "small_fp32":
        data, name, dtype = rng.random((1, 16), dtype=np.float32), "x", "FP32"
    else:
        data, name, dtype = rng.random((2, 5), dtype=np.float32), "INPUT0", "FP32"
    t = lib.InferInput(name, list(data.shape), dtype)
    if lib is httpclient:
        t.set_data_from_numpy(data, binary_data=binary)
    else:
        t.set_data_from_numpy(data)
    return [t]


def _call(proxy: RunningMmguard, front: str, route: str, model: str, binary: bool
          ) -> dict[str, Any]:
    if front == "http":
        h = httpclient.InferenceServerClient(proxy.http_url)
        r = h.infer(route, _inputs(model, httpclient, binary))
        out = r.get_response()
    else:
        g = grpcclient.InferenceServerClient(proxy.grpc_url)
        r = g.infer(route, _inputs(model, grpcclient, binary))
        out = r.get_response(as_json=True)
    return {"outputs": {o["name"]: r.as_numpy(o["name"]).tolist() for o in out["outputs"]},
            "shapes": [list(map(int, o["shape"])) for o in out["outputs"]],
            "datatypes": [o["datatype"] for o in out["outputs"]]}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("front, binary", [("http", True), ("http", False), ("grpc", True)])
def test_both_clients_give_the_same_answer(proxy: RunningMmguard, model: str, front: str,
                                           binary: bool) -> None:
    lean, session = (_call(proxy, front, f"{c}_{model}", model, binary) for c in CLIENTS)
    assert lean == session
    assert lean["outputs"]  # something was compared


@pytest.mark.parametrize("front", ["http", "grpc"])
def test_both_clients_pass_on_tritons_own_refusal(proxy: RunningMmguard, front: str) -> None:
    seen = []
    for c in CLIENTS:
        lib: Any = httpclient if front == "http" else grpcclient
        client = lib.InferenceServerClient(proxy.http_url if front == "http" else proxy.grpc_url)
        t = lib.InferInput("not_an_input", [1, 16], "FP32")
        t.set_data_from_numpy(np.zeros((1, 16), np.float32))
        with pytest.raises(InferenceServerException) as err:
            client.infer(f"{c}_small_fp32", [t])
        seen.append((err.value.status(), err.value.message()))
    assert seen[0] == seen[1]
    assert "not_an_input" in seen[0][1]
