"""The transport lab: the floor's bare pass-through on every Python transport we could choose,
in front of one real Triton, the same payloads, one run.

    python -m bench.transport_lab [--duration 4] [--warmup 1] [--concurrency 1,16]
                                  [--variants LIST] [--rounds 1] [--with-mmguard]

For each tensor of ``python -m bench.proxy`` (FP32 [1,3,224,224] and [1,16]) and each
concurrency: direct Triton, then every pass-through variant of its protocol
(``bench/transports.py``: HTTP — aiohttp on asyncio's loop and on uvloop, a raw protocol with
httptools on uvloop, granian's RSGI (Rust) when it is installed; gRPC — grpc.aio on asyncio's
loop and on uvloop, grpc's thread-pool server); with ``--with-mmguard``, mmguard itself (default
chain) on both. The first answer of every cell is checked byte for byte (the load generator
of ``bench.proxy``). Recorded per cell: req/s, p50, and the CPU the proxy's processes spent per
request (``/proc``; granian counted with its workers), with each variant's ratio to the floor
it would replace (``aiohttp`` / ``grpc-aio``: what ``--floor`` measures) in the same round.
Rounds interleave the variants, so a noisy stretch of a shared machine spreads over all of them;
the median over rounds is reported. Results: a table on stdout and ``<out>/transport_lab.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    CpuWindow,
    MmguardProcess,
    busy_before,
    free_ports,
    group_cpu_s,
    machine_info,
    pdeathsig,
    proc_cpu_s,
    render_table,
    shut_down,
    stop_each,
    stop_process,
)
from bench.loadgen import LoadGen
from bench.proxy.cases import CASES, TensorCase
from bench.proxy.cells import loadgen_main
from bench.proxy.servers import start_triton
from bench.transports import GRPC_ALL, GRPC_VARIANTS, HTTP_VARIANTS

FLOOR = {"http": "aiohttp", "grpc": "grpc-aio"}
MMGUARD = "mmguard (uvloop)"
MMGUARD_AIOHTTP = "mmguard, no fast lane"
"""The same mmguard with ``listeners.http.fast_lane: false`` (HTTP rows only): the lane's own
effect, in the same run."""


class Variant:
    """One pass-through variant as a child process in its own session (its group's CPU)."""

    def __init__(self, name: str, root: Path, triton_grpc: str, triton_http: str) -> None:
        self.name = name
        self.protocol = "grpc" if name in GRPC_ALL else "http"
        self.log_path = root / f"{name}.log"
        self.triton = (triton_grpc, triton_http)
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def command(self) -> list[str]:
        if self.name == "granian-rsgi":
            return [sys.executable, "-m", "granian", "--interface", "rsgi", "--host", "127.0.0.1",
                    "--port", str(self.port), "--workers", "1", "--runtime-threads", "1",
                    "--loop", "uvloop", "--no-access-log", "--log-level", "warning",
                    "bench.transports:rsgi_app"]
        return [sys.executable, "-m", "bench.transports", self.name, str(self.port),
                *self.triton]

    def start(self) -> None:
        self.port = free_ports(1)[0]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pdeathsig,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_HTTP": self.triton[1]})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            text = self.log_path.read_text(errors="replace")
            if "ready" in text or (self.name == "granian-rsgi" and _listening(self.port)):
                return
            time.sleep(0.1)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"{self.name} did not start: {tail}")

    def cpu_s(self) -> float:
        assert self.proc is not None
        return group_cpu_s(self.proc.pid)

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout=10)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def available(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """The variants that can run here, and why the others cannot."""
    missing: dict[str, str] = {}
    for name, module in (("granian-rsgi", "granian"), ("httptools-uvloop", "httptools"),
                         ("aiohttp-rawclient-uvloop", "httptools"),
                         ("httptools-aioclient-uvloop", "httptools")):
        if name in names:
            try:
                __import__(module)
            except ImportError:
                missing[name] = f"{module} is not installed"
    return [n for n in names if n not in missing], missing


class Lab:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.variants: dict[str, Variant] = {}
        self.mmguard: MmguardProcess | None = None
        self.mmguard_aiohttp: MmguardProcess | None = None
        self.triton: Any = None
        self.loadgen: LoadGen | None = None
        self.cells: list[dict[str, Any]] = []

    def start(self, root: Path) -> None:
        print("starting Triton ...", flush=True)
        self.triton = start_triton(root / "triton")
        for name in self.args.variants:
            v = Variant(name, root, self.triton.grpc_url, self.triton.http_url)
            v.start()
            self.variants[name] = v
            print(f"  {name} ready on {v.port} (pid {v.proc.pid if v.proc else '?'})",
                  flush=True)
        if self.args.with_mmguard:
            from bench.proxy.servers import Mmguard

            (root / "ort").mkdir(parents=True, exist_ok=True)
            both = []
            for folder, lane in (("mmguard", True), ("mmguard-aiohttp", False)):
                (root / folder).mkdir(parents=True, exist_ok=True)
                m = Mmguard(root / folder, self.triton, root / "ort", 2, "warning")
                m.config["models"] = [x for x in m.config["models"] if x["backend"] != "ort"]
                m.config["backends"] = [b for b in m.config["backends"]
                                        if b["kind"] != "onnxruntime"]
                listeners = m.config.setdefault("listeners", {})
                listeners.setdefault("http", {})["fast_lane"] = lane
                m.config_path.write_text(json.dumps(m.config, indent=2))
                m.start()
                both.append(m)
            self.mmguard, self.mmguard_aiohttp = both
        self.loadgen = LoadGen(loadgen_main)

    def stop(self) -> None:
        stop_each([("load generator", self.loadgen.close if self.loadgen else None),
                   *((n, v.stop) for n, v in self.variants.items()),
                   ("mmguard", self.mmguard.stop if self.mmguard else None),
                   ("mmguard, no fast lane",
                    self.mmguard_aiohttp.stop if self.mmguard_aiohttp else None),
                   ("Triton", self.triton.stop if self.triton else None)])

    def measure(self, case: TensorCase, proto: str, c: int, target: str) -> dict[str, Any]:
        assert self.loadgen is not None
        route = case.triton_model if proto == "grpc" or target == "direct" else case.http_route
        probes = {"loadgen": lambda: proc_cpu_s(self.loadgen.pid if self.loadgen else 0)}
        if target == "direct":
            addr = self.triton.grpc_url if proto == "grpc" else self.triton.http_url
        elif target in (MMGUARD, MMGUARD_AIOHTTP):
            m = self.mmguard if target == MMGUARD else self.mmguard_aiohttp
            assert m is not None and m.pid is not None
            addr = f"127.0.0.1:{m.ports[proto]}"
            pid = m.pid
            probes["proxy"] = lambda: proc_cpu_s(pid)
        else:
            v = self.variants[target]
            addr = f"127.0.0.1:{v.port}"
            probes["proxy"] = v.cpu_s
        spec = {"kind": proto, "case": case.key, "protocol": proto, "concurrency": c,
                "shape": list(case.shape), "input": case.triton_in, "output": case.triton_out,
                "op": case.op, "target": target, "addr": addr, "model": route,
                "duration": self.args.duration, "warmup": self.args.warmup}
        window = CpuWindow(probes)
        result = self.loadgen.run(spec, lambda: window.mark("start"), lambda: window.mark("end"))
        result.update(window.result(result.get("requests", 0)))
        cell = {**spec, **result}
        self.cells.append(cell)
        cpu = (result.get("cpu_ms_per_req") or {}).get("proxy")
        print(f"  {case.label} {proto} c={c} {target:18s} {result.get('rps', 0):8.0f} req/s  "
              f"p50 {result.get('p50_ms', 0):6.2f} ms  proxy CPU "
              f"{'-' if cpu is None else f'{cpu:.3f}'} ms/req  errors {result.get('errors')}"
              f"  other {result.get('other_cpu_pct')}%", flush=True)
        return cell

    def run(self) -> None:
        for rnd in range(self.args.rounds):
            for case in CASES:
                for proto in ("grpc", "http"):
                    for c in self.args.concurrency:
                        names = [n for n, v in self.variants.items() if v.protocol == proto]
                        if self.mmguard is not None:
                            names.append(MMGUARD)
                        if self.mmguard_aiohttp is not None and proto == "http":
                            names.append(MMGUARD_AIOHTTP)
                        order = names if rnd % 2 == 0 else names[::-1]
                        for target in ["direct", *order]:
                            self.measure(case, proto, c, target)


def table(cells: list[dict[str, Any]]) -> str:
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    for cell in cells:
        groups.setdefault((cell["case"], cell["protocol"], cell["concurrency"], cell["target"]),
                          []).append(cell)

    def cpu(cell: dict[str, Any]) -> float | None:
        value = (cell.get("cpu_ms_per_req") or {}).get("proxy")
        return None if value is None else float(value)

    rows = []
    labels = {c.key: c.label for c in CASES}
    for (case, proto, c, target), found in groups.items():
        if target == "direct":
            continue
        cpus = [x for x in (cpu(f) for f in found) if x is not None]
        floor = [x for x in (cpu(f) for f in groups.get((case, proto, c, FLOOR[proto]), []))
                 if x is not None]
        direct = groups.get((case, proto, c, "direct"), [])
        med = statistics.median(cpus) if cpus else None
        ratio = med / statistics.median(floor) if med is not None and floor else None
        rps = statistics.median(f.get("rps", 0) for f in found)
        d_rps = statistics.median(f.get("rps", 0) for f in direct) if direct else None
        rows.append([f"{labels[case]} {proto} c={c}", target,
                     "-" if med is None else f"{med:.3f}",
                     "-" if ratio is None else f"{ratio:.2f}", f"{rps:.0f}",
                     "-" if not d_rps else f"{rps / d_rps:.2f}",
                     f"{statistics.median(f.get('p50_ms', 0) for f in found):.2f}",
                     str(sum(int(f.get("errors") or 0) for f in found)),
                     f"{statistics.median(float(f.get('other_cpu_pct') or 0) for f in found):.0f}"])
    return render_table(["case", "transport", "proxy CPU ms/req", "x floor", "req/s",
                         "x direct", "p50 ms", "errors", "other CPU %"], rows, md=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transport_lab",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--variants", default=",".join(HTTP_VARIANTS + GRPC_VARIANTS))
    p.add_argument("--with-mmguard", action="store_true",
                   help="also mmguard itself (default chain, uvloop) in front of the same Triton")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    p.add_argument("--keep-tmp", action="store_true")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.variants, missing = available([v for v in args.variants.split(",") if v])
    for name, why in missing.items():
        print(f"{name}: skipped, {why}", flush=True)
    info = machine_info(("grpcio", "aiohttp", "uvloop", "httptools", "granian"), nginx=False)
    busy_before(info)
    tmp = Path(tempfile.mkdtemp(prefix="mmguard-transport-lab-"))
    lab = Lab(args)
    try:
        lab.start(tmp)
        lab.run()
        text = table(lab.cells)
        print()
        print(text)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "transport_lab.json").write_text(json.dumps(
            {"machine": info, "skipped": missing, "cells": lab.cells}, indent=2, default=str))
        return 1 if any(c.get("errors") or c.get("failed") for c in lab.cells) else 0
    except KeyboardInterrupt:
        return 130
    finally:
        shut_down(lab.stop, tmp, args.keep_tmp)


if __name__ == "__main__":
    sys.exit(main())
