"""What a config turns into: backends, routes with their composed chains, and live contracts.

A ``Runtime`` is immutable once built; a reload builds a new one (reusing the backends whose
config did not change) and the data plane swaps it in. In-flight calls finish on the runtime
they started on.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from pydantic import BaseModel

from proxy.backends.base import Backend
from proxy.call import CLIENT_DEADLINE, Api, Call, CallKey, LocalReply, Reply, Target
from proxy.chain import FilterContext, Next, compose
from proxy.clock import Clock
from proxy.config.backends import BackendConfig
from proxy.config.model import Config, ModelRoute
from proxy.contract import ModelContract
from proxy.engine.canary import CanaryMatcher, share_hash_for
from proxy.engine.clients import ClientMemories
from proxy.engine.terminal import Terminal
from proxy.errors import ErrorKind, ProxyError, unknown_model
from proxy.keys import Store
from proxy.lifecycle import Observer
from proxy.registry import filter_factories
from proxy.share import ShareHash
from proxy.telemetry import RepeatedFailure, Telemetry

log = logging.getLogger("mmguard.runtime")
_REROUTES: CallKey[int] = CallKey("reroutes")
_MAX_REROUTES = 3


def make_backend(cfg: BackendConfig) -> Backend:
    if cfg.kind == "onnxruntime":
        from proxy.backends.onnxruntime import OnnxRuntimeBackend
        return OnnxRuntimeBackend(cfg)
    if cfg.kind == "triton_grpc":
        from proxy.backends.triton_grpc import TritonGrpcBackend
        return TritonGrpcBackend(cfg)
    if cfg.kind == "vllm":
        from proxy.backends.vllm import VllmBackend
        return VllmBackend(cfg)
    from proxy.backends.triton_http import TritonHttpBackend
    return TritonHttpBackend(cfg)


@dataclass
class Route:
    spec: ModelRoute
    chain: Next

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def target(self) -> Target:
        return Target(self.spec.backend, self.spec.backend_model or self.spec.name,
                      self.spec.version)


class Runtime:
    def __init__(self, config: Config, telemetry: Telemetry, clock: Clock,
                 backends: dict[str, Backend], store: Store | None = None,
                 share_hash: ShareHash | None = None, seed: int | None = None) -> None:
        self.config = config
        self._seed = seed
        """Seeds each filter's ``rng`` (by route and position) when set: tests replay draws."""
        self.share_hash = share_hash or share_hash_for(config)
        self.canary = CanaryMatcher(config, self.share_hash, telemetry)
        lc = config.listeners
        self.clients = ClientMemories({"grpc": lc.grpc.client_header,
                                       "http": lc.http.client_header,
                                       "openai": lc.http.client_header}, clock)
        """Each named client's memory across its unary requests (``listeners.*.client_header``)."""
        self.state = Store() if store is None else store
        """Filter state that outlives a reload (e.g. experiments started through the API)."""
        self.local = Store()
        """This runtime's filter state (e.g. what its chains offer the admin API)."""
        self.telemetry = telemetry
        self.clock = clock
        self.backends = backends
        self.contracts: dict[str, ModelContract] = {}
        self.routes: dict[str, Route] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.start_errors: dict[str, str] = {}
        """Each backend's last failure to start (for the reload that gives up on it)."""
        self.contract_errors: dict[str, str] = {}
        """Each route's last failure to learn its contract (``mmguard status`` says why)."""
        self.backend_ok: dict[str, bool] = {}
        """Each backend's readiness at the last ``ready()``."""
        self._started = {name: asyncio.Event() for name in backends}
        self.terminal = Terminal(backends, self._started, telemetry, clock)
        """Where every route's chain ends: the backend of ``call.target``."""
        self.calls = 0
        """Calls in this runtime now, streams until their last event (``DataPlane._infer``): a
        runtime a reload retired closes its backends once it has none left."""
        self._idle: asyncio.Event | None = None
        self._activations: list[Callable[[], None]] = []
        self._active = False
        """Whether this runtime serves (``activate``): until then it writes no shared series."""
        self._filter_configs: dict[str, dict[str, BaseModel]] = {}
        """Filter name → route → its config there (what ``activated`` hands each factory)."""
        for spec in config.models:
            self.routes[spec.name] = Route(spec, self._build_chain(spec))
        internal = config.internal_routes()
        self.served: dict[str, Route] = {name: route for name, route in self.routes.items()
                                         if name not in internal}
        """The routes clients may call and see (``ModelRoute.internal``); ``routes`` are all,
        for mmguard's own calls (``reroute``)."""
        self.observers: list[Observer] = [
            o for f in filter_factories().values() for o in f.observers(self.state, self.local)]
        """What sees every routed call's final answer (the filters' ``observers``)."""

    def activate(self) -> None:
        """Once this runtime serves: what its filters deferred (starting experiments, taking
        over shared state) happens now, then each filter factory hears of its configs in the
        runtime (experiments the new config dropped end). Building did none of it, so a
        runtime that is never swapped in changed nothing."""
        self._active = True
        for hook in self._activations:
            hook()
        self._activations.clear()
        for name, factory in filter_factories().items():
            factory.activated(self.state, self.local, self._filter_configs.get(name, {}))

    @classmethod
    def build(cls, config: Config, telemetry: Telemetry, clock: Clock,
              previous: Runtime | None = None) -> Runtime:
        backends: dict[str, Backend] = {}
        for cfg in config.backends:
            old = previous.backend_config(cfg.name) if previous else None
            if previous is not None and old == cfg:
                backends[cfg.name] = previous.backends[cfg.name]  # unchanged: keep its connections
            else:
                backends[cfg.name] = make_backend(cfg)
                if (handoff := getattr(backends[cfg.name], "handoff", None)) is not None:
                    handoff.bind(telemetry)  # the shared-memory pool's counters on /metrics
        return cls(config, telemetry, clock, backends,
                   store=previous.state if previous is not None else None)

    def backend_config(self, name: str) -> BackendConfig | None:
        return next((b for b in self.config.backends if b.name == name), None)

    def _build_chain(self, spec: ModelRoute) -> Next:
        factories = filter_factories()
        filters = []
        def contract() -> ModelContract | None:
            return self.contracts.get(spec.name)

        for i, fs in enumerate(self.config.chain(spec)):
            rng = (random.Random() if self._seed is None
                   else random.Random(f"{self._seed}:{spec.name}:{i}"))
            ctx = FilterContext(route=spec.name, telemetry=self.telemetry, clock=self.clock,
                                rng=rng, contract=contract, lookup=self.lookup,
                                count_tokens=self.count_tokens, reroute=self.reroute,
                                local=self.local, state=self.state,
                                share_hash=self.share_hash,
                                on_activate=self._activations.append)
            factory = factories[fs.name]
            self._filter_configs.setdefault(fs.name, {})[spec.name] = fs.config
            filters.append((fs.name, factory.build(fs.config, ctx)))
        return compose(filters, self.terminal)

    def lookup(self, name: str) -> tuple[Target, ModelContract | None] | None:
        """Another route's target and contract (for filters that reroute)."""
        route = self.routes.get(name)
        return None if route is None else (route.target, self.contracts.get(name))

    async def reroute(self, name: str, call: Call) -> Reply:
        """Run ``call`` through route ``name``'s chain, as if the client had asked for it; the
        answer still carries the client's model name."""
        route = self.routes.get(name)
        if route is None:
            # Config validation refuses a reroute to a missing route; a filter's bug lands here.
            return LocalReply(ErrorKind.INTERNAL, f"reroute target '{name}' is not a route")
        hops = call.state.get(_REROUTES, 0) or 0
        if hops >= _MAX_REROUTES:
            return LocalReply(ErrorKind.INTERNAL, f"reroute loop: {hops} reroutes, the last to "
                              f"'{name}'; check the routes' reroute_to settings")
        call.state[_REROUTES] = hops + 1
        call.target = route.target
        return await route.chain(call)

    async def count_tokens(self, call: Call) -> int | None:
        """Prompt tokens as the target backend counts them, where it can (vLLM /tokenize)."""
        assert call.target is not None
        backend = self.backends[call.target.backend]
        count = getattr(backend, "count_tokens", None)
        return None if count is None else int(await count(call, call.target.model))

    async def handle(self, call: Call, route: Route) -> Reply:
        """Run ``call`` through ``route`` (the data plane found it, once, by the call's model):
        the API check, the version, the target, canary membership and the deadline, then the
        route's chain."""
        backend_api = self.backends[route.spec.backend].api
        if call.api is not backend_api:
            speaks_openai = backend_api is Api.OPENAI
            api, front = (("the OpenAI API", "OpenAI") if speaks_openai
                          else ("KServe v2", "KServe v2 (/v2/models/…/infer or gRPC)"))
            return LocalReply(ErrorKind.INVALID_ARGUMENT,
                              f"model '{call.model}' is served over {api} by backend "
                              f"'{route.spec.backend}'; call it through the {front} front",
                              param="model")
        if call.version and route.spec.version and call.version != route.spec.version:
            refusal = unknown_model(call.model, call.version)
            return LocalReply(ErrorKind.NOT_FOUND,
                              f"{refusal.message} (mmguard serves version "
                              f"'{route.spec.version}' of it)")
        target = route.target
        if call.version and not route.spec.version:
            target.version = call.version
        call.target = target
        if call.deadline is not None and CLIENT_DEADLINE not in call.state:
            call.state[CLIENT_DEADLINE] = call.deadline  # only a front set it: the client's
        self.canary.mark(call)
        self.clients.attach(call)
        if route.spec.timeout_s is not None:
            limit = time.monotonic() + route.spec.timeout_s  # same clock as Call.deadline
            call.deadline = limit if call.deadline is None else min(call.deadline, limit)
        return await route.chain(call)

    # --- life cycle -------------------------------------------------------------------------

    async def start(self, started: set[str] | None = None) -> None:
        """Start backends not already started (reused ones are) and watch contracts. Every
        new backend not yet started and every route without a contract has its readiness
        series at 0 once this runtime serves (now, for the first; at the swap, for a reload's:
        a reload that is rejected, or still starting, writes nothing over the serving runtime's
        series of the same names): an alert on ``== 0`` sees a backend that never comes up."""
        fresh = [name for name in self.backends if started is None or name not in started]

        def unready() -> None:
            for name in fresh:
                if not self._started[name].is_set():
                    self.telemetry.backend_ready.labels(name).set(0)
            for route in self.routes.values():
                if route.name not in self.contracts:
                    self.telemetry.route_ready.labels(route.name, route.spec.backend).set(0)

        if self._active:
            unready()
        else:
            self._activations.insert(0, unready)
        for name, backend in self.backends.items():
            if started is None or name not in started:
                self._tasks.append(asyncio.create_task(self._start_backend(name, backend)))
            else:
                self._started[name].set()
        for route in self.routes.values():
            self._tasks.append(asyncio.create_task(self._watch_contract(route)))

    async def wait_started(self, within_s: float, answering: Collection[str] = ()) -> list[str]:
        """Wait (up to ``within_s``) for every backend to have started, and those of them named
        in ``answering`` to answer at their address; the names still not."""
        pending = [n for n, e in self._started.items() if not e.is_set()]
        if pending:
            waits = [asyncio.ensure_future(self._started[n].wait()) for n in pending]
            try:
                await asyncio.wait(waits, timeout=within_s)
            finally:  # also when the reload itself is cancelled
                for w in waits:
                    w.cancel()
        slow = [n for n, e in self._started.items() if not e.is_set()]
        return slow + await self._unreachable(
            [n for n in answering if n in self.backends and n not in slow], within_s)

    async def _unreachable(self, names: Collection[str], within_s: float) -> list[str]:
        """Of the started backends ``names``, those whose server has not answered within
        ``within_s`` (asked every 0.5 s), each one's reason in ``start_errors``: a reload
        replaces a backend only with one that answers at its address."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        pending = list(names)
        while pending:
            reasons = await asyncio.gather(*(self.backends[n].reach() for n in pending))
            for n, why in zip(pending, reasons, strict=True):
                if why is None:
                    self.start_errors.pop(n, None)
                else:
                    self.start_errors[n] = why
            pending = [n for n, why in zip(pending, reasons, strict=True) if why]
            if not pending or loop.time() >= deadline:
                break
            await asyncio.sleep(0.5)
        return pending

    async def _start_backend(self, name: str, backend: Backend) -> None:
        delay = 0.2
        down = RepeatedFailure(log, f"backend {name!r} failed to start", {"backend": name})
        while True:
            try:
                await backend.start()
                self._started[name].set()
                self.start_errors.pop(name, None)
                down.recovered(self.clock.monotonic())
                return
            except Exception as exc:  # keep trying: the model server may start after us
                self.start_errors[name] = f"{type(exc).__name__}: {exc}"
                down.failed(self.clock.monotonic(), f"{exc}; retrying (every {delay:.1f}s "
                            "at first, then every 5s)")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _watch_contract(self, route: Route) -> None:
        target = route.target
        backend = self.backends[target.backend]
        down = RepeatedFailure(log, f"contract of model {route.name!r} not available yet from "
                               f"backend {target.backend!r}", {"model": route.name,
                                                               "backend": target.backend})
        await self._started[target.backend].wait()
        delay = 0.2
        while True:
            try:
                contract = await backend.metadata(target.model, target.version)
            except Exception as exc:
                self.contract_errors[route.name] = f"{type(exc).__name__}: {exc}"
                if route.name not in self.contracts:
                    down.failed(self.clock.monotonic(), str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            down.recovered(self.clock.monotonic())
            self.contract_errors.pop(route.name, None)
            old = self.contracts.get(route.name)
            if old is None:
                log.info("contract of model %r learned from backend %r (fingerprint %s)",
                         route.name, target.backend, contract.fingerprint[:12])
            elif old.fingerprint != contract.fingerprint:
                log.warning("contract of model %r changed on backend %r: %s -> %s",
                            route.name, target.backend, old.fingerprint[:12],
                            contract.fingerprint[:12],
                            extra={"fields": {"model": route.name, "old": old.fingerprint,
                                              "new": contract.fingerprint}})
            self.contracts[route.name] = contract
            delay = 0.2
            await asyncio.sleep(self.config.contract_refresh_s)

    async def ready(self) -> bool:
        """Every backend ready and every route's contract known. Each backend's and route's
        readiness series is set on every call, known contracts or not."""
        results = await asyncio.gather(*(self._backend_ready(n, b)
                                         for n, b in self.backends.items()))
        for name, ok in zip(self.backends, results, strict=True):
            self.backend_ok[name] = ok
            self.telemetry.backend_ready.labels(name).set(1 if ok else 0)
        for route in self.routes.values():
            ok = route.name in self.contracts and self.backend_ok.get(route.spec.backend, False)
            self.telemetry.route_ready.labels(route.name, route.spec.backend).set(1 if ok else 0)
        return all(results) and all(r in self.contracts for r in self.routes)

    async def _backend_ready(self, name: str, backend: Backend) -> bool:
        if not self._started[name].is_set():
            return False  # its session or channel does not exist yet
        try:
            return await backend.ready()
        except Exception:
            return False

    def readiness(self) -> dict[str, dict[str, dict[str, object]]]:
        """Each backend and route: ready or not, and why not (``/readyz``, ``mmguard status``)."""
        backends: dict[str, dict[str, object]] = {}
        for name in self.backends:
            ok = self.backend_ok.get(name, False)
            why = None if ok else (
                f"failed to start: {self.start_errors[name]}" if name in self.start_errors
                else "starting" if not self._started[name].is_set()
                else "its readiness check answers not ready")
            backends[name] = {"ready": ok, "why": why}
        routes: dict[str, dict[str, object]] = {}
        for route in self.routes.values():
            b = route.spec.backend
            why = None
            if route.name not in self.contracts:
                why = (f"contract unknown: {self.contract_errors[route.name]}"
                       if route.name in self.contract_errors
                       else f"contract unknown: waiting for backend '{b}' to start")
            elif not backends[b]["ready"]:
                why = f"backend '{b}' not ready"
            routes[route.name] = {"ready": why is None, "backend": b, "why": why}
        return {"backends": backends, "routes": routes}

    async def model_ready(self, model: str, version: str = "") -> bool:
        route = self.routes.get(model)
        if route is None or model not in self.contracts:
            return False
        target = route.target
        return await self.backends[target.backend].model_ready(target.model,
                                                               version or target.version)

    def contract(self, model: str) -> ModelContract:
        if model not in self.routes:  # never the served names: clients may not list them
            raise unknown_model(model)
        contract = self.contracts.get(model)
        if contract is None:
            raise ProxyError(ErrorKind.UNAVAILABLE,
                             f"model '{model}': backend '{self.routes[model].spec.backend}' has "
                             "not answered with its metadata yet")
        return contract

    def enter(self) -> None:
        """A call took this runtime (its route, chain and backends)."""
        self.calls += 1

    def leave(self) -> None:
        """That call ended (a stream: its last event, or its client left)."""
        self.calls -= 1
        if self.calls == 0 and self._idle is not None:
            self._idle.set()

    async def idle(self) -> None:
        """Until no call is in this runtime. A retired runtime takes no new call (the data
        plane reads its runtime and enters it in one step), so this ends."""
        if self.calls > 0:
            if self._idle is None:
                self._idle = asyncio.Event()
            self._idle.clear()
            await self._idle.wait()

    async def stop_watching(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def close(self, keep: set[str] | None = None, drain: bool = False) -> None:
        """Close the backends not in ``keep`` (``drain``: see ``Backend.close``)."""
        await self.stop_watching()
        self.clients.close()
        for name, backend in self.backends.items():
            if keep is None or name not in keep:
                await backend.close(drain)


def forget_removed(telemetry: Telemetry, old: Runtime, new: Runtime) -> None:
    """Delete the gauge series of the routes and backends ``old`` had and ``new`` has not (a
    reload removed them; see ``Telemetry.forget``)."""
    def pairs(runtime: Runtime) -> set[tuple[str, str]]:
        return {(r.name, r.spec.backend) for r in runtime.routes.values()}
    telemetry.forget(old.routes.keys() - new.routes.keys(), pairs(old) - pairs(new),
                     old.backends.keys() - new.backends.keys())
