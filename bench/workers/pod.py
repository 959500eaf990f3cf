"""mmguard as a pod (``serve --workers N``) and the /proc walks that follow it: affinity, a
process's allowed CPUs, the serve process's tree, each pod process's CPU over a cell."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.common import ROOT, CpuWindow, MmguardProcess, http_status, proc_cpu_s
from bench.proxy.cases import CASES
from bench.workers.plan import expected_processes, imbalance
from tests.support.triton import TritonServer

PIXEL = CASES[0]  # FP32 [1,3,224,224]


@contextlib.contextmanager
def affinity(cpus: Sequence[int]) -> Iterator[None]:
    """The calling thread runs on ``cpus`` meanwhile: what it starts inherits that set."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def allowed_cpus(pid: int) -> str:
    """``Cpus_allowed_list`` of a process, as the kernel reports it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live process (field 4 of /proc/<pid>/stat)."""
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # the comm field may hold spaces: split after its closing parenthesis
        with contextlib.suppress(IndexError, ValueError):
            out[int(entry)] = int(raw[raw.rfind(")") + 2:].split()[1])
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and every live process below it. From the parent pids rather than
    /proc/<pid>/task/<tid>/children, which some kernels (and gVisor) do not offer."""
    parents = _parents()
    if root not in parents:
        return []
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


class PodWindow(CpuWindow):
    """CpuWindow that also keeps each pod process's CPU at every mark (per-worker shares)."""

    def __init__(self, probes: dict[str, Callable[[], float]], pod_root: int | None) -> None:
        super().__init__(probes)
        self.pod_root = pod_root

    def sample(self) -> dict[str, Any]:
        out = super().sample()
        tree = process_tree(self.pod_root) if self.pod_root else []
        out["pod"] = {pid: proc_cpu_s(pid) for pid in tree}
        return out

    def pod_result(self) -> dict[str, Any]:
        if "start" not in self.marks or "end" not in self.marks:
            return {}
        a, b = self.marks["start"]["pod"], self.marks["end"]["pod"]
        per = {pid: b[pid] - a.get(pid, 0.0) for pid in b}
        # with workers, the serve process is their supervisor: the balance is the workers'
        workers = [v for pid, v in per.items() if pid != self.pod_root] if len(per) > 1 else []
        return {"pod_processes": len(b), "pod_pids_changed": sorted(set(a) ^ set(b)),
                "pod_cpu_s_by_pid": {str(p): round(v, 3) for p, v in per.items()},
                "supervisor_cpu_s": round(per.get(self.pod_root or 0, 0.0), 3) if workers
                else None,
                "pod_imbalance": imbalance(workers),
                "window_s": round(self.marks["end"]["t"] - self.marks["start"]["t"], 3)}


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


def mmguard_config(ort_dir: Path, triton: TritonServer | None,
                   args: argparse.Namespace) -> dict[str, Any]:
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
