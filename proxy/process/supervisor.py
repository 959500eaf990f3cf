"""``mmguard serve --workers N``: the pod's supervisor and its N worker processes.

The supervisor is the process that was started. It

- holds the data ports (HTTP and gRPC, bound with SO_REUSEPORT and never listened on, so a port
  0 is resolved once and a restarted worker binds the same one); each worker listens on them
  with SO_REUSEPORT, and the kernel spreads connections over the workers;
- owns the **control state** (``proxy.pod.state``): it builds the same runtime as a worker from the
  same config, never starts its backends, and runs on its copies the observations the workers
  forward; what changes goes back to every worker within a loop turn;
- serves the **admin listener** for the pod: the filters' admin API reads and changes the one
  authoritative state (so ``mmguard status`` and ``canary-report`` see the pod), ``/metrics``
  aggregates every process's metrics (Prometheus multiprocess files), ``/readyz`` is ready when
  every worker is connected and ready;
- forwards **SIGHUP** (and a changed config file, and ``POST /admin/reload``): it reloads its own
  copy first and, once that is applied, every worker; **SIGTERM**: fault experiments end first,
  then every worker drains, then the admin listener closes;
- restarts a worker that dies (with a growing pause when it keeps dying), which gets the whole
  control state when it connects: nothing is lost. Every worker, first or restarted, starts
  from the config the supervisor serves (the bytes it applied, kept in its private run
  directory), never from the file as it is now; it listens once its backends are ready.

Workers are ``python -m proxy.cli serve`` with ``MMGUARD_POD_SOCKET`` set: they die with the
supervisor (``PR_SET_PDEATHSIG``) and stop by themselves when its socket closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from proxy.config.model import Config
from proxy.pod import counters
from proxy.pod.link import SOCKET_ENV
from proxy.pod.state import POD, Role, encode, read_message

log = logging.getLogger("mmguard.supervisor")

INDEX_ENV = "MMGUARD_WORKER_INDEX"
WORKERS_ENV = "MMGUARD_WORKERS"
SECRET_ENV = "MMGUARD_POD_SECRET"
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
STATUS_STALE_S = 3.0
"""A worker whose last status is older than this is not ready."""
RESTART_PAUSES_S = (0.5, 1.0, 2.0, 5.0, 10.0)
STABLE_S = 30.0
"""A worker that lived this long starts its restart pauses from the first again."""


def cpus_available() -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup (v2 ``cpu.max`` or v1
    ``cpu.cfs_quota_us``) quota, rounded up; at least 1 (what ``workers: auto`` means)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        n = min(n, max(1, int(-(-quota // 1))))
    return max(1, n)


def _cgroup_quota() -> float | None:
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def resolve_workers(cli: str | None, config: Config) -> int:
    """``--workers`` wins over the config's ``workers``; ``auto`` = ``cpus_available()``."""
    wanted: int | str = config.workers if cli is None else (
        cli if cli == "auto" else int(cli))
    return cpus_available() if wanted == "auto" else int(wanted)


@dataclass
class Worker:
    index: int
    process: asyncio.subprocess.Process | None = None
    writer: asyncio.StreamWriter | None = None
    ready: bool = False
    status_at: float = 0.0
    started_at: float = 0.0
    restarts: int = 0
    failures_in_row: int = 0
    reloaded: asyncio.Future[tuple[bool, str]] | None = None
    pid: int = 0
    history: list[int] = field(default_factory=list)
    """Exit codes of its earlier processes (the newest last)."""
    readiness: dict[str, Any] = field(default_factory=dict)
    """Its backends and routes, ready or not and why, as its last status said."""


