"""Each filter's CPU per call on the 600 KB case, in-process: the chain study's chains
(``bench/chain_study.py``) over ``tests/support/chain_harness.py``'s in-memory backend, so the
figure is the filters' own work, free of the transport and of the other processes on a busy
machine (CPU time of this process, ``time.process_time``).

    python -m bench.chain_profile [--calls 300] [--repeats 5] [--chains default,full]
    python -m bench.chain_profile --profile full      # cProfile of one chain, top functions
    python -m bench.chain_profile --breakdown --reuse-signals   # the chain around the signals
    python -m bench.chain_profile --breakdown --cold 16   # each call after 16 MB of other reads

``--cold MB`` reads MB of other memory before each call (its CPU is not counted), as a request
through the process arrives after the sockets, the codecs and the last request have passed
through the same caches: with 16 MB it reproduces about a third of the gap between this
harness's figures and the process's (``bench/README.md``, "tenth pass").

What it does not see: the codecs and sockets (the same for every chain: ``python -m bench.proxy``'s
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
from collections.abc import Callable
from typing import Any, Protocol

from opentelemetry.trace import Tracer

from bench import chain_study as study
from bench.common import render_table
from proxy.call import Call, Reply, Result, Target
from proxy.chain import Filter, Next
from proxy.tensor import Tensor
from tests.support.chain_harness import ChainHarness, contract_for

SHAPE = (1, 3, 224, 224)


class StepBuilder(Protocol):
    """``proxy.chain._step``'s type: one filter's step of a chain."""

    def __call__(self, name: str, f: Filter, nxt: Next, tracer: Tracer) -> Next: ...


def _identity(call: Call, target: Target) -> Result:
    """pixel_identity: pixel_values back as pixel_out, in a buffer of its own."""
    t = call.inputs[0]
    return Result(target.model, outputs=[Tensor(study.TRITON_OUT, "FP32", t.shape,
                                                 raw=bytes(t.raw_bytes()))])


class Breakdown:
    """Each filter's own CPU (``time.thread_time_ns``: this thread's CPU, not wall time), the
    time spent in its ``next`` and in the backend left out: ``proxy.chain._step`` is wrapped
    for the run (a bench-only build of the chain). The modality router's reroute (the path
    route's data plane and chain) is its own; the backend answering it is not."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.backend_ns = 0
        self.calls = 0
        self.found: dict[str, list[dict[str, float]]] = {}
        """Chain -> each repeat's :meth:`per_call_us` (set at the end of the run)."""

    def install(self) -> StepBuilder:
        """Wraps ``proxy.chain._step`` (until :func:`main` puts the returned original back)."""
        import proxy.chain as chain_mod

        original = chain_mod._step
        me = self

        def step(name: str, f: Filter, nxt: Next, tracer: Tracer) -> Next:
            async def timed_step(call: Call) -> Reply:
                inside = [0, 0]  # ns in next, backend ns within next

                async def timed_next(c: Call) -> Reply:
                    b0, t0 = me.backend_ns, time.thread_time_ns()
                    try:
                        return await nxt(c)
                    finally:
                        inside[0] += time.thread_time_ns() - t0
                        inside[1] += me.backend_ns - b0

                b0, t0 = me.backend_ns, time.thread_time_ns()
                try:
                    return await f(call, timed_next)
                finally:
                    total = time.thread_time_ns() - t0
                    backend_outside_next = (me.backend_ns - b0) - inside[1]
                    me.ns[name] = me.ns.get(name, 0) + total - inside[0] - backend_outside_next

            async def as_filter(call: Call, next: Next) -> Reply:
                return await timed_step(call)

            return original(name, as_filter, nxt, tracer)

        chain_mod._step = step
        return original

    def answer(self, call: Call, target: Target) -> Result:
        t0 = time.thread_time_ns()
        try:
            return _identity(call, target)
        finally:
            self.backend_ns += time.thread_time_ns() - t0

    def reset(self) -> None:
        self.ns, self.calls = {}, 0

    def per_call_us(self) -> dict[str, float]:
        return {k: v / 1000 / max(self.calls, 1) for k, v in self.ns.items()}


