"""What ``python -m bench.proxy`` reports: one line per cell as it is measured, the summary
(each row's mmguard and nginx against direct: req/s ratios, added latency, CPU per request),
every cell in detail, and the files ``results.json`` and ``results.md``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.chain_study import chain_notes, chain_table
from bench.common import NOISY_OTHER_PCT, fmt, git_line, render_table
from bench.proxy.cases import CASES


def cell_line(cell: dict[str, Any]) -> str:
    if "failed" in cell:
        return f"{cell['label']:<40} FAILED: {cell['failed']}"
    cpu = cell.get("cpu_ms_per_req") or {}
    cpu_s = " ".join(f"{k}={v:.3f}" for k, v in cpu.items() if v)
    err = f" errors={cell['errors']}" if cell.get("errors") else ""
    return (f"{cell['label']:<40} {cell.get('rps', 0):9.1f} req/s  p50 {cell.get('p50_ms', 0):7.2f}"
            f"  p99 {cell.get('p99_ms', 0):7.2f} ms{err}  cpu ms/req: {cpu_s}"
            f"  busy {cell.get('machine_busy_pct')}% (other {cell.get('other_cpu_pct')}%)")


def _num(cell: dict[str, Any] | None, key: str) -> float | None:
    if not cell or "failed" in cell or key not in cell:
        return None
    return float(cell[key])


def summary_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        d, n, m, f = r.get("direct"), r.get("nginx"), r.get("mmguard"), r.get("floor")
        drps, nrps, mrps = _num(d, "rps"), _num(n, "rps"), _num(m, "rps")

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a is not None and b else None

        def added(cell: dict[str, Any] | None, key: str,
                  d: dict[str, Any] | None = d) -> float | None:
            a, b = _num(cell, key), _num(d, key)
            return a - b if a is not None and b is not None else None

        backend = "Triton" if r["backend"] == "triton" else "ORT (in-process)"
        out.append({
            "case": f"{r['case']} {r['protocol']} c={r['concurrency']} -> {backend}",
            "tensor": r["case"], "protocol": r["protocol"], "concurrency": r["concurrency"],
            "backend": r["backend"],
            "direct_rps": drps, "nginx_rps": nrps, "mmguard_rps": mrps,
            "mmguard_over_direct": ratio(mrps, drps), "nginx_over_direct": ratio(nrps, drps),
            "mmguard_added_p50_ms": added(m, "p50_ms"), "mmguard_added_p99_ms": added(m, "p99_ms"),
            "nginx_added_p50_ms": added(n, "p50_ms"), "nginx_added_p99_ms": added(n, "p99_ms"),
            "direct_p50_ms": _num(d, "p50_ms"), "direct_p99_ms": _num(d, "p99_ms"),
            "mmguard_p50_ms": _num(m, "p50_ms"), "mmguard_p99_ms": _num(m, "p99_ms"),
            "errors": "/".join(str(int(c.get("errors", 0))) if c and "failed" not in c
                               else ("FAIL" if c else "-") for c in (d, n, m)),
            "mmguard_cpu_ms_per_req": ((m or {}).get("cpu_ms_per_req") or {}).get("mmguard"),
            "nginx_cpu_ms_per_req": ((n or {}).get("cpu_ms_per_req") or {}).get("nginx"),
            "floor_rps": _num(f, "rps"),
            "floor_cpu_ms_per_req": ((f or {}).get("cpu_ms_per_req") or {}).get("passthrough"),
        })
    return out


SUMMARY_COLUMNS = [
    ("case", "case", None), ("direct req/s", "direct_rps", ".0f"),
    ("nginx req/s", "nginx_rps", ".0f"), ("mmguard req/s", "mmguard_rps", ".0f"),
    ("mmguard/direct", "mmguard_over_direct", ".2f"), ("nginx/direct", "nginx_over_direct", ".2f"),
    ("+p50 ms", "mmguard_added_p50_ms", "+.2f"), ("+p99 ms", "mmguard_added_p99_ms", "+.2f"),
    ("nginx +p50 ms", "nginx_added_p50_ms", "+.2f"),
    ("mmguard CPU ms/req", "mmguard_cpu_ms_per_req", ".3f"),
    ("errors d/n/m", "errors", None),
]
FLOOR_COLUMNS = [("floor req/s", "floor_rps", ".0f"),
                 ("floor CPU ms/req", "floor_cpu_ms_per_req", ".3f")]


def summary_table(summary: list[dict[str, Any]], md: bool) -> str:
    columns = SUMMARY_COLUMNS[:-1]
    if any(s.get("floor_rps") is not None for s in summary):
        columns += FLOOR_COLUMNS
    columns.append(SUMMARY_COLUMNS[-1])
    head = [c[0] for c in columns]
    body = [[str(s[k]) if spec is None else fmt(s[k], spec) for _, k, spec in columns]
            for s in summary]
    return render_table(head, body, md)


def detail_md(cells: list[dict[str, Any]]) -> str:
    lines = ["| case | target | req/s | p50 ms | p90 ms | p99 ms | max ms | errors | "
             "CPU ms/req (per process) | machine busy % | other CPU % |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for c in cells:
        case = next(x for x in CASES if x.key == c["case"]).label
        what = f"{case} {c['protocol']} c={c['concurrency']}"
        if "failed" in c:
            lines.append(f"| {what} | {c['label']} | FAILED: {c['failed']} | | | | | | | | |")
            continue
        cpu = ", ".join(f"{k} {v:.3f}" for k, v in (c.get("cpu_ms_per_req") or {}).items()
                        if v >= 0.0005)
        lines.append(f"| {what} | {c['label']} | {c.get('rps', 0):.0f} | "
                     f"{fmt(c.get('p50_ms'), '.2f')} | {fmt(c.get('p90_ms'), '.2f')} | "
                     f"{fmt(c.get('p99_ms'), '.2f')} | {fmt(c.get('max_ms'), '.2f')} | "
                     f"{c.get('errors', 0)} | {cpu} | {c.get('machine_busy_pct')} | "
                     f"{c.get('other_cpu_pct')} |")
    return "\n".join(lines)


def machine_line(m: dict[str, Any]) -> str:
    v = m["versions"]
    return (f"machine: {m['nproc']} CPUs (nproc), {m['cpu_model']}, {m['mem_gib']} GiB, "
            f"Linux {m['kernel']}; Python {v.get('python')}, grpcio {v.get('grpcio')}, "
            f"aiohttp {v.get('aiohttp')}, onnxruntime {v.get('onnxruntime')}, "
            f"nginx {v.get('nginx', '-')}, Triton {v.get('triton', '?')} "
            f"(nvidia-pytriton {v.get('nvidia-pytriton')})")


def write_reports(out: Path, info: dict[str, Any], args: argparse.Namespace,
                  rows: list[dict[str, Any]], cells: list[dict[str, Any]],
                  mmguard_configs: dict[str, Any], elapsed: float,
                  chain_rows: list[dict[str, Any]] | None = None) -> str:
    summary = summary_rows(rows)
    table = summary_table(summary, md=False) if summary else "(no direct / nginx / mmguard rows)"
    out.mkdir(parents=True, exist_ok=True)
    doc = {"machine": info, "args": {k: v for k, v in vars(args).items() if k != "out"},
           "elapsed_s": round(elapsed, 1), "mmguard_config": mmguard_configs["mmguard"],
           "chains_mmguard_config": mmguard_configs.get("chains"),
           "summary": summary, "chains": chain_rows or [], "cells": cells}
    (out / "results.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    notes = [
        "- Cells: `--duration` s measured after `--warmup` s of the same load, one load-generator "
        "process (asyncio), `concurrency` requests in flight on one gRPC channel / up to "
        "`concurrency` HTTP keep-alive connections.",
        "- *+p50/+p99*: mmguard's latency minus direct's, ms. *CPU ms/req*: CPU time the mmguard "
        "process spent per request during the window.",
        "- ORT rows: *direct* is an in-process `session.run` in the load-generator process "
        "(c=1: a plain loop; c>1: a pool of `--ort-threads` threads, as mmguard's backend); no "
        "nginx equivalent.",
        *(["- *floor*: `bench/passthrough_proxy.py`, a bare grpc.aio/aiohttp pass-through "
           "(no parsing, filters, metrics or tracing), same routes as mmguard."]
          if args.floor else []),
        "- HTTP rows through mmguard use routes `*_h` with `backend_model` (a route name differs "
        "from Triton's model name).",
        f"- All processes share the machine's {info['nproc']} CPUs; the load generator is one "
        "of them. *other CPU %*: share of the machine's CPU used during the cell by processes "
        f"outside the benchmark (machine {info.get('busy_before_pct')}% busy before the start); "
        f"cells above {NOISY_OTHER_PCT:g}% are noisy.",
    ]
    md = "\n".join([
        "# mmguard benchmark", "",
        machine_line(info), "",
        f"`{' '.join(['python', '-m', 'bench.proxy', *sys.argv[1:]])}` — {elapsed:.0f} s, "
        f"mmguard at {git_line(info)}", "",
        *(["## Summary", "", summary_table(summary, md=True), "", *notes, ""] if summary else []),
        *(["## The chain's price", "", chain_table(chain_rows, md=True), "",
           *chain_notes(args.chain_concurrency, args.chain_rounds), ""] if chain_rows else []),
        "## Every cell", "", detail_md(cells), "",
    ])
    (out / "results.md").write_text(md)
    return table
