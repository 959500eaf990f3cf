"""What ``bench_workers.py`` is made of apart from its servers and its report: the CPU-set plan
and the efficiency arithmetic (pure, unit-tested in tests/unit/test_bench_workers.py), the /proc
walks (affinity, a pod's processes, their CPU), and the load-generator cells that run in
spawned processes (the request builders and byte checks are bench_proxy's).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    CpuWindow,
    Recorder,
    drive,
    fmt,
    percentiles,
    proc_cpu_s,
    render_table,
    serve_cells,
)
from bench_proxy import (
    GRPC_INFER,
    MiB,
    _grpc_check,
    _grpc_request,
    _http_check,
    _http_request,
    _payload,
)

# ---------------------------------------------------------------------------------------------
# Pure helpers: CPU sets, shares, efficiency (tests/unit/test_bench_workers.py)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuPlan:
    """Which CPUs the load generators, the backend and mmguard may run on."""

    loadgen: tuple[int, ...]
    backend: tuple[int, ...]
    mmguard: tuple[int, ...]
    pinned: bool
    note: str


def cpu_list(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (taskset's and /proc's way of writing a set)."""
    out: list[str] = []
    for _, run in itertools.groupby(enumerate(sorted(cpus)), lambda p: p[1] - p[0]):
        ids = [c for _, c in run]
        out.append(str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}")
    return ",".join(out)


def plan_cpus(available: Sequence[int], pin: bool = True) -> CpuPlan:
    """Load generators a quarter of the CPUs, the backend a quarter, mmguard the rest (16 CPUs:
    0-3, 4-7, 8-15). With 3 CPUs one each; with 2 the load generator and the backend share the
    first; with 1 (or ``pin=False``) nothing is pinned apart and ``note`` says what that means."""
    cpus = tuple(sorted(set(available)))
    if not cpus:
        raise ValueError("no CPUs to plan with")
    n = len(cpus)
    if not pin or n == 1:
        why = "--no-pin" if not pin else "1 CPU"
        return CpuPlan(cpus, cpus, cpus, False,
                       f"not pinned ({why}): load generators, backend and mmguard share CPUs "
                       f"{cpu_list(cpus)}, so the proxy is not the only bottleneck and a worker "
                       f"added takes CPU from the others")
    if n == 2:
        return CpuPlan(cpus[:1], cpus[:1], cpus[1:], True,
                       f"2 CPUs: the load generator and the backend share CPU {cpus[0]} "
                       f"(nothing is left to pin them apart) and mmguard has CPU {cpus[1]}, "
                       f"for every N (alone among the benchmark's processes; the machine's "
                       f"other work is not pinned: see other CPU %): N workers share that one "
                       f"CPU, so N > 1 cannot scale here (bound 1/N); what it shows is what "
                       f"the extra workers cost")
    if n == 3:
        return CpuPlan(cpus[:1], cpus[1:2], cpus[2:], True,
                       "3 CPUs: one for the load generator, one for the backend, one for mmguard")
    q = n // 4
    return CpuPlan(cpus[:q], cpus[q:2 * q], cpus[2 * q:], True,
                   f"{n} CPUs: load generators {cpu_list(cpus[:q])}, backend "
                   f"{cpu_list(cpus[q:2 * q])}, mmguard {cpu_list(cpus[2 * q:])}")


def split(total: int, parts: int) -> list[int]:
    """``total`` spread over ``parts`` as evenly as integers allow (larger shares first)."""
    if parts < 1 or total < parts:
        raise ValueError(f"cannot split {total} over {parts} parts (each needs at least 1)")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def efficiency(rps: float | None, workers: int, rps_one: float | None) -> float | None:
    """req/s at ``workers`` over ``workers`` × req/s at one worker; None when unknown."""
    if rps is None or not rps_one or workers < 1:
        return None
    return rps / (workers * rps_one)


def efficiency_bound(workers: int, mmguard_cpus: int) -> float:
    """The best efficiency N workers can reach on ``mmguard_cpus`` CPUs: min(N, CPUs) / N."""
    return min(workers, mmguard_cpus) / workers


def cpu_use_pct(rps: float | None, cpu_ms_per_req: float | None, cpus: int) -> float | None:
    """How much of its CPU set the pod used: 100 = all of it busy. The bound holds only where
    one worker already used its CPUs to the full; below that, other parts held it back."""
    if rps is None or cpu_ms_per_req is None or cpus < 1:
        return None
    return 100 * rps * cpu_ms_per_req / 1000 / cpus


