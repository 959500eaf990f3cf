#!/usr/bin/env python
"""Soak: sustained mixed load on one mmguard process for a given time; RSS must stay flat.

    python bench/soak.py --minutes 60
    python bench/soak.py --minutes 10 --vllm http://127.0.0.1:8000   # + OpenAI streaming chat

mmguard runs as its own process (``python -m proxy.cli serve``, bench/_common.py) on in-process
ONNX Runtime with ``clip_demo`` and the ``identity_<dtype>`` models of the tests. This script
keeps ``--concurrency`` requests in flight per kind, all valid and checked:

* ``grpc``: ModelInfer, raw ``grpc.aio`` unary, FP32 [4096] to identity_fp32 (output == input);
* ``grpc_stream``: ModelStreamInfer, each worker a bidirectional stream of 50 requests, then a
  new stream. ONNX Runtime has no decoupled model, so every request has exactly one response;
* ``http_json``: v2 JSON, INT64 [64] to identity_int64 (output == input);
* ``http_binary``: v2 binary extension, clip_demo (pixel_values [1,3,224,224] + input_ids
  [1,77]), 3 outputs, similarity within [-1, 1];
* ``bad``: invalid requests, HTTP and gRPC (shape/size mismatch, unknown model, malformed
  JSON), whose expected 4xx / gRPC code counts as success (leaks often live in error paths);
* ``openai_stream`` with ``--vllm URL``: streaming chat completions through a ``vllm`` backend.

Every ``--interval`` seconds: one line with requests/s and p50/p99 ms per kind, errors by kind
and code, and mmguard's RSS (/proc/<pid>/status VmRSS) and open file descriptors. At the end: a
summary with RSS first/last/max and its slope in MiB per hour (least squares over the samples
after ``--warmup``), and exit code 1 when the slope exceeds ``--max-rss-slope-mib-per-h`` or any
request failed unexpectedly. Samples go to ``<out>/soak.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
from numpy.typing import NDArray

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script it already is
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, MmguardProcess, http_json, proc_cpu_s  # (puts ROOT on sys.path)

from proxy.pb import grpc_service_pb2 as pb

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
HLEN = "Inference-Header-Content-Length"
STREAM_LENGTH = 50
"""Requests per ModelStreamInfer stream before it is closed and a new one opened."""


class Unexpected(Exception):
    """An answer that is not the expected one; ``code`` is what the summary counts it under."""

    def __init__(self, code: str, detail: str = "") -> None:
        super().__init__(f"{code}: {detail}"[:300])
        self.code = code


@dataclass
class Kind:
    """Counters of one kind of request; ``lat`` is emptied at each report."""

    name: str
    done: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    samples: dict[str, str] = field(default_factory=dict)
    lat: list[float] = field(default_factory=list)
    all_lat: list[float] = field(default_factory=list)

    def ok(self, seconds: float) -> None:
        self.done += 1
        self.lat.append(seconds)

    def fail(self, exc: BaseException) -> None:
        code = exc.code if isinstance(exc, Unexpected) else type(exc).__name__
        self.errors[code] += 1
        self.samples.setdefault(code, str(exc)[:300])


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


def _grpc_body(model: str, name: str, dt: str, arr: NDArray[Any]) -> bytes:
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name=name, datatype=dt, shape=list(arr.shape))
    req.raw_input_contents.append(arr.tobytes())
    return bytes(req.SerializeToString())


def _first_output(answer: bytes) -> bytes:
    resp = pb.ModelInferResponse.FromString(answer)
    return bytes(resp.raw_output_contents[0]) if resp.raw_output_contents else b""


@dataclass(frozen=True)
class BadCase:
    body: bytes
    path: str | None = None
    """The HTTP path; None: gRPC ModelInfer."""
    status: int = 400
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT


@dataclass
class Load:
    """What each kind sends, built once, and how its answer is checked."""

    http: str
    grpc_url: str
    vllm_model: str | None
    fp32: NDArray[np.float32] = field(
        default_factory=lambda: np.random.default_rng(1).standard_normal(4096).astype("<f4"))
    int64: NDArray[np.int64] = field(default_factory=lambda: np.arange(64, dtype="<i8") * 7919)

    def __post_init__(self) -> None:
        self.grpc_body = _grpc_body("identity_fp32", "INPUT0", "FP32", self.fp32)
        self.json_body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT64",
                                                 "shape": [64], "data": self.int64.tolist()}]}
                                    ).encode()
        px = np.random.default_rng(2).random((1, 3, 224, 224), dtype=np.float32)
        ids = np.zeros((1, 77), dtype="<i8")
        ids[0, :5] = [49406, 320, 1929, 539, 49407]
        head = json.dumps({"inputs": [
            {"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 224, 224],
             "parameters": {"binary_data_size": px.nbytes}},
            {"name": "input_ids", "datatype": "INT64", "shape": [1, 77],
             "parameters": {"binary_data_size": ids.nbytes}}],
            "outputs": [{"name": n, "parameters": {"binary_data": True}}
                        for n in ("image_embeds", "text_embeds", "similarity")]}).encode()
        self.clip_body, self.clip_hlen = head + px.tobytes() + ids.tobytes(), len(head)
        self.bad_cases = [
            BadCase(b'{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [3], '
                    b'"data": [1, 2]}]}', "/v2/models/identity_fp32/infer"),
            BadCase(b"{not json", "/v2/models/identity_fp32/infer"),
            BadCase(self.json_body, "/v2/models/no_such_model/infer", status=404),
            BadCase(_grpc_body("no_such_model", "INPUT0", "FP32", self.fp32[:4]),
                    code=grpc.StatusCode.NOT_FOUND),
            # raw_input_contents is the last field: one byte short of its declared length
            BadCase(self.grpc_body[:-4] + b"\x00" * 3),
        ]


async def _http_status(session: aiohttp.ClientSession, url: str, body: bytes,
                       headers: dict[str, str]) -> tuple[int, bytes, Any]:
    async with session.post(url, data=body, headers=headers) as resp:
        return resp.status, await resp.read(), resp.headers


def grpc_unary(load: Load, channel: grpc.aio.Channel) -> Callable[[], Awaitable[None]]:
    rpc = channel.unary_unary(INFER)

    async def one() -> None:
        try:
            answer = await rpc(load.grpc_body, timeout=30)
        except grpc.aio.AioRpcError as err:
            raise Unexpected(err.code().name, err.details() or "") from None
        if _first_output(answer) != load.fp32.tobytes():
            raise Unexpected("wrong-answer", "identity_fp32 changed the tensor")

    return one


def http_json_call(load: Load, session: aiohttp.ClientSession) -> Callable[[], Awaitable[None]]:
    url = f"http://{load.http}/v2/models/identity_int64/infer"
    headers = {"Content-Type": "application/json"}

    async def one() -> None:
        status, body, _ = await _http_status(session, url, load.json_body, headers)
        if status != 200:
            raise Unexpected(f"HTTP {status}", body[:200].decode(errors="replace"))
        if json.loads(body)["outputs"][0]["data"] != load.int64.tolist():
            raise Unexpected("wrong-answer", "identity_int64 changed the tensor")

    return one


def http_binary_call(load: Load, session: aiohttp.ClientSession) -> Callable[[], Awaitable[None]]:
    url = f"http://{load.http}/v2/models/clip_demo/infer"
    headers = {HLEN: str(load.clip_hlen), "Content-Type": "application/octet-stream"}

    async def one() -> None:
        status, body, resp_headers = await _http_status(session, url, load.clip_body, headers)
        if status != 200:
            raise Unexpected(f"HTTP {status}", body[:200].decode(errors="replace"))
        hlen = int(resp_headers[HLEN])
        sim = np.frombuffer(body[hlen:][-4:], dtype="<f4")[0]
        if not -1.001 <= sim <= 1.001 or len(body) - hlen != 4 * (64 + 64 + 1):
            raise Unexpected("wrong-answer", f"clip_demo similarity {sim}")

    return one


def bad_call(load: Load, session: aiohttp.ClientSession,
             channel: grpc.aio.Channel) -> Callable[[], Awaitable[None]]:
    rpc = channel.unary_unary(INFER)
    turn = itertools.count()

    async def one() -> None:
        case = load.bad_cases[next(turn) % len(load.bad_cases)]
        if case.path is not None:
            status, answer, _ = await _http_status(session, f"http://{load.http}{case.path}",
                                                   case.body, {"Content-Type": "application/json"})
            if status != case.status or not json.loads(answer).get("error"):
                raise Unexpected(f"HTTP {status}", f"expected {case.status} with a message")
            return
        try:
            await rpc(case.body, timeout=30)
        except grpc.aio.AioRpcError as err:
            if err.code() == case.code and err.details():
                return
            raise Unexpected(err.code().name, err.details() or "") from None
        raise Unexpected("OK", f"expected {case.code.name}")

    return one


async def stream_worker(load: Load, channel: grpc.aio.Channel, kind: Kind,
                        until: float) -> None:
    """One bidirectional stream at a time: a request, its response, ``STREAM_LENGTH`` times."""
    rpc = channel.stream_stream(STREAM)
    expected = load.fp32.tobytes()
    while time.monotonic() < until:
        call = rpc(timeout=600)
        try:
            for _ in range(STREAM_LENGTH):
                if time.monotonic() >= until:
                    break
                t0 = time.perf_counter()
                await call.write(load.grpc_body)
                answer = await call.read()
                if answer is grpc.aio.EOF:
                    raise Unexpected("stream-ended", "the server closed the stream")
                msg = pb.ModelStreamInferResponse.FromString(answer)
                if msg.error_message:
                    raise Unexpected("stream-error", msg.error_message)
                if bytes(msg.infer_response.raw_output_contents[0]) != expected:
                    raise Unexpected("wrong-answer", "identity_fp32 changed the tensor")
                kind.ok(time.perf_counter() - t0)
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:  # the server ends its side too
                pass
        except grpc.aio.AioRpcError as err:
            kind.fail(Unexpected(err.code().name, err.details() or ""))
            await asyncio.sleep(0.05)
        except Unexpected as exc:
            kind.fail(exc)
            call.cancel()
            await asyncio.sleep(0.05)


def openai_stream_call(load: Load,
                       session: aiohttp.ClientSession) -> Callable[[], Awaitable[None]]:
    url = f"http://{load.http}/v1/chat/completions"
    body = json.dumps({"model": load.vllm_model, "stream": True, "max_tokens": 16,
                       "messages": [{"role": "user", "content": "Tell me about robots."}]})

    async def one() -> None:
        async with session.post(url, data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                raise Unexpected(f"HTTP {resp.status}", (await resp.text())[:200])
            events, done = 0, False
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: "):
                    events += 1
                    if "error" in json.loads(line[6:]):  # an error event ends a stream early
                        raise Unexpected("stream-error", line[:200].decode(errors="replace"))
            if not done or events == 0:
                raise Unexpected("stream-cut", f"{events} events, [DONE] {done}")

    return one


async def unary_worker(one: Callable[[], Awaitable[None]], kind: Kind, until: float) -> None:
    while time.monotonic() < until:
        t0 = time.perf_counter()
        try:
            await one()
        except Exception as exc:  # counted by code; a short pause so a dead target can't spin
            kind.fail(exc)
            await asyncio.sleep(0.05)
            continue
        kind.ok(time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# Sampling and reporting
# ---------------------------------------------------------------------------------------------


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return None


def slope_mib_per_h(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) points, in MiB per hour."""
    if len(points) < 3:
        return None
    t = np.array([p[0] for p in points])
    y = np.array([p[1] for p in points])
    if np.ptp(t) == 0:
        return None
    return float(np.polyfit(t, y, 1)[0] * 3600)


