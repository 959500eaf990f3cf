"""No untrusted client steers a canary's release verdict (issue 26, item 1), against a real
``mmguard serve`` with a real shadow pair on ONNX Runtime.

The attacks that broke it before:
- a tiny ``mmguard-timeout-ms`` made production answer 504 while the mirrored copy, under its
  own deadline, succeeded: two such calls aborted an identical canary;
- one request replayed 250 times under fresh ids, with an easy input, outvoted the honest
  traffic on which a canary is wrong half the time;
- ``mmguard-shadow: mirrored`` (and ``mmguard-fault``) told an untrusted client its treatment,
  which made finding a mirrored request cheap.
Each must fail now: the deadline attack is counted as ``unjudged{reason="deadline"}`` and adds
no comparison, the replays add one comparison between them, and an untrusted listener's answers
carry no treatment (while a listener that shows treatment does: the treatment did happen).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.adversarial.test_images import MODEL, FakeOpenAI
from tests.conftest import ort_config
from tests.support.adversary import Prober, http_call, serve
from tests.support.models import ort_repository, write_wrong_above_half
from tests.support.process import MmguardProcess
from tests.support.wire import grpc_infer_raw, grpc_request

HONEST = 30
REPLAYS = 250


@pytest.fixture(scope="module")
def fake_openai() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as fake:
        yield fake


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory,
         fake_openai: FakeOpenAI) -> Iterator[MmguardProcess]:
    models = ort_repository(tmp_path_factory.mktemp("verdict_models"))
    write_wrong_above_half(models)
    cfg: dict[str, Any] = ort_config(models, canary={"share": 1.0})
    # judged on agreement only: copies queue behind the primary on a busy machine
    shadow = {"queue_size": 1024, "on_abort": {"stop_mirroring": False},
              "verdict": {"max_latency_ratio": None}}
    fault = {"experiments": [{"name": "mark", "actions": [{"kind": "delay", "ms": 0}]}]}
    abort = {"experiments": [{"name": "outage", "actions": [
        {"kind": "abort", "http_status": 503, "message": "upstream unavailable"}],
        "stop": {"max_error_rate": None, "max_p99_ms": None}}]}
    cfg["backends"].append({"kind": "vllm", "name": "llm", "image_input": "no",
                            "url": f"http://127.0.0.1:{fake_openai.port}"})
    cfg["models"] = [
        {"name": "identity_fp32", "backend": "ort"},  # the probes
        {"name": "good", "backend": "ort", "backend_model": "identity_fp32",
         "filters": [{"shadow": {"canary": "good_canary", **shadow}}]},
        {"name": "good_canary", "backend": "ort", "backend_model": "identity_fp32"},
        {"name": "bad", "backend": "ort", "backend_model": "identity_fp32",
         "filters": [{"shadow": {"canary": "bad_canary", **shadow}}]},
        {"name": "bad_canary", "backend": "ort", "backend_model": "wrong_above_half_fp32"},
        {"name": "faulted", "backend": "ort", "backend_model": "identity_fp32",
         "filters": [{"fault": fault}]},
        {"name": "aborted", "backend": "ort", "backend_model": "identity_fp32",
         "filters": [{"fault": abort}]},
        {"name": MODEL, "backend": "llm",
         "filters": [{"fault": {"experiments": [{**fault["experiments"][0], "name": "chat"}]}},
                     {"shadow": {"canary": "chat_canary", **shadow}}]},
        {"name": "chat_canary", "backend": "llm", "backend_model": MODEL},
        {"name": "guarded", "backend": "ort", "backend_model": "identity_fp32",
         "filters": [{"fallback": {"breaker": {"minimum_calls": 5, "failure_rate": 0.5}}}]},
    ]
    # The HTTP listener is untrusted (the default); the gRPC one shows treatment: the control
    # that proves the treatment the HTTP answers hide did happen.
    cfg["listeners"] = {"grpc": {"treatment_headers": True}}
    with serve(tmp_path_factory.mktemp("verdict"), cfg) as proc:
        yield proc


def _infer(proc: MmguardProcess, model: str, value: float,
           headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1],
                                   "data": [value]}]}).encode()
    return http_call(proc.ports["http"], "POST", f"/v2/models/{model}/infer", body,
                     {"Content-Type": "application/json", **(headers or {})})


def _shadow(proc: MmguardProcess, route: str) -> dict[str, Any]:
    status, _, body = http_call(proc.ports["admin"], "GET", "/admin/shadows")
    assert status == 200, body
    found: dict[str, Any] = json.loads(body)[route]
    return found


def _settled(proc: MmguardProcess, route: str, done: int) -> dict[str, Any]:
    """The route's shadow once ``done`` calls are compared or refused as replays."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        snap = _shadow(proc, route)
        if snap["compared"] + snap["unjudged"].get("replay", 0) >= done and not snap["queued"]:
            return snap
        time.sleep(0.1)
    raise AssertionError(f"the shadow of {route!r} did not settle: {_shadow(proc, route)}")


