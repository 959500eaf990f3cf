"""Fault injection on canary traffic, through real clients and in-process ONNX Runtime (and a
real vLLM for the stream faults): each fault changes canary answers as configured, every other
call is answered byte for byte as without the filter, perturbations follow their seed,
experiments stop themselves, and the admin API needs its token."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import openai
import pytest
from numpy.typing import NDArray
from onnx import TensorProto, helper

from filters.fault.registry import EXPERIMENTS
from proxy.pb import grpc_service_pb2 as pb
from tests.conftest import ort_config
from tests.support.mmguard import RunningMmguard
from tests.support.vllm import VllmServer
from tests.support.wire import grpc_infer_raw, grpc_request, http_binary_body, http_post

CANARY = (("x-canary", "1"),)
TOKEN = "s3cret-admin-token"


def write_mm_identity(model_dir: Path) -> None:
    """``mm_identity``: pixel_values FP32 [n,3,h,w] and input_ids INT64 [n,t] come back as
    they went in, so an answer shows exactly what the backend was given."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["pixel_values"], ["pixels_seen"]),
         helper.make_node("Identity", ["input_ids"], ["ids_seen"])], "mm_identity",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["n", 3, "h", "w"]),
         helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["n", "t"])],
        [helper.make_tensor_value_info("pixels_seen", TensorProto.FLOAT, ["n", 3, "h", "w"]),
         helper.make_tensor_value_info("ids_seen", TensorProto.INT64, ["n", "t"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = model_dir / "mm_identity" / "1" / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)


@pytest.fixture(scope="module")
def models(ort_models: Path) -> Path:
    write_mm_identity(ort_models)
    return ort_models


def fault_config(models: Path, experiments: list[dict[str, Any]], *, trust: bool = True,
                 token: str | None = TOKEN, **extra: Any) -> dict[str, Any]:
    cfg = ort_config(models)
    cfg["models"] = [
        {"name": "mm", "backend": "ort", "backend_model": "mm_identity",
         "filters": [{"fault": {"experiments": [e for e in experiments
                                                if e.get("route") != "text"]}}]},
        {"name": "mm_plain", "backend": "ort", "backend_model": "mm_identity", "filters": []},
        {"name": "text", "backend": "ort", "backend_model": "identity_bytes",
         "filters": [{"fault": {"experiments": [e for e in experiments
                                                if e.get("route") == "text"]}}]},
    ]
    for e in experiments:
        e.pop("route", None)
    cfg["canary"] = {"headers": {"x-canary": "1"}}
    cfg["listeners"] = {"grpc": {"trust_canary_headers": trust},
                        "http": {"trust_canary_headers": trust},
                        "admin": {"token": token}}
    cfg.update(extra)
    return cfg


def pixels(seed: int = 0) -> NDArray[np.float32]:
    return np.random.default_rng(seed).random((1, 3, 32, 32), dtype=np.float32)


IDS = np.array([[49406, 320, 1000, 2000, 3000, 4000, 5000, 49407]], dtype=np.int64)


def mm_request(model: str = "mm", px: NDArray[Any] | None = None) -> bytes:
    px = pixels() if px is None else px
    return grpc_request(model, [("pixel_values", "FP32", list(px.shape), px.tobytes()),
                                ("input_ids", "INT64", list(IDS.shape), IDS.tobytes())])


def infer(m: RunningMmguard, body: bytes, canary: bool = True,
          request_id: str | None = None) -> tuple[pb.ModelInferResponse, dict[str, str], bytes]:
    meta = CANARY if canary else ()
    if request_id is not None:
        meta = (*meta, ("x-request-id", request_id))
    raw, trailers = grpc_infer_raw(m.grpc_url, body, metadata=meta)
    return pb.ModelInferResponse.FromString(raw), dict(trailers or ()), raw


def out(resp: pb.ModelInferResponse, name: str) -> NDArray[Any]:
    i = [o.name for o in resp.outputs].index(name)
    dtype = {"FP32": np.float32, "INT64": np.int64}[resp.outputs[i].datatype]
    return np.frombuffer(resp.raw_output_contents[i], dtype).reshape(list(resp.outputs[i].shape))


def experiment(name: str, *actions: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"name": name, "actions": list(actions), **kw}


def admin(m: RunningMmguard, path: str, body: dict[str, Any] | None = None,
          token: str | None = TOKEN) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(m.admin_url + path, headers=headers,
                                 data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


# --- canary only --------------------------------------------------------------------------------


ALL_INPUT_FAULTS = [
    {"kind": "gaussian_noise", "sigma": 0.1},
    {"kind": "sign_noise", "eps": 0.03},
    {"kind": "patch_mask", "ratio": 0.5, "patch": 8, "tokens": "input_ids"},
    {"kind": "token_dropout", "p": 0.5},
    {"kind": "precision", "mode": "round", "decimals": 1},
    {"kind": "blur", "radius": 2},
    {"kind": "darken", "factor": 0.3},
    {"kind": "quantise", "levels": 4},
    {"kind": "nan_output", "outputs": ["pixels_seen"], "share": 0.1},
]


def test_non_canary_calls_are_byte_identical_to_no_filter(models: Path) -> None:
    cfg = fault_config(models, [experiment("everything", *ALL_INPUT_FAULTS,
                                           {"kind": "delay", "ms": 1},
                                           stop={"max_error_rate": None, "max_p99_ms": None})])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        plain, _, _ = infer(m, mm_request("mm_plain"), canary=False)
        guarded, trailers, _ = infer(m, mm_request("mm"), canary=False)
        plain.model_name = "mm"  # the one field that names the route
        assert (guarded.SerializeToString(deterministic=True)  # maps in one order
                == plain.SerializeToString(deterministic=True))
        assert guarded.raw_output_contents[0] == pixels().tobytes()
        assert not any(k.startswith("mmguard-fault") for k in trailers)
        # HTTP binary too
        body, hlen = http_binary_body([("pixel_values", "FP32", [1, 3, 32, 32], pixels().tobytes()),
                                       ("input_ids", "INT64", [1, 8], IDS.tobytes())],
                                      outputs=["pixels_seen", "ids_seen"])
        hdr = {"Inference-Header-Content-Length": str(hlen),
               "Content-Type": "application/octet-stream"}
        a = http_post(m.http_url, "/v2/models/mm_plain/infer", body, hdr)
        b = http_post(m.http_url, "/v2/models/mm/infer", body, hdr)
        assert a[0] == b[0] == 200
        a_len = int({k.lower(): v for k, v in a[1].items()}["inference-header-content-length"])
        b_len = int({k.lower(): v for k, v in b[1].items()}["inference-header-content-length"])
        assert a[2][a_len:] == b[2][b_len:]  # the tensors, byte for byte
        head_a, head_b = json.loads(a[2][:a_len]), json.loads(b[2][:b_len])
        assert {**head_a, "model_name": "mm"} == head_b
        # and the canary call is changed, and says so
        resp, trailers, _ = infer(m, mm_request("mm"))
        assert not np.array_equal(out(resp, "pixels_seen")[~np.isnan(out(resp, "pixels_seen"))],
                                  pixels().reshape(-1)[~np.isnan(out(resp, "pixels_seen")
                                                                 .reshape(-1))])
        assert trailers["mmguard-fault"].startswith("everything/")


def test_untrusted_canary_headers_are_stripped(models: Path) -> None:
    cfg = fault_config(models, [experiment("noise", {"kind": "gaussian_noise", "sigma": 0.2})],
                       trust=False)
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        resp, trailers, _ = infer(m, mm_request())  # says x-canary: 1, but is not trusted
        assert np.array_equal(out(resp, "pixels_seen"), pixels())
        assert "mmguard-fault" not in trailers


@pytest.mark.parametrize("action", ALL_INPUT_FAULTS, ids=lambda a: a["kind"])
def test_each_input_fault_changes_canary_answers_as_specified(models: Path,
                                                              action: dict[str, Any]) -> None:
    cfg = fault_config(models, [experiment("e", action, stop={"max_error_rate": None})])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        resp, trailers, _ = infer(m, mm_request())
        seen, ids = out(resp, "pixels_seen"), out(resp, "ids_seen")
        assert trailers["mmguard-fault"].startswith(f"e/{action['kind']}")
        x = pixels()
        kind = action["kind"]
        if kind == "gaussian_noise":
            assert 0.05 < float(np.std(seen - x)) < 0.15  # σ 0.1, a little less after clamping
            assert seen.min() >= 0 and seen.max() <= 1 and not np.array_equal(seen, x)
        elif kind == "sign_noise":
            diff = np.abs(seen - x)
            assert diff.max() <= 0.03 + 1e-6 and diff.mean() > 0.01
        elif kind == "patch_mask":
            masked = (seen == 0).all(axis=1)[0]  # [h, w]: every channel zero
            assert 0.3 < masked.mean() < 0.7  # half the 8x8 patches
            assert (ids == 0).sum() > 0 and ids.shape == IDS.shape
        elif kind == "token_dropout":
            kept = ids[ids != 0]
            assert len(kept) < IDS.size and ids.shape == IDS.shape
            assert list(kept) == [t for t in IDS[0] if t in set(kept)]  # order kept
        elif kind == "precision":
            assert np.array_equal(seen, np.round(x, 1))
        elif kind == "blur":
            assert np.var(np.diff(seen, axis=-1)) < np.var(np.diff(x, axis=-1)) / 2
        elif kind == "darken":
            np.testing.assert_allclose(seen, x * 0.3, rtol=1e-6)
        elif kind == "quantise":
            assert len(np.unique(seen)) <= 4
        elif kind == "nan_output":
            assert np.isnan(seen).mean() == pytest.approx(0.1, abs=0.01)
            assert np.array_equal(ids, IDS)


def test_same_seed_same_perturbation_other_seed_another(models: Path) -> None:
    results: dict[int, list[tuple[bytes, bytes]]] = {}
    for seed in (1, 1, 2):
        cfg = fault_config(models, [experiment("s", {"kind": "gaussian_noise", "sigma": 0.1},
                                               seed=seed)])
        with RunningMmguard(cfg) as m:
            m.wait_ready()
            a = out(infer(m, mm_request(), request_id="req-7")[0], "pixels_seen")
            b = out(infer(m, mm_request(), request_id="req-8")[0], "pixels_seen")
            results.setdefault(seed, []).append((a.tobytes(), b.tobytes()))
    assert results[1][0] == results[1][1]  # same seed, same request key: identical
    assert results[1][0][0] != results[1][0][1]  # another request key: another draw
    assert results[2][0][0] != results[1][0][0]  # another seed: another perturbation


def test_gradient_fgsm_against_a_torchscript_surrogate(models: Path, tmp_path: Path) -> None:
    import torch

    class Score(torch.nn.Module):  # a differentiable "similarity" of the image
        def forward(self, image: torch.Tensor) -> torch.Tensor:
            return (image * torch.linspace(-1, 1, image.shape[-1])).mean()

    path = tmp_path / "surrogate.pt"
    with warnings.catch_warnings():  # TorchScript is deprecated in 2.13, still what loads here
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(Score()).save(str(path))  # type: ignore[no-untyped-call]  # ScriptModule.save: unannotated
    cfg = fault_config(models, [experiment("adv", {"kind": "fgsm", "eps": 0.03,
                                                   "surrogate": str(path)})])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        resp, trailers, _ = infer(m, mm_request())
    seen, x = out(resp, "pixels_seen"), pixels()
    assert trailers["mmguard-fault"].startswith("adv/fgsm")
    assert np.abs(seen - x).max() <= 0.03 + 1e-6
    score = Score()
    assert float(score(torch.from_numpy(seen.copy()))) < float(score(torch.from_numpy(x)))


def test_text_faults_on_bytes_tensors(models: Path) -> None:
    exps = [experiment("txt", {"kind": "mixed_scripts", "share": 1.0}, route="text"),
            experiment("cut", {"kind": "cut_text", "keep": 0.5}, route="text",
                       headers={"x-cut": "1"})]
    cfg = fault_config(models, exps)
    text = b"a clear photo of a red bus on a road"
    body = grpc_request("text", [("INPUT0", "BYTES", [1],
                                  len(text).to_bytes(4, "little") + text)])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        resp, trailers, _ = infer(m, body)
        assert trailers["mmguard-fault"].startswith("txt/mixed_scripts")
        got = resp.raw_output_contents[0][4:].decode()
        assert got != text.decode() and len(got) == len(text.decode())
        assert any(ord(c) > 127 for c in got)  # look-alike letters from other scripts
        raw, _trailers = grpc_infer_raw(m.grpc_url, body, metadata=(*CANARY, ("x-cut", "1")))
        cut = pb.ModelInferResponse.FromString(raw).raw_output_contents[0][4:].decode()
        assert len(cut) < len(text)


def test_drop_modality_removes_the_input(models: Path) -> None:
    cfg = fault_config(models, [experiment("blind", {"kind": "drop_modality",
                                                     "inputs": ["pixel_values"]})])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        with pytest.raises(grpc.RpcError) as exc:  # the model needs it: ORT says what is missing
            infer(m, mm_request())
        assert "pixel_values" in (exc.value.details() or "")
        assert dict(exc.value.trailing_metadata())["mmguard-fault"].startswith("blind/")


# --- transport faults ---------------------------------------------------------------------------


def test_abort_and_delay(models: Path) -> None:
    cfg = fault_config(models, [
        experiment("abort", {"kind": "abort", "grpc_code": "UNAVAILABLE", "http_status": 503,
                             "percent": 50}, stop={"max_error_rate": None}),
        experiment("slow", {"kind": "delay", "ms": 150}, headers={"x-slow": "1"},
                   stop={"max_error_rate": None})])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        codes = []
        for i in range(40):
            try:
                infer(m, mm_request(), request_id=f"r{i}")
                codes.append("ok")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                assert dict(err.trailing_metadata())["mmguard-fault"].startswith("abort/abort")
                codes.append("aborted")
        assert 5 < codes.count("aborted") < 35  # about half, chosen by request key
        again = []  # the same request keys get the same treatment
        for i in range(40):
            try:
                infer(m, mm_request(), request_id=f"r{i}")
                again.append("ok")
            except grpc.RpcError:
                again.append("aborted")
        assert again == codes
        status, _, body = http_post(m.http_url, "/v2/models/mm/infer", json.dumps(
            {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 1, 1],
                         "data": [0.1, 0.2, 0.3]},
                        {"name": "input_ids", "datatype": "INT64", "shape": [1, 1],
                         "data": [1]}]}).encode(),
            {"x-canary": "1", "x-request-id": f"r{codes.index('aborted')}"})
        assert status == 503 and b"fault injected" in body
        metrics = urllib.request.urlopen(m.admin_url + "/metrics").read().decode()
        assert 'code="injected"' in metrics and 'code="unavailable"' not in metrics
        assert 'mmguard_faults_injected_total{action="abort",experiment="abort",model="mm"}' \
            in metrics
        # delay: only calls with x-slow, and it is marked
        ok_id = f"r{codes.index('ok')}"
        start = time.monotonic()
        _raw, trailers = grpc_infer_raw(m.grpc_url, mm_request(), metadata=(
            *CANARY, ("x-slow", "1"), ("x-request-id", ok_id)))
        assert time.monotonic() - start >= 0.15
        assert dict(trailers)["mmguard-fault"] == "slow/delay; delay 150 ms"