def _ms(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q) * 1000:.1f}" if values else "-"


def interval_line(elapsed: float, span: float, kinds: list[Kind], rss: float | None,
                  fds: int | None, cpu_pct: float) -> str:
    parts = [f"[{elapsed:6.0f}s] rss {rss or 0:7.1f} MiB  fds {fds or 0:3d}  cpu {cpu_pct:3.0f}%"]
    for k in kinds:
        parts.append(f"{k.name} {len(k.lat) / span:6.1f}/s {_ms(k.lat, 50)}/{_ms(k.lat, 99)}ms")
    errors = ", ".join(f"{k.name} {code}×{n}" for k in kinds for code, n in k.errors.items())
    return " | ".join(parts) + f" | errors: {errors or 'none'}"


async def sampler(pid: int, kinds: list[Kind], start: float, until: float, interval: float,
                  samples: list[dict[str, Any]]) -> None:
    """RSS every second; a line every ``interval`` seconds."""
    last_report, cpu0 = time.monotonic(), proc_cpu_s(pid)
    while (now := time.monotonic()) < until:
        await asyncio.sleep(min(1.0, max(until - now, 0.01)))
        now = time.monotonic()
        rss, fds = rss_mib(pid), open_fds(pid)
        samples.append({"t": round(now - start, 2), "rss_mib": rss, "fds": fds})
        if now - last_report >= interval or now >= until:
            span = now - last_report
            cpu1 = proc_cpu_s(pid)
            print(interval_line(now - start, span, kinds, rss, fds, 100 * (cpu1 - cpu0) / span),
                  flush=True)
            for k in kinds:
                k.all_lat.extend(k.lat)
                k.lat.clear()
            last_report, cpu0 = now, cpu1


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def mmguard_config(model_dir: Path, vllm: str | None, vllm_model: str | None) -> dict[str, Any]:
    from tests.conftest import ort_config

    cfg: dict[str, Any] = ort_config(model_dir, telemetry={"log_level": "warning"})
    if vllm:
        cfg["backends"].append({"kind": "vllm", "name": "vllm", "url": vllm})
        cfg["models"].append({"name": vllm_model, "backend": "vllm"})
    return cfg


