"""The worker-scaling bench's pure helpers (bench/workers/): CPU-set planning, shares,
efficiency and its bound, medians over rounds, and the /proc walk that finds a pod's processes
(against real child processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest

from bench.workers.plan import (
    cpu_list,
    cpu_use_pct,
    efficiency,
    efficiency_bound,
    expected_processes,
    imbalance,
    plan_cpus,
    split,
)
from bench.workers.pod import affinity, allowed_cpus, process_tree
from bench.workers.report import merge_results, summary_rows, table


def test_sixteen_cpus_split_quarter_quarter_half() -> None:
    plan = plan_cpus(range(16))
    assert plan.loadgen == (0, 1, 2, 3)
    assert plan.backend == (4, 5, 6, 7)
    assert plan.mmguard == tuple(range(8, 16))
    assert plan.pinned
    assert "mmguard 8-15" in plan.note


def test_sets_never_overlap_and_cover_the_machine_from_three_cpus_up() -> None:
    for n in range(3, 65):
        cpus = [c * 2 for c in range(n)]  # not 0..n-1: the sets follow the CPUs given
        plan = plan_cpus(cpus)
        groups = [set(plan.loadgen), set(plan.backend), set(plan.mmguard)]
        assert all(groups), n
        assert not (groups[0] & groups[1] or groups[0] & groups[2] or groups[1] & groups[2]), n
        assert set().union(*groups) == set(cpus), n
        assert len(plan.mmguard) >= len(plan.loadgen), n


def test_two_cpus_share_the_first_and_say_why_n_cannot_scale() -> None:
    plan = plan_cpus([0, 1])
    assert plan.loadgen == plan.backend == (0,)
    assert plan.mmguard == (1,)
    assert "share CPU 0" in plan.note and "cannot scale" in plan.note


def test_one_cpu_or_no_pin_shares_everything() -> None:
    for plan in (plan_cpus([3]), plan_cpus(range(8), pin=False)):
        assert not plan.pinned
        assert plan.loadgen == plan.backend == plan.mmguard
        assert "not pinned" in plan.note
    with pytest.raises(ValueError, match="no CPUs"):
        plan_cpus([])


def test_cpu_list_is_written_as_taskset_writes_it() -> None:
    assert cpu_list([0, 1, 2, 5]) == "0-2,5"
    assert cpu_list([8, 9, 10, 11, 12, 13, 14, 15]) == "8-15"
    assert cpu_list([7]) == "7"
    assert cpu_list([4, 2, 3, 9, 10]) == "2-4,9-10"


def test_split_spreads_evenly_and_refuses_empty_shares() -> None:
    assert split(16, 4) == [4, 4, 4, 4]
    assert split(10, 4) == [3, 3, 2, 2]
    assert sum(split(67, 5)) == 67
    with pytest.raises(ValueError, match="cannot split 3 over 4"):
        split(3, 4)


def test_efficiency_is_rate_over_n_times_one_worker() -> None:
    assert efficiency(1800.0, 2, 1000.0) == pytest.approx(0.9)
    assert efficiency(1000.0, 1, 1000.0) == pytest.approx(1.0)
    assert efficiency(3000.0, 8, 500.0) == pytest.approx(0.75)
    assert efficiency(None, 2, 1000.0) is None
    assert efficiency(900.0, 2, None) is None
    assert efficiency(900.0, 2, 0.0) is None


def test_bound_is_what_the_cpus_of_mmguard_allow() -> None:
    assert efficiency_bound(2, 1) == pytest.approx(0.5)
    assert efficiency_bound(8, 8) == pytest.approx(1.0)
    assert efficiency_bound(4, 8) == pytest.approx(1.0)
    assert efficiency_bound(8, 4) == pytest.approx(0.5)


def test_imbalance_is_busiest_over_mean_of_busy_processes() -> None:
    assert imbalance([1.0, 1.0]) == pytest.approx(1.0)
    assert imbalance([3.0, 1.0]) == pytest.approx(1.5)
    assert imbalance([0.0, 2.0, 2.0]) == pytest.approx(1.0)  # an idle supervisor is left out
    assert imbalance([0.0]) is None


def test_summary_rows_take_medians_over_rounds_and_compare_with_one_worker() -> None:
    def cell(backend: str, proto: str, n: int, rps: float) -> dict[str, Any]:
        return {"target": "mmguard", "backend": backend, "protocol": proto, "workers": n,
                "rps": rps, "pod_processes": expected_processes(n), "pod_imbalance": 1.1,
                "cpu_ms_per_req": {"mmguard": rps / 1000}, "errors": 0, "other_cpu_pct": 2.0}

    cells = [cell("ort", "grpc", 1, 500.0), cell("ort", "http", 1, 800.0),
             cell("ort", "grpc", 2, 900.0), cell("ort", "http", 2, 800.0),
             {"target": "mmguard", "backend": "triton", "protocol": "grpc", "workers": 2,
              "failed": "AssertionError: output bytes differ"},
             cell("ort", "grpc", 1, 500.0), cell("ort", "grpc", 2, 1100.0),
             cell("triton", "grpc", 2, 700.0)]
    rows = summary_rows(cells, mmguard_cpus=1)
    assert [(r["backend"], r["protocol"], r["workers"], r["rounds"]) for r in rows] == [
        ("ORT in-process", "grpc", 1, 2), ("ORT in-process", "http", 1, 1),
        ("ORT in-process", "grpc", 2, 2), ("ORT in-process", "http", 2, 1),
        ("Triton", "grpc", 2, 2)]
    assert rows[2]["rps"] == pytest.approx(1000.0)  # median of 900 and 1100
    assert rows[2]["rps_range"] == "900-1100"
    assert rows[2]["cpu_ms_per_req"] == pytest.approx(1.0)
    assert rows[2]["processes"] == 3
    assert [r["efficiency"] for r in rows[:4]] == pytest.approx([1.0, 1.0, 1.0, 0.5])
    assert [r["bound"] for r in rows[:4]] == pytest.approx([1.0, 1.0, 0.5, 0.5])
    assert rows[4]["errors"] == "FAIL" and rows[4]["rps"] is None  # one failed round of two
    assert rows[4]["efficiency"] is None
    assert "FAIL" in table(rows, md=True)


def test_merge_pools_latencies_and_sums_rates() -> None:
    parts = [{"rps": 100.0, "requests": 500, "errors": 1, "error_samples": {"E: x": 1},
              "lat_ms": [1.0, 2.0]},
             {"rps": 50.0, "requests": 250, "errors": 0, "error_samples": {},
              "lat_ms": [3.0, 4.0]}]
    out = merge_results(parts)
    assert out["rps"] == 150.0 and out["requests"] == 750 and out["errors"] == 1
    assert out["max_ms"] == pytest.approx(4.0)
    assert out["p50_ms"] == pytest.approx(2.5)
    assert "failed" in merge_results([*parts, {"failed": "RuntimeError: died"}])


def test_process_tree_finds_grandchildren_and_affinity_is_inherited() -> None:
    script = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
              "print(c.pid, flush=True); time.sleep(30)")
    before = os.sched_getaffinity(0)
    first = sorted(before)[0]
    with affinity([first]):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                text=True)
    try:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        deadline = time.monotonic() + 20
        while grandchild not in process_tree(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(process_tree(proc.pid)) == {proc.pid, grandchild}
        assert allowed_cpus(grandchild) == str(first)
        assert os.sched_getaffinity(0) == before  # the caller's own set is given back
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
        subprocess.run(["kill", "-9", str(grandchild)], check=False)


def test_one_worker_is_one_process_more_are_a_supervisor_and_workers() -> None:
    assert [expected_processes(n) for n in (1, 2, 8)] == [1, 3, 9]


def test_cpu_use_is_the_pods_cpu_over_what_its_set_offers() -> None:
    assert cpu_use_pct(500.0, 2.0, 1) == pytest.approx(100.0)
    assert cpu_use_pct(1000.0, 2.0, 4) == pytest.approx(50.0)
    assert cpu_use_pct(None, 2.0, 1) is None
    assert cpu_use_pct(500.0, None, 1) is None
