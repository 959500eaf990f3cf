"""The worker-scaling bench's pure parts: which CPUs the load generators, the backend and
mmguard get, how load is shared out, and the efficiency arithmetic
(tests/unit/test_bench_workers.py)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


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