def reuse_signals() -> Callable[[], None]:
    """Quality's image signals measured once per image and handed back after that: the bench
    sends one image, so what is left of the quality filter's cost is the work around its
    signals (rules, report, headers, scores, drift). An image is told apart by its shape,
    dtype, spec and ~1,000 of its values (not every byte: that read would be billed to the
    quality filter). Returns what puts the real ``measure_image`` back."""
    import filters.quality.filter as quality

    name = "measure_image"  # the quality filter's own reference to it
    real = getattr(quality, name)
    seen: dict[tuple[Any, ...], tuple[dict[str, Any], Any]] = {}

    def once(image: Any, spec: Any, optional: frozenset[str]) -> tuple[dict[str, Any], Any]:
        flat = image.reshape(-1)
        key = (image.shape, image.dtype.str, spec, optional,
               flat[::max(1, flat.size // 1000)].tobytes())
        found = seen.get(key)
        if found is None:
            found = seen[key] = real(image, spec, optional)
        return dict(found[0]), found[1]

    setattr(quality, name, once)

    def restore() -> None:
        setattr(quality, name, real)

    return restore


def harness_doc(chains: list[str]) -> dict[str, Any]:
    """The chains' routes (gRPC ones) on the harness's in-memory backend."""
    routes = [{k: v for k, v in r.items() if k not in ("backend", "backend_model")}
              for r in study.chain_routes(chains) if "-grpc" in r["name"]]
    return {"canary": {"headers": {study.CANARY_HEADER: "1"}},
            "listeners": {"grpc": {"trust_canary_headers": True}}, "models": routes}


async def _run(chains: list[str], calls: int, repeats: int, profile: str | None,
               breakdown: Breakdown | None = None, cold_mb: int = 0
               ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    import numpy as np

    other = np.ones(cold_mb << 18, np.float32)  # MB of float32: read before each call
    evicting = [0.0]  # the CPU those reads took, taken off the chain's figure
    doc = harness_doc(chains)
    contract = contract_for(study.TRITON_MODEL, {study.TRITON_IN: ("FP32", (-1, 3, 224, 224))},
                            {study.TRITON_OUT: ("FP32", (-1, 3, 224, 224))}, max_batch_size=8)
    contracts = {m["name"]: contract for m in doc["models"]}
    x = study.photo_pixels()
    if x is None:
        x = np.random.default_rng(20260105).standard_normal(SHAPE).astype(np.float32)
    out: dict[str, list[float]] = {c: [] for c in chains}
    faults: dict[str, list[float]] = {c: [] for c in chains}
    per_filter: dict[str, list[dict[str, float]]] = {c: [] for c in chains}
    answer = breakdown.answer if breakdown is not None else _identity
    async with ChainHarness.open(doc, answer=answer, contracts=contracts) as h:
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
            if other.size:
                t = time.process_time()
                other.sum()
                evicting[0] += time.process_time() - t
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
                if breakdown is not None:
                    breakdown.reset()
                t0, f0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                evicting[0] = 0.0
                if prof:
                    prof.enable()
                for i in range(calls):
                    await one(route, 100 + i)
                await asyncio.sleep(0)
                if prof:
                    prof.disable()
                    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
                out[chain].append((time.process_time() - t0 - evicting[0]) * 1000 / calls)
                if breakdown is not None:
                    breakdown.calls = calls
                    per_filter[chain].append(breakdown.per_call_us())
                faults[chain].append(
                    (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / calls)
    if breakdown is not None:
        breakdown.found = per_filter
    return out, faults


def _breakdown_table(found: dict[str, list[dict[str, float]]]) -> str:
    names = list(study.STEPS)
    head = ["chain", *[f"{n} µs" for n in names], "sum µs"]
    body = []
    for chain, runs in found.items():
        med = {n: statistics.median(r.get(n, 0.0) for r in runs) for n in names}
        steps = study.steps_of(chain)
        body.append([chain, *[f"{med[n]:.0f}" if n in steps else "" for n in names],
                     f"{sum(med.values()):.0f}"])
    return render_table(head, body, md=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chain_profile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chains", default=",".join(study.STUDY))
    p.add_argument("--profile", default=None, help="a chain to cProfile (first repeat)")
    p.add_argument("--breakdown", action="store_true",
                   help="also each filter's own CPU per call (next and backend left out)")
    p.add_argument("--cold", type=int, default=0, metavar="MB",
                   help="read MB of other memory before each call (not counted): the caches "
                   "as a request through the process finds them")
    p.add_argument("--reuse-signals", action="store_true",
                   help="measure quality's image signals once and reuse them (the bench's "
                   "image never changes): what the chain costs around them")
    args = p.parse_args(argv)
    chains = study.parse_chains(args.chains)
    breakdown = Breakdown() if args.breakdown else None
    original = breakdown.install() if breakdown is not None else None
    restore = reuse_signals() if args.reuse_signals else None
    try:
        found, faults = asyncio.run(_run(chains, args.calls, args.repeats, args.profile,
                                         breakdown, args.cold))
    finally:
        if restore is not None:
            restore()
        if original is not None:
            import proxy.chain as chain_mod
            chain_mod._step = original
    rows, prev, base = [], None, None
    for chain in chains:
        ms = statistics.median(found[chain])
        base = ms if chain == "default" else base
        rows.append([chain, f"{ms:.3f}", f"{min(found[chain]):.3f}-{max(found[chain]):.3f}",
                     "-" if prev is None else f"{ms - prev:+.3f}",
                     "-" if base is None or chain == "default" else f"{ms - base:+.3f}",
                     f"{statistics.median(faults[chain]):.0f}"])
        if chain not in study.VARIANTS:
            prev = ms
    print(render_table(["chain", "CPU ms/call (median)", "min-max", "Δ vs previous",
                        "Δ vs default", "page faults/call"], rows, md=False))
    if breakdown is not None:
        print()
        print("each filter's own CPU per call (median of the repeats; thread CPU time):")
        print(_breakdown_table(breakdown.found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
