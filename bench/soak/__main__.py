"""The soak's run (see the package's doc): mmguard started, every kind's workers and the
sampler until the time is up, the summary and ``soak.json``."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import grpc
import numpy as np

from bench.common import ROOT, MmguardProcess, http_json, proc_cpu_s
from bench.soak import DESCRIPTION
from bench.soak.load import (
    Kind,
    Load,
    bad_call,
    grpc_unary,
    http_binary_call,
    http_json_call,
    openai_stream_call,
    stream_worker,
    unary_worker,
)

# ---------------------------------------------------------------------------------------------
# Sampling and reporting
# ---------------------------------------------------------------------------------------------


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return None


def slope_mib_per_h(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) points, in MiB per hour."""
    if len(points) < 3:
        return None
    t = np.array([p[0] for p in points])
    y = np.array([p[1] for p in points])
    if np.ptp(t) == 0:
        return None
    return float(np.polyfit(t, y, 1)[0] * 3600)


def _ms(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q) * 1000:.1f}" if values else "-"


def interval_line(elapsed: float, span: float, kinds: list[Kind], rss: float | None,
                  fds: int | None, cpu_pct: float) -> str:
    parts = [f"[{elapsed:6.0f}s] rss {rss or 0:7.1f} MiB  fds {fds or 0:3d}  cpu {cpu_pct:3.0f}%"]
    for k in kinds:
        parts.append(f"{k.name} {len(k.lat) / span:6.1f}/s {_ms(k.lat, 50)}/{_ms(k.lat, 99)}ms")
    errors = ", ".join(f"{k.name} {code}×{n}" for k in kinds for code, n in k.errors.items())
    return " | ".join(parts) + f" | errors: {errors or 'none'}"


async def sampler(pid: int, kinds: list[Kind], start: float, until: float, interval: float,
                  samples: list[dict[str, Any]]) -> None:
    """RSS every second; a line every ``interval`` seconds."""
    last_report, cpu0 = time.monotonic(), proc_cpu_s(pid)
    while (now := time.monotonic()) < until:
        await asyncio.sleep(min(1.0, max(until - now, 0.01)))
        now = time.monotonic()
        rss, fds = rss_mib(pid), open_fds(pid)
        samples.append({"t": round(now - start, 2), "rss_mib": rss, "fds": fds})
        if now - last_report >= interval or now >= until:
            span = now - last_report
            cpu1 = proc_cpu_s(pid)
            print(interval_line(now - start, span, kinds, rss, fds, 100 * (cpu1 - cpu0) / span),
                  flush=True)
            for k in kinds:
                k.all_lat.extend(k.lat)
                k.lat.clear()
            last_report, cpu0 = now, cpu1


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def mmguard_config(model_dir: Path, vllm: str | None, vllm_model: str | None) -> dict[str, Any]:
    from tests.conftest import ort_config

    cfg: dict[str, Any] = ort_config(model_dir, telemetry={"log_level": "warning"})
    if vllm:
        cfg["backends"].append({"kind": "vllm", "name": "vllm", "url": vllm})
        cfg["models"].append({"name": vllm_model, "backend": "vllm"})
    return cfg


async def run_load(args: argparse.Namespace, proc: MmguardProcess, vllm_model: str | None
                   ) -> tuple[list[Kind], list[dict[str, Any]], float]:
    load = Load(f"127.0.0.1:{proc.ports['http']}", f"127.0.0.1:{proc.ports['grpc']}",
                vllm_model)
    names = ["grpc", "grpc_stream", "http_json", "http_binary", "bad"]
    names += ["openai_stream"] if vllm_model else []
    kinds = {n: Kind(n) for n in names}
    samples: list[dict[str, Any]] = []
    start = time.monotonic()
    until = start + args.minutes * 60
    c = args.concurrency
    connector = aiohttp.TCPConnector(limit=0)
    async with grpc.aio.insecure_channel(load.grpc_url) as channel, \
            aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60),
                                  headers={"Accept-Encoding": "identity"}) as session:
        units: dict[str, Callable[[], Awaitable[None]]] = {
            "grpc": grpc_unary(load, channel), "http_json": http_json_call(load, session),
            "http_binary": http_binary_call(load, session),
            "bad": bad_call(load, session, channel)}
        if vllm_model:
            units["openai_stream"] = openai_stream_call(load, session)
        tasks = [unary_worker(one, kinds[n], until) for n, one in units.items()
                 for _ in range(c if n != "bad" else 1)]
        tasks += [stream_worker(load, channel, kinds["grpc_stream"], until) for _ in range(c)]
        tasks.append(sampler(proc.pid or 0, list(kinds.values()), start, until, args.interval,
                             samples))
        await asyncio.gather(*tasks)
    return list(kinds.values()), samples, time.monotonic() - start