def _metric(proc: MmguardProcess, name: str, **labels: str) -> float:
    _, _, body = http_call(proc.ports["admin"], "GET", "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels}")


def test_a_tiny_client_deadline_never_counts_against_a_good_canary(
        pair: MmguardProcess) -> None:
    for i in range(HONEST):  # honest traffic: an identical canary agrees on every call
        assert _infer(pair, "good", 1.0 + i)[0] == 200
    before = _settled(pair, "good", HONEST)
    assert before["compared"] == HONEST
    with Prober(pair.ports["http"]) as probe:
        answers = [_infer(pair, "good", 100.0 + i, {"mmguard-timeout-ms": "0.001"})[0]
                   for i in range(20)]
        time.sleep(1.0)
    probe.assert_served()
    assert set(answers) == {504}, answers  # production really timed out, every time
    after = _shadow(pair, "good")
    # Before the fix: 20 disagreements (the copies succeeded) and an abort.
    assert after["compared"] == HONEST, after
    assert after["unjudged"].get("deadline") == 20, after
    assert after["state"] != "abort", after
    labels = {"model": "good", "canary": "good_canary"}
    assert _metric(pair, "mmguard_shadow_comparisons_total", agree="false", **labels) == 0
    assert _metric(pair, "mmguard_shadow_unjudged_total", reason="deadline", **labels) == 20


def test_one_replayed_request_counts_once_however_often_and_under_whatever_id(
        pair: MmguardProcess) -> None:
    with Prober(pair.ports["http"]) as probe:
        for i in range(REPLAYS):  # one easy request, fresh ids: the header and the body's id
            headers = {"x-request-id": f"replay-{i}"} if i % 2 else {}
            assert _infer(pair, "bad", 0.1, headers)[0] == 200
        for i in range(HONEST):  # honest traffic: half of it above 0.5, where the canary is wrong
            assert _infer(pair, "bad", (i + 0.5) / HONEST)[0] == 200
        snap = _settled(pair, "bad", REPLAYS + HONEST)
    probe.assert_served()
    assert snap["compared"] == HONEST + 1, snap
    assert snap["unjudged"].get("replay") == REPLAYS - 1, snap
    labels = {"model": "bad", "canary": "bad_canary"}
    assert _metric(pair, "mmguard_shadow_comparisons_total", agree="true", **labels) == 16
    assert _metric(pair, "mmguard_shadow_comparisons_total", agree="false", **labels) == 15
    assert snap["state"] != "promote", snap


def test_an_untrusted_client_never_learns_its_treatment(pair: MmguardProcess,
                                                        fake_openai: FakeOpenAI) -> None:
    for model in ("good", "faulted"):
        status, headers, _ = _infer(pair, model, 7.0)
        assert status == 200
        leaked = sorted(k for k in headers if k in ("mmguard-shadow", "mmguard-fault"))
        assert not leaked, f"{model}: {leaked} sent to an untrusted client"
    status, headers, body = _infer(pair, "aborted", 7.0)
    assert status == 503 and "mmguard-fault" not in headers
    error = json.loads(body)["error"]
    assert error == "upstream unavailable", error  # not "... (outage/abort)"
    # the OpenAI front (a fake vLLM that does not stream: the streamed answer's headers come
    # from the same ``Call.shown_decisions``)
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    status, headers, answer = http_call(pair.ports["http"], "POST", "/v1/chat/completions",
                                        chat.encode(), {"Content-Type": "application/json"})
    assert status == 200, answer
    assert not {"mmguard-shadow", "mmguard-fault"} & set(headers), headers

    # The control: the same calls on the listener that shows treatment carry it.
    for model, header in (("good", "mmguard-shadow"), ("faulted", "mmguard-fault")):
        raw = grpc_request(model, [("INPUT0", "FP32", [1], b"\x00\x00\xe0\x40")])
        _, trailers = grpc_infer_raw(f"127.0.0.1:{pair.ports['grpc']}", raw)
        assert header in dict(trailers), (model, trailers)


def test_a_tiny_client_deadline_never_opens_a_breaker_for_everyone(pair: MmguardProcess) -> None:
    """The sibling on the fallback filter: timeouts count against a backend's breaker, and the
    client chooses its deadline. Before: ten calls with ``mmguard-timeout-ms: 0.001`` opened
    the breaker, and every client's calls went to the next level for ``wait_in_open_s``."""
    answers = [_infer(pair, "guarded", 1.0 + i, {"mmguard-timeout-ms": "0.001"})[0]
               for i in range(10)]
    assert set(answers) <= {503, 504}, answers  # its own call fails (the fallback's 503)
    status, _, body = http_call(pair.ports["admin"], "GET", "/admin/breakers")
    breaker = next(b for b in json.loads(body) if b["route"] == "guarded")
    assert breaker["state"] == "closed" and breaker["calls_in_window"] == 0, breaker
    status, headers, _ = _infer(pair, "guarded", 3.0)
    assert status == 200 and "mmguard-fallback-level" not in headers, headers
