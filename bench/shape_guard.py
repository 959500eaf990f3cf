"""What shape_guard costs per request, beside what a whole request costs.

    python -m bench.shape_guard [--n 2000]

Part 1 times the guard's request checks alone (in-process, µs per request) at batch 1 and 64:
a v2 image+token request against clip_demo's contract (dims, dtype, batch, pad-aware token
limit) and a BYTES text request counted with whitespace and with an HF tokenizer.json.
Part 2 runs the same requests through a real mmguard (gRPC front, in-process ONNX Runtime) with
and without the guard on the route, and prints the median request latency of each, so the
guard's cost is read against the whole request.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from filters.shape_guard.filter import ShapeGuard, ShapeGuardConfig
from proxy.chain import FilterContext
from proxy.clock import SystemClock
from proxy.contract import ModelContract, TensorSpec
from proxy.telemetry import Telemetry
from proxy.wire import kserve_grpc
from tests.support.mmguard import RunningMmguard
from tests.support.models import ort_repository
from tests.support.wire import grpc_infer_raw, grpc_request

CLIP = ModelContract("clip_demo", ("1",), "onnxruntime_onnx",
                     (TensorSpec("pixel_values", "FP32", (-1, 3, 224, 224)),
                      TensorSpec("input_ids", "INT64", (-1, 77))),
                     (TensorSpec("image_embeds", "FP32", (-1, 64)),), max_batch_size=64)
TEXT = ModelContract("clip_text", ("1",), "python", (TensorSpec("text", "BYTES", (-1, 1)),),
                     (TensorSpec("embedding", "FP32", (-1, 8)),), max_batch_size=64)


def guard(cfg: dict[str, object], contract: ModelContract) -> ShapeGuard:
    ctx = FilterContext("bench", Telemetry(), SystemClock(), random.Random(0), lambda: contract)
    return ShapeGuard(ShapeGuardConfig.model_validate(cfg), ctx)


def clip_body(batch: int) -> bytes:
    px = np.zeros((batch, 3, 224, 224), "<f4").tobytes()
    ids = np.zeros((batch, 77), "<i8")
    ids[:, :20] = 7
    return grpc_request("clip_demo", [("pixel_values", "FP32", [batch, 3, 224, 224], px),
                                      ("input_ids", "INT64", [batch, 77], ids.tobytes())])


def text_body(batch: int) -> bytes:
    words = " ".join(f"w{i}" for i in range(60)).encode()
    raw = b"".join(len(words).to_bytes(4, "little") + words for _ in range(batch))
    return grpc_request("clip_text", [("text", "BYTES", [batch, 1], raw)])


def per_call_us(g: ShapeGuard, contract: ModelContract, body: bytes, n: int) -> float:
    call = kserve_grpc.decode_request(body)
    assert not g.check_request(call, contract)
    start = time.perf_counter()
    for _ in range(n):
        g.check_request(call, contract)
    return (time.perf_counter() - start) / n * 1e6


def tokenizer_file(tmp: Path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i + 1 for i in range(100)}},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp / "tokenizer.json"))
    return str(tmp / "tokenizer.json")


def through_mmguard(tmp: Path, n: int) -> list[tuple[str, float, float]]:
    models = ort_repository(tmp / "models")
    cfg = {"backends": [{"kind": "onnxruntime", "name": "ort", "model_dir": str(models),
                         "max_batch_size": {"clip_demo": 64}}],
           "models": [{"name": "plain", "backend": "ort", "backend_model": "clip_demo"},
                      {"name": "guarded", "backend": "ort", "backend_model": "clip_demo",
                       "filters": [{"limits": {}}, {"shape_guard": {"inputs": {
                           "input_ids": {"max_tokens": 77, "pad_token_id": 0}}}}]}]}
    rows = []
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        for batch in (1, 64):
            body = clip_body(batch)
            reqs = {r: kserve_grpc.encode_request(kserve_grpc.decode_request(body), r, "")
                    for r in ("plain", "guarded")}
            times: dict[str, list[float]] = {"plain": [], "guarded": []}
            for i in range(max(30, n // (batch * 4))):
                for route, req in reqs.items():  # interleaved, so drift hits both alike
                    t0 = time.perf_counter()
                    grpc_infer_raw(m.grpc_url, req)
                    if i >= 5:
                        times[route].append(time.perf_counter() - t0)
            lat = {r: statistics.median(v) * 1e3 for r, v in times.items()}
            rows.append((f"clip_demo batch {batch}", lat["plain"], lat["guarded"]))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.shape_guard",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="repetitions per guard timing")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        token_decl: dict[str, object] = {
            "inputs": {"input_ids": {"max_tokens": 77, "pad_token_id": 0}}}
        cases: list[tuple[str, dict[str, object], ModelContract, Callable[[int], bytes]]] = [
            ("image+ids, dims only", {}, CLIP, clip_body),
            ("image+ids, + token count (pad-aware)", token_decl, CLIP, clip_body),
            ("BYTES text, whitespace count", {"inputs": {"text": {
                "max_tokens": 77, "tokenizer": "whitespace"}}}, TEXT, text_body),
            ("BYTES text, tokenizer.json count", {"inputs": {"text": {
                "max_tokens": 77, "tokenizer": tokenizer_file(tmp)}}}, TEXT, text_body),
        ]
        print("shape_guard request checks, in-process (µs per request)")
        print(f"{'case':40} {'batch 1':>10} {'batch 64':>10}")
        for label, cfg, contract, body in cases:
            g = guard(cfg, contract)
            us = [per_call_us(g, contract, body(b), args.n if b == 1 else args.n // 8)
                  for b in (1, 64)]
            print(f"{label:40} {us[0]:10.1f} {us[1]:10.1f}")
        print("\nthrough mmguard (gRPC → ORT clip_demo), median request latency, c=1")
        print(f"{'case':22} {'no guard ms':>12} {'guard ms':>10} {'added µs':>10}")
        for label, plain, guarded in through_mmguard(tmp, args.n):
            print(f"{label:22} {plain:12.3f} {guarded:10.3f} {(guarded - plain) * 1e3:10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
