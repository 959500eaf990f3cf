"""The process: listeners (HTTP, gRPC, admin), config reload and graceful shutdown.

Life cycle that MUST hold: ports bind before the process says it is up (port 0 resolved and
logged); a reload (SIGHUP, a change of the config file or of a file it names, seen by
``proxy.process.watch``, or ``POST /admin/reload``) keeps the old config when the new one is invalid
or a backend it replaces does not start, and says so in the log and in
``mmguard_config_reloads_total{result="rejected"}``; reading, validating and building the new
runtime run in a thread, off the event loop; nothing of the new runtime is live (no experiment
started) before it is swapped in. SIGTERM stops accepting, drains in-flight requests up to
``shutdown_grace_s``, closes backends.

A reload applies new TLS certificates to the running listeners (``proxy.config.tls.ListenerTls``);
every other listener setting (address, limits, the admin token, TLS on/off, mTLS on/off) is kept
until a restart, with a warning naming what changed. Each listener enforces its own limits
before any front sees a request (``proxy.process.listeners``: connections, header and body
deadlines, header size, concurrent requests, and on admin the body size; gRPC's through its
options). """

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter

from proxy.clock import Clock, SystemClock
from proxy.config.listeners import AdminListener, GrpcListener, HttpListener, Listeners
from proxy.config.model import Config, ConfigError, load_config
from proxy.config.tls import ListenerTls, restart_needed
from proxy.engine.canary import log_membership
from proxy.engine.dataplane import DataPlane
from proxy.engine.runtime import Runtime, forget_removed
from proxy.fronts.grpc_v2 import SERVICE, GrpcFront
from proxy.fronts.http_v2 import HttpFront
from proxy.pod.link import SOCKET_ENV, WorkerLink
from proxy.pod.state import POD, Role
from proxy.process import listeners as guard
from proxy.process.admin import admin_app
from proxy.process.descriptors import accept_backlog, connection_caps
from proxy.process.fast_lane import FastLane, LaneSettings
from proxy.process.watch import FileWatch, watched_files
from proxy.registry import filter_factories
from proxy.shm.regions import SharedMemory
from proxy.telemetry import Telemetry

log = logging.getLogger("mmguard.server")

_CAPS = ("max_header_bytes", "max_request_bytes", "max_connections", "max_connections_evicted",
         "body_timeout_s", "min_body_bytes_per_s", "malformed")
LISTENER_LIMITS: tuple[tuple[str, str], ...] = (
    *((listener, limit) for listener in ("http", "admin") for limit in _CAPS),
    ("http", "max_concurrent_requests"))
"""The refusals ``mmguard_listener_refusals_total`` can count, created at 0."""