async def run_load(args: argparse.Namespace, proc: MmguardProcess, vllm_model: str | None
                   ) -> tuple[list[Kind], list[dict[str, Any]], float]:
    load = Load(f"127.0.0.1:{proc.ports['http']}", f"127.0.0.1:{proc.ports['grpc']}",
                vllm_model)
    names = ["grpc", "grpc_stream", "http_json", "http_binary", "bad"]
    names += ["openai_stream"] if vllm_model else []
    kinds = {n: Kind(n) for n in names}
    samples: list[dict[str, Any]] = []
    start = time.monotonic()
    until = start + args.minutes * 60
    c = args.concurrency
    connector = aiohttp.TCPConnector(limit=0)
    async with grpc.aio.insecure_channel(load.grpc_url) as channel, \
            aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60),
                                  headers={"Accept-Encoding": "identity"}) as session:
        units: dict[str, Callable[[], Awaitable[None]]] = {
            "grpc": grpc_unary(load, channel), "http_json": http_json_call(load, session),
            "http_binary": http_binary_call(load, session),
            "bad": bad_call(load, session, channel)}
        if vllm_model:
            units["openai_stream"] = openai_stream_call(load, session)
        tasks = [unary_worker(one, kinds[n], until) for n, one in units.items()
                 for _ in range(c if n != "bad" else 1)]
        tasks += [stream_worker(load, channel, kinds["grpc_stream"], until) for _ in range(c)]
        tasks.append(sampler(proc.pid or 0, list(kinds.values()), start, until, args.interval,
                             samples))
        await asyncio.gather(*tasks)
    return list(kinds.values()), samples, time.monotonic() - start


