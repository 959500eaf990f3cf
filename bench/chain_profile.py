#!/usr/bin/env python
"""Each filter's CPU per call on the 600 KB case, in-process: the chain study's chains
(``bench/chain_study.py``) over ``tests/support/chain_harness.py``'s in-memory backend, so the
figure is the filters' own work, free of the transport and of the other processes on a busy
machine (CPU time of this process, ``time.process_time``).

    python bench/chain_profile.py [--calls 300] [--repeats 5] [--chains default,full]
    python bench/chain_profile.py --profile full      # cProfile of one chain, top functions

What it does not see: the codecs and sockets (the same for every chain: ``bench_proxy.py``'s
chain rows measure the whole process), and a real Triton's answer buffers (the in-memory backend
answers with a fresh ``bytes`` copy of the input, as a decoded answer is).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import chain_study as study
from _common import render_table

from proxy.call import Call, Result, Target
from proxy.tensor import Tensor
from tests.support.chain_harness import ChainHarness, contract_for

SHAPE = (1, 3, 224, 224)


def _identity(call: Call, target: Target) -> Result:
    """pixel_identity: pixel_values back as pixel_out, in a buffer of its own."""
    t = call.inputs[0]
    return Result(target.model, outputs=[Tensor(study.TRITON_OUT, "FP32", t.shape,
                                                 raw=bytes(t.raw_bytes()))])


def harness_doc(chains: list[str]) -> dict[str, Any]:
    """The chains' routes (gRPC ones) on the harness's in-memory backend."""
    routes = [{k: v for k, v in r.items() if k not in ("backend", "backend_model")}
              for r in study.chain_routes(chains) if "-grpc" in r["name"]]
    return {"canary": {"headers": {study.CANARY_HEADER: "1"}},
            "listeners": {"grpc": {"trust_canary_headers": True}}, "models": routes}


async def _run(chains: list[str], calls: int, repeats: int,
               profile: str | None) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    import numpy as np

    doc = harness_doc(chains)
    contract = contract_for(study.TRITON_MODEL, {study.TRITON_IN: ("FP32", (-1, 3, 224, 224))},
                            {study.TRITON_OUT: ("FP32", (-1, 3, 224, 224))}, max_batch_size=8)
    contracts = {m["name"]: contract for m in doc["models"]}
    x = study.photo_pixels()
    if x is None:
        x = np.random.default_rng(20260105).standard_normal(SHAPE).astype(np.float32)
    out: dict[str, list[float]] = {c: [] for c in chains}
    faults: dict[str, list[float]] = {c: [] for c in chains}
    async with ChainHarness.open(doc, answer=_identity, contracts=contracts) as h:
        for chain in chains:
            if study.has_fault(chain):
                body = study.drill(chain, "grpc")
                from filters.fault.config import ExperimentConfig
                from filters.fault.registry import EXPERIMENTS
                reg = h.runtime.state.get(EXPERIMENTS)
                assert reg is not None
                reg.start(ExperimentConfig.model_validate(body["experiment"]), body["route"],
                          "api")

        async def one(route: str, i: int) -> None:
            reply = await h.infer(route, [Tensor(study.TRITON_IN, "FP32", SHAPE,
                                                 raw=memoryview(x.tobytes()))],
                                  headers={study.CANARY_HEADER: "1"}, request_id=f"r{i}")
            h.backend.calls.clear()  # the harness keeps every call: 600 KB each
            assert isinstance(reply, Result), reply
            if i == 0 and reply.outputs[0].raw_bytes() != x.tobytes():
                raise AssertionError(f"{route}: the answer differs from the input")
            if h.decision(study.FAULT_HEADER):
                raise AssertionError(f"{route}: a fault was injected")

        for rnd in range(repeats):  # interleaved, as the bench's rounds
            for chain in chains:
                route = study.route(chain, "grpc")
                for i in range(20):  # warm-up (and the byte check)
                    await one(route, i)
                prof = cProfile.Profile() if profile == chain and rnd == 0 else None
                t0, f0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                if prof:
                    prof.enable()
                for i in range(calls):
                    await one(route, 100 + i)
                await asyncio.sleep(0)
                if prof:
                    prof.disable()
                    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
                out[chain].append((time.process_time() - t0) * 1000 / calls)
                faults[chain].append(
                    (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / calls)
    return out, faults


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chains", default=",".join(study.STUDY))
    p.add_argument("--profile", default=None, help="a chain to cProfile (first repeat)")
    args = p.parse_args(argv)
    chains = study.parse_chains(args.chains)
    found, faults = asyncio.run(_run(chains, args.calls, args.repeats, args.profile))
    rows, prev, base = [], None, None
    for chain in chains:
        ms = statistics.median(found[chain])
        base = ms if chain == "default" else base
        rows.append([chain, f"{ms:.3f}", f"{min(found[chain]):.3f}-{max(found[chain]):.3f}",
                     "-" if prev is None else f"{ms - prev:+.3f}",
                     "-" if base is None or chain == "default" else f"{ms - base:+.3f}",
                     f"{statistics.median(faults[chain]):.0f}"])
        if chain != "full_shadow10":
            prev = ms
    print(render_table(["chain", "CPU ms/call (median)", "min-max", "Δ vs previous",
                        "Δ vs default", "page faults/call"], rows, md=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
