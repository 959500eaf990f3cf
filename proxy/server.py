"""The process: listeners (HTTP, gRPC, admin), config reload and graceful shutdown.

Life cycle that MUST hold: ports bind before the process says it is up (port 0 resolved and
logged); SIGHUP reloads the config file and keeps the old config when the new one is invalid;
SIGTERM stops accepting, drains in-flight requests up to ``shutdown_grace_s``, closes backends.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proxy.admin import admin_app
from proxy.clock import Clock, SystemClock
from proxy.config import Config, ConfigError, load_config
from proxy.dataplane import DataPlane
from proxy.fronts.grpc_v2 import SERVICE, GrpcFront
from proxy.fronts.http_v2 import HttpFront
from proxy.runtime import Runtime
from proxy.telemetry import Telemetry

log = logging.getLogger("mmguard.server")


@dataclass(frozen=True)
class Ports:
    http: int | None = None
    grpc: int | None = None
    admin: int | None = None


class Server:
    def __init__(self, config: Config, config_path: Path | None = None,
                 ports: Ports = Ports(), clock: Clock | None = None,
                 telemetry: Telemetry | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self._ports = ports
        self.clock = clock or SystemClock()
        self.telemetry = telemetry or Telemetry()
        self.plane = DataPlane(Runtime.build(config, self.telemetry, self.clock), self.telemetry)
        self.health = health.aio.HealthServicer()
        self._grpc: grpc.aio.Server | None = None
        self._runners: list[web.AppRunner] = []
        self.http_port = self.grpc_port = self.admin_port = 0
        self._stopped = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._health_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.plane.runtime.start()
        lc = self.config.listeners
        self.http_port = await self._serve_http(
            HttpFront(self.plane, lc.http.max_request_bytes,
                      self.config.openai.image_url_allow_hosts).app(), lc.http.host,
            _pick(self._ports.http, lc.http.port))
        self.admin_port = await self._serve_http(admin_app(self.plane, lc.admin.token),
                                                 lc.admin.host,
                                                 _pick(self._ports.admin, lc.admin.port))
        self._grpc = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", lc.grpc.max_request_bytes),
            ("grpc.max_send_message_length", 1 << 30),
            ("grpc.so_reuseport", 0),
        ])
        self._grpc.add_generic_rpc_handlers((GrpcFront(self.plane).handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        self.grpc_port = self._grpc.add_insecure_port(
            f"{lc.grpc.host}:{_pick(self._ports.grpc, lc.grpc.port)}")
        if self.grpc_port == 0:
            raise OSError(f"cannot bind gRPC port {lc.grpc.host}:{lc.grpc.port}")
        await self._grpc.start()
        self._health_task = asyncio.create_task(self._track_health())
        log.info("mmguard serving: http %d, grpc %d, admin %d", self.http_port, self.grpc_port,
                 self.admin_port, extra={"fields": {"http_port": self.http_port,
                                                    "grpc_port": self.grpc_port,
                                                    "admin_port": self.admin_port}})

    async def _serve_http(self, app: web.Application, host: str, port: int) -> int:
        runner = web.AppRunner(app, access_log=None, handle_signals=False,
                               shutdown_timeout=self.config.shutdown_grace_s)
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_port=False)
        await site.start()
        self._runners.append(runner)
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        return int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def refresh_health(self) -> bool:
        """Set grpc.health.v1 (overall and per service name) from readiness; returns it."""
        ready = await self.plane.ready()
        status = (health_pb2.HealthCheckResponse.SERVING if ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("", status)
        await self.health.set(SERVICE, status)
        return ready

    async def _track_health(self) -> None:
        while True:
            await self.refresh_health()
            await asyncio.sleep(0.5)

    async def reload(self) -> bool:
        """Re-read the config file; swap in the new runtime only if it is valid and builds."""
        async with self._reload_lock:
            if self.config_path is None:
                log.warning("reload asked for, but mmguard runs without a config file")
                return False
            try:
                config = load_config(self.config_path)
                if config.listeners != self.config.listeners:
                    log.warning("listener changes need a restart; keeping the old listeners")
                old = self.plane.runtime
                new = Runtime.build(config, self.telemetry, self.clock, previous=old)
            except (ConfigError, Exception) as exc:
                self.telemetry.config_reloads.labels("rejected").inc()
                log.error("config reload rejected, the old config keeps serving: %s", exc)
                return False
            reused = {n for n, b in new.backends.items() if old.backends.get(n) is b}
            new.contracts.update({r: c for r, c in old.contracts.items()
                                  if r in new.routes and new.routes[r].spec.backend in reused})
            await new.start(started=reused)
            self.plane.runtime = new
            self.config = config
            self.telemetry.config_reloads.labels("applied").inc()
            log.info("config reloaded from %s", self.config_path)
            retire = asyncio.create_task(self._retire(old, keep=reused))
            self._background.add(retire)
            retire.add_done_callback(self._background.discard)
            return True

    async def _retire(self, old: Runtime, keep: set[str]) -> None:
        await old.stop_watching()
        await asyncio.sleep(self.config.shutdown_grace_s)  # let its in-flight calls finish
        await old.close(keep=keep)

    async def stop(self) -> None:
        grace = self.config.shutdown_grace_s
        self.plane.draining = True
        log.info("shutting down: draining for up to %.1fs", grace)
        if self._health_task:
            self._health_task.cancel()
        await self.health.enter_graceful_shutdown()
        # Both fronts stop accepting at once, then wait for their in-flight calls (up to grace).
        tasks = [r.cleanup() for r in self._runners]
        if self._grpc is not None:
            tasks.append(self._grpc.stop(grace))
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.plane.runtime.close()
        self._stopped.set()
        log.info("stopped")

    async def run_until_signalled(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))
        await stop.wait()
        await self.stop()


def _pick(override: int | None, configured: int) -> int:
    return configured if override is None else override
