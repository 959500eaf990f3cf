"""``output_drift``: the answers' confidence against a baseline (a robustness KPI).

Guards against the failure that returns 200: inputs look normal, the model answers, but it has
become less sure (a new model version, a pre-processing change upstream, inputs it was not
trained on). Seeds: output cross-entropy drift warning above 0.8, critical above 1.9, with a
healthy baseline of 0.25 ± 0.11.

For each configured output, every answer gives two values: its confidence in [0, 1] (read as
the ``modality_router`` reads it: max softmax, 1 − normalised entropy, a scalar in a range, or
vLLM's token logprobs) and its cross-entropy against its own top class, −log(confidence) in
nats — mmguard sees no labels, so this is the label-free stand-in for the seeds' figure. Their
distributions are compared with a baseline (the first ``baseline_size`` answers, or a baseline
file) exactly as ``quality`` compares input signals: the 1-Wasserstein distance and the KS
statistic over a sliding window, exported as ``mmguard_output_drift{model,output,signal}`` and
``mmguard_output_drift_ks``. Answers are only read, never changed.
"""

from __future__ import annotations

import asyncio
import logging
import math

from prometheus_client import CollectorRegistry
from pydantic import Field, model_validator

from filters.answer_reads import Confidence, answer_reads
from filters.call_keys import touched_by_fault
from filters.degradation import SimilarityAlarm, SimilarityAlarmConfig
from filters.quality.drift import DriftConfig, DriftGauges, DriftMonitor, drift_gauges
from proxy.call import Call, Reply, Result
from proxy.chain import FilterContext, Next
from proxy.lifecycle import FilterFactoryBase
from proxy.pod.state import share
from proxy.strict import Strict

log = logging.getLogger("mmguard.output_drift")


class OutputDriftConfig(Strict):
    outputs: dict[str, Confidence] = Field(default_factory=dict)
    """A name for each watched output → how its confidence is read (``kind``, ``output``,
    ``range``), as in the modality_router's paths."""
    drift: DriftConfig = DriftConfig()
    similarity_alarm: SimilarityAlarmConfig | None = None
    """The silent-degradation alarm (filters/degradation.py)."""

    @model_validator(mode="after")
    def _something(self) -> OutputDriftConfig:
        if not self.outputs and self.similarity_alarm is None:
            raise ValueError("output_drift needs 'outputs' to watch or a 'similarity_alarm'")
        return self


def output_gauges(registry: CollectorRegistry) -> DriftGauges:
    return drift_gauges(registry, "mmguard_output_drift",
                        "an output's recent confidence (or cross-entropy)",
                        ("model", "output", "signal"))


class OutputDrift:
    def __init__(self, cfg: OutputDriftConfig, ctx: FilterContext) -> None:
        self.cfg = cfg
        self.monitor = DriftMonitor(ctx.route, cfg.drift, output_gauges(ctx.telemetry.registry))
        monitor = self.monitor
        ctx.on_activate(lambda: share(monitor, f"drift/output/{ctx.route}"))
        self.alarm = (SimilarityAlarm(cfg.similarity_alarm, ctx)
                      if cfg.similarity_alarm is not None else None)

    async def __call__(self, call: Call, next: Next) -> Reply:
        if self.alarm is not None:  # the alarm may send the call elsewhere
            return await self.alarm.serve(call, next, self._watch)
        return await self._watch(call, next)

    async def _watch(self, call: Call, next: Next) -> Reply:
        reply = await next(call)
        if isinstance(reply, Result) and reply.stream is None and not touched_by_fault(call):
            values = []
            reads = answer_reads(call, reply)  # read once with the router's and fallback's
            for name, spec in self.cfg.outputs.items():
                c = reads.confidence(spec)
                if c is None:
                    continue
                values += [(name, "confidence", c),
                           (name, "cross_entropy", -math.log(max(c, 1e-12)))]
            monitor = self.monitor
            monitor.observe_all(values)
            if monitor.dirty and monitor.cfg.baseline_file is not None:
                monitor.dirty = False  # a baseline just completed: keep it across restarts
                try:
                    await asyncio.to_thread(monitor.save, monitor.snapshot())
                except OSError as exc:
                    log.warning("output_drift: cannot save the baseline to %s: %s",
                                monitor.cfg.baseline_file, exc)
        return reply


class OutputDriftFactory(FilterFactoryBase):
    name = "output_drift"
    config_model = OutputDriftConfig

    def build(self, config: OutputDriftConfig, ctx: FilterContext) -> OutputDrift:
        return OutputDrift(config, ctx)
