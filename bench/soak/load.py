"""What each kind of the soak sends, built once, and how its answer is checked: the request
builders, the per-kind calls and the workers that repeat them until the end."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import numpy as np
from multidict import CIMultiDictProxy
from numpy.typing import NDArray

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
                       headers: dict[str, str]) -> tuple[int, bytes, CIMultiDictProxy[str]]:
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
