"""The release verdict on a real Triton, under CPU load: what issue 25 measured, measured again.

1. The clean-copy latency gap (canary p50 − production p50 over the copies no fault touched),
   in one run, interleaved: a shadow whose canary runs the documented chaos experiment (noise,
   patch mask, 30 % of copies delayed 50 ± 15 ms) beside one whose canary runs none. A delay
   must not hold a shadow worker, so the two gaps should agree within ±0.5 ms.
2. ``--runs`` runs in a row (default 10) of an identical canary (Triton on both sides) under the
   documented experiment and robustness block, the verdict at a 95 % bar with latency judged
   (1.1×, 1 ms), while ``--load`` busy processes load the CPUs: every run should promote.

    python -m bench.verdict_runs [--runs 10] [--load 2] [--gap-requests 600]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from proxy.cli.demo_model import ensure_clip_demo
from tests.integration.test_release_verdict import MAX_CALLS, VERDICT, config, one_run, reset
from tests.integration.test_robustness import CHAOS, smooth_body
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer, write_model_repository
from tests.support.wire import grpc_infer_raw


def _burn(stop_at: float) -> None:
    x = 0
    while time.monotonic() < stop_at:
        x += 1


def shadows(m: RunningMmguard) -> dict[str, Any]:
    with urllib.request.urlopen(m.admin_url + "/admin/shadows", timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def gap(triton: TritonServer, requests: int) -> dict[str, dict[str, float]]:
    verdict = {**VERDICT, "window": requests, "max_latency_ratio": None}  # measure, not judge
    shadow = {"verdict": verdict, "on_abort": {"stop_mirroring": False}, "queue_size": 256,
              "compare": {"outputs": ["image_embeds", "text_embeds"]}}
    cfg = {"backends": [{"kind": "triton_grpc", "name": "triton", "url": triton.grpc_url}],
           "models": [
               {"name": "chaos", "backend": "triton", "backend_model": "clip_demo",
                "filters": [{"shadow": {**shadow, "canary": "canary_chaos"}}]},
               {"name": "plain", "backend": "triton", "backend_model": "clip_demo",
                "filters": [{"shadow": {**shadow, "canary": "canary_plain"}}]},
               {"name": "canary_chaos", "backend": "triton", "backend_model": "clip_demo",
                "filters": [{"fault": {"experiments": [CHAOS]}}]},
               {"name": "canary_plain", "backend": "triton", "backend_model": "clip_demo",
                "internal": False, "filters": []}]}  # warmed up directly
    out = {}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        for i in range(20):
            grpc_infer_raw(m.grpc_url, smooth_body("canary_plain", -1 - i))
        for i in range(requests):
            for route in (("chaos", "plain") if i % 2 else ("plain", "chaos")):
                grpc_infer_raw(m.grpc_url, smooth_body(route, i))
        time.sleep(2)  # the last copies
        for route in ("chaos", "plain"):
            snap = shadows(m)[route]
            lat = snap["latency_ms"]
            out[route] = {"production_p50": lat["primary"]["p50"],
                          "canary_p50": lat["canary"]["p50"],
                          "gap_ms": lat["canary"]["p50"] - lat["primary"]["p50"],
                          "clean": snap["samples"], "excluded": snap.get("excluded", 0)}
    return out


def runs(triton: TritonServer, n: int, max_calls: int) -> list[dict[str, Any]]:
    found = []
    with RunningMmguard(config(triton, "clip_demo", VERDICT, chaos=True)) as m:
        m.wait_ready(timeout=60)
        for i in range(5):
            grpc_infer_raw(m.grpc_url, smooth_body("canary", -1 - i))
        first = 0
        for _ in range(n):
            reset(m)
            t = time.monotonic()
            snap, calls = one_run(m, first, max_calls)
            first += calls
            lat = snap["evidence"]["latency"]
            found.append({"state": snap["state"], "calls": calls, "clean": snap["samples"],
                          "excluded": snap["excluded"], "s": round(time.monotonic() - t, 1),
                          "agreement_lower": snap["evidence"]["agreement"]["lower"],
                          "slower_share": lat["estimate"], "slower_upper": lat["upper"],
                          "reasons": snap["reasons"] if snap["state"] != "promote" else []})
            print(f"  run {len(found)}: {found[-1]}", flush=True)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.verdict_runs",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--load", type=int, default=2, help="busy processes beside the run")
    ap.add_argument("--gap-requests", type=int, default=600)
    ap.add_argument("--gap-repeats", type=int, default=1,
                    help="measure the gaps this many times (a fresh mmguard each): the median "
                         "and range of the difference")
    ap.add_argument("--max-calls", type=int, default=MAX_CALLS,
                    help=f"calls a run may take before it stops undecided (the test's "
                         f"{MAX_CALLS})")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mmguard-bench-verdict-"))
    repo = write_model_repository(root / "repo", ensure_clip_demo(root / "onnx"))
    load = [multiprocessing.Process(target=_burn, args=(time.monotonic() + 3600,), daemon=True)
            for _ in range(a.load)]
    with TritonServer(repo, root / "work") as triton:
        for p in load:
            p.start()
        try:
            diffs: list[float] = []
            for r in range(a.gap_repeats if a.gap_requests > 0 else 0):  # 0: only the runs
                print(f"1. clean-copy p50 gap, {a.gap_requests} requests per shadow, "
                      f"interleaved, {a.load} busy processes (repeat {r + 1})")
                g = gap(triton, a.gap_requests)
                for route, figs in g.items():
                    print(f"  {route:6s} " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float)
                                                      else f"{k} {v}" for k, v in figs.items()))
                diffs.append(g["chaos"]["gap_ms"] - g["plain"]["gap_ms"])
                print(f"  difference of the gaps (chaos - plain): {diffs[-1]:+.2f} ms",
                      flush=True)
            if len(diffs) > 1:
                print(f"  over {len(diffs)} repeats: median {statistics.median(diffs):+.2f} ms, "
                      f"range {min(diffs):+.2f} to {max(diffs):+.2f} ms, "
                      f"{sum(d > 0 for d in diffs)} of {len(diffs)} above zero")
            if a.runs <= 0:
                return 0
            print(f"2. {a.runs} runs (at most {a.max_calls} calls each), identical canary "
                  f"under chaos + robustness, "
                  f"{a.load} busy processes")
            found = runs(triton, a.runs, a.max_calls)
            states = [r["state"] for r in found]
            print(f"  promote {states.count('promote')}, abort {states.count('abort')}, "
                  f"undecided {len(states) - states.count('promote') - states.count('abort')}")
        finally:
            for p in load:
                p.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
