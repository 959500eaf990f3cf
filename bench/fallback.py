"""What the fallback filter costs when all is well, and how fast it moves when it is not.

    python -m bench.fallback [--n 3000]

Part 1: the filter's own cost per request on the healthy path (µs), in-process: the same chain
with and without ``fallback`` around a terminal that answers at once (v2 FP32 [1,16]; the L3
cache stores every answer and the NaN check reads it: the defaults).
Part 2: a real Triton primary is SIGKILLed under a steady request loop (c=1 through mmguard's
gRPC front); prints the time from the kill to the first answer from L2 (a second real Triton)
and how the requests in between ended.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from filters.fallback.filter import Fallback, FallbackConfig
from proxy.call import Call, Reply, Result, Target
from proxy.chain import FilterContext, compose
from proxy.cli.demo_model import ensure_clip_demo
from proxy.clock import SystemClock
from proxy.telemetry import Telemetry
from proxy.tensor import Tensor
from proxy.wire import kserve_grpc
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer, write_model_repository
from tests.support.wire import grpc_infer_raw, grpc_request

BODY = grpc_request("m", [("x", "FP32", [1, 16], np.ones(16, "<f4").tobytes())])


async def healthy_path(n: int) -> tuple[float, float]:
    answer = Result("m", "1", "", [Tensor("y", "FP32", (1, 16), raw=np.ones(16, "<f4").tobytes())])

    async def terminal(call: Call) -> Reply:
        return answer

    ctx = FilterContext("m", Telemetry(), SystemClock(), random.Random(0), lambda: None)
    chains = {"without": compose([], terminal),
              "with": compose([("fallback", Fallback(FallbackConfig(), ctx))], terminal)}
    out = {}
    for label, chain in chains.items():
        for _ in range(200):  # warm up
            call = kserve_grpc.decode_request(BODY)
            call.target = Target("b", "m")
            await chain(call)
        start = time.perf_counter()
        for _ in range(n):
            call = kserve_grpc.decode_request(BODY)
            call.target = Target("b", "m")
            await chain(call)
        out[label] = (time.perf_counter() - start) / n * 1e6
    return out["without"], out["with"]


def failover(tmp: Path) -> tuple[float, list[str]]:
    onnx_path = ensure_clip_demo(tmp / "onnx")
    servers = [TritonServer(write_model_repository(tmp / n / "repo", onnx_path),
                            tmp / n / "work").start() for n in ("primary", "light")]
    primary, light = servers
    cfg = {"backends": [{"kind": "triton_grpc", "name": "p", "url": primary.grpc_url},
                        {"kind": "triton_grpc", "name": "l", "url": light.grpc_url}],
           "telemetry": {"log_level": "error"},
           "models": [{"name": "y", "backend": "p", "backend_model": "small_fp32",
                       "filters": [{"fallback": {"degrade_to": ["y_light"], "breaker": {
                           "minimum_calls": 3, "wait_in_open_s": 30}}}]},
                      {"name": "y_light", "backend": "l", "backend_model": "small_fp32"}]}
    body = grpc_request("y", [("x", "FP32", [1, 16], np.ones(16, "<f4").tobytes())])
    outcomes: list[str] = []
    try:
        with RunningMmguard(cfg) as m:
            m.wait_ready(timeout=60)
            for _ in range(50):
                grpc_infer_raw(m.grpc_url, body)
            assert primary.pid is not None
            os.killpg(primary.pid, signal.SIGKILL)
            killed = time.monotonic()
            while time.monotonic() - killed < 10:
                try:
                    _, trailers = grpc_infer_raw(m.grpc_url, body, 5)
                    level = dict(trailers or ()).get("mmguard-fallback-level", "1")[:1]
                    outcomes.append(f"L{level}")
                    if level == "2":
                        return (time.monotonic() - killed) * 1e3, outcomes
                except grpc.RpcError as err:
                    outcomes.append(err.code().name)
            return float("nan"), outcomes
    finally:
        for s in servers:
            s.stop()


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fallback",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000)
    args = ap.parse_args()
    samples = [asyncio.run(healthy_path(args.n)) for _ in range(3)]
    without = statistics.median(s[0] for s in samples)
    with_ = statistics.median(s[1] for s in samples)
    print("fallback on the healthy path, in-process (decode + chain, µs per request)")
    print(f"  without fallback {without:8.1f}\n  with fallback    {with_:8.1f}"
          f"\n  added            {with_ - without:8.1f}")
    with tempfile.TemporaryDirectory() as d:
        ms, outcomes = failover(Path(d))
    print("\nprimary Triton SIGKILLed under a c=1 request loop")
    print(f"  time to the first L2 answer: {ms:.1f} ms")
    print(f"  requests in between: {outcomes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
