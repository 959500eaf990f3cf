"""The load generator: a spawned process running one cell per message, the recorder its workers
share, and percentiles of what they recorded.

A bench gives :class:`LoadGen` a module-level entry point that calls :func:`serve_cells` with
its ``run_cell(spec, factory)``; ``factory(Recorder)`` (or a subclass) makes the cell's
recorder, wired to tell the parent when the measured window starts and ends.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar, cast

from bench.common import pdeathsig

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

_R = TypeVar("_R", bound="Recorder")


class Recorder:
    """Shared by the workers of one cell: latencies of requests started inside the window."""

    def __init__(self, warmup: float, duration: float, notify: Callable[[str], None]) -> None:
        now = time.perf_counter()
        self.t_start = now + warmup
        self.t_end = self.t_start + duration
        self.notify = notify
        self.started_sent = False
        self.lat: list[float] = []
        self.last_done = self.t_start
        self.errors = 0
        self.error_samples: dict[str, int] = {}

    def tick(self, t0: float) -> bool:
        """Called before each request; False once the window is over."""
        if not self.started_sent and t0 >= self.t_start:
            self.started_sent = True
            self.notify("start")
        return t0 < self.t_end

    def ok(self, t0: float, t1: float, extra: float | None = None) -> None:
        """A request started at ``t0`` ended well at ``t1``; ``extra``: what ``one()`` returned
        (unused here, see subclasses)."""
        if t0 >= self.t_start:
            self.lat.append(t1 - t0)
            self.last_done = max(self.last_done, t1)

    def error(self, t0: float, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}"[:300]
        if t0 >= self.t_start:
            self.errors += 1
        if len(self.error_samples) < 5 or text in self.error_samples:
            self.error_samples[text] = self.error_samples.get(text, 0) + 1

    def result(self) -> dict[str, Any]:
        n = len(self.lat)
        window = max(self.last_done - self.t_start, 1e-9)
        out: dict[str, Any] = {"requests": n, "errors": self.errors, "window_s": round(window, 3),
                               "rps": n / window if n else 0.0,
                               "error_samples": self.error_samples}
        if n:
            out.update(percentiles(self.lat))
        return out


def percentiles(values_s: Sequence[float], prefix: str = "") -> dict[str, float]:
    """p50/p90/p99/mean/max in ms of latencies given in seconds."""
    import numpy as np

    arr = np.asarray(values_s) * 1000.0
    return {f"{prefix}p50_ms": float(np.percentile(arr, 50)),
            f"{prefix}p90_ms": float(np.percentile(arr, 90)),
            f"{prefix}p99_ms": float(np.percentile(arr, 99)),
            f"{prefix}mean_ms": float(arr.mean()), f"{prefix}max_ms": float(arr.max())}


async def drive(one: Callable[[], Awaitable[float | None]], rec: Recorder,
                concurrency: int) -> None:
    """``concurrency`` workers calling ``one()`` back to back until the window is over."""
    async def worker() -> None:
        while True:
            t0 = time.perf_counter()
            if not rec.tick(t0):
                return
            try:
                extra = await one()
            except Exception as exc:  # counted, and a short pause so a dead target can't spin
                rec.error(t0, exc)
                await asyncio.sleep(0.005)
                continue
            rec.ok(t0, time.perf_counter(), extra)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    rec.notify("end")


class RecorderFactory(Protocol):
    """Makes a cell's recorder of the class given (:class:`Recorder` or a subclass)."""

    def __call__(self, cls: type[_R], /) -> _R: ...


CellRunner = Callable[[dict[str, Any], RecorderFactory], Awaitable[dict[str, Any]]]
Conn: TypeAlias = "Connection[Any, Any]"
"""The pipe end between the parent and the load generator (it carries plain Python values)."""


def serve_cells(conn: Conn, run_cell: CellRunner) -> None:
    """Body of a load-generator process: ``run_cell(spec, recorder_factory)`` per message
    until None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    pdeathsig()

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        while True:
            spec = await loop.run_in_executor(None, conn.recv)
            if spec is None:
                return

            def factory(cls: type[_R], spec: dict[str, Any] = spec) -> _R:
                return cls(spec["warmup"], spec["duration"],
                           lambda what: conn.send((what, time.time())))

            try:
                result = await run_cell(spec, factory)
            except Exception as exc:
                result = {"failed": f"{type(exc).__name__}: {exc}"[:1000]}
            conn.send(("result", result))

    try:
        asyncio.run(serve())
    except (EOFError, BrokenPipeError):
        pass


class LoadGen:
    """The load-generator process. ``target(conn)`` runs in it (a module-level function that
    calls :func:`serve_cells`); ``run(spec, ...)`` sends one cell and waits for its result."""

    def __init__(self, target: Callable[[Conn], None]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child,), name="bench-loadgen",
                                daemon=True)
        self.proc.start()
        child.close()

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def run(self, spec: dict[str, Any], on_start: Callable[[], None],
            on_end: Callable[[], None]) -> dict[str, Any]:
        self.conn.send(spec)
        deadline = time.monotonic() + spec["warmup"] + spec["duration"] + 120
        while True:
            if not self.conn.poll(1.0):
                if not self.proc.is_alive():
                    raise RuntimeError(f"load generator died (exit code {self.proc.exitcode})")
                if time.monotonic() > deadline:
                    raise RuntimeError("load generator did not answer in time")
                continue
            what, payload = self.conn.recv()
            if what == "start":
                on_start()
            elif what == "end":
                on_end()
            elif what == "result":
                return cast("dict[str, Any]", payload)  # what serve_cells sends: a cell's dict

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(None)
                self.proc.join(5)
        except (OSError, BrokenPipeError):
            pass
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
