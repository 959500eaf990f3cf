"""Triton's generate extension (``/generate``, ``/generate_stream``), direct and through mmguard
(both Triton backends): each request is sent to Triton itself and to mmguard, and mmguard's
answer must be Triton's — the same status and content type, the same bytes for an answer (the
keys in Triton's order, a one-element output as a value), and an error that starts with
Triton's words. A few answers are also pinned to what Triton 2.51 was seen to send, so a fixture
that broke both sides alike fails too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.wire import http_post

SSE = "text/event-stream; charset=utf-8"

CASES: dict[str, tuple[str, object]] = {
    "floats": ("identity_fp32", {"INPUT0": [1.5, 2, 3]}),
    "one-value": ("identity_fp32", {"INPUT0": 7}),
    "id-and-parameters": ("identity_fp32", {"INPUT0": [1, 2], "id": "abc", "temperature": 0.5,
                                            "flag": True, "n": 3, "s": "x"}),
    "text": ("identity_bytes", {"INPUT0": "hello"}),
    "texts": ("identity_bytes", {"INPUT0": ["a", "b"]}),
    "bools": ("identity_bool", {"INPUT0": [True, False]}),
    "ints": ("identity_int64", {"INPUT0": [1, 2, 3]}),
    "empty": ("identity_fp32", {"INPUT0": []}),
    "fixed-dims": ("small_fp32", {"x": [1.0] * 16}),
    "batch-dim-spread": ("batch4_fp32", {"x": [0.5] * 32}),
    "text-model": ("clip_text_trunc", {"text": ["a cat", "a dog"]}),
    "parameters-seen-by-the-model": ("echo_params", {"INPUT0": [1.0], "parameters": {
        "temperature": 0.5, "k": "v"}, "top": 3}),
    "input-twice": ("echo_params", {"INPUT0": [1.0], "parameters": {"INPUT0": [2.0]}}),
    "parameter-array": ("echo_params", {"INPUT0": [1.0], "bad": [1, 2]}),
    "parameter-object": ("echo_params", {"INPUT0": [1.0], "bad": {"a": 1}}),
    "parameters-not-object": ("echo_params", {"INPUT0": [1.0], "parameters": 5}),
    "count-not-spread": ("small_fp32", {"x": [1.0] * 15}),
    "string-for-fixed-dims": ("small_fp32", {"x": "str"}),
    "no-inputs": ("identity_fp32", {}),
    "no-inputs-of-two": ("clip_demo", {}),
    "one-input-of-two": ("clip_demo", {"input_ids": [0] * 77}),
    "id-not-string": ("identity_fp32", {"id": 5, "INPUT0": [1.0]}),
    "nested-array": ("identity_fp32", {"INPUT0": [[1, 2], [3, 4]]}),
    "model-fails": ("fail_fp32", {"x": [1.0]}),
    "unknown-model": ("nosuch", {"x": 1}),
    "fp16-as-json": ("identity_fp16", {"INPUT0": [1.0]}),
}
PINNED = {  # what Triton itself answered (seen with 2.51)
    "floats": b'{"OUTPUT0":[1.5,2.0,3.0],"model_name":"identity_fp32","model_version":"1"}',
    "one-value": b'{"OUTPUT0":7.0,"model_name":"identity_fp32","model_version":"1"}',
    "id-and-parameters": b'{"OUTPUT0":[1.0,2.0],"id":"abc","model_name":"identity_fp32",'
                         b'"model_version":"1"}',
}


@pytest.fixture(scope="module", params=["mmguard-grpc", "mmguard-http"])
def proxy(request: pytest.FixtureRequest,
          conformance_proxies: dict[str, RunningMmguard]) -> Iterator[RunningMmguard]:
    yield conformance_proxies[request.param]


def _post(url: str, path: str, body: bytes) -> tuple[int, str, bytes]:
    status, headers, data = http_post(url, path, body, {"Content-Type": "application/json"})
    return status, headers.get("Content-Type", ""), data


def _unordered(answer: bytes) -> bytes:
    """An answer with echo_params' PARAMS (the request's parameters as the model saw them, a
    map whose order the wire does not keep: gRPC's map is unordered) written in key order;
    the bytes around it untouched."""
    start = answer.find(b"{")
    if b'"PARAMS"' not in answer or start < 0:
        return answer
    doc = json.loads(answer[start:])
    doc["PARAMS"] = json.dumps(json.loads(doc["PARAMS"]), sort_keys=True)
    return answer[:start] + json.dumps(doc, separators=(",", ":")).encode()


def _same(direct: tuple[int, str, bytes], proxied: tuple[int, str, bytes], case: str) -> None:
    status, kind, body = direct
    if status == 500 and kind.startswith("application/json"):
        # Triton's JSON reader answers a client's mistake with 500, mmguard with 400, as on
        # infer (docs/triton-compat.md, "Differences that remain, on purpose")
        status = 400
    assert proxied[0] == status, (case, direct, proxied)
    if status == 200 and kind.startswith("application/json") and b'"error"' not in body:
        assert _unordered(proxied[2]) == _unordered(body), (case, direct, proxied)
        assert proxied[1].startswith("application/json")
        return
    if kind == SSE:  # an answer's events, or an error event once the model ran
        assert proxied[1] == SSE, (case, direct, proxied)
        assert [_unordered(e) for e in proxied[2].split(b"\n\n")] == \
            [_unordered(e) for e in body.split(b"\n\n")], (case, direct, proxied)
        return
    ours = json.loads(proxied[2])["error"]
    theirs = json.loads(body)["error"]
    # JSON readers word their complaints their own way: the lead is Triton's
    lead = theirs.split(": ")[0] + ": " if "JSON buffer" in theirs else theirs
    assert ours.startswith(lead), (case, theirs, ours)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", ["generate", "generate_stream"])
def test_a_generate_request_is_answered_as_triton_answers_it(
        triton: TritonServer, proxy: RunningMmguard, case: str, kind: str) -> None:
    model, doc = CASES[case]
    body = json.dumps(doc).encode()
    path = f"/v2/models/{model}/{kind}"
    direct = _post(triton.http_url, path, body)
    if case in PINNED:
        pinned = PINNED[case] if kind == "generate" else b"data: " + PINNED[case] + b"\n\n"
        assert direct[:1] == (200,) and direct[2] == pinned
    _same(direct, _post(proxy.http_url, path, body), f"{case} {kind}")


@pytest.mark.parametrize("body", [b"{nope", b"[1]", b""], ids=["malformed", "array", "empty"])
def test_a_body_that_is_not_a_json_object_is_refused_as_triton_refuses_it(
        triton: TritonServer, proxy: RunningMmguard, body: bytes) -> None:
    path = "/v2/models/identity_fp32/generate"
    _same(_post(triton.http_url, path, body), _post(proxy.http_url, path, body), repr(body))


def test_a_version_in_the_path_is_read_as_triton_reads_it(triton: TritonServer,
                                                          proxy: RunningMmguard) -> None:
    body = json.dumps({"INPUT0": [1.0]}).encode()
    for version in ("1", "9"):
        path = f"/v2/models/identity_fp32/versions/{version}/generate"
        _same(_post(triton.http_url, path, body), _post(proxy.http_url, path, body), version)


def test_the_model_sees_the_same_parameters_through_mmguard(triton: TritonServer,
                                                            proxy: RunningMmguard) -> None:
    body = json.dumps({"INPUT0": [1.0], "temperature": 0.25, "parameters": {"k": "v"}}).encode()
    path = "/v2/models/echo_params/generate"
    seen = [json.loads(json.loads(_post(url, path, body)[2])["PARAMS"])
            for url in (triton.http_url, proxy.http_url)]
    assert seen[0]["temperature"] == 0.25 and seen[0]["k"] == "v"
    assert seen[1] == seen[0]


def test_a_decoupled_model_streams_each_response_and_refuses_one_answer(
        triton: TritonServer, conformance_proxies: dict[str, RunningMmguard]) -> None:
    proxy = conformance_proxies["mmguard-grpc"]  # Triton streams decoupled models over gRPC
    body = json.dumps({"count": 3}).encode()
    for kind in ("generate_stream", "generate"):
        path = f"/v2/models/decoupled_counter/{kind}"
        direct = _post(triton.http_url, path, body)
        assert direct[0] == 200
        _same(direct, _post(proxy.http_url, path, body), kind)
    events = _post(proxy.http_url, "/v2/models/decoupled_counter/generate_stream", body)[2]
    assert [json.loads(e[len(b"data: "):])["value"] for e in events.split(b"\n\n") if e] == \
        [0, 1, 2]


def test_the_filter_chain_runs_on_generate(triton: TritonServer) -> None:
    """A guard a client could step around by changing the path is no guard: the shape guard
    refuses on generate what it refuses on infer."""
    config = {"backends": [{"kind": "triton_http", "name": "triton", "url": triton.http_url}],
              "models": [{"name": "clip_text_trunc", "backend": "triton", "filters": [
                  {"shape_guard": {"inputs": {"text": {"max_tokens": 3,
                                                       "tokenizer": "whitespace"}}}}]}]}
    with RunningMmguard(config) as proxy:
        proxy.wait_ready()
        status, _, data = _post(proxy.http_url, "/v2/models/clip_text_trunc/generate",
                                json.dumps({"text": "one two three four five"}).encode())
    assert status == 400, data
    assert json.loads(data)["error"].startswith("input 'text' has 5 tokens")


@pytest.mark.parametrize("coding", ["IDENTITY", "gzip"])
def test_a_coded_body_is_refused_as_triton_refuses_it(triton: TritonServer,
                                                      proxy: RunningMmguard, coding: str) -> None:
    """Triton's generate takes no coding but ``identity``, named exactly (mmguard read
    ``IDENTITY`` as identity)."""
    body = json.dumps({"INPUT0": [1.0]}).encode()
    headers = {"Content-Type": "application/json", "Content-Encoding": coding}
    path = "/v2/models/identity_fp32/generate"
    direct = http_post(triton.http_url, path, body, headers)
    got = http_post(proxy.http_url, path, body, headers)
    assert direct[0] == got[0] == 400
    assert json.loads(got[2])["error"] == json.loads(direct[2])["error"]
