"""The shadow filter: mirror a share of calls to the canary and judge the pairs."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from opentelemetry.trace import SpanContext
from prometheus_client import Counter, Gauge

from filters.call_keys import FAULTS, OFF_LANE
from filters.compare import Comparison, compare_status, compare_tensors, compare_text, openai_text
from filters.fault.registry import EXPERIMENTS

# clean-copy correctness and robustness experiments live in their own modules
from filters.robustness.experiment import (
    Baselines,
    RobustnessExperiment,
    RobustnessMetrics,
    RobustnessTable,
)
from filters.robustness.verdict import ReleaseVerdict
from filters.shadow.admin import SHADOW_STATES, shadow_routes, verdicts_summary
from filters.shadow.config import ShadowConfig
from filters.shadow.copies import (
    Copy,
    HeldBytes,
    Sent,
    arrays,
    code,
    freeing,
    fresh,
    paired_latency,
    snapshot,
    stream_text,
)
from filters.shadow.replay import UNJUDGED_REASONS, client_caused, content_key_of, shed_here
from filters.shadow.state import ShadowState
from proxy.call import (
    BACKEND_S,
    CANARY_ELIGIBLE,
    CANARY_POPULATION,
    Api,
    Call,
    LocalReply,
    Reply,
    Result,
    SseEvent,
    headers_match,
)
from proxy.chain import FilterContext, Next
from proxy.keys import Store
from proxy.lifecycle import AdminRequest, FilterFactoryBase, StateKey, Summary
from proxy.pod.state import POD, share
from proxy.telemetry import caused_by, linked_span

log = logging.getLogger("mmguard.shadow")

_STATES = {"collecting": 0, "promote": 1, "hold": 2, "abort": 3}
GAUGES_EVERY_S = 0.25
"""How often at most the verdict's gauges are rebuilt from its snapshot (``Shadow._publish``)."""

SHADOWS: StateKey[dict[str, Shadow]] = StateKey("shadows")
"""Route → its shadow filter in this runtime (``FilterContext.local``)."""
LIVE_SHADOWS: StateKey[dict[str, Shadow]] = StateKey("shadow_filters")
"""Route → the shadow filter that serves (``FilterContext.state``): its workers end when the
next one takes over, or after the drain on shutdown."""


