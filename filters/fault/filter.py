"""The fault filter: which canary calls an experiment touches, and the faults it injects."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import numpy as np
from prometheus_client import Counter
from pydantic import BaseModel

from filters.call_keys import FAULTS, OFF_LANE
from filters.fault import rules
from filters.fault.admin import ROUTES, experiments_summary
from filters.fault.config import (
    MAX_DELAY_MS,
    SEEN,
    Abort,
    ActionBase,
    Delay,
    FaultConfig,
    InputAction,
    OutputFault,
    StreamFault,
)
from filters.fault.injectors import (
    _corrupt_output,
    _corrupt_stream,
    _perturb_openai,
    _perturb_tensors,
)
from filters.fault.registry import (
    EXPERIMENTS,
    FAULT_ROUTES,
    Experiment,
    registry,
)
from proxy.call import CANARY, SHOW_TREATMENT, Api, Call, LocalReply, Reply, headers_match
from proxy.chain import FilterContext, Next
from proxy.errors import STATUS, ErrorKind, kind_from_grpc, kind_from_http
from proxy.keys import Store
from proxy.lifecycle import AdminRequest, FilterFactoryBase, Observer, Summary

log = logging.getLogger("mmguard.fault")
STOP_POLL_S = 0.05
"""How often an injected wait looks whether its experiment was stopped."""




def _seed(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Fault:
    def __init__(self, cfg: FaultConfig, ctx: FilterContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.registry = registry(ctx)
        self.m_injected = ctx.telemetry.metric(
            Counter, "mmguard_faults_injected_total",
            "Faults injected into canary calls (never counted as the backend's failures).",
            ["model", "experiment", "action"])
        for exp in cfg.experiments:  # at 0 from the start, so increase() sees the first
            for action in exp.actions:
                self.m_injected.labels(ctx.route, exp.name, action.label)
        ctx.on_activate(self._start_experiments)
        ctx.local.setdefault(FAULT_ROUTES, set).add(ctx.route)

    def _start_experiments(self) -> None:
        for exp in self.cfg.experiments:  # a reload restarts only what changed
            old = self.registry.experiments.get(exp.name)
            if old is None or old.cfg != exp or old.route != self.ctx.route:
                self.registry.start(exp, self.ctx.route, "config")

    async def __call__(self, call: Call, next: Next) -> Reply:
        if not call.state.get(CANARY):
            return await next(call)
        running = self.registry.running(self.ctx.route)
        if not running:
            return await next(call)
        chosen: list[tuple[Experiment, int, ActionBase]] = []
        shares = self.ctx.share_hash
        key = shares.request_key(call)
        for exp in running:
            why = exp.check()
            if why:
                self.registry.auto_stop(exp, why)
                continue
            if not headers_match(exp.cfg.headers, call.headers):
                continue
            if exp.cfg.share < 1 and not shares.in_share(f"experiment:{exp.name}", key,
                                                         exp.cfg.share):
                continue
            seen = call.state.get(SEEN)
            if seen is None:
                call.state[SEEN] = seen = []
            seen.append(exp.name)
            if rules.in_baseline(exp):  # the baseline: observed, not injected
                self.registry.tally(exp.name, matched=1, baseline=1)
                continue
            if exp.cfg.max_active_faults is not None and exp.active >= exp.cfg.max_active_faults:
                self.registry.tally(exp.name, matched=1, skipped=1)
                self.ctx.telemetry.decide(call, "fault", "skipped", f"{exp.name}: "
                                          f"{exp.active} faults active (max "
                                          f"{exp.cfg.max_active_faults})", treatment=True)
                continue
            for i, action in enumerate(exp.cfg.actions):
                if not headers_match(action.headers, call.headers):
                    continue
                if action.percent < 100 and not shares.in_share(
                        f"action:{exp.cfg.seed}:{exp.name}:{i}", key, action.percent / 100):
                    continue
                chosen.append((exp, i, action))
            self.registry.tally(exp.name, matched=1)
        if not chosen:
            return await next(call)
        exps = {id(e): e for e, _, _ in chosen}.values()
        for exp in exps:
            exp.active += 1
        try:
            return await self._inject(call, next, chosen)
        finally:
            for exp in exps:
                exp.active -= 1

    def _mark(self, call: Call, exp: Experiment, action: ActionBase, detail: str) -> str:
        tag = f"{exp.name}/{action.label}"
        faults = call.state.get(FAULTS)
        if faults is None:
            call.state[FAULTS] = faults = []
        faults.append(tag)
        self.registry.tally(exp.name, injected=action.label, at=self.ctx.clock.monotonic())
        self.m_injected.labels(call.model, exp.name, action.label).inc()
        previous = call.decisions.get("mmguard-fault")
        self.ctx.telemetry.decide(call, "fault", tag, detail, experiment=exp.name,
                                  action=action.label, treatment=True)
        if previous:  # several faults on one call: keep them all in the header
            call.decisions["mmguard-fault"] = f"{previous}, {call.decisions['mmguard-fault']}"
        return tag

    async def _inject(self, call: Call, next: Next,
                      chosen: list[tuple[Experiment, int, ActionBase]]) -> Reply:
        shares = self.ctx.share_hash
        key = shares.request_key(call)
        after: list[tuple[Experiment, int, ActionBase]] = []
        for exp, i, action in chosen:
            if isinstance(action, Delay):
                seconds = self._delay_s(action, _seed(exp.cfg.seed, exp.name, i, key))
                self._mark(call, exp, action, f"delay {seconds * 1000:.0f} ms")
                _leave_lane(call)
                await self._sleep(exp, seconds)
            elif isinstance(action, Abort):
                tag = self._mark(call, exp, action, "abort")
                return _abort(action, tag, _shown(call, tag))
            elif isinstance(action, StreamFault) and action.kind == "reset" and not call.streaming:
                tag = self._mark(call, exp, action, "connection reset")
                return LocalReply(ErrorKind.UNAVAILABLE, f"connection reset{_shown(call, tag)}",
                                  injected=tag, reset=True)
            elif isinstance(action, InputAction):
                rng_seed = _seed(exp.cfg.seed, exp.name, i, key)
                try:
                    detail = self._perturb_input(call, action, rng_seed)
                except Exception as exc:  # a broken action stops its experiment, not the call
                    self.registry.action_failed(exp.name, f"action '{action.label}' failed: "
                                                f"{type(exc).__name__}: {exc}")
                    continue
                if detail:
                    self._mark(call, exp, action, detail)
            else:
                after.append((exp, i, action))
        reply = await next(call)
        if isinstance(reply, LocalReply):
            return reply
        for exp, _, action in after:
            if isinstance(action, OutputFault) and reply.stream is None:
                detail = _corrupt_output(reply, action)
                if detail:
                    self._mark(call, exp, action, detail)
            elif isinstance(action, StreamFault) and reply.stream is not None:
                tag = self._mark(call, exp, action, _stream_detail(action))
                if action.kind == "slow_stream":
                    _leave_lane(call)
                reply.stream = self._faulty_stream(reply.stream, exp, action, tag,
                                                   _shown(call, tag))
            elif isinstance(action, OutputFault) and reply.stream is not None:
                tag = self._mark(call, exp, action, f"{action.kind} on the stream's text")
                reply.stream = _corrupt_stream(reply.stream, action)
        return reply

    def _delay_s(self, a: Delay, seed: int) -> float:
        rng = np.random.default_rng(seed)
        if a.ms is not None:
            ms = a.ms
        elif a.mean_ms is not None:
            ms = min(max(0.0, float(rng.normal(a.mean_ms, a.std_ms))), MAX_DELAY_MS)
        else:
            assert a.min_ms is not None and a.max_ms is not None
            ms = float(rng.uniform(a.min_ms, a.max_ms))
        return ms / 1000

    async def _sleep(self, exp: Experiment, seconds: float) -> None:
        """An injected wait, cut short once its experiment stops (the kill switch, a verdict's
        abort, shutdown): the call then goes on as a clean one. The state is looked at every
        ``STOP_POLL_S`` (a stop may come from the supervisor of another process)."""
        left = seconds
        while left > 0 and self._running(exp):
            step = min(left, STOP_POLL_S)
            await self.ctx.clock.sleep(step)
            left -= step

    def _running(self, exp: Experiment) -> bool:
        """Whether this run of ``exp`` still runs (a worker's registry takes the supervisor's
        experiments as new objects)."""
        now = self.registry.experiments.get(exp.name)
        return now is not None and now.running and now.started_wall == exp.started_wall

    async def _faulty_stream(self, items: AsyncIterator[Any], exp: Experiment, a: StreamFault,
                             tag: str, shown: str) -> AsyncIterator[Any]:
        n = 0
        async for item in items:
            if not self._running(exp):  # stopped: the rest of the stream as it comes
                pass
            elif a.kind == "slow_stream":
                await self._sleep(exp, a.ms / 1000)
            elif n >= a.after_events:
                if a.kind == "cut_stream":
                    yield LocalReply(ErrorKind.UNAVAILABLE, f"stream cut after {n} events"
                                     f"{shown}", injected=tag)
                else:
                    yield LocalReply(ErrorKind.UNAVAILABLE, f"connection reset after {n} "
                                     f"events{shown}", injected=tag, reset=True)
                return
            yield item
            n += 1

    # --- inputs -------------------------------------------------------------------------------

    def _perturb_input(self, call: Call, a: InputAction, seed: int) -> str:
        if call.api is Api.OPENAI:
            return _perturb_openai(call, a, seed)
        return _perturb_tensors(call, a, seed)


def _leave_lane(call: Call) -> None:
    """A faulted copy is about to wait: free the shadow worker that sent it (``OFF_LANE``)."""
    leave = call.state.get(OFF_LANE)
    if leave is not None:
        leave()


def _stream_detail(a: StreamFault) -> str:
    if a.kind == "slow_stream":
        return f"slow stream: +{a.ms:g} ms per event"
    return f"{a.kind.replace('_', ' ')} after {a.after_events} events"


def _shown(call: Call, tag: str) -> str:
    """`` (<experiment>/<action>)`` for a client whose listener shows treatment, else nothing:
    an injected failure looks like the failure it emulates (docs/security.md)."""
    return f" ({tag})" if call.state.get(SHOW_TREATMENT) else ""


def _abort(a: Abort, tag: str, shown: str) -> LocalReply:
    import grpc
    if a.grpc_code is not None:
        kind = kind_from_grpc(grpc.StatusCode[a.grpc_code.upper()])
    elif a.http_status is not None:
        kind = kind_from_http(a.http_status)
    else:
        kind = ErrorKind.UNAVAILABLE
    status = a.http_status if a.http_status is not None else STATUS[kind].http
    return LocalReply(kind, f"{a.message}{shown}", status=status, injected=tag)



class FaultFactory(FilterFactoryBase):
    name = "fault"
    config_model = FaultConfig
    admin_routes = ROUTES

    async def summary(self, req: AdminRequest) -> Summary:
        return await experiments_summary(req)

    def build(self, config: FaultConfig, ctx: FilterContext) -> Fault:
        return Fault(config, ctx)

    def activated(self, state: Store, local: Store, configs: Mapping[str, BaseModel]) -> None:
        """The config's experiments that the new config no longer has end."""
        reg = state.get(EXPERIMENTS)
        if reg is not None:
            reg.retire({e.name for c in configs.values() if isinstance(c, FaultConfig)
                        for e in c.experiments})

    def observers(self, state: Store, local: Store) -> Sequence[Observer]:
        reg = state.get(EXPERIMENTS)
        return () if reg is None else (reg.observe,)

    async def before_drain(self, state: Store) -> None:
        """Faults end first: draining calls get clean answers."""
        reg = state.get(EXPERIMENTS)
        if reg is not None:
            reg.stop_all("mmguard is shutting down", "shutdown")