def test_max_active_faults_bounds_the_blast_radius(models: Path) -> None:
    cfg = fault_config(models, [experiment("one", {"kind": "delay", "ms": 500},
                                           max_active_faults=1, stop={"max_p99_ms": None})])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(infer, m, mm_request()) for _ in range(4)]
            faults = [f.result()[1].get("mmguard-fault", "") for f in futures]
        delayed = [f for f in faults if f.startswith("one/delay")]
        assert len(delayed) >= 1 and len(delayed) < 4
        snap = admin(m, "/admin/experiments/one")[1]
        assert snap["skipped"] == 4 - len(delayed)


def test_output_truncation_and_connection_reset(models: Path) -> None:
    cfg = fault_config(models, [
        experiment("trunc", {"kind": "truncate_output", "keep": 0.5}, headers={"x-t": "1"}),
        experiment("reset", {"kind": "reset"}, headers={"x-r": "1"},
                   stop={"max_error_rate": None})])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        raw, _trailers = grpc_infer_raw(m.grpc_url, mm_request(), metadata=(*CANARY, ("x-t", "1")))
        resp = pb.ModelInferResponse.FromString(raw)
        assert len(resp.raw_output_contents[0]) == 3 * 32 * 32 * 4 // 2
        body = json.dumps({"inputs": [
            {"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 1, 1],
             "data": [0.1, 0.2, 0.3]},
            {"name": "input_ids", "datatype": "INT64", "shape": [1, 1], "data": [1]}]}).encode()
        req = urllib.request.Request(f"http://{m.http_url}/v2/models/mm/infer", data=body,
                                     headers={"x-canary": "1", "x-r": "1"}, method="POST")
        with pytest.raises((ConnectionError, urllib.error.URLError, OSError)):
            urllib.request.urlopen(req, timeout=10).close()
        with pytest.raises(grpc.RpcError) as exc:
            grpc_infer_raw(m.grpc_url, mm_request(), metadata=(*CANARY, ("x-r", "1")))
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "connection reset" in (exc.value.details() or "")
        # and the proxy keeps serving
        assert http_post(m.http_url, "/v2/models/mm/infer", body)[0] == 200


