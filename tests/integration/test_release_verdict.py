"""The release verdict on real Triton backends, latency judged: an identical canary under the
documented chaos experiment and robustness block is never aborted and is promoted in every run
but at most one (a run may hold at MAX_CALLS: docs/canary.md, "Where the pair's noise comes
from"), and
a canary 30 % slower in its own model (a real sleep inside it: 30 % of its own work, the premise
checked on Triton's per-model compute statistics) is aborted on latency, with the test and its
figures in the reason. Production's answers stay byte-identical to a route with no filter
throughout.

Ten runs in a row under CPU load are ``python -m bench.verdict_runs``; here as many runs as fit
in about two minutes.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.pb import grpc_service_pb2 as pb
from tests.integration.test_robustness import CHAOS, ROBUSTNESS, smooth_body
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.wire import grpc_infer_raw

# The integration-test scale of the bar: 95 % needs ~140 clean comparisons of an identical
# canary (99.5 %: ~1,000). Latency with the defaults: 1.1× and 1 ms.
VERDICT = {"promote_agreement": 0.95, "abort_agreement": 0.5}
RUN_BUDGET_S = 110.0
MAX_CALLS = 900


@pytest.fixture
def cue(triton: TritonServer) -> Iterator[Path]:
    path = Path(triton.repository) / "clip_demo.cue.json"
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture
def production_cue(triton: TritonServer) -> Iterator[Path]:
    path = Path(triton.repository) / "clip_fragile.cue.json"
    yield path
    path.unlink(missing_ok=True)


def config(triton: TritonServer, production: str, verdict: dict[str, Any],
           chaos: bool) -> dict[str, Any]:
    shadow: dict[str, Any] = {"canary": "canary", "verdict": verdict,
                              "compare": {"outputs": ["image_embeds", "text_embeds"]}}
    if chaos:
        shadow["robustness"] = ROBUSTNESS
    return {"listeners": {"admin": {"token": "op"}},
            "backends": [{"kind": "triton_grpc", "name": "triton", "url": triton.grpc_url}],
            "models": [
                {"name": "prod", "backend": "triton", "backend_model": production,
                 "filters": [{"shadow": shadow}]},
                {"name": "direct", "backend": "triton", "backend_model": production,
                 "filters": []},
                {"name": "canary", "backend": "triton", "backend_model": "clip_demo",
                 "internal": False,  # the tests warm it up directly
                 "filters": [{"fault": {"experiments": [CHAOS] if chaos else []}}]}]}


def verdict(m: RunningMmguard) -> dict[str, Any]:
    with urllib.request.urlopen(m.admin_url + "/admin/shadows", timeout=5) as r:
        return json.loads(r.read())["prod"]  # type: ignore[no-any-return]


def reset(m: RunningMmguard) -> None:
    req = urllib.request.Request(m.admin_url + "/admin/shadows/prod/reset", data=b"",
                                 method="POST", headers={"Authorization": "Bearer op"})
    urllib.request.urlopen(req, timeout=5).close()


def one_run(m: RunningMmguard, first: int,
            max_calls: int = MAX_CALLS) -> tuple[dict[str, Any], int]:
    """Traffic until the verdict decides (or ``max_calls``); every 10th answer checked against
    the route with no filter, byte for byte."""
    for i in range(first, first + max_calls):
        body, trailers = grpc_infer_raw(m.grpc_url, smooth_body("prod", i))
        assert "mmguard-fault" not in dict(trailers)
        if i % 10 == 0:
            direct, _ = grpc_infer_raw(m.grpc_url, smooth_body("direct", i))
            a, b = pb.ModelInferResponse.FromString(body), pb.ModelInferResponse.FromString(direct)
            assert list(a.raw_output_contents) == list(b.raw_output_contents), f"call {i}"
        if i % 20 == 0:
            snap = verdict(m)
            if snap["state"] in ("promote", "abort"):
                return snap, i + 1 - first
    deadline = time.monotonic() + 30
    snap = verdict(m)
    while snap["state"] not in ("promote", "abort") and time.monotonic() < deadline:
        time.sleep(0.2)  # the last copies' comparisons
        snap = verdict(m)
    return snap, max_calls


@pytest.mark.triton
def test_an_identical_canary_under_chaos_is_promoted_run_after_run(triton: TritonServer) -> None:
    runs: list[tuple[str, int, int, float | None]] = []
    with RunningMmguard(config(triton, "clip_demo", VERDICT, chaos=True)) as m:
        m.wait_ready(timeout=60)
        for i in range(5):  # warm-up: a cold Python backend is not the canary's latency
            grpc_infer_raw(m.grpc_url, smooth_body("canary", -1 - i))
        started, first = time.monotonic(), 0
        while not runs or time.monotonic() - started < RUN_BUDGET_S:
            reset(m)
            snap, calls = one_run(m, first)
            first += calls
            runs.append((snap["state"], calls, snap["samples"],
                         snap["evidence"]["latency"]["estimate"]))
            # The verdict's guarantee is its error rate: an identical canary is never aborted.
            assert snap["state"] != "abort", (runs, snap["reasons"], snap["evidence"])
            assert snap["excluded"] > 0  # the experiment ran: its copies were left out
            if snap["state"] == "promote":
                ev = snap["decided"]["figures"]
                assert ev["agreement"]["lower"] >= VERDICT["promote_agreement"]
                assert ev["latency"]["upper"] < 0.5
                rows = snap["robustness"]["rows"]
                assert {r["perturbation"] for r in rows} == {"gaussian_noise", "patch_mask"}
                assert all(r["verdict"] == "passes" for r in rows)
            else:
                # Not enough evidence within MAX_CALLS, said as such: 28-44 % of this
                # identical pair's clean copies read slower than the margin on this machine,
                # where Triton's own times put 16-32 % past it: the rest is the wait for
                # mmguard's process after the answer arrived, on an oversubscribed 2-core
                # machine (measured with Triton's trace; docs/canary.md). A run whose share
                # drifts past ~42 % needs more pairs than MAX_CALLS gives.
                assert snap["state"] == "hold" and snap["missing"], snap
            if len(runs) >= 10:
                break
    print(f"identical canary under chaos: {len(runs)} runs (state, calls, clean comparisons, "
          f"share of pairs slower than the latency margin): {runs}")
    promoted = sum(1 for r in runs if r[0] == "promote")
    assert promoted >= 2 and promoted >= len(runs) - 1, runs  # at most one run held


# A model of realistic latency: 30 % of ~3 ms (the bare demo model) is under the default 1 ms
# minimum effect, a difference the verdict is told not to care about. And on a 2-core machine
# at load 10, mmguard's own time around a backend call (its event loop, gRPC) adds ~10 ms of
# noise to either side of a pair (a ~10 ms model was seen at p50 19 ms, its 1.22x canary at
# 28 ms, slower than the margin in only 58 % of pairs: 633 pairs to an abort, and a hold at 900
# calls in another run). 30 % of ~27 ms stands clear of that noise.
PRODUCTION_DELAY_MS = 25.0
SLOWDOWN = 1.3


def compute_ms(triton: TritonServer, model: str) -> tuple[int, float]:
    """Triton's own count and total time of ``model``'s executions (its compute_infer)."""
    with urllib.request.urlopen(f"http://{triton.http_url}/v2/models/{model}/stats",
                                timeout=5) as r:
        infer = json.loads(r.read())["model_stats"][0]["inference_stats"]["compute_infer"]
    return int(infer["count"]), int(infer["ns"]) / 1e6


def direct_ratio(triton: TritonServer, pairs: int = 40) -> tuple[float, float, float]:
    """The canary model's time over production's in Triton itself, on interleaved direct calls
    (one at a time, so neither waits on the other), each call's own compute time read from
    Triton's statistics; medians, so one stall of a busy machine does not move the ratio:
    (ratio, canary ms, production ms)."""
    names = ("clip_demo", "clip_fragile")
    took: dict[str, list[float]] = {name: [] for name in names}
    for i in range(pairs):
        for name in names:
            count, ms = compute_ms(triton, name)
            grpc_infer_raw(triton.grpc_url, smooth_body(name, 7000 + i))
            deadline = time.monotonic() + 5
            while (now := compute_ms(triton, name))[0] == count:  # Triton records a call's
                assert time.monotonic() < deadline  # statistics just after its answer
                time.sleep(0.001)
            assert now[0] == count + 1
            took[name].append(now[1] - ms)
    canary, production = (sorted(took[n])[pairs // 2] for n in names)
    return canary / production, canary, production


@pytest.mark.triton
def test_a_canary_30_percent_slower_in_its_own_backend_is_aborted_on_latency(
        triton: TritonServer, cue: Path, production_cue: Path) -> None:
    # production: clip_fragile doing clip_demo's work (its roughness check off) and sleeping
    # 25 ms; canary: clip_demo sleeping 25 ms too and 30 % of its own work more, so it is 1.3x
    # slower in itself however loaded the machine is (no calibration loop on end-to-end times,
    # which a busy machine swings by more than the effect); the verdict's latency defaults
    production_cue.write_text(json.dumps({"delay_ms": PRODUCTION_DELAY_MS, "fragile": False}))
    cue.write_text(json.dumps({"delay_ms": PRODUCTION_DELAY_MS, "slowdown": SLOWDOWN}))
    with RunningMmguard(config(triton, "clip_fragile", VERDICT, chaos=False)) as m:
        m.wait_ready(timeout=60)
        for i in range(5):  # warm-up: a cold Python backend's first calls are not its speed
            grpc_infer_raw(m.grpc_url, smooth_body("canary", -1 - i))
            grpc_infer_raw(m.grpc_url, smooth_body("direct", -1 - i))
        slower, canary_ms, production_ms = direct_ratio(triton)
        reset(m)
        snap, calls = one_run(m, 5000)
    print(f"30 %-slower canary: {slower:.2f}x in Triton's compute times on direct calls "
          f"({canary_ms:.1f} vs {production_ms:.1f} ms), {snap['state']} after {calls} calls: "
          f"{snap['reasons']}; backend times the verdict saw, last {snap['latency_ms']['recent']}"
          f" pairs: production {snap['latency_ms']['primary']}, canary "
          f"{snap['latency_ms']['canary']}")
    assert 1.2 <= slower <= 1.45, f"the premise: canary {slower:.2f}x production in Triton"
    assert snap["state"] == "abort", (calls, snap["reasons"], snap["evidence"])
    latency = [r for r in snap["reasons"] if r.startswith("latency")]
    assert latency, snap["reasons"]
    assert "sequential sign test, false-abort rate" in latency[0]
    assert "pairs" in latency[0] and "lower bound" in latency[0]
    assert snap["agreement"] == 1.0  # the answers were right: it is the latency
