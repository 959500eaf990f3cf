"""Every oversized number is a 400 (gRPC INVALID_ARGUMENT), never a 500 (issue 26, item 6).

Before: ``Inference-Header-Content-Length`` of 4301+ digits (Python's limit on the digits
``int()`` converts) got a 500 and a traceback; a JSON number that long was refused with a
message naming an interpreter setting; a deeply nested JSON body on the shared-memory,
repository and admin endpoints got a 500. Every numeric header, JSON field and nesting a
client sends is tried here on every front of a real ``mmguard serve``.
"""

from __future__ import annotations

import json

import grpc
import pytest

from proxy.pb import grpc_service_pb2 as pb
from tests.support.adversary import ADMIN_TOKEN, PROBE_PATH, Prober, http_call
from tests.support.process import MmguardProcess
from tests.support.wire import grpc_infer_raw

BIG = "9" * 5000
DEEP = "[" * 100_000 + "]" * 100_000
JSON = {"Content-Type": "application/json"}


def _v2(shape: str = "[2]", data: str = "[1.0, 2.0]", extra: str = "") -> bytes:
    head = '{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": '
    return (head + shape + ', "data": ' + data + "}]" + extra + "}").encode()


def _chat(extra: str) -> bytes:
    return ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], ' + extra
            + "}").encode()


HTTP_CASES: list[tuple[str, str, bytes, dict[str, str], str]] = [
    # (what, path, body, headers, a phrase the 400 must hold)
    ("a 5000-digit Inference-Header-Content-Length", PROBE_PATH, _v2(),
     {"Inference-Header-Content-Length": BIG}, "Inference-Header-Content-Length"),
    ("a 4301-digit Inference-Header-Content-Length", PROBE_PATH, _v2(),
     {"Inference-Header-Content-Length": "1" * 4301}, "at most 19 ASCII digits"),
    ("a 20-digit Inference-Header-Content-Length", PROBE_PATH, _v2(),
     {"Inference-Header-Content-Length": "9" * 20}, "Inference-Header-Content-Length"),
    # read as C's atoi reads it, as Triton does: "+5" is 5, and 5 bytes are not a JSON header
    ("a signed Inference-Header-Content-Length", PROBE_PATH, _v2(),
     {"Inference-Header-Content-Length": "+5"}, "failed to parse the request JSON buffer"),
    ("a 5000-digit mmguard-timeout-ms", PROBE_PATH, _v2(), {"mmguard-timeout-ms": BIG},
     "mmguard-timeout-ms"),
    ("mmguard-timeout-ms of 1e999", PROBE_PATH, _v2(), {"mmguard-timeout-ms": "1e999"},
     "mmguard-timeout-ms"),
    ("a 5000-digit shape dim", PROBE_PATH, _v2(shape=f"[{BIG}]"), JSON, "5000 digits"),
    ("a shape dim of 2**64", PROBE_PATH, _v2(shape=f"[{2**64}]"), JSON,
     "shape"),
    ("a shape dim of 1e308", PROBE_PATH, _v2(shape="[1e308]"), JSON, "shape"),
    ("a 5000-digit datum", PROBE_PATH, _v2(shape="[1]", data=f"[{BIG}]"), JSON, "5000 digits"),
    ("a 5000-digit priority", PROBE_PATH, _v2(extra=f', "parameters": {{"priority": {BIG}}}'),
     JSON, "5000 digits"),
    # Triton's words for a number its unsigned-integer reader cannot take
    ("a priority of 2**200", PROBE_PATH,
     _v2(extra=f', "parameters": {{"priority": {2**200}}}'), JSON, "Unable to parse 'priority'"),
    ("a timeout of 2**200", PROBE_PATH,
     _v2(extra=f', "parameters": {{"timeout": {2**200}}}'), JSON, "Unable to parse 'timeout'"),
    ("a classification of 2**70", PROBE_PATH,
     _v2(extra=f', "outputs": [{{"name": "OUTPUT0", "parameters": {{"classification": '
               f'{2**70}}}}}]'), JSON, "classification"),
    ("a v2 body nested 100,000 deep", PROBE_PATH, DEEP.encode(), JSON, "nested too deeply"),
    ("a 5000-digit max_tokens", "/v1/chat/completions", _chat(f'"max_tokens": {BIG}'), JSON,
     "5000 digits"),
    ("a 5000-digit temperature", "/v1/chat/completions", _chat(f'"temperature": {BIG}.5'),
     JSON, ""),  # a float that long is inf: refused for the model it names (none here)
    ("an OpenAI body nested 100,000 deep", "/v1/completions", DEEP.encode(), JSON,
     "nested too deeply"),
    ("a shared-memory offset of 5000 digits", "/v2/systemsharedmemory/region/r/register",
     f'{{"key": "k", "offset": {BIG}, "byte_size": 1}}'.encode(), JSON, ""),
    ("a shared-memory body nested 100,000 deep", "/v2/systemsharedmemory/region/r/register",
     DEEP.encode(), JSON, ""),
    ("a repository body nested 100,000 deep", "/v2/repository/models/identity_fp32/load",
     DEEP.encode(), JSON, ""),
]


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_an_oversized_number_over_http_is_a_client_error(
        served: MmguardProcess, case: tuple[str, str, bytes, dict[str, str], str]) -> None:
    what, path, body, headers, phrase = case
    with Prober(served.ports["http"]) as probe:
        status, _, answer = http_call(served.ports["http"], "POST", path, body, headers)
    probe.assert_served(minimum=1)
    # 501: an endpoint that is off (shared memory, the repository API) says so
    assert 400 <= status < 500 or status == 501, f"{what}: {status} {answer[:300]!r}"
    if phrase:
        assert status == 400, f"{what}: {status} {answer[:300]!r}"
        assert phrase in answer.decode(), f"{what}: {answer[:300]!r}"
    assert b"set_int_max_str_digits" not in answer