# --- experiments stop themselves; the admin API ------------------------------------------------


def test_stop_condition_stops_the_experiment_and_traffic_goes_on(models: Path) -> None:
    cfg = fault_config(models, [experiment("bad", {"kind": "abort"},
                                           stop={"max_error_rate": 0.5, "min_requests": 5,
                                                 "window_s": 30})])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        failed = 0
        for i in range(20):
            try:
                infer(m, mm_request(), request_id=f"q{i}")
            except grpc.RpcError:
                failed += 1
        # a stop is a statistic: at the stop's alpha (0.01) split over its two conditions (the
        # error rate and the default p99), 14 errors of 14 calls are the first evidence that
        # the error rate is above 0.5 (5 of 5 are not)
        assert failed == 14
        _status, snap = admin(m, "/admin/experiments/bad")
        assert snap["state"] == "stopped"
        assert snap["stop_reason"].startswith("error rate 1.000 > 0.5 over the last 30 s "
                                              "(14 of 14 canary calls; bounds ")
        assert "false-stop rate 0.005" in snap["stop_reason"]
        metrics = urllib.request.urlopen(m.admin_url + "/metrics").read().decode()
        assert 'mmguard_experiment_stops_total{cause="slo",experiment="bad",route="mm"} 1.0' \
            in metrics


