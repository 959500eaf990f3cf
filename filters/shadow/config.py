"""The shadow filter's config."""

from __future__ import annotations

from pydantic import Field

from filters.compare import (
    CompareConfig,
    VerdictConfig,
)
from filters.robustness.config import RobustnessConfig
from proxy.lifecycle import ConfigReferences
from proxy.strict import Strict


class OnAbort(Strict):
    stop_mirroring: bool = True
    stop_experiments: bool = True
    """Stop the fault experiments running on the primary and the canary routes."""


class ShadowConfig(Strict):
    canary: str
    """The route that serves the canary (its own filters run on the copies)."""
    percent: float = Field(100.0, ge=0, le=100)
    """Share of the route's calls mirrored (stable by request key)."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Only calls with these headers are mirrored (``"*"`` = any value)."""
    queue_size: int = Field(64, ge=1)
    """Copies waiting for the canary; a full queue drops new copies (counted)."""
    queue_max_bytes: int = Field(64 * 1024 * 1024, ge=1)
    """The bytes the copies not yet compared keep alive (each its request's inputs and
    production's answer), together; past it new copies are dropped as on a full queue."""
    workers: int = Field(2, ge=1, le=64)
    timeout_s: float = Field(10.0, gt=0)
    """Deadline of a copy on the canary."""
    noise_floor_percent: float = Field(0.0, ge=0, le=100)
    """Share of the mirrored calls also sent a second time to the primary."""
    compare: CompareConfig = CompareConfig()
    verdict: VerdictConfig = VerdictConfig()
    on_abort: OnAbort = OnAbort()
    robustness: RobustnessConfig | None = None
    """Perturbed copies of mirrored calls judged beside clean ones (filters/robustness/)."""

    def references(self) -> ConfigReferences:
        """The canary route (checked at load), internal unless it says otherwise: a client
        that could call it could load it, and its load would read as the canary's."""
        return ConfigReferences(routes=(("canary", self.canary),), internal=(self.canary,))
