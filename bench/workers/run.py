"""The run of ``python -m bench.workers``: the backend and the load generators started once,
pinned to their CPU sets; mmguard started per N on its own set; each cell sent by every load
generator at once and merged."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import group_cpu_s, proc_cpu_s, stop_each
from bench.loadgen import LoadGen
from bench.proxy.cases import ORT_IN, ORT_OUT
from bench.proxy.servers import start_triton, write_ort_models
from bench.workers.cells import loadgen_main
from bench.workers.plan import CpuPlan, split
from bench.workers.pod import (
    PIXEL,
    PodMmguard,
    PodWindow,
    affinity,
    allowed_cpus,
    mmguard_config,
    process_tree,
)
from bench.workers.report import cell_line, merge_results
from tests.support.triton import TritonServer

PROTOCOLS = ("grpc", "http")


class Bench:
    def __init__(self, args: argparse.Namespace, plan: CpuPlan) -> None:
        self.args = args
        self.plan = plan
        self.triton: TritonServer | None = None
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
            assert self.triton.pid is not None
            self.affinity_seen["triton"] = allowed_cpus(self.triton.pid)
        with affinity(self.plan.loadgen):
            self.loadgens = [LoadGen(loadgen_main) for _ in range(self.args.loadgens)]
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
        parts: list[tuple[str, Callable[[], object] | None]] = [
            ("load generator", lg.close) for lg in self.loadgens]
        stop_each([*parts, ("mmguard", self.stop_mmguard),
                   ("Triton", self.triton.stop if self.triton else None)])

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
