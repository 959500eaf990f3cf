"""What a robustness experiment at its cap costs production.

One mmguard (in-process ONNX Runtime, the demo CLIP model, gRPC), three routes called in turn,
interleaved: ``direct`` (no filter), ``mirror`` (shadow to a canary, no robustness experiment)
and ``robust`` (the same shadow plus a robustness experiment drawing every mirrored copy, two
perturbations, capped at ``--cap`` production calls per second). Reported: the client-facing
p50 / p99 of each route, and the experiment's extra backend calls (production's against its
cap, the canary's) over the run. The canary is the same model on the same backend, so it
competes for the same cores: the honest worst case for a sidecar. The figures are measured on
whatever machine runs this, under whatever else it runs: say so when quoting them.

    python -m bench.robustness [--requests 600] [--cap 10]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from filters.shadow.filter import SHADOWS
from proxy.cli.demo_model import ensure_clip_demo, tokenize
from tests.support.mmguard import RunningMmguard
from tests.support.wire import grpc_infer_raw, grpc_request

ROUTES = ("direct", "mirror", "robust")


def body(model: str, seed: int) -> bytes:
    a, b = np.random.default_rng(seed).random(2)
    y, x = np.mgrid[0:224, 0:224].astype(np.float32) / 223
    px = np.stack([a * x + (1 - a) * y, b * x, 0.5 * y])[None].astype(np.float32)
    return grpc_request(model, [
        ("pixel_values", "FP32", [1, 3, 224, 224], px.tobytes()),
        ("input_ids", "INT64", [1, 77], tokenize("a photo")[None, :].tobytes())])


def config(model_dir: Path, cap: float) -> dict[str, object]:
    shadow = {"canary": "canary", "queue_size": 64, "workers": 2,
              "compare": {"outputs": ["image_embeds", "text_embeds"]},
              "on_abort": {"stop_mirroring": False}}
    robustness = {"perturbations": [{"kind": "gaussian_noise", "sigma": 0.08},
                                    {"kind": "patch_mask", "ratio": 0.25}],
                  "max_qps": cap, "seed": 1,
                  "compare": {"outputs": ["image_embeds", "text_embeds"], "cosine_min": 0.9}}
    ort = {"backend": "ort", "backend_model": "clip_demo"}
    return {"backends": [{"kind": "onnxruntime", "name": "ort", "model_dir": str(model_dir),
                          "threads": 2}],
            "models": [{"name": "direct", **ort, "filters": []},
                       {"name": "mirror", **ort, "filters": [{"shadow": shadow}]},
                       {"name": "robust", **ort, "filters": [
                           {"shadow": {**shadow, "robustness": robustness}}]},
                       {"name": "canary", **ort, "filters": []}]}


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.robustness",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--cap", type=float, default=10.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mmguard-bench-robustness-"))
    ensure_clip_demo(tmp)
    bodies = {r: [body(r, i) for i in range(32)] for r in ROUTES}
    lat: dict[str, list[float]] = {r: [] for r in ROUTES}
    load = os.getloadavg()
    with RunningMmguard(config(tmp, args.cap)) as m:
        m.wait_ready(timeout=60)
        start = time.monotonic()
        for i in range(args.requests + 30):
            for name in random.Random(i).sample(ROUTES, len(ROUTES)):
                t = time.perf_counter()
                grpc_infer_raw(m.grpc_url, bodies[name][i % 32])
                if i >= 30:
                    lat[name].append((time.perf_counter() - t) * 1000)
        elapsed = time.monotonic() - start
        assert m.server is not None
        snap = (m.server.plane.runtime.local.get(SHADOWS) or {})["robust"].snapshot()
    counts = snap["robustness"]["counts"]
    print(f"machine load average at start: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
          f"({os.cpu_count()} CPUs) — measured under that load")
    print(f"client-facing latency, gRPC, {args.requests} calls per route, interleaved (ms)")
    ref = float(np.median(lat["direct"]))
    print(f"  {'route':8s} {'p50':>7s} {'p99':>7s} {'p50 − direct':>13s}")
    for name in ROUTES:
        q = np.percentile(lat[name], [50, 99])
        print(f"  {name:8s} {q[0]:7.2f} {q[1]:7.2f} {q[0] - ref:+13.2f}")
    print(f"robustness experiment over {elapsed:.1f} s: {counts['drawn']} copies drawn, "
          f"{counts['skipped_cap']} over the cap; extra production calls "
          f"{counts['production_calls']} ({counts['production_calls'] / elapsed:.1f}/s, cap "
          f"{args.cap:g}/s), extra canary calls {counts['canary_calls']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
