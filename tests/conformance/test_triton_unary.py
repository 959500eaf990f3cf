"""Unary inference with Triton's own Python clients — sync and asyncio, gRPC and HTTP, JSON and
binary tensors — directly and through mmguard, with the same assertions: the answer's bytes,
datatype and shape, the request id echoed, the outputs asked for (and only those), and the
request parameters as the model itself sees them."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from numpy.typing import NDArray
from tritonclient.utils import InferenceServerException

from proxy.pb import grpc_service_pb2 as pb
from tests.conformance.conftest import Target
from tests.support.triton import TritonServer

PAYLOADS: dict[str, NDArray[Any]] = {
    "FP32": np.array([[1.5, -0.0, np.inf, 3.25e-38]], np.float32),
    "FP16": np.array([[1.5, -2.0, 65504.0]], np.float16),
    "BF16": np.array([[1.0, -3.5, 0.0078125]], ml_dtypes.bfloat16),
    "INT64": np.array([[-(2**63), 2**63 - 1, 0]], np.int64),
    "BOOL": np.array([[True, False, True]]),
    # NUL bytes inside and at both ends, an empty element, bytes that are not UTF-8.
    "BYTES": np.array([[b"\x00lead", b"mid\x00dle", b"", b"tail\x00", b"\xff\xfe"]],
                      dtype=np.object_),
}
JSON_TYPES = ("FP32", "INT64", "BOOL", "BYTES")  # JSON carries these exactly (no BF16 / FP16)
# JSON strings are text: the same NULs and empty element, UTF-8 only.
JSON_BYTES = np.array([[b"\x00lead", b"mid\x00dle", b"", b"tail\x00", "\u00e9t\u00e9".encode()]],
                      dtype=np.object_)


def client_for(module: Any, target: Target) -> Any:
    url = target.grpc_url if module in (grpcclient, grpcaio) else target.http_url
    return module.InferenceServerClient(url)


def payload(datatype: str, binary: bool = True) -> NDArray[Any]:
    return JSON_BYTES if datatype == "BYTES" and not binary else PAYLOADS[datatype]


def identity_inputs(module: Any, datatype: str, binary: bool = True) -> list[Any]:
    x = payload(datatype, binary)
    inp = module.InferInput("INPUT0", list(x.shape), datatype)
    if module in (httpclient, httpaio):
        inp.set_data_from_numpy(x, binary_data=binary)
    else:
        inp.set_data_from_numpy(x)
    return [inp]


def assert_same_tensor(got: NDArray[Any], want: NDArray[Any]) -> None:
    assert got.shape == want.shape
    if want.dtype == np.object_:  # a JSON answer's BYTES come back as str
        assert [v.encode() if isinstance(v, str) else bytes(v) for v in got.reshape(-1)] == \
            [bytes(v) for v in want.reshape(-1)]
    else:
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("datatype", list(PAYLOADS))
@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_sync_binary_tensors_come_back_byte_for_byte(target: Target, module: Any,
                                                     datatype: str) -> None:
    client = client_for(module, target)
    try:
        outputs = [module.InferRequestedOutput("OUTPUT0")]
        result = client.infer(f"identity_{datatype.lower()}", identity_inputs(module, datatype),
                              outputs=outputs, request_id=f"req-{datatype}")
        assert_same_tensor(result.as_numpy("OUTPUT0"), PAYLOADS[datatype])
        response = result.get_response()
        rid = response["id"] if module is httpclient else response.id
        assert rid == f"req-{datatype}"
    finally:
        client.close()


@pytest.mark.parametrize("datatype", JSON_TYPES)
def test_http_json_tensors_both_ways(target: Target, datatype: str) -> None:
    """JSON in, JSON out (``binary_data=False`` on the output): the answer's ``data`` list."""
    client = httpclient.InferenceServerClient(target.http_url)
    try:
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)
        result = client.infer(f"identity_{datatype.lower()}",
                              identity_inputs(httpclient, datatype, binary=False), outputs=[out])
        entry = result.get_output("OUTPUT0")
        assert "data" in entry and "binary_data_size" not in entry.get("parameters", {})
        assert entry["datatype"] == datatype and entry["shape"] == list(PAYLOADS[datatype].shape)
        if datatype == "BYTES":  # JSON strings: the text as sent, NULs kept
            assert entry["data"] == ["\x00lead", "mid\x00dle", "", "tail\x00", "\u00e9t\u00e9"]
        assert_same_tensor(result.as_numpy("OUTPUT0"), payload(datatype, binary=False))
    finally:
        client.close()


