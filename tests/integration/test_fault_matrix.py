"""The fault matrix (issue #11, part 1): one table of scenarios over real backends — a backend
killed, hung, slow, resetting its connections, answering truncated, NaN or malformed output; the
config reloaded under load; a dead canary; every fallback level down — each driven by the same
mixed gRPC/HTTP load and judged by one checker.

For every request the checker accepts exactly one of: (a) the right answer, byte for byte; (b) an
answer marked ``mmguard-fallback-level`` that is right for that level (L2: the lighter model's
answer, L3: the cached L1 answer marked stale, or the static answer); (c) a clear refusal: the
error kind the scenario allows, with the code and status of ``proxy.errors.STATUS``, and a
message that names the model or backend and the cause. Anything else — an unmarked wrong answer,
a transport exception, an answer past the client's deadline plus ``SLACK_S`` — fails. The
outcomes must add up to the requests sent (none lost) and agree with mmguard's own
``mmguard_requests_total``. A last test runs the heaviest scenario against mmguard as a process
for a few thousand requests and bounds its RSS growth.

Real servers everywhere (Triton from nvidia-pytriton, in-process ONNX Runtime, a real TCP
forwarder that resets connections); ``FakeV2`` only for what no real server does on cue: hang,
answer a payload shorter than its shape, answer bytes that are not a v2 response.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import struct
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import pytest
import yaml
from numpy.typing import NDArray
from onnx import TensorProto, helper
from prometheus_client.parser import text_string_to_metric_families

from proxy.cli.demo_model import ensure_clip_demo
from proxy.errors import STATUS
from proxy.pb import grpc_service_pb2 as pb
from tests.support.fake_v2 import FakeV2
from tests.support.loop import BackgroundLoop
from tests.support.mmguard import RunningMmguard
from tests.support.process import MmguardProcess
from tests.support.triton import TritonServer, write_model_repository
from tests.support.wire import INFER, grpc_request

SLACK_S = 2.0  # a deadline check, not a speed test: an answer may come this late, no later
THREADS = 4
GRPC_CODE_KIND = {s.grpc: k.value for k, s in reversed(STATUS.items())}
HTTP_STATUS_KIND = {s.http: k.value for k, s in STATUS.items()}
BAD = ("WRONG", "UNCLEAR", "EXCEPTION")
STATIC = np.full((1, 16), -7.5, np.float32)
Array = NDArray[np.float32]


# --- the models -------------------------------------------------------------------------------


def double(x: Array) -> Array:  # small_fp32 on Triton, ``double`` on ONNX Runtime
    return (x * np.float32(2)).astype(np.float32)


def same(x: Array) -> Array:  # slow_fp32 on Triton, echo on FakeV2
    return x


def negate(x: Array) -> Array:  # ``negate`` on ONNX Runtime
    return -x


def write_onnx(model_dir: Path, name: str, op: str, inp: str, out: str,
               dims: list[Any], const: float | None = None) -> None:
    inits, names = [], [inp]
    if const is not None:
        inits = [helper.make_tensor("k", TensorProto.FLOAT, [], [const])]
        names.append("k")
    graph = helper.make_graph(
        [helper.make_node(op, names, [out])], name,
        [helper.make_tensor_value_info(inp, TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, dims)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = model_dir / name / "1" / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)


@dataclass
class Env:
    root: Path
    ort: Path
    repo: Path
    request: pytest.FixtureRequest

    @property
    def triton(self) -> TritonServer:
        """The session's Triton, for scenarios that neither kill nor reload it."""
        server: TritonServer = self.request.getfixturevalue("triton")
        return server

    @contextmanager
    def own_triton(self, name: str, models: list[str]) -> Iterator[TritonServer]:
        """A Triton of the scenario's own, to kill."""
        server = TritonServer(self.repo, self.root / name, load_models=models)
        try:
            yield server.start()
        finally:
            server.stop()  # after a SIGKILL: the group's leftovers and shm regions go

    def ort_backend(self) -> dict[str, Any]:
        return {"kind": "onnxruntime", "name": "ort", "model_dir": str(self.ort), "threads": 1}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Env:
    root = tmp_path_factory.mktemp("fault_matrix")
    ort = root / "ort"
    # L2 answers differ from L1's, so an L2 answer passed off as L1's is caught as wrong.
    write_onnx(ort, "double", "Mul", "x", "y", ["n", 16], const=2.0)
    write_onnx(ort, "negate", "Neg", "INPUT0", "OUTPUT0", ["m"])
    repo = write_model_repository(root / "repo", ensure_clip_demo(root / "onnx"))
    return Env(root, ort, repo, request)


# --- a TCP forwarder that resets its connections -------------------------------------------------


