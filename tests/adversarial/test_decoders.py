"""Small requests that made the request decoders stall the event loop or grow memory (issue 15,
items 3, 4 and 15), sent to a real ``mmguard serve`` while a probe client sends a good request
every 100 ms: each is refused with its own clear message, no probe waits past the bound, and the
process's RSS grows by less than ``RSS_BOUND_MIB``.

Before the fix (measured here against the old decoders): 4 M empty BYTES elements for a shape of
[1] held every probe for 3+ s; a 7 MiB ``int64_contents`` for a shape of [1] for 2+ s and
hundreds of MiB; an error naming 4,000 unknown inputs reached the gRPC client as
RESOURCE_EXHAUSTED (a 416 KB message does not fit gRPC metadata). Every message is now cut at
``MAX_MESSAGE_CHARS`` where it is made (``ProxyError``, ``LocalReply``), and lists of names show
the first few and a count.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from proxy.errors import MAX_HEADER_CHARS, MAX_MESSAGE_CHARS
from proxy.pb import grpc_service_pb2 as pb
from tests.conftest import ort_config
from tests.support.adversary import Prober, http_call, rss_mib, serve
from tests.support.process import MmguardProcess
from tests.support.wire import INFER, http_binary_body

RSS_BOUND_MIB = 100
EMPTY_ELEMENTS = 4 * 1024 * 1024
"""Empty BYTES elements in the framing attack: 16 MiB of zero bytes (294 bytes gzipped)."""
CONTENTS_BYTES = 7 * 1024 * 1024


@dataclass
class Answer:
    code: int | grpc.StatusCode
    message: str


@dataclass
class Outcome:
    answer: Answer
    worst_probe_s: float
    rss_growth_mib: float


def attack(served: MmguardProcess, send: Callable[[MmguardProcess], Answer]) -> Outcome:
    """``send`` while the probes run; every probe must be answered within the bound."""
    before = rss_mib(served.proc.pid)
    with Prober(served.ports["http"]) as probes:
        time.sleep(0.2)
        answer = send(served)
        time.sleep(0.3)  # probes queued behind a stalled loop are answered (and timed) by now
    growth = rss_mib(served.proc.pid) - before
    worst = max(r.waited for r in probes.records)
    print(f"\n  worst probe wait {worst:.3f} s, RSS growth {growth:.1f} MiB, "
          f"answer {answer.code} {answer.message[:120]!r}")
    probes.assert_served()
    assert growth < RSS_BOUND_MIB, f"RSS grew by {growth:.0f} MiB"
    return Outcome(answer, worst, growth)


def http_infer(model: str, body: bytes, header_length: int | None = None
               ) -> Callable[[MmguardProcess], Answer]:
    headers = {} if header_length is None else {
        "Inference-Header-Content-Length": str(header_length)}

    def send(served: MmguardProcess) -> Answer:
        status, _, answer = http_call(served.ports["http"], "POST", f"/v2/models/{model}/infer",
                                      body, headers)
        return Answer(status, json.loads(answer)["error"])
    return send


def grpc_infer(body: bytes) -> Callable[[MmguardProcess], Answer]:
    def send(served: MmguardProcess) -> Answer:
        with grpc.insecure_channel(f"127.0.0.1:{served.ports['grpc']}") as channel:
            try:
                channel.unary_unary(INFER)(body, timeout=30)
            except grpc.RpcError as err:
                return Answer(err.code(), err.details() or "")
        raise AssertionError("the attack was answered with a result")
    return send


def grpc_body(name: str, datatype: str, shape: list[int], raw: bytes | None = None,
              model: str = "identity_bytes", **contents: object) -> bytes:
    req = pb.ModelInferRequest(model_name=model)
    tensor = req.inputs.add(name=name, datatype=datatype, shape=shape)
    for field, values in contents.items():
        getattr(tensor.contents, field).extend(values)
    if raw is not None:
        req.raw_input_contents.append(raw)
    return bytes(req.SerializeToString())


# --- item 3: BYTES framing ----------------------------------------------------------------------

EMPTY = b"\0" * (4 * EMPTY_ELEMENTS)
ALTERNATING = b"\0\0\0\0\1\0\0\0x" * (EMPTY_ELEMENTS // 2)
"""Empty and one-byte elements in turn: no equal-length shortcut, the walk must stop early."""


@pytest.mark.parametrize("payload", [EMPTY, ALTERNATING], ids=["empty", "alternating"])
def test_bytes_framing_past_the_shape_over_http_binary(served: MmguardProcess,
                                                       payload: bytes) -> None:
    body, hlen = http_binary_body([("INPUT0", "BYTES", [1], payload)])
    out = attack(served, http_infer("identity_bytes", body, hlen))
    assert out.answer.code == 400
    assert out.answer.message == ("[request id: <id_unknown>] unexpected number of string "
                                  "elements 2 for inference input 'INPUT0' for model "
                                  "'identity_bytes', expecting 1")


@pytest.mark.parametrize("payload", [EMPTY, ALTERNATING], ids=["empty", "alternating"])
def test_bytes_framing_past_the_shape_over_grpc(served: MmguardProcess, payload: bytes) -> None:
    out = attack(served, grpc_infer(grpc_body("INPUT0", "BYTES", [1], payload)))
    assert out.answer.code == grpc.StatusCode.INVALID_ARGUMENT
    assert out.answer.message == ("[request id: <id_unknown>] unexpected number of string "
                                  "elements 2 for inference input 'INPUT0' for model "
                                  "'identity_bytes', expecting 1")


def test_bytes_json_data_past_the_shape(served: MmguardProcess) -> None:
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1],
                                   "data": [""] * 1_000_000}]}).encode()
    out = attack(served, http_infer("identity_bytes", body))
    assert out.answer.code == 400
    assert out.answer.message == ("Unable to parse 'data': Shape does not match true shape of "
                                  "'data' field (input 'INPUT0': shape needs 1 BYTES elements, "
                                  "got more than 1026 in 'data')")


# --- item 4: typed contents and every repeated field ----------------------------------------------


def test_int64_contents_far_past_the_shape(served: MmguardProcess) -> None:
    body = grpc_body("INPUT0", "INT64", [1], model="identity_int64",
                     int64_contents=[0] * CONTENTS_BYTES)
    out = attack(served, grpc_infer(body))
    assert out.answer.code == grpc.StatusCode.INVALID_ARGUMENT
    assert out.answer.message == (f"[request id: <id_unknown>] input byte size mismatch for "
                                  f"input 'INPUT0' for model 'identity_int64'. Expected 8, got "
                                  f"{8 * CONTENTS_BYTES} (shape [1] needs 1 INT64 elements, "
                                  f"int64_contents holds {CONTENTS_BYTES})")


def test_bytes_contents_far_past_the_shape(served: MmguardProcess) -> None:
    body = grpc_body("INPUT0", "BYTES", [1], bytes_contents=[b""] * (CONTENTS_BYTES // 2))
    out = attack(served, grpc_infer(body))
    assert out.answer.code == grpc.StatusCode.INVALID_ARGUMENT
    assert out.answer.message == ("input 'INPUT0': shape [1] needs 1 BYTES elements, "
                                  "bytes_contents holds more than 1")


def test_json_int64_data_far_past_the_shape(served: MmguardProcess) -> None:
    # 2 MB of JSON: a larger body mostly times json.loads, which the front's JSON limit bounds.
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT64", "shape": [1],
                                   "data": [0] * 1_000_000}]}).encode()
    out = attack(served, http_infer("identity_int64", body))
    assert out.answer.code == 400
    assert out.answer.message == ("Unable to parse 'data': Shape does not match true shape of "
                                  "'data' field (input 'INPUT0': INT64 shape [1] needs 8 bytes, "
                                  "got more than 8208: more than 1026 elements in 'data')")


def test_a_hundred_thousand_inputs_over_grpc(served: MmguardProcess) -> None:
    req = pb.ModelInferRequest(model_name="identity_fp32")
    for i in range(100_000):
        req.inputs.add(name=f"in{i}", datatype="FP32", shape=[1])
    out = attack(served, grpc_infer(req.SerializeToString()))
    assert out.answer.code == grpc.StatusCode.INVALID_ARGUMENT
    assert out.answer.message == ("the request has more than 4096 inputs; mmguard takes at "
                                  "most 4096")


def test_millions_of_tiny_fields_over_grpc(served: MmguardProcess) -> None:
    body = b"\x1a\x00" * (CONTENTS_BYTES // 2)  # the request id, sent 3.6 million times
    out = attack(served, grpc_infer(body))
    assert out.answer.code == grpc.StatusCode.INVALID_ARGUMENT
    assert out.answer.message == ("the request has more than 50000 protobuf fields outside its "
                                  "tensor payloads; mmguard takes at most 50000")


def test_ten_thousand_inputs_over_http(served: MmguardProcess) -> None:
    body = json.dumps({"inputs": [{"name": f"in{i}", "datatype": "FP32", "shape": [1],
                                   "data": [1]} for i in range(10_000)]}).encode()
    out = attack(served, http_infer("identity_fp32", body))
    assert out.answer.code == 400
    assert out.answer.message == "'inputs' has 10000 inputs; mmguard takes at most 4096"


# --- item 15: an error naming thousands of inputs -----------------------------------------------

UNKNOWN = [(f"unknown_input_{i:05d}_" + "x" * 80, "FP32", [1], b"\0" * 4) for i in range(4000)]


def _check_bounded(message: str) -> None:
    assert len(message) <= MAX_MESSAGE_CHARS, len(message)
    assert message.startswith("model 'identity_fp32' expects inputs ['INPUT0']; unknown: "
                              "['unknown_input_00000_"), message[:200]
    assert message.endswith(", ... and 3995 more]; missing: ['INPUT0']"), message[-200:]


def test_error_naming_thousands_of_inputs_is_bounded_over_grpc(served: MmguardProcess) -> None:
    req = pb.ModelInferRequest(model_name="identity_fp32")
    for name, datatype, shape, raw in UNKNOWN:
        req.inputs.add(name=name, datatype=datatype, shape=shape)
        req.raw_input_contents.append(raw)
    out = attack(served, grpc_infer(req.SerializeToString()))
    assert out.answer.code == grpc.StatusCode.INVALID_ARGUMENT, out.answer
    _check_bounded(out.answer.message)


def test_error_naming_thousands_of_inputs_is_bounded_over_http(served: MmguardProcess) -> None:
    body, hlen = http_binary_body(UNKNOWN)
    out = attack(served, http_infer("identity_fp32", body, hlen))
    assert out.answer.code == 400
    _check_bounded(out.answer.message)


def test_shape_guard_refusal_of_thousands_of_inputs_fits_grpc_metadata(
        ort_models: Path, tmp_path: Path) -> None:
    # shape_guard joins one violation per unknown input into its message AND its decision
    # trailer: both went out whole (the client saw RESOURCE_EXHAUSTED).
    cfg = ort_config(ort_models)
    cfg["models"] = [{"name": "guarded", "backend": "ort", "backend_model": "identity_fp32",
                      "filters": [{"shape_guard": {}}]},
                     {"name": "identity_fp32", "backend": "ort"}]
    req = pb.ModelInferRequest(model_name="guarded")
    for name, datatype, shape, raw in UNKNOWN:
        req.inputs.add(name=name, datatype=datatype, shape=shape)
        req.raw_input_contents.append(raw)
    body = req.SerializeToString()
    with serve(tmp_path, cfg) as proc:
        channel = grpc.insecure_channel(f"127.0.0.1:{proc.ports['grpc']}")
        with channel, pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(INFER).with_call(body, timeout=30)
    rpc: Any = err.value
    assert rpc.code() is grpc.StatusCode.INVALID_ARGUMENT, rpc.details()
    details = rpc.details()
    assert len(details) <= MAX_MESSAGE_CHARS
    assert details.startswith("model 'identity_fp32' has no input 'unknown_input_00000_")
    trailers = dict(rpc.trailing_metadata())
    decision = trailers["mmguard-shape-unknown-input"]
    assert decision.startswith("reject; model 'identity_fp32' has no input 'unknown_input_00000_")
    assert len(decision) <= MAX_HEADER_CHARS


def test_a_megabyte_model_name_is_not_sent_back_whole(served: MmguardProcess) -> None:
    name = "m" * (1024 * 1024)
    out = attack(served, grpc_infer(grpc_body("INPUT0", "FP32", [1], b"\0" * 4, model=name)))
    assert out.answer.code == grpc.StatusCode.NOT_FOUND, out.answer
    assert len(out.answer.message) <= MAX_MESSAGE_CHARS
    assert out.answer.message.startswith("Request for unknown model: 'mmmm")
    assert out.answer.message.endswith(" more characters]")


# --- a shape that matches: the walk is long, so it runs in a worker thread ----------------------


WALKED = ALTERNATING * 3
WALKED_COUNT = 3 * EMPTY_ELEMENTS


def test_shape_matched_bytes_walk_over_grpc_is_off_the_loop(served: MmguardProcess) -> None:
    """12 M alternating elements (54 MiB) for a shape one larger: every element is walked before
    the count falls short (1-3 s on the loop before the fronts decoded big bodies in a thread)."""
    body = grpc_body("INPUT0", "BYTES", [WALKED_COUNT + 1], raw=WALKED)
    out = attack(served, grpc_infer(body))
    assert out.answer.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"expected {WALKED_COUNT + 1} string elements" in out.answer.message


def test_shape_matched_bytes_walk_over_http_is_off_the_loop(served: MmguardProcess) -> None:
    body, hlen = http_binary_body([("INPUT0", "BYTES", [WALKED_COUNT + 1], WALKED)])
    out = attack(served, http_infer("identity_bytes", body, hlen))
    assert out.answer.code == 400
    assert f"expected {WALKED_COUNT + 1} string elements" in out.answer.message