def test_http_mixed_binary_and_json_outputs(target: Target) -> None:
    """Per output: one in the binary part, one as JSON, as the client asked for each."""
    client = httpclient.InferenceServerClient(target.http_url)
    try:
        x = np.arange(10, dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", [10], "FP32")
        inp.set_data_from_numpy(x, binary_data=False)
        outs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
                httpclient.InferRequestedOutput("PARAMS", binary_data=False)]
        result = client.infer("echo_params", [inp], outputs=outs)
        assert "binary_data_size" in result.get_output("OUTPUT0")["parameters"]
        assert "data" in result.get_output("PARAMS")
        assert_same_tensor(result.as_numpy("OUTPUT0"), x)
    finally:
        client.close()


@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_only_the_outputs_asked_for(target: Target, module: Any) -> None:
    client = client_for(module, target)
    try:
        pixels = np.random.default_rng(3).random((1, 3, 224, 224), np.float32)
        ids = np.arange(77, dtype=np.int64).reshape(1, 77)
        inputs = [module.InferInput("pixel_values", [1, 3, 224, 224], "FP32"),
                  module.InferInput("input_ids", [1, 77], "INT64")]
        inputs[0].set_data_from_numpy(pixels)
        inputs[1].set_data_from_numpy(ids)
        every = client.infer("clip_demo", inputs)
        one = client.infer("clip_demo", inputs,
                           outputs=[module.InferRequestedOutput("similarity")])
        names = ([o["name"] for o in one.get_response()["outputs"]] if module is httpclient
                 else [o.name for o in one.get_response().outputs])
        assert names == ["similarity"]
        assert one.as_numpy("similarity").shape == (1, 1)
        assert_same_tensor(one.as_numpy("similarity"), every.as_numpy("similarity"))
        assert every.as_numpy("image_embeds").shape == (1, 64)
    finally:
        client.close()


PARAMETERS = {"custom": "text \u00e9", "count": 3, "flag": True, "ratio": 0.25}


@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_request_parameters_reach_the_model(target: Target, module: Any) -> None:
    """The model sees the parameters the client sent — and nothing the proxy added (HTTP's
    ``binary_data_output`` stays on the HTTP hop, as Triton's HTTP server keeps it)."""
    client = client_for(module, target)
    try:
        inp = module.InferInput("INPUT0", [2], "FP32")
        inp.set_data_from_numpy(np.array([1, 2], np.float32))
        result = client.infer("echo_params", [inp], parameters=PARAMETERS, request_id="p-1")
        seen = json.loads(result.as_numpy("PARAMS")[0])
        assert seen == PARAMETERS
        response = result.get_response()
        assert (response["id"] if module is httpclient else response.id) == "p-1"
    finally:
        client.close()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
async def test_http_aio_client(target: Target, binary: bool) -> None:
    client = httpaio.InferenceServerClient(target.http_url)
    try:
        assert await client.is_server_ready()
        meta = await client.get_model_metadata("identity_bytes")
        assert meta["inputs"][0]["datatype"] == "BYTES"
        result = await client.infer(
            "identity_bytes", identity_inputs(httpaio, "BYTES", binary),
            outputs=[httpaio.InferRequestedOutput("OUTPUT0", binary_data=binary)],
            request_id="aio-h")
        assert_same_tensor(result.as_numpy("OUTPUT0"), payload("BYTES", binary))
        assert result.get_response()["id"] == "aio-h"
    finally:
        await client.close()


async def test_grpc_aio_client(target: Target) -> None:
    client = grpcaio.InferenceServerClient(target.grpc_url)
    try:
        assert await client.is_server_ready()
        for datatype in PAYLOADS:
            result = await client.infer(f"identity_{datatype.lower()}",
                                        identity_inputs(grpcaio, datatype),
                                        request_id=f"aio-{datatype}")
            assert_same_tensor(result.as_numpy("OUTPUT0"), PAYLOADS[datatype])
            assert result.get_response().id == f"aio-{datatype}"
        inp = grpcaio.InferInput("INPUT0", [1], "FP32")
        inp.set_data_from_numpy(np.array([7], np.float32))
        seen = await client.infer("echo_params", [inp], parameters=PARAMETERS)
        assert json.loads(seen.as_numpy("PARAMS")[0]) == PARAMETERS
    finally:
        await client.close()


