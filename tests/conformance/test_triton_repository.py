"""The model repository API (index, load, unload), both ways.

Off (the default): both fronts refuse alike, with a reason (gRPC UNIMPLEMENTED, HTTP 501 and a
JSON error), never a bare 404. On (``v2.repository_api``) with the admin token: the same
client calls give what Triton gives directly: a model loaded from files sent in the request
(``file:`` parameters, bytes on gRPC, base64 on HTTP) is ready and answers, and is gone once
unloaded; the index lists what Triton's own lists. Without the token: UNAUTHENTICATED / 401.

The probe models are loaded from files in the request under fresh names, so the shared Triton's
own models are never touched.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conformance.conftest import Target, same_name_routes
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer

TOKEN = "repository-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}  # gRPC metadata keys are lower case
_IDENTITY = Path(__file__).resolve().parents[1] / "support" / "triton_models" / "identity.py"


def _probe_config(name: str) -> str:
    return json.dumps({
        "name": name, "backend": "python", "max_batch_size": 0,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
    })


@pytest.fixture(scope="module")
def repository_proxies(triton: TritonServer) -> Iterator[dict[str, RunningMmguard]]:
    def config(kind: str) -> dict[str, Any]:
        return {**same_name_routes(triton, kind), "v2": {"repository_api": True},
                "listeners": {"admin": {"token": TOKEN}}}

    with RunningMmguard(config("triton_grpc")) as via_grpc, \
            RunningMmguard(config("triton_http")) as via_http:
        via_grpc.wait_ready()
        via_http.wait_ready()
        yield {"mmguard-grpc": via_grpc, "mmguard-http": via_http}


@pytest.fixture(params=["direct", "mmguard-grpc", "mmguard-http"])
def on_target(request: pytest.FixtureRequest, triton: TritonServer,
              repository_proxies: dict[str, RunningMmguard]) -> Target:
    label: str = request.param
    if label == "direct":
        return Target(label, triton.http_url, triton.grpc_url)
    proxy = repository_proxies[label]
    return Target(label, proxy.http_url, proxy.grpc_url, proxy)


def _index(client: Any, protocol: str) -> dict[str, dict[str, str]]:
    if protocol == "grpc":
        raw = client.get_model_repository_index(headers=AUTH, as_json=True).get("models", [])
    else:
        raw = client.get_model_repository_index(headers=AUTH)
    return {m["name"]: {k: v for k, v in m.items() if k != "name"} for m in raw}


def _client(target: Target, protocol: str) -> Any:
    if protocol == "grpc":
        return grpcclient.InferenceServerClient(target.grpc_url)
    return httpclient.InferenceServerClient(target.http_url)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_off_is_the_same_clear_refusal_on_both_fronts(target: Target, protocol: str) -> None:
    client = _client(target, protocol)
    try:
        calls: list[Callable[[], Any]] = [
            lambda: client.get_model_repository_index(),
            lambda: client.load_model("no_such_model"),
            lambda: client.unload_model("no_such_model")]
        outcomes: list[InferenceServerException | None] = []
        for call in calls:
            try:
                call()
                outcomes.append(None)
            except InferenceServerException as refused:  # not `exc`: the loop below reuses it
                outcomes.append(refused)
    finally:
        client.close()
    if not target.via_mmguard:  # Triton: an index, "failed to load", and ok (sic) for unload
        index, load, unload = outcomes
        assert index is None and unload is None
        assert load is not None and "no_such_model" in load.message()
        return
    for exc in outcomes:
        assert exc is not None
        assert "v2.repository_api" in exc.message()
        if protocol == "grpc":
            assert exc.status() == "StatusCode.UNIMPLEMENTED"
        else:
            assert exc.status() == "501"


def test_off_http_refusal_is_json_not_a_bare_404(target: Target) -> None:
    host, port = target.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v2/repository/index", body=b"{}")
        r = conn.getresponse()
        status, body = r.status, r.read()
    finally:
        conn.close()
    if target.via_mmguard:
        assert status == 501
        assert "v2.repository_api: false" in json.loads(body)["error"]
    else:
        assert status == 200 and isinstance(json.loads(body), list)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_on_with_token_load_index_unload(on_target: Target, triton: TritonServer,
                                         protocol: str) -> None:
    name = f"repo_probe_{on_target.label.replace('-', '_')}_{protocol}"
    client = _client(on_target, protocol)
    direct = httpclient.InferenceServerClient(triton.http_url)
    data = np.array([1.5, -2.0], dtype=np.float32)
    try:
        before = _index(client, protocol)
        assert before == _index(direct, "http")  # what Triton itself lists, field for field
        assert before["identity_fp32"] == {"version": "1", "state": "READY"}
        client.load_model(name, headers=AUTH, config=_probe_config(name),
                          files={"file:1/model.py": _IDENTITY.read_bytes()})
        assert direct.is_model_ready(name)  # loaded from the files this call carried
        assert _infer_at_triton(triton, name, data).tobytes() == data.tobytes()
        client.unload_model(name, headers=AUTH)
        assert not direct.is_model_ready(name)
        assert _index(client, protocol) == before
    finally:
        client.close()
        direct.close()


def _infer_at_triton(triton: TritonServer, name: str,
                     data: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The probe model is not a mmguard route: ask Triton itself."""
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    t = grpcclient.InferInput("INPUT0", [2], "FP32")
    t.set_data_from_numpy(data)
    try:
        result: np.ndarray[Any, Any] = client.infer(name, [t]).as_numpy("OUTPUT0")
        return result
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_on_without_token_is_unauthenticated(repository_proxies: dict[str, RunningMmguard],
                                             protocol: str) -> None:
    proxy = repository_proxies["mmguard-grpc"]
    target = Target("mmguard-grpc", proxy.http_url, proxy.grpc_url, proxy)
    client = _client(target, protocol)
    try:
        for headers in (None, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
            with pytest.raises(InferenceServerException) as err:
                client.unload_model("identity_fp32", headers=headers)
            assert "admin token" in err.value.message()
            assert err.value.status() == ("StatusCode.UNAUTHENTICATED" if protocol == "grpc"
                                          else "401")
    finally:
        client.close()
    assert proxy.server is not None
    # Nothing reached Triton: the model the refused calls named still serves.
    direct = grpcclient.InferenceServerClient(
        proxy.server.config.backends[0].url)  # type: ignore[union-attr]  # a Triton backend
    try:
        assert direct.is_model_ready("identity_fp32")
    finally:
        direct.close()