def summary(kinds: list[Kind], samples: list[dict[str, Any]], seconds: float,
            args: argparse.Namespace) -> tuple[str, dict[str, Any], bool]:
    lines = [f"\nsoak: {seconds:.0f} s, concurrency {args.concurrency} per kind", "",
             f"{'kind':<14} {'requests':>9} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
             f"{'max ms':>7}  errors"]
    for k in kinds:
        lat = k.all_lat + k.lat
        errs = ", ".join(f"{c}×{n}" for c, n in k.errors.items()) or "0"
        lines.append(f"{k.name:<14} {k.done:>9,} {k.done / seconds:>7.1f} {_ms(lat, 50):>7} "
                     f"{_ms(lat, 99):>7} {(max(lat) * 1000 if lat else 0):>7.1f}  {errs}")
    rss = [(s["t"], s["rss_mib"]) for s in samples if s["rss_mib"] is not None]
    warm = args.warmup if args.minutes * 60 >= 2 * args.warmup else args.minutes * 60 / 3
    slope = slope_mib_per_h([p for p in rss if p[0] >= warm])
    fds = [s["fds"] for s in samples if s["fds"] is not None]
    failed = sum(sum(k.errors.values()) for k in kinds)
    flat = slope is not None and slope <= args.max_rss_slope_mib_per_h
    figures = {"seconds": round(seconds, 1), "warmup_s": round(warm, 1),
               "rss_first_mib": rss[0][1] if rss else None,
               "rss_last_mib": rss[-1][1] if rss else None,
               "rss_max_mib": max(p[1] for p in rss) if rss else None,
               "rss_slope_mib_per_h": None if slope is None else round(slope, 2),
               "fds_first": fds[0] if fds else None, "fds_last": fds[-1] if fds else None,
               "unexpected_failures": failed}
    lines += ["", f"RSS: first {figures['rss_first_mib']:.1f} MiB, last "
              f"{figures['rss_last_mib']:.1f}, max {figures['rss_max_mib']:.1f}; slope after "
              f"{warm:.0f} s warm-up: {slope if slope is not None else float('nan'):+.1f} MiB/h "
              f"(limit {args.max_rss_slope_mib_per_h:g})" if rss else "RSS: no samples",
              *(["(under 10 minutes of samples after the warm-up: the slope is noisy; soak "
                 "for 30 minutes or more for a verdict)"] if seconds - warm < 600 else []),
              f"open fds: first {figures['fds_first']}, last {figures['fds_last']}",
              f"unexpected failures: {failed}"]
    for k in kinds:
        for code, text in k.samples.items():
            lines.append(f"  {k.name} {code}: {text}")
    ok = flat and failed == 0
    lines.append("verdict: " + ("OK" if ok else "FAIL" + ("" if flat else " (RSS grows)")
                                + ("" if failed == 0 else " (requests failed)")))
    return "\n".join(lines), figures, ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=DESCRIPTION)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the load runs (10)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between lines (10)")
    p.add_argument("--warmup", type=float, default=60.0,
                   help="seconds left out of the RSS slope (60; a third of the run if shorter "
                        "than two warm-ups)")
    p.add_argument("--concurrency", type=int, default=2,
                   help="requests in flight per kind (2; 'bad' always 1)")
    p.add_argument("--max-rss-slope-mib-per-h", type=float, default=50.0,
                   help="exit 1 when RSS grows faster (50)")
    p.add_argument("--vllm", metavar="URL", help="also stream chat completions through a vllm "
                   "backend at this URL")
    p.add_argument("--vllm-model", help="the model name vLLM serves (default: its /v1/models)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    p.add_argument("--keep-tmp", action="store_true", help="keep the models, config and log")
    return p.parse_args(argv)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM stops mmguard the same way as Ctrl-C (``finally`` below)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vllm_model = args.vllm_model
    if args.vllm and not vllm_model:
        listed = http_json(args.vllm.rstrip("/") + "/v1/models") or {}
        vllm_model = next((m["id"] for m in listed.get("data", [])), None)
        if not vllm_model:
            raise SystemExit(f"no model listed at {args.vllm}/v1/models; give --vllm-model")
    from tests.support.models import ort_repository

    tmp = Path(tempfile.mkdtemp(prefix="mmguard-soak-"))
    (tmp / "models").mkdir()
    proc = MmguardProcess(tmp, mmguard_config(ort_repository(tmp / "models"), args.vllm,
                                              vllm_model))
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        proc.start()
        kinds = ", ".join(["grpc", "grpc_stream (one response per request: ONNX Runtime has no "
                           "decoupled model)", "http_json", "http_binary", "bad",
                           *(["openai_stream"] if vllm_model else [])])
        print(f"mmguard pid {proc.pid}, ports {proc.ports}; load: {kinds}; "
              f"{args.minutes:g} min", flush=True)
        kinds_done, samples, seconds = asyncio.run(run_load(args, proc, vllm_model))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        proc.stop()
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    text, figures, ok = summary(kinds_done, samples, seconds, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(
        {"figures": figures, "args": {k: str(v) for k, v in vars(args).items()},
         "kinds": {k.name: {"requests": k.done, "errors": dict(k.errors)} for k in kinds_done},
         "samples": samples}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