class Shadow:
    def __init__(self, cfg: ShadowConfig, ctx: FilterContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        found = (ctx.state.get(SHADOW_STATES) or {}).get(ctx.route)
        if found is None or found.cfg != cfg:
            verdict = ReleaseVerdict(cfg.verdict, ctx.clock,  # correctness + robustness
                                     expect_noise=cfg.noise_floor_percent > 0,
                                     robustness=cfg.robustness)
            found = ShadowState(cfg, verdict)
            found.verdict.on_change(self._changed)
        self.state: ShadowState = found
        ctx.local.setdefault(SHADOWS, dict)[ctx.route] = self
        ctx.on_activate(self._take_over)
        self.queue: asyncio.Queue[Copy] | None = None
        self.held = HeldBytes()
        self.workers: list[asyncio.Task[None]] = []
        self._gauges_due, self._gauges_at = False, -GAUGES_EVERY_S
        self.waiting: set[asyncio.Task[None]] = set()
        """Copies a fault made wait, off their lane (``_work``)."""
        self.robustness = self.robustness_metrics = None  # no robustness block: no experiment
        if cfg.robustness is not None and found.verdict.robustness is not None:
            # Measured into a scratch table, handed to the state per copy (``robust``): the
            # one table is the pod's (each worker takes its part of the rate cap).
            self.robustness = RobustnessExperiment(cfg.robustness,
                                                   RobustnessTable(cfg.robustness),
                                                   cfg.timeout_s, workers=POD.workers)
            self.robustness_metrics = RobustnessMetrics(ctx.telemetry, ctx.route, cfg.canary,
                                                        cfg.robustness)
        t = ctx.telemetry
        labels = ["model", "canary"]
        self.m_mirrored = t.metric(Counter, "mmguard_shadow_mirrored_total",
                                   "Calls copied to the canary.", labels)
        self.m_dropped = t.metric(Counter, "mmguard_shadow_dropped_total",
                                  "Copies not sent to the canary, by why.", [*labels, "reason"])
        self.m_unjudged = t.metric(Counter, "mmguard_shadow_unjudged_total",
                                   "Calls whose canary comparison would not be evidence, by "
                                   "why: a replay of a request judged in this window, or a "
                                   "production failure the client caused.", [*labels, "reason"])
        for why in UNJUDGED_REASONS:
            self.m_unjudged.labels(ctx.route, cfg.canary, why)
        self.m_compared = t.metric(Counter, "mmguard_shadow_comparisons_total",
                                   "Canary answers compared with production's.",
                                   [*labels, "agree"])
        self.m_agreement = t.metric(Gauge, "mmguard_shadow_agreement",
                                    "Share of the window's comparisons that agreed (after the "
                                    "noise floor).", labels)
        self.m_verdict = t.metric(Gauge, "mmguard_shadow_verdict",
                                  "0 collecting, 1 promote, 2 hold, 3 abort.", labels)
        self.m_verdict_status = t.one_hot(
            "mmguard_shadow_verdict_status", "The canary verdict, one-hot (sum by state across "
            "pods).", labels, list(_STATES))
        self.population = "every call in the share"
        """Which calls the verdict judges (``canary.eligible``), as the last call said."""
        self.m_evidence = t.metric(
            Gauge, "mmguard_shadow_evidence", "The verdict's evidence: the estimate and anytime "
            "bounds of each test (test: agreement, latency; figure: estimate, lower, upper, "
            "samples; latency = share of pairs slower than the margin).",
            [*labels, "test", "figure"])
        for reason in ("v2-stream", "queue-full", "fault-backlog"):  # at 0 from the start
            self.m_dropped.labels(ctx.route, cfg.canary, reason)
        for agree in ("true", "false"):
            self.m_compared.labels(ctx.route, cfg.canary, agree)
        self.m_verdict.labels(ctx.route, cfg.canary).set(_STATES[found.verdict.state()])
        self.m_verdict_status.set((ctx.route, cfg.canary), found.verdict.state())

    def _take_over(self) -> None:
        """Once this filter's runtime serves (never at build: a rejected reload changes
        nothing): its state is the route's, and the old filter's workers end."""
        self.ctx.state.setdefault(SHADOW_STATES, dict)[self.ctx.route] = self.state
        self.state.published = self._publish
        self.state.on_unjudged = self._unjudged
        share(self.state, f"shadow/{self.ctx.route}")
        live = self.ctx.state.setdefault(LIVE_SHADOWS, dict)
        old = live.get(self.ctx.route)
        if old is not None and old is not self:
            old.cancel()
        live[self.ctx.route] = self

    # --- request path -------------------------------------------------------------------------

    async def __call__(self, call: Call, next: Next) -> Reply:
        st = self.state
        if not st.mirroring or not self._selected(call):
            return await next(call)
        if call.state.get(CANARY_ELIGIBLE) is False:  # canary.eligible: not this population
            self.population = call.state.get(CANARY_POPULATION) or self.population
            self.m_dropped.labels(self.ctx.route, self.cfg.canary, "ineligible").inc()
            return await next(call)
        self.population = call.state.get(CANARY_POPULATION) or "every call in the share"
        if call.streaming and call.api is Api.KSERVE_V2:
            # A v2 decoupled stream has no one answer to compare: not mirrored, and counted.
            self.m_dropped.labels(self.ctx.route, self.cfg.canary, "v2-stream").inc()
            return await next(call)
        copy = snapshot(call)
        before = call.state.get(BACKEND_S) or 0.0  # an outer filter's earlier try: not ours
        start = time.monotonic()
        reply = await next(call)
        latency = time.monotonic() - start
        spent = call.state.get(BACKEND_S)
        backend_s = None if spent is None else spent - before
        noise = (self.cfg.noise_floor_percent > 0
                 and self.ctx.rng.random() * 100 < self.cfg.noise_floor_percent)
        if isinstance(reply, Result) and reply.stream is not None:
            reply.stream = self._tee(reply.stream, copy, latency, noise, next, call, caused_by())
            return reply
        if self._admitted(call, reply):
            self._enqueue(call, Copy(copy, reply, latency, None, noise, next, cause=caused_by(),
                                     primary_backend_s=backend_s))
        return reply

    def _admitted(self, call: Call, primary: Reply) -> bool:
        """Not when production failed because of the request itself (filters/shadow/replay.py):
        counted, never judged, and the canary is not asked."""
        why = client_caused(call, primary, self.cfg.timeout_s)
        if why is None:
            return True
        self.state.excused(why)
        self.ctx.telemetry.decide(call, "shadow", "unjudged", why, treatment=True)
        return False

    def _unjudged(self, reason: str) -> None:
        self.m_unjudged.labels(self.ctx.route, self.cfg.canary, reason).inc()

    def _selected(self, call: Call) -> bool:
        if not headers_match(self.cfg.headers, call.headers):
            return False
        if self.cfg.percent >= 100:
            return True
        shares = self.ctx.share_hash
        return shares.in_share(f"shadow:{self.ctx.route}", shares.request_key(call),
                               self.cfg.percent / 100)

    async def _tee(self, items: AsyncIterator[Any], copy: Call, latency: float, noise: bool,
                   resend: Next, call: Call, cause: SpanContext | None) -> AsyncIterator[Any]:
        """Pass the stream through untouched; after its end, queue the assembled text."""
        pieces: list[str] = []
        failed: LocalReply | None = None
        async for item in items:
            if isinstance(item, SseEvent):
                pieces.extend(stream_text(item))
            elif isinstance(item, LocalReply):
                failed = item
            yield item
        primary: Reply = failed if failed is not None else Result(call.model)
        if self._admitted(call, primary):
            self._enqueue(call, Copy(copy, primary, latency, "".join(pieces), noise, resend,
                                      cause=cause))

    def _enqueue(self, call: Call, item: Copy) -> None:
        st = self.state
        faults: list[str] = call.state.get(FAULTS) or []  # a copy a fault touched is not judged
        item.primary_faults = tuple(faults)
        self._ensure_workers()
        assert self.queue is not None
        size = item.held_bytes()
        try:
            if self.queue.full() or not self.held.take(size, self.cfg.queue_max_bytes):
                raise asyncio.QueueFull
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            st.counted(dropped=1)
            self.m_dropped.labels(self.ctx.route, self.cfg.canary, "queue-full").inc()
            why = f"queue full ({self.queue.qsize()} copies, {self.held.total} bytes waiting)"
            self.ctx.telemetry.decide(call, "shadow", "dropped", why, treatment=True)
            return
        item.held = size  # mirrored once sent (``_compare``): a replay is not
        self.ctx.telemetry.decide(call, "shadow", "queued", f"to '{self.cfg.canary}'",
                                  treatment=True)

    def _ensure_workers(self) -> None:
        if self.queue is None:
            self.queue = asyncio.Queue(self.cfg.queue_size)
        if not self.workers or self.workers[0].done():
            # none yet, or cancelled by a reload that then failed: this filter still serves.
            # An empty context: the workers belong to no request (each copy its own trace).
            self.workers = [asyncio.create_task(self._work(), name=f"shadow {self.ctx.route}",
                                                context=contextvars.Context())
                            for _ in range(self.cfg.workers)]

    # --- off the request path -----------------------------------------------------------------

    async def _work(self) -> None:
        """One lane: a copy at a time, unless a fault makes the copy wait (``OFF_LANE``): then
        the copy waits on its own (at most ``queue_size`` of them) and the lane goes on."""
        assert self.queue is not None
        loop = asyncio.get_running_loop()
        while True:
            item = await self.queue.get()
            try:
                freed: asyncio.Future[None] = loop.create_future()

                def leave(freed: asyncio.Future[None] = freed) -> None:
                    if not freed.done():
                        freed.set_result(None)

                task = asyncio.create_task(self._compare_logged(item, leave))
                task.add_done_callback(freeing(leave))
                task.add_done_callback(self.held.freer(item.held))
                try:
                    await freed
                except asyncio.CancelledError:
                    task.cancel()  # the lane ends (reload, shutdown): so does its copy
                    raise
                if task.done():
                    continue
                if len(self.waiting) >= self.cfg.queue_size:  # never judged: never waited for
                    task.cancel()
                    self.m_dropped.labels(self.ctx.route, self.cfg.canary, "fault-backlog").inc()
                    continue
                self.waiting.add(task)
                task.add_done_callback(self.waiting.discard)
            finally:
                self.queue.task_done()

    async def _compare_logged(self, item: Copy, leave: Callable[[], None]) -> None:
        try:
            with linked_span(f"shadow copy {self.ctx.route} -> {self.cfg.canary}",
                             item.cause, **{"mmguard.route": self.ctx.route}):
                await self._compare(item, leave)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken comparison must not stop the mirroring
            log.exception("shadow comparison on route %r failed: %s", self.ctx.route, exc)

    async def _send(self, item: Copy, route: str | None,
                    leave: Callable[[], None]) -> Sent:
        call = fresh(item.call, self.cfg.timeout_s)
        call.state[OFF_LANE] = leave
        start = time.monotonic()
        if route is None:  # noise floor: the primary again, through the rest of its chain
            reply = await item.resend(call)
        else:
            assert self.ctx.reroute is not None
            reply = await self.ctx.reroute(route, call)
        text: str | None = None
        if isinstance(reply, Result) and reply.stream is not None:
            pieces: list[str] = []
            async for piece in reply.stream:
                if isinstance(piece, SseEvent):
                    pieces.extend(stream_text(piece))
                elif isinstance(piece, LocalReply):
                    reply = piece
                    break
            text = "".join(pieces)
        faults: list[str] = call.state.get(FAULTS) or []
        return Sent(reply, time.monotonic() - start, text, list(faults), call.state.get(BACKEND_S))

    async def _compare(self, item: Copy, leave: Callable[[], None]) -> None:
        st = self.state
        key = await content_key_of(item.call, self.ctx.share_hash.secret)  # a replay: nothing
        if not st.admit(key):
            return
        st.counted(mirrored=1)
        self.m_mirrored.labels(self.ctx.route, self.cfg.canary).inc()
        sent = await self._send(item, self.cfg.canary, leave)
        reply, text, faults = sent.reply, sent.text, sent.faults
        if shed_here(reply):  # load on the canary's route, not what the canary answers
            st.excused("canary-overload")
            return
        c = self._judge(item.primary, item.primary_text, reply, text)
        self.m_compared.labels(self.ctx.route, self.cfg.canary, str(c.agree).lower()).inc()
        if not c.agree:
            # per call: DEBUG (the admin API keeps the last disagreements, the counter all)
            log.debug("canary %r disagrees with %r: %s", self.cfg.canary, self.ctx.route,
                      c.reason, extra={"fields": {"model": self.ctx.route,
                                                  "canary": self.cfg.canary,
                                                  "reason": c.reason}})
        st.judged(c, *paired_latency(item, sent), [*item.primary_faults, *faults], key)
        experiments = self.ctx.state.get(EXPERIMENTS)
        if experiments is not None:
            for route in {self.ctx.route, self.cfg.canary}:
                experiments.observe_divergence(route, c.agree)
        if item.noise:  # a fault on either copy: counted, not judged (it is not the floor)
            again = await self._send(item, None, leave)
            st.noise(self._judge(item.primary, item.primary_text, again.reply, again.text),
                     [*item.primary_faults, *again.faults])
        await self._measure_robustness(item, None if faults else (reply, text))  # chaos

    async def _measure_robustness(self, item: Copy,
                                  canary: tuple[Reply, str | None] | None) -> None:
        """The same seeded perturbations for both sides (filters/robustness)."""
        if self.robustness is None or self.robustness_metrics is None or item.primary_faults:
            return
        shares = self.ctx.share_hash
        key = shares.request_key(item.call)
        pct = self.robustness.cfg.percent / 100
        if not self.robustness.draw(shares.in_share(f"robustness:{self.ctx.route}", key, pct)):
            self._hand_over_robustness()
            return
        assert self.ctx.reroute is not None
        reroute, canary_route = self.ctx.reroute, self.cfg.canary
        base = Baselines(item.primary, item.primary_text, *(canary or (None, None)))
        await self.robustness.run(item.call, key, base, item.resend,
                                  lambda call: reroute(canary_route, call), self._judge)
        self._hand_over_robustness()

    def _hand_over_robustness(self) -> None:
        """The scratch table's pairs and counts, into the state's one table."""
        assert self.robustness is not None and self.robustness_metrics is not None
        scratch = self.robustness.table
        pairs = [(label, pair) for label, found in scratch.pairs.items() for pair in found]
        counts = {k: n for k, n in scratch.counts.items() if n}
        scratch.reset()
        if pairs or counts:
            self.state.robust(pairs, counts)

    def _judge(self, primary: Reply, primary_text: str | None, canary: Reply,
               canary_text: str | None) -> Comparison:
        if isinstance(primary, LocalReply) or isinstance(canary, LocalReply):
            return compare_status(not isinstance(primary, LocalReply), code(primary),
                                  not isinstance(canary, LocalReply), code(canary))
        if primary_text is not None or canary_text is not None:
            return compare_text(primary_text or "", canary_text or "", self.cfg.compare)
        a, b = openai_text(primary), openai_text(canary)
        if a is not None or b is not None:
            return compare_text(a or "", b or "", self.cfg.compare)
        return compare_tensors(arrays(primary), arrays(canary), self.cfg.compare)

    def _publish(self) -> None:
        """After an outcome: the counters now; the gauges read from the whole verdict at most
        every ``GAUGES_EVERY_S``, and once more after the last outcome. The verdict's snapshot
        (every figure with its bounds) runs in the event loop that also times the backends'
        answers: rebuilt after every pair, it held that loop for ~10 ms a pair beside a
        robustness block, and the answers that waited behind it read as backend latency
        (docs/canary.md). A state change is set at once (``_changed``)."""
        table = self.state.verdict.robustness
        if self.robustness_metrics is not None and table is not None:
            self.robustness_metrics.count(table)
        if self._gauges_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test's direct call): now
            self._publish_gauges()
            return
        self._gauges_due = True
        loop.call_later(max(0.0, self._gauges_at + GAUGES_EVERY_S - loop.time()),
                        self._publish_gauges)

    def _publish_gauges(self) -> None:
        self._gauges_due = False
        try:
            self._gauges_at = asyncio.get_running_loop().time()
        except RuntimeError:
            pass
        snap = self.state.verdict.snapshot()
        labels = (self.ctx.route, self.cfg.canary)
        agreement = snap.get("effective_agreement")
        if agreement is not None:
            self.m_agreement.labels(*labels).set(agreement)
        self.m_verdict.labels(*labels).set(_STATES[snap["state"]])
        self.m_verdict_status.set(labels, snap["state"])
        for test, figs in (snap.get("evidence") or {}).items():
            if isinstance(figs, dict) and "samples" in figs:
                for figure in ("estimate", "lower", "upper", "samples"):
                    if figs.get(figure) is not None:
                        self.m_evidence.labels(*labels, test, figure).set(figs[figure])
        table = self.state.verdict.robustness
        if self.robustness_metrics is not None and table is not None:
            self.robustness_metrics.publish(table)

    def _changed(self, old: str, new: str, reasons: list[str]) -> None:
        st = self.state
        why = "; ".join(reasons)
        log.warning("canary verdict for %r vs %r: %s -> %s%s", self.cfg.canary, self.ctx.route,
                    old, new, f" ({why})" if why else "",
                    extra={"fields": {"model": self.ctx.route, "canary": self.cfg.canary,
                                      "verdict": new, "reasons": reasons}})
        self.m_verdict.labels(self.ctx.route, self.cfg.canary).set(_STATES[new])
        self.m_verdict_status.set((self.ctx.route, self.cfg.canary), new)
        if new != "abort":
            return
        if self.cfg.on_abort.stop_mirroring:
            st.mirroring = False
            st.stop_reason = f"abort verdict: {why}"
        experiments = self.ctx.state.get(EXPERIMENTS)
        if self.cfg.on_abort.stop_experiments and experiments is not None:
            for route in {self.ctx.route, self.cfg.canary}:
                for exp in experiments.running(route):
                    experiments.stop(exp.name, f"canary abort verdict on '{self.ctx.route}': "
                                     f"{why}", "canary-abort")

    # --- admin --------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        st = self.state
        return {"canary": self.cfg.canary, "mirroring": st.mirroring,
                "stop_reason": st.stop_reason, "mirrored": st.mirrored, "dropped": st.dropped,
                "compared": st.compared, "queued": self.queue.qsize() if self.queue else 0,
                "population": self.population,
                "unjudged": dict(st.unjudged), "held_bytes": self.held.total,
                "waiting": len(self.waiting),
                **st.verdict.snapshot()}

    def reset(self) -> None:
        """Start judging again from nothing, and mirror again (an operator's decision)."""
        self.state.reset()

    def cancel(self) -> None:
        for task in [*self.workers, *self.waiting]:
            task.cancel()

    async def close(self) -> None:
        self.cancel()
        await asyncio.gather(*self.workers, *self.waiting, return_exceptions=True)
        self.workers = []
        self.waiting.clear()


class ShadowFactory(FilterFactoryBase):
    name = "shadow"
    config_model = ShadowConfig
    admin_routes = shadow_routes(lambda local: local.get(SHADOWS))

    async def summary(self, req: AdminRequest) -> Summary:
        found: dict[str, Shadow] = req.local.get(SHADOWS) or {}
        return verdicts_summary(found)

    async def after_drain(self, state: Store) -> None:
        """Copies still queued for the canary are dropped."""
        for shadow in (state.get(LIVE_SHADOWS) or {}).values():
            await shadow.close()

    def build(self, config: ShadowConfig, ctx: FilterContext) -> Shadow:
        return Shadow(config, ctx)