@dataclass(frozen=True)
class ReloadOutcome:
    applied: bool
    message: str
    """What happened, in one line (the admin API answers it)."""

    def __bool__(self) -> bool:
        return self.applied


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
        self.telemetry.configure(config.telemetry)
        self.plane = DataPlane(Runtime.build(config, self.telemetry, self.clock), self.telemetry)
        self.health = health.aio.HealthServicer()
        # Read at start only: a reload keeps the regions and this setting (docs/shared-memory.md).
        self.shm = SharedMemory(config.shared_memory, telemetry=self.telemetry)
        self._grpc: grpc.aio.Server | None = None
        self._runners: list[web.AppRunner] = []
        self._http_front: HttpFront | None = None
        self._http_in_flight: guard.InFlight | None = None
        self.http_port = self.grpc_port = self.admin_port = 0
        self._stopped = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._health_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._drained = asyncio.Event()
        """Set by ``stop`` once the fronts have drained: a runtime a reload is retiring closes
        its backends then, not after its grace (a stop right after a reload left them open)."""
        self._listeners = config.listeners  # what the listeners really run with
        self._tls: dict[str, ListenerTls] = {}
        self._caps = connection_caps(config.listeners)
        self._refused = self.telemetry.metric(
            Counter, "mmguard_listener_refusals_total",
            "Requests (and connections) a listener refused at one of its limits.",
            ["listener", "limit"])
        for listener, limit in LISTENER_LIMITS:  # at 0 from the start: increase() sees the first
            self._refused.labels(listener, limit)
        self._lane_requests = self.telemetry.metric(
            Counter, "mmguard_http_fast_lane_requests_total",
            "Requests the HTTP listener's fast lane served (KServe v2 infer, OpenAI "
            "inference), and connections it handed to aiohttp (at a request it does not take "
            "whole).",
            ["outcome"])
        self._watch: FileWatch | None = None
        self.pod_reload: Callable[[], Awaitable[str]] | None = None
        """A pod's supervisor: reloads every worker once its own reload applied."""
        self.pod_snapshot: Callable[[], list[dict[str, Any]]] | None = None
        self._link: WorkerLink | None = None
        for result in ("applied", "rejected"):  # at 0 from the start: increase() sees the first
            self.telemetry.config_reloads.labels(result)

    async def start(self) -> None:
        """Serve. A pod's supervisor (``proxy.process.supervisor``) serves only the admin listener
        on a runtime whose backends never start (its control state); a pod's worker serves the data
        listeners on shared ports, without the admin one, once it has the pod's state."""
        runtime = self.plane.runtime
        runtime.activate()  # its shared state is named now: the pod's state reaches it next
        if POD.is_worker:
            self._link = WorkerLink(os.environ[SOCKET_ENV], self.reload)
            await self._link.start()
        if not POD.is_worker:  # a pod's supervisor says it for every worker
            log_membership(runtime.share_hash)
        lc = self._listeners = self.config.listeners
        log.info("connection caps: http %d, grpc %d, admin %d (open-files limit %d); accept "
                 "queues: http %d, admin %d", self._caps.http, self._caps.grpc,
                 self._caps.admin, self._caps.nofile, accept_backlog(lc.http.backlog),
                 accept_backlog(lc.admin.backlog))
        self._tls = {name: ListenerTls(cfg.tls) for name, cfg in _by_name(lc)
                     if cfg.tls is not None}
        if POD.role is Role.SUPERVISOR:
            self.admin_port = await self._serve_http(
                self._admin_app(lc.admin), "admin", lc.admin,
                _pick(self._ports.admin, lc.admin.port))
            self._watch_config()
            return
        await runtime.start()
        if POD.is_worker:  # the pod's other workers serve meanwhile: take no call too early
            await self._wait_backends_ready()
        self.http_port = await self._serve_http(
            self._http_app(lc.http), "http", lc.http, _pick(self._ports.http, lc.http.port))
        if not POD.is_worker:
            self.admin_port = await self._serve_http(
                self._admin_app(lc.admin), "admin", lc.admin,
                _pick(self._ports.admin, lc.admin.port))
        self._grpc = grpc.aio.server(options=_grpc_options(lc.grpc, self._caps.grpc),
                                     maximum_concurrent_rpcs=lc.grpc.max_concurrent_requests)
        front = self.grpc_front = GrpcFront(self.plane, self.shm, lc.grpc.max_request_bytes,
                                            lc.grpc.max_stream_bytes, lc.grpc.max_streams_bytes)
        self._grpc.add_generic_rpc_handlers((front.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        address = f"{lc.grpc.host}:{_pick(self._ports.grpc, lc.grpc.port)}"
        grpc_tls = self._tls.get("grpc")
        self.grpc_port = (self._grpc.add_insecure_port(address) if grpc_tls is None else
                          self._grpc.add_secure_port(address, grpc_tls.grpc_credentials()))
        if self.grpc_port == 0:
            raise OSError(f"cannot bind gRPC port {lc.grpc.host}:{lc.grpc.port}")
        self.shm.grpc_port = self.grpc_port  # grpc.aio tells a handler its peer, not its port
        await self._grpc.start()
        self._health_task = asyncio.create_task(self._track_health())
        if not POD.is_worker:  # a pod's supervisor watches the file for every worker
            self._watch_config()
        log.info("mmguard serving: http %d, grpc %d, admin %d", self.http_port, self.grpc_port,
                 self.admin_port, extra={"fields": {"http_port": self.http_port,
                                                    "grpc_port": self.grpc_port,
                                                    "admin_port": self.admin_port,
                                                    "tls": sorted(self._tls)}})

    worker_ready_s = 120.0
    """How long a pod's worker waits for its backends before it listens anyway."""

    async def _wait_backends_ready(self) -> None:
        """A pod's worker listens once its routes are servable (its backends started and their
        contracts learned), so a restarted worker answers no call with 503 "still starting"
        that another worker would have served; after ``worker_ready_s`` it listens anyway
        (the routes still starting answer UNAVAILABLE, as a single process does)."""
        deadline = time.monotonic() + self.worker_ready_s
        while not await self.plane.ready():
            if self._link is not None:  # the pod's /readyz says why this worker waits
                self._link.status(False, self.plane.readiness())
            if time.monotonic() >= deadline:
                log.warning("worker: backends not ready after %g s; listening anyway",
                            self.worker_ready_s)
                return
            await asyncio.sleep(0.1)

    def _watch_config(self) -> None:
        if self.config_path is not None and self.config.watch_config_s > 0:
            self._watch = FileWatch(lambda: watched_files(self.config_path, self.config),
                                    self.config.watch_config_s, self._file_changed)
            self._watch.start()

    def _http_app(self, cfg: HttpListener) -> web.Application:
        self._http_front = HttpFront(self.plane, cfg.max_request_bytes, cfg.max_json_bytes,
                                     self.shm)
        app = self._http_front.app()
        guards = [guard.header_budget(cfg.max_header_bytes, "http", self._refused)]
        self._http_in_flight = None
        if cfg.max_concurrent_requests is not None:
            self._http_in_flight = guard.InFlight(cfg.max_concurrent_requests)
            guards.append(guard.concurrency_limit(self._http_in_flight, "http", self._refused))
        app.middlewares[:0] = guards  # outermost: nothing runs for a refused request
        return app

    def _fast_lane(self, cfg: HttpListener, cap: guard.ConnectionCap,
                   runner: web.AppRunner) -> Callable[[], asyncio.Protocol] | None:
        """The KServe v2 infer requests' bare protocol (``proxy.process.fast_lane``)."""
        if not cfg.fast_lane or self._http_front is None:
            return None
        server = runner.server
        assert server is not None
        settings = LaneSettings(
            self._http_front, "http", cfg.max_header_bytes, cfg.header_timeout_s,
            cfg.body_timeout_s, cfg.min_body_bytes_per_s, self._refused, cap,
            self._http_in_flight, lambda: cap.handler(server),
            self._lane_requests.labels("served"), self._lane_requests.labels("handed_over"))
        return lambda: FastLane(settings)

    def _admin_app(self, cfg: AdminListener) -> web.Application:
        app = admin_app(self.plane, cfg.resolve_token(), reload=self.reload,
                        pod=self.pod_snapshot)
        app.middlewares[:0] = [guard.header_budget(cfg.max_header_bytes, "admin", self._refused),
                               guard.body_limit(cfg.max_request_bytes, "admin", self._refused)]
        return app

    async def _serve_http(self, app: web.Application, name: str,
                          cfg: HttpListener | AdminListener, port: int) -> int:
        cap = guard.ConnectionCap(self._caps.of(name), name, self._refused)
        app.middlewares[:0] = [cap.middleware(),
                               guard.body_deadline(cfg.body_timeout_s, cfg.min_body_bytes_per_s,
                                                   name, self._refused)]
        # aiohttp's parser refuses any one line (request line or header) above the limit; its
        # keep-alive timer closes a connection whose next request's headers are not in time.
        # auto_decompress=False: the fronts inflate bodies themselves, once and bounded
        # (proxy.fronts.body); the admin API takes no compressed bodies.
        app.on_response_prepare.append(_server_header)
        runner = web.AppRunner(app, access_log=None, handle_signals=False,
                               shutdown_timeout=self.config.shutdown_grace_s,
                               max_line_size=cfg.max_header_bytes,
                               max_field_size=cfg.max_header_bytes,
                               keepalive_timeout=cfg.header_timeout_s,
                               auto_decompress=False,
                               # a data-plane call whose client left is cancelled (its backend
                               # call with it), as on the fast lane and over gRPC; an admin
                               # action (a reload) runs to its end
                               handler_cancellation=name != "admin",
                               # what aiohttp logs goes through mmguard's redacting handler
                               logger=logging.getLogger("mmguard.http"))
        await runner.setup()
        tls = self._tls.get(name)
        lane = self._fast_lane(cfg, cap, runner) if isinstance(cfg, HttpListener) else None
        site = guard.CappedSite(runner, cfg.host, port, cap=cap,
                                ssl_context=None if tls is None else tls.ssl_context,
                                handshake_timeout_s=cfg.header_timeout_s,
                                backlog=accept_backlog(cfg.backlog),
                                reuse_port=POD.is_worker and name != "admin", lane=lane,
                                grace_s=self.config.shutdown_grace_s)
        await site.start()
        self._runners.append(runner)
        return site.port

    async def refresh_health(self) -> bool:
        """Set grpc.health.v1 (overall and per service name) from readiness; returns it."""
        ready = await self.plane.ready()
        if self._link is not None:
            self._link.status(ready, self.plane.readiness())
        status = (health_pb2.HealthCheckResponse.SERVING if ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("", status)
        await self.health.set(SERVICE, status)
        return ready

    async def _track_health(self) -> None:
        while True:
            await self.refresh_health()
            await asyncio.sleep(0.5)

    async def reload(self) -> ReloadOutcome:
        """Re-read the config file; swap in the new runtime only if it is valid, builds, and
        every backend it replaces has started. Reading, validating and building run in a
        thread (a large file must not stall the data plane); the swap and the activation of
        the new runtime's filters (experiments start) happen on the loop, only once it serves."""
        async with self._reload_lock:
            if self.config_path is None:
                log.warning("reload asked for, but mmguard runs without a config file")
                return ReloadOutcome(False, "mmguard runs without a config file")
            old = self.plane.runtime
            try:
                config, new = await asyncio.to_thread(self._load_and_build, self.config_path,
                                                      old)
            except (ConfigError, Exception) as exc:  # MemoryError's text is empty: name it
                return self._rejected(str(exc) or f"{type(exc).__name__} while loading")
            reused = {n for n, b in new.backends.items() if old.backends.get(n) is b}
            new.contracts.update({r: c for r, c in old.contracts.items()
                                  if r in new.routes and new.routes[r].spec.backend in reused})
            slow: list[str] = []
            if POD.role is not Role.SUPERVISOR:  # the pod's control copy starts no backend
                await new.start(started=reused)
                # New backends connect, replaced ones answer, before the swap: calls never
                # meet one half made, nor a backend at an address where no server answers.
                slow = await new.wait_started(self.backend_start_s, old.backends.keys() - reused)
            replaced = [n for n in slow if n in old.backends]
            if replaced:  # the old one serves: keep it rather than answer 503 until fixed
                await new.close(keep=reused)
                why = "; ".join(f"{n}: {new.start_errors.get(n, 'no answer yet')}"
                                for n in replaced)
                return self._rejected(f"replaced backends {replaced} did not start within "
                                      f"{self.backend_start_s:g} s ({why})")
            if slow:
                log.warning("config reload: new backends %s have not started yet; their routes "
                            "answer UNAVAILABLE until they have", slow)
            self.plane.runtime = new
            forget_removed(self.telemetry, old, new)
            new.activate()
            self.config = config
            self.telemetry.configure(config.telemetry)
            self._reload_listeners(config.listeners)
            self.telemetry.config_reloads.labels("applied").inc()
            log.info("config reloaded from %s", self.config_path)
            retire = asyncio.create_task(self._retire(old, keep=reused))
            self._background.add(retire)
            retire.add_done_callback(self._background.discard)
            message = f"config reloaded from {self.config_path}"
            if self.pod_reload is not None:
                message += f" ({await self.pod_reload()})"
            return ReloadOutcome(True, message)

    backend_start_s = 10.0
    """How long a reload waits for the backends it starts."""

    def _load_and_build(self, path: Path, old: Runtime) -> tuple[Config, Runtime]:
        """In a worker thread: nothing here touches the loop or live state."""
        config = load_config(path, check_files=True)
        return config, Runtime.build(config, self.telemetry, self.clock, previous=old)

    def _rejected(self, why: str) -> ReloadOutcome:
        self.telemetry.config_reloads.labels("rejected").inc()
        log.error("config reload rejected, the old config keeps serving: %s", why)
        return ReloadOutcome(False, f"config reload rejected, the old config keeps serving: "
                                    f"{why}")

    async def _file_changed(self, changed: list[str]) -> None:
        log.info("config reload: %s changed", ", ".join(changed))
        await self.reload()

    def _reload_listeners(self, new: Listeners) -> None:
        """Apply what a running listener can take (new TLS files); warn about the rest."""
        serving: dict[str, Any] = {}
        for name, old in _by_name(self._listeners):
            fresh = getattr(new, name)
            why = restart_needed(old.tls, fresh.tls)
            tls = self._tls.get(name)
            if why is None and tls is not None and fresh.tls is not None and fresh.tls != old.tls:
                try:
                    tls.update(fresh.tls)
                except (OSError, ssl.SSLError) as exc:
                    log.error("listeners.%s: the new TLS files did not load; the old ones keep "
                              "serving: %s", name, exc)
                else:
                    old = old.model_copy(update={"tls": fresh.tls})
                    log.info("listeners.%s: TLS certificates reloaded from %s", name,
                             fresh.tls.cert_file)
            if old != fresh:
                log.warning("listeners.%s: a change to %s needs a restart; the listener keeps "
                            "its old settings", name, _changes(old, fresh, why))
            serving[name] = old
        self._listeners = self._listeners.model_copy(update=serving)

    async def _retire(self, old: Runtime, keep: set[str]) -> None:
        """The runtime a reload replaced serves its calls to their end: its grace first (what
        reached its backends without being a call: a metadata read, a readiness probe), then
        until its last call ends, however long (a call queued behind an injected delay, a
        fallback's next level, a stream), then its backends close with ``drain`` (what a call
        left running: a shadow copy). A stop cuts all of it: its fronts have drained."""
        await old.stop_watching()
        stopping = asyncio.ensure_future(self._drained.wait())
        idle = asyncio.ensure_future(old.idle())
        try:
            await asyncio.wait({stopping}, timeout=self.config.shutdown_grace_s)
            if not stopping.done() and not idle.done():
                log.info("config reload: the previous runtime waits for its %d calls in "
                         "flight before it closes its backends", old.calls)
                await asyncio.wait({idle, stopping}, return_when=asyncio.FIRST_COMPLETED)
            draining = asyncio.ensure_future(old.close(keep=keep, drain=not stopping.done()))
            await asyncio.wait({draining, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            idle.cancel()
        if not draining.done():
            draining.cancel()
            await asyncio.gather(draining, return_exceptions=True)
            await old.close(keep=keep)
        else:
            draining.result()  # its failure is the retirement's
        # again: a readiness pass of the old runtime that was running at the swap may have
        # written its series back since
        forget_removed(self.telemetry, old, self.plane.runtime)
        log.info("config reload: the previous runtime retired (its backends no longer used "
                 "are closed)")

    async def stop(self) -> None:
        grace = self.config.shutdown_grace_s
        self.plane.draining = True
        for factory in filter_factories().values():  # e.g. faults end: drains get clean answers
            await factory.before_drain(self.plane.runtime.state)
        log.info("shutting down: draining for up to %.1fs", grace)
        if self._watch is not None:
            await self._watch.stop()
        if self._health_task:
            self._health_task.cancel()
        await self.health.enter_graceful_shutdown()
        # Both fronts stop accepting at once, then wait for their in-flight calls (up to grace).
        tasks = [r.cleanup() for r in self._runners]
        if self._grpc is not None:
            tasks.append(self._grpc.stop(grace))
        await asyncio.gather(*tasks, return_exceptions=True)
        self.shm.close()  # calls have drained: unmap every client region
        self._drained.set()  # and the runtimes a reload is retiring close their backends now
        await asyncio.gather(*self._background, return_exceptions=True)
        for factory in filter_factories().values():  # e.g. queued mirror copies are dropped
            await factory.after_drain(self.plane.runtime.state)
        await self.plane.runtime.close()
        if self._link is not None:
            await self._link.close()
        self._stopped.set()
        log.info("stopped")

    async def run_until_signalled(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        if POD.is_worker:  # the supervisor orders a pod's reloads, to every worker at once
            loop.add_signal_handler(signal.SIGHUP, lambda: log.warning(
                "SIGHUP to a worker is ignored: send it to the pod's supervisor"))
        else:
            loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))
        await stop.wait()
        await self.stop()


def _pick(override: int | None, configured: int) -> int:
    return configured if override is None else override


def _by_name(lc: Listeners) -> list[tuple[str, HttpListener | GrpcListener | AdminListener]]:
    return [("http", lc.http), ("grpc", lc.grpc), ("admin", lc.admin)]


def _changes(old: Any, fresh: Any, tls_why: str | None) -> str:
    fields = [k for k in type(old).model_fields if getattr(old, k) != getattr(fresh, k)]
    named = [f"tls ({tls_why})" if k == "tls" and tls_why else k for k in fields]
    return ", ".join(named) or "the admin token"  # equal fields, other secret: the token's


def _grpc_options(cfg: GrpcListener, max_connections: int) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", cfg.max_request_bytes),
        ("grpc.max_send_message_length", 1 << 30),
        ("grpc.so_reuseport", 1 if POD.is_worker else 0),  # a pod's workers share the port
        # Soft and hard limit alike: above it every call is refused, not a random share.
        ("grpc.max_metadata_size", cfg.max_header_bytes),
        ("grpc.absolute_max_metadata_size", cfg.max_header_bytes),
        ("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
        # Against slow or idle clients holding descriptors (gRPC refuses past the cap before
        # the handshake; a handshake that does not finish in time is dropped).
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", int(cfg.handshake_timeout_s * 1000)),
        # The handshake timeout ends at the client's first SETTINGS frame; a client that then
        # never acknowledges ours held its connection for minutes (issue 26). The same bound.
        ("grpc.http2.settings_timeout", int(cfg.handshake_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", int(cfg.max_connection_idle_s * 1000)),
    ]
    return options


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    """``Server: mmguard``, with no version: aiohttp's default names itself and Python with
    their versions, which tells a scanner what to try."""
    response.headers["Server"] = "mmguard"