def summary(kinds: list[Kind], samples: list[dict[str, Any]], seconds: float,
            args: argparse.Namespace) -> tuple[str, dict[str, Any], bool]:
    lines = [f"\nsoak: {seconds:.0f} s, concurrency {args.concurrency} per kind", "",
             f"{'kind':<14} {'requests':>9} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
             f"{'max ms':>7}  errors"]
    for k in kinds:
        lat = k.all_lat + k.lat
        errs = ", ".join(f"{c}×{n}" for c, n in k.errors.items()) or "0"
        lines.append(f"{k.name:<14} {k.done:>9,} {k.done / seconds:>7.1f} {_ms(lat, 50):>7} "
                     f"{_ms(lat, 99):>7} {(max(lat) * 1000 if lat else 0):>7.1f}  {errs}")
    rss = [(s["t"], s["rss_mib"]) for s in samples if s["rss_mib"] is not None]
    warm = args.warmup if args.minutes * 60 >= 2 * args.warmup else args.minutes * 60 / 3
    slope = slope_mib_per_h([p for p in rss if p[0] >= warm])
    fds = [s["fds"] for s in samples if s["fds"] is not None]
    failed = sum(sum(k.errors.values()) for k in kinds)
    flat = slope is not None and slope <= args.max_rss_slope_mib_per_h
    figures = {"seconds": round(seconds, 1), "warmup_s": round(warm, 1),
               "rss_first_mib": rss[0][1] if rss else None,
               "rss_last_mib": rss[-1][1] if rss else None,
               "rss_max_mib": max(p[1] for p in rss) if rss else None,
               "rss_slope_mib_per_h": None if slope is None else round(slope, 2),
               "fds_first": fds[0] if fds else None, "fds_last": fds[-1] if fds else None,
               "unexpected_failures": failed}
    lines += ["", f"RSS: first {figures['rss_first_mib']:.1f} MiB, last "
              f"{figures['rss_last_mib']:.1f}, max {figures['rss_max_mib']:.1f}; slope after "
              f"{warm:.0f} s warm-up: {slope if slope is not None else float('nan'):+.1f} MiB/h "
              f"(limit {args.max_rss_slope_mib_per_h:g})" if rss else "RSS: no samples",
              *(["(under 10 minutes of samples after the warm-up: the slope is noisy; soak "
                 "for 30 minutes or more for a verdict)"] if seconds - warm < 600 else []),
              f"open fds: first {figures['fds_first']}, last {figures['fds_last']}",
              f"unexpected failures: {failed}"]
    for k in kinds:
        for code, text in k.samples.items():
            lines.append(f"  {k.name} {code}: {text}")
    ok = flat and failed == 0
    lines.append("verdict: " + ("OK" if ok else "FAIL" + ("" if flat else " (RSS grows)")
                                + ("" if failed == 0 else " (requests failed)")))
    return "\n".join(lines), figures, ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long the load runs (10)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between lines (10)")
    p.add_argument("--warmup", type=float, default=60.0,
                   help="seconds left out of the RSS slope (60; a third of the run if shorter "
                        "than two warm-ups)")
    p.add_argument("--concurrency", type=int, default=2,
                   help="requests in flight per kind (2; 'bad' always 1)")
    p.add_argument("--max-rss-slope-mib-per-h", type=float, default=50.0,
                   help="exit 1 when RSS grows faster (50)")
    p.add_argument("--vllm", metavar="URL", help="also stream chat completions through a vllm "
                   "backend at this URL")
    p.add_argument("--vllm-model", help="the model name vLLM serves (default: its /v1/models)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    p.add_argument("--keep-tmp", action="store_true", help="keep the models, config and log")
    return p.parse_args(argv)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM stops mmguard the same way as Ctrl-C (``finally`` below)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vllm_model = args.vllm_model
    if args.vllm and not vllm_model:
        listed = http_json(args.vllm.rstrip("/") + "/v1/models") or {}
        vllm_model = next((m["id"] for m in listed.get("data", [])), None)
        if not vllm_model:
            raise SystemExit(f"no model listed at {args.vllm}/v1/models; give --vllm-model")
    from tests.support.models import ort_repository

    tmp = Path(tempfile.mkdtemp(prefix="mmguard-soak-"))
    (tmp / "models").mkdir()
    proc = MmguardProcess(tmp, mmguard_config(ort_repository(tmp / "models"), args.vllm,
                                              vllm_model))
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        proc.start()
        kinds = ", ".join(["grpc", "grpc_stream (one response per request: ONNX Runtime has no "
                           "decoupled model)", "http_json", "http_binary", "bad",
                           *(["openai_stream"] if vllm_model else [])])
        print(f"mmguard pid {proc.pid}, ports {proc.ports}; load: {kinds}; "
              f"{args.minutes:g} min", flush=True)
        kinds_done, samples, seconds = asyncio.run(run_load(args, proc, vllm_model))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        proc.stop()
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    text, figures, ok = summary(kinds_done, samples, seconds, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(
        {"figures": figures, "args": {k: str(v) for k, v in vars(args).items()},
         "kinds": {k.name: {"requests": k.done, "errors": dict(k.errors)} for k in kinds_done},
         "samples": samples}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
