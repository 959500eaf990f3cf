"""What the load-generator process of ``python -m bench.proxy`` runs per cell: gRPC (raw
``grpc.aio`` unary calls, one channel), HTTP (``aiohttp``, up to ``concurrency`` keep-alive
connections) and the in-process ONNX Runtime "direct". The first answer of every cell is checked
byte for byte before the cell is measured."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench.loadgen import Conn, Recorder, RecorderFactory, drive, serve_cells
from bench.proxy.cases import GRPC_INFER, MiB
from bench.proxy.wire import grpc_check, grpc_request, http_check, http_request, payload


async def cell_grpc(spec: dict[str, Any], rec_factory: RecorderFactory) -> dict[str, Any]:
    import grpc

    x, expected = payload(spec)
    body = grpc_request(spec, x)
    opts = [("grpc.max_send_message_length", 64 * MiB),
            ("grpc.max_receive_message_length", 64 * MiB)]
    metadata = tuple((k, v) for k, v in (spec.get("headers") or {}).items()) or None
    watch = spec.get("count_header")  # chain cells: count answers that carry this trailer
    seen = 0
    trailers: dict[str, str] = {}
    async with grpc.aio.insecure_channel(spec["addr"], options=opts) as channel:
        await asyncio.wait_for(channel.channel_ready(), 15)
        call = channel.unary_unary(GRPC_INFER)  # no (de)serializers: bytes in, bytes out
        if watch:
            first = call(body, timeout=30, metadata=metadata)
            grpc_check(spec, await first, expected)
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
            grpc_check(spec, await call(body, timeout=30), expected)

            async def one() -> None:
                await call(body, timeout=30)

        rec = rec_factory(Recorder)
        await drive(one, rec, spec["concurrency"])
    out = rec.result()
    if watch:
        out["header_count"] = seen
        out["first_decisions"] = {k: v for k, v in trailers.items() if k.startswith("mmguard-")}
    return out


async def cell_http(spec: dict[str, Any], rec_factory: RecorderFactory) -> dict[str, Any]:
    import aiohttp

    x, expected = payload(spec)
    body, headers = http_request(spec, x)
    url = f"http://{spec['addr']}/v2/models/{spec['model']}/infer"
    headers.update(spec.get("headers") or {})
    watch = spec.get("count_header")  # chain cells: count answers that carry this header
    seen = 0
    connector = aiohttp.TCPConnector(limit=spec["concurrency"], keepalive_timeout=300)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        async with session.post(url, data=body, headers=headers) as r:
            http_check(spec, r.status, r.headers, await r.read(), expected)
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

        rec = rec_factory(Recorder)
        await drive(one, rec, spec["concurrency"])
    out = rec.result()
    if watch:
        out["header_count"] = seen
        out["first_decisions"] = {k: v for k, v in first.items() if k.startswith("mmguard-")}
    return out


async def cell_ort(spec: dict[str, Any], rec_factory: RecorderFactory) -> dict[str, Any]:
    """The in-process "direct" for ONNX Runtime rows."""
    from concurrent.futures import ThreadPoolExecutor

    import onnxruntime as ort

    x, expected = payload(spec)
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
        rec = rec_factory(Recorder)
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

        rec = rec_factory(Recorder)
        await drive(one, rec, c)
    return rec.result()


async def run_cell(spec: dict[str, Any], factory: RecorderFactory) -> dict[str, Any]:
    run = {"grpc": cell_grpc, "http": cell_http, "ort": cell_ort}[spec["kind"]]
    return await run(spec, factory)


def loadgen_main(conn: Conn) -> None:
    """Entry point of the load-generator process: one cell per message, until None."""
    serve_cells(conn, run_cell)

