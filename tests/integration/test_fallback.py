"""fallback over real Triton servers: a primary dies under load → L2 answers; L2 dies too → L3
answers from cache, marked stale; the primary comes back → half-open → closed. Every request
gets an answer or a clear error, none lost. Also: slow-call breaker, version fuse, admin API."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from proxy.cli.demo_model import ensure_clip_demo, tokenize
from proxy.pb import grpc_service_pb2 as pb
from tests.conftest import triton_routes
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer, write_model_repository
from tests.support.wire import grpc_infer_raw, grpc_request

pytestmark = pytest.mark.triton


def clip_request(route: str, i: int) -> bytes:
    px = np.full((1, 3, 224, 224), i / 10, "<f4")
    ids = tokenize(f"request {i}")[None, :]
    return grpc_request(route, [("pixel_values", "FP32", [1, 3, 224, 224], px.tobytes()),
                                ("input_ids", "INT64", [1, 77], ids.tobytes())])


def call(url: str, body: bytes, timeout: float = 10) -> tuple[str, Any]:
    """('1'|'2'|'3', similarity) for an answer, ('error', code) for a clear refusal."""
    try:
        out, trailers = grpc_infer_raw(url, body, timeout)
    except grpc.RpcError as err:
        return "error", (err.code(), err.details(), dict(err.trailing_metadata() or ()))
    meta = dict(trailers or ())
    level = meta.get("mmguard-fallback-level", "1").split(";")[0]
    resp = pb.ModelInferResponse.FromString(out)
    sim = np.frombuffer(resp.raw_output_contents[[o.name for o in resp.outputs]
                                                .index("similarity")], "<f4")
    return level, (float(sim[0]), meta.get("mmguard-stale"))


@pytest.fixture(scope="module")
def two_tritons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TritonServer, ...]]:
    root = tmp_path_factory.mktemp("fallback")
    onnx_path = ensure_clip_demo(root / "onnx")
    servers = []
    for name in ("primary", "light"):
        repo = write_model_repository(root / name / "repo", onnx_path)
        servers.append(TritonServer(repo, root / name / "work").start())
    try:
        yield tuple(servers)
    finally:
        for s in servers:
            s.stop()


def test_failure_sequence_loses_no_request(two_tritons: tuple[TritonServer, ...]) -> None:
    primary, light = two_tritons
    cfg = {
        "backends": [{"kind": "triton_grpc", "name": "primary", "url": primary.grpc_url,
                      "timeout_s": 3},
                     {"kind": "triton_grpc", "name": "light", "url": light.grpc_url,
                      "timeout_s": 3}],
        "models": [
            {"name": "clip", "backend": "primary", "backend_model": "clip_demo",
             "filters": [{"fallback": {
                 "degrade_to": ["clip_light"],
                 "breaker": {"minimum_calls": 3, "failure_rate": 0.5, "wait_in_open_s": 1.0,
                             "permitted_in_half_open": 2},
                 "retries": {"attempts": 2}}}]},
            {"name": "clip_light", "backend": "light", "backend_model": "clip_demo"},
        ],
    }
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        seen = {i: call(m.grpc_url, clip_request("clip", i)) for i in range(4)}
        assert {lvl for lvl, _ in seen.values()} == {"1"}  # warm: answered and cached by L1
        results: list[tuple[str, str, Any]] = []
        phase = ["healthy"]
        stop = threading.Event()

        def load(worker: int) -> None:
            i = worker
            while not stop.is_set():
                lvl, info = call(m.grpc_url, clip_request("clip", i % 4))
                results.append((phase[0], lvl, (i % 4, info)))
                i += 1

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(load, w) for w in range(4)]
            time.sleep(1.0)
            phase[0] = "primary down"
            primary.stop()
            time.sleep(2.5)
            phase[0] = "both down"
            light.stop()
            time.sleep(2.5)
            phase[0] = "primary back"
            primary.start(keep_ports=True)
            time.sleep(3.0)
            stop.set()
            for f in futures:
                f.result(30)  # no worker hung
        by_phase: dict[str, Counter[str]] = {}
        for ph, lvl, _ in results:
            by_phase.setdefault(ph, Counter())[lvl] += 1
        assert by_phase["healthy"] == Counter({"1": by_phase["healthy"]["1"]})
        assert by_phase["primary down"]["2"] > 0
        assert by_phase["both down"]["3"] > 0
        assert by_phase["primary back"]["1"] > 0
        for ph, lvl, (i, info) in results:
            if lvl in ("1", "2", "3"):
                assert info[0] == pytest.approx(seen[i][1][0], abs=1e-6)  # the same answer
                assert (info[1] == "true") is (lvl == "3")  # only L3 is marked stale
            else:
                code, details, trailers = info
                assert code == grpc.StatusCode.UNAVAILABLE, (ph, details)
                assert "no level could answer" in details
                assert "retry-after" in trailers
        # the last requests went through a closed primary breaker again
        state = json.loads(urllib.request.urlopen(m.admin_url + "/admin/breakers").read())
        primary_state = next(b for b in state if b["level"] == "clip")
        assert primary_state["state"] == "closed"
    light.start(keep_ports=True)


def test_slow_calls_open_the_breaker(triton: TritonServer) -> None:
    cfg = triton_routes(triton, [])
    cfg["models"] = [{"name": "slow", "backend": "triton-grpc", "backend_model": "slow_fp32",
                      "filters": [{"fallback": {"breaker": {
                          "minimum_calls": 3, "slow_call_s": 0.2, "slow_call_rate": 0.6,
                          "wait_in_open_s": 30}, "cache": None}}]}]
    body = grpc_request("slow", [("x", "FP32", [1, 1], b"\0\0\0\0"),
                                 ("delay_ms", "INT32", [1, 1], np.array([300], "<i4").tobytes())])
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        for _ in range(3):
            grpc_infer_raw(m.grpc_url, body)  # each succeeds, slowly
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as exc:
            grpc_infer_raw(m.grpc_url, body)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "breaker open (slow-call rate 100%" in exc.value.details()
        assert time.monotonic() - t0 < 0.3 + 5  # refused without waiting for the model
        text = urllib.request.urlopen(m.admin_url + "/metrics").read().decode()
        assert 'mmguard_breaker_state{level="slow",model="slow"} 1.0' in text


def test_operator_can_force_a_breaker_open_and_closed(triton: TritonServer) -> None:
    cfg = triton_routes(triton, ["identity_fp32"])
    cfg["listeners"] = {"admin": {"token": "s3cret"}}
    cfg["models"] = [{"name": "idf", "backend": "triton-grpc", "backend_model": "identity_fp32",
                      "filters": [{"fallback": {"cache": None}}]}]
    body = grpc_request("idf", [("INPUT0", "FP32", [1, 2], b"\0" * 8)])
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        url = m.admin_url + "/admin/breakers/idf/idf/open"
        denied = urllib.request.Request(url, method="POST")
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(denied)
        assert exc.value.code == 401 and b"s3cret" not in exc.value.read()
        exc.value.close()
        ok = urllib.request.Request(url, method="POST",
                                    headers={"Authorization": "Bearer s3cret"})
        assert json.loads(urllib.request.urlopen(ok).read())["state"] == "forced_open"
        with pytest.raises(grpc.RpcError) as err:
            grpc_infer_raw(m.grpc_url, body)
        assert "breaker forced_open (forced open by an operator)" in err.value.details()
        reset = urllib.request.Request(m.admin_url + "/admin/breakers/idf/idf/reset",
                                       method="POST", headers={"Authorization": "Bearer s3cret"})
        urllib.request.urlopen(reset).close()
        assert grpc_infer_raw(m.grpc_url, body)[0]


def test_version_fuse_refuses_a_changed_model_and_lifts_when_fixed(
        triton: TritonServer) -> None:
    cfg = triton_routes(triton, ["batch4_fp32"])
    cfg["contract_refresh_s"] = 0.2
    body = grpc_request("fused", [("x", "FP32", [1, 16], b"\0" * 64)])
    with RunningMmguard({**cfg, "models": [{"name": "probe", "backend": "triton-grpc",
                                            "backend_model": "batch4_fp32"}]}) as m:
        m.wait_ready(timeout=60)
        good = m.server.plane.runtime.contracts["probe"].fingerprint  # type: ignore[union-attr]
    cfg["models"] = [{"name": "fused", "backend": "triton-grpc", "backend_model": "batch4_fp32",
                      "filters": [{"fallback": {"expect_fingerprint": {"fused": good[:16]},
                                                "cache": None}}]}]
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        assert grpc_infer_raw(m.grpc_url, body)[0]
        changed = {"name": "batch4_fp32", "backend": "python", "max_batch_size": 2,
                   "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [16]}],
                   "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [16]}]}
        triton.load_model("batch4_fp32", config=changed)
        try:
            _until(lambda: _refused(m.grpc_url, body))
            with pytest.raises(grpc.RpcError) as exc:
                grpc_infer_raw(m.grpc_url, body)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"fingerprint mismatch: expected {good[:16]}" in exc.value.details()
            text = urllib.request.urlopen(m.admin_url + "/metrics").read().decode()
            assert 'mmguard_model_load_mismatch_total{model="fused",route="fused"}' in text
        finally:
            triton.unload_model("batch4_fp32")
            triton.load_model("batch4_fp32")
        _until(lambda: not _refused(m.grpc_url, body))  # it rejoins by itself


def _refused(url: str, body: bytes) -> bool:
    try:
        grpc_infer_raw(url, body)
        return False
    except grpc.RpcError:
        return True


def _until(cond: Any, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise TimeoutError("condition never held")
