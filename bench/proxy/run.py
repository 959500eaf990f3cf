"""The run of ``python -m bench.proxy``: start every server and the load generator, measure
each cell of the matrix (and the chain study's), stop them all."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.chain_study import ChainStudy
from bench.common import CpuWindow, group_cpu_s, proc_cpu_s, stop_each
from bench.loadgen import LoadGen
from bench.proxy.cases import CASES, ORT_IN, ORT_OUT, PROTOCOLS, TensorCase
from bench.proxy.cells import loadgen_main
from bench.proxy.report import cell_line
from bench.proxy.servers import Floor, Mmguard, Nginx, start_triton, write_ort_models
from tests.support.triton import TritonServer


def _per_thousand(count: Callable[[], float]) -> Callable[[], float]:
    return lambda: count() / 1000


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.triton: TritonServer | None = None
        self.mmguard: Mmguard | None = None
        self.nginx: Nginx | None = None
        self.floor: Floor | None = None
        self.loadgen: LoadGen | None = None
        self.ort_paths: dict[str, Path] = {}
        self.cells: list[dict[str, Any]] = []
        self._ort_direct: dict[tuple[str, int], dict[str, Any]] = {}
        self.study = (ChainStudy(args.chains, args.chain_rounds, args.chain_concurrency)
                      if args.chains else None)

    # -- life cycle ------------------------------------------------------------------------

    def start(self, root: Path) -> None:
        t0 = time.monotonic()
        self.ort_paths = write_ort_models(root / "ort_models")
        print("starting Triton ...", flush=True)
        self.triton = triton = start_triton(root / "triton")
        print(f"  Triton ready in {time.monotonic() - t0:.1f}s: grpc {triton.grpc_url}, "
              f"http {triton.http_url}", flush=True)
        (root / "mmguard").mkdir(parents=True, exist_ok=True)
        self.mmguard = Mmguard(root / "mmguard", triton, root / "ort_models",
                               self.args.ort_threads, self.args.mmguard_log_level)
        print("starting mmguard ...", flush=True)
        self.mmguard.start()
        print(f"  mmguard ready: grpc {self.mmguard.ports['grpc']}, http "
              f"{self.mmguard.ports['http']} (pid {self.mmguard.pid})", flush=True)
        if not self.args.no_nginx:
            self.nginx = Nginx(root, triton)
            self.nginx.start()
            print(f"  nginx ready: grpc {self.nginx.ports['grpc']}, http "
                  f"{self.nginx.ports['http']}", flush=True)
        if self.study is not None:
            self.study.start(root / "mmguard-chains", triton, self.args.mmguard_log_level)
        if self.args.floor:
            self.floor = Floor(root, triton)
            self.floor.start()
            print(f"  pass-through floor ready: grpc {self.floor.ports['grpc']}, http "
                  f"{self.floor.ports['http']}", flush=True)
        self.loadgen = LoadGen(loadgen_main)

    def stop(self) -> None:
        stop_each([("load generator", self.loadgen.close if self.loadgen else None),
                   ("nginx", self.nginx.stop if self.nginx else None),
                   ("pass-through", self.floor.stop if self.floor else None),
                   ("mmguard", self.mmguard.stop if self.mmguard else None),
                   ("chains' mmguard", self.study.stop if self.study else None),
                   ("Triton", self.triton.stop if self.triton else None)])

    # -- one cell --------------------------------------------------------------------------

    def _pids(self) -> dict[str, Callable[[], float]]:
        out: dict[str, Callable[[], float]] = {}
        if self.mmguard and self.mmguard.pid:
            pid = self.mmguard.pid
            out["mmguard"] = lambda: proc_cpu_s(pid)
        if self.nginx and self.nginx.proc:
            pids = self.nginx.pids()
            out["nginx"] = lambda: sum(proc_cpu_s(p) for p in pids)
        if self.floor and self.floor.pid:
            fpid = self.floor.pid
            out["passthrough"] = lambda: proc_cpu_s(fpid)
        if self.triton and self.triton.pid:
            pgid = self.triton.pid
            out["triton"] = lambda: group_cpu_s(pgid)
        if self.loadgen:
            lg = self.loadgen.pid
            out["loadgen"] = lambda: proc_cpu_s(lg)
        return out

    def measure(self, spec: dict[str, Any], label: str,
                probes: dict[str, Callable[[], float]] | None = None,
                counters: dict[str, Callable[[], float]] | None = None) -> dict[str, Any]:
        """One cell; ``probes``: the processes whose CPU it records (default: every server);
        ``counters``: name -> a count so far, reported per request (``per_req``)."""
        assert self.loadgen is not None
        spec = {**spec, "duration": self.args.duration, "warmup": self.args.warmup,
                "ort_threads": self.args.ort_threads, "ort_intra_op_threads": 1}
        # CpuWindow reports its "waits" as 1000 x delta / request: a count scaled by 1/1000
        # comes out per request, and stays out of the CPU sums.
        window = CpuWindow(self._pids() if probes is None else probes,
                           {k: _per_thousand(f) for k, f in (counters or {}).items()})
        result = self.loadgen.run(spec, lambda: window.mark("start"), lambda: window.mark("end"))
        result.update(window.result(result.get("requests", 0)))
        if counters:
            result["per_req"] = result.pop("runq_wait_ms_per_req", {})
        cell = {"label": label, **{k: spec[k] for k in ("kind", "target", "addr", "model",
                                                        "concurrency", "case", "protocol")},
                **result}
        self.cells.append(cell)
        print("  " + cell_line(cell), flush=True)
        return cell

    # -- the matrix ------------------------------------------------------------------------

    def run_chains(self) -> list[dict[str, Any]]:
        """The chain study's cells (``--chains``), also appended to ``self.cells``."""
        if self.study is None:
            return []
        probes = {k: f for k, f in self._pids().items() if k in ("triton", "loadgen")}
        return self.study.run(self.measure, probes)

    def run(self) -> list[dict[str, Any]]:
        """The direct / nginx / mmguard matrix (none with ``--chain-only``): the Triton rows,
        then the ONNX Runtime rows."""
        if self.args.chain_only:
            return []
        rows = [self._triton_row(case, proto, c)
                for case in CASES for proto in PROTOCOLS for c in self.args.concurrency]
        if not self.args.no_ort:
            rows += [self._ort_row(case, proto, c)
                     for case in CASES for proto in PROTOCOLS for c in self.args.concurrency]
        return rows

    def _triton_row(self, case: TensorCase, proto: str, c: int) -> dict[str, Any]:
        assert self.triton and self.mmguard
        base = {"kind": proto, "case": case.key, "protocol": proto, "concurrency": c,
                "shape": list(case.shape), "input": case.triton_in,
                "output": case.triton_out, "op": case.op}
        row: dict[str, Any] = {"case": case.label, "case_key": case.key, "protocol": proto,
                               "concurrency": c, "backend": "triton"}
        print(f"{case.label} {proto} c={c} -> Triton", flush=True)
        triton_addr = self.triton.grpc_url if proto == "grpc" else self.triton.http_url
        row["direct"] = self.measure(
            {**base, "target": "direct", "addr": triton_addr,
             "model": case.triton_model}, "direct Triton")
        if self.nginx:
            row["nginx"] = self.measure(
                {**base, "target": "nginx",
                 "addr": f"127.0.0.1:{self.nginx.ports[proto]}",
                 "model": case.triton_model}, "nginx -> Triton")
        route = case.triton_model if proto == "grpc" else case.http_route
        row["mmguard"] = self.measure(
            {**base, "target": "mmguard",
             "addr": f"127.0.0.1:{self.mmguard.ports[proto]}", "model": route},
            f"mmguard -> triton_{proto}")
        if self.floor:
            row["floor"] = self.measure(
                {**base, "target": "floor",
                 "addr": f"127.0.0.1:{self.floor.ports[proto]}", "model": route},
                "bare Python pass-through -> Triton")
        return row

    def _ort_row(self, case: TensorCase, proto: str, c: int) -> dict[str, Any]:
        """mmguard -> in-process ONNX Runtime; its "direct" (the same model in the load
        generator) is measured once per tensor and concurrency, shown on both protocols."""
        assert self.mmguard
        print(f"{case.label} {proto} c={c} -> ONNX Runtime", flush=True)
        base = {"case": case.key, "concurrency": c, "shape": list(case.shape),
                "input": ORT_IN, "output": ORT_OUT, "op": "identity",
                "model": case.ort_model}
        row: dict[str, Any] = {"case": case.label, "case_key": case.key, "protocol": proto,
                               "concurrency": c, "backend": "onnxruntime"}
        key = (case.key, c)
        if key not in self._ort_direct:
            self._ort_direct[key] = self.measure(
                {**base, "kind": "ort", "protocol": "inprocess",
                 "target": "direct", "addr": "",
                 "onnx_path": str(self.ort_paths[case.ort_model])},
                "in-process session.run" if c == 1 else
                f"in-process session.run, {self.args.ort_threads}-thread pool")
        else:
            print(f"  (direct: same as measured above, "
                  f"{self._ort_direct[key]['rps']:.0f} req/s)", flush=True)
        row["direct"] = self._ort_direct[key]
        row["mmguard"] = self.measure(
            {**base, "kind": proto, "protocol": proto, "target": "mmguard",
             "addr": f"127.0.0.1:{self.mmguard.ports[proto]}"},
            f"mmguard {proto} -> onnxruntime")
        return row
