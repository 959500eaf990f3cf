"""Robustness experiments: the same seeded perturbation on a copy for production and one for the
canary, each side judged against its own clean answer.

Answers the second of the canary's two questions (DESIGN.md, "Canary: two questions, never
mixed"): not "does the canary answer like production?" (correctness, clean copies only) but "does
the canary hold up under noise, masking, dropout, a missing modality, low light or precision loss
as well as production does?". Rules that MUST hold:

- Perturbed copies never reach a client: they are sent off the request path, by the ``shadow``
  filter's workers, after the client has its answer.
- Both sides get the SAME perturbation (one seed from the experiment's seed, the perturbation's
  name and the request key), so a difference in robustness is the models', not the noise's.
- Perturbed copies are not canary traffic: fault experiments never touch them (a fault on top of
  the perturbation would measure the fault, not the model).
- Production's extra calls are counted and capped (``max_qps``, the seeds' blast radius of
  ≤ 10 QPS): a copy that would exceed the cap is not perturbed, and that is counted too.

No verdict here: ``RobustnessTable`` keeps the paired samples, their figures and anytime-valid
tests (``filters.robustness.stats``); ``filters.robustness.verdict.ReleaseVerdict`` decides.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from filters.compare import (
    CompareConfig,
    Comparison,
    compare_status,
    compare_tensors,
    compare_text,
    openai_text,
)
from filters.robustness.config import RobustnessConfig
from filters.robustness.perturb import clean_copy, perturbed_copy, seed_for
from filters.robustness.stats import (
    difference_interval,
    paired_difference_bounds,
    share_bounds,
    wilson,
)
from proxy.call import Call, LocalReply, Reply, Result, SseEvent


@dataclass(frozen=True, slots=True)
class Pair:
    """One drawn copy under one perturbation: did each side keep its clean answer?"""

    production: bool
    canary: bool
    production_metrics: dict[str, float]
    canary_metrics: dict[str, float]


class RobustnessTable:
    """Paired samples per perturbation (the last ``window`` for the figures, counts since the
    last reset for the tests) and the anytime-valid tests the verdict decides on."""

    def __init__(self, cfg: RobustnessConfig) -> None:
        self.cfg = cfg
        self.pairs: dict[str, deque[Pair]] = {p.label: deque(maxlen=cfg.window)
                                              for p in cfg.perturbations}
        self.totals: dict[str, list[int]] = {p.label: [0, 0, 0, 0, 0] for p in cfg.perturbations}
        """label → [pairs, production kept, canary kept, production only, canary only]."""
        self.counts: dict[str, int] = {"drawn": 0, "production_calls": 0, "canary_calls": 0,
                                       "skipped_cap": 0, "skipped_baseline": 0,
                                       "not_applicable": 0}
        self.levels = (0.01, 0.05)
        """(false abort, false promote) per perturbation: set by the verdict."""

    def add(self, label: str, pair: Pair) -> None:
        self.pairs[label].append(pair)
        t = self.totals[label]
        t[0] += 1
        t[1] += pair.production
        t[2] += pair.canary
        t[3] += pair.production and not pair.canary
        t[4] += pair.canary and not pair.production

    def reset(self) -> None:
        for pairs in self.pairs.values():
            pairs.clear()
        for t in self.totals.values():
            t[:] = [0, 0, 0, 0, 0]
        for key in self.counts:
            self.counts[key] = 0

    def row(self, label: str, metrics: bool = True) -> dict[str, Any]:
        """``metrics``: the sides' mean metrics over the window, for the report; the verdict's
        checks after every pair do without them (a pass over the window each time, in the
        event loop that also times the backends' answers)."""
        n, kp, kc, p_only, c_only = self.totals[label]
        alpha, beta = self.levels
        out: dict[str, Any] = {"perturbation": label, "samples": n,
                               "production": {"kept": kp}, "canary": {"kept": kc}}
        for side, kept in (("production", kp), ("canary", kc)):
            out[side] |= {"robustness": kept / n if n else None,
                          "bounds": list(share_bounds(kept, n, alpha)),
                          "ci95": list(wilson(kept, n))}
            if metrics:
                out[side]["metrics"] = _means([getattr(p, f"{side}_metrics")
                                               for p in self.pairs[label]])
        lo, hi = paired_difference_bounds(n, p_only, c_only, beta, alpha)
        out |= {"difference": (kc - kp) / n if n else None, "difference_bounds": [lo, hi],
                "difference_ci95": list(difference_interval((kc, n), (kp, n))) if n else None,
                "production_only": p_only, "canary_only": c_only,
                "test": "paired anytime-valid bounds (production only vs canary only)",
                "alpha": alpha, "beta": beta,
                "verdict": ("not judged yet" if n < self.cfg.min_samples else
                            "fails" if hi < -self.cfg.max_drop else
                            "passes" if lo >= -self.cfg.max_drop else "undecided")}
        return out

    def failures(self) -> list[str]:
        """Why the canary is shown less robust than production by more than the margin: the
        upper bound of the difference below ``-max_drop`` (false-abort rate ``levels[0]``)."""
        out = []
        for label in self.pairs:
            row = self.row(label, metrics=False)
            if row["verdict"] != "fails":
                continue
            p, c = row["production"], row["canary"]
            lo, hi = row["difference_bounds"]
            out.append(
                f"robustness under '{label}': canary keeps {c['robustness']:.1%} of its "
                f"clean answers, production {p['robustness']:.1%} over {row['samples']} "
                f"pairs: {row['difference'] * 100:+.1f} points (anytime bounds {lo * 100:+.1f} "
                f"to {hi * 100:+.1f}, false-abort rate {row['alpha']:.2g}), below the margin "
                f"of -{self.cfg.max_drop * 100:.1f}")
        return out

    def passes(self) -> list[str]:
        """The promote evidence per perturbation (all of them pass) or [] (one does not yet)."""
        rows = [self.row(label, metrics=False) for label in self.pairs]
        if any(r["verdict"] != "passes" for r in rows):
            return []
        return [f"robustness under '{r['perturbation']}': difference ≥ "
                f"{r['difference_bounds'][0] * 100:+.1f} points over {r['samples']} pairs "
                f"(anytime lower bound, false-promote rate {r['beta']:.2g}) ≥ "
                f"-{self.cfg.max_drop * 100:.1f}" for r in rows]

    def pending(self) -> list[str]:
        """Perturbations not shown within the margin yet, with their figures."""
        out = []
        for label in self.pairs:
            row = self.row(label, metrics=False)
            if row["verdict"] == "not judged yet":
                out.append(f"robustness under '{label}': {row['samples']} of "
                           f"{self.cfg.min_samples} pairs")
            elif row["verdict"] == "undecided":
                lo, hi = row["difference_bounds"]
                out.append(f"robustness under '{label}': difference bounds {lo * 100:+.1f} to "
                           f"{hi * 100:+.1f} points over {row['samples']} pairs; promote needs "
                           f"the lower ≥ -{self.cfg.max_drop * 100:.1f}, abort the upper below")
        return out

    def snapshot(self) -> dict[str, Any]:
        return {"rows": [self.row(label) for label in self.pairs],
                "counts": dict(self.counts),
                "config": {"max_drop": self.cfg.max_drop, "min_samples": self.cfg.min_samples,
                           "max_qps": self.cfg.max_qps, "percent": self.cfg.percent,
                           "seed": self.cfg.seed}}


def _means(metrics: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({k for m in metrics for k in m})
    out = {}
    for k in names:
        values = [m[k] for m in metrics if k in m and math.isfinite(m[k])]
        if values:
            out[k] = float(np.mean(values))
    return out


# --- the rate cap ------------------------------------------------------------------------------


class TokenBucket:
    """``rate`` tokens a second, at most ``rate`` (one second's worth) saved up."""

    def __init__(self, rate: float, now: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.now = rate, now
        self.tokens, self.at = rate, now()

    def take(self, n: float) -> bool:
        t = self.now()
        self.tokens = min(self.rate, self.tokens + (t - self.at) * self.rate)
        self.at = t
        if self.tokens + 1e-9 < n:
            return False
        self.tokens -= n
        return True


# --- one drawn copy ----------------------------------------------------------------------------

Send = Callable[[Call], Awaitable[Reply]]
Judge = Callable[[Reply, "str | None", Reply, "str | None"], Any]
"""The shadow's comparison: (clean, clean text, perturbed, perturbed text) → Comparison."""


def kept(clean: Reply, clean_text: str | None, perturbed: Reply, perturbed_text: str | None,
         cfg: CompareConfig) -> Comparison:
    """Did the perturbed answer keep the clean one: the same outcome (status), then the text
    (token F1 / normalised / exact) or the tensors (cosine, top-1, NaN where it was finite)."""
    if isinstance(clean, LocalReply) or isinstance(perturbed, LocalReply):
        return compare_status(not isinstance(clean, LocalReply), _code(clean),
                              not isinstance(perturbed, LocalReply), _code(perturbed))
    a = clean_text if clean_text is not None else openai_text(clean)
    b = perturbed_text if perturbed_text is not None else openai_text(perturbed)
    if a is not None or b is not None:
        return compare_text(a or "", b or "", cfg)
    return compare_tensors({t.name: np.asarray(t.numpy()) for t in clean.outputs},
                           {t.name: np.asarray(t.numpy()) for t in perturbed.outputs}, cfg)


def _code(reply: Reply) -> str:
    return "ok" if isinstance(reply, Result) else reply.kind.value


async def answer(send: Send, call: Call) -> tuple[Reply, str | None]:
    """Send ``call``; a stream is read to its end and its text assembled."""
    reply = await send(call)
    if not isinstance(reply, Result) or reply.stream is None:
        return reply, None
    pieces: list[str] = []
    async for item in reply.stream:
        if isinstance(item, SseEvent):
            pieces.extend(_stream_text(item))
        elif isinstance(item, LocalReply):
            return item, None
    return reply, "".join(pieces)


def _stream_text(event: SseEvent) -> list[str]:
    doc = event.json()
    out: list[str] = []
    for choice in (doc or {}).get("choices") or []:
        if isinstance(choice, dict):
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(text, str):
                out.append(text)
    return out


@dataclass
class Baselines:
    """The clean answers each side's perturbed answers are judged against."""

    production: Reply
    production_text: str | None
    canary: Reply | None
    """None: the mirrored copy was touched by a fault (a clean one is sent first)."""
    canary_text: str | None


class RobustnessExperiment:
    """Draws copies (share, rate cap), perturbs them for both sides and fills the table."""

    def __init__(self, cfg: RobustnessConfig, table: RobustnessTable, timeout_s: float,
                 now: Callable[[], float] = time.monotonic, workers: int = 1) -> None:
        self.cfg, self.table, self.timeout_s = cfg, table, timeout_s
        self.bucket = TokenBucket(cfg.max_qps / workers, now)
        """A pod's workers each take their part of the cap: production sees ``max_qps``."""

    def draw(self, in_share: bool) -> bool:
        """Whether this copy is measured: in the share and within production's cap."""
        if not in_share:
            return False
        if not self.bucket.take(len(self.cfg.perturbations)):
            self.table.counts["skipped_cap"] += 1
            return False
        self.table.counts["drawn"] += 1
        return True

    async def run(self, original: Call, key: str, base: Baselines, production: Send,
                  canary: Send, judge: Judge) -> list[str]:
        """``judge`` is the shadow's comparison; ``cfg.compare``, when set, replaces it."""
        if self.cfg.compare is not None:
            loose = self.cfg.compare

            def judge(a: Reply, at: str | None, b: Reply, bt: str | None) -> Comparison:
                return kept(a, at, b, bt, loose)

        """Measure every perturbation on this copy; returns the labels measured."""
        counts = self.table.counts
        if isinstance(base.production, LocalReply):
            counts["skipped_baseline"] += 1  # nothing clean to hold production to
            return []
        if base.canary is None:
            base.canary, base.canary_text = await answer(canary,
                                                         clean_copy(original, self.timeout_s))
            counts["canary_calls"] += 1
        measured = []
        for p in self.cfg.perturbations:
            seed = seed_for(self.cfg.seed, p.label, key)
            for_production = perturbed_copy(original, p, seed, self.timeout_s)
            for_canary = perturbed_copy(original, p, seed, self.timeout_s)
            if for_production is None or for_canary is None:
                counts["not_applicable"] += 1
                continue
            counts["production_calls"] += 1
            counts["canary_calls"] += 1
            (pr, pt), (cr, ct) = await asyncio.gather(answer(production, for_production),
                                                      answer(canary, for_canary))
            kept_p = judge(base.production, base.production_text, pr, pt)
            kept_c = judge(base.canary, base.canary_text, cr, ct)
            self.table.add(p.label, Pair(kept_p.agree, kept_c.agree, dict(kept_p.metrics),
                                         dict(kept_c.metrics)))
            measured.append(p.label)
        return measured


class RobustnessMetrics:
    """``mmguard_robustness{model,canary,perturbation,side}`` (the share of clean answers kept)
    and ``mmguard_robustness_calls_total{model,canary,side}`` (the extra backend calls)."""

    def __init__(self, telemetry: Any, route: str, canary: str, cfg: RobustnessConfig) -> None:
        from prometheus_client import Counter, Gauge
        self.route, self.canary = route, canary
        self.kept = telemetry.metric(Gauge, "mmguard_robustness",
                                     "Share of a side's clean answers kept under a perturbation "
                                     "(robustness experiment).",
                                     ["model", "canary", "perturbation", "side"])
        self.calls = telemetry.metric(Counter, "mmguard_robustness_calls_total",
                                      "Extra backend calls made by robustness experiments.",
                                      ["model", "canary", "side"])
        self.skipped = telemetry.metric(Counter, "mmguard_robustness_skipped_total",
                                        "Mirrored copies a robustness experiment did not measure.",
                                        ["model", "canary", "reason"])
        for side in ("production", "canary"):
            self.calls.labels(route, canary, side)
        for reason in ("cap", "baseline"):
            self.skipped.labels(route, canary, reason)
        self.seen = {"production_calls": 0, "canary_calls": 0, "skipped_cap": 0,
                     "skipped_baseline": 0}

    def count(self, table: RobustnessTable) -> None:
        """The extra calls and the skipped copies, since the last count."""
        for key, side in (("production_calls", "production"), ("canary_calls", "canary")):
            self.calls.labels(self.route, self.canary, side).inc(
                max(0, table.counts[key] - self.seen[key]))  # after a reset: from 0 again
        for key, reason in (("skipped_cap", "cap"), ("skipped_baseline", "baseline")):
            self.skipped.labels(self.route, self.canary, reason).inc(
                max(0, table.counts[key] - self.seen[key]))
        self.seen = {k: table.counts[k] for k in self.seen}

    def publish(self, table: RobustnessTable) -> None:
        """The counters, and each side's share kept per perturbation."""
        self.count(table)
        for label in table.pairs:
            row = table.row(label, metrics=False)
            for side in ("production", "canary"):
                value = row[side]["robustness"]
                if value is not None:
                    self.kept.labels(self.route, self.canary, label, side).set(value)
