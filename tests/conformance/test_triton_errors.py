"""Refusals: a wrong shape, a wrong datatype, an unknown input or model, a batch too large, a
payload whose bytes do not fit its shape. Directly and through mmguard the status is the same
(gRPC code and HTTP status); the text may be mmguard's own where mmguard refuses first, but it
always names what was wrong (the input, the model)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from proxy.pb import grpc_service_pb2 as pb
from tests.conformance.conftest import Target

# case -> (model, input name, shape, datatype, numpy type, HTTP status, gRPC code, named in text)
CASES: dict[str, tuple[str, str, list[int], str, Any, int, str, tuple[str, ...]]] = {
    "wrong-shape": ("small_fp32", "x", [1, 8], "FP32", np.float32, 400, "INVALID_ARGUMENT",
                    ("'x'", "[1,8]")),
    "wrong-dtype": ("small_fp32", "x", [1, 16], "INT32", np.int32, 400, "INVALID_ARGUMENT",
                    ("'x'", "INT32", "FP32")),
    "unknown-input": ("small_fp32", "nope", [1, 16], "FP32", np.float32, 400,
                      "INVALID_ARGUMENT", ("'nope'",)),
    "batch-too-large": ("batch4_fp32", "x", [5, 16], "FP32", np.float32, 400,
                        "INVALID_ARGUMENT", ("batch4_fp32", "4")),
    "unknown-model": ("no_such_model", "x", [1, 16], "FP32", np.float32, 404, "NOT_FOUND",
                      ("no_such_model",)),
}


def _input(module: Any, name: str, shape: list[int], datatype: str, dtype: Any) -> Any:
    inp = module.InferInput(name, shape, datatype)
    inp.set_data_from_numpy(np.zeros(shape, dtype))
    return inp


@pytest.mark.parametrize("case", list(CASES))
def test_http_refusal(target: Target, case: str) -> None:
    model, name, shape, datatype, dtype, status, _, named = CASES[case]
    client = httpclient.InferenceServerClient(target.http_url)
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer(model, [_input(httpclient, name, shape, datatype, dtype)])
        assert err.value.status() == str(status)
        for text in named:
            assert text in err.value.message(), (text, err.value.message())
    finally:
        client.close()


@pytest.mark.parametrize("case", list(CASES))
def test_grpc_refusal(target: Target, case: str) -> None:
    model, name, shape, datatype, dtype, _, code, named = CASES[case]
    client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer(model, [_input(grpcclient, name, shape, datatype, dtype)])
        assert err.value.status() == f"StatusCode.{code}"
        for text in named:
            assert text in err.value.message(), (text, err.value.message())
    finally:
        client.close()


def test_request_id_in_the_backend_error(target: Target) -> None:
    """Triton puts the request id in its validation errors; it must still be the client's id."""
    client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer("small_fp32", [_input(grpcclient, "x", [1, 8], "FP32", np.float32)],
                         request_id="bad-7")
        assert "bad-7" in err.value.message()
    finally:
        client.close()


def test_grpc_payload_that_does_not_fit_its_shape(target: Target) -> None:
    """FP32 [1, 16] needs 64 bytes; 60 are sent (only a hand-made request can do this)."""
    req = pb.ModelInferRequest(model_name="small_fp32")
    req.inputs.add(name="x", datatype="FP32", shape=[1, 16])
    req.raw_input_contents.append(bytes(60))
    with grpc.insecure_channel(target.grpc_url) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as err:
            infer(req.SerializeToString(), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'x'" in (err.value.details() or "")


def test_http_payload_that_does_not_fit_its_shape(target: Target) -> None:
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16],
                                   "parameters": {"binary_data_size": 60}}]}).encode()
    req = urllib.request.Request(
        f"http://{target.http_url}/v2/models/small_fp32/infer", data=head + bytes(60),
        method="POST", headers={"Inference-Header-Content-Length": str(len(head)),
                                "Content-Type": "application/octet-stream"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    assert "'x'" in json.loads(err.value.read())["error"]


def test_a_stream_error_names_the_request_it_answers(stream_target: Target) -> None:
    """On ``ModelStreamInfer`` each error answer carries the request's id and model (Triton's
    ``infer_response``), so a client with several requests in flight knows which one failed;
    mmguard's carried neither, for a request it refused and for the model's own error alike."""
    from proxy.pb import grpc_service_pb2_grpc as pb_grpc

    def request(model: str, rid: str, name: str) -> pb.ModelInferRequest:
        req = pb.ModelInferRequest(model_name=model, id=rid)
        tensor = req.inputs.add(name=name, datatype="FP32", shape=[1, 2])
        req.raw_input_contents.append(np.zeros(2, np.float32).tobytes())
        assert tensor.name == name
        return req

    requests = [request("identity_fp32", "req-bad", "NOPE"),
                request("fail_fp32", "req-fail", "x"),
                request("identity_fp32", "req-ok", "INPUT0")]
    with grpc.insecure_channel(stream_target.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        answers = list(stub.ModelStreamInfer(iter(requests), timeout=60))
    assert [(a.infer_response.id, bool(a.error_message)) for a in answers] == \
        [("req-bad", True), ("req-fail", True), ("req-ok", False)]
    # the model's own failure names it; a request refused before its model ran is named by
    # its id (Triton leaves the model empty there, mmguard names the route it was sent to)
    assert [a.infer_response.model_name for a in answers[1:]] == ["fail_fp32", "identity_fp32"]
