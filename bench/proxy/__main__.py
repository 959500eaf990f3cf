"""The command line of ``python -m bench.proxy`` (see the package's doc)."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from bench.chain_study import DEFAULT_CHAINS, STUDY, chain_table, parse_chains, summarize
from bench.common import (
    ROOT,
    busy_before,
    http_json,
    machine_info,
    report_problems,
    shut_down,
)
from bench.proxy import DESCRIPTION
from bench.proxy.report import cell_line, machine_line, write_reports
from bench.proxy.run import Bench

DISTS = ("grpcio", "aiohttp", "onnxruntime", "numpy", "tritonclient", "nvidia-pytriton",
         "mmguard", "protobuf")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.proxy", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per cell (5)")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per cell (1)")
    p.add_argument("--concurrency", default="1,16",
                   help="comma-separated in-flight request counts (1,16)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out", help="results folder")
    p.add_argument("--ort-threads", type=int, default=2,
                   help="mmguard's onnxruntime backend threads (and the direct pool's) (2)")
    p.add_argument("--mmguard-log-level", default="warning",
                   choices=("debug", "info", "warning", "error"))
    p.add_argument("--no-nginx", action="store_true", help="skip the nginx baseline")
    p.add_argument("--no-ort", action="store_true", help="skip the ONNX Runtime rows")
    p.add_argument("--floor", action="store_true",
                   help="also measure bench/passthrough_proxy.py (bare grpc.aio/aiohttp "
                        "pass-through: the floor for a Python proxy) on the Triton rows")
    p.add_argument("--keep-tmp", action="store_true",
                   help="keep the temp dir (configs, server logs) and print its path")
    g = p.add_argument_group("the full chain's price (bench/chain_study.py)")
    g.add_argument("--chains", default=",".join(DEFAULT_CHAINS),
                   help=f"chains to measure on the 600 KB case, comma-separated, from "
                        f"{','.join(STUDY)}; '' for none ({','.join(DEFAULT_CHAINS)})")
    g.add_argument("--chain-study", action="store_true",
                   help="every chain: the default, one filter added at a time, full, full with "
                        "the shadow at 10 %% (overrides --chains)")
    g.add_argument("--chain-only", action="store_true",
                   help="measure only the chains (no direct / nginx / mmguard matrix)")
    g.add_argument("--chain-rounds", type=int, default=1,
                   help="rounds of every chain, interleaved; the median is reported (1)")
    g.add_argument("--chain-concurrency", type=int, default=16,
                   help="requests in flight in the chain cells (16)")
    args = p.parse_args(argv)
    try:
        args.chains = list(STUDY) if args.chain_study else parse_chains(args.chains)
    except ValueError as exc:
        p.error(f"--chains: {exc}")
    if args.chain_only and not args.chains:
        p.error("--chain-only needs chains to measure")
    if args.chain_rounds < 1 or args.chain_concurrency < 1:
        p.error("--chain-rounds and --chain-concurrency take positive integers")
    try:
        args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError:
        p.error("--concurrency takes integers, e.g. 1,16")
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency takes positive integers")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.no_nginx and shutil.which("nginx") is None:
        print("nginx is not installed (it is the baseline proxy). Install it with\n"
              "    apt-get update && apt-get install -y nginx\n"
              "or run with --no-nginx.", file=sys.stderr)
        return 2

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    info = machine_info(DISTS)
    print(machine_line(info), flush=True)
    busy_before(info)
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="mmguard-bench-"))
    bench = Bench(args)
    try:
        bench.start(tmp)
        assert bench.triton is not None and bench.mmguard is not None
        meta = http_json(f"http://{bench.triton.http_url}/v2")
        if meta:
            info["versions"]["triton"] = meta.get("version", "?")
        rows = bench.run()
        chain_rows = summarize(bench.run_chains())
        elapsed = time.monotonic() - began
        configs = {"mmguard": bench.mmguard.config,
                   **({"chains": bench.study.mmguard.config}
                      if bench.study and bench.study.mmguard else {})}
        table = write_reports(args.out, info, args, rows, bench.cells, configs, elapsed,
                              chain_rows)
        print()
        print(machine_line(info))
        print(f"duration {args.duration:g}s + warm-up {args.warmup:g}s per cell, "
              f"{len(bench.cells)} cells, {elapsed:.0f}s in all")
        print()
        print(table)
        if chain_rows:
            print()
            print(chain_table(chain_rows, md=False))
        print()
        print(f"written: {args.out / 'results.json'}, {args.out / 'results.md'}")
        return report_problems(bench.cells, "results.md", cell_line)
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every process ...", file=sys.stderr)
        return 130
    finally:
        shut_down(bench.stop, tmp, args.keep_tmp)


if __name__ == "__main__":
    sys.exit(main())