def expected_processes(workers: int) -> int:
    """``--workers 1`` is one process; N > 1 is a supervisor and N workers."""
    return 1 if workers <= 1 else workers + 1


def imbalance(cpu_by_process: Sequence[float]) -> float | None:
    """Busiest process's CPU over the mean (1.0 = even); None without any CPU."""
    busy = [c for c in cpu_by_process if c > 0]
    if not busy:
        return None
    return max(busy) / (sum(busy) / len(busy))


# ---------------------------------------------------------------------------------------------
# /proc: affinity, the serve process's tree
# ---------------------------------------------------------------------------------------------


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
    out, todo = [], [root]
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


# ---------------------------------------------------------------------------------------------
# Load generator (spawned processes)
# ---------------------------------------------------------------------------------------------


class LatencyRecorder(Recorder):
    """Also hands back every latency (ms), so several load generators' can be merged."""

    def result(self) -> dict[str, Any]:
        out = super().result()
        out["lat_ms"] = [round(v * 1000, 4) for v in self.lat]
        return out


async def _cell_grpc(spec: dict[str, Any], factory: Callable[..., Recorder]) -> dict[str, Any]:
    import grpc

    x, expected = _payload(spec)
    body = _grpc_request(spec, x)
    # its own subchannel pool: a channel that would share one TCP connection with the others
    # would put all the load on one worker
    opts = [("grpc.max_send_message_length", 64 * MiB),
            ("grpc.max_receive_message_length", 64 * MiB), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(spec["addr"], options=opts)
                for _ in range(spec["connections"])]
    try:
        calls = []
        for channel in channels:
            await asyncio.wait_for(channel.channel_ready(), 15)
            call = channel.unary_unary(GRPC_INFER)  # bytes in, bytes out
            _grpc_check(spec, await call(body, timeout=30), expected)  # each connection's first
            calls.append(call)
        turn = itertools.count()

        async def one() -> None:
            await calls[next(turn) % len(calls)](body, timeout=30)

        rec = factory(LatencyRecorder)
        await drive(one, rec, spec["concurrency"])
        return rec.result()
    finally:
        for channel in channels:
            await channel.close()


async def _cell_http(spec: dict[str, Any], factory: Callable[..., Recorder]) -> dict[str, Any]:
    import aiohttp

    x, expected = _payload(spec)
    body, headers = _http_request(spec, x)
    url = f"http://{spec['addr']}/v2/models/{spec['model']}/infer"
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1,
                                                                     keepalive_timeout=300),
                                      auto_decompress=False)
                for _ in range(spec["connections"])]
    try:
        for session in sessions:  # one connection each: its first answer, sent alone
            async with session.post(url, data=body, headers=headers) as r:
                _http_check(spec, r.status, r.headers, await r.read(), expected)
        turn = itertools.count()

        async def one() -> None:
            session = sessions[next(turn) % len(sessions)]
            async with session.post(url, data=body, headers=headers) as r:
                data = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")

        rec = factory(LatencyRecorder)
        await drive(one, rec, spec["concurrency"])
        return rec.result()
    finally:
        for session in sessions:
            await session.close()


async def _run_cell(spec: dict[str, Any], factory: Callable[..., Recorder]) -> dict[str, Any]:
    return await (_cell_grpc if spec["protocol"] == "grpc" else _cell_http)(spec, factory)


def _loadgen_main(conn: Any) -> None:
    serve_cells(conn, _run_cell)




def merge_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from each load generator's part: req/s summed, latencies pooled."""
    failed = [r["failed"] for r in results if "failed" in r]
    if failed:
        return {"failed": "; ".join(sorted(set(failed)))[:1000]}
    lat = [v / 1000 for r in results for v in r.get("lat_ms", [])]
    samples: dict[str, int] = {}
    for r in results:
        for k, v in (r.get("error_samples") or {}).items():
            samples[k] = samples.get(k, 0) + v
    out: dict[str, Any] = {"rps": sum(r["rps"] for r in results),
                           "requests": sum(r["requests"] for r in results),
                           "errors": sum(r["errors"] for r in results),
                           "error_samples": samples, "loadgens": len(results)}
    if lat:
        out.update(percentiles(lat))
    return out




