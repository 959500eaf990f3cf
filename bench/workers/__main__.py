"""The command line of ``python -m bench.workers`` (see the package's doc)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from types import FrameType

from bench.common import ROOT, busy_before, machine_info, report_problems, shut_down
from bench.workers import DESCRIPTION
from bench.workers.plan import plan_cpus
from bench.workers.pod import serve_has_workers_flag
from bench.workers.report import cell_line, check_pods, summary_rows, table, write_reports
from bench.workers.run import Bench

DISTS = ("grpcio", "aiohttp", "onnxruntime", "onnxruntime-gpu", "numpy", "tritonclient",
         "nvidia-pytriton", "mmguard")


def _ints(text: str, what: str, p: argparse.ArgumentParser) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        p.error(f"{what} takes comma-separated integers, got {text!r}")
    if not vals or min(vals) < 1:
        p.error(f"{what} takes positive integers, got {text!r}")
    return vals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.workers", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers-list", default="1,2", help="worker counts to measure (1,2)")
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per cell (5)")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per cell (1)")
    p.add_argument("--rounds", type=int, default=1,
                   help="walk the workers list this many times; the table gives medians (1)")
    p.add_argument("--concurrency", type=int,
                   help="requests in flight in all (default: max(16, 8 × the largest N))")
    p.add_argument("--connections", type=int, help="connections in all (default: concurrency)")
    p.add_argument("--loadgens", type=int,
                   help="load-generator processes (default: one per CPU of their set)")
    p.add_argument("--backends", default="ort,triton",
                   help="ort (in-process ONNX Runtime) and/or triton (real Triton) (ort,triton)")
    p.add_argument("--ort-device", default="cpu", choices=("cpu", "cuda", "auto"),
                   help="the onnxruntime backend's device (cpu)")
    p.add_argument("--ort-threads", type=int, default=2,
                   help="each worker's onnxruntime backend threads (2)")
    p.add_argument("--no-pin", action="store_true", help="share all CPUs: no CPU sets")
    p.add_argument("--mmguard-log-level", default="warning",
                   choices=("debug", "info", "warning", "error"))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out", help="results folder")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temp dir and print it")
    args = p.parse_args(argv)
    args.workers_list = _ints(args.workers_list, "--workers-list", p)
    args.backends = [b for b in args.backends.split(",") if b.strip()]
    if not args.backends or set(args.backends) - {"ort", "triton"}:
        p.error(f"--backends takes ort and/or triton, got {','.join(args.backends)!r}")
    if args.rounds < 1:
        p.error("--rounds takes a positive integer")
    if args.concurrency is None:
        args.concurrency = max(16, 8 * max(args.workers_list))
    args.connections = args.connections or args.concurrency
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = plan_cpus(sorted(os.sched_getaffinity(0)), pin=not args.no_pin)
    args.loadgens = args.loadgens or len(plan.loadgen)
    if min(args.concurrency, args.connections) < args.loadgens:
        print(f"--concurrency and --connections must be at least --loadgens ({args.loadgens})",
              file=sys.stderr)
        return 2
    flag = serve_has_workers_flag()
    if not flag and args.workers_list != [1]:
        print("this mmguard's `serve` has no --workers flag: only --workers-list 1 can run "
              "(as one process, no flag)", file=sys.stderr)
        return 2
    if "triton" in args.backends:
        from tests.support.triton import triton_available

        ok, why = triton_available()
        if not ok:
            print(f"no real Triton here ({why}): the Triton rows are skipped", flush=True)
            args.backends = [b for b in args.backends if b != "triton"]
            if not args.backends:
                return 2

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    info = machine_info(DISTS, nginx=False)
    print(f"CPU sets: {plan.note}", flush=True)
    busy_before(info)
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="mmguard-workers-"))
    bench = Bench(args, plan)
    try:
        bench.start(tmp)
        bench.run(args.workers_list, flag)
        rows = summary_rows(bench.cells, len(plan.mmguard))
        doc = {"machine": info, "plan": asdict(plan), "affinity_seen": bench.affinity_seen,
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "workers_flag": flag, "elapsed_s": round(time.monotonic() - began, 1),
               "command": " ".join(["python", "-m", "bench.workers", *sys.argv[1:]]),
               "cells": bench.cells}
        write_reports(args.out, doc, rows)
        print(f"\nCPU sets: {plan.note}\nseen: {bench.affinity_seen}\n")
        print(table(rows, md=False))
        print(f"\nwritten: {args.out / 'workers.json'}, {args.out / 'workers.md'}")
        return report_problems(bench.cells, "workers.md", cell_line) or check_pods(bench.cells)
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every process ...", file=sys.stderr)
        return 130
    finally:
        shut_down(bench.stop, tmp, args.keep_tmp)


if __name__ == "__main__":
    sys.exit(main())
