"""What ``python -m bench.workers`` reports: the load generators' parts merged into one cell,
a line per cell, one summary row per target, backend, protocol and N (medians over the rounds,
efficiency against one worker), the files ``workers.json`` and ``workers.md``, and the pods'
process check."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import fmt, git_line, render_table
from bench.loadgen import percentiles
from bench.workers.plan import cpu_use_pct, efficiency, efficiency_bound, expected_processes


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