class ResettingProxy:
    """Forwards 127.0.0.1:port to an upstream over real sockets; ``reset_all`` drops every
    connection it holds with an RST to the client side (SO_LINGER 0), as a crashing sidecar or
    a load balancer does."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.resets = 0
        self._loop = BackgroundLoop()
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._server = self._loop.run(self._start())
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            _abort(writer)
            return
        conn = (writer, up_writer)
        self._conns.add(conn)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                if not dst.is_closing():
                    dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._conns.discard(conn)

    def reset_all(self) -> None:
        async def reset() -> None:
            for client, upstream in list(self._conns):
                _abort(client)
                _abort(upstream)
            self._conns.clear()
            self.resets += 1

        self._loop.run(reset())

    def close(self) -> None:
        async def close() -> None:
            self._server.close()
            for client, upstream in list(self._conns):
                _abort(client)
                _abort(upstream)

        self._loop.run(close())
        self._loop.close()
        self._loop.loop.close()


def _abort(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


# --- a stage: what one scenario sets up ---------------------------------------------------------


@dataclass
class Stage:
    config: dict[str, Any]
    route: str
    answers: dict[str, Callable[[Array], Array]]
    """Level ("1", "2", "3") → the right output for an input; L3 answers must be marked stale."""
    errors: dict[str, str] = field(default_factory=dict)
    """Error kind → regex its message must match (naming the model or backend, and the cause)."""
    allowed: set[str] = field(default_factory=lambda: {"ok"})
    required: set[str] = field(default_factory=set)
    wait_routes: tuple[str, ...] = ()
    during: Callable[[Endpoints, Progress], None] | None = None
    """Runs beside the load (kill, reload, reset); marks the moment the fault starts."""
    inputs: tuple[str, str] = ("x", "y")
    shape: tuple[int, ...] = (1, 16)
    extra: Callable[[int], list[tuple[str, str, list[int], bytes]]] = lambda i: []
    canary: Callable[[int], bool] = lambda i: False
    key: Callable[[int], int] = lambda i: i
    warm_keys: tuple[int, ...] = ()
    """Keys asked once (gRPC) before the load and the metrics snapshot: they must be answered."""
    deadline_s: float = 5.0
    per_thread: int = 30
    config_path: Path | None = None
    checks: Callable[[Endpoints], None] | None = None


@dataclass(frozen=True)
class Endpoints:
    grpc: str
    http: str
    admin: str
    reload: Callable[[], bool] | None = None


class Progress:
    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.fault_at: float | None = None
        self.finished = threading.Event()
        self._cond = threading.Condition()

    def tick(self) -> None:
        with self._cond:
            self.done += 1
            self._cond.notify_all()

    def wait_done(self, share: float, timeout: float = 60) -> bool:
        """Until ``share`` of the requests have ended; False if the load ended first."""
        with self._cond:
            return self._cond.wait_for(lambda: self.done >= share * self.total
                                       or self.finished.is_set(), timeout) \
                and not self.finished.is_set()

    def fault(self) -> None:
        if self.fault_at is None:
            self.fault_at = time.monotonic()

    def finish(self) -> None:
        with self._cond:
            self.finished.set()
            self._cond.notify_all()


@dataclass
class Outcome:
    index: int
    front: str
    kind: str  # ok | L2 | L3 | error:<kind> | WRONG | UNCLEAR | EXCEPTION
    detail: str
    started: float
    ended: float
    deadline_s: float

    @property
    def late(self) -> bool:
        return self.ended - self.started > self.deadline_s + SLACK_S


# --- the scenarios --------------------------------------------------------------------------------

Setup = Callable[[Env], AbstractContextManager[Stage]]


def fallback(degrade_to: list[str], **extra: Any) -> dict[str, Any]:
    return {"fallback": {"degrade_to": degrade_to, "breaker": {"minimum_calls": 3,
                                                              "wait_in_open_s": 0.5},
                         "cache": None, **extra}}


def kill_after(server: TritonServer, share: float = 0.3) -> Callable[[Endpoints, Progress], None]:
    def during(_: Endpoints, progress: Progress) -> None:
        if progress.wait_done(share):
            assert server.pid is not None
            progress.fault()
            os.killpg(server.pid, signal.SIGKILL)  # the server and its model stubs, at once

    return during


@contextmanager
def killed_with_fallback(env: Env) -> Iterator[Stage]:
    with env.own_triton("killed_fb", ["small_fp32"]) as victim:
        yield Stage(
            config={"backends": [{"kind": "triton_grpc", "name": "victim",
                                  "url": victim.grpc_url, "timeout_s": 5},
                                 {"kind": "triton_grpc", "name": "light",
                                  "url": env.triton.grpc_url, "timeout_s": 5}],
                    "models": [{"name": "clf", "backend": "victim", "backend_model": "small_fp32",
                                "filters": [fallback(["clf_light"])]},
                               {"name": "clf_light", "backend": "light",
                                "backend_model": "slow_fp32"}]},
            route="clf", answers={"1": double, "2": same}, allowed={"ok", "L2"},
            required={"ok", "L2"}, wait_routes=("clf", "clf_light"), during=kill_after(victim))


@contextmanager
def killed_alone(env: Env) -> Iterator[Stage]:
    with env.own_triton("killed", ["small_fp32"]) as victim:
        yield Stage(
            config={"backends": [{"kind": "triton_http", "name": "victim",
                                  "url": victim.http_url, "timeout_s": 5}],
                    "models": [{"name": "clf", "backend": "victim", "backend_model": "small_fp32",
                                "filters": []}]},
            route="clf", answers={"1": double},
            errors={"unavailable": r"backend 'victim' \(http://127\.0\.0\.1:\d+\) is unavailable "
                                   r"for model 'small_fp32': \w+"},
            allowed={"ok", "error:unavailable"}, required={"ok", "error:unavailable"},
            wait_routes=("clf",), during=kill_after(victim))


@contextmanager
def hung(env: Env, *, kind: str, route_timeout: float | None) -> Iterator[Stage]:
    with FakeV2() as fake:
        fake.hang = True  # takes every call, answers none
        port = fake.grpc_port if kind == "triton_grpc" else fake.http_port
        route: dict[str, Any] = {"name": "echo", "backend": "fake", "filters": []}
        if route_timeout is not None:
            route["timeout_s"] = route_timeout
        yield Stage(
            config={"backends": [{"kind": kind, "name": "fake", "url": f"127.0.0.1:{port}"}],
                    "models": [route]},
            route="echo", answers={"1": same}, inputs=("INPUT0", "OUTPUT0"), shape=(16,),
            errors={"deadline_exceeded": r"backend 'fake' did not answer model 'echo' within "
                                         r"\d+ ms"},
            allowed={"error:deadline_exceeded"}, required={"error:deadline_exceeded"},
            wait_routes=("echo",), deadline_s=0.6 if route_timeout is None else 5.0,
            per_thread=4)


def slow_delay(ms: int) -> Callable[[int], list[tuple[str, str, list[int], bytes]]]:
    return lambda i: [("delay_ms", "INT32", [1, 1], np.array([ms], "<i4").tobytes())]


@contextmanager
def slow(env: Env, *, filters: list[dict[str, Any]], delay_ms: int, levels: set[str],
         checks: Callable[[Endpoints], None] | None = None) -> Iterator[Stage]:
    yield Stage(
        config={"backends": [{"kind": "triton_grpc", "name": "t", "url": env.triton.grpc_url},
                             env.ort_backend()],
                "models": [{"name": "slow", "backend": "t", "backend_model": "slow_fp32",
                            "filters": filters},
                           {"name": "slow_light", "backend": "ort", "backend_model": "double"}]},
        route="slow", answers={"1": same, "2": double}, allowed=levels, required=levels,
        wait_routes=("slow", "slow_light"), extra=slow_delay(delay_ms), per_thread=12,
        checks=checks)


def resetting(every: float) -> Callable[[ResettingProxy], Callable[[Endpoints, Progress], None]]:
    def make(proxy: ResettingProxy) -> Callable[[Endpoints, Progress], None]:
        def during(_: Endpoints, progress: Progress) -> None:
            share = every
            while progress.wait_done(share):
                progress.fault()
                proxy.reset_all()
                share += every

        return during

    return make


@contextmanager
def resets(env: Env, *, kind: str, with_fallback: bool) -> Iterator[Stage]:
    upstream = env.triton.grpc_url if kind == "triton_grpc" else env.triton.http_url
    proxy = ResettingProxy(upstream)
    try:
        url = proxy.url if kind == "triton_grpc" else f"http://{proxy.url}"
        cfg: dict[str, Any] = {
            "backends": [{"kind": kind, "name": "flaky", "url": url, "timeout_s": 5},
                         {"kind": "triton_grpc", "name": "t", "url": env.triton.grpc_url}],
            "models": [{"name": "clf", "backend": "flaky", "backend_model": "small_fp32",
                        "filters": [fallback(["clf_light"])] if with_fallback else []},
                       {"name": "clf_light", "backend": "t", "backend_model": "slow_fp32"}]}
        shown = re.escape(url)
        allowed = {"ok", "L2"} if with_fallback else {"ok", "error:unavailable"}
        yield Stage(
            config=cfg, route="clf", answers={"1": double, "2": same},
            errors={"unavailable": rf"backend 'flaky' \({shown}\) is unavailable for model "
                                   r"'small_fp32': .+"},
            allowed=allowed, required=allowed, wait_routes=("clf", "clf_light"),
            during=resetting(0.08)(proxy), per_thread=40,
            checks=lambda _: _assert(proxy.resets >= 5, f"only {proxy.resets} resets"))
    finally:
        proxy.close()


@contextmanager
def broken_answers(env: Env, *, cue: str, kind: str, filters: list[dict[str, Any]],
                   allowed: set[str], errors: dict[str, str]) -> Iterator[Stage]:
    with FakeV2() as fake:
        port = fake.grpc_port if kind == "triton_grpc" else fake.http_port
        yield Stage(
            config={"backends": [{"kind": kind, "name": "fake", "url": f"127.0.0.1:{port}"},
                                 env.ort_backend()],
                    "models": [{"name": "echo", "backend": "fake", "filters": filters},
                               {"name": "echo_light", "backend": "ort",
                                "backend_model": "negate"}]},
            route="echo", answers={"1": same, "2": negate}, inputs=("INPUT0", "OUTPUT0"),
            shape=(16,), errors=errors, allowed=allowed, required=allowed,
            wait_routes=("echo", "echo_light"),
            during=lambda _, progress: cue_after(progress, fake, cue), per_thread=10)


def cue_after(progress: Progress, fake: FakeV2, cue: str, share: float = 0.3) -> None:
    if progress.wait_done(share):
        progress.fault()
        setattr(fake, cue, True)


@contextmanager
def output_fault(env: Env, action: dict[str, Any]) -> Iterator[Stage]:
    """A real model's answer corrupted on canary traffic (half the requests, on both fronts),
    inside the fallback: the corrupted L1 answer must never reach the client; L2 answers."""
    experiment = {"name": action["kind"], "actions": [action],
                  "stop": {"max_error_rate": None, "max_p99_ms": None}}
    yield Stage(
        config={"backends": [{"kind": "triton_grpc", "name": "t", "url": env.triton.grpc_url}],
                "canary": {"headers": {"x-canary": "1"}},
                "listeners": {"grpc": {"trust_canary_headers": True},
                              "http": {"trust_canary_headers": True}},
                "models": [{"name": "clf", "backend": "t", "backend_model": "small_fp32",
                            "filters": [fallback(["clf_light"]),
                                        {"fault": {"experiments": [experiment]}}]},
                           {"name": "clf_light", "backend": "t", "backend_model": "slow_fp32"}]},
        route="clf", answers={"1": double, "2": same}, allowed={"ok", "L2"},
        required={"ok", "L2"}, wait_routes=("clf", "clf_light"),
        canary=lambda i: i % 4 in (1, 2))  # both fronts: the fronts alternate with i


RELOADS = 12
BROKEN_AT = 6  # this reload reads a broken file: refused, the running config keeps serving


def reload_config(env: Env, variant: int) -> dict[str, Any]:
    """Each variant differs from the one before it in the backend (so a reload builds a new
    one: gRPC twice as often as HTTP) and in the chain."""
    t = env.triton
    timeout = 5 + variant % 2
    backend = ({"kind": "triton_http", "name": "t", "url": t.http_url, "timeout_s": timeout}
               if variant % 3 == 1 else
               {"kind": "triton_grpc", "name": "t", "url": t.grpc_url, "timeout_s": timeout})
    filters = ([{"limits": {"max_in_flight": 64}}] if variant % 2 == 0
               else [{"fallback": {"cache": None}}, {"shape_guard": {}}])
    return {"backends": [backend], "shutdown_grace_s": 1.0,
            "models": [{"name": "clf", "backend": "t", "backend_model": "small_fp32",
                        "filters": filters}]}


@contextmanager
def reloads(env: Env) -> Iterator[Stage]:
    path = env.root / "reload.yaml"
    path.write_text(yaml.safe_dump(reload_config(env, 0)))
    results: list[bool] = []

    def during(m: Endpoints, progress: Progress) -> None:
        assert m.reload is not None
        for n in range(1, RELOADS + 1):
            if not progress.wait_done(n / (RELOADS + 2)):
                break
            progress.fault()
            path.write_text("models: [{name: clf}]\n" if n == BROKEN_AT else
                            yaml.safe_dump(reload_config(env, n)))
            results.append(m.reload())

    expected = [n != BROKEN_AT for n in range(1, RELOADS + 1)]
    yield Stage(config=reload_config(env, 0), config_path=path, route="clf",
                answers={"1": double}, wait_routes=("clf",), during=during, per_thread=60,
                checks=lambda _: _assert(results == expected, f"reload results {results}"))


@contextmanager
def canary_down(env: Env) -> Iterator[Stage]:
    yield Stage(
        config={"backends": [{"kind": "triton_grpc", "name": "t", "url": env.triton.grpc_url},
                             {"kind": "triton_grpc", "name": "dead", "url": "127.0.0.1:1"}],
                "models": [{"name": "clf", "backend": "t", "backend_model": "small_fp32",
                            "filters": [{"shadow": {"canary": "clf_canary", "timeout_s": 1}}]},
                           {"name": "clf_canary", "backend": "dead",
                            "backend_model": "small_fp32"}]},
        route="clf", answers={"1": double}, wait_routes=("clf",),
        checks=counted("mmguard_shadow_mirrored_total", model="clf", canary="clf_canary"))


EVERY_LEVEL = r"model 'clf': no level could answer: L1 'clf': .+; L2 'clf_light': .+"


@contextmanager
def all_down_from_start(env: Env, *, static: bool) -> Iterator[Stage]:
    extra: dict[str, Any] = {}
    if static:
        extra["static_answer"] = [{"name": "y", "datatype": "FP32", "shape": [1, 16],
                                   "data": STATIC.reshape(-1).tolist()}]
    yield Stage(
        config={"backends": [{"kind": "triton_grpc", "name": "dead1", "url": "127.0.0.1:1"},
                             {"kind": "triton_http", "name": "dead2", "url": "127.0.0.1:1"}],
                "models": [{"name": "clf", "backend": "dead1", "backend_model": "small_fp32",
                            "filters": [fallback(["clf_light"], **extra)]},
                           {"name": "clf_light", "backend": "dead2",
                            "backend_model": "slow_fp32"}]},
        route="clf", answers={"1": double, "3": lambda x: STATIC},
        errors={"unavailable": EVERY_LEVEL},
        allowed={"L3"} if static else {"error:unavailable"},
        required={"L3"} if static else {"error:unavailable"}, per_thread=15)


@contextmanager
def all_down_with_cache(env: Env) -> Iterator[Stage]:
    """L1 and L2 on one Triton, killed: cached requests get L1's last answer (L3, stale), the
    others a refusal naming both levels."""
    with env.own_triton("all_down", ["small_fp32", "slow_fp32"]) as victim:
        yield Stage(
            config={"backends": [{"kind": "triton_grpc", "name": "victim",
                                  "url": victim.grpc_url, "timeout_s": 5}],
                    "models": [{"name": "clf", "backend": "victim", "backend_model": "small_fp32",
                                "filters": [fallback(["clf_light"],
                                                     cache={"size": 100, "ttl_s": 300})]},
                               {"name": "clf_light", "backend": "victim",
                                "backend_model": "slow_fp32"}]},
            route="clf", answers={"1": double, "2": same, "3": double},
            errors={"unavailable": EVERY_LEVEL},
            allowed={"ok", "L3", "error:unavailable"},
            required={"ok", "L3", "error:unavailable"}, wait_routes=("clf", "clf_light"),
            key=lambda i: i % 8 if i % 3 else 1000 + i, warm_keys=tuple(range(8)),
            during=kill_after(victim))


@contextmanager
def everything(env: Env) -> Iterator[Stage]:
    """The heaviest: L1 behind a forwarder that resets its connections, L2 on another path, a
    cache that keeps filling (most requests are new), NaN injected into a third of the answers
    (canary), and every call mirrored to a canary that is down."""
    proxy = ResettingProxy(env.triton.grpc_url)
    experiment = {"name": "nan", "actions": [{"kind": "nan_output"}],
                  "stop": {"max_error_rate": None, "max_p99_ms": None}}

    def exercised(m: Endpoints) -> None:
        counted("mmguard_shadow_mirrored_total", model="clf", canary="clf_canary")(m)
        assert proxy.resets >= 5, f"only {proxy.resets} resets"

    try:
        yield Stage(
            config={"backends": [{"kind": "triton_grpc", "name": "flaky", "url": proxy.url,
                                  "timeout_s": 5},
                                 {"kind": "triton_http", "name": "t",
                                  "url": env.triton.http_url},
                                 {"kind": "triton_grpc", "name": "dead", "url": "127.0.0.1:1"}],
                    "canary": {"headers": {"x-canary": "1"}},
                    "listeners": {"grpc": {"trust_canary_headers": True},
                                  "http": {"trust_canary_headers": True}},
                    "models": [{"name": "clf", "backend": "flaky", "backend_model": "small_fp32",
                                "filters": [{"limits": {"max_in_flight": 64}},
                                            # never an abort verdict: mirroring and the
                                            # NaN experiment go on to the end
                                            {"shadow": {"canary": "clf_canary", "timeout_s": 1,
                                                        "verdict": {"abort_agreement": 0.0,
                                                                    "max_latency_ratio": None}}},
                                            fallback(["clf_light"],
                                                     cache={"size": 200, "ttl_s": 300}),
                                            {"shape_guard": {}},
                                            {"fault": {"experiments": [experiment]}}]},
                               {"name": "clf_light", "backend": "t",
                                "backend_model": "slow_fp32"},
                               {"name": "clf_canary", "backend": "dead",
                                "backend_model": "small_fp32"}]},
            route="clf", answers={"1": double, "2": same, "3": double},
            errors={"unavailable": EVERY_LEVEL}, allowed={"ok", "L2", "L3", "error:unavailable"},
            required={"ok", "L2"}, wait_routes=("clf", "clf_light"),
            canary=lambda i: i % 3 == 1, key=lambda i: i % 50 if i % 5 == 0 else i,
            during=resetting(0.1)(proxy), per_thread=40, checks=exercised)
    finally:
        proxy.close()


def _assert(cond: bool, message: str) -> None:
    assert cond, message


GARBLE_INTERNAL = (r"model 'echo' answered outside its contract: .*FP32 shape \[16\] needs 64 "
                   r"bytes, got 60")
MALFORMED = r"backend 'fake' .*model 'echo'.*malformed"

SCENARIOS: list[tuple[str, Setup, bool]] = [
    ("killed-with-fallback", killed_with_fallback, True),
    ("killed-without-fallback", killed_alone, True),
    ("hung-route-timeout-grpc", lambda e: hung(e, kind="triton_grpc", route_timeout=0.5), False),
    ("hung-client-deadline-http", lambda e: hung(e, kind="triton_http", route_timeout=None),
     False),
    ("hung-client-deadline-grpc", lambda e: hung(e, kind="triton_grpc", route_timeout=None),
     False),
    ("slow", lambda e: slow(e, filters=[], delay_ms=15, levels={"ok"}), True),
    ("slow-hedged", lambda e: slow(
        e, filters=[{"fallback": {"hedge_after_s": 0.01, "cache": None}}], delay_ms=15,
        levels={"ok"}, checks=counted("mmguard_filter_decisions_total", filter="fallback",
                                      model="slow", decision="hedge:hedge")), True),
    ("slow-past-level-timeout", lambda e: slow(e, filters=[fallback(["slow_light"],
                                                                    level_timeout_s=0.1)],
                                               delay_ms=400, levels={"L2"}), True),
    ("resets-grpc", lambda e: resets(e, kind="triton_grpc", with_fallback=False), True),
    ("resets-http-with-fallback", lambda e: resets(e, kind="triton_http", with_fallback=True),
     True),
    ("truncated-guarded", lambda e: broken_answers(
        e, cue="garble", kind="triton_grpc", filters=[{"shape_guard": {}}],
        allowed={"ok", "error:internal", "error:bad_gateway"},
        errors={"internal": GARBLE_INTERNAL, "bad_gateway": GARBLE_INTERNAL}), False),
    ("truncated-guarded-with-fallback", lambda e: broken_answers(
        e, cue="garble", kind="triton_grpc", filters=[fallback(["echo_light"]),
                                                      {"shape_guard": {}}],
        allowed={"ok", "L2"}, errors={}), False),
    ("truncated-fallback-only", lambda e: broken_answers(
        e, cue="garble", kind="triton_grpc", filters=[fallback(["echo_light"])],
        allowed={"ok", "L2"}, errors={}), False),
    ("malformed-grpc", lambda e: broken_answers(
        e, cue="malformed", kind="triton_grpc", filters=[],
        allowed={"ok", "error:internal", "error:bad_gateway"},
        errors={"internal": MALFORMED, "bad_gateway": MALFORMED}), False),
    ("malformed-http-with-fallback", lambda e: broken_answers(
        e, cue="malformed", kind="triton_http", filters=[fallback(["echo_light"])],
        allowed={"ok", "L2"}, errors={}), False),
    ("nan-output-canary", lambda e: output_fault(e, {"kind": "nan_output", "share": 0.25}), True),
    ("truncated-output-canary", lambda e: output_fault(e, {"kind": "truncate_output",
                                                           "keep": 0.5}), True),
    ("config-reloaded-under-load", reloads, True),
    ("canary-down", canary_down, True),
    ("every-level-down", lambda e: all_down_from_start(e, static=False), False),
    ("every-level-down-static", lambda e: all_down_from_start(e, static=True), False),
    ("every-level-down-cache", all_down_with_cache, True),
    ("everything-at-once", everything, True),
]


# --- the load -------------------------------------------------------------------------------------


def payload(stage: Stage, i: int) -> Array:
    key = stage.key(i)
    return ((np.arange(16, dtype=np.float32) + 16 * key) / np.float32(7)).reshape(stage.shape)


def tensors(stage: Stage, i: int) -> list[tuple[str, str, list[int], bytes]]:
    x = payload(stage, i)
    return [(stage.inputs[0], "FP32", list(x.shape), x.tobytes()), *stage.extra(i)]


class Client:
    """One load thread's connections: a gRPC channel and a keep-alive HTTP connection."""

    def __init__(self, m: Endpoints, stage: Stage) -> None:
        self.m, self.stage = m, stage
        self.channel = grpc.insecure_channel(m.grpc)
        self.infer = self.channel.unary_unary(INFER)
        self.http: http.client.HTTPConnection | None = None

    def close(self) -> None:
        self.channel.close()
        if self.http is not None:
            self.http.close()

    def call(self, i: int, front: str) -> tuple[str, str]:
        """(kind, detail) for request ``i``."""
        try:
            if front == "grpc":
                return self._grpc(i)
            return self._http(i)
        except Exception as exc:  # a transport failure the client was not told about clearly
            if self.http is not None:
                self.http.close()
                self.http = None
            return "EXCEPTION", f"{type(exc).__name__}: {exc}"

    def _metadata(self, i: int) -> tuple[tuple[str, str], ...]:
        return (("x-canary", "1"),) if self.stage.canary(i) else ()

    def _grpc(self, i: int) -> tuple[str, str]:
        body = grpc_request(self.stage.route, tensors(self.stage, i))
        try:
            raw, call = self.infer.with_call(body, timeout=self.stage.deadline_s,
                                             metadata=self._metadata(i))
        except grpc.RpcError as err:
            kind = GRPC_CODE_KIND.get(err.code())
            trailers = dict(err.trailing_metadata() or ())
            return self._refusal(kind, err.details() or "", trailers,
                                 client_deadline=err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                                 and "mmguard-error-origin" not in trailers)
        resp = pb.ModelInferResponse.FromString(raw)
        outs = {o.name: (o.datatype, list(o.shape), bytes(resp.raw_output_contents[j]))
                for j, o in enumerate(resp.outputs)}
        return self._answer(i, outs, dict(call.trailing_metadata() or ()))

    def _http(self, i: int) -> tuple[str, str]:
        ts = tensors(self.stage, i)
        head = {"inputs": [{"name": n, "datatype": dt, "shape": s,
                            "parameters": {"binary_data_size": len(raw)}}
                           for n, dt, s, raw in ts],
                "parameters": {"binary_data_output": True}}
        header = json.dumps(head).encode()
        headers = {"Inference-Header-Content-Length": str(len(header)),
                   "Content-Type": "application/octet-stream",
                   "mmguard-timeout-ms": str(int(self.stage.deadline_s * 1000)),
                   **dict(self._metadata(i))}
        if self.http is None:
            host, port = self.m.http.split(":")
            self.http = http.client.HTTPConnection(host, int(port),
                                                   timeout=self.stage.deadline_s + SLACK_S)
        self.http.request("POST", f"/v2/models/{self.stage.route}/infer",
                          body=header + b"".join(raw for *_, raw in ts), headers=headers)
        r = self.http.getresponse()
        body = r.read()
        got = {k.lower(): v for k, v in r.getheaders()}
        if r.status != 200:
            try:
                message = str(json.loads(body)["error"])
            except (ValueError, KeyError, TypeError):
                return "UNCLEAR", f"HTTP {r.status} with a body that is not an error: {body!r}"
            return self._refusal(HTTP_STATUS_KIND.get(r.status), message, got)
        hlen = int(got.get("inference-header-content-length", len(body)))
        doc = json.loads(body[:hlen])
        outs, offset = {}, hlen
        for o in doc.get("outputs", []):
            size = o.get("parameters", {}).get("binary_data_size")
            if size is None:
                return "WRONG", f"output {o['name']} not in binary: {o}"
            outs[o["name"]] = (o["datatype"], o["shape"], body[offset:offset + size])
            offset += size
        if offset != len(body):
            return "WRONG", f"{len(body) - offset} bytes after the last output"
        return self._answer(i, outs, got)

    def _answer(self, i: int, outs: dict[str, tuple[str, list[int], bytes]],
                meta: dict[str, str]) -> tuple[str, str]:
        level = meta.get("mmguard-fallback-level", "1").split(";")[0]
        stale = meta.get("mmguard-stale") == "true"
        if level not in self.stage.answers:
            return "WRONG", f"level {level!r} is not one this scenario has"
        want = self.stage.answers[level](payload(self.stage, i))
        expected = {self.stage.inputs[1]: ("FP32", list(want.shape), want.tobytes())}
        if outs != expected:
            return "WRONG", f"level {level} answer {outs!r}, expected {expected!r}"
        if stale != (level == "3"):
            return "WRONG", f"level {level} answer with mmguard-stale={stale}"
        return ("ok" if level == "1" else f"L{level}"), ""

    def _refusal(self, kind: str | None, message: str, meta: dict[str, str],
                 client_deadline: bool = False) -> tuple[str, str]:
        if kind is None:
            return "UNCLEAR", f"a code outside proxy.errors.STATUS: {message}"
        if client_deadline and message == "Deadline Exceeded":
            return "error:deadline_exceeded", "the client's own deadline"
        pattern = self.stage.errors.get(kind)
        if pattern is None or not re.search(pattern, message):
            return "UNCLEAR", f"{kind}: {message} (origin {meta.get('mmguard-error-origin')})"
        if meta.get("mmguard-error-origin") not in ("mmguard", "backend"):
            return "UNCLEAR", f"{kind} without mmguard-error-origin: {message}"
        return f"error:{kind}", message


