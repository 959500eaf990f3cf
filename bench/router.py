"""Routing decision cost (µs) with 2 and 8 paths: recomputing the weights (every call, the
worst case: ``dwell_s: 0``) and the weighted choice, in-process.

    python -m bench.router [--n 20000]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from filters.modality_router import ModalityRouter, RouterConfig
from proxy.chain import FilterContext
from proxy.clock import SystemClock
from proxy.telemetry import Telemetry


def cost_us(paths: int, n: int, dwell: float) -> float:
    cfg = RouterConfig.model_validate({"paths": [{"route": f"p{i}"} for i in range(paths)],
                                       "dwell_s": dwell})
    router = ModalityRouter(cfg, FilterContext("m", Telemetry(), SystemClock(),
                                               random.Random(0), lambda: None))
    rng = random.Random(1)
    for i in range(paths):
        for _ in range(20):
            router.record(f"p{i}", rng.uniform(0.002, 0.02), rng.random() < 0.05, rng.random())
    eligible = list(cfg.paths)
    start = time.perf_counter()
    for _ in range(n):
        router._maybe_update()
        router._choose(eligible)
    return (time.perf_counter() - start) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    print(f"{'paths':>5} {'recompute every call µs':>24} {'dwell 2 s (choice only) µs':>27}")
    for paths in (2, 8):
        print(f"{paths:5d} {cost_us(paths, args.n, 0.0):24.1f} "
              f"{cost_us(paths, args.n, 2.0):27.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
