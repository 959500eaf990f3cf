"""What each load-generator process of ``python -m bench.workers`` runs per cell: its share of
the requests in flight over its share of the connections (gRPC: a channel each, with its own
subchannel pool; HTTP: a one-connection session each). The first answer on every connection is
checked byte for byte (the request builders and checks are ``bench.proxy.wire``'s)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from bench.loadgen import Conn, Recorder, RecorderFactory, drive, serve_cells
from bench.proxy.cases import GRPC_INFER, MiB
from bench.proxy.wire import grpc_check, grpc_request, http_check, http_request, payload


class LatencyRecorder(Recorder):
    """Also hands back every latency (ms), so several load generators' can be merged."""

    def result(self) -> dict[str, Any]:
        out = super().result()
        out["lat_ms"] = [round(v * 1000, 4) for v in self.lat]
        return out


async def cell_grpc(spec: dict[str, Any], factory: RecorderFactory) -> dict[str, Any]:
    import grpc

    x, expected = payload(spec)
    body = grpc_request(spec, x)
    # its own subchannel pool: a channel that would share one TCP connection with the others
    # would put all the load on one worker
    opts = [("grpc.max_send_message_length", 64 * MiB),
            ("grpc.max_receive_message_length", 64 * MiB), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(spec["addr"], options=opts)
                for _ in range(spec["connections"])]
    try:
        calls = []
        for channel in channels:
            await asyncio.wait_for(channel.channel_ready(), 15)
            call = channel.unary_unary(GRPC_INFER)  # bytes in, bytes out
            grpc_check(spec, await call(body, timeout=30), expected)  # each connection's first
            calls.append(call)
        turn = itertools.count()

        async def one() -> None:
            await calls[next(turn) % len(calls)](body, timeout=30)

        rec = factory(LatencyRecorder)
        await drive(one, rec, spec["concurrency"])
        return rec.result()
    finally:
        for channel in channels:
            await channel.close()


async def cell_http(spec: dict[str, Any], factory: RecorderFactory) -> dict[str, Any]:
    import aiohttp

    x, expected = payload(spec)
    body, headers = http_request(spec, x)
    url = f"http://{spec['addr']}/v2/models/{spec['model']}/infer"
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1,
                                                                     keepalive_timeout=300),
                                      auto_decompress=False)
                for _ in range(spec["connections"])]
    try:
        for session in sessions:  # one connection each: its first answer, sent alone
            async with session.post(url, data=body, headers=headers) as r:
                http_check(spec, r.status, r.headers, await r.read(), expected)
        turn = itertools.count()

        async def one() -> None:
            session = sessions[next(turn) % len(sessions)]
            async with session.post(url, data=body, headers=headers) as r:
                data = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")

        rec = factory(LatencyRecorder)
        await drive(one, rec, spec["concurrency"])
        return rec.result()
    finally:
        for session in sessions:
            await session.close()


async def run_cell(spec: dict[str, Any], factory: RecorderFactory) -> dict[str, Any]:
    return await (cell_grpc if spec["protocol"] == "grpc" else cell_http)(spec, factory)


def loadgen_main(conn: Conn) -> None:
    """Entry point of a load-generator process: one cell per message, until None."""
    serve_cells(conn, run_cell)
