"""``mmguard status`` as an operator runs it: a subprocess against a real running mmguard's
admin port, and against a port where nothing listens."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from filters.shadow.filter import SHADOWS
from proxy.cli.demo_model import tokenize
from tests.conftest import ort_config
from tests.support.mmguard import RunningMmguard
from tests.support.wire import grpc_infer_raw, grpc_request

ROOT = Path(__file__).parents[2]


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "status", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def clip_body(model: str, seed: int = 0) -> bytes:
    px = np.random.default_rng(seed).random((1, 3, 224, 224), np.float32)
    return grpc_request(model, [("pixel_values", "FP32", [1, 3, 224, 224], px.tobytes()),
                                ("input_ids", "INT64", [1, 77],
                                 tokenize("a red bus")[None, :].tobytes())])


@pytest.fixture(scope="module")
def running(ort_models: Path) -> Iterator[RunningMmguard]:
    cfg = ort_config(ort_models)
    cfg["models"] = [
        {"name": "guarded_clip", "backend": "ort", "backend_model": "clip_demo", "filters": [
            {"limits": {"max_batch": 1}},
            {"fallback": {"degrade_to": ["clip_b"]}}]},
        {"name": "routed_clip", "backend": "ort", "backend_model": "clip_demo", "filters": [
            {"modality_router": {"paths": [{"route": "clip_a"}, {"route": "clip_b"}],
                                 "inputs": {"pixel_values": "image", "input_ids": "text"},
                                 "dwell_s": 0}}]},
        {"name": "clip_a", "backend": "ort", "backend_model": "clip_demo", "filters": []},
        {"name": "clip_b", "backend": "ort", "backend_model": "clip_demo", "filters": []},
        {"name": "shadowed_clip", "backend": "ort", "backend_model": "clip_demo", "filters": [
            {"shadow": {"canary": "canary_clip", "verdict": {"min_samples": 2}}}]},
        # A broken canary: another model behind the canary route (it refuses the clip inputs),
        # so every clean copy disagrees. The experiment only selects calls marked x-fault, which
        # the mirrored copies are not: a copy a fault touched would not count (issue 16).
        {"name": "canary_clip", "backend": "ort", "backend_model": "text_encoder", "filters": [
            {"fault": {"experiments": [{"name": "masked", "headers": {"x-fault": "1"},
                                        "actions": [{"kind": "patch_mask", "ratio": 0.75}],
                                        "stop": {"max_error_rate": None}}]}}]},
    ]
    cfg["canary"] = {"headers": {"x-canary": "1"}}
    cfg["listeners"] = {"admin": {"token": "op-token"}}  # forcing a breaker needs it
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        # 0 of 2 is no evidence; 0 of 3 shows agreement under the 95 % line at alpha / 3
        for seed in range(4):  # distinct requests: a replay adds no evidence
            grpc_infer_raw(m.grpc_url, clip_body("shadowed_clip", seed))
        deadline = time.monotonic() + 30
        shadow = m.server.plane.runtime.local[SHADOWS]["shadowed_clip"]  # type: ignore[union-attr]
        while shadow.state.verdict.state() != "abort":
            assert time.monotonic() < deadline, shadow.state.verdict.reasons()
            time.sleep(0.05)
        for _ in range(3):
            grpc_infer_raw(m.grpc_url, clip_body("guarded_clip"))
        grpc_infer_raw(m.grpc_url, clip_body("routed_clip"))
        # one refusal: a batch of 2 over limits.max_batch 1
        two = grpc_request("guarded_clip", [
            ("pixel_values", "FP32", [2, 3, 224, 224], bytes(2 * 3 * 224 * 224 * 4)),
            ("input_ids", "INT64", [2, 77], bytes(2 * 77 * 8))])
        with pytest.raises(grpc.RpcError) as err:
            grpc_infer_raw(m.grpc_url, two)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        yield m


def rows(out: str, *cells: str) -> list[list[str]]:
    """The table rows whose first cells are ``cells``, split into cells."""
    return [line.split() for line in out.splitlines()
            if line.split()[:len(cells)] == list(cells)]


def test_status_shows_readiness_routes_breakers_and_weights(running: RunningMmguard) -> None:
    done = status("--admin", running.admin_url)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.splitlines()[0] == f"mmguard at {running.admin_url}: READY"
    assert "backends: ort ready" in out
    # request counts by route and code: 3 ok + 1 too_large on guarded_clip
    (header,) = rows(out, "route", "total")
    assert header == ["route", "total", "ok", "too_large"]
    (counts,) = rows(out, "guarded_clip", "4")
    assert dict(zip(header, counts, strict=True)) == {
        "route": "guarded_clip", "total": "4", "ok": "3", "too_large": "1"}
    assert rows(out, "routed_clip", "1", "1", "0")
    # one breaker per level of the fallback route, both closed
    assert rows(out, "guarded_clip", "guarded_clip", "CLOSED", "3")
    assert rows(out, "guarded_clip", "clip_b", "CLOSED")
    # the router's two paths and their weights
    weights = {r[1]: float(r[2]) for r in rows(out, "routed_clip")
               if r[1] in ("clip_a", "clip_b")}
    assert set(weights) == {"clip_a", "clip_b"} and abs(sum(weights.values()) - 1) < 1e-6


def test_status_shows_a_forced_open_breaker(running: RunningMmguard) -> None:
    import urllib.request
    auth = {"Authorization": "Bearer op-token"}
    req = urllib.request.Request(f"{running.admin_url}/admin/breakers/guarded_clip/clip_b/open",
                                 method="POST", headers=auth)
    urllib.request.urlopen(req, timeout=10).read()
    try:
        done = status("--admin", running.admin_url)
        assert done.returncode == 0, done.stderr
        assert rows(done.stdout, "guarded_clip", "clip_b", "FORCED_OPEN")
    finally:
        reset = urllib.request.Request(
            f"{running.admin_url}/admin/breakers/guarded_clip/clip_b/reset", method="POST",
            headers=auth)
        urllib.request.urlopen(reset, timeout=10).read()


def test_status_fails_naming_the_url_when_nothing_listens() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the socket is closed: nothing listens on that port now
    url = f"http://127.0.0.1:{port}"
    done = status("--admin", url)
    assert done.returncode == 1
    assert url in done.stderr
    assert "cannot read the admin API" in done.stderr
    assert done.stdout == ""


def test_status_shows_experiments_and_canary_verdicts(running: RunningMmguard) -> None:
    done = status("--admin", running.admin_url)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    (verdict,) = rows(out, "shadowed_clip", "canary_clip")
    # the broken canary disagrees with production on every clean copy ...
    assert verdict[2] == "ABORT" and verdict[3] in ("3", "4") and verdict[4] == "0.0%"
    assert verdict[5] == "stopped"  # ... so mirroring stopped
    # and the abort stopped the canary's experiment too (it had matched nothing)
    (exp,) = rows(out, "masked", "canary_clip", "STOPPED", "0")
    assert "canary abort verdict on 'shadowed_clip'" in " ".join(exp)
