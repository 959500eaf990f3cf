#!/usr/bin/env python
"""Worker scaling: mmguard's req/s and CPU per request with 1, 2, ... ``--workers``.

    python bench/bench_workers.py [--workers-list 1,2] [--rounds 1] [--no-pin] [--out bench/out]

The helpers (CPU-set plan, efficiency, /proc walks, load-generator cells) are in ``_workers.py``.

The proxy must be the bottleneck, so the load generator, the backend and mmguard are pinned to
CPU sets apart (:func:`plan_cpus`; each is started from a thread whose affinity is that set, so
every process and thread it makes inherits it, and the set each really got is read back from
/proc and printed). mmguard's set is the same in every cell: between two cells only the
``--workers`` flag changes. What is measured per cell:

* FP32 [1,3,224,224] over gRPC and HTTP (KServe v2), routed by mmguard to (a) the in-process ONNX
  Runtime backend (the identity models ``bench_proxy.write_ort_models`` writes; the inference
  runs inside mmguard's workers, so its CPU is in mmguard's figure) and (b) a real Triton
  (nvidia-pytriton) when one can start; plus the same load sent to Triton directly, once, as the
  ceiling the backend itself sets.
* req/s and latency from ``--loadgens`` load-generator processes; each keeps its share of
  ``--concurrency`` requests in flight over its share of ``--connections`` connections (gRPC: one
  channel each, with its own subchannel pool, so each is a TCP connection of its own; HTTP: one
  keep-alive session each). The kernel spreads connections over the workers' SO_REUSEPORT
  sockets by a hash, so how evenly the workers were loaded is reported too (busiest worker's
  CPU over the mean).
* CPU per request of the whole pod: the serve process and every process below it (supervisor +
  workers), found by parent pid in /proc at each sample, the supervisor's share apart.
* scaling efficiency = req/s at N / (N × req/s at 1 worker), and its bound on this machine:
  min(N, CPUs of mmguard's set) / N, with how much of its set the pod used (the bound holds
  only where one worker already filled it). ``--rounds`` walks the list in turn, medians shown.

The first answer on every connection of every cell is checked byte for byte (sent alone, before
the load starts). Results: a table on stdout, ``<out>/workers.json`` and ``<out>/workers.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script it already is
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    ROOT,
    LoadGen,
    MmguardProcess,
    busy_before,
    git_line,
    group_cpu_s,
    http_status,
    machine_info,
    proc_cpu_s,
    report_problems,
    shut_down,
    stop_each,
)
from _workers import (
    CpuPlan,
    PodWindow,
    _loadgen_main,
    affinity,
    allowed_cpus,
    cell_line,
    expected_processes,
    merge_results,
    plan_cpus,
    process_tree,
    split,
    summary_rows,
    table,
)
from bench_proxy import (
    CASES,
    ORT_IN,
    ORT_OUT,
    start_triton,
    write_ort_models,
)

PIXEL = CASES[0]  # FP32 [1,3,224,224]
PROTOCOLS = ("grpc", "http")
DISTS = ("grpcio", "aiohttp", "onnxruntime", "onnxruntime-gpu", "numpy", "tritonclient",
         "nvidia-pytriton", "mmguard")


# ---------------------------------------------------------------------------------------------
# The servers
# ---------------------------------------------------------------------------------------------


def serve_has_workers_flag() -> bool:
    """Whether this checkout's ``mmguard serve`` takes ``--workers``."""
    out = subprocess.run([sys.executable, "-m", "proxy.cli", "serve", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    return "--workers" in out.stdout


class PodMmguard(MmguardProcess):
    """mmguard with ``--workers N`` on its command line (None: no flag, one process)."""

    def __init__(self, root: Path, config: dict[str, Any], workers: int | None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        super().__init__(root, config,
                         () if workers is None else ("--workers", str(workers)))
        self.workers = workers

    def start(self, attempts: int = 3, timeout: float = 120.0) -> None:
        super().start(attempts, timeout)

    def _wait_ready(self, deadline: float) -> bool:
        """Ready when the admin port's /readyz says so (a pod's supervisor: every worker
        connected and ready), its processes are there (supervisor + N workers) and 4 fresh
        connections per worker, each of which may land on any worker, all find one ready."""
        assert self.proc is not None
        url = f"http://127.0.0.1:{self.ports['http']}/v2/health/ready"
        pod = f"http://127.0.0.1:{self.ports['admin']}/readyz"
        want = expected_processes(self.workers or 1)
        while time.monotonic() < deadline and self.proc.poll() is None:
            if (http_status(pod) == 200 and len(process_tree(self.proc.pid)) >= want
                    and all(http_status(url) == 200 for _ in range(4 * want))):
                return True
            time.sleep(0.1)
        return False


def mmguard_config(ort_dir: Path, triton: Any, args: argparse.Namespace) -> dict[str, Any]:
    backends: list[dict[str, Any]] = [
        {"kind": "onnxruntime", "name": "ort", "model_dir": str(ort_dir),
         "models": [PIXEL.ort_model], "threads": args.ort_threads, "intra_op_threads": 1,
         "device": args.ort_device}]
    routes: list[dict[str, Any]] = [{"name": PIXEL.ort_model, "backend": "ort"}]
    if triton is not None:
        backends += [{"kind": "triton_grpc", "name": "triton_grpc", "url": triton.grpc_url},
                     {"kind": "triton_http", "name": "triton_http",
                      "url": f"http://{triton.http_url}"}]
        routes += [{"name": PIXEL.triton_model, "backend": "triton_grpc"},
                   {"name": PIXEL.http_route, "backend": "triton_http",
                    "backend_model": PIXEL.triton_model}]
    return {"listeners": {"http": {"host": "127.0.0.1"}, "grpc": {"host": "127.0.0.1"},
                          "admin": {"host": "127.0.0.1"}},
            "backends": backends, "models": routes,
            "telemetry": {"log_level": args.mmguard_log_level}, "shutdown_grace_s": 1.0}


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, plan: CpuPlan) -> None:
        self.args = args
        self.plan = plan
        self.triton: Any = None
        self.mmguard: PodMmguard | None = None
        self.loadgens: list[LoadGen] = []
        self.cells: list[dict[str, Any]] = []
        self.affinity_seen: dict[str, str] = {}
        self.root = Path()

    def start(self, root: Path) -> None:
        self.root = root
        write_ort_models(root / "ort_models")
        if "triton" in self.args.backends:
            print("starting Triton ...", flush=True)
            with affinity(self.plan.backend):
                self.triton = start_triton(root / "triton")
            self.affinity_seen["triton"] = allowed_cpus(self.triton.pid)
        with affinity(self.plan.loadgen):
            self.loadgens = [LoadGen(_loadgen_main) for _ in range(self.args.loadgens)]
        self.affinity_seen["loadgen"] = ",".join(sorted({allowed_cpus(lg.pid)
                                                        for lg in self.loadgens}))

    def start_mmguard(self, workers: int | None) -> None:
        cfg = mmguard_config(self.root / "ort_models", self.triton, self.args)
        self.mmguard = PodMmguard(self.root / f"mmguard-{workers}", cfg, workers)
        with affinity(self.plan.mmguard):
            self.mmguard.start()
        assert self.mmguard.pid is not None
        tree = process_tree(self.mmguard.pid)
        self.affinity_seen[f"mmguard N={workers}"] = ",".join(sorted({allowed_cpus(p)
                                                                     for p in tree}))
        print(f"  mmguard ready (--workers {workers}): {len(tree)} processes "
              f"{tree}, CPUs {self.affinity_seen[f'mmguard N={workers}']}", flush=True)

    def stop_mmguard(self) -> None:
        if self.mmguard:
            self.mmguard.stop()
        self.mmguard = None

    def stop(self) -> None:
        stop_each([("load generator", lg.close) for lg in self.loadgens]
                  + [("mmguard", self.stop_mmguard),
                     ("Triton", self.triton and self.triton.stop)])

    def _probes(self) -> dict[str, Callable[[], float]]:
        out: dict[str, Callable[[], float]] = {}
        if self.mmguard and self.mmguard.pid:
            pid = self.mmguard.pid
            out["mmguard"] = lambda: sum(proc_cpu_s(p) for p in process_tree(pid))
        if self.triton and self.triton.pid:
            pgid = self.triton.pid
            out["triton"] = lambda: group_cpu_s(pgid)
        pids = [lg.pid for lg in self.loadgens]
        out["loadgen"] = lambda: sum(proc_cpu_s(p) for p in pids)
        return out

    def measure(self, spec: dict[str, Any], label: str) -> dict[str, Any]:
        n = len(self.loadgens)
        conc, conns = split(self.args.concurrency, n), split(self.args.connections, n)
        window = PodWindow(self._probes(), self.mmguard.pid if spec["target"] == "mmguard"
                           and self.mmguard else None)
        lock, counts = threading.Lock(), {"start": 0, "end": 0}

        def on(what: str) -> None:
            with lock:  # the window: from the last generator's start to the first one's end
                counts[what] += 1
                if (what == "start" and counts[what] == n) or (what == "end" and counts[what] == 1):
                    window.mark(what)

        results: list[dict[str, Any]] = [{} for _ in range(n)]

        def run(i: int) -> None:
            one = {**spec, "concurrency": conc[i], "connections": conns[i],
                   "duration": self.args.duration, "warmup": self.args.warmup}
            try:
                results[i] = self.loadgens[i].run(one, lambda: on("start"), lambda: on("end"))
            except Exception as exc:
                results[i] = {"failed": f"{type(exc).__name__}: {exc}"}

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cell = {"label": label, **{k: spec[k] for k in ("target", "backend", "protocol",
                                                        "workers", "addr", "model")},
                **merge_results(results)}
        if "failed" not in cell:
            pod = window.pod_result()
            cell.update(pod)
            requests = round(cell["rps"] * pod.get("window_s", 0))
            cell.update(window.result(requests))
            if pod.get("supervisor_cpu_s") is not None and requests:
                cell["supervisor_cpu_ms_per_req"] = pod["supervisor_cpu_s"] * 1000 / requests
        self.cells.append(cell)
        print("  " + cell_line(cell), flush=True)
        return cell

    def run(self, workers_list: list[int], flag: bool) -> None:
        """Every N in turn, ``--rounds`` times over (1, 2, 1, 2, ...): a change in what else
        runs on the machine then falls on every N alike."""
        for r in range(1, self.args.rounds + 1):
            tag = f" (round {r}/{self.args.rounds})" if self.args.rounds > 1 else ""
            if self.triton is not None:
                for proto in PROTOCOLS:
                    addr = self.triton.grpc_url if proto == "grpc" else self.triton.http_url
                    self.measure(self._spec("direct", "triton", proto, None, addr,
                                            PIXEL.triton_model), f"direct Triton {proto}{tag}")
            for n in workers_list:
                self._one_pod(n, flag, tag)

    def _one_pod(self, n: int, flag: bool, tag: str) -> None:
        print(f"mmguard --workers {n}{tag}" if flag else "mmguard (no --workers flag)",
              flush=True)
        self.start_mmguard(n if flag else None)
        assert self.mmguard is not None
        try:
            for backend in self.args.backends:
                if backend == "triton" and self.triton is None:
                    continue
                for proto in PROTOCOLS:
                    model = (PIXEL.ort_model if backend == "ort" else
                             PIXEL.triton_model if proto == "grpc" else PIXEL.http_route)
                    self.measure(self._spec("mmguard", backend, proto, n,
                                            f"127.0.0.1:{self.mmguard.ports[proto]}", model),
                                 f"mmguard N={n} {proto} -> {backend}{tag}")
        finally:
            self.stop_mmguard()

    @staticmethod
    def _spec(target: str, backend: str, proto: str, workers: int | None, addr: str,
              model: str) -> dict[str, Any]:
        ort = backend == "ort"
        return {"target": target, "backend": backend, "protocol": proto, "workers": workers,
                "addr": addr, "model": model, "shape": list(PIXEL.shape),
                "input": ORT_IN if ort else PIXEL.triton_in,
                "output": ORT_OUT if ort else PIXEL.triton_out, "op": "identity"}


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def write_reports(out: Path, doc: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "workers.json").write_text(json.dumps({**doc, "summary": rows}, indent=2,
                                                 default=str) + "\n")
    a, info = doc["args"], doc["machine"]
    seen = "; ".join(f"{k}: CPUs {v}" for k, v in doc["affinity_seen"].items())
    md = "\n".join([
        "# mmguard worker scaling", "",
        f"machine: {info['nproc']} CPUs (nproc), {info['cpu_model']}, {info['mem_gib']} GiB, "
        f"Linux {info['kernel']}; onnxruntime {info['versions'].get('onnxruntime') or '-'}, "
        f"onnxruntime-gpu {info['versions'].get('onnxruntime-gpu') or '-'}; mmguard at "
        f"{git_line(info)}", "",
        f"`{doc['command']}` — {doc['elapsed_s']:.0f} s", "",
        f"**CPU sets**: {doc['plan']['note']}. Seen in /proc: {seen}.", "",
        table(rows, md=True), "",
        f"- Each row: the median of {a['rounds']} round(s) (the workers list walked in turn "
        "each round; *req/s range*: the rounds' lowest and highest).",
        f"- FP32 [1,3,224,224], {a['concurrency']} requests in flight over {a['connections']} "
        f"connections from {a['loadgens']} load-generator process(es); {a['duration']:g} s "
        f"measured after {a['warmup']:g} s of the same load per cell; ORT device "
        f"`{a['ort_device']}`.",
        "- *CPU ms/req*: CPU of every process of the mmguard pod (the serve process and all "
        "below it) per request during the window; the direct rows give Triton's own. For the "
        "ORT rows the inference runs inside the workers, so its CPU is in the figure.",
        "- *efficiency*: req/s at N / (N × req/s at N=1), same backend and protocol. *bound*: "
        "min(N, CPUs of mmguard's set) / N, the best this machine allows when one worker "
        "already keeps its CPUs busy. *mmguard CPUs used %*: the pod's CPU over what its set "
        "offers (under 100 at N=1: something else, the load generator or the backend, held "
        "the rate back, and N > 1 can pass the bound).",
        "- *of it supervisor*: the part of it the supervisor used (N > 1: it owns the admin "
        "port and the pod's control state; the data goes straight to the workers).",
        "- *busiest/mean*: CPU of the busiest worker over the mean of the busy ones: the "
        "kernel's SO_REUSEPORT hash decides which worker gets a connection.",
        "- *other CPU %*: the machine's CPU used by processes outside the benchmark during "
        "the cell (noisy above 5 %).", ""])
    (out / "workers.md").write_text(md)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def _ints(text: str, what: str, p: argparse.ArgumentParser) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        p.error(f"{what} takes comma-separated integers, got {text!r}")
    if not vals or min(vals) < 1:
        p.error(f"{what} takes positive integers, got {text!r}")
    return vals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
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

    def on_term(signum: int, frame: Any) -> None:
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
               "command": " ".join(["python", "bench/bench_workers.py", *sys.argv[1:]]),
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


def check_pods(cells: list[dict[str, Any]]) -> int:
    """1 when a pod had other than the processes its workers make, or one changed during a
    cell (a worker died and was restarted: its CPU and its requests are then not all counted)."""
    bad = [c for c in cells if c["target"] == "mmguard" and "failed" not in c
           and ((c.get("pod_processes") or 0) != expected_processes(c["workers"] or 1)
                or c.get("pod_pids_changed"))]
    for c in bad:
        changed = c.get("pod_pids_changed")
        print(f"{c['label']}: {c.get('pod_processes')} pod processes for {c['workers']} workers"
              + (f", changed during the cell: {changed}" if changed else ""), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