def test_p99_stop_condition(models: Path) -> None:
    cfg = fault_config(models, [experiment("lag", {"kind": "delay", "ms": 60},
                                           stop={"max_p99_ms": 50, "min_requests": 3})])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        faults = [infer(m, mm_request())[1].get("mmguard-fault", "") for _ in range(6)]
        assert [bool(f) for f in faults] == [True, True, True, False, False, False]
        assert admin(m, "/admin/experiments/lag")[1]["stop_reason"].startswith("p99 latency")


def test_admin_api_needs_the_token_and_stops_everything(models: Path) -> None:
    new = {"route": "mm", "experiment": experiment("api", {"kind": "gaussian_noise"})}
    with RunningMmguard(fault_config(models, [], token=None)) as m:
        m.wait_ready()
        assert admin(m, "/admin/experiments", new, token=None)[0] == 403  # no token set: never
    with RunningMmguard(fault_config(models, [])) as m:
        m.wait_ready()
        assert admin(m, "/admin/experiments", new, token=None)[0] == 401
        assert admin(m, "/admin/experiments", new, token="wrong")[0] == 401
        status, body = admin(m, "/admin/experiments", {"route": "mm", "experiment": {
            "name": "bad", "actions": [{"kind": "teleport"}]}})
        assert status == 400 and "experiment.actions" in body["problems"][0]
        assert admin(m, "/admin/experiments", {**new, "route": "mm_plain"})[0] == 409
        status, snap = admin(m, "/admin/experiments", new)
        assert status == 201 and snap["state"] == "running" and snap["source"] == "api"
        resp, trailers, _ = infer(m, mm_request())
        assert trailers["mmguard-fault"].startswith("api/gaussian_noise")
        assert admin(m, "/admin/experiments/stop-all", {}, token=None)[0] == 401
        status, body = admin(m, "/admin/experiments/stop-all", {})
        assert status == 200 and body["stopped"] == ["api"]
        resp, trailers, _ = infer(m, mm_request())
        assert "mmguard-fault" not in trailers
        assert np.array_equal(out(resp, "pixels_seen"), pixels())
        listed = admin(m, "/admin/experiments")[1]
        assert [(e["name"], e["state"]) for e in listed] == [("api", "stopped")]
        assert TOKEN not in json.dumps(listed)


