"""The release verdict's error rates, simulated: known answers through the real ``Verdict``.

Seeded streams of comparisons (agreement, primary and canary latency, the noise floor's
self-comparisons) for A/A pairs (the canary meets its SLO: any abort is false) and A/B pairs
(it misses: any promote is false), each consulted after every sample as the shadow filter does.
Beside it, on the same streams, two reference judges written here:

- Flagger-style: intervals of 50 comparisons; an interval passes when its agreement is at least
  the promote bar and its p99 latency ratio at most 1.5; 5 failed intervals roll back, 10
  passed ones promote.
- Kayenta-style: intervals of 50; per interval a one-sided Mann-Whitney test of canary vs
  production latency (p < 0.05 with a median 10 % higher fails it) and the interval's
  agreement against the bar; the score after ``--kayenta-intervals`` intervals is the share of
  passed metric checks: ≥ 95 % promotes, < 75 % aborts, otherwise one more analysis.

Reported per scenario: false-abort rate (A/A) or false-promote rate (A/B) with its 95 %
Clopper-Pearson interval, the share of runs decided, and the median samples to the first
decision. Samples at equal error rates (fixed-sample judges sized to hold this verdict's
``alpha`` and ``beta``): ``python -m bench.verdict_matched``.

    python -m bench.verdict_sim [--runs 200] [--horizon 2500] [--seed 1] [--procs 2]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy import stats

from filters.compare import Comparison, Verdict, VerdictConfig
from proxy.clock import ManualClock

AGREE, DISAGREE = Comparison(True, {}), Comparison(False, {}, "simulated disagreement")
INTERVAL = 50


@dataclass(frozen=True)
class Latency:
    base_ms: float = 5.0
    sigma: float = 0.15
    """Log-normal spread of a call."""
    stall_p: float = 0.0
    """Share of calls that stall, +4 to 12 ms."""
    tail_p: float = 0.0
    """Share of calls with a Pareto(1.5) heavy tail on top."""
    factor: float = 1.0

    def draw(self, rng: np.random.Generator, n: int) -> NDArray[np.float64]:
        ms = self.base_ms * self.factor * rng.lognormal(0.0, self.sigma, n)
        if self.stall_p:
            ms += (rng.random(n) < self.stall_p) * rng.uniform(4, 12, n)
        if self.tail_p:
            ms += (rng.random(n) < self.tail_p) * self.base_ms * rng.pareto(1.5, n)
        return np.asarray(ms, dtype=np.float64)


@dataclass(frozen=True)
class Scenario:
    name: str
    good: bool
    """The canary meets its SLO (A/A, or within the margins): an abort is false."""
    agreement: float = 1.0
    """P(canary agrees with production) on a comparison."""
    self_agreement: float | None = None
    """P(production agrees with itself); None: deterministic, no noise floor."""
    primary: Latency = field(default_factory=Latency)
    canary: Latency = field(default_factory=Latency)


STALLS = Latency(stall_p=0.01)
HEAVY = Latency(tail_p=0.05)
SCENARIOS = (
    Scenario("A/A deterministic", True),
    Scenario("A/A stalls 1 % both sides", True, primary=STALLS, canary=STALLS),
    Scenario("A/A heavy tails", True, primary=HEAVY, canary=HEAVY),
    Scenario("A/A noise floor 90 %", True, agreement=0.9, self_agreement=0.9),
    Scenario("A/B latency +5 % (within margin)", True, canary=Latency(factor=1.05)),
    Scenario("A/B agreement 99 %", False, agreement=0.99),
    Scenario("A/B agreement 97 %", False, agreement=0.97),
    Scenario("A/B agreement 90 %", False, agreement=0.90),
    Scenario("A/B noise floor, effective 83 %", False, agreement=0.75, self_agreement=0.9),
    Scenario("A/B latency +30 %", False, canary=Latency(factor=1.3)),
    Scenario("A/B latency +30 %, stalls", False, primary=STALLS,
             canary=Latency(stall_p=0.01, factor=1.3)),
)


@dataclass
class Stream:
    agree: NDArray[np.bool_]
    primary_ms: NDArray[np.float64]
    canary_ms: NDArray[np.float64]
    noise: NDArray[np.bool_]
    """A self-comparison comes with this comparison."""
    self_agree: NDArray[np.bool_]


def stream(sc: Scenario, horizon: int, seed: int) -> Stream:
    rng = np.random.default_rng(seed)
    s = 1.0 if sc.self_agreement is None else sc.self_agreement
    noise = (rng.random(horizon) < 0.2) if sc.self_agreement is not None else \
        np.zeros(horizon, dtype=bool)
    return Stream(rng.random(horizon) < sc.agreement, sc.primary.draw(rng, horizon),
                  sc.canary.draw(rng, horizon), noise, rng.random(horizon) < s)


@dataclass(frozen=True)
class Outcome:
    promoted_at: int | None
    aborted_at: int | None


def run_verdict(sc: Scenario, st: Stream, cfg: VerdictConfig) -> Outcome:
    v = Verdict(cfg, ManualClock(), expect_noise=sc.self_agreement is not None)
    promoted: int | None = None
    for i in range(len(st.agree)):
        if st.noise[i]:
            v.add_noise(AGREE if st.self_agree[i] else DISAGREE)
        v.add(AGREE if st.agree[i] else DISAGREE, st.primary_ms[i] / 1000,
              st.canary_ms[i] / 1000)
        state = v.state()
        if state == "abort":
            return Outcome(promoted, i + 1)
        if state == "promote" and promoted is None:
            promoted = i + 1
            if not sc.good:
                return Outcome(promoted, None)  # a false promote: nothing more to learn
    return Outcome(promoted, None)


def run_flagger(st: Stream, bar: float) -> Outcome:
    failed = passed = 0
    for end in range(INTERVAL, len(st.agree) + 1, INTERVAL):
        sl = slice(end - INTERVAL, end)
        ok = bool(st.agree[sl].mean() >= bar and np.quantile(st.canary_ms[sl], 0.99)
                  <= 1.5 * np.quantile(st.primary_ms[sl], 0.99))
        failed, passed = failed + int(not ok), passed + int(ok)
        if failed >= 5:
            return Outcome(None, end)
        if passed >= 10:
            return Outcome(end, None)
    return Outcome(None, None)


def run_kayenta(st: Stream, bar: float, intervals: int) -> Outcome:
    scores: list[float] = []
    for end in range(INTERVAL, len(st.agree) + 1, INTERVAL):
        sl = slice(end - INTERVAL, end)
        c, p = st.canary_ms[sl], st.primary_ms[sl]
        high = (stats.mannwhitneyu(c, p, alternative="greater").pvalue < 0.05
                and np.median(c) > 1.1 * np.median(p))
        scores.append((int(not high) + int(st.agree[sl].mean() >= bar)) / 2)
        if len(scores) == intervals:
            score = float(np.mean(scores))
            if score >= 0.95:
                return Outcome(end, None)
            if score < 0.75:
                return Outcome(None, end)
            scores = []
    return Outcome(None, None)


Judge = Callable[[Scenario, Stream], Outcome]


def _chunk(args: tuple[int, int, int, int, int]) -> list[tuple[Outcome, Outcome, Outcome]]:
    index, first, count, horizon, kayenta = args
    sc, cfg = SCENARIOS[index], VerdictConfig()
    out = []
    for seed in range(first, first + count):
        st = stream(sc, horizon, seed)
        out.append((run_verdict(sc, st, cfg), run_flagger(st, cfg.promote_agreement),
                    run_kayenta(st, cfg.promote_agreement, kayenta)))
    return out


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    a = (1 - level) / 2
    lo = 0.0 if k == 0 else float(stats.beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1 - a, k + 1, n - k))
    return lo, hi


def summarise(sc: Scenario, outcomes: list[Outcome]) -> dict[str, Any]:
    n = len(outcomes)
    wrong = sum((o.aborted_at is not None) if sc.good else (o.promoted_at is not None)
                for o in outcomes)
    right = sum((o.promoted_at is not None) if sc.good else (o.aborted_at is not None)
                for o in outcomes)
    firsts = [min(x for x in (o.promoted_at, o.aborted_at) if x is not None)
              for o in outcomes if o.promoted_at is not None or o.aborted_at is not None]
    return {"runs": n, "error": wrong / n, "error_ci": clopper_pearson(wrong, n),
            "right": right / n, "decided": len(firsts) / n,
            "median_samples": float(np.median(firsts)) if firsts else math.nan,
            "p90_samples": float(np.percentile(firsts, 90)) if firsts else math.nan}


def simulate(runs: int, horizon: int, seed: int, procs: int, kayenta: int,
             only: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    todo = [i for i in range(len(SCENARIOS)) if not only or i in only]
    per = max(1, math.ceil(runs / (procs * 2)))
    jobs = [(i, seed * 1_000_003 + start, min(per, runs - start), horizon, kayenta)
            for i in todo for start in range(0, runs, per)]
    results: dict[int, list[tuple[Outcome, Outcome, Outcome]]] = {i: [] for i in todo}
    if procs > 1:
        with ProcessPoolExecutor(procs) as pool:
            for job, found in zip(jobs, pool.map(_chunk, jobs), strict=True):
                results[job[0]].extend(found)
    else:
        for job in jobs:
            results[job[0]].extend(_chunk(job))
    rows = []
    for i in todo:
        sc = SCENARIOS[i]
        triples = results[i]
        rows.append({"scenario": sc.name, "good": sc.good,
                     "mmguard": summarise(sc, [t[0] for t in triples]),
                     "flagger": summarise(sc, [t[1] for t in triples]),
                     "kayenta": summarise(sc, [t[2] for t in triples])})
    return rows


def _cell(s: dict[str, Any]) -> str:
    lo, hi = s["error_ci"]
    med = "-" if math.isnan(s["median_samples"]) else f"{s['median_samples']:.0f}"
    return f"{s['error']:.1%} [{lo:.1%}, {hi:.1%}] · {s['right']:.0%} · {med}"


def markdown(rows: list[dict[str, Any]], runs: int, horizon: int, kayenta: int) -> str:
    head = ("| scenario | wrong decision | mmguard | Flagger-style | "
            f"Kayenta-style ({kayenta}×{INTERVAL}) |\n|---|---|---|---|---|\n")
    body = "".join(f"| {r['scenario']} | {'abort' if r['good'] else 'promote'} | "
                   f"{_cell(r['mmguard'])} | {_cell(r['flagger'])} | {_cell(r['kayenta'])} |\n"
                   for r in rows)
    return (head + body + f"\nEach cell: wrong-decision rate [95 % Clopper-Pearson] · right "
            f"decision rate · median samples to the first decision; {runs} seeded runs of up "
            f"to {horizon} comparisons per scenario.\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--horizon", type=int, default=2500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--kayenta-intervals", type=int, default=4)
    ap.add_argument("--scenario", type=int, action="append", default=[],
                    help="index into SCENARIOS (repeatable); default: all")
    a = ap.parse_args()
    t0, c0 = time.monotonic(), time.process_time()
    rows = simulate(a.runs, a.horizon, a.seed, a.procs, a.kayenta_intervals, tuple(a.scenario))
    print(markdown(rows, a.runs, a.horizon, a.kayenta_intervals))
    print(f"wall {time.monotonic() - t0:.0f} s, parent CPU {time.process_time() - c0:.0f} s, "
          f"{a.procs} processes")


if __name__ == "__main__":
    main()