def run_load(m: Endpoints, stage: Stage, per_thread: int | None = None) -> list[Outcome]:
    n = per_thread or stage.per_thread
    progress = Progress(THREADS * n)
    outcomes: list[Outcome] = []

    def worker(t: int) -> None:
        client = Client(m, stage)
        try:
            for k in range(n):
                i = t * n + k
                front = "grpc" if i % 2 == 0 else "http"
                start = time.monotonic()
                kind, detail = client.call(i, front)
                outcomes.append(Outcome(i, front, kind, detail, start, time.monotonic(),
                                        stage.deadline_s))
                progress.tick()
        finally:
            client.close()

    with ThreadPoolExecutor(THREADS + 1) as pool:
        action = pool.submit(stage.during, m, progress) if stage.during else None
        workers = [pool.submit(worker, t) for t in range(THREADS)]
        # none hung: each request ends by its deadline + slack, so the whole load by n of them
        bound = n * (stage.deadline_s + SLACK_S) + 30
        for w in workers:
            w.result(timeout=bound)
        progress.finish()
        if action is not None:
            action.result(timeout=60)
    for o in outcomes:  # before the fault began, only canary calls may be treated otherwise
        if (progress.fault_at is not None and o.ended < progress.fault_at and o.kind != "ok"
                and not stage.canary(o.index)):
            o.detail = f"before the fault: {o.kind} {o.detail}"
            o.kind = "WRONG"
    return outcomes