def test_shutdown_stops_every_experiment(models: Path) -> None:
    m = RunningMmguard(fault_config(models, [experiment("x", {"kind": "darken"})]))
    with m:
        m.wait_ready()
        assert m.server is not None
        registry = m.server.plane.runtime.state[EXPERIMENTS]
    assert registry.experiments["x"].state == "stopped"
    assert registry.experiments["x"].stop_reason == "mmguard is shutting down"


def test_injected_failures_never_trip_the_breaker(models: Path) -> None:
    cfg = fault_config(models, [])
    cfg["models"] = [
        {"name": "mm", "backend": "ort", "backend_model": "mm_identity", "filters": [
            {"fallback": {"degrade_to": ["mm_light"], "cache": None,
                          "breaker": {"minimum_calls": 2, "failure_rate": 0.5}}},
            {"fault": {"experiments": [experiment("down", {"kind": "abort"},
                                                  stop={"max_error_rate": None})]}}]},
        {"name": "mm_light", "backend": "ort", "backend_model": "mm_identity", "filters": []}]
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        for _ in range(6):
            resp, trailers, _ = infer(m, mm_request())
            assert np.array_equal(out(resp, "pixels_seen"), pixels())  # served by the L2
            assert trailers["mmguard-fault"].startswith("down/abort")
            assert trailers["mmguard-fallback-level"].startswith("2; ")
        breakers = admin(m, "/admin/breakers")[1]
        primary = next(b for b in breakers if b["level"] == "mm")
        assert primary["state"] == "closed"