def _held_socket(host: str, port: int) -> socket.socket:
    """Bound with SO_REUSEPORT, never listening: holds the port for the workers."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    return sock


class Supervisor:
    def __init__(self, config: Config, config_path: Path | None, ports: Any, workers: int,
                 telemetry: Any) -> None:
        from proxy.process.server import Server

        self.config = config
        self.n = workers
        self.workers = [Worker(i) for i in range(workers)]
        self.rundir = Path(tempfile.mkdtemp(prefix="mmguard-pod-"))
        os.chmod(self.rundir, 0o700)
        self.socket_path = self.rundir / "control.sock"
        self.applied_path = self.rundir / "applied-config.yaml"
        self.telemetry = telemetry
        self.server = Server(config, config_path, ports, telemetry=telemetry)
        self.server.pod_reload = self._reload_workers
        self.server.plane.ready_override = self.ready
        self.server.plane.readiness_override = self.readiness
        self.server.pod_snapshot = self.snapshot
        self._ports = ports
        self._held: list[socket.socket] = []
        self._secret = secrets.token_hex(32)
        shm = Path("/dev/shm")
        self.counters_path = (Path(tempfile.mkstemp(prefix="mmguard-pod-", dir=shm)[1])
                              if shm.is_dir() else self.rundir / "counters")
        self.counters = counters.create(self.counters_path, workers)
        self._stopping = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._broadcast_scheduled = False
        self.m_restarts = telemetry.metric(Counter, "mmguard_worker_restarts_total",
                                           "Worker processes restarted after they died.",
                                           ["worker"])
        self.m_workers = telemetry.metric(Gauge, "mmguard_workers_ready",
                                          "Worker processes connected and ready.", [])
        for w in self.workers:
            self.m_restarts.labels(str(w.index))
        self.http_port = self.grpc_port = 0

    @property
    def admin_port(self) -> int:
        return self.server.admin_port

    # --- start --------------------------------------------------------------------------------

    async def start(self) -> None:
        POD.on_dirty = self._schedule_broadcast
        lc = self.config.listeners
        http = lc.http.port if self._ports.http is None else self._ports.http
        grpc = lc.grpc.port if self._ports.grpc is None else self._ports.grpc
        for host, port in ((lc.http.host, http), (lc.grpc.host, grpc)):
            self._held.append(_held_socket(host, port))
        self.http_port = self._held[0].getsockname()[1]
        self.grpc_port = self._held[1].getsockname()[1]
        self._write_applied()
        control = await asyncio.start_unix_server(self._serve_worker, path=str(self.socket_path))
        self._control = control
        await self.server.start()  # the control runtime and the admin listener
        log.info("mmguard pod serving: %d workers on http %d, grpc %d; admin %d", self.n,
                 self.http_port, self.grpc_port, self.admin_port,
                 extra={"fields": {"workers": self.n, "http_port": self.http_port,
                                   "grpc_port": self.grpc_port,
                                   "admin_port": self.admin_port}})
        for w in self.workers:
            await self._spawn(w)
        self._spawn_task(self._ticks())

    def _worker_env(self, w: Worker) -> dict[str, str]:
        env = dict(os.environ)
        env.update({SOCKET_ENV: str(self.socket_path), INDEX_ENV: str(w.index),
                    WORKERS_ENV: str(self.n), SECRET_ENV: self._secret,
                    METRICS_ENV: str(self.metrics_dir),
                    counters.COUNTERS_ENV: str(self.counters_path)})
        return env

    @property
    def metrics_dir(self) -> Path:
        return Path(os.environ[METRICS_ENV])

    def _write_applied(self) -> None:
        """The config the supervisor serves, as the bytes it was loaded from, where workers
        read theirs (written whole, then renamed: a worker never reads half of it)."""
        source = self.server.config.source
        if source is None:
            return
        tmp = self.applied_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(source)
        os.replace(tmp, self.applied_path)

    async def _spawn(self, w: Worker) -> None:
        argv = [sys.executable, "-m", "proxy.cli", "serve", "--http-port", str(self.http_port),
                "--grpc-port", str(self.grpc_port)]
        if self.server.config_path is not None:
            # The supervisor's current config, never the file's: an edited file that was not
            # reloaded (watch_config_s: 0) must not reach a restarted worker only.
            argv += ["--config", str(self.applied_path)]
        w.process = await asyncio.create_subprocess_exec(*argv, env=self._worker_env(w))
        w.pid = w.process.pid
        w.started_at = time.monotonic()
        w.ready = False
        self._spawn_task(self._watch(w, w.process))

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, w: Worker, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        w.history.append(code)
        w.ready = False
        _mark_dead(process.pid)
        counters.zero_column(self.counters, w.index)  # its requests in flight ended with it
        if self._stopping:
            return
        lived = time.monotonic() - w.started_at
        w.failures_in_row = 0 if lived >= STABLE_S else w.failures_in_row + 1
        pause = RESTART_PAUSES_S[min(w.failures_in_row, len(RESTART_PAUSES_S) - 1)]
        log.error("worker %d (pid %d) exited with %s after %.1f s; restarting it in %.1f s",
                  w.index, process.pid, code, lived, pause,
                  extra={"fields": {"worker": w.index, "pid": process.pid, "exit": code}})
        await asyncio.sleep(pause)
        if self._stopping:
            return
        w.restarts += 1
        self.m_restarts.labels(str(w.index)).inc()
        await self._spawn(w)

    # --- the control link ---------------------------------------------------------------------

    async def _serve_worker(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        worker: Worker | None = None
        try:
            hello = await read_message(reader)
            worker = self.workers[int(hello[1])]
            worker.writer = writer
            writer.write(encode(("state", POD.export_all())))  # first: the whole state
            while True:
                message = await read_message(reader)
                self._take(worker, message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:
            log.exception("pod: the link to worker %s failed",
                          "?" if worker is None else worker.index)
        finally:
            if worker is not None and worker.writer is writer:
                worker.writer = None
                worker.ready = False
                worker.readiness = {}
            writer.close()

    def _take(self, w: Worker, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ops":
            missing = POD.apply(message[1])
            if missing:
                log.debug("pod: %d observations for state this config no longer has", missing)
        elif kind == "status":
            w.ready, w.status_at = bool(message[1]), time.monotonic()
            w.readiness = message[2] if len(message) > 2 else {}
        elif kind == "sync":
            if w.writer is not None:
                w.writer.write(encode(("state", POD.export_all())))
        elif kind == "reloaded" and w.reloaded is not None and not w.reloaded.done():
            w.reloaded.set_result((bool(message[1]), str(message[2])))

    def _schedule_broadcast(self) -> None:
        if self._broadcast_scheduled:
            return
        self._broadcast_scheduled = True
        asyncio.get_running_loop().call_soon(self._broadcast)

    def _broadcast(self) -> None:
        self._broadcast_scheduled = False
        states = POD.take_dirty()
        if not states:
            return
        frame = encode(("state", states))
        for w in self.workers:
            if w.writer is not None and not w.writer.is_closing():
                w.writer.write(frame)

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            POD.tick()
            self.m_workers.set(sum(self._is_ready(w) for w in self.workers))

    # --- the pod's health and reloads ---------------------------------------------------------

    def _is_ready(self, w: Worker) -> bool:
        return (w.writer is not None and w.ready
                and time.monotonic() - w.status_at < STATUS_STALE_S)

    def ready(self) -> bool:
        return not self._stopping and all(self._is_ready(w) for w in self.workers)

    def readiness(self) -> dict[str, Any]:
        """``/readyz`` of the pod: each worker, ready or not and why; each backend and route
        as the workers see it: ready when it is in every connected worker, else the first
        worker's reason."""
        merged: dict[str, dict[str, dict[str, Any]]] = {"backends": {}, "routes": {}}
        workers = []
        for w in self.workers:
            ready = self._is_ready(w)
            why = (None if ready else "not connected to the supervisor" if w.writer is None
                   else "starting: no status yet" if not w.status_at
                   else "not ready: see its backends and routes" if not w.ready
                   else f"no status for {STATUS_STALE_S:g} s")
            workers.append({"worker": w.index, "pid": w.pid, "ready": ready, "why": why})
            for kind, seen in merged.items():
                for name, doc in w.readiness.get(kind, {}).items():
                    pod = seen.setdefault(name, {**doc, "ready": True, "why": None})
                    if not doc.get("ready") and pod["ready"]:
                        pod.update(ready=False, why=f"worker {w.index}: {doc.get('why')}")
        return {**merged, "workers": workers}

    def snapshot(self) -> list[dict[str, Any]]:
        return [{"worker": w.index, "pid": w.pid, "connected": w.writer is not None,
                 "ready": self._is_ready(w), "restarts": w.restarts,
                 "exit_codes": w.history[-5:]} for w in self.workers]

    async def _reload_workers(self) -> str:
        """After the supervisor's own reload applied: every connected worker reloads, from the
        bytes the supervisor applied (so is every worker started from now on)."""
        self._write_applied()
        loop = asyncio.get_running_loop()
        waiting = []
        for w in self.workers:
            if w.writer is None:
                continue
            w.reloaded = loop.create_future()
            w.writer.write(encode(("reload",)))
            waiting.append(w)
        limit = self.server.backend_start_s + 10
        outcomes = []
        for w in waiting:
            assert w.reloaded is not None
            try:
                applied, message = await asyncio.wait_for(w.reloaded, limit)
            except TimeoutError:
                applied, message = False, f"no answer within {limit:g} s"
            outcomes.append((w.index, applied, message))
        refused = [(i, m) for i, ok, m in outcomes if not ok]
        for i, message in refused:
            log.error("worker %d did not take the reload (it keeps its old config): %s", i,
                      message)
        if not refused:
            return f"{len(outcomes)} of {self.n} workers reloaded"
        return (f"{len(outcomes) - len(refused)} of {self.n} workers reloaded; refused: "
                + "; ".join(f"worker {i}: {m}" for i, m in refused))

    # --- stop ---------------------------------------------------------------------------------

    async def run_until_signalled(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGHUP,
                                lambda: self._spawn_task(self.server.reload()))
        await stop.wait()
        await self.stop()

    async def stop(self) -> None:
        from proxy.registry import filter_factories

        self._stopping = True
        self.server.plane.draining = True
        for factory in filter_factories().values():  # experiments end before workers drain
            await factory.before_drain(self.server.plane.runtime.state)
        self._broadcast()
        await asyncio.sleep(0.05)  # the end of the experiments reaches the workers first
        running = [w.process for w in self.workers
                   if w.process is not None and w.process.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        limit = self.config.shutdown_grace_s + 10
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in running)), limit)
        except TimeoutError:
            for process in running:
                if process.returncode is None:
                    log.error("worker pid %d did not stop within %g s; killed", process.pid,
                              limit)
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
        self._control.close()
        for task in list(self._tasks):
            task.cancel()
        await self.server.stop()
        for sock in self._held:
            sock.close()
        shutil.rmtree(self.rundir, ignore_errors=True)
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        self.counters_path.unlink(missing_ok=True)


def _mark_dead(pid: int) -> None:
    """Its live gauges (in flight, ready) leave the pod's /metrics; its counters stay."""
    try:
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
    except (OSError, ValueError, KeyError):
        pass


def become_supervisor(workers: int) -> Path:
    """Before any metric exists: this process is a pod's supervisor; the metrics directory."""
    from prometheus_client import values

    metrics = Path(tempfile.mkdtemp(prefix="mmguard-metrics-"))
    os.environ[METRICS_ENV] = str(metrics)
    values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
    POD.role, POD.workers, POD.index = Role.SUPERVISOR, workers, 0
    return metrics


def become_worker() -> bool:
    """This process is a pod's worker when the supervisor's socket is in the environment."""
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return False
    POD.role = Role.WORKER
    POD.index = int(os.environ.get(INDEX_ENV, "0"))
    POD.workers = int(os.environ.get(WORKERS_ENV, "1"))
    _die_with_parent()
    return True


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
