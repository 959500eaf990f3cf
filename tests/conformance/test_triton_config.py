"""Model config and metadata, over both protocols: what a client reads through mmguard is what
Triton itself answers, field by field (every model here is served under its own name, so no
field differs). Clients act on these answers — an image client reads ``max_batch_size``, the
input ``format`` and ``dims`` to lay out its batch — so a missing zero or a number turned into
a string is a broken client, not a cosmetic difference."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

from tests.conformance.conftest import Target
from tests.support.triton import DECOUPLED_MODELS, MODEL_NAMES, TritonServer


def served(target: Target) -> list[str]:
    """The models this target serves (mmguard's HTTP backend does not carry decoupled ones)."""
    if target.label == "mmguard-http":
        return [m for m in MODEL_NAMES if m not in DECOUPLED_MODELS]
    return list(MODEL_NAMES)


def get_json(http_url: str, path: str) -> Any:
    with urllib.request.urlopen(f"http://{http_url}{path}", timeout=30) as r:
        assert r.status == 200
        return json.loads(r.read())


# Protobuf maps have no order (Triton's C++ and Python's protobuf iterate them differently).
MAPS = ("parameters", "metric_tags", "cc_model_filenames", "priority_queue_policy",
        "input_map", "output_map")


def assert_same_fields(got: Any, want: Any, where: str = "") -> None:
    """Equal, with the first differing field named (and the field order of messages too: it is
    what a client that prints or hashes the config sees)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {got!r} is not an object"
        if where.rsplit(".", 1)[-1] in MAPS:
            assert sorted(got) == sorted(want), f"{where}: keys {list(got)} != {list(want)}"
        else:
            assert list(got) == list(want), f"{where}: fields {list(got)} != {list(want)}"
        for key in want:
            assert_same_fields(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_fields(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def test_http_config_is_tritons_field_for_field(target: Target, triton: TritonServer) -> None:
    for model in served(target):
        want = get_json(triton.http_url, f"/v2/models/{model}/config")
        got = get_json(target.http_url, f"/v2/models/{model}/config")
        assert_same_fields(got, want, model)


def test_grpc_config_is_tritons_message(target: Target, triton: TritonServer) -> None:
    direct = grpcclient.InferenceServerClient(triton.grpc_url)
    client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        for model in served(target):
            want = direct.get_model_config(model).config
            got = client.get_model_config(model).config
            # Field by field in the readable form first (a failure names the field), then the
            # messages themselves: unknown or extra fields would differ there.
            assert_same_fields(json_format.MessageToDict(got, preserving_proto_field_name=True),
                               json_format.MessageToDict(want, preserving_proto_field_name=True),
                               model)
            assert got == want, model
    finally:
        direct.close()
        client.close()


def test_zero_values_and_int64_dims_as_numbers(target: Target) -> None:
    """The issue's case: max_batch_size 0 and an int64 reshape, as an image client reads them."""
    cfg = get_json(target.http_url, "/v2/models/classify_fp32/config")
    assert cfg["max_batch_size"] == 0 and type(cfg["max_batch_size"]) is int
    probs = cfg["output"][0]
    assert probs["dims"] == [10] and probs["reshape"] == {"shape": [1, 10, 1, 1]}
    assert probs["label_filename"] == "labels.txt"
    x = cfg["input"][0]
    assert x["format"] == "FORMAT_NONE" and x["dims"] == [10] and x["optional"] is False
    batched = get_json(target.http_url, "/v2/models/clip_demo/config")
    assert batched["max_batch_size"] == 8
    assert [i["dims"] for i in batched["input"]] == [[3, 224, 224], [77]]
    # The same facts over gRPC, read as a gRPC image client reads them.
    client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        msg = client.get_model_config("classify_fp32").config
        assert msg.max_batch_size == 0
        assert list(msg.output[0].reshape.shape) == [1, 10, 1, 1]
        assert msg.input[0].format == model_config_pb2.ModelInput.FORMAT_NONE
        assert list(client.get_model_config("clip_demo").config.input[0].dims) == [3, 224, 224]
    finally:
        client.close()


def test_http_metadata_is_tritons(target: Target, triton: TritonServer) -> None:
    for model in served(target):
        want = get_json(triton.http_url, f"/v2/models/{model}")
        got = get_json(target.http_url, f"/v2/models/{model}")
        assert_same_fields(got, want, model)


@pytest.mark.parametrize("model", ["clip_demo", "identity_bytes", "classify_fp32"])
def test_grpc_metadata_is_tritons(target: Target, triton: TritonServer, model: str) -> None:
    direct = grpcclient.InferenceServerClient(triton.grpc_url)
    client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        want = direct.get_model_metadata(model)
        got = client.get_model_metadata(model)
        assert got == want, f"{model}: {got} != {want}"
        # The batch dimension shows as a leading -1 exactly when the model batches.
        leading = [t.shape[0] for t in got.inputs]
        assert (leading == [-1] * len(leading)) == (model != "classify_fp32")
    finally:
        direct.close()
        client.close()


def test_metadata_and_config_of_every_served_model_agree(target: Target) -> None:
    """What one protocol says, the other says too (through mmguard both come from one
    contract; directly, from one Triton)."""
    client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        for model in served(target):
            http_meta = get_json(target.http_url, f"/v2/models/{model}")
            meta = client.get_model_metadata(model, as_json=True)
            assert meta["name"] == http_meta["name"] == model
            assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]])
                    for t in meta["inputs"]] == [(t["name"], t["datatype"], t["shape"])
                                                 for t in http_meta["inputs"]]
            cfg = client.get_model_config(model).config
            http_cfg = get_json(target.http_url, f"/v2/models/{model}/config")
            assert cfg.max_batch_size == http_cfg["max_batch_size"]
    finally:
        client.close()


def _raw(http_url: str, path: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(f"http://{http_url}{path}", timeout=30) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers.get("Content-Type", ""), e.read()


@pytest.mark.parametrize("model", ["identity_fp32", "small_fp32", "clip_text_trunc"])
def test_metadata_answers_are_tritons_bytes(target: Target, triton: TritonServer,
                                            model: str) -> None:
    """Metadata byte for byte, typed as Triton types it; config and statistics compact and
    typed alike (mmguard wrote them spaced, with a charset); a health answer typed
    ``text/plain``, an error ``application/json``."""
    want = _raw(triton.http_url, f"/v2/models/{model}")
    assert want[0] == 200
    assert _raw(target.http_url, f"/v2/models/{model}") == want
    for path in (f"/v2/models/{model}/config", f"/v2/models/{model}/stats",
                 "/v2/health/live", "/v2/models/nope"):
        direct = _raw(triton.http_url, path)
        got = _raw(target.http_url, path)
        assert got[:2] == direct[:2], (path, got[:2], direct[:2])
        assert b'", "' not in got[2] and b'": ' not in got[2], (path, got[2][:120])