# --- streams (real vLLM) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_proxy(vllm_llama: VllmServer, models: Path) -> Iterator[RunningMmguard]:
    cfg = {"backends": [{"kind": "vllm", "name": "llama", "url": vllm_llama.url}],
           "models": [{"name": "chat", "backend": "llama", "backend_model": vllm_llama.model,
                       "filters": [{"fault": {"experiments": [
                           experiment("slow", {"kind": "slow_stream", "ms": 30},
                                      headers={"x-f": "slow"}),
                           experiment("cut", {"kind": "cut_stream", "after_events": 2},
                                      headers={"x-f": "cut"}, stop={"max_error_rate": None}),
                           experiment("words", {"kind": "token_dropout", "p": 1.0},
                                      headers={"x-f": "words"}),
                           experiment("reset", {"kind": "reset", "after_events": 2},
                                      headers={"x-f": "reset"},
                                      stop={"max_error_rate": None})]}}]}],
           "canary": {"headers": {"x-canary": "1"}},
           "listeners": {"http": {"trust_canary_headers": True}}}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=120)
        yield m


def _stream(m: RunningMmguard, fault: str | None) -> tuple[list[str], str]:
    client = openai.OpenAI(base_url=f"http://{m.http_url}/v1", api_key="unused", max_retries=0)
    headers = {"x-canary": "1", "x-f": fault} if fault else {}
    raw = client.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": "count: one two three"}],
        max_tokens=12, temperature=0, stream=True, extra_headers=headers)
    pieces = []
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    return pieces, raw.headers.get("mmguard-fault", "")


