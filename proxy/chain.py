"""The filter chain: an onion of async filters around a terminal that calls the backend.

A filter is ``async def __call__(self, call, next) -> Result | LocalReply``. It may edit the call
and ``await next(call)``; return a ``LocalReply`` without calling ``next``; inspect or replace the
result; or call ``next`` again with another target. The chain for a route is composed once (at
start-up and on reload); an outer layer guarantees that no exception escapes: a ``ProxyError``
becomes its ``LocalReply``, anything else an INTERNAL reply naming the filter.

Filters are found through the ``mmguard.filters`` entry-point group, so ``proxy`` never imports
``filters``: each entry point names a ``FilterFactory`` with its own pydantic config model and,
optionally, its lifecycle (``proxy.lifecycle``: admin routes, activation, observers, shutdown).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry import trace
from pydantic import BaseModel

from proxy.call import Call, LocalReply, Reply, Target
from proxy.clock import Clock
from proxy.contract import ModelContract
from proxy.errors import ErrorKind, ProxyError, cancelled_under
from proxy.keys import Store
from proxy.lifecycle import AdminRequest, AdminRoute, Observer, Summary
from proxy.share import ShareHash
from proxy.telemetry import Telemetry, tracing_on

Next = Callable[[Call], Awaitable[Reply]]
log = logging.getLogger("mmguard.chain")


class Filter(Protocol):
    async def __call__(self, call: Call, next: Next) -> Reply: ...


@dataclass(frozen=True)
class FilterContext:
    """What a filter may use besides the call: its route, telemetry, time, randomness, the
    backend's contract (a callable: contracts are refreshed while the filter lives), other
    routes (for reroutes: their target and contract) and the backend's own token count."""

    route: str
    telemetry: Telemetry
    clock: Clock
    rng: random.Random
    contract: Callable[[], ModelContract | None]
    lookup: Callable[[str], tuple[Target, ModelContract | None] | None] = lambda name: None
    count_tokens: Callable[[Call], Awaitable[int | None]] | None = None
    reroute: Callable[[str, Call], Awaitable[Reply]] | None = None
    """Hand the call to another route's chain (its own filters run); loops are cut."""
    local: Store = field(default_factory=Store)
    """State of this runtime (e.g. the breakers a route's chain built, for its admin routes)."""
    state: Store = field(default_factory=Store)
    """State that outlives a config reload (the runtime hands it from one build to the next).
    Building may read it, and make an empty entry; what changes it waits for ``on_activate``."""
    share_hash: ShareHash = field(default_factory=ShareHash)
    """Keyed, stable membership of request keys in a share (``canary.key``, ``canary.secret_*``):
    what a filter that acts on a share of calls draws with, so clients cannot pick their way in."""
    on_activate: Callable[[Callable[[], None]], None] = lambda hook: hook()
    """Register what to do once this filter's runtime serves (starting experiments, taking over
    shared state). Building MUST change nothing live: a reload that fails to build leaves the
    running config exactly as it was. Outside a runtime the hook runs at once."""


class FilterFactory(Protocol):
    """A filter: its name and config model, ``build()`` (side-effect free) and its lifecycle
    (``proxy.lifecycle``; ``FilterFactoryBase`` gives each member a do-nothing default)."""

    name: str
    config_model: type[BaseModel]
    admin_routes: Sequence[AdminRoute]

    def build(self, config: Any, ctx: FilterContext) -> Filter: ...

    def activated(self, state: Store, local: Store, configs: Mapping[str, BaseModel]) -> None: ...

    def observers(self, state: Store, local: Store) -> Sequence[Observer]: ...

    async def summary(self, req: AdminRequest) -> Summary | None: ...

    async def before_drain(self, state: Store) -> None: ...

    async def after_drain(self, state: Store) -> None: ...


def compose(filters: list[tuple[str, Filter]], terminal: Next) -> Next:
    """Fold filters (outermost first) around ``terminal`` and add the never-leak layer."""
    tracer = trace.get_tracer("mmguard")
    handler = _backend_step(terminal)
    for name, f in reversed(filters):
        handler = _step(name, f, handler, tracer)
    return _guard(handler)


def _step(name: str, f: Filter, nxt: Next, tracer: trace.Tracer) -> Next:
    span_name = f"filter {name}"

    async def step(call: Call) -> Reply:
        try:
            if not tracing_on():
                return await f(call, nxt)
            with tracer.start_as_current_span(span_name):
                return await f(call, nxt)
        except ProxyError:
            raise
        except Exception as exc:
            # Say which filter broke; the outer guard turns this into INTERNAL.
            raise _FilterCrash(name, exc) from exc

    return step


def _backend_step(terminal: Next) -> Next:
    """A crash in the backend is the backend's: say so, rather than blaming the innermost
    filter (whose ``next`` it was)."""
    async def backend(call: Call) -> Reply:
        try:
            return await terminal(call)
        except ProxyError:
            raise
        except Exception as exc:
            target = call.target
            where = (f"backend '{target.backend}' (model '{target.model}')" if target is not None
                     else "the backend")
            log.exception("%s failed: %s", where, exc)
            raise ProxyError(ErrorKind.INTERNAL, f"{where} failed: {type(exc).__name__}: {exc}",
                             origin="backend") from exc

    return backend


class _FilterCrash(Exception):
    def __init__(self, name: str, exc: Exception) -> None:
        super().__init__(f"filter '{name}' failed: {type(exc).__name__}: {exc}")
        self.filter = name


def _guard(handler: Next) -> Next:
    async def guarded(call: Call) -> Reply:
        try:
            return await handler(call)
        except ProxyError as err:
            return LocalReply.from_error(err)
        except Exception as exc:  # the one place that swallows: callers always get an answer
            log.exception("internal error on model %r: %s", call.model, exc)
            return LocalReply(ErrorKind.INTERNAL, f"mmguard internal error: {exc}")
        except asyncio.CancelledError:
            if not cancelled_under():  # the call itself was cancelled
                raise
            log.exception("internal error on model %r: a step was cancelled", call.model)
            return LocalReply(ErrorKind.INTERNAL, "mmguard internal error: a step of the call "
                              "was cancelled although the call was not")

    return guarded