def test_admin_bodies_with_oversized_numbers_or_nesting_are_400(served: MmguardProcess) -> None:
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}", **JSON}
    for body in (DEEP.encode(), f'{{"route": "identity_fp32", "n": {BIG}}}'.encode()):
        status, _, answer = http_call(served.ports["admin"], "POST", "/admin/experiments",
                                      body, auth)
        assert status == 400, (status, answer[:300])
        assert b"set_int_max_str_digits" not in answer


def test_an_oversized_number_over_grpc_is_invalid_argument(served: MmguardProcess) -> None:
    url = f"127.0.0.1:{served.ports['grpc']}"
    requests = []
    huge_dims = pb.ModelInferRequest(model_name="identity_fp32")
    huge_dims.inputs.add(name="INPUT0", datatype="FP32", shape=[2**62, 2**62])
    huge_dims.raw_input_contents.append(b"\x00" * 8)
    requests.append(huge_dims)
    negative = pb.ModelInferRequest(model_name="identity_fp32")
    negative.inputs.add(name="INPUT0", datatype="FP32", shape=[-(2**62)])
    negative.raw_input_contents.append(b"\x00" * 8)
    requests.append(negative)
    priority = pb.ModelInferRequest(model_name="identity_fp32")
    priority.inputs.add(name="INPUT0", datatype="FP32", shape=[2])
    priority.raw_input_contents.append(b"\x00" * 8)
    priority.parameters["priority"].uint64_param = 2**64 - 1
    priority.parameters["classification"].int64_param = -(2**63)
    requests.append(priority)
    for req in requests:
        try:
            grpc_infer_raw(url, req.SerializeToString())
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.OUT_OF_RANGE), (err.code(), err.details())
        # an accepted one is fine too: it is a number the model may take


def test_json_of_the_probe_still_works(served: MmguardProcess) -> None:
    status, _, body = http_call(served.ports["http"], "POST", PROBE_PATH, _v2(), JSON)
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [1.0, 2.0]
