"""What the ``fault`` and ``shadow`` filters cost the traffic they do not change.

1. In-process, per call (µs): the ``fault`` filter on NON-canary calls while an experiment runs,
   against the same chain without the filter (the aim: nothing measurable against noise).
2. End to end, in one run, interleaved: primary latency of a route mirrored at 100 %, the same
   route mirrored at 0 %, a route whose ``fault`` filter runs an experiment (the calls are not
   canary), and a route with no filter at all (in-process ONNX Runtime, the demo
   CLIP model, gRPC; the canary is the same model on the same backend, so it competes for the
   same two cores — the honest worst case for a sidecar).

    python -m bench.fault_shadow [--n 20000] [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from filters.fault import Fault, FaultConfig
from filters.shadow.filter import SHADOWS
from proxy.call import CANARY, Call, Reply, Result, Target
from proxy.chain import Filter, FilterContext, compose
from proxy.cli.demo_model import ensure_clip_demo, tokenize
from proxy.clock import SystemClock
from proxy.telemetry import Telemetry
from tests.support.mmguard import RunningMmguard
from tests.support.wire import grpc_infer_raw, grpc_request

RESULT = Result("m", outputs=[])


async def _terminal(call: Call) -> Reply:
    return RESULT


def chain_cost_us(n: int, with_fault: bool, canary: bool) -> float:
    filters: list[tuple[str, Filter]] = []
    if with_fault:
        cfg = FaultConfig.model_validate({"experiments": [{
            "name": "bench", "actions": [{"kind": "gaussian_noise"}, {"kind": "delay", "ms": 0}],
            "stop": {"max_error_rate": None, "max_p99_ms": None}}]})
        ctx = FilterContext("m", Telemetry(), SystemClock(), random.Random(0), lambda: None)
        filters.append(("fault", Fault(cfg, ctx)))
    handler = compose(filters, _terminal)

    async def run() -> float:
        calls = []
        for _ in range(n):
            c = Call("m", "", [], target=Target("b", "m"))
            c.state[CANARY] = canary
            calls.append(c)
        start = time.perf_counter()
        for c in calls:
            await handler(c)
        return (time.perf_counter() - start) / n * 1e6

    return asyncio.run(run())


def body(model: str, seed: int) -> bytes:
    px = np.random.default_rng(seed).random((1, 3, 224, 224), np.float32)
    return grpc_request(model, [
        ("pixel_values", "FP32", [1, 3, 224, 224], px.tobytes()),
        ("input_ids", "INT64", [1, 77], tokenize("a photo")[None, :].tobytes())])


def end_to_end(requests: int) -> dict[str, list[float]]:
    tmp = Path(tempfile.mkdtemp(prefix="mmguard-bench-shadow-"))
    ensure_clip_demo(tmp)
    cfg = {"backends": [{"kind": "onnxruntime", "name": "ort", "model_dir": str(tmp),
                         "threads": 2},
                        # a canary elsewhere (here: nothing listens, each copy fails at once):
                        # what the mirroring itself costs, without the canary's inference
                        {"kind": "triton_grpc", "name": "elsewhere", "url": "127.0.0.1:1",
                         "timeout_s": 1}],
           "models": [
               {"name": "mirror100", "backend": "ort", "backend_model": "clip_demo",
                "filters": [{"shadow": {"canary": "canary", "queue_size": 16,
                                        # keep mirroring whatever the verdict: this measures
                                        # the cost of mirroring, not the canary
                                        "on_abort": {"stop_mirroring": False}}}]},
               {"name": "mirror0", "backend": "ort", "backend_model": "clip_demo",
                "filters": [{"shadow": {"canary": "canary", "percent": 0}}]},
               {"name": "direct", "backend": "ort", "backend_model": "clip_demo",
                "filters": []},
               # the fault filter with an experiment running, on non-canary traffic
               {"name": "faulted", "backend": "ort", "backend_model": "clip_demo",
                "filters": [{"fault": {"experiments": [{
                    "name": "noise", "actions": [{"kind": "gaussian_noise"}],
                    "stop": {"max_error_rate": None, "max_p99_ms": None}}]}}]},
               {"name": "canary", "backend": "ort", "backend_model": "clip_demo",
                "filters": []},
               {"name": "mirror_out", "backend": "ort", "backend_model": "clip_demo",
                "filters": [{"shadow": {"canary": "canary_out", "queue_size": 16,
                                        "on_abort": {"stop_mirroring": False}}}]},
               {"name": "canary_out", "backend": "elsewhere", "backend_model": "clip_demo",
                "filters": []}]}
    bodies = {m: [body(m, i % 16) for i in range(16)]
              for m in ("mirror100", "mirror_out", "mirror0", "faulted", "direct")}
    lat: dict[str, list[float]] = {m: [] for m in bodies}
    with RunningMmguard(cfg) as m:
        assert m.server is not None
        runtime = m.server.plane.runtime
        deadline = time.monotonic() + 60  # the ORT routes (the "elsewhere" canary never is)
        while any(r not in runtime.contracts for r in (*bodies, "canary")):
            assert time.monotonic() < deadline, "the ONNX Runtime routes did not come up"
            time.sleep(0.05)
        for i in range(requests + 30):
            for name in random.Random(i).sample(list(bodies), len(bodies)):  # interleaved
                start = time.perf_counter()
                grpc_infer_raw(m.grpc_url, bodies[name][i % 16])
                if i >= 30:  # warm-up
                    lat[name].append((time.perf_counter() - start) * 1000)
        for route in ("mirror100", "mirror_out"):
            shadow = (runtime.local.get(SHADOWS) or {})[route].snapshot()
            print(f"  {route}: mirrored {shadow['mirrored']}, dropped {shadow['dropped']} "
                  f"(queue full), compared {shadow['compared']}, verdict {shadow['state']}")
    return lat


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fault_shadow",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--requests", type=int, default=300)
    args = ap.parse_args()
    print("1. fault filter, in-process chain cost per call (best of 5 runs)")
    rows = [("no filter", False, False), ("fault, experiment running, non-canary", True, False),
            ("fault, canary, empty call (0 ms delay: the marking, metric, log line)", True, True)]
    base = 0.0
    for label, with_fault, canary in rows:
        us = min(chain_cost_us(args.n if not canary else args.n // 20, with_fault, canary)
                 for _ in range(5))
        base = base or us
        print(f"  {label:58s} {us:8.2f} µs  (+{us - base:.2f})")
    print(f"2. primary latency, gRPC, {args.requests} requests per route, interleaved (ms)")
    lat = end_to_end(args.requests)
    ref = statistics.median(lat["direct"])
    print(f"  {'route':10s} {'p50':>7s} {'p90':>7s} {'p99':>7s} {'p50 / direct':>13s}")
    for name, values in lat.items():
        q = np.percentile(values, [50, 90, 99])
        print(f"  {name:10s} {q[0]:7.2f} {q[1]:7.2f} {q[2]:7.2f} {q[0] / ref:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
