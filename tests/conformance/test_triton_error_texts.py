"""Every refusal a KServe v2 client can trigger, direct and through mmguard (both Triton
backends): the same status (HTTP) or code (gRPC), and a message that starts with Triton's own
words (mmguard may add its reason after them). docs/triton-compat.md states the rule.

The leading texts are Triton 2.51's, as its clients and its own tests (qa/L0_http,
qa/L0_infer, qa/L0_shared_memory) match on them. Where mmguard answers with another status on
purpose, the case says so (``mmguard_status``) and docs/triton-compat.md gives the reason.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from proxy.pb import grpc_service_pb2 as pb
from tests.conformance.conftest import Target
from tests.conformance.test_triton_shm import NBYTES, Shm, X, fails
from tests.conformance.test_triton_shm import shm_client as shm_client  # the fixture
from tests.support.wire import http_post

X16 = np.arange(16, dtype=np.float32).tobytes()
UNKNOWN = "Request for unknown model: 'nope' is not found"
VERSION_7 = "Request for unknown model: 'small_fp32' version 7 is not found"
STOL = ("failed to get model version from specified version string 'wrong_specification' "
        "(details: stol), version should be an integral value > 0")
NEGATIVE = "invalid model version specified '-1' , version should be an integral value > 0"
CONTENT_FIELDS = ("Input must set only one of the following fields: 'data', 'binary_data_size' "
                  "in 'parameters', 'shared_memory_region' in 'parameters'. But")


def _doc(**tensor: object) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16],
                                   **tensor}]}).encode()


@dataclass(frozen=True)
class Http:
    method: str
    path: str
    status: int
    lead: str
    body: bytes | None = None
    headers: tuple[tuple[str, str], ...] = ()
    mmguard_status: int | None = None  # an intended difference (docs/triton-compat.md)


HTTP_CASES: dict[str, Http] = {
    "unknown-model-infer": Http("POST", "/v2/models/nope/infer", 404, UNKNOWN,
                                _doc(data=[0] * 16)),
    "unknown-model-metadata": Http("GET", "/v2/models/nope", 404, UNKNOWN),
    "unknown-model-config": Http("GET", "/v2/models/nope/config", 404, UNKNOWN),
    "unknown-model-stats": Http("GET", "/v2/models/nope/stats", 400,
                                "requested model 'nope' is not available"),
    # Triton matches a path as it came: percent-escapes are not decoded (aiohttp decodes them,
    # and mmguard served identity_fp32 for identity%5Ffp32)
    "escaped-model-infer": Http("POST", "/v2/models/identity%5Ffp32/infer", 404,
                                "Request for unknown model: 'identity%5Ffp32' is not found",
                                _doc(data=[0] * 16)),
    "escaped-model-metadata": Http("GET", "/v2/models/%69dentity_fp32", 404,
                                   "Request for unknown model: '%69dentity_fp32' is not found"),
    "escaped-space-in-model": Http("POST", "/v2/models/identity_fp32%20/infer", 404,
                                   "Request for unknown model: 'identity_fp32%20' is not found",
                                   _doc(data=[0] * 16)),
    "escaped-version": Http("POST", "/v2/models/identity_fp32/versions/%31/infer", 404,
                            "Not Found", _doc(data=[0] * 16)),
    "version-unknown-stats": Http("GET", "/v2/models/small_fp32/versions/7/stats", 400,
                                  "requested model version is not available for model "
                                  "'small_fp32'"),
    "version-not-a-number-infer": Http(
        "POST", "/v2/models/small_fp32/versions/wrong_specification/infer", 404, "Not Found",
        _doc(data=[0] * 16)),
    "version-not-a-number-metadata": Http(
        "GET", "/v2/models/small_fp32/versions/wrong_specification", 404, "Not Found"),
    "version-negative": Http("POST", "/v2/models/small_fp32/versions/-1/infer", 404,
                             "Not Found", _doc(data=[0] * 16)),
    "version-unknown-infer": Http("POST", "/v2/models/small_fp32/versions/7/infer", 404,
                                  VERSION_7, _doc(data=[0] * 16)),
    "version-unknown-metadata": Http("GET", "/v2/models/small_fp32/versions/7", 404,
                                     VERSION_7),
    "version-unknown-config": Http("GET", "/v2/models/small_fp32/versions/7/config", 404,
                                   VERSION_7),
    "header-length-past-the-body": Http(
        "POST", "/v2/models/small_fp32/infer", 400,
        "inference header size should be in range (0, 2), got: 50", b"{}",
        (("Inference-Header-Content-Length", "50"),)),
    "header-length-negative": Http(
        "POST", "/v2/models/small_fp32/infer", 400,
        "inference header size should be in range (0, 2), got: -1", b"{}",
        (("Inference-Header-Content-Length", "-1"),)),
    "no-data": Http("POST", "/v2/models/small_fp32/infer", 400,
                    CONTENT_FIELDS + " no field is set", _doc()),
    "data-and-binary": Http("POST", "/v2/models/small_fp32/infer", 400,
                            CONTENT_FIELDS + " set 'data' 'binary_data_size'",
                            _doc(data=[0] * 16, parameters={"binary_data_size": 64})),
    "binary-without-header": Http(
        "POST", "/v2/models/small_fp32/infer", 400,
        "unexpected size for input 'x', expecting 64 additional bytes for model 'small_fp32'",
        _doc(parameters={"binary_data_size": 64})),
    "binary-short": Http(
        "POST", "/v2/models/small_fp32/infer", 400,
        "[request id: r7] input byte size mismatch for input 'x' for model 'small_fp32'. "
        "Expected 64, got 60",
        json.dumps({"id": "r7", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16],
                                            "parameters": {"binary_data_size": 60}}]}).encode()
        + bytes(60), (("Inference-Header-Content-Length", "117"),)),
    "unknown-datatype": Http("POST", "/v2/models/small_fp32/infer", 400,
                             "invalid datatype for input x",
                             json.dumps({"inputs": [{"name": "x", "datatype": "FP99",
                                                     "shape": [1, 16],
                                                     "data": [0] * 16}]}).encode()),
    "wrong-shape": Http("POST", "/v2/models/small_fp32/infer", 400,
                        "[request id: <id_unknown>] unexpected shape for input 'x' for model "
                        "'small_fp32'. Expected [-1,16], got [1,8]",
                        json.dumps({"inputs": [{"name": "x", "datatype": "FP32",
                                                "shape": [1, 8], "data": [0] * 8}]}).encode()),
    "unknown-shm-region": Http(
        "POST", "/v2/models/small_fp32/infer", 404,
        "Unable to find shared memory region: 'nope'",
        _doc(parameters={"shared_memory_region": "nope", "shared_memory_byte_size": 64})),
    "shm-status-unknown": Http("GET", "/v2/systemsharedmemory/region/nope/status", 404,
                               "Unable to find system shared memory region: 'nope'"),
    "shm-register-no-key": Http(
        "POST", "/v2/systemsharedmemory/region/r1/register", 500,
        "Unable to open shared memory region: '/mmguard_i28_no_such_key'",
        json.dumps({"key": "/mmguard_i28_no_such_key", "offset": 0,
                    "byte_size": 64}).encode()),
    # Triton answers these client mistakes with 500 (its JSON parser's errors are INTERNAL);
    # mmguard answers 400, as Triton's own gRPC front does for the same mistakes.
    "malformed-json": Http("POST", "/v2/models/small_fp32/infer", 500,
                           "failed to parse the request JSON buffer: ", b"{nope",
                           mmguard_status=400),
    "no-inputs": Http("POST", "/v2/models/small_fp32/infer", 500, "Unable to parse 'inputs'",
                      b"{}", mmguard_status=400),
    "no-input-in-the-list": Http(
        "POST", "/v2/models/small_fp32/infer", 400,
        "[request id: <id_unknown>] expected 1 inputs but got 0 inputs for model 'small_fp32'. "
        "Got input(s) [], but missing required input(s) ['x']. Please provide all required "
        "input(s).", b'{"inputs": []}'),
    "no-input-in-the-list-with-an-id": Http(
        "POST", "/v2/models/small_fp32/infer", 400,
        "[request id: r1] expected 1 inputs but got 0 inputs for model 'small_fp32'.",
        b'{"id": "r1", "inputs": []}'),
    **{f"request-parameter-of-{kind}": Http(
        "POST", "/v2/models/small_fp32/infer", 400, "parameter 'f' has invalid type. It "
        "should be either 'int', 'bool', or 'string'.",
        _doc(data=[0] * 16)[:-1] + b', "parameters": {"i": 1, "f": ' + value + b"}}")
       for kind, value in (("object", b"{}"), ("array", b"[1]"), ("null", b"null"))},
    "data-shorter-than-shape": Http(
        "POST", "/v2/models/small_fp32/infer", 500,
        "Unable to parse 'data': Shape does not match true shape of 'data' field",
        _doc(data=[0] * 15), mmguard_status=400),
}


def _binary_bytes(shape: list[int], raw: bytes) -> Http:
    head = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": shape,
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return Http("POST", "/v2/models/identity_bytes/infer", 400, "", head + raw,
                (("Inference-Header-Content-Length", str(len(head))),))


def _element(value: bytes) -> bytes:
    return len(value).to_bytes(4, "little") + value


BYTES_FRAMING = {  # case: (shape, payload, Triton's words)
    "bytes-fewer-than-the-shape": (
        [1, 2], _element(b"ab"), "[request id: <id_unknown>] expected 2 string elements for "
        "inference input 'INPUT0' for model 'identity_bytes', got 1"),
    "bytes-more-than-the-shape": (
        [1, 1], _element(b"a") + _element(b"b"), "[request id: <id_unknown>] unexpected number "
        "of string elements 2 for inference input 'INPUT0' for model 'identity_bytes', "
        "expecting 1"),
    "bytes-cut-length-prefix": (
        [1, 1], _element(b"a") + b"\0\0", "[request id: <id_unknown>] incomplete string length "
        "indicator for inference input 'INPUT0' for model 'identity_bytes', expecting 4 bytes "
        "but only 2 bytes available."),
    "bytes-length-past-the-end": (
        [1, 1], (100).to_bytes(4, "little") + b"ab", "incomplete string data for inference "
        "input 'INPUT0', expecting string of length 100 but only 2 bytes available"),
}


HTTP_CASES["header-length-past-the-body-and-the-json-limit"] = Http(
    "POST", "/v2/models/small_fp32/infer", 400,
    "inference header size should be in range (0, 2), got: 20971520", b"{}",
    (("Inference-Header-Content-Length", str(20 << 20)),))
HTTP_CASES["binary-part-longer-than-declared"] = Http(
    "POST", "/v2/models/small_fp32/infer", 400,
    "unexpected additional input data for model 'small_fp32'",
    json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16],
                            "parameters": {"binary_data_size": 64}}]}).encode() + X16 + b"\0" * 4,
    (("Inference-Header-Content-Length", str(len(json.dumps({"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, 16],
         "parameters": {"binary_data_size": 64}}]}).encode()))),))
HTTP_CASES["fp16-output-as-json"] = Http(
    "POST", "/v2/models/identity_fp16/infer", 400,
    "sending FP16 data via JSON is not supported. Please use the binary data format for output",
    json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP16", "shape": [1, 2],
                            "parameters": {"binary_data_size": 4}}],
                "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}]}
               ).encode() + b"\0" * 4,
    (("Inference-Header-Content-Length", str(len(json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "FP16", "shape": [1, 2],
         "parameters": {"binary_data_size": 4}}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}]}).encode()))),))
HTTP_CASES.update({f"{case}-binary": dataclasses.replace(_binary_bytes(shape, raw), lead=words)
                   for case, (shape, raw, words) in BYTES_FRAMING.items()})


@pytest.mark.parametrize("case", list(HTTP_CASES))
def test_http_refusal_text(target: Target, case: str) -> None:
    c = HTTP_CASES[case]
    if c.method == "GET":
        status, _, body = _http_get(target.http_url, c.path)
    else:
        assert c.body is not None
        status, _, body = http_post(target.http_url, c.path, c.body, dict(c.headers))
    want = c.mmguard_status if target.via_mmguard and c.mmguard_status else c.status
    assert status == want, body
    message = json.loads(body)["error"]
    assert message.startswith(c.lead), message


def _http_get(url: str, path: str) -> tuple[int, dict[str, str], bytes]:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://{url}{path}", timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


def _infer(version: str = "", model: str = "small_fp32", raw: bytes | None = X16,
           contents: str | None = None, count: int = 16) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model, model_version=version)
    inp = req.inputs.add(name="x", datatype="FP32", shape=[1, 16])
    if contents is not None:
        getattr(inp.contents, contents).extend([0] * count)
    if raw is not None:
        req.raw_input_contents.append(raw)
    return req


def _shaped(shape: list[int], raws: int = 1) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="small_fp32")
    req.inputs.add(name="x", datatype="FP32", shape=shape)
    req.raw_input_contents.extend([X16] * raws)
    return req


def _bytes_infer(shape: list[int], raw: bytes) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="identity_bytes")
    req.inputs.add(name="INPUT0", datatype="BYTES", shape=shape)
    req.raw_input_contents.append(raw)
    return req


def _classified(param: pb.InferParameter) -> pb.ModelInferRequest:
    req = _infer()
    out = req.outputs.add(name="y")
    out.parameters["classification"].CopyFrom(param)
    return req


GRPC_CASES: dict[str, tuple[str, object, grpc.StatusCode, str]] = {
    "classification-zero": ("ModelInfer", _classified(pb.InferParameter(int64_param=0)),
                            grpc.StatusCode.INVALID_ARGUMENT,
                            "invalid value for 'classification' parameter, expected >= 0"),
    "classification-a-bool": ("ModelInfer", _classified(pb.InferParameter(bool_param=True)),
                              grpc.StatusCode.INVALID_ARGUMENT, "invalid value type for "
                              "'classification' parameter, expected int64_param"),
    **{case: ("ModelInfer", _bytes_infer(shape, raw), grpc.StatusCode.INVALID_ARGUMENT, words)
       for case, (shape, raw, words) in BYTES_FRAMING.items()},
    "unknown-model-infer": ("ModelInfer", _infer(model="nope"), grpc.StatusCode.NOT_FOUND,
                            UNKNOWN),
    "unknown-model-metadata": ("ModelMetadata", pb.ModelMetadataRequest(name="nope"),
                               grpc.StatusCode.NOT_FOUND, UNKNOWN),
    "unknown-model-config": ("ModelConfig", pb.ModelConfigRequest(name="nope"),
                             grpc.StatusCode.NOT_FOUND, UNKNOWN),
    "unknown-model-stats": ("ModelStatistics", pb.ModelStatisticsRequest(name="nope"),
                            grpc.StatusCode.INVALID_ARGUMENT,
                            "requested model 'nope' is not available"),
    "version-not-a-number-infer": ("ModelInfer", _infer("wrong_specification"),
                                   grpc.StatusCode.INVALID_ARGUMENT, STOL),
    "version-not-a-number-metadata": (
        "ModelMetadata", pb.ModelMetadataRequest(name="small_fp32",
                                                 version="wrong_specification"),
        grpc.StatusCode.INVALID_ARGUMENT, STOL),
    "version-not-a-number-config": (
        "ModelConfig", pb.ModelConfigRequest(name="small_fp32", version="wrong_specification"),
        grpc.StatusCode.INVALID_ARGUMENT, STOL),
    "version-not-a-number-ready": (
        "ModelReady", pb.ModelReadyRequest(name="small_fp32", version="wrong_specification"),
        grpc.StatusCode.INVALID_ARGUMENT, STOL),
    "version-not-a-number-stats": (
        "ModelStatistics", pb.ModelStatisticsRequest(name="small_fp32",
                                                     version="wrong_specification"),
        grpc.StatusCode.INVALID_ARGUMENT, STOL),
    "version-unknown-stats": ("ModelStatistics",
                              pb.ModelStatisticsRequest(name="small_fp32", version="7"),
                              grpc.StatusCode.INVALID_ARGUMENT, "requested model version is "
                              "not available for model 'small_fp32'"),
    "version-negative": ("ModelInfer", _infer("-1"), grpc.StatusCode.INVALID_ARGUMENT,
                         NEGATIVE),
    "version-unknown-infer": ("ModelInfer", _infer("7"), grpc.StatusCode.NOT_FOUND, VERSION_7),
    "version-unknown-metadata": ("ModelMetadata",
                                 pb.ModelMetadataRequest(name="small_fp32", version="7"),
                                 grpc.StatusCode.NOT_FOUND, VERSION_7),
    "contents-and-raw": ("ModelInfer", _infer(contents="fp32_contents"),
                         grpc.StatusCode.INVALID_ARGUMENT,
                         "contents field must not be specified when using raw_input_contents "
                         "for 'x' for model 'small_fp32'"),
    "contents-short": ("ModelInfer", _infer(raw=None, contents="fp32_contents", count=15),
                       grpc.StatusCode.INVALID_ARGUMENT,
                       "[request id: <id_unknown>] input byte size mismatch for input 'x' for "
                       "model 'small_fp32'. Expected 64, got 60"),
    "contents-wrong-field": ("ModelInfer", _infer(raw=None, contents="int_contents"),
                             grpc.StatusCode.INVALID_ARGUMENT,
                             "unexpected explicit tensor data for input tensor 'x' for model "
                             "'small_fp32' of type 'INT32', expected datatype 'FP32'"),
    "raw-short": ("ModelInfer", _infer(raw=X16[:60]), grpc.StatusCode.INVALID_ARGUMENT,
                  "[request id: <id_unknown>] input byte size mismatch for input 'x' for "
                  "model 'small_fp32'. Expected 64, got 60"),
    "negative-dim": ("ModelInfer", _shaped([1, -16]), grpc.StatusCode.INVALID_ARGUMENT,
                     "[request id: <id_unknown>] unexpected shape for input 'x' for model "
                     "'small_fp32'"),
    "no-data": ("ModelInfer", _infer(raw=None), grpc.StatusCode.INVALID_ARGUMENT,
                "unable to find data for input tensor 'x' for model 'small_fp32' in request."),
    "shm-status-unknown": ("SystemSharedMemoryStatus",
                           pb.SystemSharedMemoryStatusRequest(name="nope"),
                           grpc.StatusCode.NOT_FOUND,
                           "Unable to find system shared memory region: 'nope'"),
    "shm-register-no-key": ("SystemSharedMemoryRegister", pb.SystemSharedMemoryRegisterRequest(
        name="r1", key="/mmguard_i28_no_such_key", offset=0, byte_size=64),
        grpc.StatusCode.INTERNAL,
        "Unable to open shared memory region: '/mmguard_i28_no_such_key'"),
}


@pytest.mark.parametrize("case", list(GRPC_CASES))
def test_grpc_refusal_text(target: Target, case: str) -> None:
    method, request, code, lead = GRPC_CASES[case]
    with grpc.insecure_channel(target.grpc_url) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        with pytest.raises(grpc.RpcError) as err:
            call(request.SerializeToString(), timeout=30)  # type: ignore[attr-defined]
    assert err.value.code() == code, err.value.details()
    assert (err.value.details() or "").startswith(lead), err.value.details()


def test_shared_memory_bounds_in_tritons_words(shm_client: Shm) -> None:
    """Upstream's test_register_out_of_bound, test_too_big_shm, test_infer_offset_out_of_bound
    and test_infer_byte_size_out_of_bound, over both protocols."""
    s = shm_client
    name, key, handle = s.region("words", NBYTES)
    shm.set_shared_memory_region(handle, [X])
    s.client.register_system_shared_memory(name, key, NBYTES)
    _, free_key, _ = s.region("words_free", NBYTES)
    assert fails(s.code("invalid"), s.client.register_system_shared_memory, name + "_big",
                 free_key, NBYTES + 1).startswith(
        f"failed to register shared memory region '{name}_big'")
    assert fails(s.code("invalid"), s.infer, name, in_offset=32).startswith(
        f"Invalid offset + byte size for shared memory region: '{name}'")
    assert fails(s.code("invalid"), s.infer, name, in_offset=NBYTES, in_size=0).startswith(
        f"Invalid offset for shared memory region: '{name}'")
    assert "input byte size mismatch for input 'x' for model 'small_fp32'. Expected 64, got " \
           "60" in fails(s.code("invalid"), s.infer, name, in_size=NBYTES - 4)
    assert fails(s.code("not_found"), s.infer, name + "_gone").startswith(
        f"Unable to find shared memory region: '{name}_gone'")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_trace_and_logging_refused_alike_and_not_announced(target: Target,
                                                           protocol: str) -> None:
    """mmguard refuses the trace and logging extensions with one reason on both fronts and
    does not list them in its server metadata; Triton serves them (a documented difference)."""
    if protocol == "grpc":
        client = grpcclient.InferenceServerClient(target.grpc_url)
        extensions = list(client.get_server_metadata().extensions)
        calls = [client.get_trace_settings, client.get_log_settings]
    else:
        client = httpclient.InferenceServerClient(target.http_url)
        extensions = list(client.get_server_metadata()["extensions"])
        calls = [client.get_trace_settings, client.get_log_settings]
    try:
        if not target.via_mmguard:
            assert {"trace", "logging"} <= set(extensions)
            for call in calls:
                call()
            return
        assert "trace" not in extensions and "logging" not in extensions
        for call, extension in zip(calls, ("trace", "logging"), strict=True):
            with pytest.raises(InferenceServerException) as err:
                call()
            assert err.value.status() in ("501", "StatusCode.UNIMPLEMENTED")
            assert err.value.message().startswith(
                f"the '{extension}' extension is not served by mmguard: ")
    finally:
        client.close()


def test_bytes_framing_in_a_region_in_tritons_words(shm_client: Shm) -> None:
    """A BYTES input read from system shared memory is held to the same framing, refused in the
    same words as inline (the region path did not hand the request down: mmguard's words)."""
    s = shm_client
    shape, raw, words = BYTES_FRAMING["bytes-fewer-than-the-shape"]
    name, key, handle = s.region("bytes_words", len(raw))
    shm.set_shared_memory_region(handle, [np.frombuffer(raw, np.uint8)])
    s.client.register_system_shared_memory(name, key, len(raw))
    x = s.module.InferInput("INPUT0", shape, "BYTES")
    x.set_shared_memory(name, len(raw))
    message = fails(s.code("invalid"), s.client.infer, "identity_bytes", [x])
    assert message.startswith(words), message


MISSES = [("GET", "/v2/models/small_fp32/infer"), ("PUT", "/v2/models/small_fp32/infer"),
          ("HEAD", "/v2/health/live"), ("HEAD", "/v2/models/small_fp32"),
          ("POST", "/v2/health/ready"), ("DELETE", "/v2"), ("OPTIONS", "/v2/models/stats"),
          ("GET", "/v2/repository/index"), ("HEAD", "/v2/systemsharedmemory/status"),
          ("GET", "/v2/"), ("POST", "/v2/models/small_fp32/infer/"), ("GET", "/nope")]


@pytest.mark.parametrize(("method", "path"), MISSES)
def test_a_path_or_method_not_served_reads_as_tritons(target: Target, method: str,
                                                      path: str) -> None:
    """Triton's status, and its words first: 405 ``Method Not Allowed`` (HEAD included, with
    no body), 404 ``Not Found``; mmguard's 405 adds the Allow header Triton leaves out."""
    import http.client
    host, port = target.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=b"{}" if method in ("POST", "PUT") else None)
        r = conn.getresponse()
        status, body, allow = r.status, r.read(), r.getheader("Allow")
    finally:
        conn.close()
    lead = "Not Found" if path in ("/v2/", "/nope") or path.endswith("/") else (
        "Method Not Allowed")
    assert status == (404 if lead == "Not Found" else 405), (status, body)
    if method == "HEAD":
        assert body == b""
    else:
        assert json.loads(body)["error"].startswith(lead), body
    if target.via_mmguard and status == 405:
        assert allow and method not in allow, allow


def test_more_raw_contents_than_inputs_are_served_as_triton_serves_them(target: Target) -> None:
    """Triton reads an input's bytes from the raw_input_contents in order and leaves any more
    unread; mmguard refused them, a call Triton serves."""
    with grpc.insecure_channel(target.grpc_url) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        one, three = (pb.ModelInferResponse.FromString(call(
            _shaped([1, 16], raws=n).SerializeToString(), timeout=30))
            for n in (1, 3))
    assert list(three.outputs[0].shape) == [1, 16]
    assert np.frombuffer(three.raw_output_contents[0], np.float32).tolist() == \
        np.frombuffer(one.raw_output_contents[0], np.float32).tolist() == \
        (np.frombuffer(X16, np.float32) * 2).tolist()  # the test model doubles its input
