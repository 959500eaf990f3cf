"""The release verdict: correctness on clean copies AND robustness side by side.

``filters.compare.Verdict`` judges agreement and latency over a window of comparisons. A copy
that a fault touched (on production's side or the canary's) says nothing about the canary's
correctness, nor its latency: ``ReleaseVerdict`` never feeds such a copy to that window, only
counts it (by ``<experiment>/<action>``), so an identical canary under a noise + delay
experiment is not convicted for mmguard's own faults. With a robustness experiment configured,
the verdict also needs the canary to be no less robust than production by more than the margin
on every perturbation measured:

- ``abort`` when a perturbation with ``min_samples`` pairs shows the canary below production by
  more than ``max_drop`` (the reason names the perturbation and the figures), or as the
  correctness verdict says;
- ``promote`` only when correctness promotes and every perturbation has been measured and
  passed; until then ``hold``, naming what is still missing.
"""

from __future__ import annotations

from typing import Any

from filters.compare.answers import State
from filters.compare.verdict import Verdict, VerdictConfig, _Figures
from filters.robustness.config import RobustnessConfig
from filters.robustness.experiment import RobustnessTable
from proxy.clock import Clock

_EXCLUDED_KEPT = 64  # distinct fault tags counted by name; more are counted as "other"


class ReleaseVerdict(Verdict):
    def __init__(self, cfg: VerdictConfig, clock: Clock, expect_noise: bool = False,
                 robustness: RobustnessConfig | None = None) -> None:
        self.robustness = RobustnessTable(robustness) if robustness is not None else None
        self.excluded = 0
        self.excluded_by: dict[str, int] = {}
        super().__init__(cfg, clock, expect_noise)

    def exclude(self, faults: list[str]) -> None:
        """A copy a fault touched: counted, never judged."""
        self.excluded += 1
        for tag in faults:
            key = tag if tag in self.excluded_by or len(self.excluded_by) < _EXCLUDED_KEPT \
                else "other"
            self.excluded_by[key] = self.excluded_by.get(key, 0) + 1

    def judge_robustness(self) -> None:
        """New robustness pairs are in: judge again."""
        self._judge()

    def _decide(self, f: _Figures) -> tuple[State, list[str]]:
        state, reasons = super()._decide(f)
        table = self.robustness
        if table is None or state == "collecting":
            return state, reasons
        failures = table.failures()
        if failures:
            return "abort", (reasons if state == "abort" else []) + failures
        if state == "promote":
            pending = table.pending()
            if pending:
                return "hold", [f"{p} (robustness not measured yet)" for p in pending]
        return state, reasons

    def reset(self) -> None:
        self.excluded = 0
        self.excluded_by.clear()
        if self.robustness is not None:
            self.robustness.reset()
        super().reset()

    def snapshot(self) -> dict[str, Any]:
        snap = super().snapshot()
        snap["correctness_basis"] = "clean copies only (a copy a fault touched is excluded)"
        snap["excluded"] = self.excluded
        snap["excluded_by"] = dict(self.excluded_by)
        if self.robustness is not None:
            snap["robustness"] = self.robustness.snapshot()
        return snap
