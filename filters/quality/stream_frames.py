"""What a client stream keeps of its images for ``residue`` on its next requests: a video sent
frame by frame over one gRPC ``ModelStreamInfer`` stream, each frame compared with the frames
before it as the images of one request are; and the same for the unary requests of a client a
trusted gateway names (``proxy/engine/clients.py``).

Only one stream's or one named client's own requests are compared (``proxy.call.StreamMemory``
says why a keep-alive connection is not one client's), so no client's score can depend on
another client's images. What is kept is bounded per stream or client (the last
``residue.WINDOW`` images, their signs in int8: ~55 KB an image at 224 px) and per process
(``residue.STREAMS``: 64 MiB); it goes when the stream ends or the client is forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import Gauge

from filters.quality import residue
from filters.quality.report import Report
from filters.quality.residue import WINDOW, Trace, compact, nbytes
from proxy.call import StreamMemory


@dataclass(frozen=True, slots=True)
class Earlier:
    """What a stream keeps for residue on one route: the stream's last ``WINDOW`` images as the
    route scored them (traces with int8 signs, named by the request they came in) and how many
    of its requests the route scored."""

    count: int
    traces: tuple[tuple[str, Trace], ...]


def remember(memory: StreamMemory, key: str, earlier: Earlier | None, report: Report) -> None:
    """Keep the stream's last ``WINDOW`` images (this request's after the earlier ones) for its
    next request, within the process's budget (the previous entry's bytes given back first);
    past it nothing is kept, and the request says so (``report.unscored``), naming the stream or
    the client."""
    count = (earlier.count if earlier is not None else 0) + 1
    mine = tuple((f"{where} of {memory.owner}'s scored request {count}", compact(t))
                 for where, t in report.traces if t is not None)
    kept = ((earlier.traces if earlier is not None else ()) + mine)[-WINDOW:]
    memory.put(key, Earlier(count, ()))  # gives the previous entry's bytes back
    if not kept:
        return
    size = sum(nbytes(t) for _, t in kept)
    budget = residue.STREAMS  # read here: one budget for the process (a test may swap it)
    if budget.take(size):
        memory.put(key, Earlier(count, kept), lambda: budget.give(size))
    else:
        whose = memory.owner.removeprefix("the ")  # "stream", or "client" (a named one's)
        report.unscored.append(f"residue: this {whose}'s images are not kept for its next "
                               f"requests (the process keeps at most {budget.limit / 2 ** 20:g} "
                               "MiB of streams' images)")


def watch_kept(telemetry: Any) -> None:
    """``mmguard_quality_residue_kept_bytes`` in ``telemetry``'s registry, told of every change
    of the process's budget (once per registry, however many routes name residue)."""
    budget = residue.STREAMS
    if telemetry.registry in budget.watchers:
        return
    gauge = telemetry.metric(Gauge, "mmguard_quality_residue_kept_bytes",
                             "Bytes of earlier images that gRPC streams and named clients keep "
                             "for quality's residue (at most 64 MiB a process).", [])
    gauge.set(budget.used)
    budget.watchers[telemetry.registry] = gauge.set
