"""A route's shadow state: the verdict and its evidence, decided once per pod
(``proxy.pod.state``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from filters.compare import Comparison
from filters.robustness.experiment import Pair
from filters.robustness.verdict import ReleaseVerdict
from filters.shadow.config import ShadowConfig
from filters.shadow.replay import RecentKeys
from proxy.pod.state import Shared, decided

KEYS_REMEMBERED = 10_000
"""Content keys remembered per route (twice: sent here, judged for the pod), ~1 MB each."""


@dataclass
class ShadowState(Shared):
    """What outlives a reload with the same config: the verdict and its evidence.

    In a pod of several workers (``proxy.pod.state``) it is decided by the supervisor: a worker
    sends the copies and compares the answers, and forwards each outcome (``judged``, ``noise``,
    ``robust``, ``counted``); the verdict, its abort and what the abort stops happen once, on
    every worker's comparisons, and come back to the replicas."""

    cfg: ShadowConfig
    verdict: ReleaseVerdict
    mirroring: bool = True
    stop_reason: str = ""
    mirrored: int = 0
    dropped: int = 0
    compared: int = 0
    unjudged: dict[str, int] = field(default_factory=dict)
    """Calls not judged, by reason (filters/shadow/replay.py): replays, and production
    failures the client caused."""
    generation: int = 0
    """Counts resets: a worker forgets the keys it sent when the supervisor's moves on."""
    published: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    """The serving filter's gauges, set where the verdict is decided (after every outcome)."""
    on_unjudged: Callable[[str], None] | None = field(default=None, compare=False, repr=False)
    """The serving filter's counter of unjudged calls, where they are decided."""
    _judged_keys: RecentKeys = field(init=False, compare=False, repr=False)
    _sent_keys: RecentKeys = field(init=False, compare=False, repr=False)

    _publish_due: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # At least the verdict's window: a key judged longer ago has left the window.
        keys = max(self.cfg.verdict.window, KEYS_REMEMBERED)
        self._judged_keys = RecentKeys(keys)  # decided: the pod's one record
        self._sent_keys = RecentKeys(keys)  # this process's: a replay is not even sent

    def admit(self, key: int) -> bool:
        """Whether a copy with this content key may go to the canary (this process has not sent
        one in this window); a replay is counted. ``judged`` decides again, for the pod."""
        if self._sent_keys.add(key):
            return True
        self.excused("replay")
        return False

    @decided
    def excused(self, reason: str) -> None:
        """A call not judged, and why (a replay, a failure the client caused)."""
        self.unjudged[reason] = self.unjudged.get(reason, 0) + 1
        if self.on_unjudged is not None:
            self.on_unjudged(reason)

    def _publish(self) -> None:
        """Once per loop turn however many outcomes came in it (a copy's comparison, its noise
        sample and its robustness pairs): the gauges read the whole verdict."""
        if self.published is None or self._publish_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test's direct call): now
            self.published()
            return
        self._publish_due = True
        loop.call_soon(self._published_now)

    def _published_now(self) -> None:
        self._publish_due = False
        if self.published is not None:
            self.published()

    @decided
    def counted(self, mirrored: int = 0, dropped: int = 0) -> None:
        self.mirrored += mirrored
        self.dropped += dropped

    @decided
    def judged(self, c: Comparison, primary_latency_s: float, latency_s: float | None,
               touched: list[str], key: int | None = None) -> None:
        """One canary comparison; a copy a fault touched on either side is counted, never
        judged; a request whose content ``key`` was judged in this window adds nothing."""
        if key is not None and not self._judged_keys.add(key):
            self.excused("replay")
            return
        self.compared += 1
        if touched:
            self.verdict.exclude(touched)
        else:
            self.verdict.add(c, primary_latency_s, latency_s)
        self._publish()

    @decided
    def noise(self, c: Comparison, touched: list[str] | None = None) -> None:
        """One noise-floor sample (production against itself); one a fault touched on either
        copy is counted, never judged: the floor would read the fault as production's noise."""
        if touched:
            self.verdict.exclude(touched)
        else:
            self.verdict.add_noise(c)
        self._publish()

    @decided
    def robust(self, pairs: list[tuple[str, Pair]], counts: dict[str, int]) -> None:
        """What one copy's robustness measurement found (filters/robustness)."""
        table = self.verdict.robustness
        if table is None:
            return
        for label, pair in pairs:
            if label in table.pairs:
                table.add(label, pair)
        for key, n in counts.items():
            table.counts[key] = table.counts.get(key, 0) + n
        if pairs:
            self.verdict.judge_robustness()
        self._publish()

    @decided
    def reset(self) -> None:
        """Start judging again from nothing, and mirror again (an operator's decision)."""
        self.verdict.reset()
        self._judged_keys.clear()
        self._sent_keys.clear()
        self.generation += 1
        self.mirroring = True
        self.stop_reason = ""
        self._publish()

    def export_state(self) -> dict[str, Any]:
        """What a worker reads: whether to mirror (an abort stops it). The verdict, its
        evidence and the counters stay with the supervisor, whose admin API shows them."""
        return {"mirroring": self.mirroring, "stop_reason": self.stop_reason,
                "generation": self.generation}

    def import_state(self, state: dict[str, Any]) -> None:
        self.mirroring, self.stop_reason = state["mirroring"], state["stop_reason"]
        if state["generation"] != self.generation:  # a reset: a new window, keys forgotten
            self.generation = state["generation"]
            self._sent_keys.clear()