def _post(http_url: str, model: str, body: bytes, hlen: int | None) -> tuple[bytes, str | None]:
    headers = {"Content-Type": "application/json"}
    if hlen is not None:
        headers["Inference-Header-Content-Length"] = str(hlen)
    req = urllib.request.Request(f"http://{http_url}/v2/models/{model}/infer", data=body,
                                 headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read(), r.headers.get("Inference-Header-Content-Length")


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_http_answer_is_tritons_byte_for_byte(target: Target, triton: TritonServer,
                                              binary: bool) -> None:
    """The whole answer body, header length included, as Triton itself sends it — whether
    mmguard forwarded Triton's HTTP answer or re-encoded its gRPC one."""
    x = np.arange(4, dtype=np.float32)
    inp: dict[str, Any] = {"name": "INPUT0", "datatype": "FP32", "shape": [4]}
    if binary:
        inp["parameters"] = {"binary_data_size": 16}
        outs = [{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "PARAMS"}]
        head = json.dumps({"id": "b-1", "inputs": [inp], "outputs": outs}).encode()
        body, hlen = head + x.tobytes(), len(head)
    else:
        inp["data"] = x.tolist()
        body, hlen = json.dumps({"id": "j-1", "inputs": [inp],
                                 "parameters": {"p": 1}}).encode(), None
    assert _post(target.http_url, "echo_params", body, hlen) == \
        _post(triton.http_url, "echo_params", body, hlen)


def test_grpc_answer_is_tritons_byte_for_byte(target: Target, triton: TritonServer) -> None:
    req = pb.ModelInferRequest(model_name="echo_params", id="g-1")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
    req.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
    answers = []
    for url in (target.grpc_url, triton.grpc_url):
        with grpc.insecure_channel(url) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            answers.append(infer(req.SerializeToString(), timeout=30))
    assert pb.ModelInferResponse.FromString(answers[0]) == \
        pb.ModelInferResponse.FromString(answers[1])
    assert answers[0] == answers[1]


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_half_floats_are_not_answered_as_json(target: Target, datatype: str) -> None:
    """Triton refuses FP16 / BF16 as JSON data (400); through mmguard too, whichever backend
    answered. Asked in binary, the same call is answered."""
    client = httpclient.InferenceServerClient(target.http_url)
    try:
        inputs = identity_inputs(httpclient, datatype)
        json_out = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)]
        with pytest.raises(InferenceServerException) as err:
            client.infer(f"identity_{datatype.lower()}", inputs, outputs=json_out)
        assert err.value.status() == "400"
        assert datatype in (err.value.message() or "")
        result = client.infer(f"identity_{datatype.lower()}", inputs,
                              outputs=[httpclient.InferRequestedOutput("OUTPUT0")])
        assert_same_tensor(result.as_numpy("OUTPUT0"), PAYLOADS[datatype])
    finally:
        client.close()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_an_empty_tensor_comes_back_empty(target: Target, module: Any, binary: bool) -> None:
    """Shape [1, 0]: Triton answers an output of no bytes without the binary part's header
    (``binary_data_size`` 0); through a ``triton_http`` backend mmguard refused that answer
    as outside its contract (502 / INTERNAL)."""
    client = client_for(module, target)
    try:
        x = np.zeros((1, 0), np.float32)
        inp = module.InferInput("INPUT0", [1, 0], "FP32")
        if module is httpclient:
            inp.set_data_from_numpy(x, binary_data=binary)
            outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)]
        else:
            inp.set_data_from_numpy(x)
            outputs = [grpcclient.InferRequestedOutput("OUTPUT0")]
        result = client.infer("identity_fp32", [inp], outputs=outputs)
        assert_same_tensor(result.as_numpy("OUTPUT0"), x)
    finally:
        client.close()


def test_bytes_that_are_not_utf8_come_back_as_they_are_in_a_json_answer(target: Target) -> None:
    """Triton writes a BYTES element that is not UTF-8 into its JSON answer as the bytes
    themselves. Through mmguard the same bytes come back: a gRPC backend's answer was written
    as latin-1 text (other bytes, no error), an HTTP backend's refused as malformed (502)."""
    value = b"\xff\xfe\x00a\xc3("
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1],
                                   "parameters": {"binary_data_size": 4 + len(value)}}],
                       "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}]
                       }).encode()
    req = urllib.request.Request(
        f"http://{target.http_url}/v2/models/identity_bytes/infer",
        body + len(value).to_bytes(4, "little") + value,
        {"Content-Type": "application/octet-stream",
         "Inference-Header-Content-Length": str(len(body))})
    with urllib.request.urlopen(req, timeout=30) as resp:
        answer = resp.read()
    doc = json.loads(answer.decode("utf-8", "surrogateescape"))
    assert doc["outputs"][0]["data"][0].encode("utf-8", "surrogateescape") == value
