#!/usr/bin/env python
"""mmguard vs nginx vs direct: throughput and latency over KServe v2 gRPC and HTTP, in one run.

    python bench/bench_proxy.py [--duration 5] [--warmup 1] [--out bench/out]

What runs (all on 127.0.0.1, every server its own process):

* a real Triton (``tests/support/triton.py``: the nvidia-pytriton binary, Python-backend models
  ``pixel_identity`` FP32 [1,3,224,224] identity and ``small_fp32`` FP32 [1,16] y = 2x);
* mmguard (``python -m proxy.cli serve``) routing ``pixel_identity``/``small_fp32`` to a
  ``triton_grpc`` backend, ``pixel_identity_h``/``small_fp32_h`` (``backend_model``) to a
  ``triton_http`` backend and ``identity_pixel``/``identity_small`` (FP32 identity ONNX models,
  [-1,3,224,224] and [-1,16]) to an in-process ``onnxruntime`` backend;
* nginx (``grpc_pass`` on an h2c listener, ``proxy_pass`` with a keep-alive upstream) in front of
  the same Triton, from ``bench/nginx.conf.template``;
* one load-generator process (spawned, so its event loop shares nothing with the servers):
  gRPC = ``grpc.aio`` raw unary calls with pre-serialized ``ModelInferRequest`` bytes, HTTP =
  ``aiohttp`` with a pre-built binary body (``Inference-Header-Content-Length``). It keeps
  ``concurrency`` requests in flight on one connection/channel (HTTP: a pool of up to
  ``concurrency`` keep-alive connections). The first answer of every cell is checked byte for
  byte against the expected output before the cell is measured.

For the ONNX Runtime rows there is no out-of-process equivalent, so "direct" is the same model
run in the load-generator process: a plain ``session.run`` loop at concurrency 1, and at higher
concurrency ``concurrency`` callers sharing a pool of ``--ort-threads`` threads (what mmguard's
backend does), so that queueing is the same on both sides.

Besides req/s and latency, every cell records the CPU time each process spent during the
measured window (from /proc), as ms of CPU per request: on a small machine the servers and the
load generator compete for the same cores, and CPU per request says who is paying.

The full chain's price (``bench/chain_study.py``): ``--chains`` (default ``default,full,
full_shadow10``) or ``--chain-study`` (one filter added at a time) measures mmguard's CPU per
request with each chain on the 600 KB case over gRPC and HTTP, served by one more mmguard
process; ``--chain-only`` skips the matrix above.

Results: a table on stdout, ``<out>/results.json`` and ``<out>/results.md``. Every process is
stopped on exit, Ctrl-C and SIGTERM included (children also get SIGTERM if this script is
SIGKILLed: ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
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
    free_ports,
    git_line,
    group_cpu_s,
    http_json,
    http_status,
    machine_info,
    pdeathsig,
    proc_cpu_s,
    render_table,
    report_problems,
    serve_cells,
    shut_down,
    stop_each,
    stop_process,
)
from chain_study import (
    DEFAULT_CHAINS,
    STUDY,
    ChainStudy,
    chain_notes,
    chain_table,
    parse_chains,
    photo_pixels,
    summarize,
)

MiB = 1 << 20
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
HEADER_LENGTH = "Inference-Header-Content-Length"
NGINX_TEMPLATE = Path(__file__).resolve().parent / "nginx.conf.template"
DISTS = ("grpcio", "aiohttp", "onnxruntime", "numpy", "tritonclient", "nvidia-pytriton",
         "mmguard", "protobuf")


# ---------------------------------------------------------------------------------------------
# What is measured
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorCase:
    key: str
    label: str
    shape: tuple[int, ...]
    triton_model: str  # Triton's name; also mmguard's route to the triton_grpc backend
    triton_in: str
    triton_out: str
    op: str  # "identity" or "double": what the Triton model computes (checked on the answer)
    ort_model: str  # mmguard's route (and file) on the onnxruntime backend

    @property
    def http_route(self) -> str:  # mmguard's route to the triton_http backend
        return self.triton_model + "_h"


CASES = (
    TensorCase("pixel", "FP32 [1,3,224,224]", (1, 3, 224, 224), "pixel_identity",
               "pixel_values", "pixel_out", "identity", "identity_pixel"),
    TensorCase("small", "FP32 [1,16]", (1, 16), "small_fp32", "x", "y", "double",
               "identity_small"),
)
ORT_IN, ORT_OUT = "INPUT0", "OUTPUT0"
PROTOCOLS = ("grpc", "http")


# ---------------------------------------------------------------------------------------------
# Load generator (runs in its own spawned process)
# ---------------------------------------------------------------------------------------------


def _payload(spec: dict[str, Any]) -> tuple[Any, bytes]:
    import numpy as np

    x = photo_pixels() if spec.get("payload") == "photo" else None
    if x is None:
        rng = np.random.default_rng(20260101 + len(spec["shape"]))
        x = rng.standard_normal(spec["shape"]).astype(np.float32)
    expected = x if spec["op"] == "identity" else (x * np.float32(2)).astype(np.float32)
    return x, expected.tobytes()


def _grpc_request(spec: dict[str, Any], x: Any) -> bytes:
    try:
        from tritonclient.grpc import service_pb2 as pb
    except ImportError:  # pragma: no cover - tritonclient missing: use mmguard's copy
        from proxy.pb import grpc_service_pb2 as pb
    req = pb.ModelInferRequest(model_name=spec["model"])
    req.inputs.add(name=spec["input"], datatype="FP32", shape=list(spec["shape"]))
    req.outputs.add(name=spec["output"])
    req.raw_input_contents.append(x.tobytes())
    return bytes(req.SerializeToString())


def _grpc_check(spec: dict[str, Any], answer: bytes, expected: bytes) -> None:
    try:
        from tritonclient.grpc import service_pb2 as pb
    except ImportError:  # pragma: no cover
        from proxy.pb import grpc_service_pb2 as pb
    resp = pb.ModelInferResponse.FromString(answer)
    names = [o.name for o in resp.outputs]
    if names != [spec["output"]]:
        raise AssertionError(f"outputs {names}, expected [{spec['output']!r}]")
    if list(resp.outputs[0].shape) != list(spec["shape"]):
        raise AssertionError(f"shape {list(resp.outputs[0].shape)}, expected {spec['shape']}")
    if resp.raw_output_contents[0] != expected:
        raise AssertionError("output bytes differ from the expected answer")


def _http_request(spec: dict[str, Any], x: Any) -> tuple[bytes, dict[str, str]]:
    raw = x.tobytes()
    head = json.dumps({
        "inputs": [{"name": spec["input"], "shape": list(spec["shape"]), "datatype": "FP32",
                    "parameters": {"binary_data_size": len(raw)}}],
        "outputs": [{"name": spec["output"], "parameters": {"binary_data": True}}],
    }, separators=(",", ":")).encode()
    # aiohttp asks for gzip by default, and Triton then compresses its answer (600 KB through
    # zlib per request): the load generator asks for the plain body, as tritonclient does.
    headers = {HEADER_LENGTH: str(len(head)), "Content-Type": "application/octet-stream",
               "Accept-Encoding": "identity"}
    return head + raw, headers


def _http_check(spec: dict[str, Any], status: int, headers: Any, data: bytes,
                expected: bytes) -> None:
    if status != 200:
        raise AssertionError(f"HTTP {status}: {data[:300]!r}")
    hlen = headers.get(HEADER_LENGTH)
    if hlen is None:
        raise AssertionError(f"no {HEADER_LENGTH} header: answer is JSON-only: {data[:300]!r}")
    doc = json.loads(data[:int(hlen)])
    outs = doc.get("outputs") or []
    if [o.get("name") for o in outs] != [spec["output"]]:
        raise AssertionError(f"outputs {[o.get('name') for o in outs]}, expected "
                             f"[{spec['output']!r}]")
    if outs[0].get("shape") != list(spec["shape"]):
        raise AssertionError(f"shape {outs[0].get('shape')}, expected {spec['shape']}")
    if data[int(hlen):] != expected:
        raise AssertionError("output bytes differ from the expected answer")


async def _cell_grpc(spec: dict[str, Any], rec_factory: Callable[[], Recorder]) -> dict[str, Any]:
    import grpc

    x, expected = _payload(spec)
    body = _grpc_request(spec, x)
    opts = [("grpc.max_send_message_length", 64 * MiB),
            ("grpc.max_receive_message_length", 64 * MiB)]
    metadata = tuple((k, v) for k, v in (spec.get("headers") or {}).items()) or None
    watch = spec.get("count_header")  # chain cells: count answers that carry this trailer
    seen = 0
    async with grpc.aio.insecure_channel(spec["addr"], options=opts) as channel:
        await asyncio.wait_for(channel.channel_ready(), 15)
        call = channel.unary_unary(GRPC_INFER)  # no (de)serializers: bytes in, bytes out
        if watch:
            first = call(body, timeout=30, metadata=metadata)
            _grpc_check(spec, await first, expected)
            trailers = {k: str(v) for k, v in (await first.trailing_metadata() or ())}
            if watch in trailers:
                raise AssertionError(f"first answer carries {watch}: {trailers[watch]}")

            async def one() -> None:
                nonlocal seen
                c = call(body, timeout=30, metadata=metadata)
                await c
                if any(k == watch for k, _ in (await c.trailing_metadata() or ())):
                    seen += 1
        else:
            _grpc_check(spec, await call(body, timeout=30), expected)
            trailers = {}

            async def one() -> None:
                await call(body, timeout=30)

        rec = rec_factory()
        await drive(one, rec, spec["concurrency"])
    out = rec.result()
    if watch:
        out["header_count"] = seen
        out["first_decisions"] = {k: v for k, v in trailers.items() if k.startswith("mmguard-")}
    return out


async def _cell_http(spec: dict[str, Any], rec_factory: Callable[[], Recorder]) -> dict[str, Any]:
    import aiohttp

    x, expected = _payload(spec)
    body, headers = _http_request(spec, x)
    url = f"http://{spec['addr']}/v2/models/{spec['model']}/infer"
    headers.update(spec.get("headers") or {})
    watch = spec.get("count_header")  # chain cells: count answers that carry this header
    seen = 0
    connector = aiohttp.TCPConnector(limit=spec["concurrency"], keepalive_timeout=300)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        async with session.post(url, data=body, headers=headers) as r:
            _http_check(spec, r.status, r.headers, await r.read(), expected)
            first = {k.lower(): v for k, v in r.headers.items()}
        if watch and watch in first:
            raise AssertionError(f"first answer carries {watch}: {first[watch]}")

        async def one() -> None:
            nonlocal seen
            async with session.post(url, data=body, headers=headers) as r:
                data = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
                if watch and watch in r.headers:
                    seen += 1

        rec = rec_factory()
        await drive(one, rec, spec["concurrency"])
    out = rec.result()
    if watch:
        out["header_count"] = seen
        out["first_decisions"] = {k: v for k, v in first.items() if k.startswith("mmguard-")}
    return out


async def _cell_ort(spec: dict[str, Any], rec_factory: Callable[[], Recorder]) -> dict[str, Any]:
    """The in-process "direct" for ONNX Runtime rows."""
    from concurrent.futures import ThreadPoolExecutor

    import onnxruntime as ort

    x, expected = _payload(spec)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = spec["ort_intra_op_threads"]
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(spec["onnx_path"], sess_options=opts,
                                providers=["CPUExecutionProvider"])
    names, feeds = [spec["output"]], {spec["input"]: x}
    got = sess.run(names, feeds)[0]
    if got.tobytes() != expected or list(got.shape) != list(spec["shape"]):
        raise AssertionError("onnxruntime answer differs from the expected output")
    c = spec["concurrency"]
    if c == 1:  # a plain session.run loop: no executor, no event loop in the way
        rec = rec_factory()
        while True:
            t0 = time.perf_counter()
            if not rec.tick(t0):
                break
            sess.run(names, feeds)
            rec.ok(t0, time.perf_counter())
        rec.notify("end")
        return rec.result()
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=spec["ort_threads"]) as pool:
        async def one() -> None:
            await loop.run_in_executor(pool, sess.run, names, feeds)

        rec = rec_factory()
        await drive(one, rec, c)
    return rec.result()


async def _run_cell(spec: dict[str, Any], factory: Callable[[], Recorder]) -> dict[str, Any]:
    run = {"grpc": _cell_grpc, "http": _cell_http, "ort": _cell_ort}[spec["kind"]]
    return await run(spec, factory)


def _loadgen_main(conn: Any) -> None:
    """Entry point of the load-generator process: one cell per message, until None."""
    serve_cells(conn, _run_cell)


# ---------------------------------------------------------------------------------------------
# The servers
# ---------------------------------------------------------------------------------------------


def write_ort_models(model_dir: Path) -> dict[str, Path]:
    """FP32 identity ONNX models with fixed inner dims: [batch,3,224,224] and [batch,16]."""
    import onnx
    from onnx import TensorProto, helper

    paths = {}
    for case in CASES:
        dims: list[str | int | None] = ["batch", *case.shape[1:]]
        graph = helper.make_graph(
            [helper.make_node("Identity", [ORT_IN], [ORT_OUT])], case.ort_model,
            [helper.make_tensor_value_info(ORT_IN, TensorProto.FLOAT, dims)],
            [helper.make_tensor_value_info(ORT_OUT, TensorProto.FLOAT, dims)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        path = model_dir / case.ort_model / "1" / "model.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, path)
        paths[case.ort_model] = path
    return paths


def start_triton(root: Path) -> Any:
    from proxy.cli.demo_model import ensure_clip_demo
    from tests.support.triton import TritonServer, triton_available, write_model_repository

    ok, why = triton_available()
    if not ok:
        raise SystemExit(f"cannot start Triton: {why}")
    onnx_path = ensure_clip_demo(root / "clip")
    repo = write_model_repository(root / "models", onnx_path)
    keep = {c.triton_model for c in CASES}
    for entry in repo.iterdir():  # only the two benchmarked models: fewer stubs, faster start
        if entry.is_dir() and entry.name not in keep:
            shutil.rmtree(entry)
    server = TritonServer(repo, root / "work")
    server.start()
    return server


class Mmguard(MmguardProcess):
    def __init__(self, root: Path, triton: Any, ort_dir: Path, ort_threads: int,
                 log_level: str) -> None:
        routes = []
        for c in CASES:
            routes.append({"name": c.triton_model, "backend": "triton_grpc"})
            routes.append({"name": c.http_route, "backend": "triton_http",
                           "backend_model": c.triton_model})
            routes.append({"name": c.ort_model, "backend": "ort"})
        super().__init__(root, {
            "listeners": {"http": {"host": "127.0.0.1"}, "grpc": {"host": "127.0.0.1"},
                          "admin": {"host": "127.0.0.1"}},
            "backends": [
                {"kind": "triton_grpc", "name": "triton_grpc", "url": triton.grpc_url},
                {"kind": "triton_http", "name": "triton_http", "url": f"http://{triton.http_url}"},
                {"kind": "onnxruntime", "name": "ort", "model_dir": str(ort_dir),
                 "models": [c.ort_model for c in CASES], "threads": ort_threads,
                 "intra_op_threads": 1, "device": "cpu"},
            ],
            "models": routes,
            "telemetry": {"log_level": log_level},
            "shutdown_grace_s": 1.0,
        })


class Nginx:
    def __init__(self, root: Path, triton: Any) -> None:
        self.prefix = root / "nginx"
        self.prefix.mkdir(parents=True, exist_ok=True)
        self.conf = self.prefix / "nginx.conf"
        self.triton = triton
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}
        self.binary = shutil.which("nginx")

    def start(self, attempts: int = 3) -> None:
        assert self.binary is not None
        for attempt in range(1, attempts + 1):
            http, grpc_ = free_ports(2)
            self.ports = {"http": http, "grpc": grpc_}
            user = "user root root;" if os.geteuid() == 0 else ""
            text = string.Template(NGINX_TEMPLATE.read_text()).substitute(
                user_line=user, prefix=str(self.prefix), http_port=http, grpc_port=grpc_,
                triton_http_port=self.triton.http_port, triton_grpc_port=self.triton.grpc_port)
            self.conf.write_text(text)
            log = open(self.prefix / "stdout.log", "ab")  # noqa: SIM115 - closed below
            try:
                self.proc = subprocess.Popen(
                    [self.binary, "-c", str(self.conf), "-p", str(self.prefix)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=pdeathsig)
            finally:
                log.close()
            deadline = time.monotonic() + 20
            url = f"http://127.0.0.1:{http}/v2/health/ready"
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if http_status(url) == 200:
                    return
                time.sleep(0.1)
            err = (self.prefix / "error.log")
            tail = err.read_text(errors="replace")[-3000:] if err.exists() else ""
            self.stop()
            if "address already in use" in tail.lower() and attempt < attempts:
                continue
            raise RuntimeError(f"nginx did not start; error.log tail:\n{tail}")

    def pids(self) -> list[int]:
        if self.proc is None:
            return []
        out = [self.proc.pid]
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
            out += [int(p) for p in children.split()]
        except OSError:
            pass
        return out

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout=10)  # SIGTERM: nginx's fast shutdown
        self.proc = None


class Floor:
    """``bench/passthrough_proxy.py``: a bare grpc.aio/aiohttp pass-through (``--floor``)."""

    def __init__(self, root: Path, triton: Any) -> None:
        self.log_path = root / "passthrough.log"
        self.triton = triton
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}

    def start(self, attempts: int = 3) -> None:
        script = Path(__file__).resolve().parent / "passthrough_proxy.py"
        for attempt in range(1, attempts + 1):
            grpc_, http = free_ports(2)
            self.ports = {"grpc": grpc_, "http": http}
            log = open(self.log_path, "ab")  # noqa: SIM115 - closed below
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, str(script), str(grpc_), str(http), self.triton.grpc_url,
                     self.triton.http_url], stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    start_new_session=True, preexec_fn=pdeathsig)
            finally:
                log.close()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.proc.poll() is None:
                if "ready" in self.log_path.read_text(errors="replace"):
                    return
                time.sleep(0.1)
            tail = self.log_path.read_text(errors="replace")[-3000:]
            self.stop()
            if "address already in use" in tail.lower() and attempt < attempts:
                continue
            raise RuntimeError(f"pass-through proxy did not start; log tail:\n{tail}")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout=10)
        self.proc = None


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.triton: Any = None
        self.mmguard: Mmguard | None = None
        self.nginx: Nginx | None = None
        self.floor: Floor | None = None
        self.loadgen: LoadGen | None = None
        self.ort_paths: dict[str, Path] = {}
        self.cells: list[dict[str, Any]] = []
        self._ort_direct: dict[tuple[str, int], dict[str, Any]] = {}
        self.study = (ChainStudy(args.chains, args.chain_rounds, args.chain_concurrency)
                      if args.chains else None)

    # -- life cycle ------------------------------------------------------------------------

    def start(self, root: Path) -> None:
        t0 = time.monotonic()
        self.ort_paths = write_ort_models(root / "ort_models")
        print("starting Triton ...", flush=True)
        self.triton = start_triton(root / "triton")
        print(f"  Triton ready in {time.monotonic() - t0:.1f}s: grpc {self.triton.grpc_url}, "
              f"http {self.triton.http_url}", flush=True)
        (root / "mmguard").mkdir(parents=True, exist_ok=True)
        self.mmguard = Mmguard(root / "mmguard", self.triton, root / "ort_models",
                               self.args.ort_threads, self.args.mmguard_log_level)
        print("starting mmguard ...", flush=True)
        self.mmguard.start()
        print(f"  mmguard ready: grpc {self.mmguard.ports['grpc']}, http "
              f"{self.mmguard.ports['http']} (pid {self.mmguard.pid})", flush=True)
        if not self.args.no_nginx:
            self.nginx = Nginx(root, self.triton)
            self.nginx.start()
            print(f"  nginx ready: grpc {self.nginx.ports['grpc']}, http "
                  f"{self.nginx.ports['http']}", flush=True)
        if self.study is not None:
            self.study.start(root / "mmguard-chains", self.triton, self.args.mmguard_log_level)
        if self.args.floor:
            self.floor = Floor(root, self.triton)
            self.floor.start()
            print(f"  pass-through floor ready: grpc {self.floor.ports['grpc']}, http "
                  f"{self.floor.ports['http']}", flush=True)
        self.loadgen = LoadGen(_loadgen_main)

    def stop(self) -> None:
        stop_each([("load generator", self.loadgen and self.loadgen.close),
                   ("nginx", self.nginx and self.nginx.stop),
                   ("pass-through", self.floor and self.floor.stop),
                   ("mmguard", self.mmguard and self.mmguard.stop),
                   ("chains' mmguard", self.study and self.study.stop),
                   ("Triton", self.triton and self.triton.stop)])

    # -- one cell --------------------------------------------------------------------------

    def _pids(self) -> dict[str, Callable[[], float]]:
        out: dict[str, Callable[[], float]] = {}
        if self.mmguard and self.mmguard.pid:
            pid = self.mmguard.pid
            out["mmguard"] = lambda: proc_cpu_s(pid)
        if self.nginx and self.nginx.proc:
            pids = self.nginx.pids()
            out["nginx"] = lambda: sum(proc_cpu_s(p) for p in pids)
        if self.floor and self.floor.pid:
            fpid = self.floor.pid
            out["passthrough"] = lambda: proc_cpu_s(fpid)
        if self.triton and self.triton.pid:
            pgid = self.triton.pid
            out["triton"] = lambda: group_cpu_s(pgid)
        if self.loadgen:
            lg = self.loadgen.pid
            out["loadgen"] = lambda: proc_cpu_s(lg)
        return out

    def measure(self, spec: dict[str, Any], label: str,
                probes: dict[str, Callable[[], float]] | None = None,
                counters: dict[str, Callable[[], float]] | None = None) -> dict[str, Any]:
        """One cell; ``probes``: the processes whose CPU it records (default: every server);
        ``counters``: name -> a count so far, reported per request (``per_req``)."""
        assert self.loadgen is not None
        spec = {**spec, "duration": self.args.duration, "warmup": self.args.warmup,
                "ort_threads": self.args.ort_threads, "ort_intra_op_threads": 1}
        # CpuWindow reports its "waits" as 1000 x delta / request: a count scaled by 1/1000
        # comes out per request, and stays out of the CPU sums.
        window = CpuWindow(self._pids() if probes is None else probes,
                           {k: (lambda f=f: f() / 1000) for k, f in (counters or {}).items()})
        result = self.loadgen.run(spec, lambda: window.mark("start"), lambda: window.mark("end"))
        result.update(window.result(result.get("requests", 0)))
        if counters:
            result["per_req"] = result.pop("runq_wait_ms_per_req", {})
        cell = {"label": label, **{k: spec[k] for k in ("kind", "target", "addr", "model",
                                                        "concurrency", "case", "protocol")},
                **result}
        self.cells.append(cell)
        print("  " + _cell_line(cell), flush=True)
        return cell

    # -- the matrix ------------------------------------------------------------------------

    def run_chains(self) -> list[dict[str, Any]]:
        """The chain study's cells (``--chains``), also appended to ``self.cells``."""
        if self.study is None:
            return []
        probes = {k: f for k, f in self._pids().items() if k in ("triton", "loadgen")}
        return self.study.run(self.measure, probes)

    def run(self) -> list[dict[str, Any]]:
        assert self.triton and self.mmguard
        rows: list[dict[str, Any]] = []
        concs = self.args.concurrency
        if self.args.chain_only:
            return rows
        for case in CASES:
            for proto in PROTOCOLS:
                for c in concs:
                    base = {"kind": proto, "case": case.key, "protocol": proto, "concurrency": c,
                            "shape": list(case.shape), "input": case.triton_in,
                            "output": case.triton_out, "op": case.op}
                    row = {"case": case.label, "case_key": case.key, "protocol": proto,
                           "concurrency": c, "backend": "triton"}
                    print(f"{case.label} {proto} c={c} -> Triton", flush=True)
                    triton_addr = self.triton.grpc_url if proto == "grpc" else self.triton.http_url
                    row["direct"] = self.measure(
                        {**base, "target": "direct", "addr": triton_addr,
                         "model": case.triton_model}, "direct Triton")
                    if self.nginx:
                        row["nginx"] = self.measure(
                            {**base, "target": "nginx",
                             "addr": f"127.0.0.1:{self.nginx.ports[proto]}",
                             "model": case.triton_model}, "nginx -> Triton")
                    route = case.triton_model if proto == "grpc" else case.http_route
                    row["mmguard"] = self.measure(
                        {**base, "target": "mmguard",
                         "addr": f"127.0.0.1:{self.mmguard.ports[proto]}", "model": route},
                        f"mmguard -> triton_{proto}")
                    if self.floor:
                        row["floor"] = self.measure(
                            {**base, "target": "floor",
                             "addr": f"127.0.0.1:{self.floor.ports[proto]}", "model": route},
                            "bare Python pass-through -> Triton")
                    rows.append(row)
        if not self.args.no_ort:
            for case in CASES:
                for proto in PROTOCOLS:
                    for c in concs:
                        print(f"{case.label} {proto} c={c} -> ONNX Runtime", flush=True)
                        base = {"case": case.key, "concurrency": c, "shape": list(case.shape),
                                "input": ORT_IN, "output": ORT_OUT, "op": "identity",
                                "model": case.ort_model}
                        row = {"case": case.label, "case_key": case.key, "protocol": proto,
                               "concurrency": c, "backend": "onnxruntime"}
                        key = (case.key, c)
                        if key not in self._ort_direct:
                            self._ort_direct[key] = self.measure(
                                {**base, "kind": "ort", "protocol": "inprocess",
                                 "target": "direct", "addr": "",
                                 "onnx_path": str(self.ort_paths[case.ort_model])},
                                "in-process session.run" if c == 1 else
                                f"in-process session.run, {self.args.ort_threads}-thread pool")
                        else:
                            print(f"  (direct: same as measured above, "
                                  f"{self._ort_direct[key]['rps']:.0f} req/s)", flush=True)
                        row["direct"] = self._ort_direct[key]
                        row["mmguard"] = self.measure(
                            {**base, "kind": proto, "protocol": proto, "target": "mmguard",
                             "addr": f"127.0.0.1:{self.mmguard.ports[proto]}"},
                            f"mmguard {proto} -> onnxruntime")
                        rows.append(row)
        return rows


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def _cell_line(cell: dict[str, Any]) -> str:
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


