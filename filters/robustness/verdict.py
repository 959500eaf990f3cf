"""The release verdict: correctness on clean copies AND robustness side by side.

``filters.compare.Verdict`` judges agreement and latency over a window of comparisons. A copy
that a fault touched (on production's side or the canary's) says nothing about the canary's
correctness, nor its latency: ``ReleaseVerdict`` never feeds such a copy to that window, only
counts it (by ``<experiment>/<action>``), so an identical canary under a noise + delay
experiment is not convicted for mmguard's own faults. With a robustness experiment configured,
the verdict also needs the canary to be no less robust than production by more than the margin
on every perturbation measured:

- ``abort`` when, on some perturbation, the anytime upper bound of canary − production
  robustness (paired: copies kept by one side only) is below ``-max_drop``; each perturbation
  takes its share of ``alpha`` beside the correctness and latency tests;
- ``promote`` only when correctness and latency promote and every perturbation's lower bound is
  at or above ``-max_drop`` (false-promote rate ``beta`` each); until then ``hold``, naming what
  is still missing.
"""

from __future__ import annotations

from typing import Any

from filters.compare.verdict import Verdict, VerdictConfig
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

    def _abort_tests(self) -> int:
        table = self.robustness
        return super()._abort_tests() + (0 if table is None else len(table.pairs))

    def _sync_levels(self) -> None:
        if self.robustness is not None:
            lv = self.levels()
            self.robustness.levels = (lv.abort, lv.promote)

    def _aborts(self) -> list[str]:
        out = super()._aborts()
        if self.robustness is not None:
            self._sync_levels()
            out += self.robustness.failures()
        return out

    def _promotes(self) -> bool:
        if not super()._promotes():
            return False
        if self.robustness is None:
            return True
        self._sync_levels()
        return bool(self.robustness.passes())

    def _evidence(self) -> list[str]:
        out = super()._evidence()
        if self.robustness is not None:
            out += self.robustness.passes()
        return out

    def _missing(self) -> list[str]:
        out = super()._missing()
        if self.robustness is not None:
            self._sync_levels()
            out += self.robustness.pending()
        return out

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
            self._sync_levels()
            snap["robustness"] = self.robustness.snapshot()
        return snap