def cell_line(cell: dict[str, Any]) -> str:
    if "failed" in cell:
        return f"{cell['label']:<32} FAILED: {cell['failed']}"
    cpu = cell.get("cpu_ms_per_req") or {}
    err = f" errors={cell['errors']}" if cell.get("errors") else ""
    return (f"{cell['label']:<32} {cell.get('rps', 0):8.1f} req/s  p50 "
            f"{cell.get('p50_ms', 0):6.2f}  p99 {cell.get('p99_ms', 0):6.2f} ms{err}  cpu ms/req: "
            + " ".join(f"{k}={v:.3f}" for k, v in cpu.items())
            + f"  other {cell.get('other_cpu_pct')}%")


def _median(values: Sequence[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    mid = len(known) // 2
    return known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2


def summary_rows(cells: list[dict[str, Any]], mmguard_cpus: int) -> list[dict[str, Any]]:
    """One row per target, backend, protocol and N: the median over the rounds (a failed cell
    makes its row FAIL), with efficiency against the same backend and protocol at one worker."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["target"], c["backend"], c["protocol"], c["workers"]), []).append(c)
    one = {(b, p): _median([c.get("rps") for c in cs])
           for (t, b, p, n), cs in groups.items() if t == "mmguard" and n == 1
           and all("failed" not in c for c in cs)}
    rows = []
    for (target, backend, proto, n), cs in groups.items():
        mm = target == "mmguard"
        failed = any("failed" in c for c in cs)
        good = [c for c in cs if "failed" not in c]

        def med(key: str, sub: str | None = None, good: list[dict[str, Any]] = good) -> Any:
            return _median([(c.get(key) or {}).get(sub) if sub else c.get(key) for c in good])

        rates = [float(c.get("rps") or 0) for c in good]
        rps = None if failed else med("rps")
        rows.append({
            "backend": ("ORT in-process" if backend == "ort" else "Triton")
                       + ("" if mm else " (direct)"),
            "protocol": proto, "workers": n if mm else None,
            "processes": max((c.get("pod_processes") or 0) for c in good) if mm and good
            else None,
            "rounds": len(cs), "rps": rps,
            "rps_range": f"{min(rates):.0f}-{max(rates):.0f}" if len(rates) > 1 else "",
            "p50_ms": med("p50_ms"), "p99_ms": med("p99_ms"),
            "cpu_ms_per_req": med("cpu_ms_per_req", "mmguard" if mm else "triton"),
            "cpu_label": "mmguard pod" if mm else "Triton",
            "supervisor_cpu_ms_per_req": med("supervisor_cpu_ms_per_req"),
            "imbalance": med("pod_imbalance") if mm and n and n > 1 else None,
            "efficiency": efficiency(rps, n, one.get((backend, proto))) if mm and n else None,
            "bound": efficiency_bound(n, mmguard_cpus) if mm and n else None,
            "mmguard_cpu_use_pct": cpu_use_pct(rps, med("cpu_ms_per_req", "mmguard"),
                                               mmguard_cpus) if mm else None,
            "errors": "FAIL" if failed else str(sum(int(c.get("errors", 0)) for c in good)),
            "other_cpu_pct": max((c.get("other_cpu_pct") or 0.0) for c in good) if good
            else None,
        })
    return rows


COLUMNS = [("backend", "backend", None), ("proto", "protocol", None),
           ("workers", "workers", "d"), ("procs", "processes", "d"), ("req/s", "rps", ".0f"),
           ("req/s range", "rps_range", None),
           ("p50 ms", "p50_ms", ".2f"), ("p99 ms", "p99_ms", ".2f"),
           ("CPU ms/req", "cpu_ms_per_req", ".3f"),
           ("of it supervisor", "supervisor_cpu_ms_per_req", ".3f"),
           ("busiest/mean", "imbalance", ".2f"),
           ("efficiency", "efficiency", ".2f"), ("bound", "bound", ".2f"),
           ("mmguard CPUs used %", "mmguard_cpu_use_pct", ".0f"),
           ("errors", "errors", None), ("other CPU %", "other_cpu_pct", ".1f")]


def table(rows: list[dict[str, Any]], md: bool) -> str:
    body = [[str(r[k]) if spec is None else fmt(r[k], spec) for _, k, spec in COLUMNS]
            for r in rows]
    return render_table([c[0] for c in COLUMNS], body, md)