def _table(summary: list[dict[str, Any]], md: bool) -> str:
    columns = SUMMARY_COLUMNS[:-1]
    if any(s.get("floor_rps") is not None for s in summary):
        columns += FLOOR_COLUMNS
    columns.append(SUMMARY_COLUMNS[-1])
    head = [c[0] for c in columns]
    body = [[str(s[k]) if spec is None else fmt(s[k], spec) for _, k, spec in columns]
            for s in summary]
    return render_table(head, body, md)


def _detail_md(cells: list[dict[str, Any]]) -> str:
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


def _machine_line(m: dict[str, Any]) -> str:
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
    table = _table(summary, md=False) if summary else "(no direct / nginx / mmguard rows)"
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
        _machine_line(info), "",
        f"`{' '.join(['python', 'bench/bench_proxy.py', *sys.argv[1:]])}` — {elapsed:.0f} s, "
        f"mmguard at {git_line(info)}", "",
        *(["## Summary", "", _table(summary, md=True), "", *notes, ""] if summary else []),
        *(["## The chain's price", "", chain_table(chain_rows, md=True), "",
           *chain_notes(args.chain_concurrency, args.chain_rounds), ""] if chain_rows else []),
        "## Every cell", "", _detail_md(cells), "",
    ])
    (out / "results.md").write_text(md)
    return table


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per cell (5)")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per cell (1)")
    p.add_argument("--concurrency", default="1,16",
                   help="comma-separated in-flight request counts (1,16)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out", help="results folder")
    p.add_argument("--ort-threads", type=int, default=2,
                   help="mmguard's onnxruntime backend threads (and the direct pool's) (2)")
    p.add_argument("--mmguard-log-level", default="warning",
                   choices=("debug", "info", "warning", "error"))
    p.add_argument("--no-nginx", action="store_true", help="skip the nginx baseline")
    p.add_argument("--no-ort", action="store_true", help="skip the ONNX Runtime rows")
    p.add_argument("--floor", action="store_true",
                   help="also measure bench/passthrough_proxy.py (bare grpc.aio/aiohttp "
                        "pass-through: the floor for a Python proxy) on the Triton rows")
    p.add_argument("--keep-tmp", action="store_true",
                   help="keep the temp dir (configs, server logs) and print its path")
    g = p.add_argument_group("the full chain's price (bench/chain_study.py)")
    g.add_argument("--chains", default=",".join(DEFAULT_CHAINS),
                   help=f"chains to measure on the 600 KB case, comma-separated, from "
                        f"{','.join(STUDY)}; '' for none ({','.join(DEFAULT_CHAINS)})")
    g.add_argument("--chain-study", action="store_true",
                   help="every chain: the default, one filter added at a time, full, full with "
                        "the shadow at 10 %% (overrides --chains)")
    g.add_argument("--chain-only", action="store_true",
                   help="measure only the chains (no direct / nginx / mmguard matrix)")
    g.add_argument("--chain-rounds", type=int, default=1,
                   help="rounds of every chain, interleaved; the median is reported (1)")
    g.add_argument("--chain-concurrency", type=int, default=16,
                   help="requests in flight in the chain cells (16)")
    args = p.parse_args(argv)
    try:
        args.chains = list(STUDY) if args.chain_study else parse_chains(args.chains)
    except ValueError as exc:
        p.error(f"--chains: {exc}")
    if args.chain_only and not args.chains:
        p.error("--chain-only needs chains to measure")
    if args.chain_rounds < 1 or args.chain_concurrency < 1:
        p.error("--chain-rounds and --chain-concurrency take positive integers")
    try:
        args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError:
        p.error("--concurrency takes integers, e.g. 1,16")
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency takes positive integers")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.no_nginx and shutil.which("nginx") is None:
        print("nginx is not installed (it is the baseline proxy). Install it with\n"
              "    apt-get update && apt-get install -y nginx\n"
              "or run with --no-nginx.", file=sys.stderr)
        return 2

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    info = machine_info(DISTS)
    print(_machine_line(info), flush=True)
    busy_before(info)
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="mmguard-bench-"))
    bench = Bench(args)
    try:
        bench.start(tmp)
        meta = http_json(f"http://{bench.triton.http_url}/v2")
        if meta:
            info["versions"]["triton"] = meta.get("version", "?")
        rows = bench.run()
        chain_rows = summarize(bench.run_chains())
        assert bench.mmguard is not None
        elapsed = time.monotonic() - began
        configs = {"mmguard": bench.mmguard.config,
                   **({"chains": bench.study.mmguard.config}
                      if bench.study and bench.study.mmguard else {})}
        table = write_reports(args.out, info, args, rows, bench.cells, configs, elapsed,
                              chain_rows)
        print()
        print(_machine_line(info))
        print(f"duration {args.duration:g}s + warm-up {args.warmup:g}s per cell, "
              f"{len(bench.cells)} cells, {elapsed:.0f}s in all")
        print()
        print(table)
        if chain_rows:
            print()
            print(chain_table(chain_rows, md=False))
        print()
        print(f"written: {args.out / 'results.json'}, {args.out / 'results.md'}")
        return report_problems(bench.cells, "results.md", _cell_line)
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every process ...", file=sys.stderr)
        return 130
    finally:
        shut_down(bench.stop, tmp, args.keep_tmp)


if __name__ == "__main__":
    sys.exit(main())
