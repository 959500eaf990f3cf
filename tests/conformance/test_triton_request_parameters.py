"""Request parameters as Triton's fronts read them, direct and through mmguard (both Triton
backends): a gRPC client gets what Triton's gRPC front answers whatever backend follows (a
``triton_http`` backend read them by Triton's HTTP rules: a ``uint64_param`` or an unset value
passed, a string ``priority`` was INTERNAL), and an HTTP client's parameters are read as
Triton's HTTP front reads them.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from proxy.pb import grpc_service_pb2 as pb
from tests.conformance.conftest import Target
from tests.support.wire import http_post

P = pb.InferParameter
KINDS = {"int64": P(int64_param=3), "uint64": P(uint64_param=3), "bool": P(bool_param=True),
         "string": P(string_param="hi"), "double": P(double_param=1.5), "unset": P()}
TAKES = {  # key: (the kinds Triton's gRPC front takes, the end of its words)
    "custom": ({"int64", "bool", "string", "double"}, "int64_param, bool_param, or string_param."),
    "binary_data_output": ({"int64", "bool", "string", "double"},
                           "int64_param, bool_param, or string_param."),
    "priority": ({"int64", "uint64"}, "int64_param or uint64_param."),
    "timeout": ({"int64"}, "int64_param."),
    "sequence_id": ({"int64", "string"}, "int64_param or string_param."),
    "sequence_start": ({"bool"}, "bool_param."),
    "sequence_end": ({"bool"}, "bool_param."),
    "triton_enable_empty_final_response": ({"bool"}, "bool_param."),
}
TRITON_PREFIX = ("parameter keys starting with 'triton_' are reserved for Triton usage. Only the "
                 "following keys starting with 'triton_' are allowed: "
                 "triton_enable_empty_final_response")


def _grpc_infer(target: Target, params: dict[str, pb.InferParameter]) -> tuple[str, str]:
    req = pb.ModelInferRequest(model_name="identity_fp32", parameters=params)
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 2])
    req.raw_input_contents.append(np.array([[1, 2]], np.float32).tobytes())
    with grpc.insecure_channel(target.grpc_url) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        try:
            call(req.SerializeToString(), timeout=30)
        except grpc.RpcError as err:
            return err.code().name, err.details() or ""
    return "OK", ""


@pytest.mark.parametrize("key", list(TAKES))
def test_grpc_request_parameter_types(target: Target, key: str) -> None:
    takes, words = TAKES[key]
    for kind, param in KINDS.items():
        code, details = _grpc_infer(target, {key: param})
        if kind in takes:
            assert code == "OK", (kind, details)
        else:
            assert code == "INVALID_ARGUMENT", (kind, details)
            lead = f"invalid value type for '{key}' parameter, expected {words}"
            assert details.startswith(lead), (kind, details)


@pytest.mark.parametrize("param", [P(int64_param=1), P(bool_param=True)])
def test_grpc_triton_prefix_reserved(target: Target, param: pb.InferParameter) -> None:
    code, details = _grpc_infer(target, {"triton_x": param})
    assert code == "INVALID_ARGUMENT" and details.startswith(TRITON_PREFIX), details


def test_grpc_negative_priority(target: Target) -> None:
    code, details = _grpc_infer(target, {"priority": P(int64_param=-3)})
    assert code == "INVALID_ARGUMENT", details
    assert details.startswith("invalid value for 'priority', expected value >= 0."), details


def test_grpc_largest_uint64_priority(target: Target) -> None:
    assert _grpc_infer(target, {"priority": P(uint64_param=2**64 - 1)}) == ("OK", "")


BIG = {"above-int64": "9223372036854775808", "largest-uint64": "18446744073709551615",
       "above-uint64": "18446744073709551616", "below-int64": "-9223372036854775809"}


@pytest.mark.parametrize("case", list(BIG))
def test_http_integer_parameter_past_int64_is_a_double(target: Target, case: str) -> None:
    """Triton reads an integer past int64 as a double and the model sees one (mmguard refused
    it as outside the int64 range); ``echo_params`` shows what reached the model."""
    body = ('{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[2],"data":[1,2]}],'
            f'"parameters":{{"big":{BIG[case]}}}}}').encode()
    status, _, answer = http_post(target.http_url, "/v2/models/echo_params/infer", body)
    assert status == 200, answer
    params = json.loads(next(o for o in json.loads(answer)["outputs"]
                             if o["name"] == "PARAMS")["data"][0])
    assert params == {"big": float(int(BIG[case]))}, params
    assert type(params["big"]) is float


def test_http_priority_up_to_uint64_taken(target: Target) -> None:
    body = (b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,2],"data":[1,2]}],'
            b'"parameters":{"priority":18446744073709551615}}')
    status, _, answer = http_post(target.http_url, "/v2/models/identity_fp32/infer", body)
    assert status == 200, answer