def samples(m: Endpoints, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """mmguard's own count ``name`` from its /metrics, the samples whose labels match."""
    text = urllib.request.urlopen(m.admin + "/metrics", timeout=10).read().decode()
    return [(s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def requests_by_code(m: Endpoints, route: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for labels, value in samples(m, "mmguard_requests_total", model=route):
        out[labels["code"]] += int(value)
    return out


def counted(name: str, **labels: str) -> Callable[[Endpoints], None]:
    """A check that mmguard counted ``name`` at least once: the scenario's path was taken."""
    def check(m: Endpoints) -> None:
        total = sum(value for _, value in samples(m, name, **labels))
        assert total > 0, f"mmguard never counted {name} {labels}"

    return check


def check(stage: Stage, outcomes: list[Outcome], sent: int, seen: Counter[str]) -> Counter[str]:
    """The one checker: every request answered right, answered marked, or refused clearly —
    in time, none lost, and counted by mmguard as the clients saw it."""
    kinds = Counter(o.kind for o in outcomes)
    bad = [o for o in outcomes if o.kind in BAD][:5]
    late = [o for o in outcomes if o.late][:5]
    assert len(outcomes) == sent, f"{sent - len(outcomes)} requests lost: {kinds}"
    assert not bad, f"{kinds}; e.g. " + "; ".join(f"#{o.index} {o.front} {o.kind}: {o.detail}"
                                                  for o in bad)
    assert not late, "past the deadline: " + "; ".join(
        f"#{o.index} {o.front} {o.kind} after {o.ended - o.started:.2f}s" for o in late)
    assert set(kinds) <= stage.allowed, f"outcomes {kinds}, allowed {stage.allowed}"
    assert stage.required <= set(kinds), f"outcomes {kinds}, required {stage.required}"
    mine: Counter[str] = Counter()
    for kind, count in kinds.items():
        mine["ok" if not kind.startswith("error:") else kind.removeprefix("error:")] += count
    # gRPC has no code of its own for a bad gateway: its clients see INTERNAL (HTTP ones 502)
    seen, mine = _grpc_view(seen), _grpc_view(mine)
    assert +seen == +mine, f"mmguard counted {dict(seen)}, the clients saw {dict(mine)}"
    return kinds


def _grpc_view(counts: Counter[str]) -> Counter[str]:
    out: Counter[str] = Counter()
    for kind, n in counts.items():
        out["internal" if kind == "bad_gateway" else kind] += n
    return out


def wait_routes(m: Endpoints, routes: tuple[str, ...], timeout: float = 60) -> None:
    host, port = m.http.split(":")
    deadline = time.monotonic() + timeout
    for route in routes:
        while True:
            conn = http.client.HTTPConnection(host, int(port), timeout=5)
            try:
                conn.request("GET", f"/v2/models/{route}/ready")
                answer = conn.getresponse()
                if answer.status == 200:
                    break
                said = f"{answer.status} {answer.read()[:300]!r}"
            finally:
                conn.close()
            assert time.monotonic() < deadline, f"route {route} not ready in {timeout} s: {said}"
            time.sleep(0.05)


def warm(m: Endpoints, stage: Stage) -> None:
    client = Client(m, stage)
    try:
        for key in stage.warm_keys:
            i = next(i for i in range(10_000) if stage.key(i) == key)
            kind, detail = client.call(i, "grpc")
            assert kind == "ok", f"warm-up #{i}: {kind} {detail}"
    finally:
        client.close()


def in_process(m: RunningMmguard) -> Endpoints:
    assert m.server is not None
    server = m.server
    return Endpoints(m.grpc_url, m.http_url, m.admin_url,
                     reload=lambda: bool(m.run(server.reload())))


# --- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("setup", [
    pytest.param(setup, id=name, marks=[pytest.mark.triton] if triton else [])
    for name, setup, triton in SCENARIOS])
def test_fault_matrix(env: Env, setup: Setup) -> None:
    with setup(env) as stage, RunningMmguard(stage.config, stage.config_path) as m:
        ends = in_process(m)
        wait_routes(ends, stage.wait_routes)
        warm(ends, stage)
        before = requests_by_code(ends, stage.route)
        outcomes = run_load(ends, stage)
        seen = requests_by_code(ends, stage.route)
        seen.subtract(before)
        kinds = check(stage, outcomes, THREADS * stage.per_thread, seen)
        if stage.checks is not None:
            stage.checks(ends)
        print(f"outcomes: {dict(sorted(kinds.items()))}")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.triton
def test_memory_stays_bounded_under_the_heaviest_scenario(env: Env, tmp_path: Path) -> None:
    """``everything-at-once`` against mmguard as a process: after a warm-up, a few thousand more
    requests grow its RSS by less than 50 MiB (the cache, the shadow queue, the breakers'
    windows and the metrics are all bounded)."""
    with everything(env) as stage:
        path = tmp_path / "mmguard.yaml"
        path.write_text(yaml.safe_dump(stage.config))
        proc = MmguardProcess(["--config", str(path)], tmp_path / "mmguard.log")
        stopped = False
        try:
            ends = Endpoints(f"127.0.0.1:{proc.ports['grpc']}",
                             f"127.0.0.1:{proc.ports['http']}",
                             f"http://127.0.0.1:{proc.ports['admin']}")
            wait_routes(ends, stage.wait_routes)
            warmup = run_load(ends, stage, per_thread=150)
            check(stage, warmup, THREADS * 150, +requests_by_code(ends, stage.route))
            start = rss_kib(proc.proc.pid)
            before = requests_by_code(ends, stage.route)
            outcomes = run_load(ends, stage, per_thread=600)
            seen = requests_by_code(ends, stage.route)
            seen.subtract(before)
            kinds = check(stage, outcomes, THREADS * 600, seen)
            end = rss_kib(proc.proc.pid)
            assert stage.checks is not None
            stage.checks(ends)
            print(f"RSS {start / 1024:.1f} MiB after the warm-up, {end / 1024:.1f} MiB after "
                  f"{THREADS * 600} more requests; outcomes {dict(sorted(kinds.items()))}")
            assert end - start < 50 * 1024, f"RSS grew {(end - start) / 1024:.1f} MiB"
            stopped = True
            assert proc.stop() == 0, "mmguard did not exit cleanly on SIGTERM"
        finally:
            if not stopped:
                proc.stop()
