"""Server metadata: clients that check for Triton (name, version, extensions) keep working
through a single-backend mmguard, which announces itself in its own extension (``mmguard``)
and a ``mmguard-version`` header / gRPC metadata. ``v2.server_metadata: mmguard`` gives
mmguard's own answer instead.

Intended differences from direct: extensions mmguard refuses (``cuda_shared_memory``,
``trace``, ``logging``, and ``model_repository`` while the repository API is off) are not
announced on the backend's behalf, and ``mmguard`` is added.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from proxy import __version__
from proxy.pb import grpc_service_pb2 as pb
from proxy.pb import grpc_service_pb2_grpc as pb_grpc
from tests.conformance.conftest import Target, same_name_routes
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer

NOT_ON_BEHALF = {"cuda_shared_memory", "trace", "logging", "model_repository",
                 "model_repository(unload_dependents)"}


def _metadata(target: Target) -> list[dict[str, Any]]:
    http = httpclient.InferenceServerClient(target.http_url)
    grpc_client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        return [http.get_server_metadata(),
                grpc_client.get_server_metadata(as_json=True)]
    finally:
        http.close()
        grpc_client.close()


def test_backend_metadata_through_mmguard(target: Target, triton: TritonServer) -> None:
    direct = httpclient.InferenceServerClient(triton.http_url)
    try:
        truth = direct.get_server_metadata()
    finally:
        direct.close()
    assert truth["name"] == "triton"
    for meta in _metadata(target):
        assert meta["name"] == truth["name"]
        assert meta["version"] == truth["version"]
        extensions = set(meta["extensions"])
        if not target.via_mmguard:
            assert extensions == set(truth["extensions"])
            continue
        assert "mmguard" in extensions
        assert extensions - {"mmguard"} == set(truth["extensions"]) - NOT_ON_BEHALF
        assert {"classification", "sequence", "binary_tensor_data"} <= extensions


def _raw_http_metadata(url: str) -> tuple[dict[str, str], dict[str, Any]]:
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/v2")
        r = conn.getresponse()
        assert r.status == 200
        return {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    finally:
        conn.close()


def _grpc_initial_metadata(url: str) -> dict[str, str]:
    with grpc.insecure_channel(url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        _, call = stub.ServerMetadata.with_call(pb.ServerMetadataRequest(), timeout=30)
        return {k: v for k, v in call.initial_metadata() if isinstance(v, str)}


def test_mmguard_announces_itself(target: Target) -> None:
    headers, _ = _raw_http_metadata(target.http_url)
    grpc_meta = _grpc_initial_metadata(target.grpc_url)
    if not target.via_mmguard:
        assert "mmguard-version" not in headers and "mmguard-version" not in grpc_meta
        return
    assert headers["mmguard-version"] == grpc_meta["mmguard-version"] == __version__
    assert headers["mmguard-server-metadata"] == "backend 'triton'"


@pytest.fixture(scope="module")
def own_metadata_proxy(triton: TritonServer) -> Iterator[RunningMmguard]:
    config = {**same_name_routes(triton, "triton_grpc"), "v2": {"server_metadata": "mmguard"}}
    with RunningMmguard(config) as proxy:
        yield proxy


def test_mmguard_mode_gives_mmguards_own(own_metadata_proxy: RunningMmguard) -> None:
    target = Target("mmguard-grpc", own_metadata_proxy.http_url, own_metadata_proxy.grpc_url,
                    own_metadata_proxy)
    for meta in _metadata(target):
        assert meta["name"] == "mmguard"
        assert meta["version"] == __version__
        assert "model_repository" not in meta["extensions"]
        assert "binary_tensor_data" in meta["extensions"]
    headers, _ = _raw_http_metadata(target.http_url)
    assert headers["mmguard-server-metadata"] == "mmguard"


def test_unreachable_backend_falls_back_and_says_so(triton: TritonServer) -> None:
    """A backend that does not answer: mmguard's own metadata, the header saying why."""
    config = {"backends": [{"kind": "triton_http", "name": "gone", "url": "127.0.0.1:9"}],
              "models": [{"name": "identity_fp32", "backend": "gone"}]}
    with RunningMmguard(config) as proxy:
        headers, meta = _raw_http_metadata(proxy.http_url)
    assert meta["name"] == "mmguard"
    assert headers["mmguard-server-metadata"].startswith("mmguard (backend 'gone' did not "
                                                         "answer")


def test_unknown_model_is_clear_and_lists_nothing(target: Target) -> None:
    """Both fronts refuse an unknown model as Triton does (not found; statistics: invalid
    argument), in Triton's words, without listing the models served to whoever asks."""
    http = httpclient.InferenceServerClient(target.http_url)
    grpc_client = grpcclient.InferenceServerClient(target.grpc_url)
    t_http = httpclient.InferInput("INPUT0", [1], "FP32")
    t_http.set_data_from_numpy(np.zeros(1, dtype=np.float32))
    t_grpc = grpcclient.InferInput("INPUT0", [1], "FP32")
    t_grpc.set_data_from_numpy(np.zeros(1, dtype=np.float32))
    unknown = "Request for unknown model: 'no_such_model' is not found"
    calls: list[tuple[Callable[[], Any], str, str]] = [
        (lambda: http.infer("no_such_model", [t_http]), "404", unknown),
        (lambda: grpc_client.infer("no_such_model", [t_grpc]), "StatusCode.NOT_FOUND", unknown),
        (lambda: http.get_model_metadata("no_such_model"), "404", unknown),
        (lambda: grpc_client.get_model_metadata("no_such_model"), "StatusCode.NOT_FOUND",
         unknown),
        (lambda: grpc_client.get_inference_statistics("no_such_model"),
         "StatusCode.INVALID_ARGUMENT", "requested model 'no_such_model' is not available")]
    try:
        for call, status, says in calls:
            with pytest.raises(InferenceServerException) as err:
                call()
            message = err.value.message()
            assert err.value.status() == status and says in message, message
            assert "identity_fp32" not in message and "serving" not in message
    finally:
        http.close()
        grpc_client.close()


@pytest.mark.parametrize("asked", ["", "1"])
def test_statistics_entry_names_the_version_as_triton_writes_it(target: Target,
                                                                 asked: str) -> None:
    """Each entry's ``version`` is the model's (Triton writes "1" when none was asked; mmguard
    wrote ""), on both fronts, for one model and for all."""
    http = httpclient.InferenceServerClient(target.http_url)
    grpc_client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        one = http.get_inference_statistics("small_fp32", asked)["model_stats"]
        assert [(m["name"], m["version"]) for m in one] == [("small_fp32", "1")]
        got = grpc_client.get_inference_statistics("small_fp32", asked).model_stats
        assert [(m.name, m.version) for m in got] == [("small_fp32", "1")]
        if not asked:
            every = http.get_inference_statistics()["model_stats"]
            assert {m["version"] for m in every if m["name"] == "small_fp32"} == {"1"}
    finally:
        http.close()
        grpc_client.close()
