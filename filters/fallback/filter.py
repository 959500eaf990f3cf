"""``fallback``: circuit breaker → lighter model → cached answer, and the version fuse.

Guards against a backend that fails, hangs or slows down, and against a canary whose tokenizer
or image processor differs from the one the model was built with. Seed scenario: with no
elasticity P99 2150 ms and 42 % success; breaking, degrading and rolling back to a cached answer
brought it to 320 ms and 99.2 % — and an answer from a lower level always says so.

Levels: L1 is the route's own target; L2 are the routes in ``degrade_to`` (each runs its own
chain, and the call is adapted to its contract: inputs it does not take are dropped, images for a
text-only model; when it cannot be adapted, the level is skipped with the reason); L3 is the last
good L1 answer for the same request (bounded, TTL) or a configured static answer. Each level has
its own breaker. A client error (400, 404) is the client's, not the backend's: it is returned
as it is and does not count against a breaker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from prometheus_client import Counter, Gauge
from pydantic import Field

from filters.answer_reads import answer_reads
from filters.call_keys import FAULTS, touched_by_fault
from filters.fallback.adapt import adapt
from filters.fallback.admin import BREAKERS, CACHED_ANSWERS, ROUTES, breakers_summary
from filters.fallback.breaker import Breaker, BreakerSettings, State
from filters.fallback.cache import AnswerCache as AnswerCache
from filters.fallback.cache import CacheConfig as CacheConfig
from filters.fallback.cache_key import KeyParts, key_parts
from filters.fallback.clone import clone_call
from filters.fallback.fuse_log import log_mismatch
from filters.outcomes import clients_own, missing_version
from proxy.call import ANSWERED_BY, Api, Call, LocalReply, Reply, Result
from proxy.chain import FilterContext, Next
from proxy.errors import ErrorKind, ProxyError
from proxy.lifecycle import AdminRequest, ConfigReferences, FilterFactoryBase, Summary
from proxy.pod.state import share
from proxy.strict import Strict
from proxy.tensor import Tensor

log = logging.getLogger("mmguard.fallback")


class BreakerConfig(Strict):
    window: Literal["count", "time"] = "count"
    window_size: int = Field(20, ge=1)
    """Calls (count window) or seconds (time window)."""
    minimum_calls: int = Field(5, ge=1)
    failure_rate: float = Field(0.5, gt=0, le=1)
    slow_call_s: float = Field(5.0, gt=0)
    slow_call_rate: float = Field(1.0, gt=0, le=1)
    """1.0 with the default slow_call_s: slow calls alone rarely open the breaker."""
    wait_in_open_s: float = Field(10.0, ge=0)
    permitted_in_half_open: int = Field(3, ge=1)


class RetryConfig(Strict):
    attempts: int = Field(1, ge=1, le=10)
    """Tries per level, the first included."""
    backoff_base_s: float = Field(0.025, gt=0)
    backoff_max_s: float = Field(0.25, gt=0)
    budget: float = Field(0.2, ge=0, le=1)
    """Retries in flight may be at most this share of requests in flight (Envoy's budget)..."""
    min_concurrent_retries: int = Field(3, ge=0)
    """...but this many are always allowed."""


class StaticTensor(Strict):
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: list[Any]


class FallbackConfig(Strict):
    breaker: BreakerConfig = BreakerConfig()
    failure_kinds: tuple[str, ...] = ("unavailable", "deadline_exceeded", "internal",
                                      "bad_gateway", "not_found")
    """Error kinds that count as the backend failing (and move to the next level). not_found:
    a model the route serves vanishing is the backend failing — Triton unloads its models while
    it shuts down and answers NOT_FOUND for a while before its port closes. (A model name
    mmguard does not serve is refused before any filter runs.) A backend's own ``cancelled``
    counts too, whatever this says: the client is still there (its leaving cancels the call's
    task, not a reply), so the backend dropped a call it took — Triton cancels its in-flight
    requests as it shuts down."""
    nan_is_failure: bool = True
    """An answer with NaN/Inf in a float output counts as a failure."""
    degrade_to: tuple[str, ...] = ()
    """L2: routes to try in order when L1 cannot answer."""
    level_timeout_s: float | None = Field(None, gt=0)
    """Per level, inside the call's overall deadline."""
    retries: RetryConfig = RetryConfig()
    hedge_after_s: float | None = Field(None, gt=0)
    """Send a second try to the same level when the first has not answered by then."""
    cache: CacheConfig | None = CacheConfig()
    static_answer: tuple[StaticTensor, ...] | None = None
    """L3 when nothing is cached: these outputs (v2 models)."""
    expect_fingerprint: dict[str, str] = Field(default_factory=dict)
    """Route name → the contract fingerprint (or a prefix of it, 12+ characters) it must have;
    a route whose fingerprint differs takes no traffic until it matches again."""

    def references(self) -> ConfigReferences:
        """The L2 routes and the routes given fingerprints (checked at load)."""
        return ConfigReferences(routes=(
            *((f"degrade_to[{i}]", r) for i, r in enumerate(self.degrade_to)),
            *((f"expect_fingerprint.{r}", r) for r in self.expect_fingerprint)))


class Fallback:
    def __init__(self, cfg: FallbackConfig, ctx: FilterContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        t = ctx.telemetry
        self.m_level = t.metric(Counter, "mmguard_fallback_answers_total",
                                "Answers by the level that gave them (1 primary, 2 degraded, "
                                "3 cached/static).", ["model", "level"])
        self.m_state = t.metric(Gauge, "mmguard_breaker_state", "0 closed, 1 open, 2 half-open,"
                                " 3 forced open, 4 forced closed.", ["model", "level"])
        self.m_mismatch = t.metric(Counter, "mmguard_model_load_mismatch_total",
                                   "Calls refused a route whose fingerprint differs from the "
                                   "expected one.", ["model", "route"])
        self.levels = [ctx.route, *cfg.degrade_to]
        for n in ("1", "2", "3"):  # at 0 from the start: increase() misses a child born at 1
            self.m_level.labels(ctx.route, n)
        for name in self.levels:
            self.m_mismatch.labels(ctx.route, name)
        self.breakers = {name: self._breaker(name) for name in self.levels}
        ctx.local.setdefault(BREAKERS, dict).update(
            {(ctx.route, name): b for name, b in self.breakers.items()})
        self.cache = AnswerCache(cfg.cache, ctx.clock.monotonic) if cfg.cache else None
        if self.cache is not None:  # quality's graded actions serve it too
            ctx.local.setdefault(CACHED_ANSWERS, dict)[ctx.route] = self.cached_answer
            self.m_cache_bytes = t.metric(
                Gauge, "mmguard_answer_cache_bytes", "Bytes the route's cached answers keep "
                "alive, with the requests of those not yet keyed (at most its "
                "fallback.cache.max_bytes).", ["model"]).labels(ctx.route)
            self.m_cache_skipped = t.metric(
                Counter, "mmguard_answer_cache_skipped_total", "Good answers not cached: over "
                "fallback.cache.max_entry_bytes.", ["model"]).labels(ctx.route)
            self._told_too_large = False
        self.in_flight = 0
        self.retrying = 0
        self._keying: asyncio.Future[None] | None = None
        self._level_children: dict[tuple[str, str], Any] = {}

    async def cached_answer(self, call: Call) -> tuple[float, Result] | None:
        """(age in seconds, the last good answer to the same request), if cached; a large
        read keyed off the loop, as the filter's own."""
        found = await self._read_off_loop(key_parts(call))
        return None if found is None else (self.ctx.clock.monotonic() - found[0], found[1])

    async def _read_off_loop(self, key: KeyParts | None) -> tuple[float, Result] | None:
        """``_read``, the MACs of a large read run in a worker thread first (as quality measures
        a large image): the first read after many good calls keys up to ``max_bytes`` of
        requests, ~13 ms for 64 MiB. Concurrent reads wait for one such run."""
        cache = self.cache
        own = sum(len(p) for p in key.payloads) if key is not None else 0
        if cache is not None and key is not None and cache.undigested_bytes + own > \
                _INLINE_MAC_BYTES:
            if self._keying is None:
                todo = [*cache.undigested_keys(), key]
                self._keying = asyncio.ensure_future(asyncio.to_thread(_digest_each, todo))
                self._keying.add_done_callback(self._keyed)
            await asyncio.shield(self._keying)
            if not key.digested and own > _INLINE_MAC_BYTES:  # it waited on another's run
                await asyncio.to_thread(key.digest)
        return self._read(key)

    def _keyed(self, _: object) -> None:
        self._keying = None

    def _read(self, key: KeyParts | None) -> tuple[float, Result] | None:
        """The cache's entry for ``key``; reading keys what it holds, so its bytes are said
        again."""
        if self.cache is None or key is None:
            return None
        found = self.cache.get(key)
        self.m_cache_bytes.set(self.cache.bytes)
        return found

    def _breaker(self, level: str) -> Breaker:
        b = self.cfg.breaker
        settings = BreakerSettings(b.window, b.window_size, b.minimum_calls, b.failure_rate,
                                   b.slow_call_s, b.slow_call_rate, b.wait_in_open_s,
                                   b.permitted_in_half_open)
        gauge = self.m_state.labels(self.ctx.route, level)
        status = self.ctx.telemetry.one_hot(
            "mmguard_breaker_status", "The breaker's state, one-hot (sum by state across pods).",
            ["model", "level"], [st.name.lower() for st in State])

        def changed(old: State, new: State, reason: str) -> None:
            gauge.set(int(new))
            status.set((self.ctx.route, level), new.name.lower())
            log.warning("breaker of route %r level %r: %s -> %s (%s)", self.ctx.route, level,
                        old.name.lower(), new.name.lower(), reason,
                        extra={"fields": {"model": self.ctx.route, "level": level,
                                          "state": new.name.lower(), "reason": reason}})

        def imported(new: State) -> None:
            gauge.set(int(new))
            status.set((self.ctx.route, level), new.name.lower())

        breaker = Breaker(settings, self.ctx.clock, changed, imported)

        def activate() -> None:
            # Once its runtime serves: a rejected reload's breakers neither take anything over
            # nor write the gauges the serving ones keep (a reload that failed had set every
            # breaker's gauges back to closed while they stayed open).
            imported(State.CLOSED)
            share(breaker, f"breaker/{self.ctx.route}/{level}")

        self.ctx.on_activate(activate)
        return breaker

    async def __call__(self, call: Call, next: Next) -> Reply:
        if call.streaming:
            # a stream goes through the version fuse before its first byte
            why = self._fused(call, self.ctx.route)
            if why:
                return LocalReply(ErrorKind.UNAVAILABLE, f"model '{call.model}': {why}")
            return await next(call)  # a stream's first bytes are the client's; not retried
        self.in_flight += 1
        try:
            return await self._serve(call, next)
        finally:
            self.in_flight -= 1

    async def _serve(self, call: Call, next: Next) -> Reply:
        key = key_parts(call) if self.cache is not None else None  # digested if ever read
        reasons: list[str] = []
        for i, level in enumerate(self.levels):
            why = self._fused(call, level)
            if why:
                reasons.append(f"L{min(i + 1, 2)} '{level}': {why}")
                continue
            breaker = self.breakers[level]
            if not breaker.allow():
                reasons.append(f"L{min(i + 1, 2)} '{level}': breaker {breaker.state.name.lower()}"
                               f" ({breaker.reason})")
                continue
            attempt = self._clone(call)
            if i > 0:
                why = adapt(attempt, level, self.ctx)
                if why:
                    reasons.append(f"L2 '{level}': {why}")
                    continue
            send = next if i == 0 else self._rerouted(level)
            start = self.ctx.clock.monotonic()
            faults_before = _fault_count(call)
            reply, failed = await self._tries(attempt, send)
            own = clients_own(call, reply, self.cfg.breaker.slow_call_s)
            if _fault_count(call) == faults_before and not own:
                breaker.record(failed, self.ctx.clock.monotonic() - start)
            # else: a fault experiment, or the client (its short deadline, a version that does
            # not exist), made this outcome; the backend's breaker never counts it
            if not failed:
                call.target = attempt.target
                if isinstance(reply, LocalReply):
                    return reply  # the client's own error: no fallback for a bad request
                return self._answered(call, reply, i, level, key, reasons)
            reasons.append(f"L{min(i + 1, 2)} '{level}': {_describe(reply, attempt)}")
        return await self._last_resort(call, key, reasons)

    # --- one level ----------------------------------------------------------------------------

    def _clone(self, call: Call) -> Call:
        return clone_call(call)

    def _rerouted(self, level: str) -> Callable[[Call], Awaitable[Reply]]:
        assert self.ctx.reroute is not None
        reroute = self.ctx.reroute

        async def send(call: Call) -> Reply:
            return await reroute(level, call)

        return send

    async def _tries(self, call: Call,
                     send: Callable[[Call], Awaitable[Reply]]) -> tuple[Reply, bool]:
        retries = self.cfg.retries
        tries = 0
        while True:
            # The level's own copy serves the first try; a retry needs a fresh one.
            attempt = self._clone(call) if tries else call
            if self.cfg.level_timeout_s is not None:
                limit = time.monotonic() + self.cfg.level_timeout_s
                attempt.deadline = limit if call.deadline is None else min(call.deadline, limit)
            reply = await self._hedged(attempt, send)
            tries += 1
            failed = self._failed(attempt, reply)
            if not failed or tries >= retries.attempts or not self._may_retry(call):
                call.target = attempt.target
                return reply, failed
            delay = min(retries.backoff_max_s, retries.backoff_base_s * 2 ** (tries - 1))
            delay *= self.ctx.rng.uniform(0.5, 1.5)  # jitter: retries of many calls spread out
            remaining = call.remaining()
            if remaining is not None and remaining <= delay:
                return reply, failed
            self.ctx.telemetry.decide(call, "fallback", "retry", f"try {tries + 1} after "
                                      f"{delay * 1000:.0f} ms: {_describe(reply, attempt)}",
                                      header="retry")
            self.retrying += 1
            try:
                await self.ctx.clock.sleep(delay)
            finally:
                self.retrying -= 1

    def _may_retry(self, call: Call) -> bool:
        allowed = max(self.cfg.retries.min_concurrent_retries,
                      int(self.cfg.retries.budget * self.in_flight))
        if self.retrying >= allowed:
            self.ctx.telemetry.decide(call, "fallback", "retry-budget-exhausted",
                                      f"{self.retrying} retries in flight", header="retry")
            return False
        return True

    async def _hedged(self, call: Call, send: Callable[[Call], Awaitable[Reply]]) -> Reply:
        if self.cfg.hedge_after_s is None:
            return await send(call)
        tries = {asyncio.ensure_future(send(call))}
        try:  # a client that leaves ends both tries (asyncio.wait leaves them running)
            done, _ = await asyncio.wait(tries, timeout=self.cfg.hedge_after_s)
            if done:
                return done.pop().result()
            self.ctx.telemetry.decide(call, "fallback", "hedge", f"no answer after "
                                      f"{self.cfg.hedge_after_s * 1000:.0f} ms", header="hedge")
            tries.add(asyncio.ensure_future(send(self._clone(call))))
            done, _ = await asyncio.wait(tries, return_when=asyncio.FIRST_COMPLETED)
            return done.pop().result()
        finally:
            for task in tries:
                task.cancel()  # the slower try (a done one ignores it)

    def _failed(self, call: Call, reply: Reply) -> bool:
        if isinstance(reply, LocalReply):
            if missing_version(call, reply):
                return False  # the client's version does not exist: its own error, no fallback
            return reply.kind.value in self.cfg.failure_kinds or reply.dropped_by_backend
        if not self.cfg.nan_is_failure or reply.stream is not None:
            return False
        if reply.wire is not None and reply.wire.api is Api.OPENAI:
            return False
        return _unusable(reply, call) is not None

    def _fused(self, call: Call, level: str) -> str:
        expected = self.cfg.expect_fingerprint.get(level)
        if not expected:
            return ""
        found = self.ctx.lookup(level)
        actual = found[1].fingerprint if found and found[1] else ""
        if actual.startswith(expected) and (len(expected) >= 12 or actual == expected):
            return ""
        self.m_mismatch.labels(call.model, level).inc()
        why = f"fingerprint mismatch: expected {expected}, backend has {actual or '?'}"
        log_mismatch(log, call.model, level, expected, actual)  # once at WARNING
        self.ctx.telemetry.decide(call, "fallback", "fused", f"'{level}': {why}", header="fuse",
                                  expected=expected, actual=actual)
        return why

    # --- answers ------------------------------------------------------------------------------

    def _count(self, model: str, level: str) -> None:
        child = self._level_children.get((model, level))
        if child is None:
            child = self._level_children[(model, level)] = self.m_level.labels(model, level)
        child.inc()

    def _answered(self, call: Call, result: Result, index: int, level: str,
                  key: KeyParts | None,
                  reasons: list[str]) -> Result:
        n = min(index + 1, 2)
        self._count(call.model, str(n))
        if n == 1:
            if self.cache is not None and key is not None and not touched_by_fault(call):
                self._keep(call, key, result)
            return result
        self.ctx.telemetry.decide(call, "fallback", str(n), f"answered by '{level}': "
                                  + "; ".join(reasons), header="level")
        if call.target is not None:
            call.state[ANSWERED_BY] = call.target.backend
        return result

    def _keep(self, call: Call, key: KeyParts, result: Result) -> None:
        assert self.cache is not None
        if self.cache.put(key, result) is None:
            self.m_cache_skipped.inc()
            if not self._told_too_large:  # once per route: the metric counts the rest
                self._told_too_large = True
                log.warning("fallback: answers of model '%s' over %d bytes are not cached "
                            "(fallback.cache.max_entry_bytes); counted in "
                            "mmguard_answer_cache_skipped_total", call.model,
                            self.cache.cfg.max_entry_bytes)
        self.m_cache_bytes.set(self.cache.bytes)

    async def _last_resort(self, call: Call, key: KeyParts | None,
                           reasons: list[str]) -> Reply:
        cached = await self._read_off_loop(key)
        if cached is not None:
            age = self.ctx.clock.monotonic() - cached[0]
            self._count(call.model, "3")
            self.ctx.telemetry.decide(call, "fallback", "3", f"cached answer, {age:.1f}s old: "
                                      + "; ".join(reasons), header="level")
            call.decisions["mmguard-stale"] = "true"
            call.state[ANSWERED_BY] = "(cache)"
            return cached[1]
        if self.cfg.static_answer is not None and call.api is Api.KSERVE_V2:
            self._count(call.model, "3")
            self.ctx.telemetry.decide(call, "fallback", "3", "static answer: "
                                      + "; ".join(reasons), header="level")
            call.decisions["mmguard-stale"] = "true"
            call.state[ANSWERED_BY] = "(static)"
            return Result(call.model, "", call.id, [_static(s) for s in self.cfg.static_answer])
        retry = min((b.retry_after_s() for b in self.breakers.values()
                     if b.state == State.OPEN), default=1.0)
        message = f"model '{call.model}': no level could answer: " + "; ".join(reasons)
        self.ctx.telemetry.decide(call, "fallback", "exhausted", message, header="level")
        return LocalReply(ErrorKind.UNAVAILABLE, message, retry_after_s=max(retry, 1.0))


_INLINE_MAC_BYTES = 1 << 20
"""A cache read whose MACs would run over more than this is keyed in a worker thread."""


def _digest_each(keys: list[KeyParts]) -> None:
    """Run each key's MAC (BLAKE3 lets the GIL go over long inputs)."""
    for key in keys:
        key.digest()


def _describe(reply: Reply, call: Call) -> str:
    if isinstance(reply, LocalReply):
        return f"{reply.kind.name} {reply.message}"
    return _unusable(reply, call) or "non-finite values in the answer"


def _unusable(reply: Result, call: Call) -> str | None:
    """Why an answer cannot be served: non-finite values, or tensors that cannot be read (bytes
    that do not fit their shape: a truncated or garbled answer). None when it is fine. Read
    once per answer with the other filters of the call (filters/answer_reads.py)."""
    try:
        if not answer_reads(call, reply).all_finite():
            return "non-finite values in the answer"
    except (ProxyError, ValueError) as exc:
        message = exc.message if isinstance(exc, ProxyError) else str(exc)
        return f"unreadable answer: {message}"
    return None


def _static(s: StaticTensor) -> Tensor:
    t = Tensor(s.name, s.datatype, s.shape, data=s.data)
    t.raw_bytes()
    return t


class FallbackFactory(FilterFactoryBase):
    name = "fallback"
    config_model = FallbackConfig
    admin_routes = ROUTES

    async def summary(self, req: AdminRequest) -> Summary:
        return await breakers_summary(req)

    def build(self, config: FallbackConfig, ctx: FilterContext) -> Fallback:
        return Fallback(config, ctx)


def _fault_count(call: Call) -> int:
    faults = call.state.get(FAULTS)
    return 0 if faults is None else len(faults)