@pytest.mark.vllm
def test_stream_faults_on_a_real_vllm_stream(chat_proxy: RunningMmguard) -> None:
    plain, mark = _stream(chat_proxy, None)
    assert len(plain) > 3 and mark == ""
    slow, mark = _stream(chat_proxy, "slow")
    # slower, the same text (vLLM may group tokens into events differently from run to run)
    assert "".join(slow) == "".join(plain) and mark.startswith("slow/slow_stream")
    with pytest.raises(openai.APIError) as exc:
        _stream(chat_proxy, "cut")
    assert "stream cut after 2 events" in str(exc.value)
    with pytest.raises(Exception) as dropped:  # the connection drops mid-stream
        _stream(chat_proxy, "reset")
    text = str(dropped.value).lower()  # the SDK's words, or its transport's, for a dropped peer
    assert (isinstance(dropped.value, openai.APIConnectionError) or "closed" in text
            or "incomplete" in text), repr(dropped.value)
    again, _ = _stream(chat_proxy, None)
    assert "".join(again) == "".join(plain)  # and the proxy keeps serving
    client = openai.OpenAI(base_url=f"http://{chat_proxy.http_url}/v1", api_key="unused",
                           max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": "count: one two three"}],
        max_tokens=4, temperature=0, extra_headers={"x-canary": "1", "x-f": "words"})
    assert raw.headers["mmguard-fault"].startswith("words/token_dropout; token_dropout on 1")


def test_reload_keeps_api_experiments_and_retires_removed_ones(models: Path,
                                                               tmp_path: Path) -> None:
    import yaml
    path = tmp_path / "mmguard.yaml"
    cfg = fault_config(models, [experiment("cfg", {"kind": "darken"})])
    path.write_text(yaml.safe_dump(cfg))
    with RunningMmguard(cfg, config_path=path) as m:
        m.wait_ready()
        assert admin(m, "/admin/experiments", {"route": "mm", "experiment": experiment(
            "api", {"kind": "quantise"})})[0] == 201
        path.write_text(yaml.safe_dump(fault_config(models, [])))
        assert m.server is not None
        assert m.run(m.server.reload())
        states = {e["name"]: (e["state"], e["stop_reason"])
                  for e in admin(m, "/admin/experiments")[1]}
        assert states == {"cfg": ("stopped", "removed from the config"), "api": ("running", "")}
        _, trailers, _ = infer(m, mm_request())
        assert trailers["mmguard-fault"].startswith("api/quantise")


def test_a_broken_action_stops_its_experiment_and_the_call_goes_on(models: Path,
                                                                   tmp_path: Path) -> None:
    # a surrogate file that is no TorchScript: the attack cannot run
    bad = tmp_path / "not-a-model.pt"
    bad.write_bytes(b"not torchscript")
    cfg = fault_config(models, [experiment("adv", {"kind": "fgsm", "surrogate": str(bad)})])
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        resp, trailers, _ = infer(m, mm_request())
        assert np.array_equal(out(resp, "pixels_seen"), pixels())  # served, unperturbed
        assert "mmguard-fault" not in trailers
        snap = admin(m, "/admin/experiments/adv")[1]
        assert snap["state"] == "stopped"
        assert snap["stop_reason"].startswith("action 'fgsm' failed: ")
